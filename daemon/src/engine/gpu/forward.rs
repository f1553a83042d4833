//! One engine step on the GPU (see the module docs of `gpu` for the CPU‖GPU split of MoE layers).
use super::experts::PhaseBuffers;
use super::graphs::ActBufs;
use super::handoff::Handoff;
use super::{GpuAttention, GpuFfn, GpuLinear, GpuMlp, GpuModel};
use crate::engine::kv::{slot, BlockId};
use crate::engine::moe::{dram_experts_forward, GatedAct, Routing};
use crate::engine::StepTimes;
use crate::model::config::{Activation, RouterInput, RouterKind};
use crate::model::{Ffn, Model};
use anyhow::Context;
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg};
use half::bf16;
use moe_kernels::cuda::GpuDevice;
use std::time::Instant;

/// One sequence's chunk in a GPU step: its block table covers `pos0 + tokens.len()` positions (the
/// driver reserved them). `state`: the sequence's recurrent-state buffer slot (models with
/// linear-attention layers; see `gpu::hybrid`).
pub struct GpuSeqInput<'a> {
    pub blocks: &'a [BlockId],
    pub pos0: usize,
    pub tokens: &'a [u32],
    pub state: Option<&'a mut Option<CudaSlice<f32>>>,
}

pub(super) fn launch_err(e: cudarc::driver::DriverError) -> anyhow::Error {
    anyhow::anyhow!("CUDA launch: {e}")
}

/// What a layer's pre-expert segment reads and writes (persistent buffers in graph steps).
struct Segment<'a, 'b> {
    x: &'a mut CudaSlice<f32>,
    hb: &'a mut CudaSlice<bf16>,
    hf: &'a mut CudaSlice<f32>,
    logits: &'a mut CudaSlice<f32>,
    eids: &'a mut CudaSlice<i32>,
    w: &'a mut CudaSlice<f32>,
    attn: &'a mut super::graphs::AttnBufs,
    hand: &'a mut Handoff,
    /// Also copy the normalised rows to the host (the layer has DRAM experts and is not streamed).
    want_x: bool,
    /// Streams, recurrent states and indexer selection of hybrid models.
    hybrid: Option<&'a mut super::hybrid::HybridStep<'b>>,
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
            let total = n * l.out_dim;
            let cols = l.out_dim as i32;
            let mut a = self.dev.launch(&self.dev.k.add_bias);
            a.arg(y).arg(b).arg(&cols).arg(&total);
            unsafe { a.launch(GpuDevice::cfg_elems(total)) }.map_err(launch_err)?;
        }
        Ok(())
    }

    pub(super) fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> anyhow::Result<CudaSlice<T>> {
        // SAFETY: every buffer of a step is fully written by a kernel or GEMM before it is read (the
        // callers below are written that way), so skipping the memset is sound and saves a launch.
        Ok(unsafe { self.dev.stream.alloc::<T>(n.max(1)) }?)
    }

    /// RMSNorm of `rows` rows of x into bf16 (and optionally f32).
    pub(super) fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        eps: f32,
        dim: usize,
        rows: usize,
        out_bf16: &mut CudaSlice<bf16>,
        out_f32: Option<&mut CudaSlice<f32>>,
    ) -> anyhow::Result<()> {
        let dim_i = dim as i32;
        let null = 0u64;
        let mut a = self.dev.launch(&self.dev.k.rms_norm);
        a.arg(x).arg(w).arg(&eps).arg(&dim_i).arg(out_bf16);
        match out_f32 {
            Some(o) => a.arg(o),
            None => a.arg(&null),
        };
        unsafe { a.launch(GpuDevice::cfg((rows as u32, 1), 256, 0)) }.map_err(launch_err)?;
        Ok(())
    }

    /// down(act(gate_up(x))) for `n` rows, accumulated into `y` when `accumulate`.
    fn mlp(
        &self,
        m: &GpuMlp,
        act: GatedAct,
        x: &CudaSlice<bf16>,
        y: &mut CudaSlice<f32>,
        n: usize,
        accumulate: bool,
    ) -> anyhow::Result<()> {
        let inter = m.down.in_dim;
        let mut gu = self.alloc::<f32>(n * 2 * inter)?;
        self.linear(&m.gate_up, x, &mut gu, n, false)?;
        let mut a = self.alloc::<bf16>(n * inter)?;
        self.gated_act(&gu.slice(..), &mut a.slice_mut(..), inter, n, act)?;
        self.linear(&m.down, &a, y, n, accumulate)
    }

    /// `out = f(gate) · up` to bf16 for `rows` rows of `gate_up` (`[rows, 2·inter]`, gate first), f
    /// the model's gate activation (SwiGLU, GELU-tanh, ReGLU), after the optional SwiGLU clamp.
    pub(super) fn gated_act(
        &self,
        gate_up: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, bf16>,
        inter: usize,
        rows: usize,
        act: GatedAct,
    ) -> anyhow::Result<()> {
        // Codes of kernels.cu's `gated_mul`; no clamp is an infinite limit.
        let limit = act.swiglu_limit.unwrap_or(f32::INFINITY);
        let code: i32 = match act.act {
            Activation::Silu => 0,
            Activation::GeluTanh => 1,
            Activation::Relu => 2,
        };
        let (inter_i, rows_i) = (inter as i32, rows as i32);
        let mut l = self.dev.launch(&self.dev.k.gated_mul);
        l.arg(gate_up)
            .arg(&inter_i)
            .arg(&rows_i)
            .arg(&code)
            .arg(&limit)
            .arg(out);
        unsafe { l.launch(GpuDevice::cfg_elems(rows * inter)) }.map_err(launch_err)?;
        Ok(())
    }

    /// Layer `li` up to its experts, enqueued: attention norm, attention (adds into `x`), FFN norm
    /// (`hb`, `hf`), and for MoE layers the router, top-k and the asynchronous copies of the routing
    /// (and, if `want_x`, of `hf`) into the pinned hand-off buffers. Nothing here waits or allocates
    /// for GQA layers, so it can be captured as a graph.
    fn pre_experts(
        &self,
        host: &Model,
        li: usize,
        step: &super::attention::StepIndex,
        pool: &mut super::kv::GpuKvPool,
        g: &mut Segment<'_, '_>,
    ) -> anyhow::Result<()> {
        let cfg = &host.config;
        let (dev, s, hd, n) = (&self.dev, &self.dev.stream, cfg.hidden_size, step.n);
        let layer = &self.layers[li];
        // Routers that read the layer input (SmallThinker) run before attention changes `x`.
        let early_router = match (&layer.ffn, &cfg.moe) {
            (GpuFfn::Moe(moe), Some(mc)) if mc.router_input == RouterInput::LayerInput => {
                dev.gemm_f32(&*g.x, &moe.router, g.logits, n, mc.num_experts, hd)?;
                true
            }
            _ => false,
        };
        use super::hybrid::Block;
        if let Some(hy) = g.hybrid.as_deref_mut() {
            self.hyper_collapse(hy, li, Block::Attention, hd, cfg.rms_norm_eps, g.x)?;
        }
        self.rms_norm(g.x, &layer.attn_norm, cfg.rms_norm_eps, hd, n, g.hb, None)?;
        match &layer.attn {
            GpuAttention::Gqa { .. } => {
                self.gqa_attention(&layer.attn, host, step, g.hb, pool, li, g.x, g.attn)?
            }
            GpuAttention::Mla { .. } => self.mla_attention(
                &layer.attn,
                host,
                step,
                g.hb,
                pool,
                li,
                g.x,
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
        if let Some(hy) = g.hybrid.as_deref_mut() {
            self.hyper_expand(hy, hd, g.x)?;
            self.hyper_collapse(hy, li, Block::Ffn, hd, cfg.rms_norm_eps, g.x)?;
        }
        self.rms_norm(
            g.x,
            &layer.ffn_norm,
            cfg.rms_norm_eps,
            hd,
            n,
            g.hb,
            Some(&mut *g.hf),
        )?;
        let GpuFfn::Moe(moe) = &layer.ffn else {
            return Ok(());
        };
        let mc = cfg.moe.as_ref().context("MoE layer without MoE config")?;
        let e = mc.num_experts;
        if !early_router {
            dev.gemm_f32(&*g.hf, &moe.router, g.logits, n, e, hd)?;
        }
        let (kind, renorm, n_group, topk_group, scaling) = match mc.router {
            RouterKind::Softmax { renormalize } => (0i32, renormalize as i32, 1i32, 1i32, 1.0f32),
            RouterKind::SigmoidGrouped {
                n_group,
                topk_group,
                renormalize,
            } => (
                1,
                renormalize as i32,
                n_group as i32,
                topk_group as i32,
                mc.routed_scaling_factor,
            ),
        };
        let (n_i, e_i, k_i) = (n as i32, e as i32, mc.top_k as i32);
        let null = 0u64;
        let mut l = dev.launch(&dev.k.router_topk);
        l.arg(&*g.logits)
            .arg(&n_i)
            .arg(&e_i)
            .arg(&k_i)
            .arg(&kind)
            .arg(&renorm);
        match &moe.correction_bias {
            Some(b) => l.arg(b),
            None => l.arg(&null),
        };
        l.arg(&n_group)
            .arg(&topk_group)
            .arg(&scaling)
            .arg(&mut *g.eids)
            .arg(&mut *g.w);
        let smem = (2 * e * 4) as u32;
        unsafe { l.launch(GpuDevice::cfg((n as u32, 1), 128, smem)) }.map_err(launch_err)?;
        // The layer's one hand-off: routing (and activations, when DRAM experts may be hit) into
        // pinned memory, asynchronously; the caller waits once.
        let (nk, nx) = (n * mc.top_k, n * hd);
        s.memcpy_dtoh(&g.eids.slice(..nk), g.hand.ids.slice_mut(nk))?;
        s.memcpy_dtoh(&g.w.slice(..nk), g.hand.w.slice_mut(nk))?;
        if g.want_x {
            s.memcpy_dtoh(&g.hf.slice(..nx), g.hand.x.slice_mut(nx))?;
        }
        Ok(())
    }

    fn add(&self, y: &mut CudaSlice<f32>, x: &CudaSlice<f32>, n: usize) -> anyhow::Result<()> {
        let mut l = self.dev.launch(&self.dev.k.add_inplace);
        l.arg(y).arg(x).arg(&n);
        unsafe { l.launch(GpuDevice::cfg_elems(n)) }.map_err(launch_err)?;
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
        let cfg = &host.config;
        let dev = &self.dev;
        let s = &dev.stream;
        let hd = cfg.hidden_size;
        // ---- host-side bookkeeping: token ids, positions, cache slots, block tables
        let mut pool = self.kv.lock().unwrap_or_else(|e| e.into_inner());
        let mut ids = Vec::new();
        let mut pos = Vec::new();
        let mut seq_of = Vec::new();
        let mut slots = Vec::new();
        let mut last_rows = Vec::new();
        let mut seqs = Vec::with_capacity(batch.len());
        for (si, b) in batch.iter().enumerate() {
            seqs.push(super::attention::SeqRows {
                seq: si,
                row0: ids.len(),
                len: b.tokens.len(),
                pos0: b.pos0,
            });
            for (i, &t) in b.tokens.iter().enumerate() {
                let p = b.pos0 + i;
                ids.push(t as i32);
                pos.push(p as i32);
                seq_of.push(si as i32);
                slots.push(slot(b.blocks, p) as i32);
            }
            last_rows.push((ids.len() - 1) as i32);
        }
        let n = ids.len();
        let layerwise = n >= self.prefill_threshold;
        let top_k = cfg.moe.as_ref().map_or(1, |m| m.top_k);
        // Plain decode steps replay each layer's pre-expert segment from a CUDA graph (see `graphs`).
        let graph_step = self.cuda_graphs
            && !layerwise
            && n <= super::graphs::MAX_GRAPH_ROWS
            && batch.iter().all(|b| b.tokens.len() == 1)
            && self.all_gqa();
        let mut graphs_guard = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let mut hand_guard = self.handoff.lock().unwrap_or_else(|e| e.into_inner());
        let (mut own_index, mut own_acts);
        let (index, acts, hand, mut graphs) = if graph_step {
            if graphs_guard.is_none() {
                *graphs_guard = Some(super::graphs::DecodeGraphs::new(
                    self,
                    cfg,
                    pool.total_blocks,
                )?);
            }
            let g = graphs_guard.as_mut().context("decode graphs")?;
            (&mut g.index, &mut g.acts, &mut g.hand, Some(&mut g.graphs))
        } else {
            let stride = batch
                .iter()
                .map(|b| b.blocks.len())
                .max()
                .unwrap_or(1)
                .max(1);
            own_index = self.alloc_index(n, batch.len(), stride)?;
            own_acts = self.alloc_acts(cfg, n)?;
            let hand = match &mut *hand_guard {
                Some(h) if h.fits(n * top_k, n * hd) => h,
                slot => slot.insert(Handoff::new(dev, n * top_k, n * hd)?),
            };
            (&mut own_index, &mut own_acts, hand, None)
        };
        let max_blocks = index.stride;
        let mut tables = vec![0i32; batch.len() * max_blocks];
        for (si, b) in batch.iter().enumerate() {
            for (j, &blk) in b.blocks.iter().enumerate() {
                tables[si * max_blocks + j] = blk as i32;
            }
        }
        s.memcpy_htod(&ids, &mut index.ids.slice_mut(..n))?;
        s.memcpy_htod(&pos, &mut index.pos.slice_mut(..n))?;
        s.memcpy_htod(&seq_of, &mut index.seq.slice_mut(..n))?;
        s.memcpy_htod(&slots, &mut index.slots.slice_mut(..n))?;
        s.memcpy_htod(&tables, &mut index.tables.slice_mut(..tables.len()))?;
        let index = &*index;
        let ActBufs {
            x,
            hb,
            hf,
            logits,
            eids: d_eids,
            w: d_w,
            cpu_sum,
            attn: attn_bufs,
        } = acts;

        // ---- embedding: a gather on the GPU, or rows gathered on the host and copied
        match &self.embed {
            super::EmbedTable::Device(table) => {
                let hd_i = hd as i32;
                let mut l = dev.launch(&dev.k.embed_rows);
                l.arg(table).arg(&index.ids).arg(&hd_i).arg(&mut *x);
                unsafe { l.launch(GpuDevice::cfg((n as u32, 1), 256, 0)) }.map_err(launch_err)?;
            }
            super::EmbedTable::Host => {
                let mut rows = vec![0f32; n * hd];
                for (row, &id) in rows.chunks_mut(hd).zip(&ids) {
                    host.embed.row_f32(id as usize, row);
                }
                s.memcpy_htod(&rows, &mut x.slice_mut(..n * hd))?;
            }
        }
        let mut hybrid_step = match &self.hybrid {
            Some(h) => Some(self.hybrid_begin_step(h, batch, hd, x)?),
            None => None,
        };
        // Layerwise prefill streams the packed DRAM experts (see `stream`); the first copies start now.
        let mut stream_guard = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        let mut stream = if layerwise {
            stream_guard.as_mut()
        } else {
            None
        };
        if let Some(es) = stream.as_deref_mut() {
            es.begin_step(dev, host)?;
        }
        let step = super::attention::StepIndex {
            n,
            pos: &index.pos,
            seq: &index.seq,
            slots: &index.slots,
            tables: &index.tables,
            max_blocks,
            seqs: &seqs,
        };
        for (li, layer) in self.layers.iter().enumerate() {
            // ---- attention, norm, router and the routing copies: eager, or one graph replay
            // Rows go to the host when DRAM experts may run on the CPU: in decode, or in a long
            // prompt's step for experts the placement rules keep on the CPU for prefill.
            let prefill_cpu = self
                .prefill_on_cpu
                .get(li)
                .map(Vec::as_slice)
                .unwrap_or(&[]);
            let want_x = (!layerwise || prefill_cpu.contains(&true))
                && matches!(&layer.ffn, GpuFfn::Moe(m) if m.experts.read().iter().any(Option::is_none));
            {
                let mut seg = Segment {
                    x: &mut *x,
                    hb: &mut *hb,
                    hf: &mut *hf,
                    logits: &mut *logits,
                    eids: &mut *d_eids,
                    w: &mut *d_w,
                    attn: &mut *attn_bufs,
                    hand: &mut *hand,
                    want_x,
                    hybrid: hybrid_step.as_mut(),
                };
                match graphs.as_deref_mut() {
                    Some(set) if !set.broken => {
                        let key = (li, n);
                        #[allow(clippy::map_entry)] // the capture needs `set` free
                        if !set.map.contains_key(&key) {
                            use cudarc::driver::sys::{
                                CUgraphInstantiate_flags, CUstreamCaptureMode,
                            };
                            // Relaxed: the thread-local mode refused a call of this segment on the
                            // H200 ("operation not permitted when stream is capturing").
                            s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
                            let r = self.pre_experts(host, li, &step, &mut pool, &mut seg);
                            // end the capture whatever happened, so the stream is usable again
                            let g = s.end_capture(CUgraphInstantiate_flags(0));
                            match (r, g) {
                                (Ok(()), Ok(Some(g))) => {
                                    set.map.insert(key, super::graphs::Graph(g));
                                }
                                (r, g) => {
                                    tracing::warn!(
                                        "CUDA graph capture of layer {li} failed ({:?}, {:?}); decode runs without graphs",
                                        r.err(),
                                        g.err()
                                    );
                                    set.broken = true;
                                }
                            }
                        }
                        match set.map.get(&key) {
                            Some(g) if !set.broken => g.0.launch()?,
                            _ => self.pre_experts(host, li, &step, &mut pool, &mut seg)?,
                        }
                    }
                    _ => self.pre_experts(host, li, &step, &mut pool, &mut seg)?,
                }
            }
            match &layer.ffn {
                GpuFfn::Dense(m) => self.mlp(m, GatedAct::of(cfg), hb, x, n, true)?,
                GpuFfn::Moe(moe) => {
                    let mc = cfg.moe.as_ref().context("MoE layer without MoE config")?;
                    let Ffn::Moe(host_block) = &host.layers[li].ffn else {
                        anyhow::bail!("layer {li}: host and GPU layer kinds differ");
                    };
                    let e = mc.num_experts;
                    let table = moe.experts.read();
                    let on_cpu_in_prefill =
                        |id: usize| prefill_cpu.get(id).copied().unwrap_or(false);
                    let (nk, nx) = (n * mc.top_k, n * hd);
                    let t0 = Instant::now();
                    s.synchronize()?;
                    times.gpu_wait_s += t0.elapsed().as_secs_f64();
                    let mut eids: Vec<u32> = hand.ids.slice(nk).iter().map(|&x| x as u32).collect();
                    if let Some(f) = self
                        .routing_override
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .as_mut()
                    {
                        f(li, &mut eids);
                        // out-of-range ids from an override would index past the tables
                        eids.iter_mut().for_each(|id| *id = (*id).min(e as u32 - 1));
                    }
                    let ew = hand.w.slice(nk).to_vec();
                    on_routing(li, &eids);
                    // Group tokens per expert; split GPU-resident from DRAM experts.
                    let mut per_expert: Vec<Vec<(i32, f32)>> = vec![Vec::new(); e];
                    for (j, (&id, &w)) in eids.iter().zip(&ew).enumerate() {
                        per_expert[id as usize].push(((j / mc.top_k) as i32, w));
                    }
                    let mut cpu_ids = vec![crate::engine::moe::NOT_HERE; n * mc.top_k];
                    let mut cpu_w = vec![0f32; n * mc.top_k];
                    let mut any_cpu = false;
                    for (j, &id) in eids.iter().enumerate() {
                        times.expert_hits += 1;
                        if table[id as usize].is_some() {
                            times.gpu_expert_hits += 1;
                        } else if !layerwise || on_cpu_in_prefill(id as usize) {
                            cpu_ids[j] = id;
                            cpu_w[j] = ew[j];
                            any_cpu = true;
                        }
                    }
                    let cpu_turn = any_cpu && want_x;
                    // GPU work, enqueued: shared expert, resident experts (+ streamed ones in layerwise prefill).
                    if let Some(sh) = &moe.shared {
                        match &moe.shared_gate {
                            None => self.mlp(sh, GatedAct::of(cfg), hb, x, n, true)?,
                            Some(g) => {
                                let mut tmp = self.alloc::<f32>(n * hd)?;
                                self.mlp(sh, GatedAct::of(cfg), hb, &mut tmp, n, false)?;
                                let hd_i = hd as i32;
                                let mut l = dev.launch(&dev.k.sigmoid_gate_rows);
                                l.arg(&mut tmp).arg(&*hf).arg(g).arg(&hd_i);
                                unsafe { l.launch(GpuDevice::cfg((n as u32, 1), 256, 0)) }
                                    .map_err(launch_err)?;
                                self.add(x, &tmp, n * hd)?;
                            }
                        }
                    }
                    // Routed experts on the GPU: resident ones, then (layerwise prefill) the layer's
                    // streamed chunks. Their tokens' rows are gathered once (resident experts first,
                    // then chunk by chunk, so each phase's rows are one range), one GEMM pair per
                    // expert on views, one activation per phase, one weighted scatter at the end.
                    let chunk_list = match stream.as_deref() {
                        Some(es) if layerwise => es.layer_chunks(li),
                        _ => Vec::new(),
                    };
                    let streaming = !chunk_list.is_empty();
                    let mut uploaded = Vec::new(); // layerwise without the stream (int4): per expert
                    let mut groups: Vec<(usize, usize, usize)> = Vec::new(); // (expert, first row, rows)
                    let mut idx: Vec<i32> = Vec::new();
                    let mut wts: Vec<f32> = Vec::new();
                    let mut push = |eid: usize, groups: &mut Vec<(usize, usize, usize)>| {
                        let toks = &per_expert[eid];
                        groups.push((eid, idx.len(), toks.len()));
                        idx.extend(toks.iter().map(|t| t.0));
                        wts.extend(toks.iter().map(|t| t.1));
                    };
                    for (eid, toks) in per_expert.iter().enumerate() {
                        let resident = table[eid].is_some();
                        let uploaded_here = layerwise && !streaming && !on_cpu_in_prefill(eid);
                        if !toks.is_empty() && (resident || uploaded_here) {
                            push(eid, &mut groups);
                        }
                    }
                    let resident_groups = groups.len();
                    // (chunk, first group, groups) per streamed chunk of this layer
                    let mut chunk_groups = Vec::new();
                    if let Some(es) = stream.as_deref() {
                        for &c in &chunk_list {
                            let g0 = groups.len();
                            for &id in &es.chunk(c).ids {
                                let (id_u, resident) = (id as usize, table[id as usize].is_some());
                                if !per_expert[id_u].is_empty()
                                    && !resident
                                    && !on_cpu_in_prefill(id_u)
                                {
                                    push(id as usize, &mut groups);
                                }
                            }
                            chunk_groups.push((c, g0, groups.len() - g0));
                        }
                    }
                    if layerwise && !streaming {
                        let t = Instant::now();
                        for &(eid, _, _) in &groups {
                            if table[eid].is_none() {
                                uploaded
                                    .push((eid, super::upload_dram_expert(dev, host_block, eid)?));
                            }
                        }
                        times.transfer_s += t.elapsed().as_secs_f64();
                    }
                    let rows = idx.len();
                    if rows > 0 || streaming {
                        let inter = mc.expert_intermediate;
                        let hd_i = hd as i32;
                        let (d_idx, d_wts) = if rows > 0 {
                            (Some(s.clone_htod(&idx)?), Some(s.clone_htod(&wts)?))
                        } else {
                            (None, None)
                        };
                        let mut xe = self.alloc::<bf16>(rows * hd)?;
                        if let Some(d_idx) = &d_idx {
                            let mut l = dev.launch(&dev.k.gather_rows);
                            l.arg(&*hb).arg(d_idx).arg(&hd_i).arg(&mut xe);
                            unsafe { l.launch(GpuDevice::cfg((rows as u32, 1), 256, 0)) }
                                .map_err(launch_err)?;
                        }
                        let mut gu = self.alloc::<f32>(rows * 2 * inter)?;
                        let mut act = self.alloc::<bf16>(rows * inter)?;
                        let mut ye = self.alloc::<f32>(rows * hd)?;
                        let mut bufs = PhaseBuffers {
                            xe: &xe,
                            gu: &mut gu,
                            act: &mut act,
                            ye: &mut ye,
                            hd,
                            inter,
                            activation: GatedAct::of(cfg),
                        };
                        let resident = &groups[..resident_groups];
                        let mut ws = Vec::with_capacity(resident.len());
                        for &(eid, _, _) in resident {
                            let m = match &table[eid] {
                                Some(m) => m,
                                None => uploaded
                                    .iter()
                                    .find(|(e, _)| *e == eid)
                                    .map(|(_, m)| m)
                                    .context("uploaded expert missing")?,
                            };
                            ws.push((m.gate_up.bf16()?.slice(..), m.down.bf16()?.slice(..)));
                        }
                        self.expert_phase(resident, &ws, &mut bufs)?;
                        if let Some(es) = stream.as_deref_mut() {
                            let t = Instant::now();
                            for &(c, g0, count) in &chunk_groups {
                                es.take(dev, host, c)?;
                                let gs = &groups[g0..g0 + count];
                                let each = es.geometry.dense_elems();
                                let split = 2 * inter * hd;
                                let mut ws = Vec::with_capacity(gs.len());
                                for &(eid, _, _) in gs {
                                    let j = es
                                        .chunk(c)
                                        .ids
                                        .iter()
                                        .position(|&x| x as usize == eid)
                                        .context("expert not in its chunk")?;
                                    ws.push((
                                        es.dense.slice(j * each..j * each + split),
                                        es.dense.slice(j * each + split..(j + 1) * each),
                                    ));
                                }
                                self.expert_phase(gs, &ws, &mut bufs)?;
                            }
                            times.transfer_s += t.elapsed().as_secs_f64();
                        }
                        if rows > 0 {
                            // token → its rows, for a deterministic per-token sum
                            let mut offsets = vec![0i32; n + 1];
                            for &t in &idx {
                                offsets[t as usize + 1] += 1;
                            }
                            for t in 0..n {
                                offsets[t + 1] += offsets[t];
                            }
                            let mut fill = offsets.clone();
                            let mut token_rows = vec![0i32; rows];
                            for (r, &t) in idx.iter().enumerate() {
                                token_rows[fill[t as usize] as usize] = r as i32;
                                fill[t as usize] += 1;
                            }
                            let d_off = s.clone_htod(&offsets)?;
                            let d_rows = s.clone_htod(&token_rows)?;
                            let mut l = dev.launch(&dev.k.scatter_add_weighted);
                            l.arg(&ye)
                                .arg(&d_off)
                                .arg(&d_rows)
                                .arg(d_wts.as_ref().context("weights")?)
                                .arg(&hd_i)
                                .arg(&mut *x);
                            unsafe { l.launch(GpuDevice::cfg((n as u32, 1), 256, 0)) }
                                .map_err(launch_err)?;
                        }
                    }
                    // Meanwhile on the CPU: the DRAM experts of the same tokens.
                    if cpu_turn {
                        let t = Instant::now();
                        let routing = Routing {
                            ids: cpu_ids,
                            weights: cpu_w,
                            top_k: mc.top_k,
                        };
                        let Handoff { x: hx, y: hy, .. } = &mut *hand;
                        let out = hy.slice_mut(nx);
                        out.fill(0.0);
                        dram_experts_forward(
                            host_block,
                            cpu_pool,
                            GatedAct::of(cfg),
                            hx.slice(nx),
                            hd,
                            &routing,
                            out,
                        );
                        times.cpu_experts_s += t.elapsed().as_secs_f64();
                        // Asynchronous from pinned memory: the next layer's wait (or the step's end)
                        // comes before the buffer is written again.
                        s.memcpy_htod(&*out, &mut cpu_sum.slice_mut(..nx))?;
                        self.add(x, cpu_sum, nx)?;
                    }
                }
            }
            if let Some(hy) = hybrid_step.as_mut() {
                self.hyper_expand(hy, hd, x)?;
            }
        }
        if let Some(hy) = &hybrid_step {
            self.hyper_head(hy, hd, x)?;
        }
        drop(hybrid_step);
        // ---- final norm and lm_head on the last row of each sequence
        let rows = last_rows.len();
        let d_last = s.clone_htod(&last_rows)?;
        self.rms_norm(x, &self.final_norm, cfg.rms_norm_eps, hd, n, hb, None)?;
        let mut sel = self.alloc::<bf16>(rows * hd)?;
        {
            let hd_i = hd as i32;
            let mut l = dev.launch(&dev.k.gather_rows);
            l.arg(&*hb).arg(&d_last).arg(&hd_i).arg(&mut sel);
            unsafe { l.launch(GpuDevice::cfg((rows as u32, 1), 256, 0)) }.map_err(launch_err)?;
        }
        let vocab = cfg.vocab_size;
        let mut out_logits = self.alloc::<f32>(rows * vocab)?;
        match (&self.lm_head, &self.embed) {
            (Some(head), _) => self.linear(head, &sel, &mut out_logits, rows, false)?,
            (None, super::EmbedTable::Device(table)) => {
                dev.gemm_bf16(&sel, table, &mut out_logits, rows, vocab, hd, false)?
            }
            (None, super::EmbedTable::Host) => anyhow::bail!("tied lm_head without a GPU table"),
        }
        let t0 = Instant::now();
        let host_logits = s.clone_dtoh(&out_logits)?;
        s.synchronize()?;
        times.gpu_wait_s += t0.elapsed().as_secs_f64();
        Ok(host_logits.chunks(vocab).map(<[f32]>::to_vec).collect())
    }
}
