//! The decode segment's fused ops (`segment.cu`): a layer's q/k/v (or any up to three bf16 matrices
//! over one input) as one GEMV launch, q/k norm + RoPE with the K/V cache append as one launch, and the
//! router's GEMV with its top-k (and the hand-off's publish) as one launch. They cover the decode shapes (at most
//! [`SEGMENT_MAX_ROWS`] rows, inputs a multiple of 8); [`GpuDevice::gemv_bf16_takes`] and
//! [`GpuDevice::router_fused_takes`] say whether a call fits, and the engine keeps the cuBLAS and
//! separate-kernel path for everything else (prefill, quantized weights, 8-bit caches). Decode attention
//! spread over warps is [`GpuDevice::paged_attention_warps`] (in `attention`).
use super::handoff::HandoffPort;
use super::moe::RouterKind;
use super::norm::Rotation;
use super::{ensure, grid, grid_dim, int, smem};
use crate::cuda::dense::GEMV_MAX_TOKENS_PER_CALL;
use crate::cuda::{GpuDevice, GpuError};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

/// Rows one fused segment launch takes (the GEMV kernels' register accumulators).
pub const SEGMENT_MAX_ROWS: usize = GEMV_MAX_TOKENS_PER_CALL;
/// Rows up to which the engine takes the fused q/k/v GEMV and the fused router rather than cuBLAS
/// and the separate kernels: measured on the H200 at the Qwen3-30B-A3B shape (docs/PERF.md, "The
/// decode segment: fused kernels"), the q/k/v launch beats cuBLAS's three calls at 1 and 2 rows and
/// loses from 4 (each weight load then feeds 4+ rows of dot products and the kernel is bound by its
/// instructions), the router launch likewise; the o projection is faster on cuBLAS at every row count.
pub const FUSED_SEGMENT_ROWS: usize = 2;
/// Matrices one `gemv_bf16` launch multiplies.
pub const GEMV_MATS: usize = 3;
/// Output rows per `gemv_bf16` block (a warp each).
const GEMV_WARPS: usize = 8;
/// `router_gemv_topk`'s block (4 experts' GEMV, then the top-k by the last block: ≥ k threads).
const ROUTER_THREADS: usize = 128;
/// `qk_norm_rope_append` keeps a head in a 1024-float shared array.
const MAX_HEAD_DIM: usize = 1024;

/// One matrix of a [`GpuDevice::gemv_bf16`] launch: `y[t, ..out] (=|+=) x[t] · Wᵀ`, W bf16 `[out, in]`.
pub struct GemvMat<'a> {
    pub w: &'a CudaSlice<bf16>,
    pub y: &'a mut CudaSlice<f32>,
    pub out: usize,
}

/// The bf16 K and V caches a [`GpuDevice::qk_norm_rope_append`] writes (`[slots, kv_heads · head_dim]`)
/// and each row's slot (trusted: slots of the caches' blocks, as `kv_append`'s).
pub struct CacheAppend<'a> {
    pub k_cache: &'a mut CudaSlice<bf16>,
    pub v_cache: &'a mut CudaSlice<bf16>,
    pub slot_of_row: &'a CudaSlice<i32>,
}

/// A router for [`GpuDevice::router_gemv_topk`]: f32 weights `[experts, in]`, top-`k` by `kind`, the
/// selection-only correction bias of sigmoid routers.
pub struct FusedRouter<'a> {
    pub w: &'a CudaSlice<f32>,
    pub experts: usize,
    pub k: usize,
    pub kind: &'a RouterKind,
    pub bias: Option<&'a CudaSlice<f32>>,
}

impl GpuDevice {
    /// Whether [`GpuDevice::gemv_bf16`] takes `rows` rows of `inp` inputs.
    pub fn gemv_bf16_takes(rows: usize, inp: usize) -> bool {
        (1..=SEGMENT_MAX_ROWS).contains(&rows) && inp > 0 && inp.is_multiple_of(8)
    }

    /// Whether [`GpuDevice::router_gemv_topk`] takes `rows` rows of `inp` inputs.
    pub fn router_fused_takes(rows: usize, inp: usize) -> bool {
        (1..=SEGMENT_MAX_ROWS).contains(&rows) && inp > 0 && inp.is_multiple_of(4)
    }

    /// `y_m[t] (=|+=) x[t] · W_mᵀ` for every matrix of `mats` (1 to [`GEMV_MATS`]) over the same bf16
    /// input `x` (`[rows, inp]`), in one launch: a warp per output row, 16-byte weight loads. For
    /// `rows ≤ SEGMENT_MAX_ROWS` and `inp % 8 == 0` ([`GpuDevice::gemv_bf16_takes`]); f32 sums as
    /// cuBLAS's up to their order.
    pub fn gemv_bf16(
        &self,
        x: &impl DevicePtr<bf16>,
        (rows, inp): (usize, usize),
        mats: &mut [GemvMat<'_>],
        accumulate: bool,
    ) -> Result<(), GpuError> {
        const OP: &str = "gemv_bf16";
        ensure(OP, Self::gemv_bf16_takes(rows, inp), || {
            format!(
                "{rows} rows of {inp} inputs (1..={SEGMENT_MAX_ROWS} rows, inputs a multiple of 8)"
            )
        })?;
        ensure(OP, (1..=GEMV_MATS).contains(&mats.len()), || {
            format!("{} matrices (1..={GEMV_MATS})", mats.len())
        })?;
        let xp = self.input(OP, "x", x, rows * inp)?;
        let mut args = [(0u64, 0u64, 0i32); GEMV_MATS];
        let mut total = 0usize;
        for (a, m) in args.iter_mut().zip(mats.iter_mut()) {
            let w = self.input(OP, "w", m.w, m.out * inp)?;
            let y = self.output(OP, "y", m.y, rows * m.out)?;
            *a = (w, y, int(OP, "out", m.out)?);
            total += m.out;
        }
        int(OP, "rows of all matrices", total)?;
        if total == 0 {
            return Ok(());
        }
        let (n_i, in_i, acc_i) = (rows as i32, int(OP, "inputs", inp)?, accumulate as i32);
        let mut l = self.stream.launch_builder(&self.k.gemv_bf16);
        l.arg(&xp).arg(&n_i).arg(&in_i).arg(&acc_i);
        for (w, y, out) in &args {
            l.arg(w).arg(y).arg(out);
        }
        // SAFETY: argument order and types as segment.cu's `gemv_bf16`; the warp of output row r of
        // matrix m reads W_m's row r (out_m·inp checked) and x (rows·inp checked; 16-byte loads: inp % 8
        // == 0 and device allocations are 256-byte aligned) and writes y_m[t, r] for t < rows (checked);
        // absent matrices have no rows.
        unsafe { l.launch(grid((total.div_ceil(GEMV_WARPS), 1, 1), GEMV_WARPS * 32, 0)) }?;
        Ok(())
    }

    /// In place on `q` (`[rows, heads, head_dim]`) and `k` (`[rows, kv_heads, head_dim]`): each head
    /// RMS-normalised with its norm weights when given, then rotated by `rope` when given (as
    /// [`GpuDevice::qk_norm_rope`] on each); then k's and v's rows rounded to bf16 into the caches
    /// (as [`GpuDevice::kv_append`]). One launch: a block per (row, query or KV head).
    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_rope_append(
        &self,
        (q, k, v): (
            &mut impl DevicePtrMut<f32>,
            &mut impl DevicePtrMut<f32>,
            &impl DevicePtr<f32>,
        ),
        (rows, heads, kv_heads, head_dim): (usize, usize, usize, usize),
        norms: (Option<&CudaSlice<f32>>, Option<&CudaSlice<f32>>, f32),
        rope: Option<&Rotation<'_>>,
        cache: CacheAppend<'_>,
    ) -> Result<(), GpuError> {
        const OP: &str = "qk_norm_rope_append";
        if rows == 0 {
            return Ok(());
        }
        ensure(OP, head_dim > 0 && head_dim <= MAX_HEAD_DIM, || {
            format!("head_dim {head_dim} outside 1..={MAX_HEAD_DIM}")
        })?;
        grid_dim(OP, "heads + kv_heads", heads + kv_heads)?;
        let (h_i, kvh_i, dh_i) = (
            int(OP, "heads", heads)?,
            int(OP, "kv_heads", kv_heads)?,
            int(OP, "head_dim", head_dim)?,
        );
        int(OP, "rows", rows)?;
        let width = kv_heads * head_dim;
        let qp = self.output(OP, "q", q, rows * heads * head_dim)?;
        let kp = self.output(OP, "k", k, rows * width)?;
        let vp = self.input(OP, "v", v, rows * width)?;
        let (q_norm, k_norm, eps) = norms;
        let qn = self.optional(OP, "q_norm", q_norm, head_dim)?;
        let kn = self.optional(OP, "k_norm", k_norm, head_dim)?;
        let (pos, freq, factor, rd, style) = match rope {
            Some(r) => {
                ensure(OP, r.offset == 0 && r.rotary_dim <= head_dim, || {
                    format!(
                        "rotary dims {}..{} (GQA heads rotate from dim 0, within head_dim {head_dim})",
                        r.offset,
                        r.offset + r.rotary_dim
                    )
                })?;
                (
                    self.input(OP, "positions", r.positions, rows)?,
                    self.input(OP, "inv_freq", r.inv_freq, r.rotary_dim / 2)?,
                    r.attn_factor,
                    int(OP, "rotary_dim", r.rotary_dim)?,
                    r.style.code(),
                )
            }
            None => (0, 0, 1.0, 0, 0),
        };
        let kc = self.output(OP, "k_cache", cache.k_cache, width)?;
        let vc = self.output(OP, "v_cache", cache.v_cache, width)?;
        let sl = self.input(OP, "slot_of_row", cache.slot_of_row, rows)?;
        let mut l = self.stream.launch_builder(&self.k.qk_norm_rope_append);
        l.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&h_i)
            .arg(&kvh_i)
            .arg(&dh_i);
        l.arg(&qn).arg(&kn).arg(&eps);
        l.arg(&pos).arg(&freq).arg(&factor).arg(&rd).arg(&style);
        l.arg(&kc).arg(&vc).arg(&sl);
        let threads = head_dim.div_ceil(32) * 32;
        // SAFETY: argument order and types as segment.cu's `qk_norm_rope_append`; block (t, h) reads and
        // writes head h of row t of q (h < heads) or of k (rows·heads·head_dim and rows·width checked),
        // reads v's head (checked), the norms (head_dim, checked, or null) and, when rotating,
        // positions[t] and inv_freq[..rotary_dim / 2] (checked), and writes cache row slot_of_row[t]
        // (trusted, see `CacheAppend`); head_dim ≤ 1024 fits its shared array.
        unsafe { l.launch(grid((rows, heads + kv_heads, 1), threads, 0)) }?;
        Ok(())
    }

    /// `logits[t] = x[t] · Wᵀ` for the router's f32 weights (`[experts, inp]`) and f32 rows `x`
    /// (`[rows, inp]`), then each row's top-k experts and weights into `ids` and `weights` (`[rows,
    /// k]`), in one launch: a warp per expert, and the last block to finish runs the top-k of
    /// [`GpuDevice::router_topk`] (same selection and weights, given the same logits). For
    /// [`GpuDevice::router_fused_takes`] shapes. With `publish` the same launch then does
    /// [`GpuDevice::handoff_publish`]'s work on that port: the routing and, when its flag says so, the
    /// input rows `x` into the port's host buffers, then DOWN raised.
    pub fn router_gemv_topk(
        &self,
        x: &impl DevicePtr<f32>,
        (rows, inp): (usize, usize),
        router: &FusedRouter<'_>,
        logits: &mut impl DevicePtrMut<f32>,
        (ids, weights): (&mut impl DevicePtrMut<i32>, &mut impl DevicePtrMut<f32>),
        publish: Option<(&HandoffPort, bool)>,
    ) -> Result<(), GpuError> {
        const OP: &str = "router_gemv_topk";
        ensure(OP, Self::router_fused_takes(rows, inp), || {
            format!(
                "{rows} rows of {inp} inputs (1..={SEGMENT_MAX_ROWS} rows, inputs a multiple of 4)"
            )
        })?;
        let (experts, k) = (router.experts, router.k);
        let (kind_i, renorm, n_group, topk_group, scaling) = router.kind.args(OP, experts, k)?;
        let (n_i, in_i) = (rows as i32, int(OP, "inputs", inp)?);
        let (e_i, k_i) = (int(OP, "experts", experts)?, int(OP, "k", k)?);
        let xp = self.input(OP, "x", x, rows * inp)?;
        let wp = self.input(OP, "w", router.w, experts * inp)?;
        let bp = self.optional(OP, "bias", router.bias, experts)?;
        let lp = self.output(OP, "logits", logits, rows * experts)?;
        let ip = self.output(OP, "ids", ids, rows * k)?;
        let wtp = self.output(OP, "weights", weights, rows * k)?;
        let done = self.router_blocks_done.device_ptr(&self.stream).0;
        let target = match publish {
            Some((port, with_rows)) => {
                Some(port.publish_target(OP, rows * k, with_rows.then_some(rows * inp))?)
            }
            None => None,
        };
        let [ih, wh, xh, flag, stamps] =
            target.map_or([0; 5], |t| [t.ids, t.w, t.x, t.flag, t.stamps]);
        // the top-k's selection scores and weights, and the row of logits it reads back
        let shared = smem(OP, 3 * experts * 4)?;
        let blocks = experts.div_ceil(ROUTER_THREADS / 32);
        let mut l = self.stream.launch_builder(&self.k.router_gemv_topk);
        l.arg(&xp).arg(&n_i).arg(&in_i).arg(&wp).arg(&e_i).arg(&k_i);
        l.arg(&kind_i).arg(&renorm).arg(&bp).arg(&n_group);
        l.arg(&topk_group).arg(&scaling).arg(&lp).arg(&ip).arg(&wtp);
        l.arg(&done)
            .arg(&ih)
            .arg(&wh)
            .arg(&xh)
            .arg(&flag)
            .arg(&stamps);
        // SAFETY: argument order and types as segment.cu's `router_gemv_topk`; the warp of expert e
        // reads W's row e (experts·inp checked) and x (rows·inp checked; 16-byte loads: inp % 4 == 0,
        // allocations 256-byte aligned) and writes logits[t, e]; the last block reads the logits back
        // and writes each row's k ids and weights (checked); the kind's groups fit the 64-bit mask and
        // divide the experts (`args`); the block counter is the device's own, 0 between launches, and
        // launches on the engine stream never overlap. Publishing, it writes rows·k routes and rows·inp
        // row elements (16-byte stores) into the port's mapped buffers (checked by `publish_target`;
        // DEVICEMAP allocations are page-aligned), its stamps and DOWN flag; null addresses otherwise.
        unsafe { l.launch(grid((blocks, 1, 1), ROUTER_THREADS, shared)) }?;
        Ok(())
    }
}
