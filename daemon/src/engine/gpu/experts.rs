//! Routed experts computed on the GPU in phases: a run of experts whose token rows are consecutive.
use super::GpuModel;
use crate::model::config::Activation;
use cudarc::driver::{CudaSlice, CudaView};
use half::bf16;

/// Row buffers of one MoE layer's GPU experts: gathered inputs, gate_up, activations, outputs.
pub(super) struct PhaseBuffers<'a> {
    pub(super) xe: &'a CudaSlice<bf16>,
    pub(super) gu: &'a mut CudaSlice<f32>,
    pub(super) act: &'a mut CudaSlice<bf16>,
    pub(super) ye: &'a mut CudaSlice<f32>,
    pub(super) hd: usize,
    pub(super) inter: usize,
    pub(super) activation: Activation,
}

impl GpuModel {
    /// One phase of GPU experts: `groups` (expert, first row, rows) with consecutive rows, `ws` their
    /// (gate_up `[2I, H]`, down `[H, I]`) weights: gate_up GEMMs, one activation over the phase's
    /// rows, down GEMMs into `ye`.
    pub(super) fn expert_phase(
        &self,
        groups: &[(usize, usize, usize)],
        ws: &[(CudaView<'_, bf16>, CudaView<'_, bf16>)],
        b: &mut PhaseBuffers<'_>,
    ) -> anyhow::Result<()> {
        let (Some(first), Some(last)) = (groups.first(), groups.last()) else {
            return Ok(());
        };
        let (hd, inter, dev) = (b.hd, b.inter, &self.dev);
        let (r0, r1) = (first.1, last.1 + last.2);
        for (&(_, g0, c), (w_gu, _)) in groups.iter().zip(ws) {
            let mut out = b.gu.slice_mut(g0 * 2 * inter..(g0 + c) * 2 * inter);
            dev.gemm_bf16(
                &b.xe.slice(g0 * hd..(g0 + c) * hd),
                w_gu,
                &mut out,
                c,
                2 * inter,
                hd,
                false,
            )?;
        }
        self.gated_act(
            &b.gu.slice(r0 * 2 * inter..r1 * 2 * inter),
            &mut b.act.slice_mut(r0 * inter..r1 * inter),
            inter,
            r1 - r0,
            b.activation,
        )?;
        for (&(_, g0, c), (_, w_d)) in groups.iter().zip(ws) {
            let mut out = b.ye.slice_mut(g0 * hd..(g0 + c) * hd);
            dev.gemm_bf16(
                &b.act.slice(g0 * inter..(g0 + c) * inter),
                w_d,
                &mut out,
                c,
                hd,
                inter,
                false,
            )?;
        }
        Ok(())
    }
}
