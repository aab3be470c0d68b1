//! Counters and timers behind the `[K3]` stats lines users parse.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

static PROCESS_START: OnceLock<Instant> = OnceLock::new();

/// When this process started, as k3 knows it: the first call's time (`main` makes the first
/// call; a library user's clock starts at its first load).
pub fn process_start() -> Instant {
    *PROCESS_START.get_or_init(Instant::now)
}

/// Decode/prefill counters, accumulated over a run.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Time in attention (KDA + MLA), including projections.
    pub attn: Duration,
    /// Time in the MoE blocks, including expert loading.
    pub moe: Duration,
    /// Expert load time not hidden behind compute.
    pub eload: Duration,
    /// Time in the final mix, norm and head.
    pub head: Duration,
    /// Unique experts found in a cache (per layer per window).
    pub expert_hits: u64,
    /// Of the hits, experts the backend already held resident (GPU tier): no read, no upload.
    pub gpu_expert_hits: u64,
    /// Unique experts needed (per layer per window).
    pub expert_lookups: u64,
    /// Expert bytes read from disk.
    pub bytes_streamed: u64,
    /// Time the disk had at least one expert read in flight.
    pub disk_busy: Duration,
    /// Host time handing experts to the backend (checks, upload copies, recording), part
    /// of `moe`: what the pipe must hide besides the reads.
    pub expert_handoff: Duration,
    /// Time waiting for routing decisions (on the GPU: the readback that ends each layer's
    /// recorded work), part of `moe`.
    pub router_wait: Duration,
    /// Routed experts left unread by `--expert-top-p` / `--skip-uncached-below` (per layer
    /// per window, as `expert_lookups` counts them).
    pub experts_skipped: u64,
    /// Bytes those experts would have taken to read or hold.
    pub bytes_skipped: u64,
    /// Experts the backend's tier took from host memory (the host cache dropped its copy).
    pub tier_promotions: u64,
    /// Experts the tier evicted and gave back to the host cache.
    pub tier_demotions: u64,
    /// Expert reads started for a guess of the next MoE layer's routing (`--prefetch`).
    pub prefetch_guesses: u64,
    /// Of the guesses, experts their layer then needed.
    pub prefetch_hits: u64,
    /// Of the wrong guesses, those dropped before any byte was read.
    pub prefetch_unread: u64,
    /// Bytes read for wrong guesses.
    pub prefetch_wasted_bytes: u64,
    /// MoE layer passes that guessed the layer's experts (`--prefetch`).
    pub prefetch_rounds: u64,
    /// MoE layer passes where the prefetch gate judged guessing not to pay and made none.
    pub prefetch_rounds_skipped: u64,
}

impl Stats {
    /// Hit rate in percent (0 when nothing was looked up).
    pub fn hit_percent(&self) -> f64 {
        if self.expert_lookups == 0 {
            0.0
        } else {
            100.0 * self.expert_hits as f64 / self.expert_lookups as f64
        }
    }

    /// Hits in the host RAM cache (the hits the backend's tier did not serve).
    pub fn ram_expert_hits(&self) -> u64 {
        self.expert_hits.saturating_sub(self.gpu_expert_hits)
    }

    /// The sum of two sets of counters (prefill + decode).
    pub fn plus(&self, o: &Stats) -> Stats {
        Stats {
            attn: self.attn + o.attn,
            moe: self.moe + o.moe,
            eload: self.eload + o.eload,
            head: self.head + o.head,
            expert_hits: self.expert_hits + o.expert_hits,
            gpu_expert_hits: self.gpu_expert_hits + o.gpu_expert_hits,
            expert_lookups: self.expert_lookups + o.expert_lookups,
            bytes_streamed: self.bytes_streamed + o.bytes_streamed,
            disk_busy: self.disk_busy + o.disk_busy,
            expert_handoff: self.expert_handoff + o.expert_handoff,
            router_wait: self.router_wait + o.router_wait,
            experts_skipped: self.experts_skipped + o.experts_skipped,
            bytes_skipped: self.bytes_skipped + o.bytes_skipped,
            tier_promotions: self.tier_promotions + o.tier_promotions,
            tier_demotions: self.tier_demotions + o.tier_demotions,
            prefetch_guesses: self.prefetch_guesses + o.prefetch_guesses,
            prefetch_hits: self.prefetch_hits + o.prefetch_hits,
            prefetch_unread: self.prefetch_unread + o.prefetch_unread,
            prefetch_wasted_bytes: self.prefetch_wasted_bytes + o.prefetch_wasted_bytes,
            prefetch_rounds: self.prefetch_rounds + o.prefetch_rounds,
            prefetch_rounds_skipped: self.prefetch_rounds_skipped + o.prefetch_rounds_skipped,
        }
    }

    /// The figures of two passes that ran at the same time on two threads: the counts add,
    /// each time is the longer of the two (the wall time the pair took in that stage).
    pub fn alongside(&self, o: &Stats) -> Stats {
        let mut s = self.plus(o);
        s.attn = self.attn.max(o.attn);
        s.moe = self.moe.max(o.moe);
        s.eload = self.eload.max(o.eload);
        s.head = self.head.max(o.head);
        s.disk_busy = self.disk_busy.max(o.disk_busy);
        s.expert_handoff = self.expert_handoff.max(o.expert_handoff);
        s.router_wait = self.router_wait.max(o.router_wait);
        s
    }

    /// Counters accumulated since `earlier` (a snapshot of the same run).
    pub fn since(&self, earlier: &Stats) -> Stats {
        Stats {
            attn: self.attn.saturating_sub(earlier.attn),
            moe: self.moe.saturating_sub(earlier.moe),
            eload: self.eload.saturating_sub(earlier.eload),
            head: self.head.saturating_sub(earlier.head),
            expert_hits: self.expert_hits - earlier.expert_hits,
            gpu_expert_hits: self.gpu_expert_hits - earlier.gpu_expert_hits,
            expert_lookups: self.expert_lookups - earlier.expert_lookups,
            bytes_streamed: self.bytes_streamed - earlier.bytes_streamed,
            disk_busy: self.disk_busy.saturating_sub(earlier.disk_busy),
            expert_handoff: self.expert_handoff.saturating_sub(earlier.expert_handoff),
            router_wait: self.router_wait.saturating_sub(earlier.router_wait),
            experts_skipped: self.experts_skipped - earlier.experts_skipped,
            bytes_skipped: self.bytes_skipped - earlier.bytes_skipped,
            tier_promotions: self.tier_promotions - earlier.tier_promotions,
            tier_demotions: self.tier_demotions - earlier.tier_demotions,
            prefetch_guesses: self.prefetch_guesses - earlier.prefetch_guesses,
            prefetch_hits: self.prefetch_hits - earlier.prefetch_hits,
            prefetch_unread: self.prefetch_unread - earlier.prefetch_unread,
            prefetch_wasted_bytes: self.prefetch_wasted_bytes - earlier.prefetch_wasted_bytes,
            prefetch_rounds: self.prefetch_rounds - earlier.prefetch_rounds,
            prefetch_rounds_skipped: self.prefetch_rounds_skipped - earlier.prefetch_rounds_skipped,
        }
    }

    /// These counters shared among parts in proportion to `weights` (the rows each
    /// sequence fed to one batched pass): part `k` takes the difference of the floors of
    /// the running shares before and after it, so each counter's parts add up to it
    /// exactly and totals over the parts count the pass once. Weights that are all zero
    /// share evenly.
    pub fn split(&self, weights: &[usize]) -> Vec<Stats> {
        let even = weights.iter().all(|&w| w == 0);
        let weight = |w: usize| if even { 1 } else { w as u128 };
        let total: u128 = weights.iter().map(|&w| weight(w)).sum();
        let mut before = 0u128;
        let mut out = Vec::with_capacity(weights.len());
        for &w in weights {
            let after = before + weight(w);
            let share = |x: u128| x * after / total - x * before / total;
            let n = |x: u64| share(x as u128) as u64;
            let d = |x: Duration| Duration::from_nanos(share(x.as_nanos()) as u64);
            out.push(Stats {
                attn: d(self.attn),
                moe: d(self.moe),
                eload: d(self.eload),
                head: d(self.head),
                expert_hits: n(self.expert_hits),
                gpu_expert_hits: n(self.gpu_expert_hits),
                expert_lookups: n(self.expert_lookups),
                bytes_streamed: n(self.bytes_streamed),
                disk_busy: d(self.disk_busy),
                expert_handoff: d(self.expert_handoff),
                router_wait: d(self.router_wait),
                experts_skipped: n(self.experts_skipped),
                bytes_skipped: n(self.bytes_skipped),
                tier_promotions: n(self.tier_promotions),
                tier_demotions: n(self.tier_demotions),
                prefetch_guesses: n(self.prefetch_guesses),
                prefetch_hits: n(self.prefetch_hits),
                prefetch_unread: n(self.prefetch_unread),
                prefetch_wasted_bytes: n(self.prefetch_wasted_bytes),
                prefetch_rounds: n(self.prefetch_rounds),
                prefetch_rounds_skipped: n(self.prefetch_rounds_skipped),
            });
            before = after;
        }
        out
    }
}

/// `[K3] prompt: %d tokens | ngen %d | temp %.2f`
pub fn prompt_line(tokens: usize, ngen: usize, temp: f32) -> String {
    format!("[K3] prompt: {tokens} tokens | ngen {ngen} | temp {temp:.2}")
}

/// `[K3] prefill done in %.1fs (%.2f tok/s)`
pub fn prefill_line(tokens: usize, secs: f64) -> String {
    format!(
        "[K3] prefill done in {secs:.1}s ({:.2} tok/s)",
        rate(tokens, secs)
    )
}

/// `[K3] decode %d tokens in %.1fs (%.2f tok/s) | expert hit %.1f%% (%llu/%llu) | %.1f GB streamed`
pub fn decode_line(tokens: usize, secs: f64, s: &Stats) -> String {
    format!(
        "[K3] decode {tokens} tokens in {secs:.1}s ({:.2} tok/s) | expert hit {:.1}% ({}/{}) | {:.1} GB streamed",
        rate(tokens, secs),
        s.hit_percent(),
        s.expert_hits,
        s.expert_lookups,
        s.bytes_streamed as f64 / 1e9
    )
}

/// `[K3] tiers: VRAM hits %llu | RAM hits %llu | misses %llu | promoted %llu demoted %llu`,
/// or `None` when the backend has no tier in play (no VRAM hit, nothing moved). With a
/// unified pool of `pool_slots` (the only expert cache):
/// `[K3] tiers: unified pool of %d slots | hits %llu | misses %llu | read into it %llu`.
pub fn tiers_line(s: &Stats, pool_slots: Option<usize>) -> Option<String> {
    let misses = s.expert_lookups.saturating_sub(s.expert_hits);
    if let Some(n) = pool_slots {
        return Some(format!(
            "[K3] tiers: unified pool of {n} slots | hits {} | misses {misses} | read into it {}",
            s.gpu_expert_hits, s.tier_promotions
        ));
    }
    (s.gpu_expert_hits + s.tier_promotions + s.tier_demotions > 0).then(|| {
        format!(
            "[K3] tiers: VRAM hits {} | RAM hits {} | misses {} | promoted {} demoted {}",
            s.gpu_expert_hits,
            s.ram_expert_hits(),
            misses,
            s.tier_promotions,
            s.tier_demotions
        )
    })
}

/// `[K3] cache policy auto: N of M MoE layers evict least recently used first, the rest by
/// lfu-decay` (`modes`: the expert source's `auto_policy_modes`).
pub fn policy_line(modes: Option<(usize, usize)>) -> Option<String> {
    modes.map(|(recency, layers)| {
        format!(
            "[K3] cache policy auto: {recency} of {layers} MoE layers evict least recently used first, the rest by lfu-decay"
        )
    })
}

/// `[K3] time: attn %.1fs moe %.1fs (eload %.1fs) head %.1fs | RSS %.1f GB`
pub fn time_line(s: &Stats, rss_gb: f64) -> String {
    format!(
        "[K3] time: attn {:.1}s moe {:.1}s (eload {:.1}s) head {:.1}s | RSS {rss_gb:.1} GB",
        s.attn.as_secs_f64(),
        s.moe.as_secs_f64(),
        s.eload.as_secs_f64(),
        s.head.as_secs_f64()
    )
}

/// `  [tok %d: %.1fs/tok, hit %.0f%%, %.1f GB read]`
pub fn token_line(index: usize, secs: f64, s: &Stats) -> String {
    format!(
        "  [tok {index}: {secs:.1}s/tok, hit {:.0}%, {:.1} GB read]",
        s.hit_percent(),
        s.bytes_streamed as f64 / 1e9
    )
}

/// `[K3] disk: %.1f GB in %.1fs busy (%.2f GB/s)`
pub fn disk_line(s: &Stats) -> String {
    let busy = s.disk_busy.as_secs_f64();
    let gb = s.bytes_streamed as f64 / 1e9;
    format!(
        "[K3] disk: {gb:.1} GB in {busy:.1}s busy ({:.2} GB/s)",
        if busy > 0.0 { gb / busy } else { 0.0 }
    )
}

/// `[K3] skipped: N experts (X GB not read)`, or `None` when the run was exact.
pub fn skipped_line(s: &Stats) -> Option<String> {
    (s.experts_skipped > 0).then(|| {
        format!(
            "[K3] skipped: {} experts ({:.2} GB not read) by --expert-top-p / --skip-uncached-below",
            s.experts_skipped,
            s.bytes_skipped as f64 / 1e9
        )
    })
}

/// `[K3] prefetch PHASE: N guessed reads, H used (P%), U dropped unread, W read for nothing
/// (X GB) | guessed on G of L layer passes`, or `None` when no pass was judged.
pub fn prefetch_line(phase: &str, s: &Stats) -> Option<String> {
    let passes = s.prefetch_rounds + s.prefetch_rounds_skipped;
    (passes > 0).then(|| {
        format!(
            "[K3] prefetch {phase}: {} guessed reads, {} used ({:.1}%), {} dropped unread, {} read for nothing ({:.2} GB) | guessed on {} of {passes} layer passes",
            s.prefetch_guesses,
            s.prefetch_hits,
            100.0 * s.prefetch_hits as f64 / s.prefetch_guesses.max(1) as f64,
            s.prefetch_unread,
            s.prefetch_guesses
                .saturating_sub(s.prefetch_hits + s.prefetch_unread),
            s.prefetch_wasted_bytes as f64 / 1e9,
            s.prefetch_rounds
        )
    })
}

/// How well a phase of `secs` wall seconds hid its reads: wall / max(disk busy, compute),
/// where disk busy is the time at least one expert read was in flight and compute is the
/// wall time not spent waiting for a read (wall - eload). 1.0: the longer of the two hid
/// the other completely. 0 when nothing ran.
pub fn overlap_ratio(secs: f64, s: &Stats) -> f64 {
    let compute = (secs - s.eload.as_secs_f64()).max(0.0);
    let bound = s.disk_busy.as_secs_f64().max(compute);
    if bound > 0.0 {
        secs / bound
    } else {
        0.0
    }
}

/// `[K3] overlap: decode wall / max(disk busy, compute) = R (wall, disk busy, compute)`
pub fn overlap_line(secs: f64, s: &Stats) -> String {
    format!(
        "[K3] overlap: decode wall / max(disk busy, compute) = {:.2} (wall {secs:.2}s, disk busy {:.2}s, compute = wall - eload {:.2}s)",
        overlap_ratio(secs, s),
        s.disk_busy.as_secs_f64(),
        (secs - s.eload.as_secs_f64()).max(0.0)
    )
}

/// What a generation reports for `--stats-json`: its token count and, per phase, the
/// seconds and counters.
pub trait RunReport {
    /// Tokens generated.
    fn generated_tokens(&self) -> usize;
    /// Seconds and counters of the prefill.
    fn prefill(&self) -> (f64, &Stats);
    /// Seconds and counters of the decode.
    fn decode(&self) -> (f64, &Stats);
}

/// Every counter of a run, for `--stats-json`.
pub fn run_json(prompt_tokens: usize, g: &impl RunReport, total: &Stats) -> serde_json::Value {
    let part = |s: &Stats| {
        serde_json::json!({
            "attn_s": s.attn.as_secs_f64(),
            "moe_s": s.moe.as_secs_f64(),
            "eload_s": s.eload.as_secs_f64(),
            "head_s": s.head.as_secs_f64(),
            "expert_hits": s.expert_hits,
            "gpu_hits": s.gpu_expert_hits,
            "ram_hits": s.ram_expert_hits(),
            "tier_promotions": s.tier_promotions,
            "tier_demotions": s.tier_demotions,
            "expert_lookups": s.expert_lookups,
            "hit_percent": s.hit_percent(),
            "bytes_streamed": s.bytes_streamed,
            "disk_busy_s": s.disk_busy.as_secs_f64(),
            "expert_handoff_s": s.expert_handoff.as_secs_f64(),
            "router_wait_s": s.router_wait.as_secs_f64(),
            "experts_skipped": s.experts_skipped,
            "bytes_skipped": s.bytes_skipped,
            "prefetch_guesses": s.prefetch_guesses,
            "prefetch_hits": s.prefetch_hits,
            "prefetch_unread": s.prefetch_unread,
            "prefetch_wasted_bytes": s.prefetch_wasted_bytes,
            "prefetch_rounds": s.prefetch_rounds,
            "prefetch_rounds_skipped": s.prefetch_rounds_skipped,
        })
    };
    let ((prefill_s, prefill), (decode_s, decode)) = (g.prefill(), g.decode());
    let generated = g.generated_tokens();
    serde_json::json!({
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_tok_per_s": rate(generated, decode_s),
        "decode_overlap": overlap_ratio(decode_s, decode),
        "prefill": part(prefill),
        "decode": part(decode),
        "total": part(total),
        "rss_gb": rss_gb(),
    })
}

/// Tokens per second (0 when no time passed).
pub fn rate(tokens: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        tokens as f64 / secs
    } else {
        0.0
    }
}

/// Resident set size of this process in GB (0 where the OS does not say).
pub fn rss_gb() -> f64 {
    crate::platform::available_memory::resident_bytes().unwrap_or(0) as f64 / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_shares_each_counter_by_rows_and_adds_up_to_it() {
        let s = Stats {
            expert_hits: 7,
            expert_lookups: 10,
            bytes_streamed: 1_000_003,
            moe: Duration::from_nanos(999),
            prefetch_rounds_skipped: 1,
            ..Default::default()
        };
        let parts = s.split(&[512, 1, 0, 3]);
        assert_eq!(parts.len(), 4);
        let sum = parts.iter().fold(Stats::default(), |a, p| a.plus(p));
        assert_eq!(format!("{sum:?}"), format!("{s:?}"));
        // The 512-row slice takes nearly all; the row-less part takes nothing.
        assert_eq!(parts[0].expert_lookups, 9);
        assert_eq!(parts[0].bytes_streamed, 1_000_003 * 512 / 516);
        assert_eq!(parts[2].expert_lookups, 0);
        assert_eq!(parts[2].bytes_streamed, 0);
        // Equal rows share evenly; weights all zero too.
        let even = s.split(&[1, 1]);
        assert_eq!((even[0].expert_lookups, even[1].expert_lookups), (5, 5));
        let zero = s.split(&[0, 0]);
        assert_eq!((zero[0].expert_hits, zero[1].expert_hits), (3, 4));
        assert!(s.split(&[]).is_empty());
    }

    #[test]
    fn the_policy_line_counts_layers_only_for_auto() {
        assert_eq!(policy_line(None), None);
        assert_eq!(
            policy_line(Some((2, 3))).as_deref(),
            Some("[K3] cache policy auto: 2 of 3 MoE layers evict least recently used first, the rest by lfu-decay")
        );
    }

    #[test]
    fn lines_keep_the_c_engine_format() {
        let s = Stats {
            expert_hits: 3,
            expert_lookups: 4,
            bytes_streamed: 2_500_000_000,
            ..Default::default()
        };
        assert_eq!(
            prompt_line(5, 8, 0.0),
            "[K3] prompt: 5 tokens | ngen 8 | temp 0.00"
        );
        assert_eq!(
            prefill_line(4, 2.0),
            "[K3] prefill done in 2.0s (2.00 tok/s)"
        );
        assert_eq!(
            decode_line(8, 4.0, &s),
            "[K3] decode 8 tokens in 4.0s (2.00 tok/s) | expert hit 75.0% (3/4) | 2.5 GB streamed"
        );
        assert_eq!(prefetch_line("decode", &s), None);
        let p = Stats {
            prefetch_guesses: 8,
            prefetch_hits: 6,
            prefetch_unread: 1,
            prefetch_wasted_bytes: 17_550_000,
            prefetch_rounds: 3,
            prefetch_rounds_skipped: 9,
            ..Default::default()
        };
        assert_eq!(
            prefetch_line("decode", &p).unwrap(),
            "[K3] prefetch decode: 8 guessed reads, 6 used (75.0%), 1 dropped unread, 1 read for nothing (0.02 GB) | guessed on 3 of 12 layer passes"
        );
        assert_eq!(
            time_line(&s, 1.26),
            "[K3] time: attn 0.0s moe 0.0s (eload 0.0s) head 0.0s | RSS 1.3 GB"
        );
    }

    #[test]
    fn overlap_is_wall_over_the_longer_of_disk_and_compute() {
        let s = Stats {
            eload: Duration::from_secs(1),
            disk_busy: Duration::from_secs(3),
            ..Default::default()
        };
        // compute = 4 - 1 = 3 s, disk 3 s: 4 / 3.
        assert!((overlap_ratio(4.0, &s) - 4.0 / 3.0).abs() < 1e-12);
        // compute 9 s beats disk 3 s.
        assert!((overlap_ratio(10.0, &s) - 10.0 / 9.0).abs() < 1e-12);
        assert_eq!(overlap_ratio(0.0, &Stats::default()), 0.0);
        assert!(overlap_line(4.0, &s).contains("= 1.33"));
    }
}
