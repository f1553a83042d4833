//! The GPU memory plan: what goes on the GPU within a budget, in this order, and why.
//!
//! ```text
//! usable       = USABLE_FRACTION × budget            (the rest: CUDA context, cuBLAS, allocator slack)
//! fixed        = dense weights (by dtype) + embeddings (unless in host memory) + activations
//!                + dequantization scratch + layerwise-prefill staging + CUDA graph buffers
//!                + recurrent states (linear-attention models: one per sequence of a step)
//! KV           = target tokens if they fit beside `fixed`, else at least min tokens (one
//!                --max-model-len sequence), else the plan is refused; per position: K/V rows of
//!                the layers that keep them, indexer key rows, and (CUDA graphs) the decode
//!                buffers' indexer score columns, which cover every position of the pool
//! GPU experts  = auto: ⌊(usable − fixed − KV) / (moe_layers × expert bytes)⌋ per layer, or the count asked;
//!                a layer with more placement-rule GPU pins than that keeps them all (`gpu_experts_total`)
//! KV (auto)    = then grows into what is left, up to max tokens
//! ```
//!
//! [`choose`] picks the dense dtype and where the embeddings live when they are `auto`: the first of
//! bf16 / bf16 + host embeddings / fp8 + host / int4 + host whose plan holds the KV target, else the
//! first that holds the minimum. Daemon and operator call the same functions.
use crate::shape::ModelShape;
use crate::stored::{kept_note, GpuLayout, StoredFormat};
use crate::weights::{dense_bytes, DenseBytes, DenseDtype};

pub use crate::parallel::SplitError;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// Share of the budget the engine's own allocations may take (vLLM's gpu_memory_utilization); the
/// rest covers the CUDA context, cuBLAS workspaces, NVRTC modules and allocator fragmentation.
pub const USABLE_FRACTION: f64 = 0.90;
/// bf16 slab the quantized projections of prefill steps dequantize into (kernels' DEQUANT_SCRATCH_BYTES).
pub const DEQUANT_SCRATCH_BYTES: u64 = 64 * MIB;
/// KV positions per block of the paged cache (the engine's BLOCK).
pub const KV_BLOCK: u64 = 16;
/// Bytes per cached value (the GPU caches K/V in bf16).
pub const KV_ELEM_BYTES: u64 = 2;
/// Score and probability buffers of one GEMM-attention call in a long prefill (the engine blocks
/// query rows to stay within its 512 MiB score budget; probabilities are bf16 beside f32 scores).
pub const PREFILL_ATTENTION_BYTES: u64 = 768 * MIB;
/// Head dims the fused long-prefill attention kernel is built for (the kernels crate's
/// `FLASH_HEAD_DIMS`; a daemon test checks that both lists agree).
pub const FUSED_PREFILL_HEAD_DIMS: [u64; 3] = [32, 64, 128];

/// How a long prefill chunk computes GQA attention on the GPU (the engine's `MOE_FLASH_PREFILL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillAttention {
    /// The fused kernel wherever the head dim allows it (the default): the sequence's K/V rows are
    /// gathered, no score matrix.
    #[default]
    Fused,
    /// Scores and probabilities through GEMMs for every chunk (`MOE_FLASH_PREFILL=0`, an A/B knob).
    Gemm,
}
/// Rows the CUDA-graph decode buffers are sized for (the engine's MAX_GRAPH_ROWS).
pub const GRAPH_ROWS: u64 = 64;
/// Layerwise prefill's expert stream: staging slots, and the default bytes of one chunk.
pub const STREAM_SLOTS: u64 = 4;
pub const STREAM_CHUNK_BYTES: u64 = 256 * MIB;
/// Expert copies live re-placement keeps in flight (the daemon's default), each holding one expert's
/// GPU memory until its swap; a copy lands within a step, so this also bounds the moves per step.
pub const LIVE_MOVE_SLOTS: u64 = 8;
/// Steps of at least this many tokens prefill layer by layer (the daemon's default
/// --gpu-prefill-threshold); the stream's staging is planned when the KV cache can hold such a step.
pub const DEFAULT_PREFILL_THRESHOLD: u64 = 1024;

/// Device bytes of live re-placement's copies: `slots` experts in flight, plus one packed staging
/// expert (the dense size plus tile padding and scales: 5/4) and one dense one the copies are unpacked
/// through. Nothing when live re-placement is off (`slots` 0).
pub fn live_move_bytes(dense_expert_bytes: u64, slots: u64) -> u64 {
    if slots == 0 {
        return 0;
    }
    slots * dense_expert_bytes + dense_expert_bytes * 5 / 4 + dense_expert_bytes
}

/// Device bytes of layerwise prefill's expert stream: `STREAM_SLOTS` packed staging chunks (packed
/// bytes are the dense bf16 size plus tile padding and scales: 5/4 covers them) and one dense chunk,
/// each of as many `dense_expert_bytes` experts as fit in `chunk_bytes` (at least one).
pub fn stream_staging_bytes(dense_expert_bytes: u64, experts: u64, chunk_bytes: u64) -> u64 {
    let c = (chunk_bytes / dense_expert_bytes.max(1)).clamp(1, experts.max(1));
    c * dense_expert_bytes * STREAM_SLOTS * 5 / 4 + c * dense_expert_bytes
}

/// Requested precision of the dense projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DenseChoice {
    /// bf16 when it fits, else fp8, else int4 (see [`choose`]).
    #[default]
    Auto,
    Fixed(DenseDtype),
}

/// Requested home of the embedding table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EmbeddingChoice {
    /// On the GPU unless the budget is tight.
    #[default]
    Auto,
    Gpu,
    Host,
}

/// Routed experts per MoE layer on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertsChoice {
    /// As many as fit after everything else.
    Auto,
    PerLayer(u64),
}

/// KV cache size, in positions (all sequences together).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvRequest {
    /// Refuse below this (one full-length sequence).
    pub min_tokens: u64,
    /// Reserved before `auto` GPU experts take the rest, when it fits.
    pub target_tokens: u64,
    /// KV grows into memory left over, up to this.
    pub max_tokens: u64,
    /// Most positions one sequence holds (`--max-model-len`): a prefill step's indexer score rows
    /// cover up to that many.
    pub longest_sequence: u64,
}

impl KvRequest {
    /// Exactly `tokens` positions.
    pub fn exactly(tokens: u64) -> Self {
        Self {
            min_tokens: tokens,
            target_tokens: tokens,
            max_tokens: tokens,
            longest_sequence: tokens,
        }
    }

    /// Serving limits: at least one `max_model_len` sequence, `min(max_num_seqs, 2)` of them before
    /// GPU experts, up to `max_num_seqs` of them with what is left.
    pub fn serving(max_model_len: u64, max_num_seqs: u64) -> Self {
        let seqs = max_num_seqs.max(1);
        Self {
            min_tokens: max_model_len,
            target_tokens: max_model_len * seqs.min(2),
            max_tokens: max_model_len * seqs,
            longest_sequence: max_model_len,
        }
    }
}

/// Routed experts of one MoE layer that placement rules fix: `gpu` live on the GPU whatever the
/// per-layer count, `dram` never do. The placement strategy fills the layer up to the count from the
/// experts no rule pins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerPins {
    pub gpu: u64,
    pub dram: u64,
}

/// GPU experts of all MoE layers when `per_layer` are asked of each: a layer keeps its GPU pins and
/// the strategy adds unpinned experts until it holds `per_layer` (fewer when DRAM pins leave too few).
/// `pins` has one entry per MoE layer, or none (no rules: `per_layer × moe_layers`).
pub fn gpu_experts_total(per_layer: u64, experts: u64, moe_layers: u64, pins: &[LayerPins]) -> u64 {
    if pins.is_empty() {
        return per_layer.min(experts) * moe_layers;
    }
    pins.iter()
        .map(|p| p.gpu.max(per_layer.min(experts.saturating_sub(p.dram))))
        .sum()
}

/// Everything the plan depends on besides the model shape.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanInputs {
    /// GPU memory the engine may use (`--gpu-memory-limit`, else the card's memory).
    pub budget_bytes: u64,
    pub dense: DenseChoice,
    pub embeddings: EmbeddingChoice,
    pub experts: ExpertsChoice,
    pub kv: KvRequest,
    /// Element type of the KV cache.
    pub kv_dtype: crate::KvCacheDtype,
    /// Most tokens one engine step computes (prefill chunk + decode tokens).
    pub max_step_tokens: u64,
    /// Most sequences in one step (rows of the logits).
    pub max_step_seqs: u64,
    /// Layerwise prefill's device staging (four packed chunks + one dense), 0 when off.
    pub stream_staging_bytes: u64,
    pub cuda_graphs: bool,
    /// Per MoE layer, the experts placement rules pin (empty: no rules).
    pub pins: Vec<LayerPins>,
    /// Live re-placement's copies in flight, each holding one expert's GPU memory until its swap
    /// (0: live re-placement off).
    pub move_slots: u64,
    pub prefill_attention: PrefillAttention,
}

/// One line of the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanItem {
    pub what: &'static str,
    pub bytes: u64,
    pub why: String,
}

/// The resolved plan.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    pub dense_dtype: DenseDtype,
    pub host_embeddings: bool,
    /// Routed experts per MoE layer on each GPU.
    pub gpu_experts_per_layer: u64,
    /// GPUs of the tensor-parallel group this plan is one GPU of (1: a single GPU).
    pub gpus: u64,
    /// Routed experts per MoE layer on all the group's GPUs together (the count to place).
    pub node_experts_per_layer: u64,
    /// GPU experts of all layers (`gpu_experts_per_layer × moe_layers` without placement rules).
    pub gpu_experts_total: u64,
    pub kv_tokens: u64,
    pub budget_bytes: u64,
    pub usable_bytes: u64,
    pub dense: DenseBytes,
    pub items: Vec<PlanItem>,
}

impl MemoryPlan {
    /// Bytes of all items (what the engine allocates itself).
    pub fn total(&self) -> u64 {
        self.items.iter().map(|i| i.bytes).sum()
    }

    pub fn item(&self, what: &str) -> u64 {
        self.items
            .iter()
            .filter(|i| i.what == what)
            .map(|i| i.bytes)
            .sum()
    }

    /// Multi-line table for the daemon's start-up log and the operator's explanations.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "GPU memory plan{}: {:.2} GiB of {:.2} GiB usable ({:.0}% of a {:.2} GiB budget)\n",
            if self.gpus > 1 {
                format!(
                    " (each of {} tensor-parallel GPUs; {} experts per layer on them all)",
                    self.gpus, self.node_experts_per_layer
                )
            } else {
                String::new()
            },
            gib(self.total()),
            gib(self.usable_bytes),
            USABLE_FRACTION * 100.0,
            gib(self.budget_bytes)
        );
        for i in &self.items {
            s.push_str(&format!(
                "  {:<24} {:>9.2} GiB  {}\n",
                i.what,
                gib(i.bytes),
                i.why
            ));
        }
        s
    }
}

fn gib(b: u64) -> f64 {
    b as f64 / GIB as f64
}

/// Why no plan fits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("dense weights ({dense_mib} MiB as {dtype}{embed}) and step buffers ({work_mib} MiB) need more than the {usable_mib} MiB usable of the GPU budget; try --dense-dtype int4, host embeddings, a smaller --max-num-batched-tokens or a larger GPU")]
    DenseDoesNotFit {
        dtype: &'static str,
        embed: &'static str,
        dense_mib: u64,
        work_mib: u64,
        usable_mib: u64,
    },
    #[error("the KV cache for {tokens} positions ({kv_mib} MiB) does not fit: {left_mib} MiB are left after the dense weights and step buffers; lower --max-model-len / --kv-cache-tokens or use --dense-dtype int4")]
    KvDoesNotFit {
        tokens: u64,
        kv_mib: u64,
        left_mib: u64,
        usable_mib: u64,
    },
    #[error("{asked} GPU experts per layer ({need_mib} MiB{pinned_note}) do not fit: at most {fit} fit beside the dense weights and KV cache (use --gpu-experts auto{pin_hint})")]
    ExpertsDoNotFit {
        asked: u64,
        need_mib: u64,
        fit: u64,
        left_mib: u64,
        usable_mib: u64,
        /// ", with N pinned by placement rules" when rules pin experts to the GPU.
        pinned_note: String,
        pin_hint: &'static str,
    },
    #[error("the model does not split over the GPUs of the node: {0}")]
    DoesNotSplit(SplitError),
    #[error("placement rules pin {pinned} experts to the GPU ({need_mib} MiB), more than the {left_mib} MiB left beside the dense weights and KV cache; pin fewer experts (decode: auto or cpu) or lower --max-model-len / --kv-cache-tokens")]
    PinnedExpertsDoNotFit {
        pinned: u64,
        need_mib: u64,
        left_mib: u64,
        usable_mib: u64,
    },
}

impl PlanError {
    /// MiB the smallest plan asked for would need, and MiB usable.
    pub fn shortfall_mib(&self) -> (u64, u64) {
        match *self {
            // not a question of memory
            PlanError::DoesNotSplit(_) => (0, 0),
            PlanError::DenseDoesNotFit {
                dense_mib,
                work_mib,
                usable_mib,
                ..
            } => (dense_mib + work_mib, usable_mib),
            PlanError::KvDoesNotFit {
                kv_mib: need_mib,
                left_mib,
                usable_mib,
                ..
            }
            | PlanError::ExpertsDoNotFit {
                need_mib,
                left_mib,
                usable_mib,
                ..
            }
            | PlanError::PinnedExpertsDoNotFit {
                need_mib,
                left_mib,
                usable_mib,
                ..
            } => (usable_mib - left_mib + need_mib, usable_mib),
        }
    }
}

/// Activation and per-step buffers of a step of `tokens` rows (`seqs` sequences): the rows
/// ([`step_row_bytes`]) and the long-prefill attention's scratch ([`prefill_attention_bytes`]).
pub fn step_buffer_bytes(
    shape: &ModelShape,
    tokens: u64,
    seqs: u64,
    attention: PrefillAttention,
) -> u64 {
    step_row_bytes(shape, tokens, seqs) + prefill_attention_bytes(shape, tokens, attention)
}

/// Long-prefill attention's scratch for a chunk of `tokens` rows (none below 64 rows, where the
/// paged kernel runs). GQA gathers the sequence's K and V rows to bf16; the GEMM path adds its score
/// and probability blocks. MLA's prefill kernel reads the cache in place and needs none.
pub fn prefill_attention_bytes(
    shape: &ModelShape,
    tokens: u64,
    attention: PrefillAttention,
) -> u64 {
    let crate::shape::Attention::Gqa { head_dim, .. } = &shape.attention else {
        return 0;
    };
    if tokens < 64 {
        return 0;
    }
    let (kw, vw) = shape.kv_widths();
    let gathered = tokens * (kw + vw) * 2;
    let fused = attention == PrefillAttention::Fused && FUSED_PREFILL_HEAD_DIMS.contains(head_dim);
    if fused {
        gathered
    } else {
        gathered + PREFILL_ATTENTION_BYTES
    }
}

/// The rows of a step of `tokens` rows (`seqs` sequences): the residual stream and norms, attention
/// projections, router, dense MLP / shared expert, routed experts computed on the GPU (every token's
/// top-k rows) and logits.
pub fn step_row_bytes(shape: &ModelShape, tokens: u64, seqs: u64) -> u64 {
    let h = shape.hidden;
    let (qd, kd) = match &shape.attention {
        crate::shape::Attention::Gqa {
            heads,
            kv_heads,
            head_dim,
            ..
        } => (heads * head_dim, kv_heads * head_dim),
        crate::shape::Attention::Mla {
            heads,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            kv_lora_rank,
            ..
        } => (
            heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim),
            kv_lora_rank + qk_rope_head_dim,
        ),
    };
    let (experts, top_k, inter, shared) = shape.moe.as_ref().map_or((1, 1, 0, 0), |m| {
        (
            m.experts,
            m.top_k,
            m.expert_intermediate,
            m.shared_intermediate,
        )
    });
    // x, cpu_sum, hf (f32) + hb (bf16); q, k, v f32 + out bf16; logits, ids, weights
    let acts = h * 14 + qd * 6 + kd * 8 + experts * 4 + top_k * 8;
    // gate_up f32 + activation bf16 of the widest MLP the step runs
    let mlp = shape.dense_intermediate.max(shared) * 10 + h * 4;
    // routed experts on the GPU: gathered rows bf16, gate_up f32, act bf16, outputs f32
    let routed = top_k * (h * 6 + inter * 10);
    let per_token = acts + mlp + routed;
    let logits = seqs * (shape.vocab * 4 + h * 2);
    // hybrid models: streams, linear-attention and indexer rows of the step (score rows: `plan_with`)
    let hybrid = shape.hybrid.as_ref().map_or(0, |hy| hy.step_row_values * 4);
    tokens * (per_token + hybrid) + logits
}

/// KV bytes per position of the pool: the cache rows at bf16, and with CUDA graphs the decode buffers'
/// indexer score columns (their rows cover every position the pool holds).
pub fn kv_bytes_per_position(
    shape: &ModelShape,
    cuda_graphs: bool,
    kv_dtype: crate::KvCacheDtype,
) -> u64 {
    let scores = match (&shape.hybrid, cuda_graphs) {
        (Some(hy), true) if hy.indexer_unit > 0 => (GRAPH_ROWS * 4).div_ceil(hy.indexer_unit),
        _ => 0,
    };
    shape.kv_cache_bytes_per_token(kv_dtype) + scores
}

/// The plan for fixed choices of dense dtype and embedding home.
pub fn plan_with(
    shape: &ModelShape,
    inputs: &PlanInputs,
    dtype: DenseDtype,
    host_embeddings: bool,
) -> Result<MemoryPlan, PlanError> {
    let dense = dense_bytes(shape, dtype, host_embeddings);
    let mut plan = plan_with_inputs(shape, shape, dense, inputs, dtype, host_embeddings)?;
    plan.node_experts_per_layer = plan.gpu_experts_per_layer;
    Ok(plan)
}

/// The plan of one GPU holding `dense` and the KV heads of `device` (one GPU of a tensor-parallel
/// group, or `device` = `shape` for a single GPU); step buffers are those of the full `shape`.
pub(crate) fn plan_with_inputs(
    shape: &ModelShape,
    device: &ModelShape,
    dense: DenseBytes,
    inputs: &PlanInputs,
    dtype: DenseDtype,
    host_embeddings: bool,
) -> Result<MemoryPlan, PlanError> {
    let usable = (inputs.budget_bytes as f64 * USABLE_FRACTION) as u64;
    let steps = step_buffer_bytes(
        shape,
        inputs.max_step_tokens,
        inputs.max_step_seqs,
        inputs.prefill_attention,
    );
    // decode rows only: graph steps never run the long-prefill attention
    let graphs = if inputs.cuda_graphs {
        step_row_bytes(shape, GRAPH_ROWS, GRAPH_ROWS)
    } else {
        0
    };
    let scratch = if dtype == DenseDtype::Bf16 {
        0
    } else {
        DEQUANT_SCRATCH_BYTES
    };
    let moves = live_move_bytes(shape.gpu_expert_bytes(), inputs.move_slots);
    // Linear-attention models: each sequence of a step holds its recurrent state on the GPU; the
    // indexer of a large step scores up to one longest sequence's context per row.
    let (states, scores) = shape.hybrid.as_ref().map_or((0, 0), |hy| {
        (
            hy.state_bytes(inputs.max_step_seqs),
            hy.score_bytes(inputs.max_step_tokens, inputs.kv.longest_sequence),
        )
    });
    let steps = steps + scores;
    let work = steps + graphs + scratch + inputs.stream_staging_bytes + moves + states;
    let fixed = dense.total() + work;
    let embed_note = if host_embeddings {
        ", embeddings in host memory"
    } else {
        ""
    };
    if fixed > usable {
        return Err(PlanError::DenseDoesNotFit {
            dtype: dtype.as_str(),
            embed: embed_note,
            dense_mib: dense.total().div_ceil(MIB),
            work_mib: work.div_ceil(MIB),
            usable_mib: usable / MIB,
        });
    }
    let kv_token = kv_bytes_per_position(device, inputs.cuda_graphs, inputs.kv_dtype);
    let kv_bytes = |tokens: u64| tokens.div_ceil(KV_BLOCK) * KV_BLOCK * kv_token;
    let left = usable - fixed;
    let kv_reserved = if kv_bytes(inputs.kv.target_tokens) <= left {
        inputs.kv.target_tokens
    } else if kv_bytes(inputs.kv.min_tokens) <= left {
        inputs.kv.min_tokens
    } else {
        return Err(PlanError::KvDoesNotFit {
            tokens: inputs.kv.min_tokens,
            kv_mib: kv_bytes(inputs.kv.min_tokens).div_ceil(MIB),
            left_mib: left / MIB,
            usable_mib: usable / MIB,
        });
    };
    let left = left - kv_bytes(kv_reserved);
    let each = shape.gpu_expert_bytes();
    let experts = shape.experts_per_layer();
    let total_for = |n: u64| gpu_experts_total(n, experts, shape.moe_layers(), &inputs.pins);
    let pinned = total_for(0);
    if pinned * each > left {
        return Err(PlanError::PinnedExpertsDoNotFit {
            pinned,
            need_mib: (pinned * each).div_ceil(MIB),
            left_mib: left / MIB,
            usable_mib: usable / MIB,
        });
    }
    // The most experts per layer whose total fits (the total grows with the count), then the
    // smallest count with that total: where pins fill a layer, a larger count adds nothing.
    let fit = (0..=experts)
        .rev()
        .find(|&n| total_for(n) * each <= left)
        .unwrap_or(0);
    let fit = (0..=fit)
        .find(|&n| total_for(n) == total_for(fit))
        .unwrap_or(fit);
    let per_layer = match inputs.experts {
        ExpertsChoice::Auto => fit,
        ExpertsChoice::PerLayer(n) => {
            let n = n.min(experts);
            // By the total, not the count: where pins decide whole layers, any count gives the
            // same total, and `fit` is the smallest such count.
            if total_for(n) > total_for(fit) {
                return Err(PlanError::ExpertsDoNotFit {
                    asked: n,
                    need_mib: (total_for(n) * each).div_ceil(MIB),
                    fit,
                    left_mib: left / MIB,
                    usable_mib: usable / MIB,
                    pinned_note: if pinned > 0 {
                        format!(", with {pinned} pinned by placement rules")
                    } else {
                        String::new()
                    },
                    pin_hint: if pinned > 0 {
                        ", or pin fewer experts to the GPU"
                    } else {
                        ""
                    },
                });
            }
            n
        }
    };
    let gpu_experts = total_for(per_layer);
    let left = left - gpu_experts * each;
    // KV grows into what is left, in whole blocks, up to its maximum.
    let extra_blocks = left / (KV_BLOCK * kv_token).max(1);
    let kv_tokens = (kv_reserved.div_ceil(KV_BLOCK) + extra_blocks)
        .saturating_mul(KV_BLOCK)
        .min(inputs.kv.max_tokens.div_ceil(KV_BLOCK) * KV_BLOCK)
        .max(kv_reserved.div_ceil(KV_BLOCK) * KV_BLOCK);

    let fmt = dtype.as_str();
    let stored = shape.stored.clone().unwrap_or_default();
    // "; GGUF codes kept: Q4_K as int4/32 + minimums" where the file's blocks stay as they are
    let kept = |formats: Vec<StoredFormat>| {
        let note = kept_note(dtype, formats);
        if note.is_empty() {
            note
        } else {
            format!("; GGUF codes kept: {note}")
        }
    };
    let mut items = vec![
        PlanItem {
            what: "attention",
            bytes: dense.attention,
            why: format!(
                "{} layers of projections in {fmt}{}",
                shape.layers,
                kept(stored.attention.iter().flatten().copied().collect())
            ),
        },
        PlanItem {
            what: "dense MLP",
            bytes: dense.dense_mlp,
            why: format!(
                "{} dense layers in {fmt}{}",
                shape.layers - shape.moe_layers(),
                kept(stored.dense_mlp.iter().flatten().copied().collect())
            ),
        },
        PlanItem {
            what: "shared experts",
            bytes: dense.shared_experts,
            why: format!(
                "{fmt}, computed on the GPU for every token{}",
                kept(stored.shared_experts.iter().flatten().copied().collect())
            ),
        },
        PlanItem {
            what: "routers, norms",
            bytes: dense.f32_small,
            why: "f32".into(),
        },
        PlanItem {
            what: "lm_head",
            bytes: dense.lm_head,
            why: if dense.lm_head == 0 {
                "tied to the embedding table".into()
            } else {
                let layout = crate::weights::lm_head_layout(shape, dtype);
                let rows = if dense.lm_head < layout.bytes(shape.vocab, shape.hidden) {
                    "this GPU's rows of "
                } else {
                    ""
                };
                let how = if layout == GpuLayout::of(dtype, StoredFormat::Values, shape.hidden) {
                    format!("in {fmt}")
                } else {
                    format!(
                        "GGUF {} kept as {}",
                        stored.lm_head.name(),
                        layout.describe()
                    )
                };
                format!("{rows}{} × {} {how}", shape.vocab, shape.hidden)
            },
        },
        PlanItem {
            what: "embeddings",
            bytes: dense.embeddings,
            why: if host_embeddings {
                "in host memory: rows gathered per step and copied".into()
            } else {
                "bf16 table on the GPU".into()
            },
        },
        PlanItem {
            what: "GPU experts",
            bytes: gpu_experts * each,
            why: format!(
                "{per_layer} of {experts} per layer × {} MoE layers{}, bf16 ({})",
                shape.moe_layers(),
                if inputs.pins.is_empty() {
                    String::new()
                } else {
                    format!(", {gpu_experts} in all with the placement rules' pins")
                },
                match inputs.experts {
                    ExpertsChoice::Auto => "as many as fit",
                    ExpertsChoice::PerLayer(_) => "as asked",
                }
            ),
        },
        PlanItem {
            what: "KV cache",
            bytes: kv_bytes(kv_tokens),
            why: format!(
                "{kv_tokens} positions × {} KiB ({} K/V, {} layers{}); at least {}",
                kv_token / 1024,
                inputs.kv_dtype.as_str(),
                shape.layers - shape.hybrid.as_ref().map_or(0, |h| h.linear_layers),
                match &shape.hybrid {
                    Some(h) if h.indexer_layers > 0 => ", f32 indexer rows",
                    _ => "",
                },
                inputs.kv.min_tokens
            ),
        },
        PlanItem {
            what: "activations",
            bytes: steps,
            why: format!(
                "a step of {} tokens, {} sequences",
                inputs.max_step_tokens, inputs.max_step_seqs
            ),
        },
        PlanItem {
            what: "CUDA graphs",
            bytes: graphs,
            why: if inputs.cuda_graphs {
                format!("persistent decode buffers for {GRAPH_ROWS} rows")
            } else {
                "off".into()
            },
        },
        PlanItem {
            what: "recurrent states",
            bytes: states,
            why: format!(
                "{} sequences × {} linear-attention layers, f32",
                inputs.max_step_seqs,
                shape.hybrid.as_ref().map_or(0, |h| h.linear_layers)
            ),
        },
        PlanItem {
            what: "dequant scratch",
            bytes: scratch,
            why: "bf16 slab for quantized prefill GEMMs".into(),
        },
        PlanItem {
            what: "live moves",
            bytes: moves,
            why: format!(
                "{} expert copies in flight for live re-placement, and their staging",
                inputs.move_slots
            ),
        },
        PlanItem {
            what: "prefill staging",
            bytes: inputs.stream_staging_bytes,
            why: "layerwise prefill's expert stream".into(),
        },
    ];
    items.retain(|i| i.bytes > 0 || i.what == "GPU experts" || i.what == "embeddings");
    Ok(MemoryPlan {
        dense_dtype: dtype,
        host_embeddings,
        gpu_experts_per_layer: per_layer,
        gpus: 1,
        node_experts_per_layer: per_layer,
        gpu_experts_total: gpu_experts,
        kv_tokens,
        budget_bytes: inputs.budget_bytes,
        usable_bytes: usable,
        dense,
        items,
    })
}

/// The plan, resolving `auto` dense dtype and embedding home (see the module docs).
pub fn choose(shape: &ModelShape, inputs: &PlanInputs) -> Result<MemoryPlan, PlanError> {
    choose_devices(shape, inputs, 1)
}

/// [`choose`] for each GPU of a tensor-parallel group of `gpus` identical GPUs (`inputs.budget_bytes`
/// is one GPU's; see [`crate::parallel`]). One GPU gives exactly [`choose`]'s plan.
pub fn choose_devices(
    shape: &ModelShape,
    inputs: &PlanInputs,
    gpus: u64,
) -> Result<MemoryPlan, PlanError> {
    let dtypes: Vec<DenseDtype> = match inputs.dense {
        DenseChoice::Fixed(d) => vec![d],
        DenseChoice::Auto => DenseDtype::ALL.to_vec(),
    };
    let mut candidates = Vec::new();
    for d in dtypes {
        match inputs.embeddings {
            EmbeddingChoice::Gpu => candidates.push((d, false)),
            EmbeddingChoice::Host => candidates.push((d, true)),
            EmbeddingChoice::Auto => {
                if d == DenseDtype::Bf16 {
                    candidates.push((d, false));
                }
                candidates.push((d, true));
            }
        }
    }
    let mut first_fit = None;
    let mut last_err = None;
    for (d, host) in candidates {
        let plan = if gpus == 1 {
            plan_with(shape, inputs, d, host)
        } else {
            crate::parallel::device_plan_with(shape, inputs, d, host, gpus)
        };
        match plan {
            Ok(p) if p.kv_tokens >= inputs.kv.target_tokens => return Ok(p),
            Ok(p) => {
                first_fit.get_or_insert(p);
            }
            Err(e) => last_err = Some(e),
        }
    }
    match (first_fit, last_err) {
        (Some(p), _) => Ok(p),
        (None, Some(e)) => Err(e),
        (None, None) => unreachable!("at least one candidate"),
    }
}
