//! `k3 inspect`: what a snapshot holds and what it lacks.

use anyhow::{bail, Result};
use clap::Args;
use std::path::PathBuf;

/// Flags of `k3 inspect`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Snapshot directory.
    pub model: PathBuf,
    /// Extra shard directories, ";" or "," separated, searched after the snapshot directory: a
    /// shard is read from the first directory that holds it (the snapshot, then these in order).
    #[arg(long, env = "K3_DIRS")]
    pub dirs: Option<String>,
}

/// Runs `k3 inspect`; exits non-zero when a tensor is missing or mis-shaped.
pub fn run(a: InspectArgs) -> Result<()> {
    let extra = a.dirs.as_deref().map(super::split_dirs).unwrap_or_default();
    let report = k3::checkpoint::inspect::inspect(&a.model, &extra)?;
    println!("{report}");
    if !report.is_ok() {
        bail!(
            "{}: the snapshot is incomplete or mis-shaped (see the list above)",
            a.model.display()
        );
    }
    Ok(())
}
