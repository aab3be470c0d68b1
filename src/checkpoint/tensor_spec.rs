//! One expected tensor of a checkpoint as the schema lists it: its name, shape, dtype, what
//! it is for and what its values are. The block sets of `model_tensors.rs` build these and
//! the schema (`schema.rs`) lists them, so both name the type here.

use super::tensor::Dtype;

/// What a tensor is for; `k3 inspect` sums bytes per class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorClass {
    /// Token embedding table.
    Embedding,
    /// Output projection to the vocabulary.
    Head,
    /// RMSNorm weights of the residual path.
    Norm,
    /// Attention-residual norms and projections.
    AttnRes,
    /// KDA layer weights.
    Kda,
    /// MLA layer weights.
    Mla,
    /// Dense MLP of the first layers.
    DenseMlp,
    /// MoE router weights and bias.
    Router,
    /// Latent down/up projections and norm around the routed experts.
    LatentProj,
    /// The fused shared-expert MLP.
    SharedExpert,
    /// Routed expert MXFP4 tensors.
    RoutedExpert,
}

impl TensorClass {
    /// Every class, in report order.
    pub const ALL: [TensorClass; 11] = [
        TensorClass::Embedding,
        TensorClass::Head,
        TensorClass::Norm,
        TensorClass::AttnRes,
        TensorClass::Kda,
        TensorClass::Mla,
        TensorClass::DenseMlp,
        TensorClass::Router,
        TensorClass::LatentProj,
        TensorClass::SharedExpert,
        TensorClass::RoutedExpert,
    ];
}

/// What a tensor's values are: decides the stored forms a reader accepts besides the
/// canonical one ([`dtype_accepted`](super::schema::dtype_accepted),
/// [`shape_accepted`](super::schema::shape_accepted)) and how `k3 synth` draws them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorKind {
    /// A weight matrix.
    Matrix,
    /// The token embedding table.
    Embedding,
    /// An RMSNorm weight.
    Norm,
    /// An attention-residual projection vector: `[H]`, or `[1, H]` as stored by some exports.
    ResProj,
    /// A KDA short convolution: `[P, 1, K]`, or `[P, K]`.
    Conv,
    /// KDA's per-head decay rate: F32 or BF16, padded or not (at least `heads` entries
    /// along its only non-unit dimension).
    ALog,
    /// KDA's decay bias: F32 or BF16, in any shape of `P` elements.
    DtBias,
    /// The router's score correction: F32 or BF16.
    RouterBias,
    /// A routed expert's packed MXFP4 nibbles.
    ExpertPacked,
    /// A routed expert's E8M0 scales.
    ExpertScale,
}

/// One expected tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Canonical name, without the `language_model.` prefix.
    pub name: String,
    /// Canonical shape: what a writer writes.
    pub shape: Vec<usize>,
    /// Canonical dtype: what a writer writes (see
    /// [`dtype_accepted`](super::schema::dtype_accepted) for what a reader takes).
    pub dtype: Dtype,
    /// What the tensor is for.
    pub class: TensorClass,
    /// What its values are.
    pub kind: TensorKind,
}

impl TensorSpec {
    /// Number of elements of the canonical shape.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of the canonical shape and dtype.
    pub fn byte_len(&self) -> usize {
        self.numel() * self.dtype.size()
    }
}
