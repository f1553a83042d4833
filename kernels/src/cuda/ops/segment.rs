//! The decode segment's fused ops (`segment.cu`): a layer's q/k/v (or any up to three bf16 matrices
//! over one input) as one GEMV launch, optionally with the attention RMSNorm of its input folded in;
//! q/k norm + RoPE with the K/V cache append as one launch; and the router's GEMV with its top-k (and
//! the hand-off's publish, and optionally the FFN RMSNorm of its input) as one launch. They cover the
//! decode shapes (at most [`SEGMENT_MAX_ROWS`] rows, inputs a multiple of 8):
//! [`GpuDevice::gemv_bf16_takes`], [`GpuDevice::gemv_bf16_norm_takes`],
//! [`GpuDevice::router_fused_takes`] and [`GpuDevice::router_norm_takes`] say whether a call fits, and
//! the engine keeps the cuBLAS and separate-kernel path for everything else (prefill, quantized
//! weights, 8-bit caches). Decode attention spread over warps is [`GpuDevice::paged_attention_warps`]
//! (in `attention`).
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
/// Threads of `gemv_bf16` and `gemv_bf16_norm` blocks; 256 also gives the latter `rms_norm`'s order.
const GEMV_THREADS: usize = GEMV_WARPS * 32;
/// `router_gemv_topk`'s block (4 experts' GEMV at 2 warps each, then the top-k by the last block: ≥ k
/// threads; 256 threads: `rms_norm`'s order when it normalises its input).
const ROUTER_THREADS: usize = 256;
/// Experts per `router_gemv_topk` block (`ROUTER_SPLIT` = 2 warps each).
const ROUTER_EXPERTS_PER_BLOCK: usize = ROUTER_THREADS / 32 / 2;
/// Inputs one round of a `gemv_bf16` warp's loads covers (`GEMV_CHUNK`).
const GEMV_CHUNK: usize = 8 * 32 * 8;

/// Warps per output row of a `gemv_bf16` launch over `inp` inputs: one per chunk of the row, so a row
/// is read in one round of loads (a power of two dividing the block's 8 warps).
fn gemv_split(inp: usize) -> usize {
    inp.div_ceil(GEMV_CHUNK).next_power_of_two().min(GEMV_WARPS)
}

/// Shared memory a launch that normalises its input rows may use for them (the default limit).
const NORM_SMEM_BYTES: usize = 48 << 10;
/// `qk_norm_rope_append` keeps a head in a 1024-float shared array.
const MAX_HEAD_DIM: usize = 1024;

/// One matrix of a [`GpuDevice::gemv_bf16`] launch: `y[t, ..out] (=|+=) x[t] · Wᵀ (+ bias)`, W bf16
/// `[out, in]`, the optional f32 bias `[out]` added after the sum (as [`GpuDevice::add_bias`] after the
/// GEMV: the same values, one launch less per biased matrix).
pub struct GemvMat<'a> {
    pub w: &'a CudaSlice<bf16>,
    pub y: &'a mut CudaSlice<f32>,
    pub out: usize,
    pub bias: Option<&'a CudaSlice<f32>>,
}

/// How many blocks a [`GpuDevice::gemv_bf16`] / [`GpuDevice::gemv_bf16_norm`] launch starts (the
/// kernels stride over the output rows, so both compute the same values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvGrid {
    /// One block per 8 / split output rows: a wide matrix runs in several waves of blocks.
    PerRows,
    /// At most the blocks resident at once on the device; each strides over the rows, so a block's
    /// start (and the norm of `gemv_bf16_norm`) is paid once per block instead of once per wave.
    Resident,
    /// At most this many blocks (at least one), striding over the rows.
    AtMost(usize),
}

/// The grid [`GpuDevice::gemv_bf16`] and [`GpuDevice::gemv_bf16_norm`] launch: resident (H200, one
/// process, GLM-4.5-Air shape: the folded q/k/v launch 34.2 µs against 50.2 on a block per rows, the
/// whole segment 89.2 against 111.4; docs/PERF.md, "The decode segment at the GLM-4.5-Air and
/// SmallThinker shapes").
pub const GEMV_GRID: GemvGrid = GemvGrid::Resident;

/// Blocks of the GEMV kernels resident per SM: the 1- and 2-row entries' launch bounds in segment.cu
/// (`GEMV_FEW_ROWS_BLOCKS`, `GEMV_NORM_FEW_ROWS_BLOCKS`), the general entry's ~100 registers.
fn gemv_blocks_per_sm(rows: usize, norm: bool) -> usize {
    match (rows, norm) {
        (1 | 2, false) => 4,
        (1 | 2, true) => 3,
        _ => 2,
    }
}

/// The bf16 K and V caches a [`GpuDevice::qk_norm_rope_append`] writes (`[slots, kv_heads · head_dim]`)
/// and each row's slot (trusted: slots of the caches' blocks, as `kv_append`'s).
pub struct CacheAppend<'a> {
    pub k_cache: &'a mut CudaSlice<bf16>,
    pub v_cache: &'a mut CudaSlice<bf16>,
    pub slot_of_row: &'a CudaSlice<i32>,
}

/// Rows a fused launch RMS-normalises itself before using them (`gemv_bf16_norm`,
/// `router_gemv_topk_norm`): the residual rows `x` (f32 `[rows, in]`), the norm's weights `[in]` and eps.
pub struct NormRows<'a> {
    pub x: &'a CudaSlice<f32>,
    pub w: &'a CudaSlice<f32>,
    pub eps: f32,
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

    /// Whether [`GpuDevice::gemv_bf16_norm`] takes `rows` rows of `inp` inputs (the normalised bf16
    /// rows live in shared memory).
    pub fn gemv_bf16_norm_takes(rows: usize, inp: usize) -> bool {
        Self::gemv_bf16_takes(rows, inp) && rows * inp * 2 <= NORM_SMEM_BYTES
    }

    /// Whether [`GpuDevice::router_gemv_topk_norm`] takes `rows` rows of `inp` inputs for `experts`
    /// experts (the normalised f32 rows and the top-k's arrays live in shared memory).
    pub fn router_norm_takes(rows: usize, inp: usize, experts: usize) -> bool {
        Self::router_fused_takes(rows, inp)
            && (router_topk_floats(experts) + rows * inp) * 4 <= NORM_SMEM_BYTES
    }

    /// `y_m[t] (=|+=) x[t] · W_mᵀ` for every matrix of `mats` (1 to [`GEMV_MATS`]) over the same bf16
    /// input `x` (`[rows, inp]`), in one launch: a warp per 2048 inputs of an output row (one round
    /// of 16-byte weight loads each; their sums added in order), a warp per row up to 2048 inputs. For
    /// `rows ≤ SEGMENT_MAX_ROWS` and `inp % 8 == 0` ([`GpuDevice::gemv_bf16_takes`]); f32 sums as
    /// cuBLAS's up to their order.
    pub fn gemv_bf16(
        &self,
        x: &impl DevicePtr<bf16>,
        (rows, inp): (usize, usize),
        mats: &mut [GemvMat<'_>],
        accumulate: bool,
    ) -> Result<(), GpuError> {
        self.gemv_bf16_grid(x, (rows, inp), mats, accumulate, GEMV_GRID)
    }

    /// [`GpuDevice::gemv_bf16`] launched with `grid_kind`'s blocks (the same values whatever the grid).
    pub fn gemv_bf16_grid(
        &self,
        x: &impl DevicePtr<bf16>,
        (rows, inp): (usize, usize),
        mats: &mut [GemvMat<'_>],
        accumulate: bool,
        grid_kind: GemvGrid,
    ) -> Result<(), GpuError> {
        const OP: &str = "gemv_bf16";
        ensure(OP, Self::gemv_bf16_takes(rows, inp), || {
            format!(
                "{rows} rows of {inp} inputs (1..={SEGMENT_MAX_ROWS} rows, inputs a multiple of 8)"
            )
        })?;
        let xp = self.input(OP, "x", x, rows * inp)?;
        let (args, total) = self.gemv_mats(OP, inp, rows, mats)?;
        if total == 0 {
            return Ok(());
        }
        let (n_i, in_i, acc_i) = (rows as i32, int(OP, "inputs", inp)?, accumulate as i32);
        let split = gemv_split(inp);
        let split_i = split as i32;
        let f = match rows {
            1 => &self.k.gemv_bf16_1,
            2 => &self.k.gemv_bf16_2,
            _ => &self.k.gemv_bf16,
        };
        let mut l = self.stream.launch_builder(f);
        l.arg(&xp).arg(&n_i).arg(&in_i).arg(&acc_i).arg(&split_i);
        for (w, y, out, b) in &args {
            l.arg(w).arg(y).arg(out).arg(b);
        }
        let blocks = self.gemv_blocks(total.div_ceil(GEMV_WARPS / split), rows, false, grid_kind);
        // SAFETY: argument order and types as segment.cu's `gemv_bf16` (its 1- and 2-row entries
        // alike, each taking at least the rows given); the `split` warps of output row r of matrix m
        // (a power of two dividing the block's warps) read W_m's row r (out_m·inp checked), x
        // (rows·inp checked; 16-byte loads: inp % 8 == 0 and device allocations are 256-byte aligned)
        // and bias_m[r] when given (out_m checked), and the first writes y_m[t, r] for t < rows
        // (checked); absent matrices have no rows; blocks stride over the rows past the grid's.
        unsafe { l.launch(grid((blocks, 1, 1), GEMV_THREADS, 0)) }?;
        Ok(())
    }

    /// [`GpuDevice::gemv_bf16`] over `RMSNorm(norm.x)` rounded to bf16 (the attention norm folded
    /// into the q/k/v launch): every block normalises the rows itself while its first weight loads
    /// are in flight, as [`GpuDevice::rms_norm`] does (the same bf16 values, hence the same products
    /// as `rms_norm` then `gemv_bf16`), and block 0 writes them to `normed` (`[rows, inp]`) for the
    /// ops that read them later. Never accumulates. For [`GpuDevice::gemv_bf16_norm_takes`] shapes.
    pub fn gemv_bf16_norm(
        &self,
        norm: &NormRows<'_>,
        (rows, inp): (usize, usize),
        normed: &mut CudaSlice<bf16>,
        mats: &mut [GemvMat<'_>],
    ) -> Result<(), GpuError> {
        self.gemv_bf16_norm_grid(norm, (rows, inp), normed, mats, GEMV_GRID)
    }

    /// [`GpuDevice::gemv_bf16_norm`] launched with `grid_kind`'s blocks (the same values whatever the
    /// grid).
    pub fn gemv_bf16_norm_grid(
        &self,
        norm: &NormRows<'_>,
        (rows, inp): (usize, usize),
        normed: &mut CudaSlice<bf16>,
        mats: &mut [GemvMat<'_>],
        grid_kind: GemvGrid,
    ) -> Result<(), GpuError> {
        const OP: &str = "gemv_bf16_norm";
        ensure(OP, Self::gemv_bf16_norm_takes(rows, inp), || {
            format!(
                "{rows} rows of {inp} inputs (1..={SEGMENT_MAX_ROWS} rows, inputs a multiple of 8, \
                 rows within {NORM_SMEM_BYTES} B of bf16)"
            )
        })?;
        let xp = self.input(OP, "x", norm.x, rows * inp)?;
        let nw = self.input(OP, "norm", norm.w, inp)?;
        let hb = self.output(OP, "normed", normed, rows * inp)?;
        let (args, total) = self.gemv_mats(OP, inp, rows, mats)?;
        if total == 0 {
            return Ok(());
        }
        let (n_i, in_i) = (rows as i32, int(OP, "inputs", inp)?);
        let split = gemv_split(inp);
        let split_i = split as i32;
        let f = match rows {
            1 => &self.k.gemv_bf16_norm_1,
            2 => &self.k.gemv_bf16_norm_2,
            _ => &self.k.gemv_bf16_norm,
        };
        let mut l = self.stream.launch_builder(f);
        l.arg(&xp)
            .arg(&nw)
            .arg(&norm.eps)
            .arg(&n_i)
            .arg(&in_i)
            .arg(&split_i)
            .arg(&hb);
        for (w, y, out, b) in &args {
            l.arg(w).arg(y).arg(out).arg(b);
        }
        let blocks = self.gemv_blocks(total.div_ceil(GEMV_WARPS / split), rows, true, grid_kind);
        // SAFETY: argument order and types as segment.cu's `gemv_bf16_norm` (its 1- and 2-row entries
        // alike, each taking at least the rows given); every block reads the
        // rows x and the norm weights (rows·inp and inp checked) into its shared memory (rows·inp bf16,
        // sized here), block 0 writes them to `normed` (checked); the `split` warps of output row r of
        // matrix m (as `gemv_bf16`'s) read W_m's row r (out_m·inp checked; 16-byte loads: inp % 8 == 0,
        // allocations 256-byte aligned) and bias_m[r] when given (out_m checked), and the first writes
        // y_m[t, r] for t < rows (checked); absent matrices have no rows; blocks stride over the rows
        // past the grid's.
        unsafe { l.launch(grid((blocks, 1, 1), GEMV_THREADS, rows * inp * 2)) }?;
        Ok(())
    }

    /// The matrices' launch arguments (weights, outputs, output rows, biases or 0; checked against
    /// `rows` rows of `inp` inputs) and their output rows in all.
    #[allow(clippy::type_complexity)]
    fn gemv_mats(
        &self,
        op: &str,
        inp: usize,
        rows: usize,
        mats: &mut [GemvMat<'_>],
    ) -> Result<([(u64, u64, i32, u64); GEMV_MATS], usize), GpuError> {
        ensure(op, (1..=GEMV_MATS).contains(&mats.len()), || {
            format!("{} matrices (1..={GEMV_MATS})", mats.len())
        })?;
        let mut args = [(0u64, 0u64, 0i32, 0u64); GEMV_MATS];
        let mut total = 0usize;
        for (a, m) in args.iter_mut().zip(mats.iter_mut()) {
            let w = self.input(op, "w", m.w, m.out * inp)?;
            let y = self.output(op, "y", m.y, rows * m.out)?;
            let b = self.optional(op, "bias", m.bias, m.out)?;
            *a = (w, y, int(op, "out", m.out)?, b);
            total += m.out;
        }
        int(op, "rows of all matrices", total)?;
        Ok((args, total))
    }

    /// Blocks of a GEMV launch whose rows need `per_rows` blocks, by `grid_kind` ([`GemvGrid`]).
    fn gemv_blocks(&self, per_rows: usize, rows: usize, norm: bool, grid_kind: GemvGrid) -> usize {
        match grid_kind {
            GemvGrid::PerRows => per_rows,
            GemvGrid::Resident => per_rows.min(self.sm_count * gemv_blocks_per_sm(rows, norm)),
            GemvGrid::AtMost(blocks) => per_rows.min(blocks.max(1)),
        }
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
        let r = self.rotation_inputs(OP, rope, (rows, head_dim), false)?;
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
        l.arg(&r.positions)
            .arg(&r.inv_freq)
            .arg(&r.attn_factor)
            .arg(&r.rotary_dim)
            .arg(&r.style);
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
    /// k]`), in one launch: two warps per expert, and the last block to finish runs the top-k of
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
        routing: (&mut impl DevicePtrMut<i32>, &mut impl DevicePtrMut<f32>),
        publish: Option<(&HandoffPort, bool)>,
    ) -> Result<(), GpuError> {
        const OP: &str = "router_gemv_topk";
        ensure(OP, Self::router_fused_takes(rows, inp), || {
            format!(
                "{rows} rows of {inp} inputs (1..={SEGMENT_MAX_ROWS} rows, inputs a multiple of 4)"
            )
        })?;
        let input = RouterIn {
            x: self.input(OP, "x", x, rows * inp)?,
            norm: None,
        };
        self.router_launch(OP, input, (rows, inp), router, logits, routing, publish)
    }

    /// [`GpuDevice::router_gemv_topk`] over `RMSNorm(norm.x)` (the FFN norm folded into the router's
    /// launch): every block normalises the rows itself, as [`GpuDevice::rms_norm`] does (the same
    /// values), and the launch writes them to `hb` (bf16) and `hf` (f32) `[rows, inp]` for the ops
    /// after it; the published rows are these. For [`GpuDevice::router_norm_takes`] shapes.
    #[allow(clippy::too_many_arguments)]
    pub fn router_gemv_topk_norm(
        &self,
        norm: &NormRows<'_>,
        (hb, hf): (&mut CudaSlice<bf16>, &mut CudaSlice<f32>),
        (rows, inp): (usize, usize),
        router: &FusedRouter<'_>,
        logits: &mut impl DevicePtrMut<f32>,
        routing: (&mut impl DevicePtrMut<i32>, &mut impl DevicePtrMut<f32>),
        publish: Option<(&HandoffPort, bool)>,
    ) -> Result<(), GpuError> {
        const OP: &str = "router_gemv_topk_norm";
        ensure(
            OP,
            Self::router_norm_takes(rows, inp, router.experts),
            || {
                format!(
                "{rows} rows of {inp} inputs and {} experts (1..={SEGMENT_MAX_ROWS} rows, inputs a \
                 multiple of 4, rows and top-k arrays within {NORM_SMEM_BYTES} B)",
                router.experts
            )
            },
        )?;
        let input = RouterIn {
            x: self.input(OP, "x", norm.x, rows * inp)?,
            norm: Some((
                self.input(OP, "norm", norm.w, inp)?,
                norm.eps,
                self.output(OP, "hb", hb, rows * inp)?,
                self.output(OP, "hf", hf, rows * inp)?,
            )),
        };
        self.router_launch(OP, input, (rows, inp), router, logits, routing, publish)
    }

    /// One `router_gemv_topk` launch (shapes checked by the callers).
    #[allow(clippy::too_many_arguments)]
    fn router_launch(
        &self,
        op: &str,
        input: RouterIn,
        (rows, inp): (usize, usize),
        router: &FusedRouter<'_>,
        logits: &mut impl DevicePtrMut<f32>,
        (ids, weights): (&mut impl DevicePtrMut<i32>, &mut impl DevicePtrMut<f32>),
        publish: Option<(&HandoffPort, bool)>,
    ) -> Result<(), GpuError> {
        let (experts, k) = (router.experts, router.k);
        ensure(op, k <= ROUTER_THREADS, || {
            format!("top-{k} (at most {ROUTER_THREADS})")
        })?;
        let (kind_i, renorm, n_group, topk_group, scaling) = router.kind.args(op, experts, k)?;
        let (n_i, in_i) = (rows as i32, int(op, "inputs", inp)?);
        let (e_i, k_i) = (int(op, "experts", experts)?, int(op, "k", k)?);
        let wp = self.input(op, "w", router.w, experts * inp)?;
        let bp = self.optional(op, "bias", router.bias, experts)?;
        let lp = self.output(op, "logits", logits, rows * experts)?;
        let ip = self.output(op, "ids", ids, rows * k)?;
        let wtp = self.output(op, "weights", weights, rows * k)?;
        let done = self.router_blocks_done.device_ptr(&self.stream).0;
        let target = match publish {
            Some((port, with_rows)) => {
                Some(port.publish_target(op, rows * k, with_rows.then_some(rows * inp))?)
            }
            None => None,
        };
        let [ih, wh, xh, flag, stamps] =
            target.map_or([0; 5], |t| [t.ids, t.w, t.x, t.flag, t.stamps]);
        let (nw, eps, hb, hf) = input.norm.unwrap_or((0, 0.0, 0, 0));
        // the top-k's selection scores and weights and the row of logits it reads back, then the
        // normalised rows
        let rows_smem = if input.norm.is_some() { rows * inp } else { 0 };
        let shared = smem(op, (router_topk_floats(experts) + rows_smem) * 4)?;
        let blocks = experts.div_ceil(ROUTER_EXPERTS_PER_BLOCK);
        let mut l = self.stream.launch_builder(&self.k.router_gemv_topk);
        l.arg(&input.x).arg(&n_i).arg(&in_i);
        l.arg(&nw).arg(&eps).arg(&hb).arg(&hf);
        l.arg(&wp).arg(&e_i).arg(&k_i);
        l.arg(&kind_i).arg(&renorm).arg(&bp).arg(&n_group);
        l.arg(&topk_group).arg(&scaling).arg(&lp).arg(&ip).arg(&wtp);
        l.arg(&done)
            .arg(&ih)
            .arg(&wh)
            .arg(&xh)
            .arg(&flag)
            .arg(&stamps);
        // SAFETY: argument order and types as segment.cu's `router_gemv_topk`; the two warps of expert
        // e read W's row e (experts·inp checked) and the rows x (rows·inp checked; 16-byte loads: inp %
        // 4 == 0, allocations 256-byte aligned) or, normalising, their normalised copy in shared memory
        // (sized above, with the norm weights' inp elements checked), and write logits[t, e];
        // normalising, each thread writes elements of hb and hf (rows·inp checked); the last block
        // reads the logits back and writes each row's k ids and weights (checked; k ≤ the block's
        // threads); the kind's groups fit the 64-bit mask and divide the experts (`args`); the block
        // counter is the device's own, 0 between launches, and launches on the engine stream never
        // overlap. Publishing, it writes rows·k routes and rows·inp row elements (16-byte stores) into
        // the port's mapped buffers (checked by `publish_target`; DEVICEMAP allocations are
        // page-aligned), its stamps and DOWN flag; null addresses otherwise.
        unsafe { l.launch(grid((blocks, 1, 1), ROUTER_THREADS, shared)) }?;
        Ok(())
    }
}

impl GpuDevice {
    /// Fetches the first `len` elements of `x` into L2, marked evict-last (`l2_prefetch`): a
    /// layer's segment weights brought in while the GPU waits for the host, so the segment reads
    /// them from L2. Reads nothing into registers and writes nothing; a hint the hardware may drop.
    pub fn l2_prefetch<T>(&self, x: &impl DevicePtr<T>, len: usize) -> Result<(), GpuError> {
        const OP: &str = "l2_prefetch";
        if len == 0 {
            return Ok(());
        }
        let p = self.input(OP, "x", x, len)?;
        let bytes = (len * size_of::<T>()) as u64;
        let lines = bytes.div_ceil(L2_LINE as u64) as usize;
        let blocks = lines.div_ceil(L2_PREFETCH_THREADS).min(self.sm_count * 4);
        let mut l = self.stream.launch_builder(&self.k.l2_prefetch);
        l.arg(&p).arg(&bytes);
        // SAFETY: argument order and types as segment.cu's `l2_prefetch`; it issues prefetches of
        // addresses inside x's first `len` elements (checked) and touches no memory otherwise.
        unsafe { l.launch(grid((blocks, 1, 1), L2_PREFETCH_THREADS, 0)) }?;
        Ok(())
    }
}

/// Bytes of an L2 line (`l2_prefetch` issues one prefetch per line).
const L2_LINE: usize = 128;
/// Threads of an `l2_prefetch` block.
const L2_PREFETCH_THREADS: usize = 256;

/// `router_gemv_topk`'s input: the rows' device address, and when the launch normalises them itself
/// (norm weights, eps, the bf16 and f32 outputs).
struct RouterIn {
    x: u64,
    norm: Option<(u64, f32, u64, u64)>,
}

/// `router_topk_floats` of segment.cu: the top-k's three arrays of `experts` floats, rounded up to
/// 16 bytes (the normalised rows follow them in shared memory).
fn router_topk_floats(experts: usize) -> usize {
    (3 * experts).next_multiple_of(4)
}
