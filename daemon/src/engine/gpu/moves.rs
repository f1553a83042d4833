//! The GPU side of live re-placement (policy in [`crate::engine::replacement`]): copy a DRAM expert to
//! the GPU on a side stream while steps run, and swap it into its layer's table between two steps once
//! the copy has landed (an event says so; nothing waits for it).
//!
//! Cost on the engine thread per started move: exporting the expert from the packed DRAM set to bf16
//! rows (a few ms for a Qwen3-30B expert of 9 MiB) and handing the rows to the driver; the PCIe copy
//! itself overlaps the following steps. The evicted expert's GPU memory is freed at the swap, after the
//! step that last read it has completed (a step ends by synchronizing the engine's stream).
use super::{upload_dram_expert_on, GpuFfn, GpuMlp, GpuModel};
use crate::engine::replacement::Move;
use crate::model::{Ffn, Model};
use anyhow::Context;
use cudarc::driver::{CudaEvent, CudaStream};
use std::sync::Arc;

struct InFlight {
    mv: Move,
    weights: GpuMlp,
    landed: CudaEvent,
}

/// Copies in flight on the side stream.
pub struct ExpertMover {
    stream: Arc<CudaStream>,
    in_flight: Vec<InFlight>,
}

impl ExpertMover {
    pub fn new(gpu: &GpuModel) -> anyhow::Result<Self> {
        Ok(Self {
            stream: gpu.dev.ctx.new_stream()?,
            in_flight: Vec::new(),
        })
    }

    /// Starts copying `mv.admit` of `mv.layer` from `host`'s DRAM copy.
    pub fn start(&mut self, host: &Model, mv: Move) -> anyhow::Result<()> {
        let Some(Ffn::Moe(block)) = host.layers.get(mv.layer).map(|l| &l.ffn) else {
            anyhow::bail!("layer {} has no experts to move", mv.layer);
        };
        let weights = upload_dram_expert_on(&self.stream, block, mv.admit).with_context(|| {
            format!("copying layer {} expert {} to the GPU", mv.layer, mv.admit)
        })?;
        let landed = self.stream.record_event(None)?;
        self.in_flight.push(InFlight {
            mv,
            weights,
            landed,
        });
        Ok(())
    }

    /// Swaps every landed copy into its table (call between steps); returns the moves completed.
    pub fn swap_landed(&mut self, gpu: &GpuModel) -> anyhow::Result<Vec<Move>> {
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.in_flight.len() {
            if !self.in_flight[i].landed.try_is_complete()? {
                i += 1;
                continue;
            }
            let f = self.in_flight.swap_remove(i);
            gpu.swap_expert(f.mv.layer, f.mv.admit, f.mv.evict, f.weights)?;
            done.push(f.mv);
        }
        Ok(done)
    }

    /// Waits for every copy in flight and swaps them in (tests; shutting down cleanly).
    pub fn finish_all(&mut self, gpu: &GpuModel) -> anyhow::Result<Vec<Move>> {
        self.stream.synchronize()?;
        self.swap_landed(gpu)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

impl GpuModel {
    /// Between steps: `admit` of `layer` becomes GPU-resident with `weights`, `evict` goes back to its
    /// DRAM copy (its GPU memory is freed here).
    pub fn swap_expert(
        &self,
        layer: usize,
        admit: usize,
        evict: usize,
        weights: GpuMlp,
    ) -> anyhow::Result<()> {
        let GpuFfn::Moe(moe) = &self
            .layers
            .get(layer)
            .with_context(|| format!("no layer {layer}"))?
            .ffn
        else {
            anyhow::bail!("layer {layer} is not an MoE layer");
        };
        let resident = moe.experts.resident();
        if resident.get(admit) != Some(&false) || resident.get(evict) != Some(&true) {
            anyhow::bail!(
                "layer {layer}: cannot swap expert {admit} in for {evict} (residency changed)"
            );
        }
        moe.experts.install(admit, weights);
        drop(moe.experts.evict(evict));
        Ok(())
    }

    /// Per layer and expert: resident on the GPU now (empty rows for dense layers).
    pub fn residency(&self) -> Vec<Vec<bool>> {
        self.layers
            .iter()
            .map(|l| match &l.ffn {
                GpuFfn::Moe(m) => m.experts.resident(),
                GpuFfn::Dense(_) => Vec::new(),
            })
            .collect()
    }
}
