//! The binary's end of the library's `tracing` events: each event's message alone on stderr,
//! one line each, so the lines scripts and tests look for (`[K3] …`, the start-up and
//! warning lines) keep their exact text. `K3_LOG`, else `RUST_LOG`, filters them.

use anyhow::{anyhow, bail, Result};
use std::fmt;
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// The filter when neither variable is set: every line k3 prints at `info` and above.
const DEFAULT_FILTER: &str = "info";

/// The variables read for the filter, the first one set wins.
const FILTER_VARS: [&str; 2] = ["K3_LOG", "RUST_LOG"];

/// Writes an event as its fields only (the message, bare), with no time, level or target.
struct MessageOnly;

impl<S, N> FormatEvent<S, N> for MessageOnly
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// The filter text and the variable it came from (`None`: the default).
fn filter_spec() -> Result<(Option<&'static str>, String)> {
    for var in FILTER_VARS {
        match std::env::var(var) {
            Ok(v) if !v.trim().is_empty() => return Ok((Some(var), v)),
            Ok(_) | Err(std::env::VarError::NotPresent) => {}
            Err(std::env::VarError::NotUnicode(_)) => bail!("{var}: not valid UTF-8"),
        }
    }
    Ok((None, DEFAULT_FILTER.to_string()))
}

/// Parses a filter (`warn`, `debug`, `k3::serve=debug,info`, …), naming its variable on error.
fn parse_filter(var: Option<&str>, spec: &str) -> Result<EnvFilter> {
    EnvFilter::builder().parse(spec).map_err(|e| {
        anyhow!(
            "{}: {spec:?} is not a log filter ({e}); use a level (error, warn, info, debug, \
             trace, off) or target=level pairs separated by commas",
            var.unwrap_or("log filter")
        )
    })
}

/// Installs the stderr subscriber; called once, before any subcommand runs.
pub(crate) fn init() -> Result<()> {
    let (var, spec) = filter_spec()?;
    let filter = parse_filter(var, &spec)?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .event_format(MessageOnly)
        .try_init()
        .map_err(|e| anyhow!("log output: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_filter_names_its_variable() {
        let err = parse_filter(Some("K3_LOG"), "k3=loud").unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.starts_with("K3_LOG: \"k3=loud\" is not a log filter"),
            "{text}"
        );
    }

    #[test]
    fn levels_and_targets_parse() {
        for spec in ["info", "warn", "debug", "off", "k3::serve=debug,info"] {
            assert!(parse_filter(Some("K3_LOG"), spec).is_ok(), "{spec}");
        }
    }
}
