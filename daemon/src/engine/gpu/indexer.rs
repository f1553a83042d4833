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
use moe_kernels::cuda::indexer::{DeviceSelection, MlaDims, PagedTables, PoolLayout, ScoreKeys};
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
    /// Runs layer `li`'s own indexer over the step and leaves its selection in `hy.selection` (a
    /// `shared` layer keeps the one there). `x` is the layer input, `q_resid` the normalised q-LoRA
    /// output `[n, q_lora_rank]` (f32).
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
        let Some(w) = hybrid.indexers[li].as_ref() else {
            anyhow::ensure!(
                hy.selection.is_some(),
                "layer {li} shares a selection no earlier layer made"
            );
            return Ok(());
        };
        let cfg = &host.config;
        let ix = cfg.indexer.as_ref().context("indexer without its config")?;
        let q_resid = q_resid.context("the indexer needs the q-LoRA output")?;
        let (dev, k) = (&self.dev, &hybrid.kernels);
        let (n, hd, nh, d) = (step.n, cfg.hidden_size, ix.n_heads, ix.head_dim);
        // f32 normalised layer input (the CPU indexer's `h`)
        let mut h32 = self.alloc::<f32>(n * hd)?;
        let mut hb = self.alloc::<bf16>(n * hd)?;
        dev.rms_norm(
            x,
            &self.layers[li].attn_norm,
            cfg.rms_norm_eps,
            (n, hd),
            &mut hb,
            Some(&mut h32),
        )?;
        drop(hb);
        let mut q = self.alloc::<f32>(n * nh * d)?;
        dev.gemm_f32(q_resid, &w.wq_b, &mut q, n, nh * d, w.q_lora_rank)?;
        let mut key = self.alloc::<f32>(n * d)?;
        dev.gemm_f32(&h32, &w.wk, &mut key, n, d, hd)?;
        let mut weights = self.alloc::<f32>(n * nh)?;
        dev.gemm_f32(&h32, &w.weights_proj, &mut weights, n, nh, hd)?;
        k.idx_layer_norm(dev, n, &mut key, &w.k_norm_weight, &w.k_norm_bias)?;
        if ix.rope_dim > 0 {
            self.norm_rope(host, &mut key, step, 1, d, None, 0, true)?;
            self.norm_rope(host, &mut q, step, nh, d, None, 0, true)?;
        }
        let gate = match &w.pool {
            Some((_, g)) => {
                let mut gl = self.alloc::<f32>(n * d)?;
                dev.gemm_f32(&h32, g, &mut gl, n, d, hd)?;
                Some(gl)
            }
            None => None,
        };
        let width = pool.c_width;
        let rows = pool.c[li]
            .as_mut()
            .with_context(|| format!("layer {li} has no indexer rows"))?;
        k.idx_write_rows(dev, n, d, &key, gate.as_ref(), step.slots, rows, width)?;
        let rows = &*rows;
        let paged = PagedTables {
            tables: step.tables,
            max_blocks: step.max_blocks,
            block_size: BLOCK,
        };
        // Candidates per query: complete pools (key pools) or positions 0..=pos.
        let unit = match ix.pooling {
            IndexerPooling::KeyPool { pool } => pool,
            IndexerPooling::PerToken => 1,
        };
        let mut cand = Vec::with_capacity(n);
        for &(pos0, len) in &hy.spans {
            cand.extend((pos0..pos0 + len).map(|p| ((p + 1) / unit) as i32));
        }
        let stride = cand.iter().copied().max().unwrap_or(0).max(1) as usize;
        let d_cand = dev.stream.clone_htod(&cand)?;
        let mut scores = self.alloc::<f32>(n * stride)?;
        let scale = (d as f32).powf(-0.5);
        let topk = ix.topk / unit;
        let pooled;
        let layout;
        let keys = match (&w.pool, ix.pooling) {
            (Some((ape, _)), IndexerPooling::KeyPool { pool: p }) => {
                let counts: Vec<usize> = hy.spans.iter().map(|&(p0, l)| (p0 + l) / p).collect();
                layout = PoolLayout::new(dev, &counts)?;
                let mut out = self.alloc::<f32>(layout.total * d)?;
                k.idx_pool_keys(dev, rows, d, p, ape, &paged, &layout, &mut out)?;
                pooled = out;
                ScoreKeys::Pooled {
                    keys: &pooled,
                    layout: &layout,
                }
            }
            _ => ScoreKeys::PerPosition {
                cache: rows,
                width,
                paged: &paged,
            },
        };
        k.idx_scores(
            dev,
            &hy.seg,
            (nh, d),
            scale,
            &q,
            &weights,
            &d_cand,
            &keys,
            stride,
            &mut scores,
        )?;
        let mut sel = DeviceSelection::alloc(dev, n, topk * unit + unit)?;
        k.idx_topk(
            dev, &scores, stride, &d_cand, step.pos, topk, unit, &mut sel,
        )?;
        hy.selection = Some(sel);
        Ok(())
    }

    /// Absorbed MLA of layer `li` over the positions in `hy.selection` (bf16 `out` `[n, heads·v]`).
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
        let sel = hy
            .selection
            .as_ref()
            .with_context(|| format!("layer {li}: no indexer selection"))?;
        let paged = PagedTables {
            tables: step.tables,
            max_blocks: step.max_blocks,
            block_size: BLOCK,
        };
        hybrid.kernels.mla_attention_selected(
            &self.dev,
            dims,
            q,
            &pool.k[pool.slot(li)],
            &pool.v[pool.slot(li)],
            &paged,
            step.seq,
            sel,
            kv_b,
            scale,
            out,
        )?;
        Ok(())
    }
}
