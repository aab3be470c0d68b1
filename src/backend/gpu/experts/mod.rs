//! Routed experts on the device, batched: every chosen expert × every token that chose it
//! in one dispatch per matrix (per binding-sized batch of experts). Expert bytes are
//! uploaded as their native MXFP4 bytes; rows are gathered from z and scattered back by
//! routing tables built on the host. A call checks its experts, places each in a tier slot
//! or a transient arena, routes the pairs, and dispatches gate+up, the GLU, down and the
//! scatter. `GpuExperts` owns the experts' device state: the VRAM tier, the transient
//! arenas, the chunk carry, the exchange with the host cache and the staging lent to reads.
//! The arenas, the tier's pools, the routing, the batched matmuls, the carry, the exchange,
//! the expert byte views, the tier's bookkeeping and the VRAM budget each have a file here.

mod arena;
mod batched;
mod carry;
mod exchange;
pub(crate) mod expert_bytes;
pub(crate) mod expert_tier;
mod routing;
mod tier;
pub mod vram_budget;

use arena::Arena;
use carry::Carry;
use exchange::Mailbox;
use tier::TierState;

use crate::backend::gpu::device::buffers::GpuAct;
use crate::backend::gpu::device::context::Dispatch;
use crate::backend::gpu::device::context::{GpuContext, GpuOptions, ReadStaging};
use crate::backend::gpu::device::pipeline::{AdapterShape, VariantList};
use crate::backend::gpu::device::read_staging::StagingLender;
use crate::backend::gpu::device::shaders::Shader;
use crate::backend::gpu::device::upload_path::{self, UploadPath};
use crate::backend::gpu::kernels::chunk_gemm::GemmTile;
use crate::backend::gpu::GpuBackend;
use crate::backend::{
    ExpertAssignment, ExpertPayload, ExpertResidency, FreeDeviceMemory, Glu, TierExchange,
};
use crate::routed_expert::ReadLender;
use anyhow::{anyhow, bail, ensure, Result};
use arena::ArenaSet;
use expert_bytes::{ExpertSrc, MatSrc};
use routing::{build_routing, Routing};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

/// The routed experts' state on the device, behind the [`ExpertResidency`] the backend
/// implements.
pub(crate) struct GpuExperts {
    /// The VRAM expert tier (off until [`ExpertResidency::configure_expert_tier`]).
    tier: Mutex<TierState>,
    /// Device buffers that streamed experts outside the tier are written into, kept from
    /// call to call (see `arena.rs`).
    transient: Mutex<Vec<Option<Arena>>>,
    /// What the last prefill window of each layer uploaded outside the tier (`carry.rs`).
    carry: Mutex<Carry>,
    /// The tier's promotions and demotions for the host cache (`exchange.rs`).
    exchange: Arc<Mailbox>,
    /// Upload staging lent to the expert readers (see [`GpuOptions::read_staging`]).
    lender: Option<Arc<StagingLender>>,
    /// The tier is the single expert pool of a unified-memory adapter
    /// ([`GpuOptions::expert_pool`]).
    unified_pool: bool,
}

impl GpuExperts {
    /// No tier, nothing carried, and staging lent to reads where `opts` and the adapter
    /// of `ctx` call for it.
    pub(crate) fn new(ctx: &GpuContext, opts: &GpuOptions) -> Self {
        let shared = upload_path::unified_memory(ctx.info.device_type);
        // Under an Apple limits profile the pool is the default on any adapter, as on the Mac.
        let unified_pool = opts.expert_pool.unwrap_or(ctx.unified_memory);
        // In the pool a read lands in lent staging and one device copy puts it in its slot.
        let lend = match opts.read_staging {
            ReadStaging::On => true,
            ReadStaging::Off => false,
            ReadStaging::Auto => {
                unified_pool || upload_path::of(&ctx.adapter) == UploadPath::HostMemory
            }
        };
        let lender = lend.then(|| Arc::new(StagingLender::new(ctx.device.clone(), shared)));
        Self {
            tier: Mutex::new(TierState::default()),
            transient: Mutex::new(Vec::new()),
            carry: Mutex::new(Carry::default()),
            exchange: Arc::new(Mailbox::new(ctx.device.clone())),
            lender,
            unified_pool,
        }
    }

    /// Upload buffers alive for lending to expert reads (0 when reads are not lent).
    pub(crate) fn lent_buffers(&self) -> usize {
        self.lender.as_ref().map_or(0, |l| l.buffers_alive())
    }

    /// Experts the VRAM tier holds now.
    pub(crate) fn resident_experts(&self) -> Result<usize> {
        Ok(self.tier()?.book.len())
    }

    fn tier(&self) -> Result<MutexGuard<'_, TierState>> {
        self.tier
            .lock()
            .map_err(|_| anyhow!("GPU expert tier poisoned by an earlier panic"))
    }

    fn carry(&self) -> Result<MutexGuard<'_, Carry>> {
        self.carry
            .lock()
            .map_err(|_| anyhow!("GPU chunk carry poisoned by an earlier panic"))
    }
}

/// Columns per MXFP4 scale block (one kernel unit).
const BLOCK: usize = 32;

/// Where each expert of a call runs: `place[e]` = (arena group, slot in it), and the
/// groups' arena sets.
struct Placement {
    place: Vec<(usize, u32)>,
    sets: Vec<ArenaSet>,
}

/// How an expert is named in errors.
fn name_of(e: &ExpertAssignment<'_>) -> String {
    e.key.map_or("an unnamed expert".to_string(), |k| {
        format!("expert {} of layer {}", k.id, k.layer)
    })
}

impl GpuBackend {
    pub(super) fn moe_accumulate_op(
        &self,
        out: &mut GpuAct,
        z: &GpuAct,
        experts: &[ExpertAssignment<'_>],
        glu: Glu,
    ) -> Result<()> {
        crate::backend::shape_checks::moe_accumulator((out.rows, out.cols), (z.rows, z.cols))?;
        if experts.is_empty() {
            return Ok(());
        }
        // A prefill window can route more (token, expert) pairs to one call than a dispatch
        // or a pair buffer holds: the experts go in consecutive groups that fit, each group
        // a call of its own. The list order, and so every row's summation order, stays.
        let cap = self.max_pairs_per_call(z.cols, experts);
        let pairs: usize = experts.iter().map(|e| e.tokens.len()).sum();
        if pairs > cap {
            let mut start = 0;
            while start < experts.len() {
                let mut end = start;
                let mut n = 0;
                while end < experts.len() && (end == start || n + experts[end].tokens.len() <= cap)
                {
                    n += experts[end].tokens.len();
                    end += 1;
                }
                self.moe_accumulate_op(out, z, &experts[start..end], glu)?;
                start = end;
            }
            return Ok(());
        }
        let tier = self.experts.tier()?;
        let (srcs, i) = self.expert_sources(experts, z.cols, &tier)?;
        let placed = self.place_experts(experts, &srcs, (i, z.cols), z.rows, tier)?;
        let most = experts.iter().map(|e| e.tokens.len()).max().unwrap_or(0);
        let (tile, tiled) = self.expert_tiling(most);
        let rt = build_routing(experts, z.rows, &placed.place, placed.sets.len(), tiled)?;
        if rt.pairs == 0 {
            return Ok(());
        }
        self.dispatch_experts(out, z, &placed.sets, &rt, tile, i, glu);
        Ok(())
    }

    /// The most (token, expert) pairs one call dispatches: the grid's limit per dimension,
    /// and the pair buffers (`[pairs, 2I]`, `[pairs, d]`) within one binding each.
    fn max_pairs_per_call(&self, d: usize, experts: &[ExpertAssignment<'_>]) -> usize {
        let i = experts
            .iter()
            .find_map(|e| match &e.payload {
                ExpertPayload::Host(w) => Some(w.w1.rows),
                ExpertPayload::Staged(st) => Some(st.dims.0),
                ExpertPayload::Resident => None,
            })
            .unwrap_or(d);
        let widest = (2 * i).max(d).max(1) as u64 * 4;
        let by_binding = (self.ctx.max_binding / widest) as usize;
        let by_grid = self.ctx.limits.max_compute_workgroups_per_dimension as usize;
        by_binding.min(by_grid).max(1)
    }

    /// Where each expert's bytes are (host views, a lent staging buffer, or `None`: resident
    /// in the tier), checked to share one `[I, d]` shape; and that `I`. Also checks that the
    /// call fits one binding per expert and the grid's limit on pairs.
    fn expert_sources<'a>(
        &self,
        experts: &'a [ExpertAssignment<'a>],
        d: usize,
        tier: &TierState,
    ) -> Result<(Vec<Option<ExpertSrc<'a>>>, usize)> {
        let srcs: Vec<Option<ExpertSrc<'_>>> = experts
            .iter()
            .map(|ex| match &ex.payload {
                ExpertPayload::Host(w) => ExpertSrc::host(w, d).map(Some),
                ExpertPayload::Staged(st) => ExpertSrc::staged(st, d).map(Some),
                ExpertPayload::Resident => Ok(None),
            })
            .collect::<Result<_>>()?;
        // Experts without bytes are resident in the tier or carried from the last chunk.
        let carried = self.experts.carry()?.dims;
        let held = |dims: (usize, usize)| tier.book.dims() == dims || carried == Some(dims);
        let i = match (srcs.iter().flatten().next(), carried) {
            (Some(w), _) => w.dims.0,
            (None, Some((ci, cd))) if cd == d && tier.book.dims().1 != d => ci,
            (None, _) => tier.book.dims().0,
        };
        for (ex, src) in experts.iter().zip(&srcs) {
            match src {
                Some(w) => ensure!(
                    w.dims == (i, d),
                    "moe: {} is [{}, {}] but another expert of the call is [{i}, {d}]",
                    name_of(ex),
                    w.dims.0,
                    w.dims.1
                ),
                None => ensure!(
                    held((i, d)),
                    "moe: {} is resident as [{}, {}] but the call needs [{i}, {d}]",
                    name_of(ex),
                    tier.book.dims().0,
                    tier.book.dims().1
                ),
            }
        }
        let per_expert = (i * d) as u64;
        if self.ctx.max_binding / per_expert.max(1) == 0 {
            bail!("moe: one expert's gate+up ({per_expert} B) exceeds the adapter's binding limit of {} B", self.ctx.max_binding);
        }
        let pairs: usize = experts.iter().map(|e| e.tokens.len()).sum();
        ensure!(
            pairs <= self.ctx.limits.max_compute_workgroups_per_dimension as usize,
            "moe: {pairs} (token, expert) pairs in one call exceed the adapter's {} workgroups per dimension; use a smaller --chunk",
            self.ctx.limits.max_compute_workgroups_per_dimension
        );
        Ok((srcs, i))
    }

    /// Places every expert: in a tier slot (resident, or uploaded there now), in the arenas
    /// the previous chunk of its layer left in the carry, else in a transient arena, batched
    /// so each batch's gate+up arena fits one binding. A call of several `rows` (a prefill
    /// chunk) makes its transient arenas for itself and hands them to the carry for the next
    /// chunk; a one-row call writes into the arenas kept for reuse. The tier is released
    /// before the transient arenas are written.
    fn place_experts(
        &self,
        experts: &[ExpertAssignment<'_>],
        srcs: &[Option<ExpertSrc<'_>>],
        (i, d): (usize, usize),
        rows: usize,
        mut tier: MutexGuard<'_, TierState>,
    ) -> Result<Placement> {
        let mut carry = self.experts.carry()?;
        let keep = rows > 1 && carry.budget > 0;
        let per_batch = (self.ctx.max_binding / ((i * d) as u64).max(1)) as usize;
        let tier_fits = tier.book.dims() == (i, d);
        let mut place = Vec::with_capacity(experts.len());
        let mut group_of_pool: HashMap<usize, usize> = HashMap::new();
        let mut group_of_carried: HashMap<u64, usize> = HashMap::new();
        let mut sets: Vec<Option<ArenaSet>> = Vec::new();
        let mut busy = HashSet::new();
        let mut transient: Vec<(Vec<MatSrc<'_>>, Vec<MatSrc<'_>>)> = Vec::new();
        // The experts placed in each transient arena, by id and slot, and its layer.
        let mut transient_ids: Vec<Vec<(u32, u32)>> = Vec::new();
        let mut transient_group = None;
        let mut uploads = 0u64;
        let mut carried_hits = 0u64;
        for (ex, src) in experts.iter().zip(srcs) {
            let mut slot = None;
            if let (Some(key), true) = (ex.key, tier_fits) {
                slot = tier.book.lookup(key);
                if slot.is_none() && carry.find(key).is_none() {
                    if let Some(w) = src {
                        if let Some(s) = tier.book.reserve(key, &busy) {
                            if let Some(victim) = tier.book.take_evicted() {
                                self.demote_from_slot(&tier, s, victim)?;
                            }
                            self.upload_to_slot(&mut tier, s, w)?;
                            self.note_promoted(key)?;
                            uploads += 1;
                            slot = Some(s);
                        }
                    }
                }
            }
            if let Some(s) = slot {
                busy.insert(s);
                place.push(resident_place(&tier, s, &mut group_of_pool, &mut sets)?);
                continue;
            }
            if let Some((set, at, arenas)) = ex.key.and_then(|k| carry.find(k)) {
                let g = *group_of_carried.entry(set).or_insert_with(|| {
                    sets.push(Some(arenas.clone()));
                    sets.len() - 1
                });
                carried_hits += 1;
                place.push((g, at));
                continue;
            }
            let w = src.as_ref().ok_or_else(|| {
                anyhow!(
                    "moe: {} has no weights and is not resident in the GPU expert tier; pin it with pin_resident_experts before the layer runs",
                    name_of(ex)
                )
            })?;
            let g = match transient_group {
                Some(g) if transient.last().is_some_and(|b| b.0.len() / 2 < per_batch) => g,
                _ => {
                    sets.push(None);
                    transient.push((Vec::new(), Vec::new()));
                    transient_ids.push(Vec::new());
                    transient_group = Some(sets.len() - 1);
                    sets.len() - 1
                }
            };
            let (Some((up, down)), Some(ids)) = (transient.last_mut(), transient_ids.last_mut())
            else {
                bail!("internal: no transient arena open");
            };
            if let Some(k) = ex.key {
                ids.push((k.id, down.len() as u32));
            }
            place.push((g, down.len() as u32));
            up.extend([w.w1, w.w3]);
            down.push(w.w2);
            uploads += 1;
        }
        drop(tier);
        // Transient arenas fill the groups left empty, in the order they were opened.
        let mut tb = transient.iter();
        let mut made = Vec::new();
        for (j, set) in sets.iter_mut().filter(|s| s.is_none()).enumerate() {
            let Some((up, down)) = tb.next() else {
                bail!("internal: a MoE arena group has no buffers");
            };
            let reuse = |k: usize| (!keep).then_some(k);
            let arenas = ArenaSet {
                up: self.arena(up, reuse(2 * j))?,
                down: self.arena(down, reuse(2 * j + 1))?,
            };
            if keep {
                made.push((carry.new_set_id(), arenas.clone(), transient_ids[j].clone()));
            }
            *set = Some(arenas);
        }
        carry.uploads += uploads;
        carry.hits += carried_hits;
        // A carry is kept per layer; a call's experts share one layer (the model's).
        let layer = experts.iter().find_map(|e| e.key.map(|k| k.layer));
        if let (true, Some(layer)) = (keep, layer) {
            let reused: HashSet<u64> = group_of_carried.keys().copied().collect();
            carry.keep(layer, (i, d), &reused, made);
        }
        Ok(Placement {
            place,
            sets: sets.into_iter().flatten().collect(),
        })
    }

    /// The routed pairs through gate+up, the GLU and down, group by group, then scattered
    /// into `out` with their routing weights.
    #[allow(clippy::too_many_arguments)]
    fn dispatch_experts(
        &self,
        out: &GpuAct,
        z: &GpuAct,
        sets: &[ArenaSet],
        rt: &Routing,
        tile: Option<GemmTile>,
        i: usize,
        glu: Glu,
    ) {
        let d = z.cols;
        let rtb = self
            .ctx
            .buffer_init(bytemuck::cast_slice(&rt.words), "routing");
        // Activations, so their buffers come back for the next call (no zero-fill each time).
        let h = self.alloc(rt.pairs, 2 * i);
        let act = self.alloc(rt.pairs, i);
        let ypair = self.alloc(rt.pairs, d);
        let (h, ypair) = (&h.buf, &ypair.buf);
        let chunk = self.chunk_pass(tile, rt, 2 * i, d);
        let (big, big_down) = (self.ctx.expert_matvec, self.ctx.expert_down_matvec);
        for (set, &items) in sets.iter().zip(&rt.group_items) {
            let c = chunk.as_ref();
            self.mxfp4_batched(
                big,
                &set.up,
                &z.buf,
                h,
                &rtb,
                2 * i,
                d,
                rt.tok_map,
                items,
                c,
            );
        }
        self.finish_chunk_pass(chunk.as_ref(), h);
        let iu = i as u32;
        self.glu_strided(h, h, &act, glu, (2 * iu, 2 * iu, iu));
        let chunk = self.chunk_pass(tile, rt, d, i);
        for (set, &items) in sets.iter().zip(&rt.group_items) {
            let c = chunk.as_ref();
            self.mxfp4_batched(
                big_down, &set.down, &act.buf, ypair, &rtb, d, i, rt.id_map, items, c,
            );
        }
        self.finish_chunk_pass(chunk.as_ref(), ypair);
        if !out.is_empty() {
            self.ctx.dispatch(&Dispatch {
                shader: Shader::Moe,
                entry: "scatter",
                consts: &[],
                params: &[
                    out.len() as u32,
                    d as u32,
                    rt.csr,
                    rt.csr_pairs,
                    rt.csr_weights,
                ],
                buffers: &[ypair, &rtb, &out.buf],
                groups: self.ctx.grid((out.len() as u32).div_ceil(self.ctx.wg)),
            });
        }
    }
}

/// The (group, slot) of tier slot `s`: its pool's group (opened on its first expert of the
/// call), marked as holding huge scales where the slot's expert may.
fn resident_place(
    tier: &TierState,
    s: usize,
    group_of_pool: &mut HashMap<usize, usize>,
    sets: &mut Vec<Option<ArenaSet>>,
) -> Result<(usize, u32)> {
    let per_pool = tier.book.per_pool();
    let g = *group_of_pool.entry(s / per_pool).or_insert_with(|| {
        sets.push(None);
        sets.len() - 1
    });
    let huge = tier.huge.contains(&s);
    match &mut sets[g] {
        Some(set) => {
            set.up.huge |= huge;
            set.down.huge |= huge;
        }
        None => {
            let pool = tier
                .pools
                .get(s / per_pool)
                .ok_or_else(|| anyhow!("internal: GPU expert tier slot {s} has no device pool"))?;
            sets[g] = Some(pool.marked(huge));
        }
    }
    Ok((g, (s % per_pool) as u32))
}

impl ExpertResidency for GpuBackend {
    fn read_lender(&self) -> Option<Arc<dyn ReadLender>> {
        self.experts
            .lender
            .clone()
            .map(|l| -> Arc<dyn ReadLender> { l })
    }

    fn tier_exchange(&self) -> Option<Arc<dyn TierExchange>> {
        Some(self.experts.exchange.clone())
    }

    fn unified_pool(&self) -> bool {
        self.experts.unified_pool
    }

    fn expert_tier_slots(&self) -> Result<usize> {
        Ok(self.experts.tier()?.book.capacity())
    }

    fn configure_expert_tier(
        &self,
        bytes: u64,
        experts: usize,
        intermediate: usize,
        hidden: usize,
    ) -> Result<Option<usize>> {
        self.configure_tier_op(bytes, experts, intermediate, hidden)
            .map(Some)
    }

    fn pin_resident_experts(&self, layer: usize, ids: &[u32]) -> Result<Vec<bool>> {
        let in_tier = self.experts.tier()?.book.pin(layer, ids);
        let carried = self.experts.carry()?.pin(layer, ids);
        Ok(in_tier.iter().zip(carried).map(|(&t, c)| t || c).collect())
    }

    fn free_device_memory(&self) -> Result<FreeDeviceMemory> {
        // Dropped buffers (an earlier tier, staging) go back to the driver only once the
        // device has been polled past the work that used them.
        self.ctx.finish()?;
        Ok(
            match vram_budget::free_device_local_bytes(&self.ctx.adapter) {
                Some(bytes) => FreeDeviceMemory::Bytes(bytes),
                None => FreeDeviceMemory::Unknown(vram_budget::why_unknown(&self.ctx.info)),
            },
        )
    }
}

/// The MoE scatter kernel's pipeline (the expert matmuls are the matvec kernels').
pub(crate) fn pipeline_variants(_a: AdapterShape, list: &mut VariantList) {
    list.push(Shader::Moe, "scatter", Vec::new());
}
