//! A step's device buffers, declared once per batch-size class and reused by every step of that class,
//! eager or replayed from CUDA graphs: the layer loop allocates nothing.
//!
//! Classes (what the memory plan budgets, `moe_sizing::plan`):
//! - `Decode`: up to [`MAX_GRAPH_ROWS`] rows and sequences, block tables as wide as the KV pool. Its
//!   addresses are what captured graphs bake in, so it is allocated once and never moved; eager
//!   steps of that size use it too. Only with CUDA graphs on (the plan's "CUDA graphs" item).
//! - `Large`: every other step (all steps with graphs off), sized for the step's rows and sequences
//!   (powers of two, capped by the engine's step limits) and grown when a step needs more (the plan's
//!   "activations" item, a step of `max_step_tokens`).
//!
//! Each set holds its mapped hand-off buffers too (graphs bake their addresses as well).
use super::handoff::Handoff;
use super::{GpuAttention, GpuFfn, GpuMlaQuery, GpuModel};
use crate::model::ModelConfig;
use cudarc::driver::CudaSlice;
use half::bf16;

/// Largest decode batch replayed from graphs (larger batches run eagerly on the large class).
pub const MAX_GRAPH_ROWS: usize = 64;

/// Device copies of where each token of the step sits.
pub struct IndexBufs {
    pub ids: CudaSlice<i32>,
    pub pos: CudaSlice<i32>,
    pub seq: CudaSlice<i32>,
    /// Per group of layers (`engine::kv::layout`): each row's cache slot, and `[sequences, stride]`
    /// block ids.
    pub slots: Vec<CudaSlice<i32>>,
    pub tables: Vec<CudaSlice<i32>>,
    /// Row stride of `tables`: the most blocks one sequence of a step of this class may hold.
    pub stride: usize,
}

/// Attention's buffers: GQA's q, k, v (f32) and output (bf16), sized when every layer is GQA; MLA's
/// when any layer is MLA.
pub struct AttnBufs {
    pub rows: usize,
    pub gqa: bool,
    pub q: CudaSlice<f32>,
    pub k: CudaSlice<f32>,
    pub v: CudaSlice<f32>,
    pub out: CudaSlice<bf16>,
    pub mla: Option<MlaBufs>,
    /// Long-prefill GQA attention's scratch (`prefill_gqa`).
    pub prefill: PrefillScratch,
}

/// Long-prefill GQA attention's scratch: the chunk's queries, its sequence's keys and values so far
/// (bf16), and one query block's scores (f32) and probabilities (bf16). Sized by the longest context
/// seen, not by the step's rows, so each buffer is grown when a longer context first arrives (at most
/// once per step, at its first layer) and otherwise reused by every layer and step; the memory plan's
/// prefill item budgets its largest size.
#[derive(Default)]
pub struct PrefillScratch {
    pub q: Option<CudaSlice<bf16>>,
    pub k: Option<CudaSlice<bf16>>,
    pub v: Option<CudaSlice<bf16>>,
    pub scores: Option<CudaSlice<f32>>,
    pub probs: Option<CudaSlice<bf16>>,
}

impl GpuModel {
    /// `slot`'s buffer, reallocated first when it holds fewer than `n` elements.
    pub(super) fn grown<'a, T>(
        &self,
        slot: &'a mut Option<CudaSlice<T>>,
        n: usize,
    ) -> anyhow::Result<&'a mut CudaSlice<T>>
    where
        T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits,
    {
        if slot.as_ref().is_none_or(|b| b.len() < n) {
            // the old buffer goes back to the pool first (stream-ordered), so both never coexist
            *slot = None;
            *slot = Some(self.alloc(n)?);
        }
        Ok(slot.as_mut().expect("allocated above"))
    }
}

/// MLA's per-step rows (absorbed form).
pub struct MlaBufs {
    /// Queries `[rows, heads, nope + rope]` f32.
    pub q: CudaSlice<f32>,
    /// The low-rank query's latent `[rows, q_lora_rank]`, f32 and normalised bf16.
    pub q_a: CudaSlice<f32>,
    pub q_a_bf16: CudaSlice<bf16>,
    /// The normalised q latent in f32 (the sparse-attention indexer reads it).
    pub q_a_norm: CudaSlice<f32>,
    /// kv_a_proj output `[rows, lora + rope]`, split into the normalised latent and the rope key.
    pub ckv: CudaSlice<f32>,
    pub latent: CudaSlice<f32>,
    pub krope: CudaSlice<f32>,
    /// Attention output `[rows, heads, v_dim]` bf16.
    pub out: CudaSlice<bf16>,
}

/// A dense MLP's (dense layers, shared experts) intermediate rows and an output for gated sums.
pub struct MlpBufs {
    /// `[rows, 2 · inter]` f32, `[rows, inter]` bf16 (inter: the widest MLP of the model).
    pub gate_up: CudaSlice<f32>,
    pub act: CudaSlice<bf16>,
    /// `[rows, hidden]`: the shared expert's output before its sigmoid gate.
    pub out: CudaSlice<f32>,
}

/// Routed experts computed on the GPU: every token's top-k rows at most.
pub struct ExpertBufs {
    /// The dispatch plan's row index (token and weight per row) and combine CSR.
    pub row_token: CudaSlice<i32>,
    pub row_weight: CudaSlice<f32>,
    pub token_offsets: CudaSlice<i32>,
    pub token_rows: CudaSlice<i32>,
    /// Gathered inputs `[rows·k, hidden]` bf16, gate_up `[rows·k, 2·inter]` f32, activations
    /// `[rows·k, inter]` bf16, outputs `[rows·k, hidden]` f32.
    pub x: CudaSlice<bf16>,
    pub gate_up: CudaSlice<f32>,
    pub act: CudaSlice<bf16>,
    pub y: CudaSlice<f32>,
    /// cuBLAS's pointer table of the batched expert GEMMs (weights, inputs, outputs of each GPU
    /// expert of a phase; `gemm_bf16_items`).
    pub gemm_table: CudaSlice<u64>,
}

impl ExpertBufs {
    /// Buffers for `routed` expert rows of `tokens` tokens, `hd` wide with experts `inter` wide, a
    /// phase holding at most `experts` experts; allocated on `stream` (every element a phase reads
    /// is written earlier in it: no memset).
    pub fn new(
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
        (tokens, routed): (usize, usize),
        (hd, inter): (usize, usize),
        experts: usize,
    ) -> anyhow::Result<ExpertBufs> {
        fn alloc<T: cudarc::driver::DeviceRepr>(
            s: &std::sync::Arc<cudarc::driver::CudaStream>,
            n: usize,
        ) -> anyhow::Result<CudaSlice<T>> {
            // SAFETY: see above; written before read.
            Ok(unsafe { s.alloc::<T>(n.max(1)) }?)
        }
        Ok(ExpertBufs {
            row_token: alloc(stream, routed)?,
            row_weight: alloc(stream, routed)?,
            token_offsets: alloc(stream, tokens + 1)?,
            token_rows: alloc(stream, routed)?,
            x: alloc(stream, routed * hd)?,
            gate_up: alloc(stream, routed * 2 * inter)?,
            act: alloc(stream, routed * inter)?,
            y: alloc(stream, routed * hd)?,
            // one entry of each kind per GPU expert a phase can hold
            gemm_table: alloc(
                stream,
                moe_kernels::cuda::table_len(routed.min(experts.max(1)), routed),
            )?,
        })
    }
}

/// Final norm rows and logits of each sequence's last position.
pub struct HeadBufs {
    pub last_rows: CudaSlice<i32>,
    /// `[seqs, hidden]` bf16, `[seqs, vocab]` f32.
    pub rows: CudaSlice<bf16>,
    pub logits: CudaSlice<f32>,
}

/// Activations of a step, reused by every layer (each layer overwrites what it reads).
pub struct ActBufs {
    /// Residual stream `[rows, hidden]`.
    pub x: CudaSlice<f32>,
    /// Normalised rows as GEMM input (bf16) and for the CPU experts and the router (f32).
    pub hb: CudaSlice<bf16>,
    pub hf: CudaSlice<f32>,
    /// Router logits `[rows, experts]`, top-k ids and weights `[rows, k]`.
    pub logits: CudaSlice<f32>,
    pub eids: CudaSlice<i32>,
    pub w: CudaSlice<f32>,
    pub attn: AttnBufs,
    pub mlp: MlpBufs,
    pub experts: ExpertBufs,
    pub head: HeadBufs,
}

/// Every buffer of steps of up to `rows` rows and `seqs` sequences.
pub struct StepBuffers {
    pub rows: usize,
    pub seqs: usize,
    pub index: IndexBufs,
    pub acts: ActBufs,
    pub hand: Handoff,
    /// Hybrid-attention models' buffers (`hybrid_bufs`).
    pub hybrid: Option<super::hybrid_bufs::HybridBufs>,
}

/// The two classes' buffer sets (created on first use).
#[derive(Default)]
pub struct BufferClasses {
    pub decode: Option<StepBuffers>,
    pub large: Option<StepBuffers>,
}

/// Which class a step of `rows` rows and `seqs` sequences uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchClass {
    Decode,
    Large,
}

impl BatchClass {
    pub fn of(rows: usize, seqs: usize, cuda_graphs: bool) -> BatchClass {
        if cuda_graphs && rows <= MAX_GRAPH_ROWS && seqs <= MAX_GRAPH_ROWS {
            BatchClass::Decode
        } else {
            BatchClass::Large
        }
    }
}

/// How a step runs, decided once from its shape and the engine's switches before anything is
/// enqueued: its buffer class, whether its segments replay from CUDA graphs, whether its layers
/// pipeline with the CPU experts, and whether resident experts may be computed from the routing on
/// the device (`routed`). Every condition of those paths lives here, not at the places that use them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepClass {
    /// Rows of the step.
    pub rows: usize,
    pub buffers: BatchClass,
    /// At least the layerwise-prefill threshold: DRAM experts go to the GPU.
    pub long_prompt: bool,
    /// Plain decode replayed from graphs: every sequence adds one token, at most
    /// [`MAX_GRAPH_ROWS`] rows, graphs on and not paused, no probe, and GQA or hybrid attention.
    pub graphs: bool,
    /// The next layer's segment is enqueued before this layer's CPU experts run (`handoff`).
    pub pipelined: bool,
    /// Mid-length prompt whose DRAM experts are split between the GPU stream and the CPU (`split`).
    pub split: bool,
    /// Resident experts may be computed from the device routing (`routed`): the path is on, the
    /// step is small (at most [`MAX_GRAPH_ROWS`] rows and `routed::MAX_PAIRS` pairs, not a long
    /// prompt), one GPU (no tensor parallelism, no probe), no hybrid attention, exact routing (no
    /// deferred experts, early routing or benchmark override) and widths the kernels take.
    pub device_routing: bool,
}

impl GpuModel {
    /// The class of a step of `rows` rows in `seqs` sequences (`decode_rows`: each adds one token).
    pub(super) fn step_class(
        &self,
        cfg: &ModelConfig,
        (rows, seqs): (usize, usize),
        decode_rows: bool,
    ) -> StepClass {
        use std::sync::atomic::Ordering::Relaxed;
        let long_prompt = rows >= self.prefill_threshold;
        let probing = self.probing();
        let graphs = self.cuda_graphs
            && !self.graphs_paused.load(Relaxed)
            && !long_prompt
            && rows <= MAX_GRAPH_ROWS
            && decode_rows
            && !probing
            && (self.all_gqa() || self.hybrid.is_some());
        let pipelined = self.pipelined(long_prompt, decode_rows, rows);
        let split = self.split_step(long_prompt, pipelined, rows);
        // a probe waits for the stream inside the step, which a pipelined step must not do
        let pipelined = pipelined && !probing;
        let device_routing = cfg.moe.as_ref().is_some_and(|mc| {
            self.device_routed.load(Relaxed)
                && !long_prompt
                && rows <= MAX_GRAPH_ROWS
                && rows * mc.top_k <= moe_kernels::cuda::routed::MAX_PAIRS
                && self.shard.is_none()
                && !probing
                && self.hybrid.is_none()
                && self.switches.defer_experts() == 0
                && !self.early_routing()
                && !self.routing_overridden()
                && moe_kernels::cuda::routed::supported_widths(
                    cfg.hidden_size,
                    mc.expert_intermediate,
                )
        });
        StepClass {
            rows,
            buffers: BatchClass::of(rows, seqs, self.cuda_graphs),
            long_prompt,
            graphs,
            pipelined,
            split,
            device_routing,
        }
    }
}

/// Capacity of a large-class set for `need` rows: the next power of two, but not beyond `limit`
/// (the engine's step limit, what the plan budgets) unless the step itself is larger.
pub fn large_capacity(need: usize, limit: usize) -> usize {
    need.next_power_of_two().min(limit.max(need)).max(1)
}

impl GpuModel {
    /// The buffer set of `class` for a step of `rows` rows, `seqs` sequences whose block tables hold
    /// at most `blocks` blocks, allocated or grown as needed (the decode set only once).
    pub(super) fn step_buffers<'a>(
        &self,
        sets: &'a mut BufferClasses,
        cfg: &ModelConfig,
        class: BatchClass,
        (rows, seqs, blocks): (usize, usize, usize),
        pool_blocks: usize,
    ) -> anyhow::Result<&'a mut StepBuffers> {
        let (limit_rows, limit_seqs) = self.max_step;
        // The decode class's indexer score rows cover every position of the KV pool (graphs).
        let score_positions = match class {
            BatchClass::Decode => pool_blocks * crate::engine::kv::BLOCK,
            BatchClass::Large => 0,
        };
        let (slot, want) = match class {
            BatchClass::Decode => (
                &mut sets.decode,
                (MAX_GRAPH_ROWS, MAX_GRAPH_ROWS, pool_blocks),
            ),
            BatchClass::Large => (
                &mut sets.large,
                (
                    large_capacity(rows, limit_rows),
                    large_capacity(seqs, limit_seqs),
                    large_capacity(blocks, pool_blocks),
                ),
            ),
        };
        let fits = |b: &StepBuffers| b.rows >= rows && b.seqs >= seqs;
        if let Some(b) = slot.as_mut().filter(|b| fits(b) && b.index.stride < blocks) {
            // Only a sequence's block table outgrew the set (a long decode): widen the tables alone.
            let stride = want.2;
            for t in &mut b.index.tables {
                *t = self.alloc(b.seqs * stride)?;
            }
            b.index.stride = stride;
        }
        if !slot.as_ref().is_some_and(fits) {
            // Drop the smaller set first, so both never coexist (stream-ordered frees).
            *slot = None;
            let (r, s, stride) = want;
            let b = StepBuffers {
                rows: r,
                seqs: s,
                index: self.alloc_index(r, s, stride)?,
                acts: self.alloc_acts(cfg, r, s)?,
                hand: Handoff::new(
                    &self.dev,
                    r * cfg.moe.as_ref().map_or(1, |m| m.top_k),
                    r * cfg.hidden_size,
                )?,
                hybrid: self.alloc_hybrid(cfg, r, s, score_positions)?,
            };
            // Allocations are stream-ordered; graphs captured later must find them done.
            self.dev.stream.synchronize()?;
            *slot = Some(b);
        }
        Ok(slot.as_mut().expect("set above"))
    }

    fn alloc_index(&self, rows: usize, seqs: usize, stride: usize) -> anyhow::Result<IndexBufs> {
        let groups = self.kv_layout.groups().len();
        Ok(IndexBufs {
            ids: self.alloc(rows)?,
            pos: self.alloc(rows)?,
            seq: self.alloc(rows)?,
            slots: (0..groups)
                .map(|_| self.alloc(rows))
                .collect::<Result<_, _>>()?,
            tables: (0..groups)
                .map(|_| self.alloc(seqs * stride))
                .collect::<Result<_, _>>()?,
            stride,
        })
    }

    /// Activation buffers for `rows` rows and `seqs` sequences.
    fn alloc_acts(&self, cfg: &ModelConfig, rows: usize, seqs: usize) -> anyhow::Result<ActBufs> {
        let hd = cfg.hidden_size;
        let (experts, k, inter) = cfg.moe.as_ref().map_or((1, 1, 0), |m| {
            (m.num_experts, m.top_k, m.expert_intermediate)
        });
        let gqa = self.all_gqa();
        let (qd, kd) = if gqa {
            (
                cfg.num_heads * cfg.head_dim,
                cfg.num_kv_heads * cfg.head_dim,
            )
        } else {
            (0, 0)
        };
        let mlp_inter = self.widest_mlp();
        let routed = if cfg.moe.is_some() { rows * k } else { 0 };
        Ok(ActBufs {
            x: self.alloc(rows * hd)?,
            hb: self.alloc(rows * hd)?,
            hf: self.alloc(rows * hd)?,
            logits: self.alloc(rows * experts)?,
            eids: self.alloc(rows * k)?,
            w: self.alloc(rows * k)?,
            attn: AttnBufs {
                rows,
                gqa,
                q: self.alloc(rows * qd)?,
                k: self.alloc(rows * kd)?,
                v: self.alloc(rows * kd)?,
                out: self.alloc(rows * qd)?,
                mla: self.alloc_mla(cfg, rows)?,
                prefill: PrefillScratch::default(),
            },
            mlp: MlpBufs {
                gate_up: self.alloc(rows * 2 * mlp_inter)?,
                act: self.alloc(rows * mlp_inter)?,
                out: self.alloc(rows * hd)?,
            },
            experts: ExpertBufs::new(&self.dev.stream, (rows, routed), (hd, inter), experts)?,
            head: HeadBufs {
                last_rows: self.alloc(seqs)?,
                rows: self.alloc(seqs * hd)?,
                logits: self.alloc(seqs * cfg.vocab_size)?,
            },
        })
    }

    /// MLA's buffers when some layer is MLA.
    fn alloc_mla(&self, cfg: &ModelConfig, rows: usize) -> anyhow::Result<Option<MlaBufs>> {
        let (Some(m), true) = (
            &cfg.mla,
            self.layers
                .iter()
                .any(|l| matches!(l.attn, GpuAttention::Mla(_))),
        ) else {
            return Ok(None);
        };
        let q_lora = self
            .layers
            .iter()
            .filter_map(|l| match &l.attn {
                GpuAttention::Mla(w) => match &w.q {
                    GpuMlaQuery::LowRank { a, .. } => Some(a.out_dim),
                    GpuMlaQuery::Direct(_) => None,
                },
                GpuAttention::Gqa(_) | GpuAttention::Linear(_) => None,
            })
            .max()
            .unwrap_or(0);
        let (nh, qk) = (cfg.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim);
        let (lora, rope) = (m.kv_lora_rank, m.qk_rope_head_dim);
        Ok(Some(MlaBufs {
            q: self.alloc(rows * nh * qk)?,
            q_a: self.alloc(rows * q_lora)?,
            q_a_bf16: self.alloc(rows * q_lora)?,
            q_a_norm: self.alloc(rows * q_lora)?,
            ckv: self.alloc(rows * (lora + rope))?,
            latent: self.alloc(rows * lora)?,
            krope: self.alloc(rows * rope)?,
            out: self.alloc(rows * nh * m.v_head_dim)?,
        }))
    }

    pub(super) fn all_gqa(&self) -> bool {
        self.layers
            .iter()
            .all(|l| matches!(l.attn, GpuAttention::Gqa(_)))
    }

    /// Intermediate width of the widest dense MLP or shared expert (0 without any).
    fn widest_mlp(&self) -> usize {
        self.layers
            .iter()
            .filter_map(|l| match &l.ffn {
                GpuFfn::Dense(m) => Some(m.down.in_dim),
                GpuFfn::Moe(moe) => moe.shared.as_ref().map(|m| m.down.in_dim),
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_and_capacities() {
        assert_eq!(BatchClass::of(1, 1, true), BatchClass::Decode);
        assert_eq!(BatchClass::of(64, 64, true), BatchClass::Decode);
        assert_eq!(BatchClass::of(65, 3, true), BatchClass::Large);
        assert_eq!(
            BatchClass::of(1, 1, false),
            BatchClass::Large,
            "graphs off: one class"
        );
        assert_eq!(large_capacity(300, 2048), 512);
        assert_eq!(large_capacity(1500, 2048), 2048);
        assert_eq!(large_capacity(1500, 1600), 1600, "capped by the step limit");
        assert_eq!(large_capacity(5000, 2048), 5000, "a larger step still fits");
        assert_eq!(large_capacity(0, 64), 1);
    }
}
