//! Attention of one layer on the GPU: GQA over a paged K/V cache, and MLA in absorbed form over a paged
//! latent + rope-key cache. Both add their output projection into the residual stream `x`.
use super::buffers::{AttnBufs, MlaBufs, PrefillScratch};
use super::kv::GpuKvPool;
use super::{GpuAttention, GpuFfn, GpuLinear, GpuMlaQuery, GpuModel, GqaWeights, MlaWeights};
use crate::engine::kv::BLOCK;
use crate::model::config::RouterInput;
use crate::model::Model;
use anyhow::Context;
use cudarc::driver::CudaSlice;
use half::bf16;
use moe_kernels::cuda::ops::segment::GEMV_MATS;
use moe_kernels::cuda::ops::{
    CacheAppend, FlashBlock, FlashShape, GemvMat, MlaDims, NormRows, PagedIndex, QueryRows,
    Rotation, FUSED_SEGMENT_ROWS,
};
use moe_kernels::cuda::GpuDevice;
use std::sync::OnceLock;

/// Where each token of the step sits: positions, sequences, cache slots and block tables (device).
pub struct StepIndex<'a> {
    pub n: usize,
    pub pos: &'a CudaSlice<i32>,
    pub seq: &'a CudaSlice<i32>,
    pub slots: &'a CudaSlice<i32>,
    pub tables: &'a CudaSlice<i32>,
    pub max_blocks: usize,
    /// Host view of the same: each sequence's rows in the step.
    pub seqs: &'a [SeqRows],
}

impl StepIndex<'_> {
    /// The paged-cache index the attention kernels read.
    pub fn paged(&self) -> PagedIndex<'_> {
        PagedIndex {
            block_tables: self.tables,
            max_blocks: self.max_blocks,
            seq_of_row: self.seq,
            pos_of_row: self.pos,
            block_size: BLOCK,
        }
    }
}

/// One sequence of a step: rows `row0..row0 + len` of the step, at positions `pos0..pos0 + len`, row
/// `seq` of the block tables.
#[derive(Clone, Copy, Debug)]
pub struct SeqRows {
    pub seq: usize,
    pub row0: usize,
    pub len: usize,
    pub pos0: usize,
}

/// Share of the L2 a layer's segment weights are prefetched into ([`GpuModel::prefetch_segment`]); the
/// rest is left to what the segment writes and to the lines the prefetch cannot displace.
const L2_PREFETCH_SHARE: f64 = 0.6;

/// The first elements of `x` that fit in `left` bytes fetched into L2; `left` less them.
fn prefetch_part<T>(dev: &GpuDevice, x: &CudaSlice<T>, left: &mut usize) -> anyhow::Result<()> {
    let len = x.len().min(*left / size_of::<T>());
    dev.l2_prefetch(x, len)?;
    *left -= len * size_of::<T>();
    Ok(())
}

/// A chunk of at least this many rows takes the GEMM attention path (below it the paged kernel's
/// launch is cheaper than gathering K/V and two GEMMs per KV head).
pub const PREFILL_GEMM_MIN_ROWS: usize = 64;
/// Score + probability buffer budget of one GEMM attention call (query rows are blocked to fit).
const PREFILL_SCORE_BYTES: usize = 512 << 20;

/// Whether long chunks use the fused attention kernel (`flash_prefill`) where it takes the head dim,
/// and its block: `MOE_FLASH_PREFILL=0` keeps the GEMM + softmax path for every chunk, `w8` takes blocks
/// of 8 warps, `1` / `w4` (or unset) the default (read once per process; other values: see
/// [`FLASH_PREFILL_KNOB`]).
pub fn flash_prefill_mode() -> Option<FlashBlock> {
    static MODE: OnceLock<Option<FlashBlock>> = OnceLock::new();
    *MODE.get_or_init(|| FLASH_PREFILL_KNOB.read_or(Some(FlashBlock::default())))
}

/// `MOE_FLASH_PREFILL` ([`flash_prefill_mode`]): `None` is the GEMM path.
pub const FLASH_PREFILL_KNOB: moe_kernels::knob::Knob<Option<FlashBlock>> = moe_kernels::knob::Knob {
    name: "MOE_FLASH_PREFILL",
    takes: "0 for the GEMM path, 1 or w4 for the fused kernel in blocks of 4 warps (the default), w8",
    parse: |v| match v {
        "0" => Some(None),
        "1" | "w4" => Some(Some(FlashBlock::Warps4)),
        "w8" => Some(Some(FlashBlock::Warps8)),
        _ => None,
    },
};

impl GpuModel {
    /// In-place optional per-head RMSNorm and RoPE on dims `offset..offset + rotary_dim` of each head
    /// (`rotate` false: a NoPE layer, norm only).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_rope(
        &self,
        host: &Model,
        buf: &mut CudaSlice<f32>,
        step: &StepIndex,
        heads: usize,
        head_dim: usize,
        norm: Option<&CudaSlice<f32>>,
        offset: usize,
        rotate: bool,
    ) -> anyhow::Result<()> {
        let cfg = &host.config;
        let rotation = Rotation {
            positions: step.pos,
            inv_freq: &self.inv_freq,
            attn_factor: self.attn_factor,
            rotary_dim: cfg.rope.rotary_dim,
            offset,
            style: super::kinds::rotary_style(cfg.rope.style),
        };
        self.dev.qk_norm_rope(
            buf,
            (step.n, heads, head_dim),
            norm.map(|w| (w, cfg.rms_norm_eps)),
            rotate.then_some(&rotation),
        )?;
        Ok(())
    }

    /// Appends this step's rows to layer `li`'s caches.
    fn append(
        &self,
        pool: &mut GpuKvPool,
        li: usize,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        step: &StepIndex,
    ) -> anyhow::Result<()> {
        pool.append(&self.dev, li, (a, b), step.n, step.slots)
    }

    /// GQA attention of the step's rows, its output projection added into `x`. Its input is the
    /// normalised rows `hb`, or with `fold_norm` (the attention norm's weights;
    /// [`GpuModel::attention_norm_folds`]) the residual `x` normalised by the q/k/v launch itself,
    /// which writes the normalised rows to `hb`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gqa_attention(
        &self,
        w: &GqaWeights,
        host: &Model,
        step: &StepIndex,
        (hb, fold_norm): (&mut CudaSlice<bf16>, Option<&CudaSlice<f32>>),
        pool: &mut GpuKvPool,
        li: usize,
        x: &mut CudaSlice<f32>,
        bufs: &mut AttnBufs,
    ) -> anyhow::Result<()> {
        let GqaWeights {
            q: wq,
            k: wk,
            v: wv,
            o,
            q_norm,
            k_norm,
        } = w;
        let cfg = &host.config;
        let ((nh, nkv), n, dh) = (self.tp_heads(cfg), step.n, cfg.head_dim);
        anyhow::ensure!(
            bufs.rows >= n,
            "attention buffers for {} rows, step has {n}",
            bufs.rows
        );
        anyhow::ensure!(bufs.gqa, "step buffers without GQA buffers");
        let AttnBufs {
            q,
            k,
            v,
            out,
            prefill,
            ..
        } = bufs;
        // The fused decode segment (`MOE_GPU_SEGMENT`, `switches`): q/k/v as one GEMV launch and
        // norm + RoPE + append as one, where the shapes and the cache's rows allow.
        let fused = self.switches.fused_segment();
        let qkv = &mut [(wq, &mut *q), (wk, &mut *k), (wv, &mut *v)];
        match fold_norm {
            Some(norm_w) => {
                let norm = NormRows {
                    x: &*x,
                    w: norm_w,
                    eps: cfg.rms_norm_eps,
                };
                self.linears_normed(&norm, hb, n, qkv)?
            }
            None => self.linears(hb, n, qkv, fused)?,
        }
        let layout = cfg.layer_attention[li];
        let norms = (q_norm.as_ref(), k_norm.as_ref());
        let appended = fused
            && self.norm_rope_append(
                host,
                step,
                pool,
                li,
                (&mut *q, &mut *k, &*v),
                norms,
                layout.rope,
            )?;
        if !appended {
            self.norm_rope(host, q, step, nh, dh, q_norm.as_ref(), 0, layout.rope)?;
            self.norm_rope(host, k, step, nkv, dh, k_norm.as_ref(), 0, layout.rope)?;
            self.append(pool, li, k, v, step)?;
        }
        let (q, out) = (&*q, out);
        let scale = cfg.attention_scale();
        // Sliding-window layers: the kernels skip keys before `pos - window + 1`.
        let window = layout.window;
        // Long prefill chunks: two GEMMs per KV head around a softmax (tensor cores); everything
        // else (decode rows, short chunks), in runs of consecutive rows: the paged kernel.
        let shape = ((nh, nkv, dh), (scale, window));
        let paged = |(r0, rows): (usize, usize), out: &mut CudaSlice<bf16>| {
            self.paged_gqa(q, pool, li, step, shape.0, shape.1, r0, rows, out)
        };
        let mut run: Option<(usize, usize)> = None; // (first row, rows) of short sequences
        for s in step.seqs {
            if s.len >= PREFILL_GEMM_MIN_ROWS {
                if let Some(r) = run.take() {
                    paged(r, out)?;
                }
                self.prefill_gqa(q, pool, li, step, s, shape, prefill, out)?;
            } else {
                run = Some(match run {
                    Some((r0, c)) => (r0, c + s.len),
                    None => (s.row0, s.len),
                });
            }
        }
        if let Some(r) = run {
            paged(r, out)?;
        }
        let accumulate = self.tp_attention_accumulates();
        // (the `o-gemv` switch: the fused segment's GEMV, split over a warp per 2048 inputs)
        if self.switches.fused_segment() && self.switches.o_gemv() && self.gemv_takes(o, n) {
            let w = o.w.as_bf16().context("checked bf16")?;
            let mut mats = [GemvMat {
                w,
                y: &mut *x,
                out: o.out_dim,
                bias: o.bias.as_ref(),
            }];
            self.dev
                .gemv_bf16(&*out, (n, o.in_dim), &mut mats, accumulate)?;
            return Ok(());
        }
        self.linear(o, out, x, n, accumulate)
    }

    /// Whether the fused segment multiplies `l` over `n` rows with its bf16 GEMV (bf16 weights, at
    /// most `FUSED_SEGMENT_ROWS` rows: cuBLAS is faster above; the o projection stays on cuBLAS, which
    /// is faster at every row count).
    fn gemv_takes(&self, l: &GpuLinear, n: usize) -> bool {
        l.w.as_bf16().is_some()
            && n <= FUSED_SEGMENT_ROWS
            && GpuDevice::gemv_bf16_takes(n, l.in_dim)
    }

    /// Whether the fused segment folds the attention norm into the q/k/v launch of `w` for `n` rows
    /// (`gemv_bf16_norm`): the `fold-norms` switch, one GPU, the q/k/v GEMV takes every projection
    /// ([`GpuModel::linears`]) and the normalised rows fit its shared memory.
    pub(super) fn attention_norm_folds(&self, w: &GqaWeights, n: usize) -> bool {
        let projs = [&w.q, &w.k, &w.v];
        self.switches.fused_segment()
            && self.switches.fold_norms()
            && self.shard.is_none()
            && projs
                .iter()
                .all(|l| self.gemv_takes(l, n) && l.in_dim == w.q.in_dim)
            && GpuDevice::gemv_bf16_norm_takes(n, w.q.in_dim)
    }

    /// `y_i = RMSNorm(x) · W_iᵀ (+ bias_i)` for the q/k/v projections in one `gemv_bf16_norm` launch
    /// (shapes as [`GpuModel::attention_norm_folds`] checked; the biases added by the same launch), the
    /// normalised rows into `hb`.
    fn linears_normed(
        &self,
        norm: &NormRows<'_>,
        hb: &mut CudaSlice<bf16>,
        n: usize,
        projs: &mut [(&GpuLinear, &mut CudaSlice<f32>)],
    ) -> anyhow::Result<()> {
        let inp = projs[0].0.in_dim;
        let mut mats = Self::gemv_mats(projs)?;
        self.dev.gemv_bf16_norm(norm, (n, inp), hb, &mut mats)?;
        Ok(())
    }

    /// The GEMV launch's matrices of bf16 projections (checked by [`GpuModel::gemv_takes`]), with
    /// their biases.
    fn gemv_mats<'a>(
        projs: &'a mut [(&GpuLinear, &mut CudaSlice<f32>)],
    ) -> anyhow::Result<Vec<GemvMat<'a>>> {
        let mut mats = Vec::with_capacity(projs.len());
        for (l, y) in projs.iter_mut() {
            let w = l.w.as_bf16().context("checked bf16")?;
            mats.push(GemvMat {
                w,
                y,
                out: l.out_dim,
                bias: l.bias.as_ref(),
            });
        }
        Ok(mats)
    }

    /// `y_i = x · W_iᵀ (+ bias_i)` for projections over the same input `x` (`n` rows): one GEMV launch
    /// for all of them when `fused` and every one takes it ([`GpuModel::gemv_takes`], at most
    /// `GEMV_MATS`), else one [`GpuModel::linear`] each.
    pub(super) fn linears(
        &self,
        x: &CudaSlice<bf16>,
        n: usize,
        projs: &mut [(&GpuLinear, &mut CudaSlice<f32>)],
        fused: bool,
    ) -> anyhow::Result<()> {
        let one_launch = fused
            && projs.len() <= GEMV_MATS
            && projs
                .iter()
                .all(|(l, _)| self.gemv_takes(l, n) && l.in_dim == projs[0].0.in_dim);
        if !one_launch {
            for (l, y) in projs.iter_mut() {
                self.linear(l, x, y, n, false)?;
            }
            return Ok(());
        }
        let inp = projs[0].0.in_dim;
        let mut mats = Self::gemv_mats(projs)?;
        self.dev.gemv_bf16(x, (n, inp), &mut mats, false)?;
        Ok(())
    }

    /// Layer `li`'s segment weights fetched into L2 (`l2_prefetch`) while the GPU waits for the host's
    /// CPU experts of the layer before it, so its launches read them from L2 instead of DRAM: in the
    /// order the segment reads them (router of a layer routing its input, q, k, v, o, router), up to
    /// [`L2_PREFETCH_SHARE`] of the L2 (a Qwen3-30B-A3B layer's ~30 MB whole, the first ~30 MB of a
    /// GLM-4.5-Air layer's ~220). bf16 GQA layers only; nothing for others.
    pub(super) fn prefetch_segment(&self, host: &Model, li: usize) -> anyhow::Result<()> {
        let Some(layer) = self.layers.get(li) else {
            return Ok(());
        };
        let GpuAttention::Gqa(w) = &layer.attn else {
            return Ok(());
        };
        let router = match (&layer.ffn, &host.config.moe) {
            (GpuFfn::Moe(moe), Some(mc)) => Some((&moe.router, mc.router_input)),
            _ => None,
        };
        let dev = &self.dev;
        let mut left = (dev.l2_bytes as f64 * L2_PREFETCH_SHARE) as usize;
        if let Some((r, RouterInput::LayerInput)) = router {
            prefetch_part(dev, r, &mut left)?;
        }
        for l in [&w.q, &w.k, &w.v, &w.o] {
            if let Some(x) = l.w.as_bf16() {
                prefetch_part(dev, x, &mut left)?;
            }
        }
        if let Some((r, RouterInput::FfnInput)) = router {
            prefetch_part(dev, r, &mut left)?;
        }
        Ok(())
    }

    /// The fused segment's q/k norm + RoPE and K/V append as one launch (`qk_norm_rope_append`), for
    /// bf16 caches; false (nothing done) for 8-bit ones, which keep the separate ops.
    #[allow(clippy::too_many_arguments)]
    fn norm_rope_append(
        &self,
        host: &Model,
        step: &StepIndex,
        pool: &mut GpuKvPool,
        li: usize,
        (q, k, v): (&mut CudaSlice<f32>, &mut CudaSlice<f32>, &CudaSlice<f32>),
        (q_norm, k_norm): (Option<&CudaSlice<f32>>, Option<&CudaSlice<f32>>),
        rotate: bool,
    ) -> anyhow::Result<bool> {
        let Some((k_cache, v_cache)) = pool.bf16_rows_mut(li) else {
            return Ok(false);
        };
        let cfg = &host.config;
        let ((nh, nkv), dh) = (self.tp_heads(cfg), cfg.head_dim);
        let rotation = Rotation {
            positions: step.pos,
            inv_freq: &self.inv_freq,
            attn_factor: self.attn_factor,
            rotary_dim: cfg.rope.rotary_dim,
            offset: 0,
            style: super::kinds::rotary_style(cfg.rope.style),
        };
        let cache = CacheAppend {
            k_cache,
            v_cache,
            slot_of_row: step.slots,
        };
        self.dev.qk_norm_rope_append(
            (q, k, v),
            (step.n, nh, nkv, dh),
            (q_norm, k_norm, cfg.rms_norm_eps),
            rotate.then_some(&rotation),
            cache,
        )?;
        Ok(true)
    }

    /// Paged attention for rows `row0..row0 + rows` of the step (decode and short chunks).
    #[allow(clippy::too_many_arguments)]
    fn paged_gqa(
        &self,
        q: &CudaSlice<f32>,
        pool: &GpuKvPool,
        li: usize,
        step: &StepIndex,
        (nh, nkv, dh): (usize, usize, usize),
        (scale, window): (f32, Option<usize>),
        row0: usize,
        rows: usize,
        out: &mut CudaSlice<bf16>,
    ) -> anyhow::Result<()> {
        pool.paged_attention(
            &self.dev,
            li,
            q,
            &step.paged(),
            (nh, nkv, dh),
            (scale, window),
            (row0..row0 + rows, self.switches.fused_segment()),
            out,
        )
    }

    /// Causal attention of one long chunk (`s`): its cached K/V rows (the chunk's own rows were
    /// appended already, earlier chunks' rows are there too) gathered to contiguous bf16, then the fused
    /// kernel ([`flash_prefill_mode`], head dims it is built for), or as GEMMs: per query
    /// block and KV head `S = scale · Q Kᵀ` (strided-batched over the group's query heads), a causal
    /// softmax to bf16 `P`, and `O = P V` written straight into the head's columns of `out`.
    /// Query blocks keep the score buffer ≤ `PREFILL_SCORE_BYTES` and skip keys past the block (causal).
    ///
    /// Its buffers are the step buffers' [`PrefillScratch`], sized by the sequence's whole context
    /// (its K/V so far) and grown when a longer one arrives (the memory plan's prefill item).
    #[allow(clippy::too_many_arguments)]
    fn prefill_gqa(
        &self,
        q: &CudaSlice<f32>,
        pool: &GpuKvPool,
        li: usize,
        step: &StepIndex,
        s: &SeqRows,
        ((nh, nkv, dh), (scale, window)): ((usize, usize, usize), (f32, Option<usize>)),
        scratch: &mut PrefillScratch,
        out: &mut CudaSlice<bf16>,
    ) -> anyhow::Result<()> {
        let dev = &self.dev;
        let total = s.pos0 + s.len; // keys of the last query
        let (kw, vw) = (nkv * dh, pool.v_width);
        let hq = nh / nkv;
        let table = step
            .tables
            .slice(s.seq * step.max_blocks..(s.seq + 1) * step.max_blocks);
        let flash =
            flash_prefill_mode().filter(|_| GpuDevice::flash_prefill_supports(dh) && vw == kw);
        if let Some(block) = flash {
            // fused: the gathered K/V rows and one launch, no score matrix
            let kb = self.grown(&mut scratch.k, total * kw)?;
            let vb = self.grown(&mut scratch.v, total * vw)?;
            pool.gather_bf16(dev, li, &table, total, (&mut *kb, &mut *vb))?;
            let at = QueryRows {
                row0: s.row0,
                rows: s.len,
                pos0: s.pos0,
            };
            let shape = FlashShape {
                heads: nh,
                kv_heads: nkv,
                head_dim: dh,
                scale,
                window,
                block,
            };
            dev.flash_prefill(q, at, (&*kb, &*vb), (kw, vw), shape, out)?;
            return Ok(());
        }
        // bf16 Q of this chunk's rows, K and V of all its positions
        let qn = s.len * nh * dh;
        let PrefillScratch {
            q: qb,
            k: kb,
            v: vb,
            scores,
            probs,
        } = scratch;
        let qb = self.grown(qb, qn)?;
        let q_rows = q.slice(s.row0 * nh * dh..s.row0 * nh * dh + qn);
        dev.f32_to_bf16(&q_rows, qn, qb)?;
        let kb = self.grown(kb, total * kw)?;
        let vb = self.grown(vb, total * vw)?;
        pool.gather_bf16(dev, li, &table, total, (&mut *kb, &mut *vb))?;
        // query rows per block: hq heads × rows × keys × (4 B score + 2 B probability) within budget
        let block_rows = (PREFILL_SCORE_BYTES / (hq * total * 6)).max(16).min(s.len);
        let scores = self.grown(scores, hq * block_rows * total)?;
        let probs = self.grown(probs, hq * block_rows * total)?;
        let (qa, ka, va, sa, pa, oa) = (
            dev.addr(&*qb),
            dev.addr(&*kb),
            dev.addr(&*vb),
            dev.addr(&*scores),
            dev.addr(&*probs),
            dev.addr(&*out),
        );
        const B16: u64 = 2;
        let mut r0 = 0;
        while r0 < s.len {
            let rows = block_rows.min(s.len - r0);
            let lk = s.pos0 + r0 + rows; // causal: no key beyond the block's last query
            for g in 0..nkv {
                let h0 = g * hq;
                // S_b (row-major [rows, lk]) = column-major lk × rows: op(A)=Kᵀ-view, op(B)=Q-view
                // SAFETY: every address below lies inside the buffers allocated above (or `out`), at the
                // offsets and extents the strides describe; all stay alive until the stream runs.
                unsafe {
                    dev.gemm_bf16_batched_raw(
                        true,
                        false,
                        (lk, rows, dh),
                        scale,
                        (ka + B16 * (g * dh) as u64, kw, 0),
                        (qa + B16 * ((r0 * nh + h0) * dh) as u64, nh * dh, dh),
                        (sa, lk, rows * lk),
                        hq,
                        false,
                    )?;
                }
                dev.causal_softmax_rows(
                    &*scores,
                    (hq * rows, lk),
                    rows,
                    s.pos0 + r0,
                    window,
                    &mut *probs,
                )?;
                // O_b (head h0 + b's columns of the chunk's rows) = column-major dh × rows: V-view · P_bᵀ
                // SAFETY: as above; `out` has n × nh × dh elements and row s.row0 + r0 + rows ≤ n.
                unsafe {
                    dev.gemm_bf16_batched_raw(
                        false,
                        false,
                        (dh, rows, lk),
                        1.0,
                        (va + B16 * (g * dh) as u64, vw, 0),
                        (pa, lk, rows * lk),
                        (
                            oa + B16 * (((s.row0 + r0) * nh + h0) * dh) as u64,
                            nh * dh,
                            dh,
                        ),
                        hq,
                        true,
                    )?;
                }
            }
            r0 += rows;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn mla_attention(
        &self,
        w: &MlaWeights,
        host: &Model,
        step: &StepIndex,
        hb: &CudaSlice<bf16>,
        pool: &mut GpuKvPool,
        li: usize,
        x: &mut CudaSlice<f32>,
        bufs: &mut AttnBufs,
        hybrid: Option<&mut super::hybrid::HybridStep<'_>>,
    ) -> anyhow::Result<()> {
        let MlaWeights {
            q: wq,
            kv_a,
            kv_a_norm,
            kv_b,
            o,
        } = w;
        let cfg = &host.config;
        let m = cfg.mla.as_ref().context("MLA layer without MLA config")?;
        let (n, nh) = (step.n, self.tp_heads(cfg).0);
        let (nope, rope, lora, vd) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.kv_lora_rank,
            m.v_head_dim,
        );
        let qk = nope + rope;
        let dev = &self.dev;
        anyhow::ensure!(
            bufs.rows >= n,
            "attention buffers for {} rows, step has {n}",
            bufs.rows
        );
        let MlaBufs {
            q,
            q_a,
            q_a_bf16,
            q_a_norm,
            ckv,
            latent,
            krope,
            out,
        } = bufs
            .mla
            .as_mut()
            .context("step buffers without MLA buffers")?;
        // Layers with sparse attention (GLM-5, GLM-5.3-Flash) attend what the indexer selects; it
        // reads the q-LoRA output in f32.
        let sparse = self.hybrid.as_ref().is_some_and(|h| h.sparse[li]);
        match wq {
            GpuMlaQuery::Direct(l) => self.linear(l, hb, q, n, false)?,
            GpuMlaQuery::LowRank { a, norm, b } => {
                let r = a.out_dim;
                self.linear(a, hb, q_a, n, false)?;
                let q_resid = if sparse { Some(&mut *q_a_norm) } else { None };
                dev.rms_norm(&*q_a, norm, m.latent_norm_eps, (n, r), q_a_bf16, q_resid)?;
                self.linear(b, q_a_bf16, q, n, false)?;
            }
        }
        self.norm_rope(host, q, step, nh, qk, None, nope, true)?;
        self.linear(kv_a, hb, ckv, n, false)?;
        dev.mla_split_latent(
            &*ckv,
            kv_a_norm,
            m.latent_norm_eps,
            (n, lora, rope),
            latent,
            krope,
        )?;
        if rope > 0 {
            self.norm_rope(host, krope, step, 1, rope, None, 0, true)?;
        }
        self.append(pool, li, latent, krope, step)?;
        let dims = MlaDims {
            heads: nh,
            nope,
            rope,
            lora,
            v_dim: vd,
        };
        let scale = cfg.attention_scale();
        if sparse {
            let hy = hybrid.context("a sparse-attention layer without hybrid step state")?;
            let q_resid = matches!(wq, GpuMlaQuery::LowRank { .. }).then_some(&*q_a_norm);
            self.indexer_select(host, li, step, x, q_resid, pool, hy)?;
            self.mla_selected(step, pool, li, dims, scale, q, kv_b, hy, out)?;
            return self.linear(o, out, x, n, self.tp_attention_accumulates());
        }
        let (lat_cache, rope_cache) = pool.bf16_rows(li)?;
        dev.mla_attention(
            &*q,
            lat_cache,
            rope_cache,
            &step.paged(),
            n,
            dims,
            kv_b,
            scale,
            out,
        )?;
        self.linear(o, out, x, n, self.tp_attention_accumulates())
    }
}
