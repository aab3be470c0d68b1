//! How far a long prefill has come: tokens, layers, expert bytes read and an ETA. The model
//! updates it after every layer of a window; `k3 run`/`chat` print it as `[K3] prefill`
//! lines and `k3 serve` shows it on `/health`. Atomics, so a reader on another thread sees
//! it while the engine thread runs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Prompts shorter than this print no progress lines (they end within a blink).
pub(crate) const PRINT_FROM_TOKENS: usize = 256;

/// Progress of the prefill that runs now (or ran last).
#[derive(Debug, Default)]
pub struct PrefillProgress {
    active: AtomicBool,
    tokens: AtomicU64,
    tokens_done: AtomicU64,
    window: AtomicU64,
    layers: AtomicU64,
    /// Layer passes done: a window of `w` tokens through one layer counts `w` token-layers.
    token_layers_done: AtomicU64,
    bytes_read: AtomicU64,
    started: Mutex<Option<Instant>>,
    printed: Mutex<Option<Instant>>,
    print: AtomicBool,
}

/// One reading of [`PrefillProgress`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ProgressView {
    /// Prompt tokens this prefill feeds.
    pub tokens: u64,
    /// Tokens through every layer.
    pub tokens_done: u64,
    /// Tokens of the window now running.
    pub window: u64,
    /// Layers of the model.
    pub layers: u64,
    /// Layers the window now running is through.
    pub layers_done: u64,
    /// Expert bytes read by this prefill, GB.
    pub gb_read: f64,
    /// Seconds since it started.
    pub elapsed_s: f64,
    /// Seconds left at the rate so far (`None` before the first layer ends).
    pub eta_s: Option<f64>,
}

impl PrefillProgress {
    /// Whether `[K3] prefill` lines go to stderr.
    pub fn set_print(&self, on: bool) {
        self.print.store(on, Ordering::Relaxed);
    }

    /// A prefill of `tokens` tokens through `layers` layers starts now.
    pub fn begin(&self, tokens: usize, layers: usize) {
        self.tokens.store(tokens as u64, Ordering::Relaxed);
        self.tokens_done.store(0, Ordering::Relaxed);
        self.window.store(0, Ordering::Relaxed);
        self.layers.store(layers as u64, Ordering::Relaxed);
        self.token_layers_done.store(0, Ordering::Relaxed);
        self.bytes_read.store(0, Ordering::Relaxed);
        if let Ok(mut s) = self.started.lock() {
            *s = Some(Instant::now());
        }
        if let Ok(mut p) = self.printed.lock() {
            *p = None;
        }
        self.active.store(true, Ordering::Release);
    }

    /// A window of `tokens` tokens starts its first layer.
    pub fn window_started(&self, tokens: usize) {
        self.window.store(tokens as u64, Ordering::Relaxed);
    }

    /// The window is through one more layer, having read `bytes` of experts there.
    pub fn layer_done(&self, bytes: u64) {
        if !self.active.load(Ordering::Acquire) {
            return;
        }
        let w = self.window.load(Ordering::Relaxed);
        self.token_layers_done.fetch_add(w, Ordering::Relaxed);
        self.bytes_read.fetch_add(bytes, Ordering::Relaxed);
        self.maybe_print(false);
    }

    /// The window is through every layer.
    pub fn window_done(&self) {
        let w = self.window.load(Ordering::Relaxed);
        self.tokens_done.fetch_add(w, Ordering::Relaxed);
    }

    /// The prefill ended (done, cancelled or failed); prints its last line when it printed
    /// any.
    pub fn end(&self) {
        if self.active.swap(false, Ordering::AcqRel) {
            let printed = self.printed.lock().map(|p| p.is_some()).unwrap_or(false);
            if printed {
                self.print_line();
            }
        }
    }

    /// The prefill running now, or `None` between prefills.
    pub fn view(&self) -> Option<ProgressView> {
        if !self.active.load(Ordering::Acquire) {
            return None;
        }
        Some(self.read())
    }

    fn read(&self) -> ProgressView {
        let tokens = self.tokens.load(Ordering::Relaxed);
        let layers = self.layers.load(Ordering::Relaxed);
        let window = self.window.load(Ordering::Relaxed);
        let tl = self.token_layers_done.load(Ordering::Relaxed);
        let elapsed_s = self
            .started
            .lock()
            .ok()
            .and_then(|s| *s)
            .map_or(0.0, |s| s.elapsed().as_secs_f64());
        let total = tokens * layers;
        let done_before = self.tokens_done.load(Ordering::Relaxed) * layers;
        let finished = tokens > 0 && self.tokens_done.load(Ordering::Relaxed) >= tokens;
        let layers_done = if finished {
            layers
        } else {
            tl.saturating_sub(done_before)
                .checked_div(window)
                .unwrap_or(0)
                .min(layers)
        };
        let eta_s = (tl > 0 && total >= tl).then(|| elapsed_s * (total - tl) as f64 / tl as f64);
        ProgressView {
            tokens,
            tokens_done: self.tokens_done.load(Ordering::Relaxed),
            window,
            layers,
            layers_done,
            gb_read: self.bytes_read.load(Ordering::Relaxed) as f64 / 1e9,
            elapsed_s,
            eta_s,
        }
    }

    /// Prints a line when printing is on, the prompt is long, and a second has passed
    /// since the last one (or `force`).
    fn maybe_print(&self, force: bool) {
        if !self.print.load(Ordering::Relaxed)
            || self.tokens.load(Ordering::Relaxed) < PRINT_FROM_TOKENS as u64
        {
            return;
        }
        let Ok(mut last) = self.printed.lock() else {
            return;
        };
        if !force && last.is_some_and(|t| t.elapsed().as_secs_f64() < 1.0) {
            return;
        }
        *last = Some(Instant::now());
        drop(last);
        self.print_line();
    }

    fn print_line(&self) {
        tracing::info!("{}", self.read());
    }
}

impl std::fmt::Display for ProgressView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let eta = self.eta_s.map_or("?".to_string(), |s| format!("{s:.0} s"));
        write!(
            f,
            "[K3] prefill: {}/{} tokens through all layers | window of {}: {}/{} layers | {:.2} GB read | {:.1} s | ETA {eta}",
            self.tokens_done,
            self.tokens,
            self.window,
            self.layers_done,
            self.layers,
            self.gb_read,
            self.elapsed_s
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_counts_layers_of_each_window_and_ends_idle() {
        let p = PrefillProgress::default();
        assert!(p.view().is_none());
        p.begin(10, 4);
        p.window_started(6);
        p.layer_done(1_000_000_000);
        p.layer_done(0);
        let v = p.view().unwrap();
        assert_eq!(
            (v.tokens, v.tokens_done, v.window, v.layers_done),
            (10, 0, 6, 2)
        );
        assert!((v.gb_read - 1.0).abs() < 1e-9);
        assert!(v.eta_s.is_some());
        p.layer_done(0);
        p.layer_done(0);
        p.window_done();
        p.window_started(4);
        p.layer_done(0);
        let v = p.view().unwrap();
        assert_eq!((v.tokens_done, v.window, v.layers_done), (6, 4, 1));
        assert!(v.to_string().starts_with("[K3] prefill: 6/10 tokens"));
        p.end();
        assert!(p.view().is_none());
    }
}
