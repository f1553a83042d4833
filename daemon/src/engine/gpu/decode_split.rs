//! Decode steps that read a layer's DRAM experts through both links: the CPU kernels from DRAM and
//! the GPU over PCIe (issues 14 and 15).
//!
//! At batch 1 a decode step is the CPU kernels reading the routed DRAM experts (~85 % of the DRAM
//! probe) while PCIe idles. Once a layer's routing is on the host (`moe_layer`), a share of its routed
//! DRAM experts (`split::DecodeBalance`, or a fixed count: `switches::DecodeShare`) goes to the GPU on
//! a side stream of its own ([`ShareSide`]): their packed bytes copied from the registered memory the
//! CPU kernels read (the expert stream's first staging slot), the layer's published rows copied from
//! the hand-off's mapped memory, unpacked, the expert GEMMs, their weighted sum copied back into
//! mapped host memory. The CPU pool computes the rest at the same time; before raising the hand-off
//! flag the layer's CPU half waits for the side stream and adds the GPU's sum into its own
//! (`handoff::Handoff::join_share`).
//!
//! Why the host adds the GPU's sum instead of the GPU: the engine stream is already past this layer
//! (in pipelined steps its wait for the CPU's sum and the next layer's segment, CUDA graphs included,
//! were enqueued before the routing landed), so nothing launched now can run before that wait on it;
//! the side stream could only add into the residual under a second flag the wait kernel polls (a
//! protocol change for every layer). The host's add is 2048 floats at batch 1 (~1 µs) after a
//! side stream that the balance sizes to finish before the CPU, and leaves the hand-off kernels, the
//! graphs and every step without a share exactly as they were.
//!
//! The side stream reads the same f32 rows as the CPU kernels (the hand-off's), rounded to bf16 for
//! the GEMMs as every GPU expert's input is. Exact in the sense of the prefill split: every routed
//! expert is computed once, on one side; the sums differ from the CPU's by the GPU's bf16 GEMMs.
//!
//! Measured on the H200 (docs/PERF.md, 16-layer Qwen3-30B-A3B shape): two of eight bf16 experts on the
//! GPU take 113 µs per layer off the CPU, but the host's ~17 calls that launch a share cost ~120 µs
//! before the CPU experts start, so steps are not faster; the switch is off by default and the
//! balance, which counts the launches, takes no share there. Batch 1 only (see `ShareSide::warm`).
use super::buffers::ExpertBufs;
use super::dispatch::{ExpertGroup, ExpertHome, MoeDispatchPlan};
use super::experts::PhaseBuffers;
use super::handoff::Handoff;
use super::moe_layer::MoeStep;
use super::split::{gpu_experts, routed_rows, DecodeBalance};
use super::stream::{copy_runs, layer_set, ExpertStream};
use super::switches::DecodeShare;
use super::GpuModel;
use crate::engine::moe::{GatedAct, NOT_HERE};
use crate::model::Model;
use anyhow::Context;
use cudarc::driver::{CudaEvent, CudaSlice};
use half::bf16;
use moe_kernels::cpu::moe::PackedGeometry;
use moe_kernels::cuda::GpuDevice;
use std::time::Instant;

/// The GPU side of decode splits: a handle on the device with a stream of its own, the buffers of one
/// layer's share for up to `tokens` rows, and the balance of both sides.
pub struct ShareSide {
    side: GpuDevice,
    /// The layer's published rows `[tokens, hidden]` as copied (f32) and as GEMM input (bf16).
    rows_f32: CudaSlice<f32>,
    rows_bf16: CudaSlice<bf16>,
    bufs: ExpertBufs,
    /// The share's weighted sum `[tokens, hidden]`.
    sum: CudaSlice<f32>,
    /// Recorded before the share's first copy (timing on: with the hand-off's `done`, its span).
    start: CudaEvent,
    routed: usize,
    pub balance: DecodeBalance,
    /// The last layer's bytes given to (the GPU, the CPU), until its times are read.
    last: Option<(usize, usize)>,
}

impl ShareSide {
    /// The side of a model whose decode steps have at most `tokens` rows routed to `top_k` experts
    /// each, shares of at most `experts` experts of `g`'s shape (`dense` holds them unpacked).
    pub fn new(
        dev: &GpuDevice,
        (g, dense): (&PackedGeometry, &CudaSlice<bf16>),
        (tokens, top_k): (usize, usize),
        experts: usize,
        act: GatedAct,
    ) -> anyhow::Result<ShareSide> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        let side = dev.fork()?;
        let (hd, routed) = (g.hidden, tokens * top_k);
        let s = &side.stream;
        let bufs = ExpertBufs::new(s, (tokens, routed), (hd, g.inter), experts)?;
        // SAFETY: each is written (copy, conversion, memset) before a share reads it.
        let (rows_f32, rows_bf16, sum) = unsafe {
            (
                s.alloc::<f32>(tokens * hd)?,
                s.alloc::<bf16>(tokens * hd)?,
                s.alloc::<f32>(tokens * hd)?,
            )
        };
        let mut me = ShareSide {
            start: dev.ctx.new_event(Some(CU_EVENT_DEFAULT))?,
            side,
            rows_f32,
            rows_bf16,
            bufs,
            sum,
            routed,
            balance: DecodeBalance::default(),
            last: None,
        };
        me.warm(g, dense, top_k.min(experts), act)?;
        Ok(me)
    }

    /// Runs the GEMMs of every share size a batch-1 step can take (1 to `most` experts, one row
    /// each) once and waits: cuBLAS loads a kernel on its first launch, which may wait for the whole
    /// device, and in a step the engine stream spins in a hand-off wait that only this side's finish
    /// ends. (The other kernels of a share are the engine's own, loaded at start.) The weights are
    /// whatever `dense` holds: the outputs are discarded.
    fn warm(
        &mut self,
        g: &PackedGeometry,
        dense: &CudaSlice<bf16>,
        most: usize,
        act: GatedAct,
    ) -> anyhow::Result<()> {
        let (each, split, hd) = (g.dense_elems(), 2 * g.inter * g.hidden, g.hidden);
        for count in 1..=most {
            let groups: Vec<ExpertGroup> = (0..count)
                .map(|j| ExpertGroup {
                    expert: j,
                    row0: j,
                    rows: 1,
                })
                .collect();
            let ws: Vec<_> = (0..count)
                .map(|j| {
                    (
                        dense.slice(j * each..j * each + split),
                        dense.slice(j * each + split..(j + 1) * each),
                    )
                })
                .collect();
            let b = &mut self.bufs;
            // SAFETY: written before the GEMMs read it (its values do not matter).
            self.side
                .stream
                .memset_zeros(&mut b.x.slice_mut(..count * hd))?;
            let mut pb = PhaseBuffers {
                xe: &b.x,
                gu: &mut b.gate_up,
                act: &mut b.act,
                ye: &mut b.y,
                table: &mut b.gemm_table,
                hd,
                inter: g.inter,
                activation: act,
                path: None,
            };
            GpuModel::expert_phase(&self.side, &groups, &ws, &mut pb)?;
        }
        self.synchronize()
    }

    /// Waits until the side stream has run everything enqueued (before the staging slot it shares
    /// with long prompts is used again).
    pub fn synchronize(&self) -> anyhow::Result<()> {
        Ok(self.side.stream.synchronize()?)
    }

    /// Feeds the last layer's measured times to the balance: the CPU experts' (the hand-off kept
    /// them), the GPU side's span when it had one and it has passed. Only a measurement: a span that
    /// cannot be read (the last share went through another hand-off, of another step class) is
    /// left out.
    fn collect(&mut self, hand: &Handoff) {
        let Some((gpu_bytes, cpu_bytes)) = self.last.take() else {
            return;
        };
        if let Some(cpu_s) = hand.share.cpu_s.take() {
            self.balance.observe_cpu(cpu_bytes, cpu_s, gpu_bytes > 0);
        }
        let done = &hand.share.done;
        if gpu_bytes > 0 && done.try_is_complete().unwrap_or(false) {
            if let Ok(ms) = self.start.elapsed_ms(done) {
                self.balance.observe_gpu(gpu_bytes, f64::from(ms) / 1e3);
            }
        }
    }
}

/// One layer's routing as the share sees it.
struct LayerRouting<'a> {
    ids: &'a [u32],
    weights: &'a [f32],
    top_k: usize,
    tokens: usize,
    /// The layer's experts (ids are below it).
    experts: usize,
}

impl ShareSide {
    /// Enqueues layer `li`'s share `experts` (ascending) on the side stream: copies, unpack, GEMMs,
    /// weighted sum into the hand-off's `share.sum`, then `share.done`. `staging` and `dense` hold
    /// at least `experts.len()` packed / dense experts.
    #[allow(clippy::too_many_arguments)]
    fn issue(
        &mut self,
        host: &Model,
        li: usize,
        (g, staging, dense): (&PackedGeometry, &CudaSlice<u8>, &mut CudaSlice<bf16>),
        hand: &Handoff,
        experts: &[u32],
        r: &LayerRouting<'_>,
    ) -> anyhow::Result<()> {
        let (dev, hd) = (&self.side, g.hidden);
        let (s, nx) = (&dev.stream, r.tokens * hd);
        let set = layer_set(host, li).context("a split layer without DRAM experts")?;
        self.start.record(s)?;
        let starts = experts
            .iter()
            .map(|&id| set.packed_expert(id).map(|b| b.as_ptr() as usize))
            .collect::<Option<Vec<_>>>()
            .with_context(|| format!("layer {li}: a shared expert is not in DRAM"))?;
        let base = dev.addr(staging);
        // SAFETY (both copies): the sources are the host model's packed experts (registered, alive
        // while the engine is) and the hand-off's rows, which the GPU rewrites only after this layer's
        // flag, raised after the side stream is done (`join_share`); the destinations hold them
        // (`staging` and `dense` take a chunk of experts, `rows_f32` the step's rows).
        unsafe {
            for (src, len, off) in copy_runs(&starts, g.expert_bytes) {
                let src = std::slice::from_raw_parts(src as *const u8, len);
                cudarc::driver::result::memcpy_htod_async(base + off as u64, src, s.cu_stream())?;
            }
            let rows = hand.port.x.host(nx);
            let dst = dev.addr(&self.rows_f32);
            cudarc::driver::result::memcpy_htod_async(dst, rows, s.cu_stream())?;
        }
        dev.f32_to_bf16(&self.rows_f32, nx, &mut self.rows_bf16)?;
        dev.unpack_experts(g, staging, experts.len(), dense)?;
        // The share's rows: its experts as the layer's one stream chunk, every other expert elsewhere.
        let mut homes = vec![ExpertHome::Peer; r.experts];
        for &e in experts {
            homes[e as usize] = ExpertHome::Streamed;
        }
        let plan = MoeDispatchPlan::new(r.ids, r.weights, r.top_k, &homes, &[(0, experts)]);
        let rows = plan.gpu_rows();
        let b = &mut self.bufs;
        s.memcpy_htod(&plan.row_token, &mut b.row_token.slice_mut(..rows))?;
        s.memcpy_htod(&plan.row_weight, &mut b.row_weight.slice_mut(..rows))?;
        dev.gather_rows(&self.rows_bf16, &b.row_token, (rows, hd), &mut b.x)?;
        let (each, split) = (g.dense_elems(), 2 * g.inter * hd);
        let phase = plan.phases.last().context("the share's phase")?;
        let groups = plan.phase_groups(phase);
        let mut ws = Vec::with_capacity(groups.len());
        for grp in groups {
            let j = experts
                .iter()
                .position(|&x| x as usize == grp.expert)
                .context("a routed expert outside the share")?;
            ws.push((
                dense.slice(j * each..j * each + split),
                dense.slice(j * each + split..(j + 1) * each),
            ));
        }
        let mut pb = PhaseBuffers {
            xe: &b.x,
            gu: &mut b.gate_up,
            act: &mut b.act,
            ye: &mut b.y,
            table: &mut b.gemm_table,
            hd,
            inter: g.inter,
            activation: GatedAct::of(&host.config),
            path: None,
        };
        GpuModel::expert_phase(dev, groups, &ws, &mut pb)?;
        s.memset_zeros(&mut self.sum.slice_mut(..nx))?;
        let tokens = r.tokens;
        s.memcpy_htod(
            &plan.token_offsets,
            &mut b.token_offsets.slice_mut(..tokens + 1),
        )?;
        s.memcpy_htod(&plan.token_rows, &mut b.token_rows.slice_mut(..rows))?;
        let ExpertBufs {
            y,
            token_offsets,
            token_rows,
            row_weight,
            ..
        } = &*b;
        let shape = (tokens, rows, hd);
        dev.scatter_add_weighted(
            y,
            token_offsets,
            token_rows,
            row_weight,
            shape,
            &mut self.sum,
        )?;
        // SAFETY: the host reads `share.sum` only after `done` (recorded below) passed, and the side
        // stream writes it for one layer at a time (the next share is issued after this one joined).
        unsafe {
            let dst = hand.share.sum.host_mut(nx);
            cudarc::driver::result::memcpy_dtoh_async(dst, dev.addr(&self.sum), s.cu_stream())?;
        }
        hand.share.done.record(s)?;
        Ok(())
    }
}

impl ExpertStream {
    /// The decode split's side and what it borrows of the stream: the geometry, the first staging
    /// slot and the dense buffer (idle in decode steps), the most experts they hold.
    #[allow(clippy::type_complexity)]
    fn share_parts(
        &mut self,
    ) -> Option<(
        &mut ShareSide,
        (&PackedGeometry, &CudaSlice<u8>, &mut CudaSlice<bf16>),
        usize,
    )> {
        let chunk = self.chunk_experts;
        let (side, geometry, staging, dense) = self.share_and_buffers()?;
        Some((side, (geometry, staging, dense), chunk))
    }
}

impl GpuModel {
    /// Layer `li`'s decode split (see the module docs), once its routing (`ids`, `weights`) is on the
    /// host: the GPU's experts, issued on the side stream, or `None` when the layer keeps them all
    /// on the CPU (switch off, no DRAM expert the GPU unpacks, deferred experts, a step of more than
    /// one row, or a share the balance finds not worth it).
    pub(super) fn decode_share(
        &self,
        li: usize,
        homes: &[ExpertHome],
        (ids, weights): (&[u32], &[f32]),
        ctx: &mut MoeStep<'_, '_>,
        defer: usize,
    ) -> anyhow::Result<Option<Vec<u32>>> {
        let mode = self.switches.decode_split();
        let (host, hand, n) = (ctx.host, ctx.hand, ctx.n);
        let Some(es) = ctx.decode.as_deref_mut() else {
            return Ok(None);
        };
        if mode == DecodeShare::Off
            || defer > 0
            || !super::stream::gpu_can_take_dram_experts(host, li)
        {
            return Ok(None);
        }
        let each = es.expert_bytes();
        let Some((side, parts, cap)) = es.share_parts() else {
            return Ok(None);
        };
        // batch 1: the share's GEMM shapes are those `ShareSide::warm` loaded (see there)
        let top_k = ids.len();
        if n != 1 || ids.len() > side.routed || top_k == 0 {
            return Ok(None);
        }
        side.collect(hand);
        let routed = routed_rows(ids, homes.len(), |e| homes[e] == ExpertHome::Cpu);
        let m = routed.len();
        let g = match mode {
            DecodeShare::Auto => side.balance.gpu_count(m, each, cap),
            DecodeShare::Fixed(f) => f.min(cap).min(m.saturating_sub(1)),
            DecodeShare::Off => 0,
        };
        side.last = Some((g * each, (m - g) * each));
        if g == 0 {
            return Ok(None);
        }
        let experts = gpu_experts(&routed, g as f64 / m as f64);
        let t = Instant::now();
        let r = LayerRouting {
            ids,
            weights,
            top_k,
            tokens: n,
            experts: homes.len(),
        };
        side.issue(host, li, parts, hand, &experts, &r)?;
        hand.share_issued();
        side.balance.observe_launch(t.elapsed().as_secs_f64());
        ctx.times.split_gpu_experts += experts.len() as u64;
        ctx.times.split_cpu_experts += (m - experts.len()) as u64;
        Ok(Some(experts))
    }
}

impl crate::engine::Engine {
    /// The decode split's balance (its measured rates, `split::DecodeBalance::rates`); `None`
    /// without the split's side (no expert stream, CPU backend).
    pub fn decode_split_balance(&self) -> Option<DecodeBalance> {
        let g = self.gpu.as_ref()?;
        let mut stream = g.stream.lock().unwrap_or_else(|e| e.into_inner());
        let (side, ..) = stream.as_mut()?.share_parts()?;
        Some(side.balance.clone())
    }
}

/// `ids` and `weights` with the routes to `gpu` (ascending) taken out ([`NOT_HERE`], weight 0): what
/// the CPU half computes of a split layer.
pub fn without(ids: &[u32], weights: &[f32], gpu: &[u32]) -> (Vec<u32>, Vec<f32>) {
    ids.iter()
        .zip(weights)
        .map(|(&id, &w)| match gpu.binary_search(&id) {
            Ok(_) => (NOT_HERE, 0.0),
            Err(_) => (id, w),
        })
        .unzip()
}

/// `homes` with the experts of the GPU's share (`gpu`, ascending) re-homed [`ExpertHome::Shared`].
pub fn homes_with_share(homes: &[ExpertHome], gpu: &[u32]) -> Vec<ExpertHome> {
    (0..homes.len())
        .map(|e| match gpu.binary_search(&(e as u32)) {
            Ok(_) => ExpertHome::Shared,
            Err(_) => homes[e],
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_keeps_the_routes_the_gpu_does_not_take() {
        let (ids, w) = without(&[5, 2, 9, 2], &[0.1, 0.2, 0.3, 0.4], &[2, 7]);
        assert_eq!(ids, vec![5, NOT_HERE, 9, NOT_HERE]);
        assert_eq!(w, vec![0.1, 0.0, 0.3, 0.0]);
        use ExpertHome::{Cpu, DeviceRouted, Shared};
        assert_eq!(
            homes_with_share(&[Cpu, DeviceRouted, Cpu, Cpu], &[2, 3]),
            vec![Cpu, DeviceRouted, Shared, Shared]
        );
    }
}
