//! Attention of one layer on the GPU: GQA over a paged K/V cache, and MLA in absorbed form over a paged
//! latent + rope-key cache. Both add their output projection into the residual stream `x`.
use super::forward::launch_err;
use super::kv::GpuKvPool;
use super::{GpuAttention, GpuMlaQuery, GpuModel};
use crate::engine::kv::BLOCK;
use crate::model::config::RopeStyle;
use crate::model::Model;
use anyhow::Context;
use cudarc::driver::{CudaSlice, PushKernelArg};
use half::bf16;
use moe_kernels::cuda::indexer::MlaDims;
use moe_kernels::cuda::GpuDevice;

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

/// One sequence of a step: rows `row0..row0 + len` of the step, at positions `pos0..pos0 + len`, row
/// `seq` of the block tables.
#[derive(Clone, Copy, Debug)]
pub struct SeqRows {
    pub seq: usize,
    pub row0: usize,
    pub len: usize,
    pub pos0: usize,
}

/// A chunk of at least this many rows takes the GEMM attention path (below it the paged kernel's
/// launch is cheaper than gathering K/V and two GEMMs per KV head).
pub const PREFILL_GEMM_MIN_ROWS: usize = 64;
/// Score + probability buffer budget of one GEMM attention call (query rows are blocked to fit).
const PREFILL_SCORE_BYTES: usize = 512 << 20;

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
        let dev = &self.dev;
        if norm.is_none() && !rotate {
            return Ok(());
        }
        let (heads_i, dh_i, off) = (heads as i32, head_dim as i32, offset as i32);
        let rd = if rotate {
            cfg.rope.rotary_dim as i32
        } else {
            0
        };
        let style = (cfg.rope.style == RopeStyle::Interleaved) as i32;
        let null = 0u64;
        let mut l = dev.launch(&dev.k.qk_norm_rope);
        l.arg(buf).arg(&heads_i).arg(&dh_i);
        match norm {
            Some(w) => l.arg(w),
            None => l.arg(&null),
        };
        l.arg(&cfg.rms_norm_eps)
            .arg(step.pos)
            .arg(&self.inv_freq)
            .arg(&self.attn_factor)
            .arg(&rd)
            .arg(&style)
            .arg(&off);
        let threads = (head_dim as u32).div_ceil(32) * 32;
        unsafe { l.launch(GpuDevice::cfg((step.n as u32, heads as u32), threads, 0)) }
            .map_err(launch_err)?;
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
        let (aw, bw, block) = (pool.width as i32, pool.v_width as i32, BLOCK as i32);
        let (kc, vc) = (
            &mut pool.k[li] as *mut CudaSlice<bf16>,
            &mut pool.v[li] as *mut CudaSlice<bf16>,
        );
        // SAFETY: the two caches are distinct allocations; the raw pointers only split the borrow.
        let (kc, vc) = unsafe { (&mut *kc, &mut *vc) };
        let mut l = self.dev.launch(&self.dev.k.kv_append);
        l.arg(a)
            .arg(b)
            .arg(&aw)
            .arg(&bw)
            .arg(kc)
            .arg(vc)
            .arg(step.slots)
            .arg(&block);
        unsafe { l.launch(GpuDevice::cfg((step.n as u32, 1), 256, 0)) }.map_err(launch_err)?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn gqa_attention(
        &self,
        attn: &GpuAttention,
        host: &Model,
        step: &StepIndex,
        hb: &CudaSlice<bf16>,
        pool: &mut GpuKvPool,
        li: usize,
        x: &mut CudaSlice<f32>,
        bufs: &mut super::graphs::AttnBufs,
    ) -> anyhow::Result<()> {
        let GpuAttention::Gqa {
            q: wq,
            k: wk,
            v: wv,
            o,
            q_norm,
            k_norm,
        } = attn
        else {
            anyhow::bail!("layer {li}: not GQA");
        };
        let cfg = &host.config;
        let (n, nh, nkv, dh) = (step.n, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        anyhow::ensure!(
            bufs.rows >= n,
            "attention buffers for {} rows, step has {n}",
            bufs.rows
        );
        let super::graphs::AttnBufs { q, k, v, out, .. } = bufs;
        self.linear(wq, hb, q, n, false)?;
        self.linear(wk, hb, k, n, false)?;
        self.linear(wv, hb, v, n, false)?;
        let layout = cfg.layer_attention[li];
        self.norm_rope(host, q, step, nh, dh, q_norm.as_ref(), 0, layout.rope)?;
        self.norm_rope(host, k, step, nkv, dh, k_norm.as_ref(), 0, layout.rope)?;
        self.append(pool, li, k, v, step)?;
        let (q, out) = (&*q, out);
        let scale = cfg.attention_scale();
        // Sliding-window layers: the kernels skip keys before `pos - window + 1` (0: no window).
        let window = layout.window.unwrap_or(0) as i32;
        // Long prefill chunks: two GEMMs per KV head around a softmax (tensor cores); everything
        // else (decode rows, short chunks), in runs of consecutive rows: the paged kernel.
        let mut run: Option<(usize, usize)> = None; // (first row, rows) of short sequences
        for s in step.seqs {
            if s.len >= PREFILL_GEMM_MIN_ROWS {
                if let Some((r0, c)) = run.take() {
                    self.paged_gqa(
                        q,
                        pool,
                        li,
                        step,
                        (nh, nkv, dh),
                        (scale, window),
                        r0,
                        c,
                        out,
                    )?;
                }
                self.prefill_gqa(q, pool, li, step, s, (nh, nkv, dh), (scale, window), out)?;
            } else {
                run = Some(match run {
                    Some((r0, c)) => (r0, c + s.len),
                    None => (s.row0, s.len),
                });
            }
        }
        if let Some((r0, c)) = run {
            self.paged_gqa(
                q,
                pool,
                li,
                step,
                (nh, nkv, dh),
                (scale, window),
                r0,
                c,
                out,
            )?;
        }
        self.linear(o, out, x, n, true)
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
        (scale, window): (f32, i32),
        row0: usize,
        rows: usize,
        out: &mut CudaSlice<bf16>,
    ) -> anyhow::Result<()> {
        let (mb, nh_i, nkv_i, dh_i, blk, row0_i) = (
            step.max_blocks as i32,
            nh as i32,
            nkv as i32,
            dh as i32,
            BLOCK as i32,
            row0 as i32,
        );
        let dev = &self.dev;
        let mut l = dev.launch(&dev.k.paged_attention);
        l.arg(q)
            .arg(&pool.k[li])
            .arg(&pool.v[li])
            .arg(step.tables)
            .arg(&mb)
            .arg(step.seq)
            .arg(step.pos)
            .arg(&nh_i)
            .arg(&nkv_i)
            .arg(&dh_i)
            .arg(&blk)
            .arg(&scale)
            .arg(&window)
            .arg(&row0_i)
            .arg(out);
        let smem = ((dh + 128) * 4) as u32;
        unsafe { l.launch(GpuDevice::cfg((rows as u32, nh as u32), 128, smem)) }
            .map_err(launch_err)?;
        Ok(())
    }

    /// Causal attention of one long chunk (`s`) as GEMMs: its cached K/V rows (the chunk's own rows were
    /// appended already, earlier chunks' rows are there too) gathered to contiguous bf16, then per query
    /// block and KV head `S = scale · Q Kᵀ` (strided-batched over the group's query heads), a causal
    /// softmax to bf16 `P`, and `O = P V` written straight into the head's columns of `out`.
    /// Query blocks keep the score buffer ≤ `PREFILL_SCORE_BYTES` and skip keys past the block (causal).
    #[allow(clippy::too_many_arguments)]
    fn prefill_gqa(
        &self,
        q: &CudaSlice<f32>,
        pool: &GpuKvPool,
        li: usize,
        step: &StepIndex,
        s: &SeqRows,
        (nh, nkv, dh): (usize, usize, usize),
        (scale, window): (f32, i32),
        out: &mut CudaSlice<bf16>,
    ) -> anyhow::Result<()> {
        let dev = &self.dev;
        let total = s.pos0 + s.len; // keys of the last query
        let (kw, vw) = (nkv * dh, pool.v_width);
        let hq = nh / nkv;
        // bf16 Q of this chunk's rows, K and V of all its positions
        let qn = s.len * nh * dh;
        let mut qb = self.alloc::<bf16>(qn)?;
        {
            let q_rows = q.slice(s.row0 * nh * dh..s.row0 * nh * dh + qn);
            let mut l = dev.launch(&dev.k.f32_to_bf16);
            l.arg(&q_rows).arg(&qn).arg(&mut qb);
            unsafe { l.launch(GpuDevice::cfg_elems(qn)) }.map_err(launch_err)?;
        }
        let mut kb = self.alloc::<bf16>(total * kw)?;
        let mut vb = self.alloc::<bf16>(total * vw)?;
        {
            let table = step
                .tables
                .slice(s.seq * step.max_blocks..(s.seq + 1) * step.max_blocks);
            let (blk, kw_i, vw_i) = (BLOCK as i32, kw as i32, vw as i32);
            let mut l = dev.launch(&dev.k.gather_kv_bf16);
            l.arg(&pool.k[li])
                .arg(&pool.v[li])
                .arg(&table)
                .arg(&blk)
                .arg(&kw_i)
                .arg(&vw_i)
                .arg(&mut kb)
                .arg(&mut vb);
            unsafe { l.launch(GpuDevice::cfg((total as u32, 1), 256, 0)) }.map_err(launch_err)?;
        }
        // query rows per block: hq heads × rows × keys × (4 B score + 2 B probability) within budget
        let block_rows = (PREFILL_SCORE_BYTES / (hq * total * 6)).max(16).min(s.len);
        let scores = self.alloc::<f32>(hq * block_rows * total)?;
        let mut probs = self.alloc::<bf16>(hq * block_rows * total)?;
        let (qa, ka, va, sa, pa, oa) = (
            dev.addr(&qb),
            dev.addr(&kb),
            dev.addr(&vb),
            dev.addr(&scores),
            dev.addr(&probs),
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
                let (lk_i, rows_i, qpos) = (lk as i32, rows as i32, (s.pos0 + r0) as i32);
                let mut l = dev.launch(&dev.k.causal_softmax_rows);
                l.arg(&scores)
                    .arg(&lk_i)
                    .arg(&rows_i)
                    .arg(&qpos)
                    .arg(&window)
                    .arg(&mut probs);
                unsafe { l.launch(GpuDevice::cfg(((hq * rows) as u32, 1), 256, 0)) }
                    .map_err(launch_err)?;
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
        attn: &GpuAttention,
        host: &Model,
        step: &StepIndex,
        hb: &CudaSlice<bf16>,
        pool: &mut GpuKvPool,
        li: usize,
        x: &mut CudaSlice<f32>,
        hybrid: Option<&mut super::hybrid::HybridStep<'_>>,
    ) -> anyhow::Result<()> {
        let GpuAttention::Mla {
            q: wq,
            kv_a,
            kv_a_norm,
            kv_b,
            o,
        } = attn
        else {
            anyhow::bail!("layer {li}: not MLA");
        };
        let cfg = &host.config;
        let m = cfg.mla.as_ref().context("MLA layer without MLA config")?;
        let (n, nh) = (step.n, cfg.num_heads);
        let (nope, rope, lora, vd) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.kv_lora_rank,
            m.v_head_dim,
        );
        let qk = nope + rope;
        let dev = &self.dev;
        // Layers with sparse attention (GLM-5, GLM-5.3-Flash) attend what the indexer selects; it
        // reads the q-LoRA output in f32.
        let sparse = self.hybrid.as_ref().is_some_and(|h| h.sparse[li]);
        let mut q_resid = None;
        let mut q = self.alloc::<f32>(n * nh * qk)?;
        match wq {
            GpuMlaQuery::Direct(l) => self.linear(l, hb, &mut q, n, false)?,
            GpuMlaQuery::LowRank { a, norm, b } => {
                let r = a.out_dim;
                let mut qa = self.alloc::<f32>(n * r)?;
                self.linear(a, hb, &mut qa, n, false)?;
                let mut qa_b = self.alloc::<bf16>(n * r)?;
                if sparse {
                    q_resid = Some(self.alloc::<f32>(n * r)?);
                }
                self.rms_norm(
                    &qa,
                    norm,
                    m.latent_norm_eps,
                    r,
                    n,
                    &mut qa_b,
                    q_resid.as_mut(),
                )?;
                self.linear(b, &qa_b, &mut q, n, false)?;
            }
        }
        self.norm_rope(host, &mut q, step, nh, qk, None, nope, true)?;
        let mut ckv = self.alloc::<f32>(n * (lora + rope))?;
        self.linear(kv_a, hb, &mut ckv, n, false)?;
        let mut latent = self.alloc::<f32>(n * lora)?;
        let mut krope = self.alloc::<f32>(n * rope)?;
        {
            let (lora_i, rope_i) = (lora as i32, rope as i32);
            let mut l = dev.launch(&dev.k.mla_split_latent);
            l.arg(&ckv)
                .arg(kv_a_norm)
                .arg(&m.latent_norm_eps)
                .arg(&lora_i)
                .arg(&rope_i)
                .arg(&mut latent)
                .arg(&mut krope);
            unsafe { l.launch(GpuDevice::cfg((n as u32, 1), 256, 0)) }.map_err(launch_err)?;
        }
        if rope > 0 {
            self.norm_rope(host, &mut krope, step, 1, rope, None, 0, true)?;
        }
        self.append(pool, li, &latent, &krope, step)?;
        let mut out = self.alloc::<bf16>(n * nh * vd)?;
        if sparse {
            let hy = hybrid.context("a sparse-attention layer without hybrid step state")?;
            self.indexer_select(host, li, step, x, q_resid.as_ref(), pool, hy)?;
            let dims = MlaDims {
                heads: nh,
                nope,
                rope,
                lora,
                v_dim: vd,
            };
            let scale = cfg.attention_scale();
            self.mla_selected(step, pool, li, dims, scale, &q, kv_b, hy, &mut out)?;
            return self.linear(o, &out, x, n, true);
        }
        let (mb, nh_i, nope_i, rope_i, lora_i, vd_i, blk) = (
            step.max_blocks as i32,
            nh as i32,
            nope as i32,
            rope as i32,
            lora as i32,
            vd as i32,
            BLOCK as i32,
        );
        let scale = cfg.attention_scale();
        let mut l = dev.launch(&dev.k.mla_attention);
        l.arg(&q)
            .arg(&pool.k[li])
            .arg(&pool.v[li])
            .arg(step.tables)
            .arg(&mb)
            .arg(step.seq)
            .arg(step.pos)
            .arg(&nh_i)
            .arg(&nope_i)
            .arg(&rope_i)
            .arg(&lora_i)
            .arg(&vd_i)
            .arg(kv_b)
            .arg(&blk)
            .arg(&scale)
            .arg(&mut out);
        let threads = 128u32;
        let smem = ((nope + rope + 2 * lora) as u32 + threads) * 4;
        unsafe { l.launch(GpuDevice::cfg((n as u32, nh as u32), threads, smem)) }
            .map_err(launch_err)?;
        self.linear(o, &out, x, n, true)
    }
}
