//! A Prometheus histogram: cumulative bucket counts, a sum and a count, written in the
//! text exposition format.

use std::fmt::Write;

/// Bucket bounds in seconds for waits and durations (first token, queue, whole request).
pub(crate) const DURATION_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// Bucket bounds in seconds for the time one output token takes.
pub(crate) const TOKEN_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Observations counted into fixed buckets.
#[derive(Clone, Debug)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    /// Observations at or below each bound (not yet cumulative).
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram over `bounds` (ascending).
    pub(crate) fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Counts one observation; a non-finite one is dropped.
    pub(crate) fn observe(&mut self, x: f64) {
        if !x.is_finite() {
            return;
        }
        if let Some(i) = self.bounds.iter().position(|&b| x <= b) {
            self.counts[i] += 1;
        }
        self.sum += x;
        self.count += 1;
    }

    /// Appends the histogram as `name` with its help line.
    pub(crate) fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut below = 0;
        for (b, n) in self.bounds.iter().zip(&self.counts) {
            below += n;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {below}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {:.6}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_inf_counts_all() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for x in [0.05, 0.1, 0.5, 7.0, f64::NAN] {
            h.observe(x);
        }
        let mut s = String::new();
        h.render("t", "help", &mut s);
        assert!(s.contains("# TYPE t histogram"), "{s}");
        assert!(s.contains("t_bucket{le=\"0.1\"} 2\n"), "{s}");
        assert!(s.contains("t_bucket{le=\"1\"} 3\n"), "{s}");
        assert!(s.contains("t_bucket{le=\"+Inf\"} 4\n"), "{s}");
        assert!(
            s.contains("t_count 4\n") && s.contains("t_sum 7.650000\n"),
            "{s}"
        );
    }
}
