//! The sparse-attention indexer on the GPU (GLM-5's per-token DSA, GLM-5.3-Flash's key pools): which
//! positions each query of an indexed MLA layer attends. Same contract as `engine::indexer` on the CPU:
//! keys `LayerNorm(wk · h)` (roped for GLM-5) stored per position in the layer's indexer rows (with the
//! pooling gate logits for key pools), query scores `Σ_h w_h · relu(q_h · key / √D)` against every
//! earlier position (or complete pool), the best `index_topk` kept (key pools: `index_topk / pool` pools
//! plus the query's own incomplete pool).
//!
//! The indexer's projections run in f32 from the f32 normalised layer input (as on the CPU), so the
//! selection does not move with bf16 rounding of the inputs; its weights are f32 on the GPU
//! (GLM-5.3-Flash: 2 × 32 × 128 × 2048 + 2 × 128 × 4096 + 32 × 4096 floats, ~40 MiB per indexed layer).
use super::attention::StepIndex;
use super::hybrid::HybridStep;
use super::hybrid_bufs::candidate_unit;
use super::kv::GpuKvPool;
use super::GpuModel;
use crate::engine::indexer::IndexerWeights;
use crate::engine::kv::BLOCK;
use crate::engine::linear::Linear;
use crate::model::config::{IndexerConfig, IndexerPooling};
use crate::model::Model;
use anyhow::Context;
use cudarc::driver::CudaSlice;
use half::bf16;
use moe_kernels::cuda::indexer::{IndexerRows, MlaDims, PagedTables};
use moe_kernels::cuda::GpuDevice;

/// One layer's indexer weights, f32.
pub struct GpuIndexer {
    /// `[heads × d, q_lora_rank]`
    pub wq_b: CudaSlice<f32>,
    /// `[d, hidden]`
    pub wk: CudaSlice<f32>,
    pub k_norm_weight: CudaSlice<f32>,
    pub k_norm_bias: CudaSlice<f32>,
    /// `[heads, hidden]`, pre-scaled by 1/√heads
    pub weights_proj: CudaSlice<f32>,
    /// Key pools: `compress_ape` `[pool, d]` and the gate projection `[d, hidden]`.
    pub pool: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    pub q_lora_rank: usize,
}

fn rows_f32(l: &Linear, scale: f32) -> Vec<f32> {
    let mut out = vec![0f32; l.out_dim * l.in_dim];
    for (r, row) in out.chunks_mut(l.in_dim).enumerate() {
        l.row_f32(r, row);
        row.iter_mut().for_each(|x| *x *= scale);
    }
    out
}

impl GpuIndexer {
    pub fn upload(
        dev: &GpuDevice,
        w: &IndexerWeights,
        cfg: &IndexerConfig,
    ) -> anyhow::Result<Self> {
        let s = &dev.stream;
        anyhow::ensure!(
            cfg.head_dim <= moe_kernels::cuda::indexer::MAX_HEAD_DIM,
            "index_head_dim {} > {} is not supported on the CUDA backend",
            cfg.head_dim,
            moe_kernels::cuda::indexer::MAX_HEAD_DIM
        );
        if let IndexerPooling::KeyPool { pool } = cfg.pooling {
            anyhow::ensure!(
                pool <= moe_kernels::cuda::indexer::MAX_POOL,
                "index_kpool {pool} > {} is not supported on the CUDA backend",
                moe_kernels::cuda::indexer::MAX_POOL
            );
        }
        let pool = match &w.pool {
            Some(p) => Some((
                s.clone_htod(&p.ape)?,
                s.clone_htod(&rows_f32(&p.gate, 1.0))?,
            )),
            None => None,
        };
        Ok(Self {
            wq_b: s.clone_htod(&rows_f32(&w.wq_b, 1.0))?,
            wk: s.clone_htod(&rows_f32(&w.wk, 1.0))?,
            k_norm_weight: s.clone_htod(&w.k_norm_weight)?,
            k_norm_bias: s.clone_htod(&w.k_norm_bias)?,
            weights_proj: s
                .clone_htod(&rows_f32(&w.weights_proj, (cfg.n_heads as f32).powf(-0.5)))?,
            pool,
            q_lora_rank: w.wq_b.in_dim,
        })
    }
}

impl GpuModel {
    /// Runs layer `li`'s own indexer over the step and leaves its selection in the step's buffers (a
    /// `shared` layer keeps the one there). `x` is the layer input, `q_resid` the normalised q-LoRA
    /// output `[n, q_lora_rank]` (f32). Decode-class steps enqueue kernels and GEMMs on the step's
    /// buffers only, so they can be captured; each query's candidate count comes from its position on
    /// the device.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn indexer_select(
        &self,
        host: &Model,
        li: usize,
        step: &StepIndex,
        x: &CudaSlice<f32>,
        q_resid: Option<&CudaSlice<f32>>,
        pool: &mut GpuKvPool,
        hy: &mut HybridStep<'_>,
    ) -> anyhow::Result<()> {
        let hybrid = self
            .hybrid
            .as_ref()
            .context("indexer without hybrid kernels")?;
        // A `shared` layer attends the selection the layer before it left in the step's buffers (the
        // model loader refuses a shared layer whose previous layer has no indexer of its own). No
        // per-step flag: a replayed graph would not set it.
        let Some(w) = hybrid.indexers[li].as_ref() else {
            return Ok(());
        };
        let cfg = &host.config;
        let ix = cfg.indexer.as_ref().context("indexer without its config")?;
        let q_resid = q_resid.context("the indexer needs the q-LoRA output")?;
        let (dev, k) = (&self.dev, &hybrid.kernels);
        let (n, hd, nh, d) = (step.n, cfg.hidden_size, ix.n_heads, ix.head_dim);
        let seg = &hy.bufs.seg;
        let b = hy
            .bufs
            .indexer
            .as_mut()
            .context("an indexed step without indexer buffers")?;
        // f32 normalised layer input (the CPU indexer's `h`)
        dev.rms_norm(
            x,
            &self.layers[li].attn_norm,
            cfg.rms_norm_eps,
            (n, hd),
            &mut b.hb,
            Some(&mut b.h32),
        )?;
        dev.gemm_f32(q_resid, &w.wq_b, &mut b.q, n, nh * d, w.q_lora_rank)?;
        dev.gemm_f32(&b.h32, &w.wk, &mut b.key, n, d, hd)?;
        dev.gemm_f32(&b.h32, &w.weights_proj, &mut b.weights, n, nh, hd)?;
        k.idx_layer_norm(dev, n, &mut b.key, &w.k_norm_weight, &w.k_norm_bias)?;
        if ix.rope_dim > 0 {
            self.norm_rope(host, &mut b.key, step, 1, d, None, 0, true)?;
            self.norm_rope(host, &mut b.q, step, nh, d, None, 0, true)?;
        }
        if let Some((_, g)) = &w.pool {
            dev.gemm_f32(&b.h32, g, &mut b.gate, n, d, hd)?;
        }
        let gate = w.pool.as_ref().map(|_| &b.gate);
        let width = pool.c_width;
        let rows = pool.c[li]
            .as_mut()
            .with_context(|| format!("layer {li} has no indexer rows"))?;
        k.idx_write_rows(dev, n, d, &b.key, gate, step.slots, rows, width)?;
        let paged = PagedTables {
            tables: step.tables,
            max_blocks: step.max_blocks,
            block_size: BLOCK,
        };
        let unit = candidate_unit(ix);
        if let (Some((ape, _)), IndexerPooling::KeyPool { pool: p }) = (&w.pool, ix.pooling) {
            k.idx_pool_complete(dev, n, rows, d, p, ape, &paged, step.seq, step.pos)?;
        }
        let keys = IndexerRows {
            cache: rows,
            width,
            unit,
            key_off: if unit > 1 { d } else { 0 },
            paged: &paged,
        };
        // Score rows: the decode class's cover every candidate; larger steps size theirs by their
        // context, for this call (stream-ordered allocation and free).
        let mut own_scores;
        let (scores, stride) = if b.score_stride > 0 {
            (&mut b.scores, b.score_stride)
        } else {
            let most = step.seqs.iter().map(|s| s.pos0 + s.len).max().unwrap_or(0);
            let stride = (most / unit).max(1);
            own_scores = self.alloc::<f32>(n * stride)?;
            (&mut own_scores, stride)
        };
        let scale = (d as f32).powf(-0.5);
        k.idx_scores(
            dev,
            seg,
            (nh, d),
            scale,
            &b.q,
            &b.weights,
            step.pos,
            &keys,
            stride,
            scores,
        )?;
        k.idx_topk(
            dev,
            scores,
            stride,
            step.pos,
            ix.topk / unit,
            unit,
            &mut b.selection,
        )?;
        Ok(())
    }

    /// Absorbed MLA of layer `li` over the positions in the step's selection (bf16 `out`
    /// `[n, heads·v]`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mla_selected(
        &self,
        step: &StepIndex,
        pool: &GpuKvPool,
        li: usize,
        dims: MlaDims,
        scale: f32,
        q: &CudaSlice<f32>,
        kv_b: &CudaSlice<f32>,
        hy: &HybridStep<'_>,
        out: &mut CudaSlice<bf16>,
    ) -> anyhow::Result<()> {
        let hybrid = self
            .hybrid
            .as_ref()
            .context("sparse MLA without hybrid kernels")?;
        let sel = match &hy.bufs.indexer {
            Some(b) => &b.selection,
            None => anyhow::bail!("layer {li}: sparse attention without indexer buffers"),
        };
        let paged = PagedTables {
            tables: step.tables,
            max_blocks: step.max_blocks,
            block_size: BLOCK,
        };
        let (lat_cache, rope_cache) = pool.bf16_rows(li)?;
        hybrid.kernels.mla_attention_selected(
            &self.dev, dims, q, lat_cache, rope_cache, &paged, step.seq, sel, kv_b, scale, out,
        )?;
        Ok(())
    }
}
