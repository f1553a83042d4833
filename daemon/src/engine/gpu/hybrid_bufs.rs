//! Step buffers of hybrid-attention models (GLM-5.3-Flash, GLM-5), one set per batch-size class like the
//! other step buffers (`buffers`), so decode steps can be captured as CUDA graphs: the segment layout,
//! the recurrent-state table, the hyper-connection streams, the linear-attention intermediates and the
//! indexer's projections, scores and selection are allocated once and rewritten by each step.
//!
//! What varies per step lives in these buffers, never in launch arguments: which rows belong to which
//! sequence (`seg`), which recurrent-state buffers the step's sequences own (`state_table`), each
//! query's candidate count (derived on the device from its position). The decode class's score rows are
//! as wide as the KV pool's positions allow, so one graph serves every context length; larger steps
//! (prefill) take score rows sized by their own context for the duration of the indexer call.
use super::GpuAttention;
use super::GpuModel;
use crate::model::config::IndexerConfig;
use crate::model::ModelConfig;
use cudarc::driver::CudaSlice;
use half::bf16;
use moe_kernels::cuda::hybrid::SegmentIndex;
use moe_kernels::cuda::hyper::mix_width;
use moe_kernels::cuda::indexer::DeviceSelection;

/// Residual streams of a step and the weights between a block's collapse and expansion.
pub struct Streams {
    pub m: usize,
    /// `[rows, m, hidden]`
    pub streams: CudaSlice<f32>,
    /// `[rows, 2m + m²]`
    pub mix: CudaSlice<f32>,
    /// `[rows, (2 + m)·m]`: streams · fnᵀ
    pub proj_out: CudaSlice<f32>,
}

/// A linear-attention layer's intermediates (w = heads · head_dim).
pub struct LinearBufs {
    /// q, k, v projections `[rows, 3w]` (after the convolution, the chunked recurrence's scratch),
    /// and after the convolution `[rows, 3w]`.
    pub raw: CudaSlice<f32>,
    pub mixed: CudaSlice<f32>,
    /// A low-rank pair's middle `[rows, rank]` f32 and bf16 (the forget and output gates in turn).
    pub mid: CudaSlice<f32>,
    pub mid_b: CudaSlice<bf16>,
    /// Forget gate `[rows, w]`, β `[rows, heads]`, output gate `[rows, w]`.
    pub g: CudaSlice<f32>,
    pub beta: CudaSlice<f32>,
    pub gate: CudaSlice<f32>,
    /// Recurrence output `[rows, w]` and its gated norm (bf16, the output projection's input).
    pub core: CudaSlice<f32>,
    pub normed: CudaSlice<bf16>,
}

/// The indexer's per-step rows (d = index_head_dim, h = index_n_heads).
pub struct IndexerBufs {
    /// The f32 normalised layer input `[rows, hidden]` (and its unused bf16 twin).
    pub h32: CudaSlice<f32>,
    pub hb: CudaSlice<bf16>,
    /// Queries `[rows, h, d]`, keys `[rows, d]`, head weights `[rows, h]`, pool gate logits `[rows, d]`.
    pub q: CudaSlice<f32>,
    pub key: CudaSlice<f32>,
    pub weights: CudaSlice<f32>,
    pub gate: CudaSlice<f32>,
    /// Candidate scores `[rows, score_stride]` (decode class: every candidate the KV pool can hold;
    /// 0 for the large class, whose steps allocate score rows for their context).
    pub scores: CudaSlice<f32>,
    pub score_stride: usize,
    /// The last own indexer's selection (shared layers read it too).
    pub selection: DeviceSelection,
}

/// Every hybrid buffer of steps of up to `rows` rows.
pub struct HybridBufs {
    pub rows: usize,
    pub seg: SegmentIndex,
    /// Device addresses of the step's recurrent-state buffers (one per sequence).
    pub state_table: CudaSlice<u64>,
    pub streams: Option<Streams>,
    pub linear: Option<LinearBufs>,
    pub indexer: Option<IndexerBufs>,
}

/// Candidates one query of the indexer scores at most when the KV pool holds `positions` positions
/// (complete pools, or positions).
pub fn max_candidates(ix: &IndexerConfig, positions: usize) -> usize {
    positions / candidate_unit(ix)
}

/// Positions per indexer candidate: the pool size, or 1.
pub fn candidate_unit(ix: &IndexerConfig) -> usize {
    ix.dims().unit() as usize
}

/// Positions one query's selection lists at most: `topk / unit` candidates of `unit` positions, plus
/// its own incomplete pool.
pub fn selection_stride(ix: &IndexerConfig) -> usize {
    ix.dims().selection_stride() as usize
}

impl GpuModel {
    /// Hybrid buffers for `rows` rows and `seqs` sequences; `score_positions`: the positions the decode
    /// class's score rows cover (0 for the large class).
    pub(super) fn alloc_hybrid(
        &self,
        cfg: &ModelConfig,
        rows: usize,
        seqs: usize,
        score_positions: usize,
    ) -> anyhow::Result<Option<HybridBufs>> {
        let Some(hy) = &self.hybrid else {
            return Ok(None);
        };
        let hd = cfg.hidden_size;
        let streams = match hy.hyper_cfg {
            Some(h) => Some(Streams {
                m: h.mult,
                streams: self.alloc(rows * h.mult * hd)?,
                mix: self.alloc(rows * mix_width(h.mult))?,
                proj_out: self.alloc(rows * (2 + h.mult) * h.mult)?,
            }),
            None => None,
        };
        let linear = match (
            hy.kda,
            self.layers.iter().find_map(|l| match &l.attn {
                GpuAttention::Linear(la) => Some(la),
                _ => None,
            }),
        ) {
            (Some(shape), Some(la)) => {
                let w = shape.qkv();
                let rank = la.f_a.out_dim.max(la.g_a.out_dim);
                Some(LinearBufs {
                    raw: self.alloc(rows * 3 * w)?,
                    mixed: self.alloc(rows * 3 * w)?,
                    mid: self.alloc(rows * rank)?,
                    mid_b: self.alloc(rows * rank)?,
                    g: self.alloc(rows * w)?,
                    beta: self.alloc(rows * shape.heads)?,
                    gate: self.alloc(rows * w)?,
                    core: self.alloc(rows * w)?,
                    normed: self.alloc(rows * w)?,
                })
            }
            _ => None,
        };
        let indexer = match (&cfg.indexer, hy.indexers.iter().any(Option::is_some)) {
            (Some(ix), true) => {
                let (nh, d) = (ix.n_heads, ix.head_dim);
                let score_stride = max_candidates(ix, score_positions);
                Some(IndexerBufs {
                    h32: self.alloc(rows * hd)?,
                    hb: self.alloc(rows * hd)?,
                    q: self.alloc(rows * nh * d)?,
                    key: self.alloc(rows * d)?,
                    weights: self.alloc(rows * nh)?,
                    gate: self.alloc(rows * d)?,
                    scores: self.alloc(rows * score_stride)?,
                    score_stride,
                    selection: DeviceSelection::alloc(&self.dev, rows, selection_stride(ix))?,
                })
            }
            _ => None,
        };
        Ok(Some(HybridBufs {
            rows,
            seg: SegmentIndex::with_capacity(&self.dev, rows.max(seqs))?,
            state_table: self.alloc(seqs)?,
            streams,
            linear,
            indexer,
        }))
    }
}
