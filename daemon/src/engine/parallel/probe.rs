//! A step probe for checking a tensor-parallel group against one GPU: at a few points of each layer
//! every GPU copies a buffer to the host (the queries and attention output of its heads, its partial
//! sum before an all-reduce, the reduced residual, its routing), so a test can say at which layer,
//! step and point the group first leaves the single GPU, and whether the ranks' head slices are the
//! single GPU's.
//!
//! Cost: a stream synchronisation and a device-to-host copy per point, so an installed probe turns
//! off CUDA graphs and pipelined decode (both need the host not to wait inside a step). Tests only.
use crate::engine::gpu::buffers::AttnBufs;
use crate::engine::gpu::GpuModel;
use crate::model::ModelConfig;
use cudarc::driver::CudaSlice;
use half::bf16;
use std::sync::Mutex;

/// Where in a layer a value was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProbePoint {
    /// Attention queries after RoPE, `[rows, heads, dims]` f32 (this GPU's heads).
    Queries,
    /// Attention output before the o projection, `[rows, heads, v_dim]` (this GPU's heads).
    AttentionOut,
    /// The residual after the attention block, before the all-reduce: on rank 0 `x` + its partial
    /// sum, on the others their partial sum alone.
    AttentionPartial,
    /// The residual after the attention block's all-reduce.
    AttentionReduced,
    /// The router's logits `[rows, experts]`.
    RouterLogits,
    /// The experts chosen, `[rows, top_k]` (as f32).
    Routing,
    /// The residual after the FFN block, before the all-reduce.
    FfnPartial,
    /// The residual after the layer.
    LayerOut,
}

/// One value read by the probe.
#[derive(Debug, Clone)]
pub struct ProbeRecord {
    /// The GPU's rank (0 on one GPU).
    pub rank: usize,
    pub layer: usize,
    pub point: ProbePoint,
    pub values: Vec<f32>,
}

/// What the GPUs of an engine read since the last [`StepProbe::take`].
#[derive(Default)]
pub struct StepProbe {
    records: Mutex<Vec<ProbeRecord>>,
}

impl StepProbe {
    /// The records since the last call, in the order the GPUs read them.
    pub fn take(&self) -> Vec<ProbeRecord> {
        std::mem::take(&mut *self.records.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Rank `rank`'s record of `point` in `layer` (the first, if read twice).
    pub fn find(
        records: &[ProbeRecord],
        rank: usize,
        layer: usize,
        point: ProbePoint,
    ) -> Option<&[f32]> {
        records
            .iter()
            .find(|r| r.rank == rank && r.layer == layer && r.point == point)
            .map(|r| r.values.as_slice())
    }

    fn push(&self, r: ProbeRecord) {
        self.records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(r);
    }
}

/// A device buffer the probe can read (the first `len` values).
pub trait ProbeSource {
    fn read(&self, g: &GpuModel, len: usize) -> anyhow::Result<Vec<f32>>;
}

impl ProbeSource for CudaSlice<f32> {
    fn read(&self, g: &GpuModel, len: usize) -> anyhow::Result<Vec<f32>> {
        Ok(g.dev.stream.clone_dtoh(&self.slice(..len))?)
    }
}

impl ProbeSource for CudaSlice<bf16> {
    fn read(&self, g: &GpuModel, len: usize) -> anyhow::Result<Vec<f32>> {
        let v = g.dev.stream.clone_dtoh(&self.slice(..len))?;
        Ok(v.into_iter().map(f32::from).collect())
    }
}

impl ProbeSource for CudaSlice<i32> {
    fn read(&self, g: &GpuModel, len: usize) -> anyhow::Result<Vec<f32>> {
        let v = g.dev.stream.clone_dtoh(&self.slice(..len))?;
        Ok(v.into_iter().map(|e| e as f32).collect())
    }
}

impl GpuModel {
    /// Whether a probe is installed (its steps run eagerly and unpipelined).
    pub fn probing(&self) -> bool {
        self.probe.is_some()
    }

    /// Records `buf[..len]` at `point` of layer `li` when a probe is installed (waits for the
    /// stream); nothing otherwise.
    pub fn probe_read(
        &self,
        li: usize,
        point: ProbePoint,
        buf: &impl ProbeSource,
        len: usize,
    ) -> anyhow::Result<()> {
        let Some(p) = &self.probe else {
            return Ok(());
        };
        let values = buf.read(self, len)?;
        p.push(ProbeRecord {
            rank: self.shard.as_ref().map_or(0, |s| s.rank),
            layer: li,
            point,
            values,
        });
        Ok(())
    }

    /// Records layer `li`'s attention queries and output (this GPU's heads, `n` rows).
    pub fn probe_attention(
        &self,
        cfg: &ModelConfig,
        li: usize,
        n: usize,
        bufs: &AttnBufs,
    ) -> anyhow::Result<()> {
        if self.probe.is_none() {
            return Ok(());
        }
        let nh = self.tp_heads(cfg).0;
        match (&bufs.mla, &cfg.mla) {
            (Some(b), Some(m)) => {
                let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
                self.probe_read(li, ProbePoint::Queries, &b.q, n * nh * qk)?;
                self.probe_read(li, ProbePoint::AttentionOut, &b.out, n * nh * m.v_head_dim)
            }
            _ if bufs.gqa => {
                let w = n * nh * cfg.head_dim;
                self.probe_read(li, ProbePoint::Queries, &bufs.q, w)?;
                self.probe_read(li, ProbePoint::AttentionOut, &bufs.out, w)
            }
            _ => Ok(()),
        }
    }
}
