//! Model definitions: `config.json` parsing ([`config`]) and the layer structures every architecture is
//! built from ([`build`]). An architecture differs from another only in its config fields and tensor
//! names ([`names`]); the blocks (RMSNorm, GQA / MLA attention, dense MLP, MoE with its router variants)
//! are shared.
pub mod build;
mod build_hybrid;
pub mod config;
pub mod hybrid;
pub mod names;

use crate::engine::linear::Linear;
pub use config::{Arch, ModelConfig};

/// A gated MLP: down(act(gate(x)) · up(x)).
pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

/// Grouped-query attention (MHA and MQA are special cases).
pub struct GqaAttention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    /// Per-head RMSNorm weights on q and k before RoPE (Qwen3, GLM with use_qk_norm).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
}

pub enum MlaQuery {
    /// `q_lora_rank` null: one projection.
    Direct(Linear),
    /// q_a_proj → q_a_layernorm → q_b_proj.
    LowRank {
        a: Linear,
        norm: Vec<f32>,
        b: Linear,
    },
}

/// Multi-head latent attention. The cache holds the normalised latent (`kv_lora_rank`) and the roped
/// shared key part (`qk_rope_head_dim`) per position; `kv_b` is applied in absorbed form (queries are
/// projected into latent space, outputs out of it), so the cache is never expanded per head.
pub struct MlaAttention {
    pub q: MlaQuery,
    pub kv_a: Linear,
    pub kv_a_norm: Vec<f32>,
    /// kv_b_proj as f32, `[heads × (nope + v), kv_lora_rank]`.
    pub kv_b: Vec<f32>,
    pub o: Linear,
    /// Sparse attention (GLM-5): which earlier positions each query attends. None: all of them.
    pub indexer: Option<SparseAttention>,
}

/// The sparse-attention indexer of an MLA layer ([`crate::engine::indexer`]).
pub enum SparseAttention {
    /// The layer runs its own indexer.
    Own(Box<crate::engine::indexer::IndexerWeights>),
    /// The layer attends the positions the nearest earlier `Own` layer selected for the same tokens.
    Shared,
}

/// KDA-style gated delta-rule linear attention (GLM-5.3-Flash's linear layers). Per sequence it keeps a
/// `head_dim × head_dim` state per head and the last inputs of the short convolution instead of a KV
/// cache (`engine::cpu::linear_attention`).
pub struct LinearAttention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    /// Depthwise causal convolution over the concatenated q, k, v channels: `[3 · qkv_dim, kernel]`,
    /// f32 (checkpoints store it as `q_conv1d`, `k_conv1d`, `v_conv1d`).
    pub conv: Vec<f32>,
    /// Forget gate: f_b(f_a(x)) + dt_bias, `A_log` per head.
    pub f_a: Linear,
    pub f_b: Linear,
    pub dt_bias: Vec<f32>,
    pub a_log: Vec<f32>,
    /// Write strength β = sigmoid(b(x)), one per head.
    pub b: Linear,
    /// Output gate g_b(g_a(x)) of the gated RMSNorm (weight `o_norm`, per head).
    pub g_a: Linear,
    pub g_b: Linear,
    pub o_norm: Vec<f32>,
    pub o: Linear,
}

// One per layer: the size difference between variants costs nothing worth boxing for.
#[allow(clippy::large_enum_variant)]
pub enum Attention {
    Gqa(GqaAttention),
    Mla(MlaAttention),
    Linear(LinearAttention),
}

/// One hyper-connection (before a layer's attention or its FFN): `fn` `[(2 + m) · m, m · hidden]`,
/// `base` `[(2 + m) · m]` and three scales (pre, post, comb), all f32.
pub struct HyperConnection {
    pub proj: Vec<f32>,
    pub base: Vec<f32>,
    pub scale: [f32; 3],
}

/// The two hyper-connections of a layer.
pub struct LayerHyper {
    pub attn: HyperConnection,
    pub ffn: HyperConnection,
}

/// Routed experts of one MoE layer plus its router and shared expert.
pub struct MoeBlock {
    /// Router weight `[experts, hidden]` in f32 (routers run in f32).
    pub router: Vec<f32>,
    /// e_score_correction_bias (sigmoid routers), used for selection only.
    pub correction_bias: Option<Vec<f32>>,
    /// Indexed by expert id; `None` when the expert does not live in DRAM (it is on the GPU).
    pub experts: Vec<Option<Mlp>>,
    pub shared: Option<Mlp>,
    /// Qwen2-MoE: `[hidden]` weight of the sigmoid gate on the shared expert.
    pub shared_gate: Option<Vec<f32>>,
    /// DRAM experts packed for the CPU kernels (then `experts` holds `None` for them).
    pub cpu_set: Option<moe_kernels::cpu::moe::CpuExpertSet>,
}

// One per layer: the size difference between variants costs nothing worth boxing for.
#[allow(clippy::large_enum_variant)]
pub enum Ffn {
    Dense(Mlp),
    Moe(MoeBlock),
}

pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub attn: Attention,
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn,
    /// Hyper-connection weights (models with `hc_mult` residual streams).
    pub hyper: Option<LayerHyper>,
}

pub struct Model {
    pub config: ModelConfig,
    /// `[vocab, hidden]`
    pub embed: Linear,
    pub layers: Vec<Layer>,
    pub final_norm: Vec<f32>,
    /// None when tied to the embedding.
    pub lm_head: Option<Linear>,
}

impl Model {
    pub fn lm_head(&self) -> &Linear {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}
