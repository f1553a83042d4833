//! The CUDA backend of the engine: the same [`Model`] run on a GPU, with each MoE layer's experts split
//! between GPU memory and DRAM by the placement plan.
//!
//! Per MoE layer of a step, the GPU computes norm, attention, router and top-k; one device→host copy hands
//! the normalised activations and routing to the host (the layer's single synchronisation); then the GPU
//! runs the shared expert and its resident experts (enqueued, asynchronous) while the CPU computes the
//! DRAM-resident experts of the same tokens; their sum comes back with one host→device copy and one add.
//! Above `gpu_prefill_threshold` tokens a step is a long prefill: the layer's DRAM experts are streamed to
//! the GPU instead and computed there.
//!
//! Files: `forward` (the step), `dispatch` (the pure per-layer MoE dispatch plan), `moe_layer` (its
//! phases), `experts` (GPU expert GEMM phases), `attention`, `buffers` (step buffers per batch-size
//! class), `graphs`, `handoff` (pinned buffers), `stream` (layerwise prefill's expert stream), `kv`,
//! `memory` and `setup` (the memory plan and bring-up), `kinds` (config kinds → the op layer's),
//! `routed` (resident experts of small steps from the routing on the device, no host round trip).
//! Kernels are launched only through `moe_kernels::cuda::ops`.
pub mod attention;
pub mod buffers;
pub mod copy_load;
mod decode_split;
pub mod dispatch;
mod early_routing;
mod experts;
pub mod forward;
pub mod graphs;
pub mod handoff;
pub mod host_profile;
pub mod hybrid;
pub mod hybrid_bufs;
pub mod indexer;
pub mod kinds;
pub mod kv;
pub mod linear_attention;
pub mod memory;
mod moe_layer;
pub mod moves;
pub mod routed;
pub mod setup;
pub mod split;
pub mod stream;
mod stream_profile;
pub mod switches;
mod warm;

use crate::engine::linear::{Linear, WeightData};
use crate::model::{Attention, Ffn, MlaQuery, Mlp, Model};
use anyhow::Context;
use cudarc::driver::CudaSlice;
use half::bf16;
use kv::GpuKvPool;
use moe_kernels::cpu::GgmlBlock;
use moe_kernels::cuda::dense::DeviceDense;
use moe_kernels::cuda::quant::{DenseFormat, QuantizedMatrix};
use moe_kernels::cuda::GpuDevice;
use std::sync::{Arc, Mutex};

/// A weight matrix on the GPU, `[out, in]` (bf16, FP8 or int4: see [`DeviceDense`]), with an
/// optional f32 bias.
pub struct GpuLinear {
    pub w: DeviceDense,
    pub bias: Option<CudaSlice<f32>>,
    pub out_dim: usize,
    pub in_dim: usize,
}

impl GpuLinear {
    /// The bf16 weights (routed experts, which cuBLAS multiplies in grouped phases).
    pub fn bf16(&self) -> anyhow::Result<&CudaSlice<bf16>> {
        self.w
            .as_bf16()
            .context("routed expert weights on the GPU must be bf16")
    }
}

/// Where the embedding table lives: on the GPU (a gather kernel), or in host memory with the step's
/// rows gathered on the host and copied (KTransformers' choice on small cards: a 150k × 4096 table is
/// 1.2 GiB of GPU memory for a few KiB read per decode step).
pub enum EmbedTable {
    Device(CudaSlice<bf16>),
    Host,
}

/// gate and up stacked (`[2I, H]`, gate first) so one GEMM computes both; then down `[H, I]`.
pub struct GpuMlp {
    pub gate_up: GpuLinear,
    pub down: GpuLinear,
}

pub struct GpuMoe {
    /// `[experts, hidden]` f32
    pub router: CudaSlice<f32>,
    pub correction_bias: Option<CudaSlice<f32>>,
    /// Indexed by expert id; `None` = the expert lives in DRAM.
    pub experts: ExpertTable,
    pub shared: Option<GpuMlp>,
    pub shared_gate: Option<CudaSlice<f32>>,
}

/// One MoE layer's GPU-resident experts by expert id (`None`: the expert lives in DRAM). A step reads
/// the table once per layer; live re-placement ([`crate::engine::replacement`]) installs and evicts
/// entries between steps, so a step never sees a half-made change.
pub struct ExpertTable(
    std::sync::RwLock<Vec<Option<GpuMlp>>>,
    /// Changes made so far ([`ExpertTable::replace`]).
    std::sync::atomic::AtomicU64,
);

impl ExpertTable {
    pub fn new(experts: Vec<Option<GpuMlp>>) -> Self {
        Self(std::sync::RwLock::new(experts), Default::default())
    }

    /// The table as the step sees it (held for one layer).
    pub fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Option<GpuMlp>>> {
        self.0.read().unwrap_or_else(|e| e.into_inner())
    }

    /// How many times the table changed: equal versions, same residency.
    pub fn version(&self) -> u64 {
        self.1.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Under one write lock: `m` becomes expert `admit`'s weights and expert `evict` leaves the GPU
    /// (computed from DRAM from the next step on). Returns the evicted weights (reused or freed by the
    /// caller).
    pub fn replace(&self, admit: usize, evict: usize, m: GpuMlp) -> Option<GpuMlp> {
        let mut t = self.0.write().unwrap_or_else(|e| e.into_inner());
        self.1.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        if let Some(slot) = t.get_mut(admit) {
            *slot = Some(m);
        }
        t.get_mut(evict).and_then(Option::take)
    }

    /// Which experts are resident.
    pub fn resident(&self) -> Vec<bool> {
        self.read().iter().map(Option::is_some).collect()
    }
}

// One per layer: the size difference between variants costs nothing worth boxing for.
#[allow(clippy::large_enum_variant)]
pub enum GpuFfn {
    Dense(GpuMlp),
    Moe(GpuMoe),
}

// One per MLA layer, built once at load and never moved afterwards: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum GpuMlaQuery {
    Direct(GpuLinear),
    LowRank {
        a: GpuLinear,
        norm: CudaSlice<f32>,
        b: GpuLinear,
    },
}

/// Grouped-query attention's weights (`q_norm` / `k_norm`: Qwen3's per-head RMSNorm).
pub struct GqaWeights {
    pub q: GpuLinear,
    pub k: GpuLinear,
    pub v: GpuLinear,
    pub o: GpuLinear,
    pub q_norm: Option<CudaSlice<f32>>,
    pub k_norm: Option<CudaSlice<f32>>,
}

/// Multi-head latent attention's weights, absorbed form (the cache holds latent + rope key).
pub struct MlaWeights {
    pub q: GpuMlaQuery,
    pub kv_a: GpuLinear,
    pub kv_a_norm: CudaSlice<f32>,
    /// kv_b_proj `[heads × (nope + v), kv_lora_rank]` f32.
    pub kv_b: CudaSlice<f32>,
    pub o: GpuLinear,
}

/// A layer's attention; each variant's forward takes its own weights type, so one cannot be run
/// with the other's.
// One per layer, built once at load: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum GpuAttention {
    Gqa(GqaWeights),
    Mla(MlaWeights),
    /// KDA linear attention (GLM-5.3-Flash), per-sequence recurrent state instead of a KV cache.
    Linear(Box<linear_attention::GpuLinearAttention>),
}

pub struct GpuLayer {
    pub attn_norm: CudaSlice<f32>,
    pub ffn_norm: CudaSlice<f32>,
    pub attn: GpuAttention,
    pub ffn: GpuFfn,
}

/// How the dense weights go to the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DenseUpload {
    /// Precision of attention, dense MLP, shared-expert and lm_head projections.
    pub format: DenseFormat,
    /// Keep the embedding table in host memory.
    pub host_embeddings: bool,
}

pub struct GpuModel {
    pub dev: GpuDevice,
    pub embed: EmbedTable,
    /// `None`: tied to the (bf16, on-GPU) embedding table.
    pub lm_head: Option<GpuLinear>,
    /// Precision the dense projections were uploaded in.
    pub dense: DenseUpload,
    /// bf16 slab the quantized projections of prefill steps dequantize into (`None` for bf16).
    pub dequant_scratch: Mutex<Option<CudaSlice<bf16>>>,
    pub final_norm: CudaSlice<f32>,
    pub layers: Vec<GpuLayer>,
    pub inv_freq: CudaSlice<f32>,
    pub attn_factor: f32,
    pub kv: Arc<Mutex<GpuKvPool>>,
    /// Which block table (group) and KV slot each layer uses.
    pub kv_layout: crate::engine::kv::KvLayout,
    /// Steps with at least this many tokens stream DRAM experts to the GPU (layerwise prefill).
    pub prefill_threshold: usize,
    /// Steps with at least this many rows (and fewer than `prefill_threshold`) split each layer's
    /// routed DRAM experts between the GPU stream and the CPU kernels (`split`); 0 = never.
    pub split_min_rows: usize,
    /// The split's measured rates of both sides.
    pub split: Mutex<split::SplitBalance>,
    /// No step splits for now (`bench decode --split-ab`: both in one process).
    pub split_paused: std::sync::atomic::AtomicBool,
    /// The packed-expert stream of layerwise prefill (set up by [`GpuModel::attach_expert_stream`]
    /// once the CPU kernels have packed the DRAM experts); `None`: per-expert uploads.
    pub stream: Mutex<Option<stream::ExpertStream>>,
    /// Replay decode steps' pre-expert segments from CUDA graphs.
    pub cuda_graphs: bool,
    /// Run decode steps eagerly for now (captured graphs and the graph-class buffers stay): A/B runs
    /// of graphs on and off in one process (`bench decode --graphs-ab`).
    pub graphs_paused: std::sync::atomic::AtomicBool,
    /// Run-time switches of the decode step: deferred experts, launches before the routing, the
    /// mixed layers' GEMM path (`switches`).
    pub switches: switches::DecodeSwitches,
    /// Early routing (`early_routing`): bytes of the chosen DRAM experts the CPU pool prefetches per
    /// layer while attention runs, for routers on the layer input; 0 = routing after attention.
    pub expert_prefetch_bytes: usize,
    /// Compute resident experts of small steps from the routing on the device (`routed`): on unless
    /// `MOE_DEVICE_ROUTED=0` (the host-planned path, for A/Bs), switchable with
    /// [`GpuModel::set_device_routed`].
    pub device_routed: std::sync::atomic::AtomicBool,
    /// The device-routed experts' kernels, per-layer tables and scratch (made on first use).
    pub routed: Mutex<Option<routed::DeviceRouted>>,
    /// Step buffers (and pinned hand-off buffers) per batch-size class, created on first use.
    pub buffers: Mutex<buffers::BufferClasses>,
    /// Most rows and sequences of one step (the engine's limits, which the memory plan budgets).
    pub max_step: (usize, usize),
    /// Graphs captured so far.
    pub graphs: Mutex<graphs::GraphSet>,
    /// Per layer and expert (from placement rules): a long prompt's step computes this DRAM expert on
    /// the CPU instead of streaming it to the GPU. Empty rows: stream them all.
    pub prefill_on_cpu: Vec<Vec<bool>>,
    /// Rewrites each MoE layer's routed ids after the router (benchmarks' synthetic routing bias).
    pub routing_override: Mutex<Option<RoutingOverride>>,
    /// The memory plan this engine started with and what the start allocated.
    pub memory: Option<memory::MemoryReport>,
    /// Linear attention, hyper-connections and the sparse-attention indexer (models that have them).
    pub hybrid: Option<hybrid::GpuHybrid>,
    /// This GPU's share of a tensor-parallel group (`None`: the model runs on this GPU alone).
    pub shard: Option<crate::engine::parallel::RankCtx>,
    /// Reads buffers at fixed points of each layer (tests comparing a group with one GPU).
    pub probe: Option<Arc<crate::engine::parallel::probe::StepProbe>>,
}

/// `f(layer, ids)`: rewrites one MoE layer's top-k ids of a step (`[tokens × k]`) in place.
pub type RoutingOverride = Box<dyn FnMut(usize, &mut [u32]) + Send>;

/// Uploads a dense projection in `format` (quantized on the host at load; FP8 checkpoints keep their
/// bytes and block scales). Widths the quantized kernels cannot take stay bf16.
pub fn upload_linear(
    dev: &GpuDevice,
    l: &Linear,
    format: DenseFormat,
) -> anyhow::Result<GpuLinear> {
    let w = match quantize_linear(l, format) {
        Some(q) => dev.upload_quantized(&q)?,
        None => DeviceDense::Bf16(dev.stream.clone_htod(&linear_bf16(l))?),
    };
    let bias = match &l.bias {
        Some(b) => Some(dev.stream.clone_htod(b)?),
        None => None,
    };
    Ok(GpuLinear {
        w,
        bias,
        out_dim: l.out_dim,
        in_dim: l.in_dim,
    })
}

/// `l` in the GPU's `format` layout; `None` for bf16 or widths the kernels cannot take. Weights
/// already in a GPU layout keep their values: FP8 checkpoints' blocks (fp8), GGUF Q4_0 / Q4_1 / Q4_K
/// blocks (int4 groups of 32 with their codes; Q4_K's sub-block scales and mins rounded once to f16)
/// and GGUF Q8_0 / Q5_0 / Q6_K blocks (int8 groups of 32 / 32 / 16, under int4 or fp8: not rounded
/// below the file's bits; Q5_K and Q5_1 are quantized to int8); everything else is quantized from its f32 rows.
pub fn quantize_linear(l: &Linear, format: DenseFormat) -> Option<QuantizedMatrix> {
    let kept = match (format, &l.w) {
        (
            DenseFormat::Fp8,
            WeightData::F8 {
                bytes,
                scale_inv,
                block,
            },
        ) => {
            QuantizedMatrix::from_fp8_blocks(l.out_dim, l.in_dim, bytes.clone(), scale_inv, *block)
        }
        // GGUF tensors of more than 4 bits stay 8-bit (int8 codes) under int4 and fp8 alike: a
        // file's 8-bit lm_head rounded to 4 bits costs SmolLM2 17 % of perplexity
        (DenseFormat::Int4 | DenseFormat::Fp8, WeightData::Ggml { kind, bytes })
            if matches!(
                kind,
                GgmlBlock::Q8_0
                    | GgmlBlock::Q6K
                    | GgmlBlock::Q5K
                    | GgmlBlock::Q5_0
                    | GgmlBlock::Q5_1
            ) =>
        {
            QuantizedMatrix::from_ggml_blocks(*kind, l.out_dim, l.in_dim, bytes).or_else(|| {
                QuantizedMatrix::quantize(DenseFormat::Int8, l.out_dim, l.in_dim, |r, buf| {
                    l.row_f32(r, buf)
                })
            })
        }
        (DenseFormat::Int4, WeightData::Ggml { kind, bytes }) => {
            QuantizedMatrix::from_ggml_blocks(*kind, l.out_dim, l.in_dim, bytes)
        }
        _ => None,
    };
    kept.or_else(|| {
        QuantizedMatrix::quantize(format, l.out_dim, l.in_dim, |r, buf| l.row_f32(r, buf))
    })
}

/// A linear's weights as bf16 rows (bf16 checkpoints are copied; f32 / FP8 are rounded).
pub fn linear_bf16(l: &Linear) -> Vec<bf16> {
    if let WeightData::Bf16(v) = &l.w {
        return v.clone();
    }
    let mut row = vec![0f32; l.in_dim];
    let mut out = Vec::with_capacity(l.out_dim * l.in_dim);
    for r in 0..l.out_dim {
        l.row_f32(r, &mut row);
        out.extend(row.iter().map(|&x| bf16::from_f32(x)));
    }
    out
}

/// gate and up stacked into one `[2I, H]` bf16 matrix.
pub fn mlp_gate_up_bf16(m: &Mlp) -> Vec<bf16> {
    let mut v = linear_bf16(&m.gate);
    v.extend(linear_bf16(&m.up));
    v
}

/// An MLP in `format` (dense layers and shared experts; routed experts are always bf16). Gate and up
/// are quantized each on its own (so kept FP8 / Q4_0 blocks stay exact) and stacked into one
/// `[2I, H]` matrix; rows are quantized independently, so the stack is what quantizing `[2I, H]`
/// would give. Both projections of one checkpoint have the same width and source format, hence the
/// same group; should they not, the pair stays bf16 rather than mix groups.
pub fn upload_mlp(dev: &GpuDevice, m: &Mlp, format: DenseFormat) -> anyhow::Result<GpuMlp> {
    let (i, h) = (m.gate.out_dim, m.gate.in_dim);
    let stacked = quantize_linear(&m.gate, format)
        .zip(quantize_linear(&m.up, format))
        .and_then(|(gate, up)| gate.stack_rows(up));
    let w = match stacked {
        Some(q) => dev.upload_quantized(&q)?,
        None => DeviceDense::Bf16(dev.stream.clone_htod(&mlp_gate_up_bf16(m))?),
    };
    Ok(GpuMlp {
        gate_up: GpuLinear {
            w,
            bias: None,
            out_dim: 2 * i,
            in_dim: h,
        },
        down: upload_linear(dev, &m.down, format)?,
    })
}

/// Uploads DRAM expert `eid` (checkpoint copy, or exported from the CPU kernels' packed set).
pub fn upload_dram_expert(
    dev: &GpuDevice,
    block: &crate::model::MoeBlock,
    eid: usize,
) -> anyhow::Result<GpuMlp> {
    upload_dram_expert_on(&dev.stream, block, eid)
}

/// [`upload_dram_expert`] on a given stream (live re-placement copies on a side stream). Routed experts
/// are bf16 on the GPU whatever `--dense-dtype` says.
pub fn upload_dram_expert_on(
    s: &Arc<cudarc::driver::CudaStream>,
    block: &crate::model::MoeBlock,
    eid: usize,
) -> anyhow::Result<GpuMlp> {
    if let Some(m) = block.experts.get(eid).and_then(Option::as_ref) {
        return Ok(GpuMlp {
            gate_up: GpuLinear {
                w: DeviceDense::Bf16(s.clone_htod(&mlp_gate_up_bf16(m))?),
                bias: None,
                out_dim: 2 * m.gate.out_dim,
                in_dim: m.gate.in_dim,
            },
            down: GpuLinear {
                w: DeviceDense::Bf16(s.clone_htod(&linear_bf16(&m.down))?),
                bias: match &m.down.bias {
                    Some(b) => Some(s.clone_htod(b)?),
                    None => None,
                },
                out_dim: m.down.out_dim,
                in_dim: m.down.in_dim,
            },
        });
    }
    let set = block
        .cpu_set
        .as_ref()
        .with_context(|| format!("expert {eid} is in neither memory"))?;
    let (gate_up, down) = set
        .export_bf16(eid as u32)
        .with_context(|| format!("expert {eid} is not in the CPU set"))?;
    let (h, i) = (set.config().hidden, set.config().inter);
    let as_bf16 = |v: Vec<u16>| -> Vec<bf16> { v.into_iter().map(bf16::from_bits).collect() };
    Ok(GpuMlp {
        gate_up: GpuLinear {
            w: DeviceDense::Bf16(s.clone_htod(&as_bf16(gate_up))?),
            bias: None,
            out_dim: 2 * i,
            in_dim: h,
        },
        down: GpuLinear {
            w: DeviceDense::Bf16(s.clone_htod(&as_bf16(down))?),
            bias: None,
            out_dim: h,
            in_dim: i,
        },
    })
}

/// Row widths of the two per-layer caches: K and V, or MLA's latent and shared rope key.
pub fn kv_widths(cfg: &crate::model::ModelConfig) -> (usize, usize) {
    match &cfg.mla {
        Some(m) => (m.kv_lora_rank, m.qk_rope_head_dim),
        None => (
            cfg.num_kv_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        ),
    }
}

impl GpuModel {
    /// Uploads everything but the DRAM experts. `placement[layer][expert]` marks GPU experts; the host
    /// copies of those experts are released from `model` afterwards (one copy of each expert) unless
    /// `keep_host_copies` (live re-placement: DRAM holds every expert, the GPU a cache of the hot ones).
    /// `kv_blocks`: the KV budget in blocks of every layer; `kv_layout` regroups it (same bytes);
    /// `kv_dtype`: bf16 or FP8 rows (FP8 only for grouped-query attention).
    pub fn upload(
        dev: GpuDevice,
        model: &mut Model,
        placement: &[Vec<bool>],
        (kv_blocks, kv_layout, kv_dtype): (
            usize,
            crate::engine::kv::KvLayout,
            moe_sizing::KvCacheDtype,
        ),
        prefill_threshold: usize,
        dense: DenseUpload,
        keep_host_copies: bool,
    ) -> anyhow::Result<Self> {
        let cfg = model.config.clone();
        let s = &dev.stream;
        let fmt = dense.format;
        let embed = if dense.host_embeddings {
            EmbedTable::Host
        } else {
            EmbedTable::Device(s.clone_htod(&linear_bf16(&model.embed))?)
        };
        // A tied lm_head shares the table only when both are bf16 on the GPU.
        let lm_head = match (&model.lm_head, &embed, fmt) {
            (Some(l), _, _) => Some(upload_linear(&dev, l, fmt)?),
            (None, EmbedTable::Device(_), DenseFormat::Bf16) => None,
            (None, _, _) => Some(upload_linear(&dev, &model.embed, fmt)?),
        };
        let dequant_scratch = if fmt == DenseFormat::Bf16 {
            None
        } else {
            Some(dev.alloc_dequant_scratch()?)
        };
        let final_norm = s.clone_htod(&model.final_norm)?;
        let mut layers = Vec::with_capacity(model.layers.len());
        for (li, layer) in model.layers.iter_mut().enumerate() {
            let attn = match &layer.attn {
                Attention::Gqa(a) => GpuAttention::Gqa(GqaWeights {
                    q: upload_linear(&dev, &a.q, fmt)?,
                    k: upload_linear(&dev, &a.k, fmt)?,
                    v: upload_linear(&dev, &a.v, fmt)?,
                    o: upload_linear(&dev, &a.o, fmt)?,
                    q_norm: a.q_norm.as_ref().map(|w| s.clone_htod(w)).transpose()?,
                    k_norm: a.k_norm.as_ref().map(|w| s.clone_htod(w)).transpose()?,
                }),
                Attention::Mla(a) => GpuAttention::Mla(MlaWeights {
                    q: match &a.q {
                        MlaQuery::Direct(l) => GpuMlaQuery::Direct(upload_linear(&dev, l, fmt)?),
                        MlaQuery::LowRank { a, norm, b } => GpuMlaQuery::LowRank {
                            a: upload_linear(&dev, a, fmt)?,
                            norm: s.clone_htod(norm)?,
                            b: upload_linear(&dev, b, fmt)?,
                        },
                    },
                    kv_a: upload_linear(&dev, &a.kv_a, fmt)?,
                    kv_a_norm: s.clone_htod(&a.kv_a_norm)?,
                    kv_b: s.clone_htod(&a.kv_b)?,
                    o: upload_linear(&dev, &a.o, fmt)?,
                }),
                Attention::Linear(la) => GpuAttention::Linear(Box::new(
                    linear_attention::GpuLinearAttention::upload(&dev, la, fmt)?,
                )),
            };
            let ffn = match &mut layer.ffn {
                Ffn::Dense(m) => GpuFfn::Dense(upload_mlp(&dev, m, fmt)?),
                Ffn::Moe(block) => {
                    let on_gpu = placement.get(li).map(Vec::as_slice).unwrap_or(&[]);
                    let mut experts = Vec::with_capacity(block.experts.len());
                    for (e, slot) in block.experts.iter_mut().enumerate() {
                        if on_gpu.get(e).copied().unwrap_or(false) {
                            let m = slot
                                .as_ref()
                                .with_context(|| format!("layer {li} expert {e} missing"))?;
                            experts.push(Some(upload_mlp(&dev, m, DenseFormat::Bf16)?));
                            if !keep_host_copies {
                                *slot = None;
                            }
                        } else {
                            experts.push(None);
                        }
                    }
                    GpuFfn::Moe(GpuMoe {
                        router: s.clone_htod(&block.router)?,
                        correction_bias: match &block.correction_bias {
                            Some(b) => Some(s.clone_htod(b)?),
                            None => None,
                        },
                        experts: ExpertTable::new(experts),
                        shared: match &block.shared {
                            Some(m) => Some(upload_mlp(&dev, m, fmt)?),
                            None => None,
                        },
                        shared_gate: match &block.shared_gate {
                            Some(g) => Some(s.clone_htod(g)?),
                            None => None,
                        },
                    })
                }
            };
            layers.push(GpuLayer {
                attn_norm: s.clone_htod(&layer.attn_norm)?,
                ffn_norm: s.clone_htod(&layer.ffn_norm)?,
                attn,
                ffn,
            });
        }
        let rope = crate::engine::rope::Rope::new(&cfg.rope);
        let inv_freq = s.clone_htod(rope.inv_freq())?;
        let has_rows: Vec<bool> = (0..cfg.num_layers)
            .map(|l| cfg.mixers.get(l) != Some(&crate::model::hybrid::Mixer::Linear))
            .collect();
        let blocks = kv_layout.blocks_for_budget(kv_blocks);
        let gqa_heads = cfg
            .mla
            .is_none()
            .then_some((cfg.num_kv_heads, cfg.head_dim));
        let mut kv = GpuKvPool::new(
            &dev,
            &kv_layout,
            &has_rows,
            kv_widths(&cfg),
            blocks,
            (kv_dtype, gqa_heads),
        )?;
        let hybrid = hybrid::GpuHybrid::upload(&dev, model)?;
        if let (Some(h), Some(ix)) = (&hybrid, &cfg.indexer) {
            for (li, own) in h.indexers.iter().enumerate() {
                if own.is_some() {
                    kv.add_indexer_rows(&dev, li, ix.row_width())?;
                }
            }
        }
        dev.stream.synchronize()?;
        Ok(Self {
            attn_factor: rope.attention_factor(),
            dev,
            embed,
            lm_head,
            dense,
            dequant_scratch: Mutex::new(dequant_scratch),
            final_norm,
            layers,
            inv_freq,
            kv: Arc::new(Mutex::new(kv)),
            kv_layout,
            prefill_threshold,
            split_min_rows: 0,
            split: Mutex::new(split::SplitBalance::default()),
            split_paused: std::sync::atomic::AtomicBool::new(false),
            stream: Mutex::new(None),
            cuda_graphs: false,
            graphs_paused: std::sync::atomic::AtomicBool::new(false),
            switches: switches::DecodeSwitches::default(),
            expert_prefetch_bytes: 0,
            device_routed: std::sync::atomic::AtomicBool::new(
                std::env::var_os("MOE_DEVICE_ROUTED").is_none_or(|v| v != "0"),
            ),
            routed: Mutex::new(None),
            buffers: Mutex::new(buffers::BufferClasses::default()),
            max_step: (1, 1),
            graphs: Mutex::new(graphs::GraphSet::default()),
            prefill_on_cpu: Vec::new(),
            routing_override: Mutex::new(None),
            memory: None,
            hybrid,
            shard: None,
            probe: None,
        })
    }

    /// CUDA graphs captured so far.
    pub fn graphs_captured(&self) -> usize {
        self.graphs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .captured()
    }

    /// The longest sequence the device KV pool holds.
    pub fn kv_positions(&self) -> usize {
        let total = self
            .kv
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .total_blocks;
        self.kv_layout.max_positions(total)
    }

    /// Prepares layerwise prefill's expert stream over `host`'s packed DRAM experts (pins them).
    pub fn attach_expert_stream(&self, host: &Model, chunk_bytes: usize) -> anyhow::Result<()> {
        let t = std::time::Instant::now();
        let es = stream::ExpertStream::new(&self.dev, host, chunk_bytes)?;
        if let Some(es) = &es {
            let msg =
                format!(
                "layerwise prefill: DRAM experts streamed in chunks of {} ({}), set up in {:.1} s",
                es.chunk_experts,
                if es.pinned() { "pinned memory" } else { "pageable memory" },
                t.elapsed().as_secs_f64()
            );
            tracing::info!("{msg}");
        }
        *self.stream.lock().unwrap_or_else(|e| e.into_inner()) = es;
        if self.switches.decode_split() != switches::DecodeShare::Off {
            self.ensure_decode_share(host)?;
        }
        Ok(())
    }

    /// Sets up the decode split's GPU side on the expert stream if there is one and it has none yet
    /// (`decode_split`); between steps only.
    pub fn ensure_decode_share(&self, host: &Model) -> anyhow::Result<()> {
        let mut stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        match stream.as_mut() {
            Some(es) => es.ensure_share(&self.dev, host),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::linear::WeightData;

    /// GGUF dense tensors keep their codes on the GPU: Q4_1 as int4 groups with minimums under int4,
    /// Q8_0 as int8 under int4 and fp8 alike (a file's 8-bit tensor is not rounded to 4 bits or
    /// E4M3), reading back exactly as GGML dequantizes them; Q4_1 under fp8 is quantized to E4M3.
    #[test]
    fn gguf_dense_tensors_keep_their_codes() {
        let (rows, cols) = (4, 64);
        let mut s = 7u64;
        let mut byte = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        };
        let f16_bytes = |x: f32| half::f16::from_f32(x).to_bits().to_le_bytes();
        for (kind, format, want) in [
            (GgmlBlock::Q4_1, DenseFormat::Int4, DenseFormat::Int4),
            (GgmlBlock::Q8_0, DenseFormat::Int4, DenseFormat::Int8),
            (GgmlBlock::Q8_0, DenseFormat::Fp8, DenseFormat::Int8),
            (GgmlBlock::Q4_1, DenseFormat::Fp8, DenseFormat::Fp8),
        ] {
            let (elems, block_bytes) = kind.block();
            let mut bytes = Vec::new();
            for _ in 0..rows * cols / elems {
                let start = bytes.len();
                bytes.extend(f16_bytes(0.01));
                if kind == GgmlBlock::Q4_1 {
                    bytes.extend(f16_bytes(-0.07));
                }
                while bytes.len() < start + block_bytes {
                    bytes.push(byte());
                }
            }
            let mut exact = vec![0f32; rows * cols];
            moe_kernels::cpu::ggml::dequantize(kind, &bytes, &mut exact);
            let l = Linear {
                out_dim: rows,
                in_dim: cols,
                w: WeightData::Ggml { kind, bytes },
                bias: None,
            };
            let q = quantize_linear(&l, format).expect("a GPU layout");
            assert_eq!(q.format(), want, "{kind:?} under {format}");
            if want != DenseFormat::Fp8 {
                let mut row = vec![0f32; cols];
                for r in 0..rows {
                    q.dequantize_row(r, &mut row);
                    assert_eq!(row, exact[r * cols..(r + 1) * cols], "{kind:?} row {r}");
                }
            }
        }
    }

    /// The memory plan counts the 8-bit KV cache's scales as the kernels allocate them.
    #[test]
    fn kv_scale_groups_of_plan_and_kernels_agree() {
        for head_dim in [8usize, 16, 24, 32, 40, 64, 72, 96, 128, 192, 256, 7] {
            assert_eq!(
                moe_kernels::cuda::kv_q8::scale_group(head_dim) as u64,
                moe_sizing::kv_scale_group(head_dim as u64),
                "head_dim {head_dim}"
            );
        }
    }
}
