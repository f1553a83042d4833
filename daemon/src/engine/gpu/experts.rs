//! Routed experts computed on the GPU in phases: a run of experts whose token rows are consecutive.
use super::dispatch::{ExpertGroup, ExpertHome};
use super::GpuModel;
use crate::engine::moe::GatedAct;
use cudarc::driver::{CudaSlice, CudaView};
use half::bf16;
use moe_kernels::cuda::gemm_path::UseCount;
use moe_kernels::cuda::{ExpertGemmPath, GemmItem, GpuDevice};

/// Row buffers of one MoE layer's GPU experts: gathered inputs, gate_up, activations, outputs.
pub(super) struct PhaseBuffers<'a> {
    pub(super) xe: &'a CudaSlice<bf16>,
    pub(super) gu: &'a mut CudaSlice<f32>,
    pub(super) act: &'a mut CudaSlice<bf16>,
    pub(super) ye: &'a mut CudaSlice<f32>,
    pub(super) table: &'a mut CudaSlice<u64>,
    pub(super) hd: usize,
    pub(super) inter: usize,
    pub(super) activation: GatedAct,
    /// The GEMM path for every phase of the layer, or `None` for the rule's path per use
    /// (`moe_kernels::cuda::gemm_path`).
    pub(super) path: Option<ExpertGemmPath>,
}

impl GpuModel {
    /// One phase of GPU experts: `groups` with consecutive rows, `ws` their (gate_up `[2I, H]`, down
    /// `[H, I]`) weights: gate_up GEMMs, one activation over the phase's rows, down GEMMs into `ye`;
    /// on `dev`'s stream (the engine's, or the decode split's side stream).
    pub(super) fn expert_phase(
        dev: &GpuDevice,
        groups: &[ExpertGroup],
        ws: &[(CudaView<'_, bf16>, CudaView<'_, bf16>)],
        b: &mut PhaseBuffers<'_>,
    ) -> anyhow::Result<()> {
        let (Some(first), Some(last)) = (groups.first(), groups.last()) else {
            return Ok(());
        };
        let (hd, inter) = (b.hd, b.inter);
        let (r0, r1) = (first.row0, last.row0 + last.rows);
        // Byte addresses of row `r` of a buffer `width` elements wide.
        let (bf, f) = (size_of::<bf16>() as u64, size_of::<f32>() as u64);
        let row = |base: u64, r: usize, width: usize, elem: u64| base + (r * width) as u64 * elem;
        let items = |x: u64, x_width: usize, y: u64, y_width: usize, w: &dyn Fn(usize) -> u64| {
            groups
                .iter()
                .enumerate()
                .map(|(i, g)| GemmItem {
                    x: row(x, g.row0, x_width, bf),
                    w: w(i),
                    y: row(y, g.row0, y_width, f),
                    rows: g.rows,
                })
                .collect::<Vec<_>>()
        };
        let gate_up = items(dev.addr(b.xe), hd, dev.addr(&*b.gu), 2 * inter, &|i| {
            dev.addr(&ws[i].0)
        });
        // SAFETY: each group's rows lie inside the phase buffers (sized for every routed row) and each
        // weight view is a whole [2I, H] / [H, I] matrix; all outlive the stream's use of them.
        unsafe { Self::expert_gemms(dev, &gate_up, 2 * inter, hd, b.table, b.path)? };
        let act = b.activation;
        dev.gated_mul(
            &b.gu.slice(r0 * 2 * inter..r1 * 2 * inter),
            (r1 - r0, inter),
            super::kinds::gate_activation(act.act),
            act.swiglu_limit,
            &mut b.act.slice_mut(r0 * inter..r1 * inter),
        )?;
        let down = items(dev.addr(&*b.act), inter, dev.addr(&*b.ye), hd, &|i| {
            dev.addr(&ws[i].1)
        });
        // SAFETY: as for gate_up.
        unsafe { Self::expert_gemms(dev, &down, hd, inter, b.table, b.path)? };
        Ok(())
    }

    /// One projection of a phase's experts on `path`, or the rule's path for the use when `None`.
    ///
    /// # Safety
    /// As `GpuDevice::gemm_bf16_items`.
    unsafe fn expert_gemms(
        dev: &GpuDevice,
        items: &[GemmItem],
        m: usize,
        k: usize,
        table: &mut CudaSlice<u64>,
        path: Option<ExpertGemmPath>,
    ) -> anyhow::Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            match path {
                Some(p) => dev.gemm_bf16_items_on(items, m, k, table, p)?,
                None => dev.gemm_bf16_items(items, m, k, table)?,
            }
        };
        Ok(())
    }

    /// The GEMM path of a layer's GPU experts: mixed layers (resident experts beside DRAM experts
    /// the CPU computes after the host launched the GPU's)
    /// take the grouped kernel when [`DecodeSwitches::mixed_grouped`] is on, since its launch costs
    /// the host less than cuBLAS's batched call (no per-call heuristics) and that host time delays
    /// the CPU experts; `None` elsewhere (the rule), or when `MOE_GROUPED_GEMM` forces a path.
    ///
    /// [`DecodeSwitches::mixed_grouped`]: super::switches::DecodeSwitches::mixed_grouped
    pub(super) fn mixed_layer_path(&self, homes: &[ExpertHome]) -> Option<ExpertGemmPath> {
        let mixed = homes.contains(&ExpertHome::Resident) && homes.contains(&ExpertHome::Cpu);
        let forced = self.dev.expert_gemm_forced().is_some();
        (mixed && !forced && self.switches.mixed_grouped()).then_some(ExpertGemmPath::Grouped)
    }
}

/// What benchmarks read of the CUDA backend's expert work.
impl crate::engine::Engine {
    /// The GPU's expert GEMM calls so far per kind of use and path, and the path `MOE_GROUPED_GEMM`
    /// forces if it does (CUDA backend; `moe_kernels::cuda::gemm_path`).
    pub fn expert_gemm_uses(&self) -> Option<(Vec<UseCount>, Option<ExpertGemmPath>)> {
        self.gpu.as_ref().map(|g| g.dev.expert_gemm_uses())
    }

    /// The split's measured rates of the GPU and CPU sides in bytes per second (`split`).
    pub fn split_rates(&self) -> Option<(f64, f64)> {
        let g = self.gpu.as_ref()?;
        Some(g.split.lock().unwrap_or_else(|e| e.into_inner()).rates())
    }

    /// The worker pool of the CPU expert kernels, if this engine has one.
    pub fn cpu_expert_pool(&self) -> Option<&moe_kernels::cpu::WorkerPool> {
        self.cpu_pool.as_deref()
    }
}
