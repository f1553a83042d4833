//! The per-layer hand-off between GPU and host: pinned buffers the routing and activations are copied
//! into, and the CPU experts' sum is copied out of.
use cudarc::driver::PinnedHostSlice;
use moe_kernels::cuda::GpuDevice;

/// Pinned host buffers of the per-layer hand-off: routing ids and weights and the normalised
/// activations down, the CPU experts' sum up. Copies into and out of pinned memory are asynchronous, so
/// a layer waits for the GPU once. One set per batch-size class of step buffers (`buffers`).
pub struct Handoff {
    pub(super) ids: Pinned<i32>,
    pub(super) w: Pinned<f32>,
    pub(super) x: Pinned<f32>,
    pub(super) y: Pinned<f32>,
}

impl Handoff {
    pub(super) fn new(dev: &GpuDevice, routes: usize, elems: usize) -> anyhow::Result<Handoff> {
        Ok(Handoff {
            ids: Pinned::new(dev, routes)?,
            w: Pinned::new(dev, routes)?,
            x: Pinned::new(dev, elems)?,
            y: Pinned::new(dev, elems)?,
        })
    }
}

/// Pinned host memory read and written through a raw pointer taken once: no event synchronisation on
/// access (cudarc's accessors synchronise an event, which a graph capture may refuse). Ordering
/// against the copies is the caller's: it reads after the stream synchronised and writes only what no
/// pending copy still reads.
pub(super) struct Pinned<T> {
    _buf: PinnedHostSlice<T>,
    ptr: *mut T,
    len: usize,
}

// SAFETY: the pointer is into the owned allocation; every access goes through the model's mutex.
unsafe impl<T> Send for Pinned<T> {}

impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> Pinned<T> {
    pub(super) fn new(dev: &GpuDevice, n: usize) -> anyhow::Result<Pinned<T>> {
        // Plain (not write-combined) pinned memory: the host reads what the GPU writes here.
        // SAFETY: every element is written (by a copy or by the host) before it is read.
        let mut buf = unsafe { dev.ctx.alloc_pinned_with_flags::<T>(n.max(1), 0)? };
        let ptr = buf.as_mut_ptr()?;
        Ok(Pinned {
            len: buf.len(),
            _buf: buf,
            ptr,
        })
    }

    /// The first `n` elements (panics beyond the allocation).
    pub(super) fn slice(&self, n: usize) -> &[T] {
        assert!(n <= self.len);
        // SAFETY: in bounds of the live allocation; see the type's note on ordering.
        unsafe { std::slice::from_raw_parts(self.ptr, n) }
    }

    pub(super) fn slice_mut(&mut self, n: usize) -> &mut [T] {
        assert!(n <= self.len);
        // SAFETY: as in `slice`, and `&mut self` makes this the only host view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, n) }
    }
}
