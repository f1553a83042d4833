//! Step buffers, and decode steps replayed as CUDA graphs.
//!
//! A decode step (every sequence adds one token) runs per layer the same dozen small kernels and GEMMs:
//! norm, q/k/v, rope, cache append, attention, output projection, norm, router, top-k, and the copies of
//! the routing to the host. At batch 1 each takes a few µs of GPU time but about as much host time to
//! launch, and the layer waits for all of them before its CPU experts can start. So that segment is
//! captured once per (layer, batch size) as a CUDA graph and replayed with one launch.
//!
//! A graph bakes in its buffer addresses and scalar arguments, so graph steps use persistent buffers
//! sized for `MAX_GRAPH_ROWS` rows ([`DecodeGraphs`]): the step's token ids, positions, cache slots and
//! block tables are copied into them before the replays, and the block tables have a fixed stride (the
//! most blocks one sequence can hold). Everything else of the layer (shared and GPU experts, the CPU
//! experts' sum coming back) stays eager: it depends on the routing the graph just produced.
//! Steps that are not plain decode (prefill chunks, MLA models, larger batches) run eagerly on
//! [`ActBufs`] allocated for the step.
//!
//! Status: opt-in (`--cuda-graphs`). The first run on the H200 had the capture refused ("operation not
//! permitted when stream is capturing", thread-local mode; the engine fell back to eager steps and
//! stayed correct). Capture now uses the relaxed mode and no event synchronisation inside the segment;
//! `gpu_tests::cuda_graph_decode_matches_eager` checks that graphs are captured and match eager steps,
//! and has not run on hardware since that change.
use super::handoff::Handoff;
use super::{GpuAttention, GpuModel};
use crate::model::ModelConfig;
use cudarc::driver::CudaSlice;
use half::bf16;
use moe_kernels::cuda::graph::CapturedGraph;
use std::collections::HashMap;

/// Largest decode batch replayed from graphs (larger batches run eagerly).
pub const MAX_GRAPH_ROWS: usize = 64;

/// Device copies of where each token of the step sits.
pub struct IndexBufs {
    pub ids: CudaSlice<i32>,
    pub pos: CudaSlice<i32>,
    pub seq: CudaSlice<i32>,
    pub slots: CudaSlice<i32>,
    /// `[sequences, stride]` block ids.
    pub tables: CudaSlice<i32>,
    /// Row stride of `tables`.
    pub stride: usize,
}

/// GQA attention's per-step buffers (q, k, v in f32, the attention output in bf16).
pub struct AttnBufs {
    pub rows: usize,
    pub q: CudaSlice<f32>,
    pub k: CudaSlice<f32>,
    pub v: CudaSlice<f32>,
    pub out: CudaSlice<bf16>,
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
    /// The CPU experts' sum, uploaded to be added into `x`.
    pub cpu_sum: CudaSlice<f32>,
    pub attn: AttnBufs,
}

impl GpuModel {
    /// Index buffers for `rows` tokens of `seqs` sequences, block tables of `stride` blocks each.
    pub(super) fn alloc_index(
        &self,
        rows: usize,
        seqs: usize,
        stride: usize,
    ) -> anyhow::Result<IndexBufs> {
        Ok(IndexBufs {
            ids: self.alloc(rows)?,
            pos: self.alloc(rows)?,
            seq: self.alloc(rows)?,
            slots: self.alloc(rows)?,
            tables: self.alloc(seqs * stride)?,
            stride,
        })
    }

    /// Activation buffers for `rows` rows. GQA buffers only when every layer is GQA (MLA allocates
    /// its own).
    pub(super) fn alloc_acts(&self, cfg: &ModelConfig, rows: usize) -> anyhow::Result<ActBufs> {
        let hd = cfg.hidden_size;
        let (experts, k) = cfg
            .moe
            .as_ref()
            .map_or((1, 1), |m| (m.num_experts, m.top_k));
        let gqa = self.all_gqa();
        let (qd, kd) = if gqa {
            (
                cfg.num_heads * cfg.head_dim,
                cfg.num_kv_heads * cfg.head_dim,
            )
        } else {
            (0, 0)
        };
        Ok(ActBufs {
            x: self.alloc(rows * hd)?,
            hb: self.alloc(rows * hd)?,
            hf: self.alloc(rows * hd)?,
            logits: self.alloc(rows * experts)?,
            eids: self.alloc(rows * k)?,
            w: self.alloc(rows * k)?,
            cpu_sum: self.alloc(rows * hd)?,
            attn: AttnBufs {
                rows: if gqa { rows } else { 0 },
                q: self.alloc(rows * qd)?,
                k: self.alloc(rows * kd)?,
                v: self.alloc(rows * kd)?,
                out: self.alloc(rows * qd)?,
            },
        })
    }

    pub(super) fn all_gqa(&self) -> bool {
        self.layers
            .iter()
            .all(|l| matches!(l.attn, GpuAttention::Gqa(_)))
    }
}

/// The graphs captured so far: (layer, rows) → the layer's pre-expert segment.
#[derive(Default)]
pub struct GraphSet {
    pub map: HashMap<(usize, usize), CapturedGraph>,
    /// A capture failed (a driver that refuses some captured call): decode runs eagerly from then on.
    pub broken: bool,
}

/// Persistent buffers of graph-replayed decode steps, and the graphs captured so far.
pub struct DecodeGraphs {
    pub index: IndexBufs,
    pub acts: ActBufs,
    pub hand: Handoff,
    pub graphs: GraphSet,
}

impl DecodeGraphs {
    /// Buffers for up to [`MAX_GRAPH_ROWS`] rows; block tables of `stride` blocks per sequence (the
    /// KV pool's size, so no sequence outgrows them).
    pub fn new(m: &GpuModel, cfg: &ModelConfig, stride: usize) -> anyhow::Result<DecodeGraphs> {
        let rows = MAX_GRAPH_ROWS;
        let k = cfg.moe.as_ref().map_or(1, |m| m.top_k);
        let g = DecodeGraphs {
            index: m.alloc_index(rows, rows, stride)?,
            acts: m.alloc_acts(cfg, rows)?,
            hand: Handoff::new(&m.dev, rows * k, rows * cfg.hidden_size)?,
            graphs: GraphSet::default(),
        };
        // Allocations are stream-ordered; graphs captured later must find them done.
        m.dev.stream.synchronize()?;
        Ok(g)
    }
}
