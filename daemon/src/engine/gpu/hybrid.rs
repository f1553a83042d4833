//! What hybrid-attention models (GLM-5.3-Flash, GLM-5) add to a GPU step: the kernels of `hybrid.cu`,
//! per-layer hyper-connection and indexer weights, and the step's view of its class buffers
//! (`hybrid_bufs`: residual streams, recurrent-state table, linear-attention and indexer rows).
//!
//! How a step uses it (`forward.rs` calls these hooks; layers without hyper-connections skip them):
//! - [`GpuModel::hybrid_begin_step`]: each sequence's recurrent state made ready (allocated zeroed by its
//!   first step, zeroed again when it starts over), the step's segment layout and state addresses
//!   written into the class buffers (what captured decode graphs read), the embeddings copied into
//!   every stream;
//! - per block (attention, FFN): [`GpuModel::hyper_collapse`] writes the block's input into `x`; the
//!   block adds its output into `x` as for any model; [`GpuModel::hyper_expand`] folds it into the streams;
//! - [`GpuModel::hyper_head`]: the streams' mean into `x` before the final norm.
//!
//! Recurrent state per sequence (one f32 buffer): for each linear layer in order, `heads × d × d`
//! matrices then the convolution tail `(kernel − 1) × 3 · heads · d` (GLM-5.3-Flash: 146 MiB, as on the
//! CPU). It belongs to the sequence's cache: preemption and finishing drop it with the cache.
use super::forward::GpuSeqInput;
use super::hybrid_bufs::HybridBufs;
use super::indexer::GpuIndexer;
use super::GpuModel;
use crate::model::hybrid::{HyperConfig, Mixer};
use crate::model::{Attention, Model, ModelConfig, SparseAttention};
use anyhow::Context;
use cudarc::driver::CudaSlice;
use moe_kernels::cuda::hybrid::{HybridKernels, StateTable};
use moe_kernels::cuda::hyper::HyperParams;
use moe_kernels::cuda::linear_attention::KdaShape;
use moe_kernels::cuda::GpuDevice;

/// One hyper-connection on the GPU: `proj` `[(2 + m)·m, m·hidden]`, `base` `[(2 + m)·m]`, scales.
pub struct GpuHyperConnection {
    pub proj: CudaSlice<f32>,
    pub base: CudaSlice<f32>,
    pub scale: [f32; 3],
}

/// The two hyper-connections of a layer (before attention, before the FFN).
pub struct GpuLayerHyper {
    pub attn: GpuHyperConnection,
    pub ffn: GpuHyperConnection,
}

/// Which block of a layer a hyper-connection hook is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Block {
    Attention,
    Ffn,
}

pub struct GpuHybrid {
    pub kernels: HybridKernels,
    pub hyper_cfg: Option<HyperConfig>,
    /// The indexer's config (models with sparse attention).
    pub indexer: Option<crate::model::config::IndexerConfig>,
    /// Per layer (None without hyper-connections).
    pub hyper: Vec<Option<GpuLayerHyper>>,
    /// Per layer: the indexer of layers that run their own.
    pub indexers: Vec<Option<GpuIndexer>>,
    /// Per layer: whether MLA attends a selection (own indexer or the previous layer's).
    pub sparse: Vec<bool>,
    /// Linear-attention layers' shape and each one's offset in a sequence's state buffer.
    pub kda: Option<KdaShape>,
    pub state_offsets: Vec<Option<usize>>,
    /// Floats of one sequence's state buffer (0: no linear layers).
    pub state_floats: usize,
}

impl GpuHybrid {
    /// The hybrid parts of `model`, or None for models that have none.
    pub fn upload(dev: &GpuDevice, model: &Model) -> anyhow::Result<Option<Self>> {
        let cfg = &model.config;
        if cfg.hyper.is_none() && cfg.linear_attention.is_none() && cfg.indexer.is_none() {
            return Ok(None);
        }
        let kernels = HybridKernels::load(dev).context("compiling the hybrid-attention kernels")?;
        let s = &dev.stream;
        let mut hyper = Vec::with_capacity(model.layers.len());
        for layer in &model.layers {
            hyper.push(match (&layer.hyper, cfg.hyper) {
                (Some(h), Some(_)) => {
                    let up = |c: &crate::model::HyperConnection| -> anyhow::Result<_> {
                        Ok(GpuHyperConnection {
                            proj: s.clone_htod(&c.proj)?,
                            base: s.clone_htod(&c.base)?,
                            scale: c.scale,
                        })
                    };
                    Some(GpuLayerHyper {
                        attn: up(&h.attn)?,
                        ffn: up(&h.ffn)?,
                    })
                }
                _ => None,
            });
        }
        let mut indexers = Vec::with_capacity(model.layers.len());
        let mut sparse = Vec::with_capacity(model.layers.len());
        for (li, layer) in model.layers.iter().enumerate() {
            let (own, attends) = match &layer.attn {
                Attention::Mla(a) => match (&a.indexer, &cfg.indexer) {
                    (Some(SparseAttention::Own(w)), Some(ix)) => {
                        (Some(GpuIndexer::upload(dev, w, ix)?), true)
                    }
                    (Some(SparseAttention::Shared), _) => (None, true),
                    (Some(SparseAttention::Own(_)), None) => {
                        anyhow::bail!("layer {li}: an indexer without its config")
                    }
                    (None, _) => (None, false),
                },
                _ => (None, false),
            };
            indexers.push(own);
            sparse.push(attends);
        }
        let (kda, state_offsets, state_floats) = state_layout(cfg);
        if let Some(shape) = kda {
            anyhow::ensure!(
                shape.head_dim <= 128,
                "linear-attention head_dim {} > 128 is not supported on the CUDA backend",
                shape.head_dim
            );
        }
        if let Some(h) = cfg.hyper {
            anyhow::ensure!(
                h.mult <= moe_kernels::cuda::hyper::MAX_STREAMS,
                "{} hyper-connection streams: the CUDA backend takes at most {}",
                h.mult,
                moe_kernels::cuda::hyper::MAX_STREAMS
            );
        }
        Ok(Some(Self {
            kernels,
            hyper_cfg: cfg.hyper,
            indexer: cfg.indexer.clone(),
            hyper,
            indexers,
            sparse,
            kda,
            state_offsets,
            state_floats,
        }))
    }
}

/// The linear layers' shape, each linear layer's offset in a sequence's state buffer, and the buffer's
/// floats (0 without linear layers).
pub fn state_layout(cfg: &ModelConfig) -> (Option<KdaShape>, Vec<Option<usize>>, usize) {
    let kda = cfg.linear_attention.map(|la| KdaShape {
        heads: la.num_heads,
        head_dim: la.head_dim,
        conv_kernel: la.conv_kernel,
        lower_bound: la.lower_bound,
    });
    let mut offsets = Vec::with_capacity(cfg.num_layers);
    let mut floats = 0;
    for li in 0..cfg.num_layers {
        match (cfg.mixers.get(li), kda) {
            (Some(Mixer::Linear), Some(shape)) => {
                offsets.push(Some(floats));
                floats += shape.state_floats();
            }
            _ => offsets.push(None),
        }
    }
    (kda, offsets, floats)
}

/// A hybrid model's step: its buffers (`hybrid_bufs`, of the step's batch-size class) and the
/// recurrent-state table of its sequences.
pub struct HybridStep<'s> {
    pub bufs: &'s mut HybridBufs,
    /// Every sequence's recurrent state (models with linear layers).
    pub states: Option<StateTable<'s>>,
}

impl HybridStep<'_> {
    pub fn rows(&self) -> usize {
        self.bufs.seg.rows
    }
}

impl GpuModel {
    /// Readies a step of a hybrid model (see the module docs) in the class buffers `bufs`; `x` holds the
    /// embeddings. Everything a captured decode segment reads that varies per step is written here.
    pub(super) fn hybrid_begin_step<'s>(
        &self,
        hy: &GpuHybrid,
        batch: &'s mut [GpuSeqInput<'_>],
        hidden: usize,
        x: &CudaSlice<f32>,
        bufs: &'s mut HybridBufs,
    ) -> anyhow::Result<HybridStep<'s>> {
        let dev = &self.dev;
        let lens: Vec<usize> = batch.iter().map(|b| b.tokens.len()).collect();
        let rows: usize = lens.iter().sum();
        anyhow::ensure!(
            rows <= bufs.rows && batch.len() <= bufs.state_table.len(),
            "hybrid buffers for {} rows, step has {rows}",
            bufs.rows
        );
        bufs.seg.set(dev, &lens)?;
        if let (Some(ix), Some(ib)) = (self.indexer_config(), bufs.indexer.as_mut()) {
            ib.selection.set_rows(rows)?;
            // Score rows of the decode class cover every position the KV pool holds (a captured
            // graph cannot grow them); larger steps size theirs per call.
            let most = batch.iter().map(|b| b.pos0 + b.tokens.len()).max();
            let need = super::hybrid_bufs::max_candidates(ix, most.unwrap_or(0));
            anyhow::ensure!(
                ib.score_stride == 0 || need <= ib.score_stride,
                "{need} indexer candidates for score rows of {}",
                ib.score_stride
            );
        }
        let states = if hy.state_floats > 0 {
            let mut held = Vec::with_capacity(batch.len());
            for b in batch.iter_mut() {
                let slot = b
                    .state
                    .as_deref_mut()
                    .and_then(<[_]>::first_mut)
                    .context("a sequence of a linear-attention model has no recurrent state")?;
                if b.pos0 == 0 {
                    // a new sequence, or one starting over: from the zero state
                    let reusable = matches!(slot, Some(buf) if buf.len() == hy.state_floats);
                    if !reusable {
                        *slot = Some(dev.stream.alloc_zeros::<f32>(hy.state_floats)?);
                    } else if let Some(buf) = slot.as_mut() {
                        dev.stream.memset_zeros(buf)?;
                    }
                }
                let buf = slot.as_mut().with_context(|| {
                    format!(
                        "a sequence at position {} has no recurrent state on the GPU (lost by a failed copy)",
                        b.pos0
                    )
                })?;
                held.push(buf);
            }
            Some(StateTable::new(
                dev,
                &mut bufs.state_table,
                held,
                hy.state_floats,
            )?)
        } else {
            None
        };
        if let Some(st) = bufs.streams.as_mut() {
            hy.kernels
                .hc_broadcast(dev, rows, st.m, hidden, x, &mut st.streams)?;
        }
        Ok(HybridStep { bufs, states })
    }

    /// The indexer's config of a model whose layers run one.
    pub(super) fn indexer_config(&self) -> Option<&crate::model::config::IndexerConfig> {
        self.hybrid.as_ref().and_then(|h| h.indexer.as_ref())
    }

    /// The input of layer `li`'s `block` into `x` (models with hyper-connections; no-op otherwise).
    pub(super) fn hyper_collapse(
        &self,
        step: &mut HybridStep<'_>,
        li: usize,
        block: Block,
        hidden: usize,
        norm_eps: f32,
        x: &mut CudaSlice<f32>,
    ) -> anyhow::Result<()> {
        let rows = step.rows();
        let (Some(hy), Some(st)) = (self.hybrid.as_ref(), step.bufs.streams.as_mut()) else {
            return Ok(());
        };
        let cfg = hy.hyper_cfg.context("streams without a hyper config")?;
        let hc = hy.hyper[li]
            .as_ref()
            .with_context(|| format!("layer {li} has no hyper-connection weights"))?;
        let hc = match block {
            Block::Attention => &hc.attn,
            Block::Ffn => &hc.ffn,
        };
        let m = st.m;
        self.dev.gemm_f32(
            &st.streams,
            &hc.proj,
            &mut st.proj_out,
            rows,
            (2 + m) * m,
            m * hidden,
        )?;
        let p = HyperParams {
            streams: m,
            base: &hc.base,
            scale: hc.scale,
            sinkhorn_iters: cfg.sinkhorn_iters,
            eps: cfg.eps,
            norm_eps,
        };
        hy.kernels.hc_collapse(
            &self.dev,
            rows,
            hidden,
            &p,
            &st.streams,
            &st.proj_out,
            &mut st.mix,
            x,
        )?;
        Ok(())
    }

    /// Folds the block that just added its output into `x` back into the streams.
    pub(super) fn hyper_expand(
        &self,
        step: &mut HybridStep<'_>,
        hidden: usize,
        x: &CudaSlice<f32>,
    ) -> anyhow::Result<()> {
        let rows = step.rows();
        let (Some(hy), Some(st)) = (self.hybrid.as_ref(), step.bufs.streams.as_mut()) else {
            return Ok(());
        };
        hy.kernels
            .hc_expand(&self.dev, rows, st.m, hidden, x, &st.mix, &mut st.streams)?;
        Ok(())
    }

    /// The hyper head: the streams' mean into `x` (before the final norm).
    pub(super) fn hyper_head(
        &self,
        step: &HybridStep<'_>,
        hidden: usize,
        x: &mut CudaSlice<f32>,
    ) -> anyhow::Result<()> {
        let (Some(hy), Some(st)) = (self.hybrid.as_ref(), step.bufs.streams.as_ref()) else {
            return Ok(());
        };
        hy.kernels
            .hc_mean(&self.dev, step.rows(), st.m, hidden, &st.streams, x)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GPU state buffer of GLM-5.3-Flash holds what the CPU's state holds (146 MiB per sequence),
    /// one part per linear layer, back to back.
    #[test]
    fn glm53_flash_state_layout_matches_the_host_state() {
        let v = crate::cli::synth::config_like("glm-5.3-flash").unwrap();
        let cfg = ModelConfig::from_json(&v).unwrap();
        let (shape, offsets, floats) = state_layout(&cfg);
        let la = cfg.linear_attention.unwrap();
        assert_eq!(shape.unwrap().state_floats(), la.state_floats());
        let linear: Vec<usize> = offsets.iter().flatten().copied().collect();
        assert_eq!(linear.len(), 34);
        for (i, off) in linear.iter().enumerate() {
            assert_eq!(*off, i * la.state_floats());
        }
        let host = crate::engine::kv::RecurrentState::new(&cfg.mixers, &la);
        assert_eq!(floats * 4, host.bytes());
        assert_eq!(
            floats * 4,
            crate::engine::kv::footprint::of(&cfg, 4).state_per_sequence as usize
        );
    }
}
