//! Fused causal GQA attention of a long prompt (`flash_attention.cu`): the queries of one chunk against
//! contiguous bf16 K/V rows (what [`GpuDevice::gather_kv`] writes from the paged cache), with the
//! softmax computed online per tile of keys, so the `heads · rows · keys` score matrix of the GEMM
//! path never reaches memory. Tensor-core tiles (bf16 in, f32 accumulation), the group's query heads
//! sharing each K/V tile. One NVRTC module per head dim, compiled on first use (~1 s: the tiles are
//! fully unrolled), so only models that use it pay for it, once per process.
use super::{ensure, grid, grid_dim, int};
use crate::cuda::{GpuDevice, GpuError};
use cudarc::driver::{CudaFunction, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;
use std::sync::Mutex;

/// Head dims the fused kernel is built for (one instantiation each); others take the GEMM path.
pub const FLASH_HEAD_DIMS: [usize; 3] = [32, 64, 128];
/// Entry points of a flash module: blocks of 4 and of 8 warps.
pub const ENTRIES: [&str; 2] = ["flash_prefill_w4", "flash_prefill_w8"];

/// The module's source for heads of `head_dim`.
pub fn source(head_dim: usize) -> String {
    format!(
        "#define FA_HEAD_DIM {head_dim}\n{}{}",
        include_str!("../common.cuh"),
        include_str!("../flash_attention.cu")
    )
}

/// Loaded flash modules' entries (as [`ENTRIES`]), by position of the head dim in
/// [`FLASH_HEAD_DIMS`].
#[derive(Default)]
pub(crate) struct FlashModules(Mutex<[Option<[CudaFunction; 2]>; 3]>);

/// Packed (query row, head of the group) rows per warp of a block.
const ROWS_PER_WARP: usize = 16;

/// Warps of a block, each 16 packed rows: more rows per block load each K/V tile fewer times per query
/// row; fewer keep more blocks per SM (4 warps: three blocks, 8: one, at head dim 128).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FlashBlock {
    #[default]
    Warps4,
    Warps8,
}

impl FlashBlock {
    fn warps(self) -> usize {
        match self {
            FlashBlock::Warps4 => 4,
            FlashBlock::Warps8 => 8,
        }
    }
}

/// Head geometry, scaling and block size of one fused attention call.
#[derive(Clone, Copy, Debug)]
pub struct FlashShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies `q · k` before the softmax.
    pub scale: f32,
    /// Sliding window: a query at position p sees keys `p - window + 1..=p`.
    pub window: Option<usize>,
    pub block: FlashBlock,
}

/// The query rows of one call: rows `row0..row0 + rows` of the step, at positions
/// `pos0..pos0 + rows` of their sequence (positions before `pos0` are a cached prefix in K/V).
#[derive(Clone, Copy, Debug)]
pub struct QueryRows {
    pub row0: usize,
    pub rows: usize,
    pub pos0: usize,
}

impl GpuDevice {
    /// Whether [`GpuDevice::flash_prefill`] takes heads of `head_dim`.
    pub fn flash_prefill_supports(head_dim: usize) -> bool {
        FLASH_HEAD_DIMS.contains(&head_dim)
    }

    /// The kernel for heads of `FLASH_HEAD_DIMS[which]` in blocks of `block`, compiling its module
    /// the first time.
    fn flash_kernel(&self, which: usize, block: FlashBlock) -> Result<CudaFunction, GpuError> {
        let mut loaded = self.flash.0.lock().unwrap_or_else(|e| e.into_inner());
        if loaded[which].is_none() {
            let module = super::super::load_source(
                &self.ctx,
                self.capability,
                &source(FLASH_HEAD_DIMS[which]),
            )?;
            let f = |n: &str| module.load_function(n);
            loaded[which] = Some([f(ENTRIES[0])?, f(ENTRIES[1])?]);
        }
        let entries = loaded[which].as_ref().expect("loaded above");
        Ok(entries[(block == FlashBlock::Warps8) as usize].clone())
    }

    /// Causal attention of query rows `at` (`q`: f32 `[step rows, heads · head_dim]`) over keys
    /// `0..at.pos0 + at.rows` of `k` / `v` (bf16 rows of `k_width` / `v_width`, KV head g at columns
    /// `g · head_dim`), into the same rows of `out` (bf16, `q`'s layout). Query head h reads KV head
    /// `h / (heads / kv_heads)`. The products run in bf16 (q rounded, probabilities rounded before
    /// `P · V`) with f32 accumulation and an f32 softmax, like the GEMM path.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_prefill(
        &self,
        q: &impl DevicePtr<f32>,
        at: QueryRows,
        (k, v): (&impl DevicePtr<bf16>, &impl DevicePtr<bf16>),
        (k_width, v_width): (usize, usize),
        shape: FlashShape,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<(), GpuError> {
        const OP: &str = "flash_prefill";
        let FlashShape {
            heads,
            kv_heads,
            head_dim: dh,
            scale,
            window,
            block,
        } = shape;
        if at.rows == 0 {
            return Ok(());
        }
        let which = FLASH_HEAD_DIMS.iter().position(|&d| d == dh);
        let which = which.ok_or_else(|| {
            GpuError::Shape(format!(
                "{OP}: head_dim {dh} (built for {FLASH_HEAD_DIMS:?})"
            ))
        })?;
        ensure(OP, kv_heads > 0 && heads % kv_heads == 0, || {
            format!("{heads} heads over {kv_heads} KV heads")
        })?;
        let group = heads / kv_heads;
        // 16-byte rows: K/V tiles are copied in 16-byte pieces, q read as float4
        for (what, w) in [("k_width", k_width), ("v_width", v_width)] {
            ensure(OP, w >= kv_heads * dh && w % 8 == 0, || {
                format!("{what} {w} for {kv_heads} KV heads of {dh} (a multiple of 8 needed)")
            })?;
        }
        grid_dim(OP, "kv_heads", kv_heads)?;
        let width = heads * dh;
        let keys = at.pos0 + at.rows;
        let end = at.row0 + at.rows;
        let tiles = (at.rows * group).div_ceil(ROWS_PER_WARP * block.warps());
        let args = (
            int(OP, "width", width)?,
            int(OP, "k_width", k_width)?,
            int(OP, "v_width", v_width)?,
            int(OP, "rows", at.rows)?,
            int(OP, "pos0", at.pos0)?,
            int(OP, "group", group)?,
            int(OP, "window", window.unwrap_or(0))?,
        );
        int(OP, "packed rows", at.rows * group)?;
        int(OP, "keys", keys)?;
        int(OP, "tiles", tiles)?;
        let (w, kw, vw, rows, pos0, grp, win) = args;
        let qp = self.input(OP, "q", q, end * width)? + (at.row0 * width * 4) as u64;
        let kp = self.input(OP, "k", k, keys * k_width)?;
        let vp = self.input(OP, "v", v, keys * v_width)?;
        let op = self.output(OP, "out", out, end * width)? + (at.row0 * width * 2) as u64;
        ensure(OP, [qp, kp, vp, op].iter().all(|a| a % 16 == 0), || {
            "buffers not 16-byte aligned".into()
        })?;
        let scale_log2 = scale * std::f32::consts::LOG2_E;
        let kernel = self.flash_kernel(which, block)?;
        let mut l = self.stream.launch_builder(&kernel);
        l.arg(&qp)
            .arg(&w)
            .arg(&kp)
            .arg(&kw)
            .arg(&vp)
            .arg(&vw)
            .arg(&op);
        l.arg(&rows).arg(&pos0).arg(&grp).arg(&scale_log2).arg(&win);
        // SAFETY: argument order and types as flash_attention.cu's `flash_prefill_w*`; block (b, g)
        // reads q rows row0..row0 + rows (checked, offset included) at KV head g's query heads,
        // K/V rows below pos0 + rows (checked) at columns g·dh..(g+1)·dh ≤ width (checked), and
        // writes the same rows and columns of out (checked); every address is 16-byte aligned
        // (checked) and the row widths multiples of the kernel's vector loads (checked).
        unsafe { l.launch(grid((tiles, kv_heads, 1), 32 * block.warps(), 0)) }?;
        Ok(())
    }
}
