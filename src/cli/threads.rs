//! CPU set-up at start: the thread count (`--threads`, then `RAYON_NUM_THREADS`, then
//! `OMP_NUM_THREADS`, then the number of physical cores, since hyper-threads only add
//! contention to memory-bound kernels) and the SIMD level of the CPU kernels (`K3_SIMD`).

use anyhow::{bail, Context, Result};

/// More threads than this is a typo, not a machine.
const MAX_THREADS: usize = 1024;

/// Parses one thread-count source (`what` names it in errors). `OMP_NUM_THREADS` may be a
/// list of nesting levels; its first entry is the outer level's count.
fn parse(what: &str, v: &str) -> Result<usize> {
    let first = v.split(',').next().unwrap_or("").trim();
    let n: usize = first
        .parse()
        .with_context(|| format!("{what}={v:?} is not a thread count"))?;
    check(what, n)
}

fn check(what: &str, n: usize) -> Result<usize> {
    if n == 0 {
        bail!("{what}=0: give at least 1 thread");
    }
    if n > MAX_THREADS {
        bail!("{what}={n}: more than {MAX_THREADS} threads; give at most the machine's cores");
    }
    Ok(n)
}

/// The thread count from the flag and the two variables' values, in that order of
/// precedence; `default` when none is given.
fn resolve(
    flag: Option<usize>,
    rayon_env: Option<&str>,
    omp_env: Option<&str>,
    default: usize,
) -> Result<usize> {
    if let Some(n) = flag {
        return check("--threads", n);
    }
    if let Some(v) = given(rayon_env) {
        return parse("RAYON_NUM_THREADS", v);
    }
    if let Some(v) = given(omp_env) {
        return parse("OMP_NUM_THREADS", v);
    }
    Ok(default)
}

/// A variable's value unless it is unset or blank.
fn given(v: Option<&str>) -> Option<&str> {
    v.filter(|v| !v.trim().is_empty())
}

/// Physical cores, but no more than the CPUs this process may use (a container's quota).
fn default_threads() -> usize {
    num_cpus::get_physical().min(num_cpus::get()).max(1)
}

/// Configures the global rayon pool and the CPU kernels' SIMD level; returns the thread
/// count chosen.
pub(crate) fn init(flag: Option<usize>) -> Result<usize> {
    let env = |var: &str| std::env::var(var).ok();
    let n = resolve(
        flag,
        env("RAYON_NUM_THREADS").as_deref(),
        env("OMP_NUM_THREADS").as_deref(),
        default_threads(),
    )?;
    k3::quant::simd::configure(env("K3_SIMD").as_deref())?;
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .context("configuring the CPU thread pool")?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_then_rayon_then_omp_then_default() {
        assert_eq!(resolve(Some(3), Some("5"), Some("7"), 2).unwrap(), 3);
        assert_eq!(resolve(None, Some("5"), Some("7"), 2).unwrap(), 5);
        assert_eq!(resolve(None, Some(" "), Some("7"), 2).unwrap(), 7);
        assert_eq!(resolve(None, None, Some("6,2"), 2).unwrap(), 6);
        assert_eq!(resolve(None, None, None, 2).unwrap(), 2);
    }

    #[test]
    fn zero_absurd_and_garbled_counts_are_refused() {
        let err = |r: Result<usize>| r.unwrap_err().to_string();
        assert!(err(resolve(Some(0), None, None, 2)).contains("--threads=0"));
        let e = err(resolve(Some(100_000), None, None, 2));
        assert!(e.contains("--threads=100000") && e.contains("1024"), "{e}");
        let e = err(resolve(None, Some("2000"), None, 2));
        assert!(e.contains("RAYON_NUM_THREADS=2000"), "{e}");
        let e = err(resolve(None, None, Some("four"), 2));
        assert!(e.contains("OMP_NUM_THREADS=\"four\""), "{e}");
    }

    #[test]
    fn default_is_at_least_one_thread() {
        assert!(default_threads() >= 1);
    }
}
