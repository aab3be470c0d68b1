//! [`EngineBuilder`]: the whole assembly of an engine from an [`EngineConfig`] (backend
//! choice, load, RAM clamp, tier or pool sizing, streaming, cache policy, prompt cache),
//! printing the start-up lines as it goes, and [`ModelJob`], the work run on the result
//! whatever backend was chosen.

use super::config::{CacheConfig, EngineConfig};
use super::plan::Plan;
use super::streaming::plan_runtime;
use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::GpuBackend;
use crate::backend::select::{select, Selected};
use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::model::loader::LoadOptions;
use crate::model::weight_cache::WeightCacheSetting;
use crate::model::{FormatPolicy, K3Model, Runner};
use crate::quant::idot::IdotKernel;
use anyhow::Result;
use std::path::Path;

/// Work to run on a loaded model, whatever backend was chosen.
pub trait ModelJob {
    /// What the job returns.
    type Out;
    /// Whether the job's sessions use the prompt cache (`run`, `chat`, `serve`; a
    /// benchmark measures the prefill a cached prompt would skip): [`EngineBuilder::run`]
    /// sets the config's `prompt_cache.in_use` from it.
    const PROMPT_CACHE: bool = false;
    /// Sequences the job runs at once (`k3 serve --parallel`): [`EngineBuilder::run`] sets
    /// the config's `parallel` from it, and the plan reserves a state for each.
    fn parallel(&self) -> usize {
        1
    }
    /// Runs the job on `model` and its runtime, sized by `plan`.
    fn run<B: Backend>(self, model: &mut Runner<B>, plan: &Plan) -> Result<Self::Out>;
}

/// A loaded model on the backend that was chosen.
pub enum AnyModel {
    /// On the CPU oracle.
    Cpu(Box<Runner<CpuBackend>>),
    /// On the GPU.
    Gpu(Box<Runner<GpuBackend>>),
}

/// An assembled engine: the configured model and the plan it was sized by.
pub struct Engine {
    /// The model, configured.
    pub model: AnyModel,
    /// What the memory plan decided (its lines were printed at start-up).
    pub plan: Plan,
    /// The cache settings, for the end-of-run writes.
    cache: CacheConfig,
}

impl Engine {
    /// Runs `job` on the model, then ends the run: the routing trace and usage history are
    /// written whether or not the job succeeded (a failed run's trace shows where it was);
    /// the job's error comes first.
    pub fn run<J: ModelJob>(self, job: J) -> Result<J::Out> {
        let Engine {
            mut model,
            cache,
            plan,
        } = self;
        match &mut model {
            AnyModel::Cpu(m) => finish(job.run(m.as_mut(), &plan), &cache, m),
            AnyModel::Gpu(m) => finish(job.run(m.as_mut(), &plan), &cache, m),
        }
    }
}

/// The job's result after the end-of-run writes; the job's error comes first.
fn finish<B: Backend, T>(out: Result<T>, cache: &CacheConfig, model: &Runner<B>) -> Result<T> {
    let fin = cache.finish(model);
    let out = out?;
    fin?;
    Ok(out)
}

/// Assembles an engine from an [`EngineConfig`].
#[derive(Clone, Debug)]
pub struct EngineBuilder {
    config: EngineConfig,
}

impl EngineBuilder {
    /// A builder for `config`.
    pub fn new(config: EngineConfig) -> Self {
        EngineBuilder { config }
    }

    /// The config it builds from.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Builds the engine for the checkpoint at `dir` with the prompt cache as `job` asks,
    /// then runs `job` on it.
    pub fn run<J: ModelJob>(mut self, dir: &Path, job: J) -> Result<J::Out> {
        self.config.prompt_cache.in_use = J::PROMPT_CACHE;
        self.config.parallel = job.parallel();
        self.build(dir)?.run(job)
    }

    /// Opens the checkpoint at `dir`, starts the backend, loads the model onto it, sizes
    /// the expert cache, tier or pool, the context and the prefill window against memory,
    /// installs the streaming settings and cache policy, and opens the prompt cache when
    /// it is in use, printing the start-up lines (`[K3] backend:`, `[K3][RAM_GB=...]`,
    /// `[K3] context:`, `[K3] prefill window`, ...) as it goes.
    pub fn build(self, dir: &Path) -> Result<Engine> {
        let c = &self.config;
        // First: every rank of a job takes part in the exchange of read rates.
        let ranks = crate::ranks::setup::plan(dir, &c.load.extra_dirs, &c.ranks.read_gbps)?;
        let f = c.formats;
        let policy = FormatPolicy::from_bits(f.bits, f.mla_bits, f.head_bits)?;
        c.check_before_load()?;
        let only = ranks.as_ref().and_then(|r| r.files.as_ref());
        let ckpt = Checkpoint::open_part(dir, &c.load.extra_dirs, only)?;
        let gpu = local_gpu(&c.backend.gpu);
        let (model, plan) = match select(c.backend.kind, &gpu, c.backend.gpu_variable_set)? {
            Selected::Gpu(g) => {
                tracing::info!("[K3] backend: {}{}", g.name(), local_gpu_note(&gpu));
                if c.backend.idot {
                    tracing::warn!("[K3] K3_IDOT=1 is a CPU-backend setting: the GPU runs exact");
                }
                let opts = self.load_options();
                let model = crate::ranks::setup::load(ckpt, *g, policy, &opts)?;
                let (runner, plan) = self.configure(model, &policy, ranks)?;
                (AnyModel::Gpu(Box::new(runner)), plan)
            }
            Selected::Cpu { fallback } => {
                if let Some(line) = fallback {
                    tracing::info!("{line}");
                }
                let idot = c
                    .backend
                    .idot
                    .then(|| IdotKernel::for_level(crate::quant::simd::level()));
                let cpu = CpuBackend::with_idot(idot);
                tracing::info!("[K3] backend: {}", crate::backend::cpu::describe(&cpu));
                if idot.is_some() {
                    tracing::info!(
                        "[K3] K3_IDOT=1: routed experts on int8 activations (not exact)"
                    );
                }
                let opts = self.load_options();
                let model = crate::ranks::setup::load(ckpt, cpu, policy, &opts)?;
                let (runner, plan) = self.configure(model, &policy, ranks)?;
                (AnyModel::Cpu(Box::new(runner)), plan)
            }
        };
        Ok(Engine {
            model,
            plan,
            cache: self.config.cache,
        })
    }

    /// Builds the engine for the checkpoint at `dir` as a rank other than the head of an
    /// expert-parallel job and serves the head's requests until it says stop. A failed
    /// start is reported to the head, which names this rank, its host and the error.
    #[cfg(feature = "mpi")]
    pub fn run_rank_worker(mut self, dir: &Path) -> Result<()> {
        self.config.prompt_cache.in_use = false;
        match self.build(dir) {
            Err(e) => {
                crate::ranks::worker::report_failure(&e);
                Err(e)
            }
            Ok(engine) => engine.run(RankWorkerJob),
        }
    }

    /// On the head of an expert-parallel job, waits for every rank's start-up report and
    /// returns the ranks for the model's runtime; elsewhere `None`.
    #[cfg(feature = "mpi")]
    fn join_ranks<B: Backend>(
        &self,
        model: &K3Model<B>,
        ranks: Option<crate::ranks::setup::RankPlan>,
    ) -> Result<Option<std::sync::Arc<dyn crate::experts::remote::RemoteExperts>>> {
        use crate::ranks::{head, world};
        let Some(ranks) = ranks.filter(|_| world::is_head()) else {
            return Ok(None);
        };
        let size = ranks.placement.ranks();
        let experts = model.ckpt.config.num_experts;
        tracing::info!("[K3] rank read rates: {}", ranks.rates_line());
        let own = crate::ranks::worker::hello(Some(model), None);
        let wait = std::time::Duration::from_secs(self.config.ranks.timeout_s);
        let h = head::Head::connect(ranks.placement, own, wait, wait)?;
        for (r, hello) in h.hellos().iter().enumerate() {
            let own = h.placement().owned(0, r);
            let rate = ranks.rates.get(r).copied().unwrap_or(0.0);
            tracing::info!(
                "[K3] rank {r} of {size} on {} (pid {}): experts {}..{} of layer 0's {experts}, {rate:.2} GB/s, {}",
                hello.host,
                hello.pid,
                own.start,
                own.end,
                hello.backend
            );
        }
        let h = std::sync::Arc::new(h);
        head::set_current(h.clone());
        Ok(Some(h))
    }

    #[cfg(not(feature = "mpi"))]
    fn join_ranks<B: Backend>(
        &self,
        _model: &K3Model<B>,
        _ranks: Option<crate::ranks::setup::RankPlan>,
    ) -> Result<Option<std::sync::Arc<dyn crate::experts::remote::RemoteExperts>>> {
        Ok(None)
    }

    /// The progress bar, weight cache and start-up lines the config asks for.
    fn load_options(&self) -> LoadOptions {
        LoadOptions {
            progress: !self.config.load.quiet,
            weight_cache: if self.config.load.weight_cache {
                WeightCacheSetting::Auto
            } else {
                WeightCacheSetting::Off
            },
            announce: true,
        }
    }

    /// Everything after the load: the plan (streaming, cache and window sizing), the
    /// prompt cache and the other ranks, then the model's runtime, built once.
    fn configure<B: Backend>(
        &self,
        model: K3Model<B>,
        policy: &FormatPolicy,
        ranks: Option<crate::ranks::setup::RankPlan>,
    ) -> Result<(Runner<B>, Plan)> {
        let c = &self.config;
        let (plan, mut settings) = plan_runtime(&model, c)?;
        if c.prompt_cache.in_use {
            settings.prompt_cache = self.open_prompt_cache(&model, policy)?;
        }
        settings.remote = self.join_ranks(&model, ranks)?;
        let runner = Runner::new(model, settings)?;
        runner.rt.progress().set_print(!c.load.quiet);
        Ok((runner, plan))
    }

    /// Opens the prompt cache for `model` under the identity of everything that changes
    /// its state: the weights and formats, the backend, the CPU kernel set (the SIMD level
    /// and the integer-dot kernels) and the expert selection. The prefill window is not part of it: on the CPU every window
    /// gives the same bits (`tests/model/model_cpu.rs`), on the GPU the same results within the
    /// tolerance windows already have, so a state stored under one window serves them all.
    fn open_prompt_cache<B: Backend>(
        &self,
        model: &K3Model<B>,
        policy: &FormatPolicy,
    ) -> Result<Option<std::sync::Arc<crate::model::prompt_cache::PromptCache>>> {
        let c = &self.config;
        // The CPU kernels' level (`K3_SIMD`) changes the bits of every CPU matmul and
        // attention kernel, as the integer-dot kernels (`K3_IDOT`) do.
        let numerics = format!(
            "simd {} | idot {} | experts {:?}",
            crate::quant::simd::level().name(),
            u8::from(c.backend.idot),
            c.experts.selection()?,
        );
        c.prompt_cache.open(model, policy, &numerics)
    }
}

/// The GPU options with, on a host running several ranks of an expert-parallel job and no
/// `--adapter`, the rank's own GPU (the local rank-th of the host's best ones, modulo their
/// count).
fn local_gpu(gpu: &crate::backend::gpu::GpuOptions) -> crate::backend::gpu::GpuOptions {
    #[cfg(feature = "mpi")]
    if let Some(i) = crate::ranks::world::info().filter(|i| i.local_size > 1) {
        if gpu.adapter.is_none() {
            return crate::backend::gpu::GpuOptions {
                gpu_index: Some(i.local_rank),
                ..gpu.clone()
            };
        }
    }
    gpu.clone()
}

/// What the backend line adds on a host running several ranks: which GPU this rank took.
fn local_gpu_note(gpu: &crate::backend::gpu::GpuOptions) -> String {
    #[cfg(feature = "mpi")]
    if let Some(i) = crate::ranks::world::info().filter(|i| i.local_size > 1) {
        use crate::backend::gpu::device::adapters;
        let count = if gpu.adapter.is_some() {
            0
        } else {
            adapters::best_type_count(&adapters::enumerate(&adapters::instance()))
        };
        return crate::ranks::gpu_note(
            i.rank,
            i.local_rank,
            i.local_size,
            &i.host,
            gpu.adapter.is_some(),
            count,
        );
    }
    let _ = gpu;
    String::new()
}

/// A rank's work besides the head: serve the head's expert requests.
#[cfg(feature = "mpi")]
struct RankWorkerJob;

#[cfg(feature = "mpi")]
impl ModelJob for RankWorkerJob {
    type Out = ();
    fn run<B: Backend>(self, model: &mut Runner<B>, _plan: &Plan) -> Result<()> {
        crate::ranks::worker::serve(model)
    }
}
