//! The decode hand-off between the GPU and the CPU expert pool through mapped pinned host memory
//! (`handoff.cu`): the GPU publishes a layer's routing and rows into host memory and raises a flag the
//! host polls; the host writes the CPU experts' sum into host memory and raises a flag the GPU waits
//! on before adding it. No copy and no event per layer: each direction costs one kernel's latency, and
//! the GPU's half can be enqueued before the host has produced its own (see [`HandoffPort`]).
use super::{ensure, int};
use crate::cuda::{GpuDevice, GpuError};
use cudarc::driver::sys;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PinnedHostSlice, PushKernelArg};
use std::sync::atomic::{fence, Ordering};
use std::time::Duration;

/// Threads per block of `handoff_publish`.
const THREADS: usize = 256;
/// `handoff_wait_add`'s block (`WAIT_THREADS` in handoff.cu) and the elements one block adds per
/// stride (`WAIT_LOADS` = 4 float4 loads per thread).
const WAIT_THREADS: usize = 1024;
const WAIT_ELEMS_PER_BLOCK: usize = WAIT_THREADS * 4 * 4;
/// Most blocks one hand-off kernel uses (each block's writes cross PCIe, and each block of a wait polls
/// the flag: more only adds flag traffic).
const MAX_BLOCKS: usize = 64;
/// How long the GPU waits for the host's sum before it gives up and reports it. Decode layers take
/// milliseconds; this only bounds a host that failed between enqueueing the wait and raising the flag.
const GPU_WAIT_TIMEOUT: Duration = Duration::from_secs(20);

/// Pinned host memory mapped into the device's address space: the GPU reads and writes it directly.
/// Host views are raw: ordering against the GPU is the flag protocol's (see [`HandoffPort`]).
pub struct MappedHost<T> {
    _buf: PinnedHostSlice<T>,
    host: *mut T,
    dev: u64,
    len: usize,
}

// SAFETY: the pointers are into the owned allocation; the owner serialises host access (the engine
// holds the buffers under its step lock).
unsafe impl<T> Send for MappedHost<T> {}
unsafe impl<T> Sync for MappedHost<T> {}

impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> MappedHost<T> {
    /// `len` zeroed elements (at least one).
    pub fn new(dev: &GpuDevice, len: usize) -> Result<MappedHost<T>, GpuError> {
        let len = len.max(1);
        // Plain (not write-combined) memory: the host reads what the GPU writes here, and the CPU
        // experts accumulate into it.
        // SAFETY: zeroed below before any read.
        let mut buf = unsafe {
            dev.ctx
                .alloc_pinned_with_flags::<T>(len, sys::CU_MEMHOSTALLOC_DEVICEMAP)?
        };
        let host = buf.as_mut_ptr()?;
        // SAFETY: `host` points at `len` elements of the live allocation; all-zero bits are valid T.
        unsafe { std::ptr::write_bytes(host, 0, len) };
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: `host` was returned by cuMemHostAlloc with DEVICEMAP in this context (bound by the
        // allocation above); flags must be 0.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, host.cast(), 0).result()? };
        Ok(MappedHost {
            _buf: buf,
            host,
            dev: dptr,
            len,
        })
    }
}

impl<T> MappedHost<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first `n` elements as the host sees them.
    ///
    /// # Safety
    /// No GPU work that writes them may be pending or running (the flag protocol says when).
    pub unsafe fn host(&self, n: usize) -> &[T] {
        assert!(n <= self.len, "mapped buffer of {} read at {n}", self.len);
        // SAFETY: in bounds of the live allocation; the caller rules out concurrent GPU writes.
        unsafe { std::slice::from_raw_parts(self.host, n) }
    }

    /// The first `n` elements, writable by the host.
    ///
    /// # Safety
    /// No GPU work that reads or writes them may be pending or running, and no other host view of
    /// them may be alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn host_mut(&self, n: usize) -> &mut [T] {
        assert!(
            n <= self.len,
            "mapped buffer of {} written at {n}",
            self.len
        );
        // SAFETY: in bounds; exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.host, n) }
    }

    /// Device address of element `i` (checked against the length).
    fn dev_at(&self, op: &str, what: &str, i: usize, need: usize) -> Result<u64, GpuError> {
        ensure(op, i + need <= self.len, || {
            format!(
                "{what} holds {} elements, the launch reaches {}",
                self.len,
                i + need
            )
        })?;
        Ok(self.dev + (i * std::mem::size_of::<T>()) as u64)
    }
}

/// Flag slots of a port (one `i32` each).
const DOWN: usize = 0;
const UP: usize = 1;
const TIMED_OUT: usize = 2;
/// Early routing's flag: the routing alone landed (before the layer's attention ran).
const EARLY: usize = 3;

/// One hand-off's buffers and flags. The protocol, per MoE layer with CPU experts:
/// 1. GPU: [`GpuDevice::handoff_publish`] writes ids, weights (and rows) to `ids`, `w`, `x`, then
///    raises DOWN.
/// 2. Host: [`HandoffPort::take_published`] sees DOWN, lowers it, reads `ids`, `w`, `x`; the CPU
///    experts write their sum into `y`; [`HandoffPort::raise_sum`] raises UP.
/// 3. GPU: [`GpuDevice::handoff_wait_add`] (enqueued at any time after step 1 was enqueued) waits for
///    UP, adds `y` into the residual rows, lowers UP.
///
/// One layer is in flight at a time: the GPU only publishes the next layer after it consumed this
/// layer's sum, so a single set of buffers and flags serves every layer.
///
/// Early routing (routers on the layer input, whose routing is known before attention) splits step 1:
/// [`GpuDevice::handoff_publish_early_routing`] writes ids and weights and raises EARLY before the
/// layer's attention, [`GpuDevice::handoff_publish_rows`] writes the rows and raises DOWN after it. The
/// host may read the routing once it sees EARLY ([`HandoffPort::take_early_routing`]) and must lower
/// EARLY before it lets the GPU reach the next layer (the next layer's segment is enqueued after the
/// host's wait for this one, which lowers it: [`HandoffPort::lower_early_routing`]).
pub struct HandoffPort {
    pub ids: MappedHost<i32>,
    pub w: MappedHost<f32>,
    pub x: MappedHost<f32>,
    pub y: MappedHost<f32>,
    flags: MappedHost<i32>,
    /// GPU clock stamps of the last hand-off kernels (`handoff.cu`): [`HandoffStamps`].
    stamps: MappedHost<u64>,
    /// Finished-block counter of the kernels (device memory, 0 between launches; the kernels run one
    /// after the other on the engine stream).
    blocks_done: CudaSlice<u32>,
}

impl HandoffPort {
    /// Room for `routes` (token, expert) pairs and `elems` row elements each way.
    pub fn new(dev: &GpuDevice, routes: usize, elems: usize) -> Result<HandoffPort, GpuError> {
        Ok(HandoffPort {
            ids: MappedHost::new(dev, routes)?,
            w: MappedHost::new(dev, routes)?,
            x: MappedHost::new(dev, elems)?,
            y: MappedHost::new(dev, elems)?,
            flags: MappedHost::new(dev, 4)?,
            stamps: MappedHost::new(dev, 3)?,
            blocks_done: dev.stream.alloc_zeros::<u32>(1)?,
        })
    }

    fn flag(&self, i: usize) -> *mut i32 {
        // SAFETY: i < 4, the flags' length.
        unsafe { self.flags.host.add(i) }
    }

    /// Whether the GPU has published a layer since the last call; lowers the flag when it has.
    /// After `true`, `ids`, `w` and `x` hold the layer's values until the host raises UP.
    pub fn take_published(&self) -> bool {
        // SAFETY: an aligned i32 of the live allocation, written by the GPU: volatile read.
        if unsafe { self.flag(DOWN).read_volatile() } == 0 {
            return false;
        }
        // the GPU's data writes were visible before its flag write: order our reads after the flag
        fence(Ordering::Acquire);
        // SAFETY: as above; the GPU writes DOWN again only after the host raised UP.
        unsafe { self.flag(DOWN).write_volatile(0) };
        true
    }

    /// Whether the GPU has published the layer (DOWN raised), without lowering the flag.
    pub fn published(&self) -> bool {
        // SAFETY: an aligned i32 of the live allocation, written by the GPU: volatile read.
        unsafe { self.flag(DOWN).read_volatile() != 0 }
    }

    /// Whether the early routing of the layer has landed; lowers its flag when it has. After `true`,
    /// `ids` and `w` hold the layer's routing until the host raises UP.
    pub fn take_early_routing(&self) -> bool {
        // SAFETY: as `take_published`.
        if unsafe { self.flag(EARLY).read_volatile() } == 0 {
            return false;
        }
        fence(Ordering::Acquire);
        // SAFETY: as `take_published`; the GPU raises EARLY again only for a later layer.
        unsafe { self.flag(EARLY).write_volatile(0) };
        true
    }

    /// Lowers EARLY (a layer whose early routing the host did not look at), once the layer's DOWN was
    /// taken: the next layer's early routing can only come after the host enqueued its segment.
    pub fn lower_early_routing(&self) {
        // SAFETY: an aligned i32 of the live allocation; no GPU write of it is pending (see above).
        unsafe { self.flag(EARLY).write_volatile(0) };
    }

    /// Tells the GPU the CPU experts' sum is in `y`.
    pub fn raise_sum(&self) {
        // every host write of `y` before the flag (x86 keeps stores in order; the fence keeps the
        // compiler from moving them)
        fence(Ordering::Release);
        // SAFETY: an aligned i32 of the live allocation; the GPU only reads it until it lowers it.
        unsafe { self.flag(UP).write_volatile(1) };
    }

    /// The GPU clock stamps of the last wait-and-add and the last publish. Meaningful for the wait of
    /// layer l and the publish of layer l + 1 once the host took that publish (the stream ran the
    /// wait before it).
    pub fn stamps(&self) -> HandoffStamps {
        // SAFETY: aligned u64s of the live allocation; the GPU writes them only in kernels that come
        // after the host's next flag, so they hold still here (a torn read could only come from a
        // caller breaking that order, and would only skew a profile).
        let s = unsafe { self.stamps.host(3) };
        let read = |i: usize| unsafe { std::ptr::read_volatile(&s[i]) };
        HandoffStamps {
            seen_ns: read(0),
            added_ns: read(1),
            published_ns: read(2),
        }
    }

    /// Clears the flags and reports whether a GPU wait timed out since the last reset. Only while no
    /// hand-off kernel is pending (between steps, after the stream synchronised).
    pub fn reset(&self) -> bool {
        // SAFETY: aligned i32s of the live allocation, and the GPU is idle (the caller's contract).
        unsafe {
            let timed_out = self.flag(TIMED_OUT).read_volatile() != 0;
            for i in [DOWN, UP, TIMED_OUT, EARLY] {
                self.flag(i).write_volatile(0);
            }
            timed_out
        }
    }
}

/// Device addresses a kernel that publishes a layer's routing (and rows) in place of
/// [`GpuDevice::handoff_publish`] writes: ids, weights, rows (0: none), the DOWN flag and the stamps.
pub(crate) struct PublishTarget {
    pub ids: u64,
    pub w: u64,
    pub x: u64,
    pub flag: u64,
    pub stamps: u64,
}

impl HandoffPort {
    /// Where `nk` routes and, when `nx` is given, `nx` row elements are published (checked against
    /// the port's buffers), with the DOWN flag: step 1 of the protocol done by another kernel.
    pub(crate) fn publish_target(
        &self,
        op: &str,
        nk: usize,
        nx: Option<usize>,
    ) -> Result<PublishTarget, GpuError> {
        ensure(op, nk > 0, || "no routes to publish".into())?;
        Ok(PublishTarget {
            ids: self.ids.dev_at(op, "ids_h", 0, nk)?,
            w: self.w.dev_at(op, "w_h", 0, nk)?,
            x: match nx {
                Some(nx) => self.x.dev_at(op, "x_h", 0, nx)?,
                None => 0,
            },
            flag: self.flags.dev_at(op, "flags", DOWN, 1)?,
            stamps: self.stamps.dev_at(op, "stamps", 0, 3)?,
        })
    }
}

/// GPU global-timer stamps (ns) of the hand-off kernels: when the wait saw the host's flag, when its
/// add finished, and when the publish raised its flag.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HandoffStamps {
    pub seen_ns: u64,
    pub added_ns: u64,
    pub published_ns: u64,
}

/// Blocks for `work` items per thread pass (at least one, at most [`MAX_BLOCKS`]).
fn blocks(work: usize) -> usize {
    work.div_ceil(THREADS).clamp(1, MAX_BLOCKS)
}

impl GpuDevice {
    /// Hand-off step 1 (see [`HandoffPort`]): `nk` routed ids and weights and, when `x` is given, its
    /// first `nx` elements into the port's host buffers, then DOWN raised.
    pub fn handoff_publish(
        &self,
        ids: &impl DevicePtr<i32>,
        w: &impl DevicePtr<f32>,
        nk: usize,
        x: Option<(&impl DevicePtr<f32>, usize)>,
        port: &HandoffPort,
    ) -> Result<(), GpuError> {
        const OP: &str = "handoff_publish";
        ensure(OP, nk > 0, || "no routes to publish".into())?;
        let routing = Some((
            self.input(OP, "ids", ids, nk)?,
            self.input(OP, "w", w, nk)?,
            nk,
        ));
        let rows = match x {
            Some((x, nx)) => Some((self.input(OP, "x", x, nx)?, nx)),
            None => None,
        };
        self.publish(OP, routing, rows, port, DOWN)
    }

    /// Early routing's first half of step 1: `nk` routed ids and weights into the port's host
    /// buffers, then EARLY raised (the layer's rows follow with [`GpuDevice::handoff_publish_rows`]).
    pub fn handoff_publish_early_routing(
        &self,
        ids: &impl DevicePtr<i32>,
        w: &impl DevicePtr<f32>,
        nk: usize,
        port: &HandoffPort,
    ) -> Result<(), GpuError> {
        const OP: &str = "handoff_publish_early_routing";
        ensure(OP, nk > 0, || "no routes to publish".into())?;
        let routing = Some((
            self.input(OP, "ids", ids, nk)?,
            self.input(OP, "w", w, nk)?,
            nk,
        ));
        self.publish(OP, routing, None, port, EARLY)
    }

    /// Early routing's second half of step 1: when `x` is given its first `nx` elements into the
    /// port's host buffer, then DOWN raised (the routing already went with EARLY).
    pub fn handoff_publish_rows(
        &self,
        x: Option<(&impl DevicePtr<f32>, usize)>,
        port: &HandoffPort,
    ) -> Result<(), GpuError> {
        const OP: &str = "handoff_publish_rows";
        let rows = match x {
            Some((x, nx)) => Some((self.input(OP, "x", x, nx)?, nx)),
            None => None,
        };
        self.publish(OP, None, rows, port, DOWN)
    }

    /// One `handoff_publish` launch: routing `(ids, w, nk)` and rows `(x, nx)` (device addresses,
    /// checked by the callers) into the port, then flag `slot` raised.
    fn publish(
        &self,
        op: &str,
        routing: Option<(u64, u64, usize)>,
        rows: Option<(u64, usize)>,
        port: &HandoffPort,
        slot: usize,
    ) -> Result<(), GpuError> {
        let (ip, wp, nk) = routing.unwrap_or((0, 0, 0));
        let (xp, nx) = rows.unwrap_or((0, 0));
        let (nk_i, nx_i) = (int(op, "routes", nk)?, int(op, "row elements", nx)?);
        let (ih, wh) = (
            port.ids.dev_at(op, "ids_h", 0, nk)?,
            port.w.dev_at(op, "w_h", 0, nk)?,
        );
        let xh = port.x.dev_at(op, "x_h", 0, nx)?;
        let done = port.blocks_done.device_ptr(&self.stream).0;
        let flag = port.flags.dev_at(op, "flags", slot, 1)?;
        let stamps = port.stamps.dev_at(op, "stamps", 0, 3)?;
        let b = blocks(nk.max(nx / 4));
        let mut l = self.stream.launch_builder(&self.k.handoff_publish);
        l.arg(&ip).arg(&wp).arg(&nk_i).arg(&xp).arg(&nx_i);
        l.arg(&ih)
            .arg(&wh)
            .arg(&xh)
            .arg(&done)
            .arg(&flag)
            .arg(&stamps);
        // SAFETY: argument order and types as handoff.cu's `handoff_publish`; threads read ids, w
        // (nk elements, checked by the caller; not read when nk = 0) and x (nx, checked, or null) and
        // write the mapped host buffers (checked lengths, device addresses of live DEVICEMAP
        // allocations); block counter, flag and stamps are the port's own.
        unsafe { l.launch(super::grid((b, 1, 1), THREADS, 0)) }?;
        Ok(())
    }

    /// Hand-off step 3 (see [`HandoffPort`]): waits for UP, then `x[i] += y[i]` for `n` elements with
    /// `y` read from the port's host buffer; UP is lowered once seen.
    pub fn handoff_wait_add(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        n: usize,
        port: &HandoffPort,
    ) -> Result<(), GpuError> {
        const OP: &str = "handoff_wait_add";
        ensure(OP, n > 0, || "nothing to add".into())?;
        let xp = self.output(OP, "x", x, n)?;
        ensure(OP, xp.is_multiple_of(16), || {
            "x not 16-byte aligned (a view into a buffer)".into()
        })?;
        let yh = port.y.dev_at(OP, "y_h", 0, n)?;
        let flag = port.flags.dev_at(OP, "flags", UP, 1)?;
        let timed_out = port.flags.dev_at(OP, "flags", TIMED_OUT, 1)?;
        let timeout = GPU_WAIT_TIMEOUT.as_nanos() as u64;
        let done = port.blocks_done.device_ptr(&self.stream).0;
        let stamps = port.stamps.dev_at(OP, "stamps", 0, 3)?;
        let b = n.div_ceil(WAIT_ELEMS_PER_BLOCK).clamp(1, MAX_BLOCKS);
        let mut l = self.stream.launch_builder(&self.k.handoff_wait_add);
        l.arg(&xp).arg(&yh).arg(&n).arg(&flag).arg(&timed_out);
        l.arg(&timeout).arg(&done).arg(&stamps);
        // SAFETY: argument order and types as handoff.cu's `handoff_wait_add` (n a size_t, timeout an
        // unsigned long long); threads update x[i < n] (checked; 16-byte accesses: device allocations
        // are 256-byte aligned) from the mapped y (checked length, page-aligned); flags, counter and
        // stamps are the port's own.
        unsafe { l.launch(super::grid((b, 1, 1), WAIT_THREADS, 0)) }?;
        Ok(())
    }
}
