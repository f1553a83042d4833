//! Dense projections a checkpoint stores as GGUF blocks, and the layout each takes on the GPU.
//!
//! The GPU loader keeps a GGUF tensor's codes wherever a GPU layout holds them (the daemon's
//! `engine::gpu::quantize_linear`, which a daemon test holds to [`GpuLayout::of`]):
//!
//! | stored | `--dense-dtype int4` | `--dense-dtype fp8` | bytes per weight |
//! |---|---|---|---|
//! | Q4_0 | int4 groups of 32, f16 scale | E4M3 from the values | 0.5625 (int4) |
//! | Q4_1, Q4_K | int4 groups of 32, f16 scale and minimum | E4M3 from the values | 0.625 (int4) |
//! | Q8_0 | int8 groups of 32, f32 scale | the same | 1.125 |
//! | Q6_K | int8 groups of 16, f32 scale | the same | 1.25 |
//! | Q5_0 | int8 groups of 32 (its codes q − 16), f32 scale | the same | 1.125 |
//! | Q5_K, Q5_1 | quantized to int8 groups of 32 | the same | 1.125 |
//! | values (F32 / F16 / BF16, FP8 blocks) | int4 at [`DenseDtype::group_for`] | E4M3 likewise | 0.516 / 1.031 at groups of 128 |
//!
//! Against the dtype's own layout (groups of 128): Q4_0 dense weights take 9 % more, Q4_1 / Q4_K 21 %
//! more, and an 8-bit lm_head kept as int8 about 2.2–2.4 times its int4 share. `--dense-dtype bf16`
//! dequantizes everything to bf16.
use crate::weights::DenseDtype;

/// How a checkpoint stores one dense projection, as far as GPU bytes depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum StoredFormat {
    /// Values (F32, F16, BF16) or FP8 blocks: quantized (or kept) at the dtype's own groups.
    #[default]
    Values,
    Q4_0,
    Q4_1,
    Q4K,
    Q5_0,
    Q5_1,
    Q5K,
    Q6K,
    Q8_0,
}

impl StoredFormat {
    /// llama.cpp's name of the block type.
    pub fn name(self) -> &'static str {
        match self {
            StoredFormat::Values => "values",
            StoredFormat::Q4_0 => "Q4_0",
            StoredFormat::Q4_1 => "Q4_1",
            StoredFormat::Q4K => "Q4_K",
            StoredFormat::Q5_0 => "Q5_0",
            StoredFormat::Q5_1 => "Q5_1",
            StoredFormat::Q5K => "Q5_K",
            StoredFormat::Q6K => "Q6_K",
            StoredFormat::Q8_0 => "Q8_0",
        }
    }

    /// Weights per GGML block (a valid row is a whole number of them).
    fn block_elems(self) -> u64 {
        match self {
            StoredFormat::Values => 1,
            StoredFormat::Q4_0
            | StoredFormat::Q4_1
            | StoredFormat::Q5_0
            | StoredFormat::Q5_1
            | StoredFormat::Q8_0 => 32,
            StoredFormat::Q4K | StoredFormat::Q5K | StoredFormat::Q6K => 256,
        }
    }
}

/// A dense `[rows, cols]` matrix as the GPU holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpuLayout {
    Bf16,
    /// 4-bit codes, an f16 scale per row and `group` inputs, and an f16 minimum per group (`mins`).
    Int4 {
        group: u64,
        mins: bool,
    },
    /// 8-bit codes (E4M3, or int8 kept from a GGUF file), an f32 scale per row and `group` inputs.
    W8 {
        group: u64,
        int8: bool,
    },
}

impl GpuLayout {
    /// Where a projection stored as `stored` with rows of `cols` goes under `dtype` (the daemon's
    /// `quantize_linear`): GGUF codes kept where a layout holds them (module table), else the
    /// dtype's own layout, else bf16 (widths the kernels cannot take).
    pub fn of(dtype: DenseDtype, stored: StoredFormat, cols: u64) -> GpuLayout {
        let whole_blocks = cols > 0 && cols.is_multiple_of(stored.block_elems());
        let int8 = |group: u64| GpuLayout::W8 { group, int8: true };
        match (dtype, stored) {
            (DenseDtype::Bf16, _) => return GpuLayout::Bf16,
            (_, StoredFormat::Q8_0 | StoredFormat::Q5_0) if whole_blocks => return int8(32),
            (_, StoredFormat::Q6K) if whole_blocks => return int8(16),
            // Q5_K and Q5_1 have no int8 code form: quantized to int8 at 32 (16) per scale
            (
                _,
                StoredFormat::Q8_0
                | StoredFormat::Q5_0
                | StoredFormat::Q6K
                | StoredFormat::Q5K
                | StoredFormat::Q5_1,
            ) => {
                if let Some(g) = [32, 16].into_iter().find(|g| cols.is_multiple_of(*g)) {
                    return int8(g);
                }
            }
            (DenseDtype::Int4, StoredFormat::Q4_0) if whole_blocks => {
                return GpuLayout::Int4 {
                    group: 32,
                    mins: false,
                }
            }
            (DenseDtype::Int4, StoredFormat::Q4_1 | StoredFormat::Q4K) if whole_blocks => {
                return GpuLayout::Int4 {
                    group: 32,
                    mins: true,
                }
            }
            _ => {}
        }
        match (dtype, dtype.group_for(cols)) {
            (DenseDtype::Int4, Some(group)) => GpuLayout::Int4 { group, mins: false },
            (DenseDtype::Fp8, Some(group)) => GpuLayout::W8 { group, int8: false },
            _ => GpuLayout::Bf16,
        }
    }

    /// Device bytes of a `[rows, cols]` matrix in this layout, scales and minimums included.
    pub fn bytes(self, rows: u64, cols: u64) -> u64 {
        match self {
            GpuLayout::Bf16 => rows * cols * 2,
            GpuLayout::Int4 { group, mins } => {
                rows * cols / 2 + rows * (cols / group) * if mins { 4 } else { 2 }
            }
            GpuLayout::W8 { group, .. } => rows * cols + rows * (cols / group) * 4,
        }
    }

    /// Short description for the printed plan: `int4/32 + minimums`, `int8/16`.
    pub fn describe(self) -> String {
        match self {
            GpuLayout::Bf16 => "bf16".into(),
            GpuLayout::Int4 { group, mins } => {
                format!("int4/{group}{}", if mins { " + minimums" } else { "" })
            }
            GpuLayout::W8 { group, int8 } => {
                format!("{}/{group}", if int8 { "int8" } else { "fp8" })
            }
        }
    }
}

/// Bytes of an MLP's gate and up projections (`[inter, hidden]` each), which the GPU stacks into one
/// `[2·inter, hidden]` matrix: in their layout when both have the same one, else both in bf16 (the
/// daemon's `upload_mlp` does not mix groups or codes in one matrix).
pub fn gate_up_bytes(
    dtype: DenseDtype,
    gate: StoredFormat,
    up: StoredFormat,
    inter: u64,
    hidden: u64,
) -> u64 {
    let (a, b) = (
        GpuLayout::of(dtype, gate, hidden),
        GpuLayout::of(dtype, up, hidden),
    );
    let layout = if a == b { a } else { GpuLayout::Bf16 };
    layout.bytes(2 * inter, hidden)
}

/// The stored formats of a checkpoint's dense projections (GGUF files), in the order the plan counts
/// them. Missing entries are [`StoredFormat::Values`]. `ModelShape::stored` is `None` for
/// checkpoints of values and FP8 blocks, and for a shape read from `config.json` alone.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StoredDense {
    /// Per layer with softmax attention (linear-attention layers are skipped), in layer order: GQA
    /// `[q, k, v, o]`; MLA `[q (or q_a), q_b (Values when q is direct), kv_a, o]`.
    pub attention: Vec<[StoredFormat; 4]>,
    /// Per dense (non-MoE) layer, in layer order: `[gate, up, down]`.
    pub dense_mlp: Vec<[StoredFormat; 3]>,
    /// Per MoE layer with shared experts, in layer order: `[gate, up, down]`.
    pub shared_experts: Vec<[StoredFormat; 3]>,
    /// The lm_head, or the embedding table a tied lm_head is uploaded from.
    pub lm_head: StoredFormat,
}

impl StoredDense {
    /// Whether any projection is stored in a GGUF block format.
    pub fn any_blocks(&self) -> bool {
        let blocks = |f: &StoredFormat| *f != StoredFormat::Values;
        self.lm_head != StoredFormat::Values
            || self.attention.iter().flatten().any(blocks)
            || self.dense_mlp.iter().flatten().any(blocks)
            || self.shared_experts.iter().flatten().any(blocks)
    }

    /// The formats attention layer `i` stores (all values past the list).
    pub fn attention_of(&self, i: usize) -> [StoredFormat; 4] {
        self.attention.get(i).copied().unwrap_or_default()
    }

    pub fn dense_mlp_of(&self, i: usize) -> [StoredFormat; 3] {
        self.dense_mlp.get(i).copied().unwrap_or_default()
    }

    pub fn shared_of(&self, i: usize) -> [StoredFormat; 3] {
        self.shared_experts.get(i).copied().unwrap_or_default()
    }
}

/// The GGUF formats among `formats` that `dtype` keeps in another layout than its own (for the plan's
/// notes): `"Q4_K as int4/32 + minimums, Q8_0 as int8/32"`, empty when none.
pub fn kept_note(dtype: DenseDtype, formats: impl IntoIterator<Item = StoredFormat>) -> String {
    // a width every format's blocks and every group divide
    const COLS: u64 = 4096;
    let own = GpuLayout::of(dtype, StoredFormat::Values, COLS);
    let mut seen: Vec<StoredFormat> = Vec::new();
    for f in formats {
        if !seen.contains(&f) && GpuLayout::of(dtype, f, COLS) != own {
            seen.push(f);
        }
    }
    seen.iter()
        .map(|f| {
            format!(
                "{} as {}",
                f.name(),
                GpuLayout::of(dtype, *f, COLS).describe()
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// llama.cpp file types whose per-tensor choices [`StoredDense::llama_cpp`] reproduces (what a GGUF's name
/// usually carries: `…-Q4_K_M.gguf`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LlamaFileType {
    /// BF16 / F16 / F32: values.
    Values,
    Q4_0,
    Q8_0,
    Q4KM,
}

impl LlamaFileType {
    /// The file type a file or repository name names (case-insensitive: `q4_k_m`, `q4_0`, `q8_0`, `bf16`,
    /// `f16`, `f32`), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        let n = name.to_ascii_lowercase();
        [
            ("q4_k_m", LlamaFileType::Q4KM),
            ("q4_0", LlamaFileType::Q4_0),
            ("q8_0", LlamaFileType::Q8_0),
            ("bf16", LlamaFileType::Values),
            ("f16", LlamaFileType::Values),
            ("f32", LlamaFileType::Values),
        ]
        .into_iter()
        .find(|(token, _)| n.contains(token))
        .map(|(_, t)| t)
    }
}

/// llama.cpp's `use_more_bits` (llama-quant.cpp): the layers whose attn_v / ffn_down get more bits in the
/// _M mixes: the first and last eighth, and every third between.
pub fn use_more_bits(layer: u64, layers: u64) -> bool {
    layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2
}

impl StoredDense {
    /// The types `llama-quantize` gives the dense projections of `shape` under `ftype`
    /// (`llama_tensor_get_type` of llama.cpp 0c1e570, checked against its output for Q4_K_M by the daemon
    /// test `llama_cpp_q4_k_m_smallthinker_runs_as_its_f32_twin`): Q4_K_M makes attn_v and every ffn_down
    /// (dense and shared experts) Q6_K in `use_more_bits` layers and the rest Q4_K; Q4_0 and Q8_0 use their
    /// type throughout; the output (the token table of a tied model) is Q6_K except under Q8_0; models of 8
    /// experts get llama.cpp's Mixtral rule (attn_k / attn_v Q8_0, Q4_K_M's attn_output Q5_K). Rows that are
    /// not whole blocks take llama.cpp's fallback (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0; values when
    /// even those do not fit). `None` for values, and for linear-attention (hybrid) models.
    pub fn llama_cpp(
        ftype: LlamaFileType,
        shape: &crate::shape::ModelShape,
    ) -> Option<StoredDense> {
        use StoredFormat::*;
        let base = match ftype {
            LlamaFileType::Values => return None,
            LlamaFileType::Q4_0 => Q4_0,
            LlamaFileType::Q8_0 => Q8_0,
            LlamaFileType::Q4KM => Q4K,
        };
        if shape.hybrid.is_some() {
            return None;
        }
        let n = shape.layers;
        let eight_experts = shape.moe.as_ref().is_some_and(|m| m.experts == 8);
        let more = |layer: u64| ftype == LlamaFileType::Q4KM && use_more_bits(layer, n);
        // the type of a matrix with rows of `cols`, after llama.cpp's fallback
        let fit = |t: StoredFormat, cols: u64| {
            if cols.is_multiple_of(t.block_elems()) {
                return t;
            }
            let fallback = match t {
                Q4K => Q5_0,
                Q5K => Q5_1,
                Q6K => Q8_0,
                _ => Values,
            };
            if cols.is_multiple_of(fallback.block_elems()) {
                fallback
            } else {
                Values
            }
        };
        let h = shape.hidden;
        let (q_cols, o_cols) = match &shape.attention {
            crate::shape::Attention::Gqa {
                heads, head_dim, ..
            } => (h, heads * head_dim),
            crate::shape::Attention::Mla {
                heads, v_head_dim, ..
            } => (h, heads * v_head_dim),
        };
        let mla = matches!(shape.attention, crate::shape::Attention::Mla { .. });
        let attention = (0..n)
            .map(|i| {
                let v = if eight_experts {
                    Q8_0
                } else if more(i) {
                    Q6K
                } else {
                    base
                };
                let k = if eight_experts { Q8_0 } else { base };
                let o = if eight_experts && ftype == LlamaFileType::Q4KM {
                    Q5K
                } else {
                    base
                };
                if mla {
                    // q (or q_a, q_b), kv_a, o: no attn_v / attn_k among them
                    let (q, q_b) = match &shape.attention {
                        crate::shape::Attention::Mla {
                            q_lora_rank: Some(r),
                            ..
                        } => (fit(base, q_cols), fit(base, *r)),
                        _ => (fit(base, q_cols), Values),
                    };
                    [q, q_b, fit(base, h), fit(o, o_cols)]
                } else {
                    [fit(base, q_cols), fit(k, h), fit(v, h), fit(o, o_cols)]
                }
            })
            .collect();
        let mlp = |layer: u64, inter: u64| {
            let down = if more(layer) { Q6K } else { base };
            [fit(base, h), fit(base, h), fit(down, inter)]
        };
        let moe_layers = shape.moe_layers();
        let dense_first = n - moe_layers;
        // dense layers lead (GLM, DeepSeek); the sizing shape keeps no per-layer kinds beyond that
        let dense_mlp = (0..dense_first)
            .map(|i| mlp(i, shape.dense_intermediate))
            .collect();
        let shared_experts = match &shape.moe {
            Some(m) if m.shared_intermediate > 0 => (dense_first..n)
                .map(|i| mlp(i, m.shared_intermediate))
                .collect(),
            _ => Vec::new(),
        };
        let output = if base == Q8_0 { Q8_0 } else { fit(Q6K, h) };
        Some(StoredDense {
            attention,
            dense_mlp,
            shared_experts,
            lm_head: output,
        })
    }
}
