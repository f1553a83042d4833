//! Resident experts of small steps computed from the routing the router left on the device
//! (`moe_kernels::cuda::routed`), so a decode layer needs the host only for its DRAM experts.
//!
//! The host-planned path (`moe_layer`) makes the host wait for every MoE layer's routing, build a
//! dispatch plan and launch the resident experts' GEMMs from it: one host round trip per layer, and
//! CUDA graphs cover only the segments between them. Here the layer's pre-expert segment itself ends
//! with the shared expert and the resident routed experts read from the device's top-k
//! ([`LayerRoute`]):
//! - every expert of the layer resident ([`LayerRoute::Device`]): nothing goes to the host; the whole
//!   layer is one captured graph, and a step whose layers are all like that waits only for its logits;
//! - some experts in DRAM ([`LayerRoute::DeviceAndCpu`], pipelined decode steps): the segment publishes
//!   the routing and rows to the host first (so the CPU starts at once), then computes the resident
//!   experts; the host plans and computes only the DRAM experts (their homes become
//!   [`ExpertHome::DeviceRouted`]), whose sum the GPU adds as for an all-DRAM layer.
//!
//! Small steps only (at most `MAX_GRAPH_ROWS` rows, not a long prompt), one GPU (no tensor
//! parallelism), bf16 resident experts (what `--gpu-experts` uploads), exact routing (no deferred
//! experts, early routing or benchmark routing override; the step's `StepClass` holds every such
//! condition): anything else runs the host-planned path, as does everything with
//! `MOE_DEVICE_ROUTED=0` (`bench decode --device-routed-ab` times both). A graph step whose MoE
//! layers are all device-routed replays its whole layer stack as one graph (`graphs`). Each layer's
//! device table of resident weight addresses is compared with the expert table at the start of
//! every such step and rewritten when live re-placement moved an expert (graphs bake the table's
//! address, not its contents).
//!
//! Numerics: the host-planned path's roundings (gate_up and down sums in f32, the activation rounded
//! to bf16, f32 routing weights, each token's experts summed with fused multiply-adds in ascending
//! expert order and then added into the residual once). Only the GEMVs' f32 accumulation differs
//! from cuBLAS's: one-row experts agree bit for bit on the test fixtures, but expert groups of
//! several rows go through cuBLAS's tensor-core GEMMs, whose accumulation is not IEEE-sequential. An
//! ulp of difference matters more than its size: it can cross a bf16 rounding boundary of the next
//! norm's output, and one bf16 step of one element moves a 48-wide model's logits by 3–5e-3
//! (smallthinker_softmax's batch of three on the H200; its GPU test is ignored with the figures).
//! Layers run this way report no routing to `on_routing` (live placement and routing statistics see
//! the layers that still hand their routing to the host).
use super::buffers::{MlpBufs, StepClass, MAX_GRAPH_ROWS};
use super::dispatch::ExpertHome;
use super::{GpuFfn, GpuModel, GpuMoe};
use crate::engine::moe::GatedAct;
use crate::model::Model;
use anyhow::Context;
use cudarc::driver::CudaSlice;
use half::bf16;
use moe_kernels::cuda::routed::{
    RoutedKernels, RoutedScratch, RoutedShape, RoutedTable, MAX_PAIRS,
};
use std::sync::atomic::Ordering;

/// How a layer's routed experts run in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerRoute {
    /// The host waits for the routing and plans the layer (`moe_layer`); also every dense layer.
    Host,
    /// Every expert resident: the segment computes them, nothing goes to the host.
    Device,
    /// Resident experts in the segment after the routing's publication; DRAM experts on the CPU.
    DeviceAndCpu,
}

/// The device-routed experts' kernels, each MoE layer's table and the shared scratch (allocated once
/// for the most pairs of a graph-class step, so graphs may bake it).
pub struct DeviceRouted {
    kernels: RoutedKernels,
    /// Per layer (`None`: dense layer): the device table and the addresses it holds now.
    tables: Vec<Option<(RoutedTable, Vec<u64>)>>,
    /// Per layer: what the last look at its expert table found, and at which table version.
    marks: Vec<Option<TableMark>>,
    scratch: RoutedScratch,
}

/// A layer's expert table as [`GpuModel::plan_routes`] last read it: while the table's version is
/// the same, so are its residency and addresses, and the step skips the walk over the table (a few
/// µs per layer with the host's caches cold after the CPU experts, on the step's setup where the
/// GPU idles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TableMark {
    version: u64,
    experts: usize,
    /// Resident experts (0: the layer stays on the host-planned path, also when its resident
    /// experts are not bf16).
    resident: usize,
}

/// What a layer's segment needs to compute its experts from the device routing.
pub(super) struct RoutedLayer<'a> {
    kernels: &'a RoutedKernels,
    table: &'a RoutedTable,
    scratch: &'a mut RoutedScratch,
    pub mlp: &'a mut MlpBufs,
    /// Whether the segment also hands the routing to the host (the layer has DRAM experts).
    pub publish: bool,
}

impl DeviceRouted {
    /// What layer `li`'s segment needs when its route is not [`LayerRoute::Host`].
    pub(super) fn layer<'a>(
        &'a mut self,
        li: usize,
        route: LayerRoute,
        mlp: &'a mut MlpBufs,
    ) -> Option<RoutedLayer<'a>> {
        if route == LayerRoute::Host {
            return None;
        }
        let (table, _) = self.tables.get(li)?.as_ref()?;
        Some(RoutedLayer {
            kernels: &self.kernels,
            table,
            scratch: &mut self.scratch,
            mlp,
            publish: route == LayerRoute::DeviceAndCpu,
        })
    }
}

/// `homes` of a [`LayerRoute::DeviceAndCpu`] layer as its host plan sees them: the resident experts
/// are already computed.
pub(super) fn host_homes(route: LayerRoute, homes: Vec<ExpertHome>) -> Vec<ExpertHome> {
    if route != LayerRoute::DeviceAndCpu {
        return homes;
    }
    homes
        .into_iter()
        .map(|h| match h {
            ExpertHome::Resident => ExpertHome::DeviceRouted,
            h => h,
        })
        .collect()
}

/// The resident experts' device addresses of one layer (`[2 · experts]`: gate_up, then down), or
/// `None` when one of them is not bf16 (the layer keeps the host-planned path).
fn resident_addrs(dev: &moe_kernels::cuda::GpuDevice, moe: &GpuMoe) -> Option<Vec<u64>> {
    let table = moe.experts.read();
    let e = table.len();
    let mut addrs = vec![0u64; 2 * e];
    for (i, m) in table.iter().enumerate() {
        if let Some(m) = m {
            addrs[i] = dev.addr(m.gate_up.w.as_bf16()?);
            addrs[e + i] = dev.addr(m.down.w.as_bf16()?);
        }
    }
    Some(addrs)
}

impl GpuModel {
    /// Turns the device-routed experts on or off (A/B runs and tests; on at start unless
    /// `MOE_DEVICE_ROUTED=0`).
    pub fn set_device_routed(&self, on: bool) {
        self.device_routed.store(on, Ordering::Relaxed);
    }

    /// Whether the benchmarks' routing override is installed (its layers must hand their routing to
    /// the host, which rewrites it).
    pub(super) fn routing_overridden(&self) -> bool {
        self.routing_override
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// The step's route of every layer, with the device tables brought up to date (loads the kernels
    /// and scratch the first time). All [`LayerRoute::Host`] when the step's class rules the path
    /// out; mixed layers only in pipelined steps (the DRAM experts are handed to the CPU after the
    /// next segment is enqueued).
    pub(super) fn plan_routes(
        &self,
        host: &Model,
        state: &mut Option<DeviceRouted>,
        class: &StepClass,
    ) -> anyhow::Result<Vec<LayerRoute>> {
        let mut routes = vec![LayerRoute::Host; self.layers.len()];
        let (Some(mc), true) = (&host.config.moe, class.device_routing) else {
            return Ok(routes);
        };
        let pipelined = class.pipelined;
        let dev = &self.dev;
        if state.is_none() {
            let pairs = MAX_GRAPH_ROWS * mc.top_k;
            let (hd, inter) = (host.config.hidden_size, mc.expert_intermediate);
            *state = Some(DeviceRouted {
                kernels: RoutedKernels::load(dev)?,
                tables: (0..self.layers.len()).map(|_| None).collect(),
                marks: vec![None; self.layers.len()],
                scratch: RoutedScratch::new(dev, pairs.min(MAX_PAIRS), hd, inter)?,
            });
        }
        let Some(st) = state.as_mut() else {
            return Ok(routes);
        };
        for (li, layer) in self.layers.iter().enumerate() {
            let GpuFfn::Moe(moe) = &layer.ffn else {
                continue;
            };
            let version = moe.experts.version();
            let mark = match st.marks[li] {
                Some(m) if m.version == version => m,
                _ => {
                    let m = Self::update_table(dev, moe, &mut st.tables[li], version)?;
                    st.marks[li] = Some(m);
                    m
                }
            };
            let (experts, resident) = (mark.experts, mark.resident);
            if resident == 0 {
                continue;
            }
            routes[li] = if resident == experts {
                LayerRoute::Device
            } else if pipelined && self.switches.prelaunch() {
                LayerRoute::DeviceAndCpu
            } else {
                LayerRoute::Host
            };
        }
        Ok(routes)
    }

    /// Reads layer `moe`'s expert table (at `version` or later) and brings its device table `slot`
    /// up to date; returns what it found.
    fn update_table(
        dev: &moe_kernels::cuda::GpuDevice,
        moe: &GpuMoe,
        slot: &mut Option<(RoutedTable, Vec<u64>)>,
        version: u64,
    ) -> anyhow::Result<TableMark> {
        let Some(addrs) = resident_addrs(dev, moe) else {
            return Ok(TableMark {
                version,
                experts: 0,
                resident: 0,
            });
        };
        let experts = addrs.len() / 2;
        let resident = addrs[..experts].iter().filter(|&&a| a != 0).count();
        let mark = TableMark {
            version,
            experts,
            resident,
        };
        if resident == 0 {
            return Ok(mark);
        }
        if slot.as_ref().is_none_or(|(t, _)| t.experts != experts) {
            let t = RoutedTable {
                addrs: dev.stream.alloc_zeros::<u64>(2 * experts)?,
                experts,
            };
            *slot = Some((t, Vec::new()));
        }
        if let Some((t, held)) = slot.as_mut() {
            if *held != addrs {
                // ordered on the stream before this step's kernels read it
                dev.stream.memcpy_htod(&addrs, &mut t.addrs)?;
                *held = addrs;
            }
        }
        Ok(mark)
    }

    /// The end of a device-routed layer's segment, after its top-k (`eids`, `w`): the shared expert,
    /// then the resident routed experts, added into `x`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn experts_from_device_routing(
        &self,
        host: &Model,
        moe: &GpuMoe,
        n: usize,
        r: &mut RoutedLayer<'_>,
        (hb, hf): (&CudaSlice<bf16>, &CudaSlice<f32>),
        (eids, w): (&CudaSlice<i32>, &CudaSlice<f32>),
        x: &mut CudaSlice<f32>,
    ) -> anyhow::Result<()> {
        let cfg = &host.config;
        let mc = cfg
            .moe
            .as_ref()
            .context("device routing without an MoE config")?;
        let act = GatedAct::of(cfg);
        let hd = cfg.hidden_size;
        if let Some(sh) = &moe.shared {
            let gate = moe.shared_gate.as_ref();
            self.shared_expert(sh, gate, act, (n, hd), hb, hf, x, r.mlp)?;
        }
        let shape = RoutedShape {
            rows: n,
            top_k: mc.top_k,
            hidden: hd,
            inter: mc.expert_intermediate,
        };
        let activation = (super::kinds::gate_activation(act.act), act.swiglu_limit);
        r.kernels.forward(
            &self.dev,
            shape,
            (eids, w),
            r.table,
            hb,
            activation,
            r.scratch,
            x,
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_mixed_layers_hand_their_resident_experts_to_the_device() {
        use ExpertHome::*;
        let homes = vec![Resident, Cpu, Resident];
        assert_eq!(host_homes(LayerRoute::Host, homes.clone()), homes);
        assert_eq!(host_homes(LayerRoute::Device, homes.clone()), homes);
        assert_eq!(
            host_homes(LayerRoute::DeviceAndCpu, homes),
            vec![DeviceRouted, Cpu, DeviceRouted]
        );
    }

    /// The host plan of a mixed layer leaves its device-routed experts alone: no GPU rows, only the
    /// DRAM experts' routes go to the CPU, and the device-routed hits count as GPU hits.
    #[test]
    fn host_plan_of_a_mixed_layer_keeps_only_the_dram_experts() {
        use super::super::dispatch::MoeDispatchPlan;
        use crate::engine::moe::NOT_HERE;
        use ExpertHome::*;
        let homes = host_homes(LayerRoute::DeviceAndCpu, vec![Resident, Cpu, Resident, Cpu]);
        // two tokens, top-2: token 0 → experts 0, 1; token 1 → experts 2, 0
        let plan = MoeDispatchPlan::new(&[0, 1, 2, 0], &[0.6, 0.4, 0.7, 0.3], 2, &homes, &[]);
        assert_eq!(plan.gpu_rows(), 0);
        assert!(!plan.any_gpu_work());
        assert_eq!((plan.expert_hits, plan.gpu_expert_hits), (4, 3));
        let cpu = plan.cpu.expect("the DRAM expert's route");
        assert_eq!(cpu.ids, vec![NOT_HERE, 1, NOT_HERE, NOT_HERE]);
        assert_eq!(cpu.weights, vec![0.0, 0.4, 0.0, 0.0]);
    }
}
