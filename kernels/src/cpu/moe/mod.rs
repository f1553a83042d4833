//! Routed-expert FFN of an MoE layer on the CPU: the experts of one layer that live in DRAM, repacked
//! once at load, computed for a batch of tokens at DRAM bandwidth.
//!
//! # How the engine uses it
//! ```ignore
//! use moe_kernels::cpu::{CpuMoeOptions, moe::*};
//! let opts = CpuMoeOptions { threads: Some(16), ..Default::default() };   // --cpu-threads 16
//! let pool = opts.build_pool()?;                        // once per process: pinned persistent workers
//! let cfg = ExpertSetConfig::new(hidden, inter, WeightFormat::Bf16)
//!     .with_activation(Activation::Silu, swiglu_limit)
//!     .with_hugepages(opts.hugepages).with_max_tier(opts.max_tier);
//! // per layer, at load: global ids of the experts kept in DRAM and their HF tensors ([out, in])
//! let set = CpuExpertSet::new(&cfg, &ids, &sources, &pool)?;  // sources: ExpertSource { gate, up, down }
//! // per step: x [T × hidden] f32, router top-k ids/weights [T × k]; adds into out [T × hidden]
//! set.forward(&pool, &x, &topk_ids, &topk_weights, k, &mut out)?;
//! ```
//! Ids not held by the set (experts on the GPU) are skipped, so the GPU side adds its own experts'
//! share into the same output. `forward` computes `out[t] += Σ_j w[t][j] · down(act(gate x) ⊙ up x)`
//! with SiLU (or GELU-tanh) and the optional GLM `swiglu_limit` clamp (gate ≤ limit, up in ±limit).
//! Routing weights are applied as given (normalisation and `routed_scaling_factor` are the caller's).
//!
//! - Sources: `SourceTensor::Bf16(&[u16])` (bf16 bits; cast a `&[half::bf16]` with bytemuck),
//!   `F32`, or `Fp8E4M3 { data, scale_inv }` with `weight_scale_inv` `[ceil(out/128), ceil(in/128)]`.
//!   They are only read during `new`; the packed copy lives in hugepage-backed memory (`page_kinds()`).
//! - Formats: `Bf16` (needs bf16/f32 sources, or FP8 upcast), `Fp8Block` (needs FP8 sources: bytes and
//!   scales kept as stored), `Int8` and `Int4 { group: 32 | 64 | 128 }` (quantized at load from any source).
//! - Threads: one [`WorkerPool`] for the process, shared by all layers; calls serialize on it. The
//!   thread that calls `forward` works as worker 0 and is pinned to the pool's first CPU on its first
//!   call (threads it spawns afterwards inherit that one-CPU affinity: spawn them before, or from
//!   another thread). With several NUMA groups the experts are split across them, each group's share in
//!   its node's memory.
//! - Tiers: the best of scalar / AVX2 / AVX-512 / AMX this CPU has, detected once; `max_tier` or
//!   [`CpuExpertSet::set_max_tier`] force a lower one.
//!
//! # Work split (where the time goes)
//! Per call: (A) activations converted once per token (bf16 / int8 as the kernels need), and gathered
//! into 16-row blocks for experts that use AMX; (B) gate and up for every (expert, chunk of 16-row output
//! tiles), activation applied, routing weight folded in, bf16 down activations written directly; (C) for
//! int8 kinds only, the intermediate rows quantized (their scale needs the whole row); (D) down, split
//! by chunks of the hidden dimension over all the group's experts, so each output column belongs to one
//! thread (no atomics, no reduction pass). Each region hands out items through an atomic counter, so one
//! decode token spreads its 8 experts' rows over every core. Weight bytes are read exactly once per call
//! (from DRAM; token blocks after the first re-read them from L2); everything else is small.

pub(crate) mod act;
pub(crate) mod act_i8;
pub(crate) mod amx_config;
mod export;
mod forward;
mod fused;
#[cfg(test)]
mod fused_tests;
pub(crate) mod gemm;
mod kern_amx;
#[cfg(target_arch = "x86_64")]
pub(crate) mod kern_amx_int;
mod kern_avx512;
mod kern_fp8;
mod kern_generic;
pub(crate) mod pack;
mod packed;
mod prefetch;
#[cfg(test)]
mod tests;

pub use act::{gated_rows, Activation};
pub use forward::RegionTimes;
pub use fused::{DecodePath, DecodePlan, ItemKib, FUSED_MAX_TOKENS};
pub use kern_avx512::{PrefetchHint, StreamPrefetch};
pub use pack::{
    bf16_to_f32, f32_to_bf16, format_for_ggml, fp8_e4m3_to_f32, PackError, SourceTensor,
    WeightFormat,
};
pub use packed::{unpack_bf16, PackedGeometry, PackedMat};
pub use prefetch::ExpertPrefetcher;

use std::sync::Mutex;

use thiserror::Error;

/// Every A/B knob of the CPU expert kernels as the environment sets it: the first one set to a value
/// it does not take (`crate::knob`). `moe-daemon` calls this at start and refuses to run on an error.
pub fn check_env_knobs() -> Result<(), crate::knob::KnobError> {
    fused::DECODE_PATH_KNOB.check()?;
    fused::ITEM_KIB_KNOB.check()?;
    kern_avx512::PREFETCH_KNOB.check()?;
    kern_avx512::PREFETCH_HINT_KNOB.check()?;
    Ok(())
}

use crate::cpu::features::CpuTier;
use crate::cpu::memory::{HugeBuffer, HugepageMode, PageKind};
use crate::cpu::pool::WorkerPool;
use pack::{check_source, pack_matrix, MatLayout, MatRef};

#[derive(Debug, Error)]
pub enum MoeError {
    #[error(transparent)]
    Pack(#[from] PackError),
    #[error("expert {id}: {source}")]
    Expert { id: u32, source: PackError },
    #[error("{ids} expert ids but {sources} expert sources")]
    Count { ids: usize, sources: usize },
    #[error("expert id {0} given twice")]
    Duplicate(u32),
    #[error("x has {got} values, not a multiple of hidden size {hidden}")]
    Input { got: usize, hidden: usize },
    #[error("{what} has {got} values, expected {want}")]
    Len {
        what: &'static str,
        got: usize,
        want: usize,
    },
    #[error("pool has {pool} groups but the expert set was built for {set}")]
    Pool { pool: usize, set: usize },
}

/// Source tensors of one expert, HF layout: gate `[inter, hidden]`, up `[inter, hidden]`, down `[hidden, inter]`.
#[derive(Clone, Copy, Debug)]
pub struct ExpertSource<'a> {
    pub gate: SourceTensor<'a>,
    pub up: SourceTensor<'a>,
    pub down: SourceTensor<'a>,
}

/// Shape, format and math of a layer's experts.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertSetConfig {
    pub hidden: usize,
    pub inter: usize,
    pub format: WeightFormat,
    pub activation: Activation,
    /// GLM-style clamp: gate ≤ limit, up in [-limit, limit], before the activation.
    pub swiglu_limit: Option<f32>,
    pub hugepages: HugepageMode,
    /// Cap on the kernel tier (clamped to the CPU); `None` = best available.
    pub max_tier: Option<CpuTier>,
    /// An expert with at least this many tokens in a call uses AMX (when the tier has it).
    pub amx_min_tokens: usize,
}

impl ExpertSetConfig {
    pub fn new(hidden: usize, inter: usize, format: WeightFormat) -> ExpertSetConfig {
        ExpertSetConfig {
            hidden,
            inter,
            format,
            activation: Activation::Silu,
            swiglu_limit: None,
            hugepages: HugepageMode::Auto,
            max_tier: None,
            amx_min_tokens: 16,
        }
    }
    pub fn with_activation(mut self, a: Activation, swiglu_limit: Option<f32>) -> Self {
        self.activation = a;
        self.swiglu_limit = swiglu_limit;
        self
    }
    pub fn with_hugepages(mut self, h: HugepageMode) -> Self {
        self.hugepages = h;
        self
    }
    pub fn with_max_tier(mut self, t: Option<CpuTier>) -> Self {
        self.max_tier = t;
        self
    }
}

/// Where one expert's packed matrices live.
#[derive(Clone, Copy, Debug)]
struct ExpertSlot {
    group: usize,
    offset: usize,
}

/// The buffers of one [`CpuExpertSet::forward`] call (routed rows, converted activations, intermediate
/// rows), kept between calls so decode allocates nothing and sized by the largest call so far. Sets that
/// share one (a model's layers, which run one after the other) hold that largest call's buffers once
/// instead of once per layer (about 50 MB per Qwen3-30B-A3B layer per 1000 tokens computed on the CPU);
/// their calls serialize on it.
#[derive(Clone, Default)]
pub struct SharedScratch(std::sync::Arc<Mutex<forward::Scratch>>);

impl SharedScratch {
    fn lock(&self) -> std::sync::LockResult<std::sync::MutexGuard<'_, forward::Scratch>> {
        self.0.lock()
    }
}

/// The DRAM-resident experts of one MoE layer, packed for the CPU kernels.
pub struct CpuExpertSet {
    cfg: ExpertSetConfig,
    tier: CpuTier,
    gate_l: MatLayout,
    down_l: MatLayout,
    /// Global id → index into `slots`.
    local: Vec<Option<u32>>,
    ids: Vec<u32>,
    slots: Vec<ExpertSlot>,
    buffers: Vec<HugeBuffer>,
    groups: usize,
    scratch: SharedScratch,
    /// How decode-sized calls run (see [`DecodePath`]).
    decode_path: DecodePath,
    /// Item sizes of the fused decode path.
    fused_targets: fused::Targets,
}

impl CpuExpertSet {
    /// Packs the experts `ids[i]` from `sources[i]` (checked first), spread over the pool's groups
    /// (NUMA nodes) in contiguous id ranges, each group's experts in one buffer packed by that group's
    /// threads (first touch = node-local pages).
    pub fn new(
        cfg: &ExpertSetConfig,
        ids: &[u32],
        sources: &[ExpertSource<'_>],
        pool: &WorkerPool,
    ) -> Result<CpuExpertSet, MoeError> {
        if ids.len() != sources.len() {
            return Err(MoeError::Count {
                ids: ids.len(),
                sources: sources.len(),
            });
        }
        cfg.format.check_group()?;
        let (h, i) = (cfg.hidden, cfg.inter);
        for (&id, s) in ids.iter().zip(sources) {
            let err = |source| MoeError::Expert { id, source };
            check_source("gate", &s.gate, i, h).map_err(err)?;
            check_source("up", &s.up, i, h).map_err(err)?;
            check_source("down", &s.down, h, i).map_err(err)?;
            if cfg.format == WeightFormat::Fp8Block {
                for (name, t) in [("gate", &s.gate), ("up", &s.up), ("down", &s.down)] {
                    if !matches!(t, SourceTensor::Fp8E4M3 { .. }) {
                        return Err(err(PackError::NotFp8 { name }));
                    }
                }
            }
        }
        let max_id = ids.iter().copied().max().map_or(0, |m| m as usize + 1);
        let mut local = vec![None; max_id];
        for (n, &id) in ids.iter().enumerate() {
            if local[id as usize].replace(n as u32).is_some() {
                return Err(MoeError::Duplicate(id));
            }
        }
        let gate_l = MatLayout::new(cfg.format, i, h);
        let down_l = MatLayout::new(cfg.format, h, i);
        let per_expert = 2 * gate_l.bytes() + down_l.bytes();
        let groups = pool.groups();
        let n = ids.len();
        let mut slots = Vec::with_capacity(n);
        let mut counts = vec![0usize; groups];
        for e in 0..n {
            let g = e * groups / n.max(1);
            slots.push(ExpertSlot {
                group: g,
                offset: counts[g] * per_expert,
            });
            counts[g] += 1;
        }
        let mut buffers: Vec<HugeBuffer> = (0..groups)
            .map(|g| HugeBuffer::new(counts[g] * per_expert, cfg.hugepages, pool.group_node(g)))
            .collect();
        let bases: Vec<usize> = buffers
            .iter_mut()
            .map(|b| b.as_mut_ptr() as usize)
            .collect();
        // Items per group: (expert of the group, matrix 0..3).
        let first: Vec<usize> = (0..groups)
            .map(|g| slots.iter().position(|s| s.group == g).unwrap_or(0))
            .collect();
        let items: Vec<usize> = counts.iter().map(|c| c * 3).collect();
        pool.run(&items, &|g, item, _| {
            let e = first[g] + item / 3;
            let (l, src, off) = match item % 3 {
                0 => (&gate_l, &sources[e].gate, 0),
                1 => (&gate_l, &sources[e].up, gate_l.bytes()),
                _ => (&down_l, &sources[e].down, 2 * gate_l.bytes()),
            };
            let at = bases[g] + slots[e].offset + off;
            // SAFETY: each (expert, matrix) owns the disjoint byte range [at, at + l.bytes()) of its
            // group's buffer, which outlives this region; scales follow weights, 4-byte aligned.
            let (w, s) = unsafe {
                (
                    std::slice::from_raw_parts_mut(at as *mut u8, l.w_bytes),
                    std::slice::from_raw_parts_mut((at + l.w_bytes) as *mut f32, l.s_len),
                )
            };
            pack_matrix(l, src, w, s);
        });
        let tier = cfg.max_tier.unwrap_or(CpuTier::Amx).clamp_to_cpu();
        Ok(CpuExpertSet {
            cfg: cfg.clone(),
            tier,
            gate_l,
            down_l,
            local,
            ids: ids.to_vec(),
            slots,
            buffers,
            groups,
            scratch: SharedScratch::default(),
            decode_path: DecodePath::from_env(),
            fused_targets: fused::Targets::from_env(),
        })
    }

    /// This set computing its calls in `scratch` (another set's, [`CpuExpertSet::scratch`]) instead of
    /// its own: see [`SharedScratch`].
    pub fn with_scratch(mut self, scratch: SharedScratch) -> CpuExpertSet {
        self.scratch = scratch;
        self
    }

    /// The buffers this set's calls work in, to hand to the other layers' sets.
    pub fn scratch(&self) -> SharedScratch {
        self.scratch.clone()
    }

    pub fn config(&self) -> &ExpertSetConfig {
        &self.cfg
    }

    /// Global ids of the experts held, in construction order.
    pub fn expert_ids(&self) -> &[u32] {
        &self.ids
    }

    pub fn holds(&self, id: u32) -> bool {
        self.local.get(id as usize).is_some_and(|x| x.is_some())
    }

    /// Kernel tier used by `forward`.
    pub fn tier(&self) -> CpuTier {
        self.tier
    }

    /// Lowers (or raises, up to the CPU's best) the tier used by `forward`: tests, benchmarks.
    pub fn set_max_tier(&mut self, t: CpuTier) {
        self.tier = t.clamp_to_cpu();
    }

    /// The path decode-sized calls take (default: `MOE_CPU_DECODE`, else chained).
    pub fn decode_path(&self) -> DecodePath {
        self.decode_path
    }

    /// Switches the path of decode-sized calls: A/B benchmarks, tests.
    pub fn set_decode_path(&mut self, p: DecodePath) {
        self.decode_path = p;
    }

    /// Every set computing in this set's scratch (a model's layers, [`CpuExpertSet::with_scratch`])
    /// takes path `p` for its decode-sized calls instead of its own, until `None`: one-process A/B
    /// runs of an engine's own sets, which it holds shared. Waits for a call in progress.
    pub fn set_shared_decode_path(&self, p: Option<DecodePath>) {
        self.scratch
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .path_override = p;
    }

    /// Page kinds the expert memory got, one per group.
    pub fn page_kinds(&self) -> Vec<PageKind> {
        self.buffers.iter().map(|b| b.kind()).collect()
    }

    /// The memory holding the packed experts, one buffer per group (what
    /// [`backing_of`](crate::cpu::memory::backing_of) reads).
    pub fn buffers(&self) -> &[HugeBuffer] {
        &self.buffers
    }

    /// Bytes of packed weights and scales.
    pub fn bytes(&self) -> usize {
        self.buffers.iter().map(|b| b.len()).sum()
    }

    /// Packed weight bytes of one expert (gate + up + down, with scales).
    pub fn bytes_per_expert(&self) -> usize {
        2 * self.gate_l.bytes() + self.down_l.bytes()
    }

    fn mats(&self, e: usize) -> [MatRef<'_>; 3] {
        let s = self.slots[e];
        mat_refs(self.gate_l, self.down_l, &self.buffers[s.group][s.offset..])
    }
}

/// The gate, up and down matrices of one expert whose packed bytes start at `base` (64-byte aligned).
fn mat_refs(gate_l: MatLayout, down_l: MatLayout, base: &[u8]) -> [MatRef<'_>; 3] {
    let mat = |l: MatLayout, off: usize| {
        let w = &base[off..off + l.w_bytes];
        let sb = &base[off + l.w_bytes..off + l.w_bytes + 4 * l.s_len];
        assert!(
            sb.as_ptr().align_offset(4) == 0,
            "packed expert bytes misaligned"
        );
        // SAFETY: 4-byte aligned (checked; scales sit at a 64-byte aligned offset, tile bytes are
        // multiples of 512) and in bounds; any bit pattern is an f32.
        let s = unsafe { std::slice::from_raw_parts(sb.as_ptr().cast::<f32>(), l.s_len) };
        MatRef { l, w, s }
    };
    [
        mat(gate_l, 0),
        mat(gate_l, gate_l.bytes()),
        mat(down_l, 2 * gate_l.bytes()),
    ]
}
