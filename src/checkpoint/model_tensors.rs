//! The dense tensors of the K3 text model, block by block, each named once (through
//! [`TensorPrefix`]) with its canonical shape, class and kind. The model's blocks load the
//! tensors of their set, and the schema's list ([`super::schema::dense_tensors`]) is these
//! sets in checkpoint order, so a name cannot differ between the two
//! (docs/model.md#tensor-names).

use super::tensor::Dtype;
use super::tensor_prefix::TensorPrefix;
use super::tensor_spec::{TensorClass, TensorKind, TensorSpec};
use crate::config::{AttnKind, Config};

/// Makes the specs of one block: under one prefix, of one class, stored as BF16.
struct Block {
    prefix: TensorPrefix,
    class: TensorClass,
}

impl Block {
    fn new(prefix: TensorPrefix, class: TensorClass) -> Block {
        Block { prefix, class }
    }

    fn spec(&self, leaf: &str, shape: Vec<usize>, kind: TensorKind) -> TensorSpec {
        TensorSpec {
            name: self.prefix.tensor(leaf),
            shape,
            dtype: Dtype::Bf16,
            class: self.class,
            kind,
        }
    }

    /// A `[rows, cols]` matrix.
    fn matrix(&self, leaf: &str, rows: usize, cols: usize) -> TensorSpec {
        self.spec(leaf, vec![rows, cols], TensorKind::Matrix)
    }

    /// An RMSNorm weight of `width`.
    fn norm(&self, leaf: &str, width: usize) -> TensorSpec {
        self.spec(leaf, vec![width], TensorKind::Norm)
    }
}

/// Every dense tensor of the model.
pub struct ModelTensors {
    /// The token embedding, `[V, H]`: read a row per token, never loaded whole.
    pub embed: TensorSpec,
    /// Each layer's tensors.
    pub layers: Vec<LayerTensors>,
    /// The final RMSNorm.
    pub norm: TensorSpec,
    /// The attention-residual mix before the head: norm and projection.
    pub out_res_norm: TensorSpec,
    /// See [`Self::out_res_norm`].
    pub out_res_proj: TensorSpec,
    /// The output projection to the vocabulary, `[V, H]`.
    pub head: TensorSpec,
}

impl ModelTensors {
    /// The tensors `cfg` implies.
    pub fn new(cfg: &Config) -> ModelTensors {
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let model = TensorPrefix::root().push("model");
        let embed = Block::new(model.clone(), TensorClass::Embedding);
        let norm = Block::new(model.clone(), TensorClass::Norm);
        let res = Block::new(model, TensorClass::AttnRes);
        ModelTensors {
            embed: embed.spec("embed_tokens.weight", vec![v, h], TensorKind::Embedding),
            layers: (0..cfg.num_hidden_layers)
                .map(|i| LayerTensors::new(cfg, i))
                .collect(),
            norm: norm.norm("norm.weight", h),
            out_res_norm: res.norm("output_attn_res_norm.weight", h),
            out_res_proj: res.spec("output_attn_res_proj.weight", vec![h], TensorKind::ResProj),
            head: Block::new(TensorPrefix::root(), TensorClass::Head).matrix(
                "lm_head.weight",
                v,
                h,
            ),
        }
    }

    /// Every tensor in checkpoint order: the embedding, each layer's, the final ones.
    pub fn specs(&self) -> Vec<&TensorSpec> {
        let mut out = vec![&self.embed];
        out.extend(self.layers.iter().flat_map(LayerTensors::specs));
        out.extend(self.final_specs());
        out
    }

    /// The tensors after the last layer, in checkpoint order.
    pub fn final_specs(&self) -> [&TensorSpec; 4] {
        [
            &self.norm,
            &self.out_res_norm,
            &self.out_res_proj,
            &self.head,
        ]
    }
}

/// The tensors of one layer (`model.layers.{i}.*`).
pub struct LayerTensors {
    /// The RMSNorm before attention.
    pub input_norm: TensorSpec,
    /// The RMSNorm before the FFN.
    pub post_norm: TensorSpec,
    /// The attention-residual mix before attention: norm and projection.
    pub attn_res_norm: TensorSpec,
    /// See [`Self::attn_res_norm`].
    pub attn_res_proj: TensorSpec,
    /// The attention-residual mix before the FFN: norm and projection.
    pub mlp_res_norm: TensorSpec,
    /// See [`Self::mlp_res_norm`].
    pub mlp_res_proj: TensorSpec,
    /// The attention block.
    pub attn: AttnTensors,
    /// The FFN block.
    pub ffn: FfnTensors,
}

/// A layer's attention block.
pub enum AttnTensors {
    /// Kimi Delta Attention.
    Kda(Box<KdaTensors>),
    /// Gated multi-head latent attention.
    Mla(Box<MlaTensors>),
}

/// A layer's FFN block.
pub enum FfnTensors {
    /// The dense MLP of the first layers (`mlp.*`).
    Dense(Box<GluTensors>),
    /// The latent MoE.
    Moe(Box<MoeTensors>),
}

impl LayerTensors {
    /// Layer `i`'s tensors.
    pub fn new(cfg: &Config, i: usize) -> LayerTensors {
        let h = cfg.hidden_size;
        let p = TensorPrefix::layer(i);
        let norm = Block::new(p.clone(), TensorClass::Norm);
        let res = Block::new(p.clone(), TensorClass::AttnRes);
        let proj = |leaf: &str| res.spec(leaf, vec![h], TensorKind::ResProj);
        let attn = match cfg.layer_kinds[i] {
            AttnKind::Kda => AttnTensors::Kda(Box::new(KdaTensors::new(cfg, &p))),
            AttnKind::Mla => AttnTensors::Mla(Box::new(MlaTensors::new(cfg, &p))),
        };
        let ffn = if cfg.is_moe_layer(i) {
            FfnTensors::Moe(Box::new(MoeTensors::new(cfg, i)))
        } else {
            let w = cfg.intermediate_size;
            let mlp = GluTensors::new(&p.push("mlp"), TensorClass::DenseMlp, w, h);
            FfnTensors::Dense(Box::new(mlp))
        };
        LayerTensors {
            input_norm: norm.norm("input_layernorm.weight", h),
            post_norm: norm.norm("post_attention_layernorm.weight", h),
            attn_res_norm: res.norm("self_attention_res_norm.weight", h),
            attn_res_proj: proj("self_attention_res_proj.weight"),
            mlp_res_norm: res.norm("mlp_res_norm.weight", h),
            mlp_res_proj: proj("mlp_res_proj.weight"),
            attn,
            ffn,
        }
    }

    /// Every tensor of the layer in checkpoint order: norms, residual mixes, attention, FFN.
    pub fn specs(&self) -> Vec<&TensorSpec> {
        let LayerTensors {
            input_norm,
            post_norm,
            attn_res_norm,
            attn_res_proj,
            mlp_res_norm,
            mlp_res_proj,
            attn,
            ffn,
        } = self;
        let mut out = vec![
            input_norm,
            post_norm,
            attn_res_norm,
            attn_res_proj,
            mlp_res_norm,
            mlp_res_proj,
        ];
        match attn {
            AttnTensors::Kda(t) => out.extend(t.specs()),
            AttnTensors::Mla(t) => out.extend(t.specs()),
        }
        match ffn {
            FfnTensors::Dense(t) => out.extend(t.specs()),
            FfnTensors::Moe(t) => out.extend(t.specs()),
        }
        out
    }
}

/// A KDA layer's tensors (`model.layers.{i}.self_attn.*`, docs/model.md#kda-layer).
pub struct KdaTensors {
    /// The query projection, `[P, H]` (P = heads · head_dim).
    pub q_proj: TensorSpec,
    /// The key projection, `[P, H]`.
    pub k_proj: TensorSpec,
    /// The value projection, `[P, H]`.
    pub v_proj: TensorSpec,
    /// The full-rank output gate, `[P, H]`.
    pub g_proj: TensorSpec,
    /// The output projection, `[H, P]`.
    pub o_proj: TensorSpec,
    /// The queries' causal short convolution (`q_conv1d`), `[P, 1, K]`.
    pub q_conv: TensorSpec,
    /// The keys' short convolution, `[P, 1, K]`.
    pub k_conv: TensorSpec,
    /// The values' short convolution, `[P, 1, K]`.
    pub v_conv: TensorSpec,
    /// The decay gate's low-rank input projection, `[head_dim, H]`.
    pub f_a_proj: TensorSpec,
    /// The decay gate's output projection, `[P, head_dim]`.
    pub f_b_proj: TensorSpec,
    /// The per-head write strength β, `[heads, H]`.
    pub b_proj: TensorSpec,
    /// The decay gate's bias, `[P]`.
    pub dt_bias: TensorSpec,
    /// The per-head decay rate (`A_log`), `[1, 1, heads, 1]`.
    pub a_log: TensorSpec,
    /// The per-head output RMSNorm, `[head_dim]`.
    pub o_norm: TensorSpec,
}

impl KdaTensors {
    fn new(cfg: &Config, layer: &TensorPrefix) -> KdaTensors {
        let b = Block::new(layer.push("self_attn"), TensorClass::Kda);
        let (h, p) = (cfg.hidden_size, cfg.kda_width());
        let (heads, hd, k) = (cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.conv_kernel);
        let conv = |leaf: &str| b.spec(leaf, vec![p, 1, k], TensorKind::Conv);
        KdaTensors {
            q_proj: b.matrix("q_proj.weight", p, h),
            k_proj: b.matrix("k_proj.weight", p, h),
            v_proj: b.matrix("v_proj.weight", p, h),
            g_proj: b.matrix("g_proj.weight", p, h),
            o_proj: b.matrix("o_proj.weight", h, p),
            q_conv: conv("q_conv1d.weight"),
            k_conv: conv("k_conv1d.weight"),
            v_conv: conv("v_conv1d.weight"),
            f_a_proj: b.matrix("f_a_proj.weight", hd, h),
            f_b_proj: b.matrix("f_b_proj.weight", p, hd),
            b_proj: b.matrix("b_proj.weight", heads, h),
            dt_bias: b.spec("dt_bias", vec![p], TensorKind::DtBias),
            a_log: b.spec("A_log", vec![1, 1, heads, 1], TensorKind::ALog),
            o_norm: b.norm("o_norm.weight", hd),
        }
    }

    /// In checkpoint order.
    pub fn specs(&self) -> [&TensorSpec; 14] {
        let KdaTensors {
            q_proj,
            k_proj,
            v_proj,
            g_proj,
            o_proj,
            q_conv,
            k_conv,
            v_conv,
            f_a_proj,
            f_b_proj,
            b_proj,
            dt_bias,
            a_log,
            o_norm,
        } = self;
        [
            q_proj, k_proj, v_proj, g_proj, o_proj, q_conv, k_conv, v_conv, f_a_proj, f_b_proj,
            b_proj, dt_bias, a_log, o_norm,
        ]
    }
}

/// An MLA layer's tensors (`model.layers.{i}.self_attn.*`, docs/model.md#mla-layer).
pub struct MlaTensors {
    /// The query's low-rank down projection, `[q_lora, H]`.
    pub q_a_proj: TensorSpec,
    /// Its RMSNorm (`q_a_layernorm`), `[q_lora]`.
    pub q_a_norm: TensorSpec,
    /// The query's up projection, `[heads · (nope + rope), q_lora]`.
    pub q_b_proj: TensorSpec,
    /// The latent and rope key (`kv_a_proj_with_mqa`), `[kv_lora + rope, H]`.
    pub kv_a_proj: TensorSpec,
    /// The latent's RMSNorm (`kv_a_layernorm`), `[kv_lora]`.
    pub kv_a_norm: TensorSpec,
    /// The latent's up projection to keys and values, `[heads · (nope + v), kv_lora]`.
    pub kv_b_proj: TensorSpec,
    /// The output gate, `[heads · v, H]`.
    pub g_proj: TensorSpec,
    /// The output projection, `[H, heads · v]`.
    pub o_proj: TensorSpec,
}

impl MlaTensors {
    fn new(cfg: &Config, layer: &TensorPrefix) -> MlaTensors {
        let b = Block::new(layer.push("self_attn"), TensorClass::Mla);
        let (h, heads) = (cfg.hidden_size, cfg.num_attention_heads);
        let (nope, rope, v) = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim);
        let (ql, kvl) = (cfg.q_lora_rank, cfg.kv_lora_rank);
        MlaTensors {
            q_a_proj: b.matrix("q_a_proj.weight", ql, h),
            q_a_norm: b.norm("q_a_layernorm.weight", ql),
            q_b_proj: b.matrix("q_b_proj.weight", heads * (nope + rope), ql),
            kv_a_proj: b.matrix("kv_a_proj_with_mqa.weight", kvl + rope, h),
            kv_a_norm: b.norm("kv_a_layernorm.weight", kvl),
            kv_b_proj: b.matrix("kv_b_proj.weight", heads * (nope + v), kvl),
            g_proj: b.matrix("g_proj.weight", heads * v, h),
            o_proj: b.matrix("o_proj.weight", h, heads * v),
        }
    }

    /// In checkpoint order.
    pub fn specs(&self) -> [&TensorSpec; 8] {
        let MlaTensors {
            q_a_proj,
            q_a_norm,
            q_b_proj,
            kv_a_proj,
            kv_a_norm,
            kv_b_proj,
            g_proj,
            o_proj,
        } = self;
        [
            q_a_proj, q_a_norm, q_b_proj, kv_a_proj, kv_a_norm, kv_b_proj, g_proj, o_proj,
        ]
    }
}

/// A MoE layer's dense tensors (`model.layers.{i}.block_sparse_moe.*`,
/// docs/model.md#moe-layer); the routed experts' are [`super::schema::expert_tensors`].
pub struct MoeTensors {
    /// The router's gate, `[E, H]`.
    pub gate: TensorSpec,
    /// The router's score correction, `[E]`.
    pub bias: TensorSpec,
    /// Into the experts' latent width, `[D, H]`.
    pub down: TensorSpec,
    /// Out of the latent width, `[H, D]`.
    pub up: TensorSpec,
    /// The RMSNorm on the summed latent output, when the config has one.
    pub norm: Option<TensorSpec>,
    /// The fused shared experts.
    pub shared: GluTensors,
}

impl MoeTensors {
    fn new(cfg: &Config, i: usize) -> MoeTensors {
        let p = TensorPrefix::moe(i);
        let (h, e, d) = (
            cfg.hidden_size,
            cfg.num_experts,
            cfg.routed_expert_hidden_size,
        );
        let router = Block::new(p.clone(), TensorClass::Router);
        let latent = Block::new(p.clone(), TensorClass::LatentProj);
        MoeTensors {
            gate: router.matrix("gate.weight", e, h),
            bias: router.spec(
                "gate.e_score_correction_bias",
                vec![e],
                TensorKind::RouterBias,
            ),
            down: latent.matrix("routed_expert_down_proj.weight", d, h),
            up: latent.matrix("routed_expert_up_proj.weight", h, d),
            norm: cfg
                .latent_moe_use_norm
                .then(|| latent.norm("routed_expert_norm.weight", d)),
            shared: GluTensors::new(
                &p.push("shared_experts"),
                TensorClass::SharedExpert,
                cfg.shared_width(),
                h,
            ),
        }
    }

    /// In checkpoint order.
    pub fn specs(&self) -> Vec<&TensorSpec> {
        let MoeTensors {
            gate,
            bias,
            down,
            up,
            norm,
            shared,
        } = self;
        let mut out = vec![gate, bias, down, up];
        out.extend(norm);
        out.extend(shared.specs());
        out
    }
}

/// A gated MLP's three projections (`{gate,up,down}_proj.weight`): the dense MLP and the
/// shared experts.
pub struct GluTensors {
    /// `[width, H]`.
    pub gate: TensorSpec,
    /// `[width, H]`.
    pub up: TensorSpec,
    /// `[H, width]`.
    pub down: TensorSpec,
}

impl GluTensors {
    fn new(p: &TensorPrefix, class: TensorClass, width: usize, h: usize) -> GluTensors {
        let b = Block::new(p.clone(), class);
        GluTensors {
            gate: b.matrix("gate_proj.weight", width, h),
            up: b.matrix("up_proj.weight", width, h),
            down: b.matrix("down_proj.weight", h, width),
        }
    }

    /// In checkpoint order.
    pub fn specs(&self) -> [&TensorSpec; 3] {
        [&self.gate, &self.up, &self.down]
    }
}
