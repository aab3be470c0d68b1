//! Building a [`K3Model`]: the dense weights loaded into the backend, or none for a rank
//! that runs routed experts only.

use super::{Attn, Ffn, K3Model, Layer, Output};
use crate::backend::{Backend, Glu};
use crate::checkpoint::model_tensors::{AttnTensors, FfnTensors, ModelTensors};
use crate::checkpoint::{Checkpoint, TensorSpec};
use crate::model::format_policy::FormatPolicy;
use crate::model::glu_mlp::GluMlp;
use crate::model::kda::Kda;
use crate::model::loader::{LoadOptions, Loader, Startup};
use crate::model::mla::Mla;
use crate::model::moe::Moe;
use crate::model::prefill_window::widest_row_bytes;
use crate::model::weight_cache::WeightCache;
use anyhow::{bail, Result};

impl<B: Backend> K3Model<B> {
    /// Loads every dense weight into the backend in the formats `policy` chooses.
    pub fn load(
        ckpt: Checkpoint,
        backend: B,
        policy: FormatPolicy,
        progress: bool,
    ) -> Result<Self> {
        let opts = LoadOptions {
            progress,
            ..LoadOptions::default()
        };
        Self::load_with(ckpt, backend, policy, &opts)
    }

    /// [`Self::load`] with the quantized-weight cache and start-up lines of `opts`.
    pub fn load_with(
        ckpt: Checkpoint,
        backend: B,
        policy: FormatPolicy,
        opts: &LoadOptions,
    ) -> Result<Self> {
        let process = crate::stats::process_start();
        let cfg = ckpt.config.clone();
        let cache = WeightCache::open(&ckpt, &policy, &opts.weight_cache);
        let ld = Loader::with_cache(&ckpt, &backend, opts.progress, cache);
        let tensors = ModelTensors::new(&cfg);
        // The embedding is read a row at a time, never loaded: its stored shape is checked
        // here, or a transposed one would surface only at the first matmul, unnamed.
        ld.check_stored(&tensors.embed)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (i, t) in tensors.layers.iter().enumerate() {
            let attn = match &t.attn {
                AttnTensors::Kda(a) => Attn::Kda(Kda::load(&ld, a, &policy)?),
                AttnTensors::Mla(a) => Attn::Mla(Mla::load(&ld, a, &policy)?),
            };
            let ffn = match &t.ffn {
                FfnTensors::Moe(m) => Ffn::Moe(Moe::load(&ld, i, m, &policy)?),
                FfnTensors::Dense(m) => Ffn::Dense(GluMlp::load(&ld, m, policy.dense)?),
            };
            layers.push(Layer {
                input_norm: ld.vector_act(&t.input_norm)?,
                post_norm: ld.vector_act(&t.post_norm)?,
                w_attn_res: ld.product_act(&t.attn_res_norm, &t.attn_res_proj)?,
                w_mlp_res: ld.product_act(&t.mlp_res_norm, &t.mlp_res_proj)?,
                attn,
                ffn,
            });
        }
        let final_norm = ld.vector_act(&tensors.norm)?;
        let w_out = ld.product_act(&tensors.out_res_norm, &tensors.out_res_proj)?;
        let head = ld.matrix(&tensors.head, policy.head)?;
        let unread = ld.unread();
        if !unread.is_empty() {
            bail!("internal: the model's blocks read none of {unread:?}, which the schema lists");
        }
        let dense_s = ld.elapsed_s();
        let (lines, cache_words, pending) = ld.finish_in_background(opts.announce);
        for line in lines {
            if opts.announce {
                tracing::info!("{line}");
            }
        }
        drop(ld);
        let startup = Startup::new(
            process.elapsed().as_secs_f64(),
            dense_s,
            cache_words,
            pending,
        );
        let output = Some(Output {
            final_norm,
            w_out,
            head,
        });
        Self::assemble(ckpt, backend, tensors.embed, layers, output, startup)
    }

    /// The model around its weights.
    fn assemble(
        ckpt: Checkpoint,
        backend: B,
        embed: TensorSpec,
        layers: Vec<Layer<B>>,
        output: Option<Output<B>>,
        startup: Startup,
    ) -> Result<Self> {
        let cfg = &ckpt.config;
        let mut backend = backend;
        // The widest row any op outside the routed experts takes: a backend whose bindings
        // bound an op's rows holds a window's activations in parts that fit it.
        backend.fit_rows(widest_row_bytes(cfg));
        Ok(Self {
            glu: Glu::Situ {
                beta: cfg.situ_beta,
                linear_beta: cfg.situ_linear_beta,
            },
            ckpt,
            backend,
            embed,
            layers,
            output,
            startup,
        })
    }

    /// A model holding no dense weights, only what runs routed experts (the checkpoint,
    /// and the backend): a rank other than the head of an expert-parallel job, which needs
    /// neither the dense shards nor the RAM they take. Its forward pass is an error; its
    /// experts are run through its runtime's expert source ([`Runtime::experts`](crate::model::runtime::Runtime::experts)).
    pub fn experts_only(ckpt: Checkpoint, backend: B) -> Result<Self> {
        let process = crate::stats::process_start();
        let embed = ModelTensors::new(&ckpt.config).embed;
        let startup = Startup::new(
            process.elapsed().as_secs_f64(),
            0.0,
            "no dense weights (routed experts only)".to_string(),
            None,
        );
        Self::assemble(ckpt, backend, embed, Vec::new(), None, startup)
    }
}
