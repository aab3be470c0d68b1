//! CPU thread count: `--threads`, then `RAYON_NUM_THREADS`, then `OMP_NUM_THREADS`, then
//! the number of physical cores (hyper-threads only add contention to memory-bound kernels).

use anyhow::{bail, Context, Result};

fn from_env(var: &str) -> Result<Option<usize>> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => {
            let n: usize = v
                .trim()
                .parse()
                .with_context(|| format!("{var}={v:?} is not a thread count"))?;
            if n == 0 {
                bail!("{var}=0: give at least 1 thread");
            }
            Ok(Some(n))
        }
        _ => Ok(None),
    }
}

/// Configures the global rayon pool and returns the thread count chosen.
pub fn init(flag: Option<usize>) -> Result<usize> {
    let n = match flag {
        Some(0) => bail!("--threads 0: give at least 1 thread"),
        Some(n) => n,
        None => match from_env("RAYON_NUM_THREADS")? {
            Some(n) => n,
            None => from_env("OMP_NUM_THREADS")?.unwrap_or_else(num_cpus::get_physical),
        },
    };
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .context("configuring the CPU thread pool")?;
    Ok(n)
}
