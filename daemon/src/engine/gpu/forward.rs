//! One engine step on the GPU (see the module docs of `gpu` for the CPU‖GPU split of MoE layers):
//! the host index of the step's rows, the batch-size class's buffers (`buffers`), the embedding rows,
//! then per layer its pre-expert segment (norm, attention, norm, router and the routing published to
//! the host; eager or replayed from a CUDA graph) and its FFN (a dense MLP, or the MoE phases of
//! `moe_layer`), and the lm_head on each sequence's last row.
//!
//! Pipelined steps (decode, `GpuModel::pipelined`) enqueue layer l + 1's segment before the CPU
//! experts of layer l run: the GPU waits for their sum on a flag and starts the next layer the moment
//! it lands, with no host launch between. For a layer whose experts all live in DRAM that GPU half
//! (shared expert, wait-and-add) and the next segment go even before the host waits for the layer's
//! routing, so the CPU experts start the moment it lands.
//!
//! In small steps a layer with GPU-resident experts computes them (and its shared expert) at the end
//! of its segment from the routing on the device (`routed`, [`LayerRoute`]): a layer whose experts
//! are all resident then needs no host at all, and a mixed layer hands the host only its DRAM experts.
//! A graph step whose MoE layers are all like that replays its whole layer stack as one CUDA graph
//! (`layers_on_device`, `graphs`).
use super::attention::{SeqRows, StepIndex};
use super::buffers::{ActBufs, HeadBufs, IndexBufs, StepBuffers, StepClass};
use super::dispatch::{expert_homes, ExpertHome};
use super::graphs::{GraphSet, SegmentKernels, SegmentTail, WalkMark};
use super::handoff::{CpuHalf, Handoff};
use super::host_profile;
use super::moe_layer::{MoeLayerBufs, MoeStep};
use super::routed::{self, DeviceRouted, LayerRoute, RoutedLayer};
use super::{EmbedTable, GpuAttention, GpuFfn, GpuLinear, GpuMlp, GpuModel};
use crate::engine::kv::{slot, BlockId};
use crate::engine::moe::GatedAct;
use crate::engine::parallel::probe::ProbePoint;
use crate::engine::StepTimes;
use crate::model::config::RouterInput;
use crate::model::Model;
use anyhow::Context;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use moe_kernels::cuda::ops::NormRows;
use std::time::Instant;

/// One sequence's chunk in a GPU step: its block tables (one per group of layers,
/// `engine::kv::layout`) cover `pos0 + tokens.len()` positions (the driver reserved them). `state`:
/// the sequence's recurrent-state buffer slots (models with linear-attention layers; see
/// `gpu::hybrid`), one per GPU of a tensor-parallel group, rank 0 first: a GPU's step uses the first
/// (the group hands each GPU its own).
pub struct GpuSeqInput<'a> {
    pub tables: Vec<&'a [BlockId]>,
    pub pos0: usize,
    pub tokens: &'a [u32],
    pub state: Option<&'a mut [Option<CudaSlice<f32>>]>,
}

/// The host side of a step's index: each row's token, position, sequence and cache slot (per group of
/// layers), each sequence's rows, and the widest block table.
pub(super) struct HostIndex {
    pub ids: Vec<i32>,
    pub pos: Vec<i32>,
    pub seq_of: Vec<i32>,
    pub slots: Vec<Vec<i32>>,
    /// Row of each sequence's last position (its logits are returned).
    pub last_rows: Vec<i32>,
    pub seqs: Vec<SeqRows>,
    pub max_blocks: usize,
}

impl HostIndex {
    pub fn new(batch: &[GpuSeqInput<'_>]) -> Self {
        let mut h = HostIndex {
            ids: Vec::new(),
            pos: Vec::new(),
            seq_of: Vec::new(),
            slots: vec![Vec::new(); batch.first().map_or(1, |b| b.tables.len())],
            last_rows: Vec::with_capacity(batch.len()),
            seqs: Vec::with_capacity(batch.len()),
            max_blocks: batch
                .iter()
                .map(|b| b.tables[0].len())
                .max()
                .unwrap_or(1)
                .max(1),
        };
        for (si, b) in batch.iter().enumerate() {
            h.seqs.push(SeqRows {
                seq: si,
                row0: h.ids.len(),
                len: b.tokens.len(),
                pos0: b.pos0,
            });
            for (i, &t) in b.tokens.iter().enumerate() {
                let p = b.pos0 + i;
                h.ids.push(t as i32);
                h.pos.push(p as i32);
                h.seq_of.push(si as i32);
                for (g, table) in b.tables.iter().enumerate() {
                    h.slots[g].push(slot(table, p) as i32);
                }
            }
            h.last_rows.push((h.ids.len() - 1) as i32);
        }
        h
    }

    /// Group `group`'s block tables as `[sequences, stride]` rows (zero past each table's end; entries
    /// that left a sliding window hold stale ids of valid blocks, which the kernels skip).
    pub fn tables(batch: &[GpuSeqInput<'_>], stride: usize, group: usize) -> Vec<i32> {
        let mut tables = vec![0i32; batch.len() * stride];
        for (si, b) in batch.iter().enumerate() {
            for (j, &blk) in b.tables[group].iter().enumerate() {
                tables[si * stride + j] = blk as i32;
            }
        }
        tables
    }
}

/// What the fused router reads: rows normalised already, or the residual rows it normalises itself
/// with the norm's outputs (bf16, f32 rows) it writes for the ops after it.
enum RouterRows<'a> {
    Normed(&'a CudaSlice<f32>),
    Norm(
        NormRows<'a>,
        (&'a mut CudaSlice<bf16>, &'a mut CudaSlice<f32>),
    ),
}

/// What a layer's pre-expert segment reads and writes (persistent buffers in graph steps).
struct Segment<'a, 'b> {
    x: &'a mut CudaSlice<f32>,
    hb: &'a mut CudaSlice<bf16>,
    hf: &'a mut CudaSlice<f32>,
    logits: &'a mut CudaSlice<f32>,
    eids: &'a mut CudaSlice<i32>,
    w: &'a mut CudaSlice<f32>,
    attn: &'a mut super::buffers::AttnBufs,
    hand: &'a Handoff,
    /// Also publish the normalised rows to the host (the layer has DRAM experts and is not streamed).
    want_x: bool,
    /// Streams, recurrent states and indexer selection of hybrid models.
    hybrid: Option<&'a mut super::hybrid::HybridStep<'b>>,
    /// The segment ends with the shared and resident experts from the device routing (`routed`).
    routed: Option<RoutedLayer<'a>>,
}

impl Segment<'_, '_> {
    /// How the segment ends after the top-k (part of its graph's key).
    fn tail(&self) -> SegmentTail {
        match &self.routed {
            None => SegmentTail::Publish { rows: self.want_x },
            Some(r) if r.publish => SegmentTail::PublishThenExperts,
            Some(_) => SegmentTail::Experts,
        }
    }
}

impl<'a, 'b> Segment<'a, 'b> {
    /// A layer's segment over the step's activation buffers; `device`: the device-routed experts'
    /// state with the layer and its route (`routed`).
    fn of(
        acts: &'a mut ActBufs,
        hand: &'a Handoff,
        want_x: bool,
        hybrid: Option<&'a mut super::hybrid::HybridStep<'b>>,
        device: Option<(&'a mut DeviceRouted, usize, LayerRoute)>,
    ) -> Self {
        let ActBufs {
            x,
            hb,
            hf,
            logits,
            eids,
            w,
            attn,
            mlp,
            ..
        } = acts;
        Segment {
            x,
            hb,
            hf,
            logits,
            eids,
            w,
            attn,
            hand,
            want_x,
            hybrid,
            routed: device.and_then(|(d, li, route)| d.layer(li, route, mlp)),
        }
    }
}

impl GpuModel {
    /// y[n, out] = x · Wᵀ (+ bias), or += when `accumulate`.
    pub(super) fn linear(
        &self,
        l: &GpuLinear,
        x: &CudaSlice<bf16>,
        y: &mut CudaSlice<f32>,
        n: usize,
        accumulate: bool,
    ) -> anyhow::Result<()> {
        let mut scratch = self
            .dequant_scratch
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        self.dev.dense_matmul(
            &l.w,
            x,
            y,
            (n, l.out_dim, l.in_dim),
            accumulate,
            scratch.as_mut(),
        )?;
        if let Some(b) = &l.bias {
            self.dev.add_bias(y, b, (n, l.out_dim))?;
        }
        Ok(())
    }

    pub(super) fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> anyhow::Result<CudaSlice<T>> {
        // SAFETY: every element a step reads was written earlier in the same step by a kernel, GEMM or
        // copy (the step buffers and the long-prefill scratch are used that way), so skipping the memset
        // is sound and saves a launch.
        Ok(unsafe { self.dev.stream.alloc::<T>(n.max(1)) }?)
    }

    /// down(act(gate_up(x))) for `n` rows, accumulated into `y` when `accumulate`; the intermediate
    /// rows go through the step's MLP buffers (`gate_up`, `act`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mlp(
        &self,
        m: &GpuMlp,
        act: GatedAct,
        x: &CudaSlice<bf16>,
        y: &mut CudaSlice<f32>,
        n: usize,
        accumulate: bool,
        (gate_up, a): (&mut CudaSlice<f32>, &mut CudaSlice<bf16>),
    ) -> anyhow::Result<()> {
        let inter = m.down.in_dim;
        self.linear(&m.gate_up, x, gate_up, n, false)?;
        self.gated_act(&*gate_up, a, inter, n, act)?;
        self.linear(&m.down, a, y, n, accumulate)
    }

    /// `out = f(gate) · up` to bf16 for `rows` rows of `gate_up` (`[rows, 2·inter]`, gate first), f
    /// the model's gate activation (SwiGLU, GELU-tanh, ReGLU), after the optional SwiGLU clamp.
    pub(super) fn gated_act(
        &self,
        gate_up: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<bf16>,
        inter: usize,
        rows: usize,
        act: GatedAct,
    ) -> anyhow::Result<()> {
        let activation = super::kinds::gate_activation(act.act);
        self.dev
            .gated_mul(gate_up, (rows, inter), activation, act.swiglu_limit, out)?;
        Ok(())
    }

    /// Layer `li` up to its experts, enqueued: attention norm, attention (adds into `x`), FFN norm
    /// (`hb`, `hf`), and for MoE layers the router, top-k and the routing (and, if `want_x`, `hf`)
    /// published into the mapped hand-off buffers. Nothing here waits or allocates for GQA layers,
    /// so it can be captured as a graph (and enqueued while the host still owes the previous layer's
    /// CPU experts: the stream waits for them on a flag).
    fn pre_experts(
        &self,
        host: &Model,
        li: usize,
        step: &super::attention::StepIndex,
        pool: &mut super::kv::GpuKvPool,
        g: &mut Segment<'_, '_>,
    ) -> anyhow::Result<()> {
        self.attention_block(host, li, step, pool, g)?;
        self.tp_all_reduce(g.x, step.n * host.config.hidden_size)?;
        self.probe_read(
            li,
            ProbePoint::AttentionReduced,
            &*g.x,
            step.n * host.config.hidden_size,
        )?;
        self.ffn_head(host, li, step.n, g)
    }

    /// Whether layer `li`'s router reads the layer input (SmallThinker): it runs before attention.
    fn early_router(&self, host: &Model, li: usize) -> bool {
        matches!(
            (&self.layers[li].ffn, &host.config.moe),
            (GpuFfn::Moe(_), Some(mc)) if mc.router_input == RouterInput::LayerInput
        )
    }

    /// The first half of the pre-expert segment: the early router, the attention norm and the
    /// attention (its output, this GPU's partial sum in a tensor-parallel group, added into `x`).
    fn attention_block(
        &self,
        host: &Model,
        li: usize,
        step: &super::attention::StepIndex,
        pool: &mut super::kv::GpuKvPool,
        g: &mut Segment<'_, '_>,
    ) -> anyhow::Result<()> {
        let cfg = &host.config;
        let (dev, hd, n) = (&self.dev, cfg.hidden_size, step.n);
        let layer = &self.layers[li];
        // Routers that read the layer input (SmallThinker) run before attention changes `x`; with
        // early routing their top-k and routing hand-off go first too (`early_routing`).
        if let (GpuFfn::Moe(moe), Some(mc), true) =
            (&layer.ffn, &cfg.moe, self.early_router(host, li))
        {
            // (the fused router computes the top-k with the logits)
            if self.fused_router(n, hd) {
                let routing = (&mut *g.eids, &mut *g.w);
                let input = RouterRows::Normed(&*g.x);
                self.router_gemv_topk(input, (moe, mc), (n, hd), &mut *g.logits, routing, None)?;
            } else {
                dev.gemm_f32(&*g.x, &moe.router, g.logits, n, mc.num_experts, hd)?;
            }
            if self.early_routing() {
                if !self.fused_router(n, hd) {
                    self.router_topk(moe, mc, n, g)?;
                }
                let nk = n * mc.top_k;
                dev.handoff_publish_early_routing(&*g.eids, &*g.w, nk, &g.hand.port)?;
            }
        }
        use super::hybrid::Block;
        if let Some(hy) = g.hybrid.as_deref_mut() {
            self.hyper_collapse(hy, li, Block::Attention, hd, cfg.rms_norm_eps, g.x)?;
        }
        // The fused segment's q/k/v launch normalises its input itself (`gemv_bf16_norm`).
        let fold_norm = match &layer.attn {
            GpuAttention::Gqa(w) => g.hybrid.is_none() && self.attention_norm_folds(w, n),
            _ => false,
        };
        // (in a tensor-parallel group `x` stays whole through the block: ranks other than 0 write their
        // o projection's partial sum over it, see `tp_attention_accumulates`)
        if !fold_norm {
            dev.rms_norm(g.x, &layer.attn_norm, cfg.rms_norm_eps, (n, hd), g.hb, None)?;
        }
        match &layer.attn {
            GpuAttention::Gqa(w) => {
                let input = (&mut *g.hb, fold_norm.then_some(&layer.attn_norm));
                self.gqa_attention(w, host, step, input, pool, li, g.x, g.attn)?
            }
            GpuAttention::Mla(w) => self.mla_attention(
                w,
                host,
                step,
                g.hb,
                pool,
                li,
                g.x,
                g.attn,
                g.hybrid.as_deref_mut(),
            )?,
            GpuAttention::Linear(la) => {
                let hy = g
                    .hybrid
                    .as_deref_mut()
                    .context("linear attention without hybrid state")?;
                self.linear_attention(la, host, li, g.hb, g.x, hy)?
            }
        }
        self.probe_attention(cfg, li, n, g.attn)?;
        self.probe_read(li, ProbePoint::AttentionPartial, &*g.x, n * hd)
    }

    /// The second half, once `x` holds the attention block's whole output: the FFN norm, and for
    /// MoE layers the router, top-k and the hand-off's publication.
    fn ffn_head(
        &self,
        host: &Model,
        li: usize,
        n: usize,
        g: &mut Segment<'_, '_>,
    ) -> anyhow::Result<()> {
        let cfg = &host.config;
        let (dev, hd) = (&self.dev, cfg.hidden_size);
        let layer = &self.layers[li];
        let early_router = self.early_router(host, li);
        use super::hybrid::Block;
        if let Some(hy) = g.hybrid.as_deref_mut() {
            self.hyper_expand(hy, hd, g.x)?;
            self.hyper_collapse(hy, li, Block::Ffn, hd, cfg.rms_norm_eps, g.x)?;
        }
        let mc = cfg.moe.as_ref();
        // The fused router normalises its input itself (`router_gemv_topk_norm`), on one GPU.
        let fold_norm = match (&layer.ffn, mc) {
            (GpuFfn::Moe(_), Some(mc)) => {
                !early_router && g.hybrid.is_none() && self.ffn_norm_folds(n, hd, mc.num_experts)
            }
            _ => false,
        };
        if !fold_norm {
            dev.rms_norm(
                g.x,
                &layer.ffn_norm,
                cfg.rms_norm_eps,
                (n, hd),
                g.hb,
                Some(&mut *g.hf),
            )?;
            self.tp_keep_residual_on_rank0(g.x, n * hd)?;
        }
        let GpuFfn::Moe(moe) = &layer.ffn else {
            return Ok(());
        };
        let mc = mc.context("MoE layer without MoE config")?;
        // The layer's one hand-off: routing (and activations, when DRAM experts may be hit) written
        // into mapped host memory, then the flag the host polls.
        let (nk, nx) = (n * mc.top_k, n * hd);
        if early_router && self.early_routing() {
            // the routing went before attention
            let rows = g.want_x.then_some((&*g.hf, nx));
            dev.handoff_publish_rows(rows, &g.hand.port)?;
            return Ok(());
        }
        // (the fused router publishes in its own launch: the rows it reads are the ones published)
        let publish = g.tail() != SegmentTail::Experts;
        let mut published = false;
        match (early_router, self.fused_router(n, hd)) {
            (false, true) => {
                let routing = (&mut *g.eids, &mut *g.w);
                let port = publish.then_some((&g.hand.port, g.want_x));
                let input = if fold_norm {
                    let norm = NormRows {
                        x: &*g.x,
                        w: &layer.ffn_norm,
                        eps: cfg.rms_norm_eps,
                    };
                    RouterRows::Norm(norm, (&mut *g.hb, &mut *g.hf))
                } else {
                    RouterRows::Normed(&*g.hf)
                };
                self.router_gemv_topk(input, (moe, mc), (n, hd), &mut *g.logits, routing, port)?;
                published = publish;
            }
            (false, false) => {
                dev.gemm_f32(&*g.hf, &moe.router, g.logits, n, mc.num_experts, hd)?;
                self.router_topk(moe, mc, n, g)?;
            }
            // the early router's logits are in (and with the fused router, its top-k too)
            (true, true) => {}
            (true, false) => self.router_topk(moe, mc, n, g)?,
        }
        if publish && !published {
            let rows = g.want_x.then_some((&*g.hf, nx));
            dev.handoff_publish(&*g.eids, &*g.w, nk, rows, &g.hand.port)?;
        }
        self.probe_read(li, ProbePoint::RouterLogits, &*g.logits, n * mc.num_experts)?;
        self.probe_read(li, ProbePoint::Routing, &*g.eids, nk)?;
        if let Some(r) = g.routed.as_mut() {
            let (io, routing) = ((&*g.hb, &*g.hf), (&*g.eids, &*g.w));
            self.experts_from_device_routing(host, moe, n, r, io, routing, g.x)?;
        }
        Ok(())
    }

    /// Layer `li + 1`'s segment weights fetched into L2 behind layer `li`'s enqueued segment, when the
    /// GPU then waits for `li`'s CPU experts (a pipelined step, an MoE layer not wholly on the device):
    /// the `l2-prefetch` switch (off by default), one GPU ([`GpuModel::prefetch_segment`]). Eager
    /// launches, outside the segment's graph, so the switch flips between steps.
    fn prefetch_after(
        &self,
        host: &Model,
        li: usize,
        (pipelined, route): (bool, LayerRoute),
    ) -> anyhow::Result<()> {
        let waits = pipelined
            && route != LayerRoute::Device
            && matches!(self.layers[li].ffn, GpuFfn::Moe(_));
        if waits && self.switches.l2_prefetch() && self.shard.is_none() {
            self.prefetch_segment(host, li + 1)?;
        }
        Ok(())
    }

    /// Whether the router of an `n`-row step over `hd` inputs runs as one launch with its top-k (the
    /// fused segment, at most `FUSED_SEGMENT_ROWS` rows).
    fn fused_router(&self, n: usize, hd: usize) -> bool {
        self.switches.fused_segment()
            && n <= moe_kernels::cuda::ops::FUSED_SEGMENT_ROWS
            && moe_kernels::cuda::GpuDevice::router_fused_takes(n, hd)
    }

    /// Whether the fused router of an `n`-row step over `hd` inputs and `experts` experts also
    /// computes the FFN norm (`router_gemv_topk_norm`): the `fold-norms` switch, one GPU (a
    /// tensor-parallel rank zeroes its residual between the norm and the router), shapes it takes.
    fn ffn_norm_folds(&self, n: usize, hd: usize, experts: usize) -> bool {
        self.switches.fold_norms()
            && self.shard.is_none()
            && self.fused_router(n, hd)
            && moe_kernels::cuda::GpuDevice::router_norm_takes(n, hd, experts)
    }

    /// The router's logits over its input (`[n, hd]` f32 rows, or the residual rows it normalises
    /// itself) and their top-k into `routing` (ids, weights), one launch ([`GpuModel::fused_router`]);
    /// with `publish` (a port, and whether the rows go too) the same launch publishes the routing and
    /// the (normalised) rows to the host.
    #[allow(clippy::type_complexity)]
    fn router_gemv_topk(
        &self,
        input: RouterRows<'_>,
        (moe, mc): (&super::GpuMoe, &crate::model::config::MoeConfig),
        (n, hd): (usize, usize),
        logits: &mut CudaSlice<f32>,
        routing: (&mut CudaSlice<i32>, &mut CudaSlice<f32>),
        publish: Option<(&moe_kernels::cuda::ops::HandoffPort, bool)>,
    ) -> anyhow::Result<()> {
        let kind = super::kinds::router_kind(mc);
        let router = moe_kernels::cuda::ops::FusedRouter {
            w: &moe.router,
            experts: mc.num_experts,
            k: mc.top_k,
            kind: &kind,
            bias: moe.correction_bias.as_ref(),
        };
        match input {
            RouterRows::Normed(x) => {
                self.dev
                    .router_gemv_topk(x, (n, hd), &router, logits, routing, publish)?
            }
            RouterRows::Norm(norm, out) => self.dev.router_gemv_topk_norm(
                &norm,
                out,
                (n, hd),
                &router,
                logits,
                routing,
                publish,
            )?,
        }
        Ok(())
    }

    /// The router's top-k over `g.logits` into `g.eids`, `g.w`.
    fn router_topk(
        &self,
        moe: &super::GpuMoe,
        mc: &crate::model::config::MoeConfig,
        n: usize,
        g: &mut Segment<'_, '_>,
    ) -> anyhow::Result<()> {
        self.dev.router_topk(
            &*g.logits,
            (n, mc.num_experts, mc.top_k),
            &super::kinds::router_kind(mc),
            moe.correction_bias.as_ref(),
            &mut *g.eids,
            &mut *g.w,
        )?;
        Ok(())
    }

    /// Runs one step; returns logits at the last position of each entry.
    /// `host` holds the DRAM experts (and the config); its GPU experts were released at upload.
    pub fn forward(
        &self,
        host: &Model,
        cpu_pool: Option<&moe_kernels::cpu::WorkerPool>,
        batch: &mut [GpuSeqInput<'_>],
        times: &mut StepTimes,
        mut on_routing: impl FnMut(usize, &[u32]),
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let started = Instant::now();
        let pool_before = cpu_pool.map(|p| p.region_stats());
        self.tp_check_group_step()?;
        let cfg = &host.config;
        let dev = &self.dev;
        let hd = cfg.hidden_size;
        let hi = HostIndex::new(batch);
        let n = hi.ids.len();
        // Everything that decides how this step runs (buffers, graphs, pipelining, device routing).
        let decode_rows = batch.iter().all(|b| b.tokens.len() == 1);
        let class = self.step_class(cfg, (n, batch.len()), decode_rows);
        let long_prompt = class.long_prompt;
        // Plain decode steps replay each layer's pre-expert segment from a CUDA graph (see `graphs`).
        let graph_step = class.graphs;
        let mut pool = self.kv.lock().unwrap_or_else(|e| e.into_inner());
        let mut sets = self.buffers.lock().unwrap_or_else(|e| e.into_inner());
        let shape = (n, batch.len(), hi.max_blocks);
        let bufs = self.step_buffers(&mut sets, cfg, class.buffers, shape, pool.total_blocks)?;
        self.upload_index(&hi, batch, &mut bufs.index)?;
        let StepBuffers {
            index,
            acts,
            hand,
            hybrid,
            ..
        } = bufs;
        let hand: &Handoff = hand;
        hand.begin_step(dev)?;
        // the head's rows now, while no GPU wait is pending (the head may be enqueued behind one)
        let seqs = hi.last_rows.len();
        dev.stream
            .memcpy_htod(&hi.last_rows, &mut acts.head.last_rows.slice_mut(..seqs))?;
        self.embed(host, &hi.ids, index, &mut acts.x)?;
        // Hybrid models (linear attention, hyper-connections, sparse attention): the step's streams,
        // recurrent states and indexer selection.
        let mut hybrid_step = match (&self.hybrid, hybrid.as_mut()) {
            (Some(h), Some(b)) => Some(self.hybrid_begin_step(h, batch, hd, &acts.x, b)?),
            _ => None,
        };
        let split_step = class.split;
        // Long prompts stream the packed DRAM experts (see `stream`); the first copies start now.
        // Split steps stream the experts each layer's routing gives the GPU (see `split`).
        let mut stream_guard = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        // Decode steps with the decode split on lend it to the layers instead (`decode_split`).
        let decode_split = class.pipelined
            && self.shard.is_none()
            && self.switches.decode_split() != super::switches::DecodeShare::Off;
        let (mut stream, mut decode_stream) = match stream_guard.as_mut() {
            Some(es) if long_prompt || split_step => (Some(es), None),
            Some(es) if decode_split => (None, Some(es)),
            _ => (None, None),
        };
        if let Some(es) = stream.as_deref_mut() {
            es.begin_step(dev, host, long_prompt)?;
        }
        let mut split_guard = self.split.lock().unwrap_or_else(|e| e.into_inner());
        let mut split = (split_step && stream.is_some()).then_some(&mut *split_guard);
        let mut graphs_guard = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        // (a graph bakes in its kernels: the step replays those of the segment kernels it runs)
        let sw = &self.switches;
        let kernels = SegmentKernels::of(sw.fused_segment(), sw.fold_norms(), sw.o_gemv());
        graphs_guard.select_kernels(kernels);
        // A tensor-parallel graph step whose segments are not all captured yet runs unpipelined
        // (`GraphSet::capture_pass`); one GPU captures them before its layers instead (below).
        let capture_pass = graph_step && self.shard.is_some() && graphs_guard.capture_pass(n);
        let class = StepClass {
            pipelined: class.pipelined && !capture_pass,
            ..class
        };
        let pipelined = class.pipelined;
        let mut graphs = graph_step.then_some(&mut *graphs_guard);
        // One view of the step per group of layers: its slots and block tables.
        let steps: Vec<StepIndex> = (0..index.slots.len())
            .map(|g| StepIndex {
                n,
                pos: &index.pos,
                seq: &index.seq,
                slots: &index.slots[g],
                tables: &index.tables[g],
                max_blocks: index.stride,
                seqs: &hi.seqs,
            })
            .collect();
        let act = GatedAct::of(cfg);
        // the switches as this step sees them (benchmarks flip them between steps)
        let (prelaunch_on, defer_routes) =
            (self.switches.prelaunch(), self.switches.defer_experts());
        // Layers whose resident experts the segment computes from the device routing (`routed`).
        let mut device_guard = self.routed.lock().unwrap_or_else(|e| e.into_inner());
        let route_clock = Instant::now();
        let routes = self.plan_routes(host, &mut device_guard, &class)?;
        times.host.route_plan_s += route_clock.elapsed().as_secs_f64();
        times.device_routed_layers +=
            routes.iter().filter(|r| **r != LayerRoute::Host).count() as u64;
        let mut device = device_guard.as_mut();
        // A graph step that never hands anything to the host: its whole layer stack is one graph.
        let mut first_layer = 0;
        let mut clock = started;
        times.host.setup_s += host_profile::lap(&mut clock);
        if let (Some(set), Some(d)) = (graphs.as_deref_mut(), device.as_deref_mut()) {
            if self.stays_on_device(&routes) {
                let mut layers = || {
                    let step = (&steps[..], &mut *pool);
                    self.layers_on_device(host, step, acts, hand, (&mut *d, &routes))
                };
                self.replay_whole_step(set, n, &mut layers)?;
                first_layer = self.layers.len();
            }
        }
        times.host.launch_s += host_profile::lap(&mut clock);
        // A pipelined step enqueues segments while the GPU waits for the host: its missing graphs are
        // captured now, while nothing waits (see `GraphSet::may_capture`).
        if let (Some(set), true, 0) = (graphs.as_deref_mut(), pipelined, first_layer) {
            let step = (&steps[..], &mut *pool);
            let walked = self.capture_segments(
                host,
                set,
                step,
                (acts, hand),
                device.as_deref_mut(),
                &routes,
            )?;
            times.host.walks += u64::from(walked);
        }
        times.host.capture_walk_s += host_profile::lap(&mut clock);
        // The previous MoE layer's CPU half, run once this layer's segment is enqueued.
        let mut owed: Option<CpuHalf<'_>> = None;
        // A last layer enqueued before its routing lands takes the step's head with it, so the GPU
        // goes from the last add to the lm_head without waiting for the host's launches.
        let early_head = self.switches.early_head() && stream.is_none() && hybrid_step.is_none();
        let direct_half = self.switches.direct_half();
        let mut head_enqueued = false;
        // Homes of layer li when the previous iteration already enqueued its segment (`prelaunch`).
        let mut enqueued: Option<Vec<ExpertHome>> = None;
        for (li, layer) in self.layers.iter().enumerate().skip(first_layer) {
            // Where this layer's experts run: decides whether the normalised rows go to the host.
            let homes = match enqueued.take() {
                Some(homes) => homes,
                None => {
                    let t = Instant::now();
                    let homes = self.layer_homes(host, li, long_prompt, stream.as_deref());
                    let want_x = homes.contains(&ExpertHome::Cpu);
                    let routed = device.as_deref_mut().map(|d| (d, li, routes[li]));
                    let mut seg = Segment::of(acts, hand, want_x, hybrid_step.as_mut(), routed);
                    let step = (&steps[self.kv_layout.group_of(li)], &mut *pool);
                    // the previous layer's CPU half (`owed`) has not raised its flag yet
                    let graphs = graphs.as_deref_mut().map(|g| (g, owed.is_some()));
                    self.run_pre_experts(host, li, step, &mut seg, graphs)?;
                    self.prefetch_after(host, li, (pipelined, routes[li]))?;
                    times.host.launch_s += t.elapsed().as_secs_f64();
                    homes
                }
            };
            if let Some(half) = owed.take() {
                half.run(times);
            }
            match &layer.ffn {
                GpuFfn::Dense(m) => {
                    let t = Instant::now();
                    let ActBufs { x, hb, mlp, .. } = &mut *acts;
                    self.mlp(m, act, hb, x, n, true, (&mut mlp.gate_up, &mut mlp.act))?;
                    times.host.launch_s += t.elapsed().as_secs_f64();
                }
                // the segment computed the whole layer from the device routing
                GpuFfn::Moe(_) if routes[li] == LayerRoute::Device => {}
                GpuFfn::Moe(moe) => {
                    // A layer whose experts all live in DRAM has a GPU half that does not depend on
                    // its routing: in pipelined steps it and the next layer's segment are enqueued
                    // now, while the GPU still runs this layer's attention, so the routing's landing
                    // is followed by the CPU experts at once (same GPU work, same order: exact). So
                    // has a layer whose resident experts its segment computed (`routed`).
                    let on_device = routes[li] == LayerRoute::DeviceAndCpu;
                    let prelaunch = pipelined
                        && prelaunch_on
                        && self.shard.is_none()
                        && !homes.is_empty()
                        && (on_device || homes.iter().all(|h| *h == ExpertHome::Cpu));
                    if prelaunch {
                        let t = Instant::now();
                        let bufs = MoeLayerBufs::of(acts);
                        let shared_done = (hand, on_device);
                        self.moe_gpu_half_before_routing(moe, act, (n, hd), bufs, shared_done)?;
                        if li + 1 < self.layers.len() {
                            let next = self.layer_homes(host, li + 1, long_prompt, None);
                            let want_x = next.contains(&ExpertHome::Cpu);
                            let routed = device.as_deref_mut().map(|d| (d, li + 1, routes[li + 1]));
                            let mut seg = Segment::of(acts, hand, want_x, None, routed);
                            let step = (&steps[self.kv_layout.group_of(li + 1)], &mut *pool);
                            // this layer's wait for its CPU experts was just enqueued
                            let g = graphs.as_deref_mut().map(|g| (g, true));
                            let r = self
                                .run_pre_experts(host, li + 1, step, &mut seg, g)
                                .and_then(|()| {
                                    self.prefetch_after(host, li + 1, (pipelined, routes[li + 1]))
                                });
                            if let Err(e) = r {
                                hand.port.raise_sum(); // the GPU must not wait for a host that gave up
                                return Err(e);
                            }
                            enqueued = Some(next);
                        } else if early_head {
                            let ActBufs { x, hb, head, .. } = &mut *acts;
                            if let Err(e) = self.enqueue_head(cfg, seqs, (n, hd), x, hb, head) {
                                hand.port.raise_sum(); // the GPU must not wait for a host that gave up
                                return Err(e);
                            }
                            head_enqueued = true;
                        }
                        times.host.launch_s += t.elapsed().as_secs_f64();
                    }
                    let mut ctx = MoeStep {
                        host,
                        cpu_pool,
                        hand,
                        n,
                        stream: stream.as_deref_mut(),
                        split: split.as_deref_mut(),
                        decode: decode_stream.as_deref_mut(),
                        split_cpu_bytes: 0,
                        times: &mut *times,
                    };
                    // deferred experts only in pipelined steps, and only into a next MoE layer
                    let next_moe = matches!(
                        self.layers.get(li + 1).map(|l| &l.ffn),
                        Some(GpuFfn::Moe(_))
                    );
                    let defer = if pipelined && next_moe {
                        defer_routes
                    } else {
                        0
                    };
                    let homes = routed::host_homes(routes[li], homes);
                    let r = self.moe_layer(
                        li,
                        moe,
                        &homes,
                        &mut ctx,
                        MoeLayerBufs::of(acts),
                        defer,
                        prelaunch,
                        &mut on_routing,
                    );
                    let split_cpu_bytes = ctx.split_cpu_bytes;
                    let half = match r {
                        Err(e) if prelaunch => {
                            hand.port.raise_sum(); // the GPU must not wait for a host that gave up
                            return Err(e);
                        }
                        r => r?,
                    };
                    match half {
                        // the next segment is enqueued already: nothing to launch before the half
                        Some(h) if pipelined && enqueued.is_some() && direct_half => h.run(times),
                        Some(h) if pipelined => owed = Some(h),
                        Some(h) => {
                            let t = Instant::now();
                            h.run(times);
                            if let Some(b) = split.as_deref_mut() {
                                b.observe_cpu(split_cpu_bytes, t.elapsed().as_secs_f64());
                            }
                        }
                        None => {}
                    }
                }
            }
            self.probe_read(li, ProbePoint::FfnPartial, &acts.x, n * hd)?;
            self.tp_all_reduce(&mut acts.x, n * hd)?;
            self.probe_read(li, ProbePoint::LayerOut, &acts.x, n * hd)?;
            if let Some(hy) = hybrid_step.as_mut() {
                self.hyper_expand(hy, hd, &acts.x)?;
            }
        }
        if let Some(half) = owed.take() {
            half.run(times);
        }
        let (tail, wait_before_tail) = (Instant::now(), times.gpu_wait_s);
        if let Some(set) = graphs.filter(|_| capture_pass) {
            set.ready_rows.insert(n);
        }
        let ActBufs { x, hb, head, .. } = acts;
        if !head_enqueued {
            if let Some(hy) = &hybrid_step {
                self.hyper_head(hy, hd, x)?;
            }
            self.enqueue_head(cfg, seqs, (n, hd), x, hb, head)?;
        }
        let logits = self.logits_to_host(cfg, seqs, head, times)?;
        if let Some(es) = stream {
            es.end_step(dev)?;
        }
        let h = &mut times.host;
        h.tail_s += tail.elapsed().as_secs_f64() - (times.gpu_wait_s - wait_before_tail);
        h.forward_s += started.elapsed().as_secs_f64();
        if let (Some(p), Some(before)) = (cpu_pool, pool_before) {
            h.pool.add(&p.region_stats().since(&before));
        }
        Ok(logits)
    }

    /// Every layer of a step that stays on the device (`GpuModel::stays_on_device`), enqueued back to
    /// back: segments ending with their device-routed experts, and dense MLPs. What the whole-step
    /// graph captures; the same work, in the same order, as the layer loop of `forward`.
    fn layers_on_device(
        &self,
        host: &Model,
        (steps, pool): (&[StepIndex<'_>], &mut super::kv::GpuKvPool),
        acts: &mut ActBufs,
        hand: &Handoff,
        (device, routes): (&mut DeviceRouted, &[LayerRoute]),
    ) -> anyhow::Result<()> {
        let act = GatedAct::of(&host.config);
        for (li, layer) in self.layers.iter().enumerate() {
            let step = &steps[self.kv_layout.group_of(li)];
            let routed = Some((&mut *device, li, routes[li]));
            let mut seg = Segment::of(acts, hand, false, None, routed);
            self.pre_experts(host, li, step, pool, &mut seg)?;
            if let GpuFfn::Dense(m) = &layer.ffn {
                let ActBufs { x, hb, mlp, .. } = &mut *acts;
                self.mlp(
                    m,
                    act,
                    hb,
                    x,
                    step.n,
                    true,
                    (&mut mlp.gate_up, &mut mlp.act),
                )?;
            }
        }
        Ok(())
    }

    /// Where layer `li`'s experts run in this step (empty for dense layers): GPU-resident, DRAM
    /// experts on the CPU, or streamed / uploaded to the GPU in long prompts.
    fn layer_homes(
        &self,
        host: &Model,
        li: usize,
        long_prompt: bool,
        stream: Option<&super::stream::ExpertStream>,
    ) -> Vec<ExpertHome> {
        let GpuFfn::Moe(moe) = &self.layers[li].ffn else {
            return Vec::new();
        };
        let streamed = stream.is_some_and(|es| es.has_layer(li));
        // placement rules may keep some DRAM experts on the CPU in long prompts too
        let cpu_in_prefill = self.prefill_on_cpu.get(li).map_or(&[][..], Vec::as_slice);
        let resident = moe.experts.resident();
        let to_gpu = long_prompt && super::stream::gpu_can_take_dram_experts(host, li);
        let homes = expert_homes(&resident, to_gpu, streamed, cpu_in_prefill);
        self.tp_homes(li, homes)
    }

    /// Copies the step's index into the class buffers (block tables at the buffers' stride).
    fn upload_index(
        &self,
        hi: &HostIndex,
        batch: &[GpuSeqInput<'_>],
        index: &mut IndexBufs,
    ) -> anyhow::Result<()> {
        let (s, n) = (&self.dev.stream, hi.ids.len());
        s.memcpy_htod(&hi.ids, &mut index.ids.slice_mut(..n))?;
        s.memcpy_htod(&hi.pos, &mut index.pos.slice_mut(..n))?;
        s.memcpy_htod(&hi.seq_of, &mut index.seq.slice_mut(..n))?;
        for (g, slots) in hi.slots.iter().enumerate() {
            let tables = HostIndex::tables(batch, index.stride, g);
            s.memcpy_htod(slots, &mut index.slots[g].slice_mut(..n))?;
            s.memcpy_htod(&tables, &mut index.tables[g].slice_mut(..tables.len()))?;
        }
        Ok(())
    }

    /// The step's embedding rows into `x`: a gather on the GPU, or rows gathered on the host and
    /// copied.
    fn embed(
        &self,
        host: &Model,
        ids: &[i32],
        index: &IndexBufs,
        x: &mut CudaSlice<f32>,
    ) -> anyhow::Result<()> {
        let (n, hd) = (ids.len(), host.config.hidden_size);
        match &self.embed {
            EmbedTable::Device(table) => self.dev.embed_rows(table, &index.ids, (n, hd), x)?,
            EmbedTable::Host => {
                let mut rows = vec![0f32; n * hd];
                for (row, &id) in rows.chunks_mut(hd).zip(ids) {
                    host.embed.row_f32(id as usize, row);
                }
                self.dev
                    .stream
                    .memcpy_htod(&rows, &mut x.slice_mut(..n * hd))?;
            }
        }
        Ok(())
    }

    /// Captures the pre-expert segment of every layer of a pipelined one-GPU graph step that has no
    /// graph yet, before the step's layers run: the same segments (homes, hand-off tail, device
    /// route) the layer loop then replays. Capturing enqueues nothing. The walk over the layers is
    /// skipped when a step of the same rows, routes and expert placement found every segment
    /// captured ([`WalkMark`]); returns whether it walked.
    fn capture_segments(
        &self,
        host: &Model,
        set: &mut GraphSet,
        (steps, pool): (&[StepIndex<'_>], &mut super::kv::GpuKvPool),
        (acts, hand): (&mut ActBufs, &Handoff),
        mut device: Option<&mut DeviceRouted>,
        routes: &[LayerRoute],
    ) -> anyhow::Result<bool> {
        let Some(rows) = steps.first().map(|s| s.n) else {
            return Ok(false);
        };
        if set.broken || self.shard.is_some() {
            return Ok(false);
        }
        let mark = WalkMark {
            routes: routes.to_vec(),
            placement: self.placement_version(),
        };
        if self.switches.walk_mark() && set.walked(rows, &mark) {
            return Ok(false);
        }
        for li in 0..self.layers.len() {
            let want_x = self
                .layer_homes(host, li, false, None)
                .contains(&ExpertHome::Cpu);
            let routed = device.as_deref_mut().map(|d| (d, li, routes[li]));
            let mut seg = Segment::of(acts, hand, want_x, None, routed);
            let step = &steps[self.kv_layout.group_of(li)];
            let key = (li, step.n, seg.tail());
            if set.map.contains_key(&key) {
                continue;
            }
            self.capture_segment(set, key, || {
                self.pre_experts(host, li, step, pool, &mut seg)
            })?;
            if set.broken {
                return Ok(true);
            }
        }
        set.mark_walked(rows, mark);
        Ok(true)
    }

    /// Captures `enqueue` (a layer's pre-expert segment) as the graph of `key`; a refused capture
    /// turns graphs off for the engine (decode runs eagerly from then on).
    fn capture_segment(
        &self,
        set: &mut GraphSet,
        key: super::graphs::SegmentKey,
        enqueue: impl FnOnce() -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        match self.dev.capture(enqueue)? {
            (Ok(()), Ok(Some(g))) => {
                set.map.insert(key, g);
            }
            (r, g) => {
                tracing::warn!(
                    "CUDA graph capture of layer {} failed ({:?}, {:?}); decode runs without graphs",
                    key.0,
                    r.err(),
                    g.err()
                );
                set.broken = true;
            }
        }
        Ok(())
    }

    /// Layer `li`'s pre-expert segment: replayed from its graph in graph steps (captured the first
    /// time a (layer, rows) pair is seen, unless a hand-off wait is pending: `graphs`' flag, see
    /// [`GraphSet::may_capture`]), else enqueued eagerly.
    fn run_pre_experts(
        &self,
        host: &Model,
        li: usize,
        (step, pool): (&StepIndex<'_>, &mut super::kv::GpuKvPool),
        seg: &mut Segment<'_, '_>,
        graphs: Option<(&mut GraphSet, bool)>,
    ) -> anyhow::Result<()> {
        let (set, waiting) = match graphs {
            Some((set, waiting)) if !set.broken => (set, waiting),
            _ => return self.pre_experts(host, li, step, pool, seg),
        };
        if self.shard.is_some() {
            return self.run_pre_experts_halves(host, li, (step, pool), seg, (set, waiting));
        }
        // The hand-off copies differ with `want_x` (a layer whose DRAM experts all moved to the GPU),
        // and device-routed layers end with their experts.
        let key = (li, step.n, seg.tail());
        if !set.map.contains_key(&key) && !set.may_capture(step.n, waiting) {
            return self.pre_experts(host, li, step, pool, seg);
        }
        if !set.map.contains_key(&key) {
            self.capture_segment(set, key, || self.pre_experts(host, li, step, pool, seg))?;
        }
        match set.map.get(&key) {
            Some(g) if !set.broken => Ok(g.replay()?),
            _ => self.pre_experts(host, li, step, pool, seg),
        }
    }

    /// A graph step of a GPU in a tensor-parallel group: the segment's two halves are captured apart
    /// (each rank its own, on its own stream) and the attention's all-reduce between them runs
    /// eagerly (the loopback communicator's hosts meet there, which a replay would skip).
    fn run_pre_experts_halves(
        &self,
        host: &Model,
        li: usize,
        (step, pool): (&StepIndex<'_>, &mut super::kv::GpuKvPool),
        seg: &mut Segment<'_, '_>,
        (set, waiting): (&mut GraphSet, bool),
    ) -> anyhow::Result<()> {
        let key = (li, step.n, seg.tail());
        let missing = [0, 1].iter().any(|h| !set.halves.contains_key(&(key, *h)));
        if missing && !set.may_capture(step.n, waiting) {
            return self.pre_experts(host, li, step, pool, seg);
        }
        self.graph_half(set, (key, 0), &mut || {
            self.attention_block(host, li, step, pool, seg)
        })?;
        self.tp_all_reduce(seg.x, step.n * host.config.hidden_size)?;
        self.graph_half(set, (key, 1), &mut || self.ffn_head(host, li, step.n, seg))
    }

    /// Replays `key`'s graph, capturing `f` into it the first time; eager when capture fails.
    fn graph_half(
        &self,
        set: &mut GraphSet,
        key: (super::graphs::SegmentKey, u8),
        f: &mut dyn FnMut() -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        if !set.broken && !set.halves.contains_key(&key) {
            match self.dev.capture(&mut *f)? {
                (Ok(()), Ok(Some(g))) => {
                    set.halves.insert(key, g);
                }
                (r, g) => {
                    tracing::warn!(
                        "CUDA graph capture of layer {} failed ({:?}, {:?}); decode runs without graphs",
                        key.0 .0,
                        r.err(),
                        g.err()
                    );
                    set.broken = true;
                }
            }
        }
        match set.halves.get(&key) {
            Some(g) if !set.broken => Ok(g.replay()?),
            _ => f(),
        }
    }

    /// The step's head, enqueued: final norm, the last row of each of the `rows` sequences gathered
    /// (their row numbers were uploaded with the step's index), lm_head. Kernels and GEMMs only, so it
    /// may be enqueued behind a GPU wait for the CPU experts.
    fn enqueue_head(
        &self,
        cfg: &crate::model::ModelConfig,
        rows: usize,
        (n, hd): (usize, usize),
        x: &CudaSlice<f32>,
        hb: &mut CudaSlice<bf16>,
        head: &mut HeadBufs,
    ) -> anyhow::Result<()> {
        let dev = &self.dev;
        let vocab = self.tp_vocab(cfg);
        dev.rms_norm(x, &self.final_norm, cfg.rms_norm_eps, (n, hd), hb, None)?;
        dev.gather_rows(&*hb, &head.last_rows, (rows, hd), &mut head.rows)?;
        match (&self.lm_head, &self.embed) {
            (Some(l), _) => self.linear(l, &head.rows, &mut head.logits, rows, false)?,
            (None, EmbedTable::Device(table)) => {
                dev.gemm_bf16(&head.rows, table, &mut head.logits, rows, vocab, hd, false)?
            }
            (None, EmbedTable::Host) => anyhow::bail!("tied lm_head without a GPU table"),
        }
        Ok(())
    }

    /// The logits of the enqueued head ([`GpuModel::enqueue_head`]) on the host, one row per
    /// sequence; the step's one closing wait.
    fn logits_to_host(
        &self,
        cfg: &crate::model::ModelConfig,
        rows: usize,
        head: &HeadBufs,
        times: &mut StepTimes,
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let s = &self.dev.stream;
        let vocab = self.tp_vocab(cfg);
        let mut host_logits = vec![0f32; rows * vocab];
        let t0 = Instant::now();
        s.memcpy_dtoh(&head.logits.slice(..rows * vocab), &mut host_logits)?;
        s.synchronize()?;
        times.gpu_wait_s += t0.elapsed().as_secs_f64();
        if rows == 1 {
            return Ok(vec![host_logits]); // batch 1: the row as copied, without copying it again
        }
        Ok(host_logits.chunks(vocab).map(<[f32]>::to_vec).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::kv::BLOCK;

    #[test]
    fn host_index_of_a_mixed_step() {
        // a decode row of a sequence at position 20 (blocks 7, 3) and a 3-token chunk from position 0
        let a = GpuSeqInput {
            tables: vec![&[7, 3]],
            pos0: 20,
            tokens: &[11],
            state: None,
        };
        let b = GpuSeqInput {
            tables: vec![&[5]],
            pos0: 0,
            tokens: &[1, 2, 3],
            state: None,
        };
        let batch = [a, b];
        let h = HostIndex::new(&batch);
        assert_eq!(h.ids, vec![11, 1, 2, 3]);
        assert_eq!(h.pos, vec![20, 0, 1, 2]);
        assert_eq!(h.seq_of, vec![0, 1, 1, 1]);
        let s = BLOCK as i32;
        assert_eq!(
            h.slots,
            vec![vec![3 * s + 20 - s, 5 * s, 5 * s + 1, 5 * s + 2]]
        );
        assert_eq!(h.last_rows, vec![0, 3]);
        assert_eq!((h.seqs[1].row0, h.seqs[1].len, h.max_blocks), (1, 3, 2));
        assert_eq!(HostIndex::tables(&batch, 3, 0), vec![7, 3, 0, 5, 0, 0]);
    }
}
