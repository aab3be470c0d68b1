//! Supplies a MoE layer's chosen experts, in canonical (shard, offset) order, in batches:
//! cached experts at once, misses as the loader pool delivers them.

use crate::backend::TierExchange;
use crate::checkpoint::Checkpoint;
use crate::experts::cache::cache_policy::CacheSetup;
use crate::experts::cache::expert_cache::LayerCache;
use crate::experts::io::expert_reader::ExpertReader;
use crate::experts::io::loader_pool::{LoadJob, LoaderPool};
use crate::experts::io::shard_io::IoMode;
use crate::experts::plan::prefetch::Prefetcher;
use crate::experts::supplied::{Item, Supplied};
use crate::experts::telemetry::disk_meter::DiskMeter;
use crate::experts::telemetry::route_trace::RouteTap;
use crate::routed_expert::LoadedExpert;
use crate::routed_expert::ReadLender;
use crate::stats::Stats;
use anyhow::{anyhow, Result};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How experts are read and kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamConfig {
    /// `K3_DIRECT`: direct or buffered reads.
    pub mode: IoMode,
    /// `K3_PIPE`: overlap loads with compute.
    pub pipe: bool,
    /// `K3_LOAD_THREADS`: loader threads when piping.
    pub load_threads: usize,
    /// Cache slots per MoE layer (0: no cache).
    pub slots_per_layer: usize,
}

impl Default for StreamConfig {
    fn default() -> Self {
        Self {
            mode: IoMode::Direct,
            pipe: true,
            load_threads: 4,
            slots_per_layer: 0,
        }
    }
}

/// Where experts come from: a per-layer cache in front of the shards.
pub struct ExpertSource {
    cfg: StreamConfig,
    reader: Arc<ExpertReader>,
    meter: Arc<DiskMeter>,
    pool: Option<LoaderPool>,
    caches: Mutex<HashMap<usize, LayerCache>>,
    /// Slots per layer memory pressure has cut the cache to (`usize::MAX`: not cut).
    pressure_cap: AtomicUsize,
    cache_setup: CacheSetup,
    route_tap: Option<Arc<RouteTap>>,
    prefetch: Prefetcher,
    /// The backend's tier, which holds an expert instead of the host cache (exclusive).
    exchange: Option<Arc<dyn TierExchange>>,
}

/// The consumer of a layer's experts, called with batches in canonical order.
pub(crate) type Consume<'c> = dyn FnMut(&[Supplied<'_>]) -> Result<()> + 'c;

impl ExpertSource {
    /// A source with `cfg`; starts the loader threads when piping.
    pub fn new(cfg: StreamConfig) -> Result<Self> {
        Self::with_lender(cfg, None)
    }

    /// A source with `cfg` that reads experts into memory `lender` lends where it can (the
    /// backend's upload staging).
    pub fn with_lender(cfg: StreamConfig, lender: Option<Arc<dyn ReadLender>>) -> Result<Self> {
        let reader = Arc::new(ExpertReader::new(cfg.mode).with_lender(lender));
        let meter = Arc::new(DiskMeter::default());
        let pool = if cfg.pipe {
            Some(LoaderPool::new(
                cfg.load_threads,
                reader.clone(),
                meter.clone(),
            )?)
        } else {
            None
        };
        Ok(Self {
            cfg,
            reader,
            meter,
            pool,
            caches: Mutex::new(HashMap::new()),
            pressure_cap: AtomicUsize::new(usize::MAX),
            cache_setup: CacheSetup::default(),
            route_tap: None,
            prefetch: Prefetcher::default(),
            exchange: None,
        })
    }

    /// This source with the backend's tier `exchange`: an expert lives in the tier or in the
    /// host cache, never both. Experts the tier takes leave the host cache (promotion), the
    /// ones it evicts come back into it (demotion), and while the tier takes every upload a
    /// read expert waits for its demotion before the host cache keeps it.
    pub fn with_tier_exchange(mut self, exchange: Option<Arc<dyn TierExchange>>) -> Self {
        if let Some(x) = &exchange {
            x.want_demotions(self.cfg.slots_per_layer > 0);
        }
        self.exchange = exchange;
        self
    }

    /// Applies the tier's promotions and the demotions that have arrived to the host caches.
    pub fn settle_tier_moves(&self, stats: &mut Stats) -> Result<()> {
        let Some(x) = &self.exchange else {
            return Ok(());
        };
        let moves = x.take_moves()?;
        if moves.promoted.is_empty() && moves.demoted.is_empty() {
            return Ok(());
        }
        let mut caches = self
            .caches
            .lock()
            .map_err(|_| anyhow!("expert cache poisoned"))?;
        stats.tier_promotions += moves.promoted.len() as u64;
        for key in moves.promoted {
            if let Some(lc) = caches.get_mut(&key.layer) {
                lc.remove(key.id);
            }
        }
        stats.tier_demotions += moves.demoted.len() as u64;
        for (layer, e) in moves.demoted {
            self.layer_cache(&mut caches, layer).insert(Arc::new(e));
        }
        Ok(())
    }

    /// The cache of `layer`, made empty on its first use.
    fn layer_cache<'m>(
        &self,
        caches: &'m mut HashMap<usize, LayerCache>,
        layer: usize,
    ) -> &'m mut LayerCache {
        caches.entry(layer).or_insert_with(|| {
            LayerCache::with_policy(
                self.slots_per_layer(),
                self.cache_setup.kind,
                self.cache_setup.pins_for(layer),
            )
        })
    }

    /// Slots every layer's cache has now: the configured ones, or fewer once memory
    /// pressure cut them ([`ExpertSource::shrink_host_cache`]).
    pub fn slots_per_layer(&self) -> usize {
        self.cfg
            .slots_per_layer
            .min(self.pressure_cap.load(Ordering::Relaxed))
    }

    /// Cuts every layer's host cache to `slots` (memory pressure): each keeps the experts
    /// its policy values most. Returns the experts dropped.
    pub fn shrink_host_cache(&self, slots: usize) -> Result<usize> {
        self.pressure_cap.fetch_min(slots, Ordering::Relaxed);
        let mut caches = self
            .caches
            .lock()
            .map_err(|_| anyhow!("expert cache poisoned"))?;
        let mut dropped = 0;
        for (&layer, lc) in caches.iter_mut() {
            let before = lc.len();
            let old = std::mem::replace(lc, LayerCache::new(0));
            *lc = old.shrunk(
                slots,
                self.cache_setup.kind,
                self.cache_setup.pins_for(layer),
            );
            dropped += before - lc.len();
        }
        Ok(dropped)
    }

    /// Runs every layer cache with `setup` (policy and pins), from empty caches.
    pub fn set_cache_setup(&mut self, setup: CacheSetup) -> Result<()> {
        self.caches
            .lock()
            .map_err(|_| anyhow!("expert cache poisoned"))?
            .clear();
        self.cache_setup = setup;
        Ok(())
    }

    /// The policy and pins every layer cache runs.
    pub fn cache_setup(&self) -> &CacheSetup {
        &self.cache_setup
    }

    /// Records every MoE layer's routes into `tap` (`--route-trace`, usage history).
    pub fn set_route_tap(&mut self, tap: Option<Arc<RouteTap>>) {
        self.route_tap = tap;
    }

    /// The routing tap, when one records.
    pub fn route_tap(&self) -> Option<&Arc<RouteTap>> {
        self.route_tap.as_ref()
    }

    /// The settings in force.
    pub fn config(&self) -> StreamConfig {
        self.cfg
    }

    /// Splits each loader-pool read of an expert larger than `bytes` into pieces of about
    /// that size, which the loader threads read at once; 0 reads each expert in one read
    /// ([`ExpertReader::set_read_piece`]; the default is
    /// [`crate::experts::io::expert_reader::DEFAULT_READ_PIECE`]).
    pub fn set_read_piece(&self, bytes: usize) {
        self.reader.set_read_piece(bytes);
    }

    /// Makes every later expert read consult `plan` (I/O errors and short reads injected
    /// into the read path, for tests; [`ExpertReader::inject_faults`]).
    pub fn inject_faults(&self, plan: Arc<dyn super::FaultPlan>) -> Result<()> {
        self.reader.inject_faults(plan)
    }

    /// The I/O mode in force (direct may have fallen back to buffered).
    pub fn io_mode(&self) -> IoMode {
        self.reader.mode()
    }

    /// Disk busy time and bytes read so far.
    pub fn disk_totals(&self) -> (Duration, u64) {
        self.meter.totals()
    }

    /// Sorts expert ids of `layer` into the order every path consumes them: by shard and
    /// offset. One global order keeps each row's sum over its experts independent of chunking,
    /// caching and overlap, and issues a layer's reads in disk order.
    pub fn canonical_order(ck: &Checkpoint, layer: usize, ids: &mut [u32]) -> Result<()> {
        let mut keyed = Vec::with_capacity(ids.len());
        for &e in ids.iter() {
            let loc = ExpertReader::locate(ck, layer, e)?;
            keyed.push(((loc.shard, loc.span().start), e));
        }
        keyed.sort_unstable();
        for (slot, (_, e)) in ids.iter_mut().zip(keyed) {
            *slot = e;
        }
        Ok(())
    }

    /// For host caches run by the `auto` policy: how many of them evict least recently used
    /// first now, of how many (`None` when no layer cache runs `auto`).
    pub fn auto_policy_modes(&self) -> Result<Option<(usize, usize)>> {
        let caches = self
            .caches
            .lock()
            .map_err(|_| anyhow!("expert cache poisoned"))?;
        let modes: Vec<bool> = caches
            .values()
            .filter_map(LayerCache::follows_recency)
            .collect();
        Ok((!modes.is_empty()).then(|| (modes.iter().filter(|&&m| m).count(), modes.len())))
    }

    /// Which of `ids` (experts of `layer`) the host cache holds now, without touching their
    /// recency.
    pub fn cached(&self, layer: usize, ids: &[u32]) -> Result<Vec<bool>> {
        let caches = self
            .caches
            .lock()
            .map_err(|_| anyhow!("expert cache poisoned"))?;
        Ok(match caches.get(&layer) {
            Some(lc) => ids.iter().map(|&id| lc.contains(id)).collect(),
            None => vec![false; ids.len()],
        })
    }

    /// Whether the host cache holds all `experts` routed experts of each of `layers`: a
    /// pass then reads nothing, whatever its rows choose.
    pub fn holds_every_expert(
        &self,
        layers: impl IntoIterator<Item = usize>,
        experts: usize,
    ) -> Result<bool> {
        let caches = self
            .caches
            .lock()
            .map_err(|_| anyhow!("expert cache poisoned"))?;
        Ok(layers
            .into_iter()
            .all(|l| caches.get(&l).is_some_and(|lc| lc.len() >= experts)))
    }

    /// Those of `ids` (experts of `layer`) that neither the host cache nor the backend's
    /// tier holds now, asked without touching either's recency or pins.
    pub fn held_nowhere(&self, layer: usize, ids: &[u32]) -> Result<Vec<u32>> {
        let cached = self.cached(layer, ids)?;
        let in_tier = match &self.exchange {
            Some(x) => x.holds(layer, ids),
            None => vec![false; ids.len()],
        };
        Ok(ids
            .iter()
            .zip(cached.iter().zip(in_tier))
            .filter_map(|(&id, (&c, t))| (!c && !t).then_some(id))
            .collect())
    }

    /// Guess the next layer's experts on every pass (`--prefetch always`) instead of where
    /// the prefetch gate judges it pays (`on`, the default).
    pub fn set_prefetch_always(&self, always: bool) {
        self.prefetch.set_always(always);
    }

    /// Whether guesses are made on every pass ([`Self::set_prefetch_always`]).
    pub fn prefetch_always(&self) -> bool {
        self.prefetch.always()
    }

    /// Whether `layer`'s experts are to be guessed on this pass: never without the pipe (no
    /// loader reads ahead), else as the prefetch gate judges (`prefetch_gate.rs`).
    pub fn should_guess(&self, layer: usize, stats: &mut Stats) -> Result<bool> {
        if self.pool.is_none() {
            return Ok(false);
        }
        self.prefetch.should_guess(layer, stats)
    }

    /// Reads ahead the experts `ids` (canonical order) guessed for `layer`, those no cache
    /// (host or the backend's tier) holds, behind the reads of the layer running now
    /// (`prefetch.rs`); `router` is what making the guess took. Without the pipe there is
    /// no loader to read ahead: nothing happens.
    pub fn prefetch(
        &self,
        ck: &Checkpoint,
        layer: usize,
        ids: &[u32],
        router: std::time::Duration,
        stats: &mut Stats,
    ) -> Result<()> {
        let Some(pool) = &self.pool else {
            return Ok(());
        };
        let uncached = self.held_nowhere(layer, ids)?;
        self.prefetch
            .issue(pool, ck, &self.reader, layer, &uncached, router, stats)
    }

    fn classify(&self, layer: usize, ids: &[u32], resident: &[bool]) -> Result<Vec<Item>> {
        let mut caches = self
            .caches
            .lock()
            .map_err(|_| anyhow!("expert cache poisoned"))?;
        let lc = self.layer_cache(&mut caches, layer);
        Ok(ids
            .iter()
            .zip(resident)
            .map(|(&id, &r)| {
                if r {
                    Item::Resident(id)
                } else {
                    lc.get(id).map_or(Item::Miss(id), Item::Ready)
                }
            })
            .collect())
    }

    fn remember(&self, layer: usize, e: &Arc<LoadedExpert>) -> Result<()> {
        if self.exchange.as_ref().is_some_and(|x| x.takes_uploads()) {
            // The tier takes it; the host cache gets it back when the tier evicts it.
            return Ok(());
        }
        let mut caches = self
            .caches
            .lock()
            .map_err(|_| anyhow!("expert cache poisoned"))?;
        if let Some(lc) = caches.get_mut(&layer) {
            lc.insert(e.clone());
        }
        Ok(())
    }

    /// Loads the experts `ids` (already in canonical order) of `layer` and hands them to
    /// `consume` in that order, in one or more batches; counts hits, misses and waits.
    /// `resident[k]` says the backend holds `ids[k]` already: it is neither read nor looked
    /// up in the host cache, and counts as a (GPU) hit. `prework` runs once before the first
    /// batch: with the pipe, once the first reads are in flight, so work that does not need
    /// the experts (the layer's shared expert, its latent projection) runs while the disk
    /// reads.
    #[allow(clippy::too_many_arguments)]
    pub fn stream(
        &self,
        ck: &Checkpoint,
        layer: usize,
        ids: &[u32],
        resident: &[bool],
        stats: &mut Stats,
        prework: &mut dyn FnMut() -> Result<()>,
        consume: &mut Consume<'_>,
    ) -> Result<()> {
        if resident.len() != ids.len() {
            return Err(anyhow!(
                "internal: {} residency flags for {} experts of layer {layer}",
                resident.len(),
                ids.len()
            ));
        }
        // Experts earlier layers' uploads evicted from the tier come back first.
        self.settle_tier_moves(stats)?;
        let items = self.classify(layer, ids, resident)?;
        stats.gpu_expert_hits += resident.iter().filter(|&&r| r).count() as u64;
        let misses: Vec<u32> = items
            .iter()
            .filter_map(|i| {
                if let Item::Miss(id) = i {
                    Some(*id)
                } else {
                    None
                }
            })
            .collect();
        stats.expert_lookups += ids.len() as u64;
        stats.expert_hits += (ids.len() - misses.len()) as u64;
        if self.reader.mode() == IoMode::Buffered {
            for &id in &misses {
                self.reader.will_need(ck, layer, id)?;
            }
        }
        let (busy0, bytes0) = self.meter.totals();
        let res = match &self.pool {
            Some(pool) => {
                self.stream_piped(pool, ck, layer, items, &misses, stats, prework, consume)
            }
            None => prework().and_then(|()| self.stream_serial(ck, layer, items, stats, consume)),
        };
        let (busy1, bytes1) = self.meter.totals();
        stats.disk_busy += busy1.saturating_sub(busy0);
        stats.bytes_streamed += bytes1 - bytes0;
        res?;
        self.settle_tier_moves(stats)
    }

    fn stream_serial(
        &self,
        ck: &Checkpoint,
        layer: usize,
        items: Vec<Item>,
        stats: &mut Stats,
        consume: &mut Consume<'_>,
    ) -> Result<()> {
        let t0 = Instant::now();
        let mut all = Vec::with_capacity(items.len());
        for item in items {
            all.push(match item {
                Item::Miss(id) => {
                    self.meter.begin();
                    let r = self.reader.read(ck, layer, id);
                    self.meter
                        .end(r.as_ref().map(|e| e.len() as u64).unwrap_or(0));
                    let e = Arc::new(r?);
                    self.remember(layer, &e)?;
                    Item::Ready(e)
                }
                have => have,
            });
        }
        stats.eload += t0.elapsed();
        let refs: Vec<Supplied<'_>> = all.iter().map(Item::supplied).collect::<Result<_>>()?;
        consume(&refs)
    }

    #[allow(clippy::too_many_arguments)]
    fn stream_piped(
        &self,
        pool: &LoaderPool,
        ck: &Checkpoint,
        layer: usize,
        items: Vec<Item>,
        misses: &[u32],
        stats: &mut Stats,
        prework: &mut dyn FnMut() -> Result<()>,
        consume: &mut Consume<'_>,
    ) -> Result<()> {
        // Reads in flight at once: enough to keep every loader busy and the disk queue full,
        // few enough that memory stays bounded whatever the chunk routes to.
        let window = 2 * self.cfg.load_threads;
        let mut queued: VecDeque<Receiver<Result<LoadedExpert>>> = VecDeque::new();
        let mut next_miss = 0usize;
        // Reads guessed for this layer are already queued or done: they take their miss's
        // place in the order and no place in the window.
        let mut guessed = self
            .prefetch
            .settle(pool, layer, misses, self.meter.totals(), stats)?;
        let mut submit_next = |queued: &mut VecDeque<_>| -> Result<()> {
            while let Some(rx) = misses.get(next_miss).and_then(|id| guessed.remove(id)) {
                queued.push_back(rx);
                next_miss += 1;
            }
            if let Some(&id) = misses.get(next_miss) {
                let loc = ExpertReader::locate(ck, layer, id)?.clone();
                self.reader.expect_unchanged(ck, loc.shard)?;
                let (reply, rx) = channel();
                pool.submit(LoadJob {
                    path: ck.shard_path(loc.shard).to_path_buf(),
                    loc,
                    id,
                    reply,
                })?;
                queued.push_back(rx);
                next_miss += 1;
            }
            Ok(())
        };
        for _ in 0..window {
            submit_next(&mut queued)?;
        }
        prework()?;
        let mut batch: Vec<Item> = Vec::new();
        let flush = |batch: &mut Vec<Item>, consume: &mut Consume<'_>| {
            if batch.is_empty() {
                return Ok(());
            }
            let refs: Vec<Supplied<'_>> =
                batch.iter().map(Item::supplied).collect::<Result<_>>()?;
            let r = consume(&refs);
            batch.clear();
            r
        };
        for item in items {
            let e = match item {
                Item::Miss(id) => {
                    let rx = queued
                        .pop_front()
                        .ok_or_else(|| anyhow!("internal: no read queued for expert {id}"))?;
                    submit_next(&mut queued)?;
                    let got = match rx.try_recv() {
                        Ok(r) => r,
                        Err(TryRecvError::Empty) => {
                            // Compute on what has arrived while this read finishes.
                            flush(&mut batch, consume)?;
                            let t = Instant::now();
                            let r = rx
                                .recv()
                                .map_err(|_| anyhow!("expert loader thread died"))?;
                            stats.eload += t.elapsed();
                            r
                        }
                        Err(TryRecvError::Disconnected) => {
                            return Err(anyhow!("expert loader thread died"))
                        }
                    };
                    let e =
                        Arc::new(got.map_err(|e| {
                            e.context(format!("loading expert {id} of layer {layer}"))
                        })?);
                    self.remember(layer, &e)?;
                    Item::Ready(e)
                }
                have => have,
            };
            batch.push(e);
        }
        flush(&mut batch, consume)
    }
}
