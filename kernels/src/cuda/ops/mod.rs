//! The typed op layer over `kernels.cu`: one safe method of [`GpuDevice`] per kernel, which checks the
//! extents of the buffers it is handed against the shape it is told, computes the kernel's launch
//! configuration and enqueues it on the engine stream. Nothing outside `kernels/src/cuda` launches a
//! kernel; callers see shapes, `Option`s for optional inputs and enums for kinds, never argument
//! lists, null addresses or kernel codes.
//!
//! What "safe" covers: every extent the host knows (rows, widths, heads, buffer lengths) is checked
//! before the launch, and a mismatch is a [`GpuError::Shape`] naming the op and the buffer. What it
//! cannot cover without a device round trip: the *values* of device-resident index buffers (token ids,
//! cache slots, block tables, routed expert ids, CSR offsets). Those are built by the engine from
//! inputs it validated (the scheduler refuses out-of-vocabulary ids, the block manager hands out
//! tables inside its pool, the router kernel writes ids below `experts`); each op's doc names the ones
//! it trusts.
//!
//! Layout: `norm` (RMSNorm, per-head norm + RoPE, MLA's latent split), `attention` (paged caches,
//! MLA, the long-prefill softmax), `flash_attention` (long prefill's fused attention), `moe` (router, row gathers and scatters, gated activations, packed
//! expert unpacking), `elementwise` (adds, embedding rows, bf16 conversion), `handoff` (the decode hand-off with the CPU
//! experts through mapped host memory), `segment` (the decode segment's fused GEMV, norm + RoPE + append
//! and router + top-k). `reference` holds slow
//! host versions of the ops whose numerics the GPU tests compare against.
//!
//! Launches are asynchronous: an op returns once the kernel is enqueued. Buffers passed in must stay
//! allocated until the stream has run it (every caller keeps them for at least the step).
use super::{GpuDevice, GpuError};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};

pub mod attention;
pub mod elementwise;
pub mod flash_attention;
pub mod handoff;
pub mod moe;
pub mod norm;
pub mod reference;
pub mod segment;

pub use attention::{CacheRows, MlaDims, PagedIndex};
pub use flash_attention::{FlashBlock, FlashShape, QueryRows, FLASH_HEAD_DIMS};
pub use handoff::{HandoffPort, HandoffStamps, MappedHost};
pub use moe::{ExpertUnpacker, GateActivation, RouterKind, UnpackFormat};
pub use norm::{RotaryStyle, Rotation};
pub use segment::{
    CacheAppend, FusedRouter, GemvGrid, GemvMat, NormRows, FUSED_SEGMENT_ROWS, GEMV_GRID,
    SEGMENT_MAX_ROWS,
};

/// Default dynamic shared memory a kernel may take without opting in (48 KiB on every supported GPU).
const MAX_DYNAMIC_SMEM: usize = 48 << 10;

/// `grid` blocks of `block` threads, `smem` bytes of dynamic shared memory.
pub(crate) fn grid(grid: (usize, usize, usize), block: usize, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
        block_dim: (block as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

/// One thread per element, in blocks of 1024 (cudarc's `for_num_elems`).
pub(crate) fn per_elem(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems(n as u32)
}

/// `v` as a kernel's `int`, or a shape error naming `what`.
pub(crate) fn int(op: &str, what: &str, v: usize) -> Result<i32, GpuError> {
    i32::try_from(v).map_err(|_| GpuError::Shape(format!("{op}: {what} = {v} exceeds a CUDA int")))
}

/// The two extents of a launch over `rows` rows (tokens, routed rows…) of `cols` each, named `what`,
/// as the kernel's ints: `None` when there are no rows (the op enqueues nothing), a shape error when
/// either does not fit a CUDA int.
pub(crate) fn rows_cols(
    op: &str,
    what: (&str, &str),
    (rows, cols): (usize, usize),
) -> Result<Option<(i32, i32)>, GpuError> {
    if rows == 0 {
        return Ok(None);
    }
    Ok(Some((int(op, what.0, rows)?, int(op, what.1, cols)?)))
}

/// Fails unless `cond`, with `msg` (built only on failure) prefixed by the op's name.
pub(crate) fn ensure(op: &str, cond: bool, msg: impl FnOnce() -> String) -> Result<(), GpuError> {
    if cond {
        Ok(())
    } else {
        Err(GpuError::Shape(format!("{op}: {}", msg())))
    }
}

/// Fails unless a buffer `what` of `len` elements holds the `need` the kernel reaches.
pub(crate) fn holds(op: &str, what: &str, len: usize, need: usize) -> Result<(), GpuError> {
    ensure(op, len >= need, || {
        format!("{what} holds {len} elements, the launch reaches {need}")
    })
}

/// A grid dimension or launch that would be empty or too large for the hardware.
pub(crate) fn grid_dim(op: &str, what: &str, v: usize) -> Result<(), GpuError> {
    // y and z grid dimensions are limited to 65535; x to 2^31 - 1 (checked by `int`).
    ensure(op, v <= 65_535, || {
        format!("{what} = {v} exceeds a grid dimension")
    })
}

pub(crate) fn smem(op: &str, bytes: usize) -> Result<usize, GpuError> {
    ensure(op, bytes <= MAX_DYNAMIC_SMEM, || {
        format!("needs {bytes} B of shared memory, more than {MAX_DYNAMIC_SMEM}")
    })?;
    Ok(bytes)
}

/// Address of a buffer an op reads on `stream`, after checking it holds `need` elements.
pub(crate) fn input_on<T>(
    stream: &CudaStream,
    (op, what): (&str, &str),
    x: &impl DevicePtr<T>,
    need: usize,
) -> Result<u64, GpuError> {
    holds(op, what, x.len(), need)?;
    Ok(x.device_ptr(stream).0)
}

/// Address of a buffer an op writes on `stream`, after checking it holds `need` elements.
pub(crate) fn output_on<T>(
    stream: &CudaStream,
    (op, what): (&str, &str),
    x: &mut impl DevicePtrMut<T>,
    need: usize,
) -> Result<u64, GpuError> {
    holds(op, what, x.len(), need)?;
    Ok(x.device_ptr_mut(stream).0)
}

impl GpuDevice {
    /// Address of a buffer an op reads, after checking it holds `need` elements.
    pub(crate) fn input<T>(
        &self,
        op: &str,
        what: &str,
        x: &impl DevicePtr<T>,
        need: usize,
    ) -> Result<u64, GpuError> {
        input_on(&self.stream, (op, what), x, need)
    }

    /// Address of a buffer an op writes, after checking it holds `need` elements.
    pub(crate) fn output<T>(
        &self,
        op: &str,
        what: &str,
        x: &mut impl DevicePtrMut<T>,
        need: usize,
    ) -> Result<u64, GpuError> {
        output_on(&self.stream, (op, what), x, need)
    }

    /// Address of an optional input (0, the kernels' "absent", for `None`).
    pub(crate) fn optional<T>(
        &self,
        op: &str,
        what: &str,
        x: Option<&impl DevicePtr<T>>,
        need: usize,
    ) -> Result<u64, GpuError> {
        x.map_or(Ok(0), |x| self.input(op, what, x, need))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_name_the_op_and_buffer() {
        let e = holds("rms_norm", "x", 10, 12).unwrap_err().to_string();
        assert!(e.contains("rms_norm") && e.contains("x holds 10"), "{e}");
        assert!(holds("rms_norm", "x", 12, 12).is_ok());
        assert!(int("op", "rows", 1 << 31).is_err());
        assert_eq!(int("op", "rows", 7).unwrap(), 7);
        assert!(grid_dim("op", "heads", 65_536).is_err());
        assert!(smem("op", 49 << 10).is_err());
        assert_eq!(smem("op", 1024).unwrap(), 1024);
        assert_eq!(
            rows_cols("op", ("rows", "dim"), (0, 1 << 40)).unwrap(),
            None
        );
        assert_eq!(
            rows_cols("op", ("rows", "dim"), (3, 64)).unwrap(),
            Some((3, 64))
        );
        let e = rows_cols("op", ("tokens", "dim"), (2, 1 << 31)).unwrap_err();
        assert!(e.to_string().contains("dim = 2147483648"), "{e}");
    }

    #[test]
    fn launch_shapes() {
        let c = grid((5, 3, 1), 128, 64);
        assert_eq!(
            (c.grid_dim, c.block_dim, c.shared_mem_bytes),
            ((5, 3, 1), (128, 1, 1), 64)
        );
        // 1024 threads per block, rounded up
        assert_eq!(per_elem(2049).grid_dim, (3, 1, 1));
    }
}
