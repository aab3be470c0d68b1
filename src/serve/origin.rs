//! Who may drive the server from a browser: the `Host` a request names must be the address
//! the server listens on (or one `--allow-host` names), so a DNS-rebinding page cannot
//! reach a loopback server under its own name, and an `Origin` other than the server's own
//! (a cross-site page; browsers send one on every cross-origin request, preflighted or not)
//! is refused unless `--allow-origin` names it. A server bound to every address
//! (`0.0.0.0`, `::`) cannot know the names it is reached by and accepts any `Host`, but
//! still checks `Origin`.

use anyhow::{bail, Result};
use std::net::SocketAddr;

/// The longest piece of a client's header quoted back in an error.
const QUOTE_MAX: usize = 100;

/// Which `Host` and `Origin` headers the server answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OriginPolicy {
    /// Accepted `Host` values, lower case: `name:port` compares whole, a bare `name` any
    /// port; None accepts any.
    hosts: Option<Vec<String>>,
    /// Cross-site origins allowed (lower case, no trailing `/`).
    origins: Vec<String>,
    /// `--allow-origin '*'`.
    any_origin: bool,
}

/// What a request that passes the policy gets besides its answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admit {
    /// No `Origin`, or the server's own: nothing to add.
    Plain,
    /// An allowed cross-site origin: its answer carries CORS headers naming it.
    Cors(String),
}

/// Why a request is refused (the message names the flag that would allow it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal(pub String);

/// `s` as quoted in an error: at most [`QUOTE_MAX`] characters, lossy UTF-8.
fn quote(s: &[u8]) -> String {
    let text = String::from_utf8_lossy(s);
    let mut out: String = text.chars().take(QUOTE_MAX).collect();
    if text.chars().nth(QUOTE_MAX).is_some() {
        out.push('…');
    }
    format!("{out:?}")
}

/// The name part of a `Host` value (`[::1]:8080` → `[::1]`, `localhost:80` → `localhost`).
fn host_name(host: &str) -> &str {
    if host.starts_with('[') {
        return match host.find(']') {
            Some(end) => &host[..=end],
            None => host,
        };
    }
    match host.rfind(':') {
        Some(at) => &host[..at],
        None => host,
    }
}

impl OriginPolicy {
    /// The policy of a server bound to `bound`, with the `--allow-host` and
    /// `--allow-origin` entries (each `*` or a value; a bad one is refused naming its flag).
    pub fn new(
        bound: SocketAddr,
        allow_hosts: &[String],
        allow_origins: &[String],
    ) -> Result<Self> {
        let mut hosts = Vec::new();
        let mut any_host = bound.ip().is_unspecified();
        let port = bound.port();
        if bound.ip().is_loopback() {
            for name in ["localhost", "127.0.0.1", "[::1]"] {
                hosts.push(format!("{name}:{port}"));
            }
        } else {
            hosts.push(bound.to_string());
        }
        if port == 80 {
            // Browsers leave out the default port.
            let bare: Vec<String> = hosts.iter().map(|h| host_name(h).to_string()).collect();
            hosts.extend(bare);
        }
        for h in allow_hosts {
            let h = h.trim();
            if h == "*" {
                any_host = true;
            } else if h.is_empty()
                || h.chars()
                    .any(|c| c.is_whitespace() || c.is_control() || "/?#@,".contains(c))
            {
                bail!(
                    "--allow-host / K3_ALLOW_HOST: {:?} is not a host name (give NAME, \
                     NAME:PORT or *)",
                    h
                );
            } else {
                hosts.push(h.to_ascii_lowercase());
            }
        }
        let mut origins = Vec::new();
        let mut any_origin = false;
        for o in allow_origins {
            let o = o.trim();
            if o == "*" {
                any_origin = true;
                continue;
            }
            let lower = o.trim_end_matches('/').to_ascii_lowercase();
            let rest = lower
                .strip_prefix("http://")
                .or_else(|| lower.strip_prefix("https://"));
            match rest {
                Some(r)
                    if !r.is_empty()
                        && !r.chars().any(|c| {
                            c.is_whitespace() || c.is_control() || "/?#@,".contains(c)
                        }) =>
                {
                    origins.push(lower)
                }
                _ => bail!(
                    "--allow-origin / K3_ALLOW_ORIGIN: {:?} is not an origin (give \
                     http://NAME[:PORT], https://NAME[:PORT] or *)",
                    o
                ),
            }
        }
        Ok(Self {
            hosts: (!any_host).then_some(hosts),
            origins,
            any_origin,
        })
    }

    /// Checks a request's `Host` and `Origin` headers (None when absent: a client that is
    /// not a browser may send neither).
    pub fn check(&self, host: Option<&[u8]>, origin: Option<&[u8]>) -> Result<Admit, Refusal> {
        let host_lower = host.map(|h| String::from_utf8_lossy(h).to_ascii_lowercase());
        if let (Some(allowed), Some(h)) = (&self.hosts, &host_lower) {
            let name = host_name(h);
            if !allowed.iter().any(|a| a == h || a == name) {
                return Err(Refusal(format!(
                    "Host {} is not an address this server listens on; to serve it under \
                     that name, start it with --allow-host NAME (K3_ALLOW_HOST)",
                    quote(host.unwrap_or_default())
                )));
            }
        }
        let Some(origin) = origin else {
            return Ok(Admit::Plain);
        };
        let o = String::from_utf8_lossy(origin).to_ascii_lowercase();
        if host_lower
            .as_deref()
            .is_some_and(|h| o.strip_prefix("http://") == Some(h))
        {
            return Ok(Admit::Plain);
        }
        if self.any_origin || self.origins.contains(&o) {
            return Ok(Admit::Cors(String::from_utf8_lossy(origin).into_owned()));
        }
        Err(Refusal(format!(
            "a request from the web page of origin {} is refused: only the server's own page \
             may call it from a browser; to allow that origin, start the server with \
             --allow-origin ORIGIN (K3_ALLOW_ORIGIN)",
            quote(origin)
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(bound: &str, hosts: &[&str], origins: &[&str]) -> OriginPolicy {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        OriginPolicy::new(bound.parse().unwrap(), &s(hosts), &s(origins)).unwrap()
    }

    #[test]
    fn loopback_accepts_its_own_names_and_refuses_others() {
        let p = policy("127.0.0.1:8080", &[], &[]);
        for h in [
            "localhost:8080",
            "127.0.0.1:8080",
            "[::1]:8080",
            "LOCALHOST:8080",
        ] {
            assert_eq!(p.check(Some(h.as_bytes()), None), Ok(Admit::Plain), "{h}");
        }
        for h in [
            "evil.example:8080",
            "localhost:8081",
            "localhost",
            "127.0.0.1",
        ] {
            let e = p.check(Some(h.as_bytes()), None).unwrap_err();
            assert!(e.0.contains("--allow-host"), "{h}: {e:?}");
        }
        assert_eq!(p.check(None, None), Ok(Admit::Plain));
    }

    #[test]
    fn same_origin_passes_and_cross_origin_is_refused_unless_allowed() {
        let p = policy("127.0.0.1:8080", &[], &[]);
        let host = Some(&b"localhost:8080"[..]);
        assert_eq!(
            p.check(host, Some(b"http://localhost:8080")),
            Ok(Admit::Plain)
        );
        for o in ["http://evil.example", "null", "https://localhost:8080"] {
            let e = p.check(host, Some(o.as_bytes())).unwrap_err();
            assert!(e.0.contains("--allow-origin"), "{o}: {e:?}");
        }
        let p = policy("127.0.0.1:8080", &[], &["https://App.example/"]);
        assert_eq!(
            p.check(host, Some(b"https://app.example")),
            Ok(Admit::Cors("https://app.example".into()))
        );
        assert!(p.check(host, Some(b"https://other.example")).is_err());
        let p = policy("127.0.0.1:8080", &[], &["*"]);
        assert!(matches!(
            p.check(host, Some(b"https://other.example")),
            Ok(Admit::Cors(_))
        ));
    }

    #[test]
    fn every_address_accepts_any_host_but_still_checks_origin() {
        let p = policy("0.0.0.0:8080", &[], &[]);
        assert_eq!(p.check(Some(b"box.lan:8080"), None), Ok(Admit::Plain));
        assert_eq!(
            p.check(Some(b"box.lan:8080"), Some(b"http://box.lan:8080")),
            Ok(Admit::Plain)
        );
        assert!(p
            .check(Some(b"box.lan:8080"), Some(b"http://evil.example"))
            .is_err());
    }

    #[test]
    fn allow_host_adds_names_and_star_allows_any() {
        let p = policy("127.0.0.1:8080", &["k3.local", "box:9000"], &[]);
        assert!(p.check(Some(b"k3.local:8080"), None).is_ok());
        assert!(p.check(Some(b"box:9000"), None).is_ok());
        assert!(p.check(Some(b"box:9001"), None).is_err());
        let p = policy("127.0.0.1:8080", &["*"], &[]);
        assert!(p.check(Some(b"anything:1"), None).is_ok());
    }

    #[test]
    fn bad_entries_are_refused_naming_their_flag() {
        let bound: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let e = OriginPolicy::new(bound, &["a b".into()], &[]).unwrap_err();
        assert!(e.to_string().contains("--allow-host"), "{e}");
        for o in ["evil.example", "http://", "http://a/b", "ftp://x"] {
            let e = OriginPolicy::new(bound, &[], &[o.into()]).unwrap_err();
            assert!(e.to_string().contains("--allow-origin"), "{o}: {e}");
        }
    }

    #[test]
    fn a_long_header_is_quoted_short() {
        let p = policy("127.0.0.1:8080", &[], &[]);
        let long = "x".repeat(100_000);
        let e = p.check(Some(long.as_bytes()), None).unwrap_err();
        assert!(e.0.len() < 600, "{}", e.0.len());
    }
}
