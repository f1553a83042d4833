//! One MoE layer of a GPU step once its router has run: the layer's one wait for the routing (a
//! flag polled in mapped host memory, `handoff`), a [`MoeDispatchPlan`], then its phases in the
//! order that keeps both sides busy:
//!
//! 1. the shared expert and `run_gpu_experts` (resident / uploaded experts, then each streamed chunk)
//!    and `combine_gpu` (their rows summed into `x` per token, in a fixed order) are enqueued;
//! 2. so is the GPU's wait for the CPU experts' sum and its add into `x` (`handoff_wait_add`);
//! 3. the returned [`CpuHalf`] computes the DRAM experts of the same tokens on the CPU pool and
//!    raises the flag: right away, or after the caller enqueued the next layer (pipelined steps).
//!
//! Nothing here allocates device memory except the weights of experts uploaded for a long prompt
//! whose DRAM experts cannot be streamed (and cuBLAS's pointer tables of the batched GEMMs).
use super::buffers::{ExpertBufs, MlpBufs};
use super::dispatch::{split_deferred, ExpertHome, MoeDispatchPlan};
use super::experts::PhaseBuffers;
use super::handoff::{CpuHalf, Handoff};
use super::split::{GpuSpan, SplitBalance};
use super::stream::ExpertStream;
use super::{GpuMlp, GpuModel, GpuMoe};
use crate::engine::moe::{GatedAct, Routing};
use crate::engine::StepTimes;
use crate::model::{Ffn, Model, MoeBlock};
use anyhow::Context;
use cudarc::driver::{CudaEvent, CudaSlice, CudaView};
use half::bf16;
use moe_kernels::cuda::ExpertGemmPath;
use std::time::Instant;

/// What every MoE layer of a step shares: `'h` what outlives the layer's CPU half (model, pool,
/// hand-off), `'s` what the layer only borrows.
pub(super) struct MoeStep<'h, 's> {
    /// Holds the DRAM experts and the config.
    pub host: &'h Model,
    pub cpu_pool: Option<&'h moe_kernels::cpu::WorkerPool>,
    pub hand: &'h Handoff,
    /// Rows of the step.
    pub n: usize,
    /// The expert stream of a long prompt (every DRAM expert) or of a split step (those the split
    /// gives the GPU).
    pub stream: Option<&'s mut ExpertStream>,
    /// Split steps (`split`): the measured rates of both sides.
    pub split: Option<&'s mut SplitBalance>,
    /// Decode steps with the decode split on (`decode_split`): the expert stream whose side stream,
    /// first staging slot and dense buffer take each layer's GPU share.
    pub decode: Option<&'s mut ExpertStream>,
    /// Set by a split layer: bytes of the routed DRAM experts it left to the CPU.
    pub split_cpu_bytes: usize,
    pub times: &'s mut StepTimes,
}

/// A split layer's homes (its GPU share re-homed to the stream) and the start of its GPU side.
struct SplitLayer {
    homes: Vec<ExpertHome>,
    start: CudaEvent,
    gpu_bytes: usize,
}

/// The step buffers an MoE layer reads and writes.
pub(super) struct MoeLayerBufs<'a> {
    /// Residual stream, which the experts' sum is added into.
    pub x: &'a mut CudaSlice<f32>,
    /// The FFN-normalised rows (bf16 GEMM input, f32 for the shared-expert gate).
    pub hb: &'a CudaSlice<bf16>,
    pub hf: &'a CudaSlice<f32>,
    pub mlp: &'a mut MlpBufs,
    pub experts: &'a mut ExpertBufs,
}

impl<'a> MoeLayerBufs<'a> {
    /// An MoE layer's view of the step's activation buffers.
    pub fn of(acts: &'a mut super::buffers::ActBufs) -> Self {
        MoeLayerBufs {
            x: &mut acts.x,
            hb: &acts.hb,
            hf: &acts.hf,
            mlp: &mut acts.mlp,
            experts: &mut acts.experts,
        }
    }
}

impl GpuModel {
    /// Layer `li`'s experts, `homes` saying where each runs in this step. Returns the layer's CPU
    /// half when it has one (DRAM experts routed, or experts the previous layer deferred): the GPU's
    /// add of its sum is already enqueued and waits for it. `defer`: routes per token whose CPU
    /// experts may be deferred to the next layer (0: exact). `prelaunched`: the layer's GPU half
    /// ([`GpuModel::moe_gpu_half_before_routing`]) was enqueued before its routing landed (every
    /// expert of the layer in DRAM); then the CPU half is always returned, since the GPU waits for it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_layer<'h>(
        &self,
        li: usize,
        moe: &GpuMoe,
        homes: &[ExpertHome],
        ctx: &mut MoeStep<'h, '_>,
        b: MoeLayerBufs<'_>,
        defer: usize,
        prelaunched: bool,
        on_routing: &mut impl FnMut(usize, &[u32]),
    ) -> anyhow::Result<Option<CpuHalf<'h>>> {
        let (host, hand) = (ctx.host, ctx.hand);
        let cfg = &host.config;
        let mc = cfg.moe.as_ref().context("MoE layer without MoE config")?;
        let Ffn::Moe(host_block) = &host.layers[li].ffn else {
            anyhow::bail!("layer {li}: host and GPU layer kinds differ");
        };
        let (n, k, hd) = (ctx.n, mc.top_k, cfg.hidden_size);
        // The layer's one wait: routing (and rows, for the CPU) are in mapped host memory after it.
        // With early routing the wait starts with the CPU pool reading the chosen DRAM experts.
        let t0 = Instant::now();
        if homes.contains(&ExpertHome::Cpu) {
            let pool = ctx.cpu_pool;
            if let Some(b) = self.prefetch_chosen_experts(host_block, hand, n * k, pool) {
                ctx.times.early_routed_layers += 1;
                ctx.times.prefetched_bytes += b;
            }
        }
        hand.wait_routing(&self.dev)?;
        ctx.times.gpu_wait_s += t0.elapsed().as_secs_f64();
        hand.profile_routing(t0, &mut ctx.times.handoff);
        let mut clock = Instant::now();
        let (mut ids, weights) = hand.routing(n * k);
        self.override_routing(li, mc.num_experts, &mut ids);
        on_routing(li, &ids);
        ctx.times.host.routing_read_s += super::host_profile::lap(&mut clock);
        let split = self.split_layer(li, homes, &ids, ctx)?;
        let shared = match split {
            None => self.decode_share(li, homes, (&ids, &weights), ctx, defer)?,
            Some(_) => None,
        };
        let all_dram = homes.iter().all(|h| *h == ExpertHome::Cpu);
        if prelaunched && all_dram && split.is_none() && self.switches.direct_half() {
            let routing = match &shared {
                Some(gpu) => super::decode_split::without(&ids, &weights, gpu),
                None => (ids, weights),
            };
            return Ok(Some(self.all_dram_half(host_block, ctx, routing, defer)));
        }
        // a mixed layer whose resident experts the device computed from the routing: the same,
        // with the routes of those experts taken out
        let device_rest = homes
            .iter()
            .all(|h| matches!(h, ExpertHome::Cpu | ExpertHome::DeviceRouted));
        let exact = split.is_none() && shared.is_none() && ctx.stream.is_none() && defer == 0;
        if prelaunched && device_rest && exact && self.switches.direct_half() {
            let routing = (ids, weights);
            return Ok(Some(
                self.device_routed_half(host_block, ctx, homes, routing),
            ));
        }
        let shared_homes: Vec<ExpertHome>;
        let homes = match (&split, &shared) {
            (Some(s), _) => &s.homes[..],
            (None, Some(gpu)) => {
                shared_homes = super::decode_split::homes_with_share(homes, gpu);
                &shared_homes[..]
            }
            (None, None) => homes,
        };
        let plan = {
            let es = ctx.stream.as_deref();
            let chunks: Vec<(usize, &[u32])> = es.map_or(Vec::new(), |es| {
                es.layer_chunks(li)
                    .into_iter()
                    .map(|c| (c, &es.chunk(c).ids[..]))
                    .collect()
            });
            MoeDispatchPlan::new(&ids, &weights, k, homes, &chunks)
        };
        ctx.times.expert_hits += plan.expert_hits;
        ctx.times.gpu_expert_hits += plan.gpu_expert_hits;
        if let (Some(r), Some(set)) = (&plan.cpu, &host_block.cpu_set) {
            let read = super::dispatch::distinct_experts(&r.ids) as u64;
            ctx.times.dram_experts_read += read;
            ctx.times.dram_expert_bytes += read * set.packed_geometry().expert_bytes as u64;
        }
        let act = GatedAct::of(cfg);
        anyhow::ensure!(
            !(prelaunched && plan.any_gpu_work()),
            "layer {li}: GPU experts routed in a layer whose GPU half was enqueued before its routing"
        );
        if let (Some(sh), false) = (&moe.shared, prelaunched) {
            self.shared_expert(
                sh,
                moe.shared_gate.as_ref(),
                act,
                (n, hd),
                b.hb,
                b.hf,
                b.x,
                b.mlp,
            )?;
        }
        // The resident experts' weights as this step sees them (moves land between steps).
        let table = moe.experts.read();
        let shape = (n, hd, mc.expert_intermediate);
        let path = self.mixed_layer_path(homes);
        let io = (b.hb, path);
        self.run_gpu_experts(&plan, &table, host_block, ctx, shape, io, b.experts)?;
        self.combine_gpu(&plan, (n, hd), b.experts, b.x)?;
        if let (Some(s), Some(balance)) = (split, ctx.split.as_deref_mut()) {
            let end = SplitBalance::event(&self.dev.stream)?;
            balance.pend_gpu(GpuSpan {
                start: s.start,
                end,
                bytes: s.gpu_bytes,
            });
        }
        if plan.cpu.is_none() && !hand.has_deferred() && !prelaunched {
            ctx.times.host.plan_s += clock.elapsed().as_secs_f64();
            return Ok(None);
        }
        let (now, later) = match plan.cpu {
            Some(r) if defer > 0 => split_deferred(&r, &weights, defer),
            r => (r, None),
        };
        let half = CpuHalf {
            block: host_block,
            pool: ctx.cpu_pool,
            act,
            now,
            later,
            n,
            hd,
            hand,
            raised: false,
        };
        // the GPU adds the sum once the half raises its flag
        if !prelaunched {
            self.dev.handoff_wait_add(b.x, n * hd, &hand.port)?;
        }
        ctx.times.host.plan_s += clock.elapsed().as_secs_f64();
        Ok(Some(half))
    }

    /// The CPU half of a prelaunched layer whose experts all live in DRAM (its GPU half is enqueued
    /// and waits for it): every route goes to the CPU, so the routing as it landed is the half's,
    /// without a dispatch plan between the routing and the CPU experts (`direct_half`; the plan
    /// would give the same routing). `defer` as in [`GpuModel::moe_layer`].
    fn all_dram_half<'h>(
        &self,
        block: &'h MoeBlock,
        ctx: &mut MoeStep<'h, '_>,
        (ids, weights): (Vec<u32>, Vec<f32>),
        defer: usize,
    ) -> CpuHalf<'h> {
        let cfg = &ctx.host.config;
        let top_k = cfg.moe.as_ref().map_or(1, |mc| mc.top_k);
        ctx.times.expert_hits += ids.len() as u64;
        if let Some(set) = &block.cpu_set {
            let read = super::dispatch::distinct_experts(&ids) as u64;
            ctx.times.dram_experts_read += read;
            ctx.times.dram_expert_bytes += read * set.packed_geometry().expert_bytes as u64;
        }
        let all = Routing {
            ids,
            weights,
            top_k,
        };
        let (now, later) = match defer {
            0 => (Some(all), None),
            d => split_deferred(&all, &all.weights, d),
        };
        CpuHalf {
            block,
            pool: ctx.cpu_pool,
            act: GatedAct::of(cfg),
            now,
            later,
            n: ctx.n,
            hd: cfg.hidden_size,
            hand: ctx.hand,
            raised: false,
        }
    }

    /// The CPU half of a prelaunched device-routed layer (`routed`: its resident experts were computed
    /// from the routing on the device, the GPU waits for the DRAM experts' sum): the routing as it
    /// landed with every route to a non-DRAM expert taken out (id `NOT_HERE`, weight 0), without a
    /// dispatch plan between the routing and the CPU experts (`direct_half`; the plan gives the same
    /// routing: `routed`'s test). Its hits are counted as the plan counts them.
    fn device_routed_half<'h>(
        &self,
        block: &'h MoeBlock,
        ctx: &mut MoeStep<'h, '_>,
        homes: &[ExpertHome],
        (mut ids, mut weights): (Vec<u32>, Vec<f32>),
    ) -> CpuHalf<'h> {
        let cfg = &ctx.host.config;
        let top_k = cfg.moe.as_ref().map_or(1, |mc| mc.top_k);
        ctx.times.expert_hits += ids.len() as u64;
        let elsewhere = keep_dram_routes(homes, &mut ids, &mut weights);
        ctx.times.gpu_expert_hits += elsewhere as u64;
        let on_cpu = ids.len() - elsewhere;
        if let (true, Some(set)) = (on_cpu > 0, &block.cpu_set) {
            let read = super::dispatch::distinct_experts(&ids) as u64;
            ctx.times.dram_experts_read += read;
            ctx.times.dram_expert_bytes += read * set.packed_geometry().expert_bytes as u64;
        }
        let now = (on_cpu > 0).then_some(Routing {
            ids,
            weights,
            top_k,
        });
        CpuHalf {
            block,
            pool: ctx.cpu_pool,
            act: GatedAct::of(cfg),
            now,
            later: None,
            n: ctx.n,
            hd: cfg.hidden_size,
            hand: ctx.hand,
            raised: false,
        }
    }

    /// The GPU half of a layer whose experts all live in DRAM, which does not depend on its routing:
    /// the shared expert and the wait for the CPU experts' sum with its add. Enqueued before the
    /// routing lands (with the next layer's segment after it), so that once it lands the host goes
    /// straight to the CPU experts instead of launching first. `shared_done`: the layer's segment
    /// already ran the shared expert (device-routed layers, `routed`).
    pub(super) fn moe_gpu_half_before_routing(
        &self,
        moe: &GpuMoe,
        act: GatedAct,
        (n, hd): (usize, usize),
        b: MoeLayerBufs<'_>,
        (hand, shared_done): (&Handoff, bool),
    ) -> anyhow::Result<()> {
        if let (Some(sh), false) = (&moe.shared, shared_done) {
            let gate = moe.shared_gate.as_ref();
            self.shared_expert(sh, gate, act, (n, hd), b.hb, b.hf, b.x, b.mlp)?;
        }
        self.dev.handoff_wait_add(b.x, n * hd, &hand.port)?;
        Ok(())
    }

    /// A split step's layer (`split`): once its routing is known, the share of its routed DRAM experts
    /// the measured rates give the GPU (the most-loaded) is issued to the expert stream and re-homed
    /// there; the rest stay on the CPU. `None` outside split steps or when the GPU takes none.
    fn split_layer(
        &self,
        li: usize,
        homes: &[ExpertHome],
        ids: &[u32],
        ctx: &mut MoeStep<'_, '_>,
    ) -> anyhow::Result<Option<SplitLayer>> {
        let (Some(balance), Some(es)) = (ctx.split.as_deref_mut(), ctx.stream.as_deref_mut())
        else {
            return Ok(None);
        };
        if !super::stream::gpu_can_take_dram_experts(ctx.host, li) {
            return Ok(None);
        }
        balance.collect_gpu()?;
        let kept = self.prefill_on_cpu.get(li).map_or(&[][..], Vec::as_slice);
        let movable =
            |e: usize| homes[e] == ExpertHome::Cpu && !kept.get(e).copied().unwrap_or(false);
        let routed = super::split::routed_rows(ids, homes.len(), movable);
        let gpu = super::split::gpu_experts(&routed, balance.gpu_share());
        let each = es.expert_bytes();
        ctx.split_cpu_bytes = (routed.len() - gpu.len()) * each;
        ctx.times.split_gpu_experts += gpu.len() as u64;
        ctx.times.split_cpu_experts += (routed.len() - gpu.len()) as u64;
        if gpu.is_empty() {
            return Ok(None);
        }
        let start = es.stream_layer(&self.dev, ctx.host, li, &gpu)?;
        let mut homes = homes.to_vec();
        for &e in &gpu {
            homes[e as usize] = ExpertHome::Streamed;
        }
        Ok(Some(SplitLayer {
            homes,
            start,
            gpu_bytes: gpu.len() * each,
        }))
    }

    /// Benchmarks' synthetic routing: rewrites the layer's routed ids (clamped to the layer's experts).
    fn override_routing(&self, li: usize, experts: usize, ids: &mut [u32]) {
        let mut f = self
            .routing_override
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(f) = f.as_mut() {
            f(li, ids);
            // out-of-range ids from an override would index past the tables
            ids.iter_mut()
                .for_each(|id| *id = (*id).min(experts as u32 - 1));
        }
    }

    /// The always-on shared expert, added into `x` (through its sigmoid gate when it has one).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn shared_expert(
        &self,
        sh: &GpuMlp,
        gate: Option<&CudaSlice<f32>>,
        act: GatedAct,
        (n, hd): (usize, usize),
        hb: &CudaSlice<bf16>,
        hf: &CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
        mlp: &mut MlpBufs,
    ) -> anyhow::Result<()> {
        let MlpBufs {
            gate_up,
            act: a,
            out,
        } = mlp;
        match gate {
            None => self.mlp(sh, act, hb, x, n, true, (gate_up, a)),
            Some(g) => {
                self.mlp(sh, act, hb, out, n, false, (gate_up, a))?;
                self.dev.sigmoid_gate_rows(out, hf, g, (n, hd))?;
                self.dev.add_inplace(x, &*out, n * hd)?;
                Ok(())
            }
        }
    }

    /// The plan's GPU experts: their rows gathered once, then phase by phase (resident and uploaded
    /// experts, then each streamed chunk as it is unpacked) gate_up GEMMs, activation, down GEMMs
    /// into the expert output rows.
    fn run_gpu_experts(
        &self,
        plan: &MoeDispatchPlan,
        table: &[Option<GpuMlp>],
        host_block: &MoeBlock,
        ctx: &mut MoeStep<'_, '_>,
        (_, hd, inter): (usize, usize, usize),
        (hb, path): (&CudaSlice<bf16>, Option<ExpertGemmPath>),
        bufs: &mut ExpertBufs,
    ) -> anyhow::Result<()> {
        if !plan.any_gpu_work() {
            return Ok(());
        }
        let (dev, s) = (&self.dev, &self.dev.stream);
        let rows = plan.gpu_rows();
        let mut uploaded = Vec::with_capacity(plan.uploads.len());
        if !plan.uploads.is_empty() {
            let t = Instant::now();
            for &e in &plan.uploads {
                uploaded.push((e, super::upload_dram_expert(dev, host_block, e)?));
            }
            ctx.times.transfer_s += t.elapsed().as_secs_f64();
        }
        if rows > 0 {
            s.memcpy_htod(&plan.row_token, &mut bufs.row_token.slice_mut(..rows))?;
            s.memcpy_htod(&plan.row_weight, &mut bufs.row_weight.slice_mut(..rows))?;
            dev.gather_rows(hb, &bufs.row_token, (rows, hd), &mut bufs.x)?;
        }
        let mut pb = PhaseBuffers {
            xe: &bufs.x,
            gu: &mut bufs.gate_up,
            act: &mut bufs.act,
            ye: &mut bufs.y,
            table: &mut bufs.gemm_table,
            hd,
            inter,
            activation: GatedAct::of(&ctx.host.config),
            path,
        };
        for phase in &plan.phases {
            let groups = plan.phase_groups(phase);
            let Some(c) = phase.chunk else {
                let mut ws: Vec<(CudaView<'_, bf16>, CudaView<'_, bf16>)> =
                    Vec::with_capacity(groups.len());
                for g in groups {
                    let m = match &table[g.expert] {
                        Some(m) => m,
                        None => uploaded
                            .iter()
                            .find(|(e, _)| *e == g.expert)
                            .map(|(_, m)| m)
                            .context("uploaded expert missing")?,
                    };
                    ws.push((m.gate_up.bf16()?.slice(..), m.down.bf16()?.slice(..)));
                }
                Self::expert_phase(dev, groups, &ws, &mut pb)?;
                continue;
            };
            let es = ctx
                .stream
                .as_deref_mut()
                .context("streamed phase without a stream")?;
            let t = Instant::now();
            es.take(dev, ctx.host, c)?;
            let (each, split) = (es.geometry.dense_elems(), 2 * inter * hd);
            let mut ws = Vec::with_capacity(groups.len());
            for g in groups {
                let j = es
                    .chunk(c)
                    .ids
                    .iter()
                    .position(|&x| x as usize == g.expert)
                    .context("expert not in its chunk")?;
                ws.push((
                    es.dense.slice(j * each..j * each + split),
                    es.dense.slice(j * each + split..(j + 1) * each),
                ));
            }
            Self::expert_phase(dev, groups, &ws, &mut pb)?;
            ctx.times.transfer_s += t.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// The GPU experts' rows into `x`: token t gets the weighted sum of its rows, in the plan's fixed
    /// order (deterministic, no atomics).
    fn combine_gpu(
        &self,
        plan: &MoeDispatchPlan,
        (n, hd): (usize, usize),
        bufs: &mut ExpertBufs,
        x: &mut CudaSlice<f32>,
    ) -> anyhow::Result<()> {
        let rows = plan.gpu_rows();
        if rows == 0 {
            return Ok(());
        }
        let s = &self.dev.stream;
        s.memcpy_htod(
            &plan.token_offsets,
            &mut bufs.token_offsets.slice_mut(..n + 1),
        )?;
        s.memcpy_htod(&plan.token_rows, &mut bufs.token_rows.slice_mut(..rows))?;
        let ExpertBufs {
            y,
            token_offsets,
            token_rows,
            row_weight,
            ..
        } = bufs;
        self.dev.scatter_add_weighted(
            &*y,
            &*token_offsets,
            &*token_rows,
            &*row_weight,
            (n, rows, hd),
            x,
        )?;
        Ok(())
    }
}

/// Leaves in `ids` / `weights` only the routes to experts that live in DRAM (`ExpertHome::Cpu`): the
/// others become `NOT_HERE` with weight 0, as in [`MoeDispatchPlan::new`]'s CPU routing. Returns how
/// many were taken out.
fn keep_dram_routes(homes: &[ExpertHome], ids: &mut [u32], weights: &mut [f32]) -> usize {
    let mut elsewhere = 0;
    for (id, w) in ids.iter_mut().zip(weights.iter_mut()) {
        if homes.get(*id as usize) != Some(&ExpertHome::Cpu) {
            (*id, *w) = (crate::engine::moe::NOT_HERE, 0.0);
            elsewhere += 1;
        }
    }
    elsewhere
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The direct CPU half of a device-routed layer hands the CPU what the dispatch plan would.
    #[test]
    fn dram_routes_are_the_plans_cpu_routing() {
        use ExpertHome::{Cpu, DeviceRouted};
        let homes = [DeviceRouted, Cpu, DeviceRouted, Cpu, Cpu, DeviceRouted];
        for (ids, w) in [
            (vec![0u32, 1, 2, 3], vec![0.1f32, 0.2, 0.3, 0.4]),
            (
                vec![1, 3, 4, 5, 0, 2],
                vec![0.5, 0.25, 0.125, 0.1, 0.2, 0.3],
            ),
            (vec![0, 2, 5, 2], vec![1.0, 2.0, 3.0, 4.0]),
        ] {
            let plan = MoeDispatchPlan::new(&ids, &w, 2, &homes, &[]);
            let (mut got_ids, mut got_w) = (ids.clone(), w.clone());
            let out = keep_dram_routes(&homes, &mut got_ids, &mut got_w);
            assert_eq!(out as u64, plan.gpu_expert_hits, "{ids:?}");
            match plan.cpu {
                Some(r) => assert_eq!((r.ids, r.weights), (got_ids, got_w)),
                None => assert_eq!(out, ids.len()),
            }
        }
    }
}
