//! Bytes of the weights the GPU holds apart from routed experts, per precision of the dense projections.
//! Mirrors what the daemon uploads (`engine/gpu`): projections in the chosen format (widths the
//! quantized kernels cannot take stay bf16), routers, MLA's `kv_b` and norms in f32, the embedding
//! table in bf16 when it is on the GPU. GGUF tensors whose codes the GPU keeps are counted in the
//! layout they keep ([`crate::stored`]).
use crate::shape::{Attention, ModelShape};
use crate::stored::{gate_up_bytes, GpuLayout, StoredDense, StoredFormat};

/// Precision of the dense projections on the GPU (attention, dense MLP, shared experts, lm_head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DenseDtype {
    #[default]
    Bf16,
    /// E4M3 weights, f32 scale per row and group of inputs (W8A16).
    Fp8,
    /// 4-bit symmetric, f16 scale per row and group of inputs (W4A16).
    Int4,
}

impl DenseDtype {
    pub const ALL: [DenseDtype; 3] = [DenseDtype::Bf16, DenseDtype::Fp8, DenseDtype::Int4];

    pub fn as_str(self) -> &'static str {
        match self {
            DenseDtype::Bf16 => "bf16",
            DenseDtype::Fp8 => "fp8",
            DenseDtype::Int4 => "int4",
        }
    }

    /// The group along the input dimension the quantized kernels use for a row of `cols`: the largest
    /// of 128, 64, 32 (and 16 for fp8) dividing it; `None` (the matrix stays bf16) otherwise. The
    /// kernels crate's `group_for` is the same rule (a daemon test compares them).
    pub fn group_for(self, cols: u64) -> Option<u64> {
        let candidates: &[u64] = match self {
            DenseDtype::Bf16 => return None,
            DenseDtype::Int4 => &[128, 64, 32],
            DenseDtype::Fp8 => &[128, 64, 32, 16],
        };
        candidates
            .iter()
            .copied()
            .find(|&g| cols > 0 && cols.is_multiple_of(g))
    }

    /// Bytes of an `[out, in]` projection of values in this format on the GPU, scales included.
    pub fn matrix_bytes(self, out: u64, inp: u64) -> u64 {
        self.stored_matrix_bytes(StoredFormat::Values, out, inp)
    }

    /// Bytes of an `[out, in]` projection stored as `stored` in this format on the GPU (GGUF codes
    /// kept where a GPU layout holds them, see [`crate::stored`]).
    pub fn stored_matrix_bytes(self, stored: StoredFormat, out: u64, inp: u64) -> u64 {
        GpuLayout::of(self, stored, inp).bytes(out, inp)
    }
}

impl std::str::FromStr for DenseDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bf16" => Ok(Self::Bf16),
            "fp8" => Ok(Self::Fp8),
            "int4" => Ok(Self::Int4),
            _ => Err(format!("dense dtype `{s}`: bf16, fp8 or int4")),
        }
    }
}

/// GPU bytes of everything but routed experts, split the way the plan prints them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DenseBytes {
    /// q/k/v/o or MLA projections, all layers (biases included).
    pub attention: u64,
    /// MLP of the dense (non-MoE) layers.
    pub dense_mlp: u64,
    pub shared_experts: u64,
    /// Routers (f32), MLA's kv_b (f32), norms.
    pub f32_small: u64,
    pub lm_head: u64,
    /// The embedding table (0 when it stays in host memory).
    pub embeddings: u64,
}

impl DenseBytes {
    pub fn total(&self) -> u64 {
        self.attention
            + self.dense_mlp
            + self.shared_experts
            + self.f32_small
            + self.lm_head
            + self.embeddings
    }
}

/// The dense part of `shape` on the GPU with projections in `dtype`, the embedding table on the
/// GPU unless `host_embeddings`. Projections a GGUF file stores in blocks (`shape.stored`) are
/// counted in the layout the GPU keeps them in.
pub fn dense_bytes(shape: &ModelShape, dtype: DenseDtype, host_embeddings: bool) -> DenseBytes {
    let h = shape.hidden;
    let none = StoredDense::default();
    let stored = shape.stored.as_ref().unwrap_or(&none);
    let m = |f: StoredFormat, out: u64, inp: u64| dtype.stored_matrix_bytes(f, out, inp);
    let mut b = DenseBytes::default();
    // one attention layer's projections stored as `f`, and its f32 extras
    let attention_layer = |f: [StoredFormat; 4]| -> (u64, u64) {
        match &shape.attention {
            Attention::Gqa {
                heads,
                kv_heads,
                head_dim,
                qkv_bias,
            } => {
                let (q, kv) = (heads * head_dim, kv_heads * head_dim);
                let bias = if *qkv_bias { (q + 2 * kv) * 4 } else { 0 };
                // q_norm / k_norm (Qwen3, GLM with qk norm): two head_dim vectors
                (
                    m(f[0], q, h) + m(f[1], kv, h) + m(f[2], kv, h) + m(f[3], h, q) + bias,
                    2 * head_dim * 4,
                )
            }
            Attention::Mla {
                heads,
                q_lora_rank,
                kv_lora_rank,
                qk_nope_head_dim,
                qk_rope_head_dim,
                v_head_dim,
            } => {
                let qk = qk_nope_head_dim + qk_rope_head_dim;
                let (q, q_norm) = match q_lora_rank {
                    Some(r) => (m(f[0], *r, h) + m(f[1], heads * qk, *r), r * 4),
                    None => (m(f[0], heads * qk, h), 0),
                };
                let kv_a = m(f[2], kv_lora_rank + qk_rope_head_dim, h);
                let o = m(f[3], h, heads * v_head_dim);
                let kv_b = heads * (qk_nope_head_dim + v_head_dim) * kv_lora_rank * 4;
                (q + kv_a + o, kv_b + q_norm + kv_lora_rank * 4)
            }
        }
    };
    let moe_layers = shape.moe_layers();
    let dense_layers = shape.layers - moe_layers;
    // Linear-attention layers (hybrid models) have projections of their own instead.
    let (linear, linear_attn, linear_small) = match &shape.hybrid {
        Some(hy) if hy.linear_layers > 0 => {
            let (w, rank, heads) = (
                hy.linear_heads * hy.linear_head_dim,
                hy.linear_head_dim,
                hy.linear_heads,
            );
            let v = StoredFormat::Values;
            // q, k, v stacked; forget and output gates as low-rank pairs (rank = head width); β; o
            let proj =
                m(v, 3 * w, h) + 2 * (m(v, rank, h) + m(v, w, rank)) + m(v, heads, h) + m(v, h, w);
            // convolution [3w, kernel], dt_bias [w], A_log [heads], o_norm [head width], f32
            let small = (3 * w * hy.conv_kernel + w + heads + hy.linear_head_dim) * 4;
            (hy.linear_layers.min(shape.layers), proj, small)
        }
        _ => (0, 0, 0),
    };
    let mut attn_small = 0;
    for i in 0..(shape.layers - linear) as usize {
        let (proj, small) = attention_layer(stored.attention_of(i));
        b.attention += proj;
        attn_small = small;
    }
    b.attention += linear_attn * linear;
    b.f32_small = (attn_small + 2 * h * 4) * (shape.layers - linear)
        + (linear_small + 2 * h * 4) * linear
        + h * 4;
    // Hybrid models' f32 extras: each own indexer's weights, each layer's hyper-connections.
    if let Some(hy) = &shape.hybrid {
        b.f32_small += (hy.indexer_layers * hy.indexer_weight_floats
            + shape.layers * hy.hyper_weight_floats)
            * 4;
    }
    // gate and up stacked into one matrix, down on its own
    let mlp = |inter: u64, f: [StoredFormat; 3]| {
        gate_up_bytes(dtype, f[0], f[1], inter, h) + m(f[2], h, inter)
    };
    b.dense_mlp = (0..dense_layers as usize)
        .map(|i| mlp(shape.dense_intermediate, stored.dense_mlp_of(i)))
        .sum();
    if let Some(moe) = &shape.moe {
        if moe.shared_intermediate > 0 {
            b.shared_experts = (0..moe_layers as usize)
                .map(|i| mlp(moe.shared_intermediate, stored.shared_of(i)))
                .sum();
        }
        let gate = if moe.shared_gate { h * 4 } else { 0 };
        // router [experts, hidden] f32 (+ correction bias)
        b.f32_small += moe_layers * (moe.experts * h * 4 + moe.experts * 4 + gate);
    }
    let table_on_gpu = !host_embeddings;
    b.embeddings = if table_on_gpu { shape.vocab * h * 2 } else { 0 };
    // A tied lm_head shares the table only when both are bf16 on the GPU.
    b.lm_head = if shape.tied_embeddings && table_on_gpu && dtype == DenseDtype::Bf16 {
        0
    } else {
        m(stored.lm_head, shape.vocab, h)
    };
    b
}

/// The layout the GPU gives the lm_head of `shape` under `dtype` (for the plan's description).
pub fn lm_head_layout(shape: &ModelShape, dtype: DenseDtype) -> GpuLayout {
    let stored = shape
        .stored
        .as_ref()
        .map_or(StoredFormat::Values, |s| s.lm_head);
    GpuLayout::of(dtype, stored, shape.hidden)
}
