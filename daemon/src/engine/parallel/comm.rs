//! The all-reduce of a tensor-parallel group: each rank's partial sums of a layer's output, summed in
//! place on every rank. Two implementations behind one trait:
//! - [`Nccl`]: NCCL through cudarc (libnccl opened at run time, only when a group of more than one
//!   GPU starts), one communicator per GPU, each used by the thread driving that GPU;
//! - [`Loopback`]: every rank on the SAME GPU (separate buffers and streams), the sum made by device
//!   adds in rank order. It exists to test the sharded math on one GPU; it synchronises the streams
//!   at every reduce, so it is slow by design.
use anyhow::{bail, Context};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use moe_kernels::cuda::GpuDevice;
use std::sync::{Condvar, Mutex};

/// Sums `buf[..len]` over the ranks. Every rank calls it once per reduction point, in the same order.
pub trait Communicator: Send + Sync {
    fn world(&self) -> usize;

    /// `buf[..len]` becomes the sum over all ranks of their `buf[..len]`, in `dev`'s stream order
    /// (the caller's later work on that stream sees the sum).
    fn all_reduce_sum(
        &self,
        rank: usize,
        dev: &GpuDevice,
        buf: &mut CudaSlice<f32>,
        len: usize,
    ) -> anyhow::Result<()>;

    /// A rank failed mid-step: wake the others out of any pending reduction with an error (where the
    /// implementation can).
    fn abort(&self);
}

/// Which implementation a group uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommKind {
    /// One GPU per rank, NCCL all-reduce.
    #[default]
    Nccl,
    /// Every rank on one GPU (tests of the sharded math without a second GPU).
    Loopback,
}

impl std::str::FromStr for CommKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "nccl" => Ok(Self::Nccl),
            "loopback" => Ok(Self::Loopback),
            _ => Err(format!("`{s}`: nccl or loopback")),
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// NCCL

/// One rank's NCCL communicator.
struct RankComm(cudarc::nccl::Comm);

// SAFETY: an NCCL communicator may be used from any thread as long as one thread uses it at a time;
// each sits behind its own mutex and only the thread driving its GPU takes it.
unsafe impl Send for RankComm {}

pub struct Nccl {
    comms: Vec<Mutex<RankComm>>,
}

impl Nccl {
    /// One communicator per stream (each on its own GPU), rank `i` = `streams[i]`.
    pub fn new(devices: &[&GpuDevice]) -> anyhow::Result<Self> {
        // SAFETY: only probes whether the shared library can be opened.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            bail!(
                "tensor parallelism over {} GPUs needs NCCL, and no libnccl.so was found: install NCCL \
                 (Debian/Ubuntu libnccl2, or the nvidia-nccl wheel) and make it loadable as libnccl.so \
                 (e.g. a libnccl.so → libnccl.so.2 link in a directory of LD_LIBRARY_PATH)",
                devices.len()
            );
        }
        let streams = devices.iter().map(|d| d.stream.clone()).collect();
        let comms = cudarc::nccl::Comm::from_devices(streams)
            .map_err(|e| anyhow::anyhow!("NCCL communicator setup: {e:?}"))?;
        Ok(Self {
            comms: comms.into_iter().map(|c| Mutex::new(RankComm(c))).collect(),
        })
    }
}

impl Communicator for Nccl {
    fn world(&self) -> usize {
        self.comms.len()
    }

    fn all_reduce_sum(
        &self,
        rank: usize,
        _dev: &GpuDevice,
        buf: &mut CudaSlice<f32>,
        len: usize,
    ) -> anyhow::Result<()> {
        let comm = self.comms.get(rank).context("rank outside the group")?;
        let comm = comm.lock().unwrap_or_else(|e| e.into_inner());
        comm.0
            .all_reduce_in_place(&mut buf.slice_mut(..len), &cudarc::nccl::ReduceOp::Sum)
            .map_err(|e| anyhow::anyhow!("NCCL all-reduce on rank {rank}: {e:?}"))?;
        Ok(())
    }

    fn abort(&self) {
        // cudarc aborts a communicator only when it is dropped; a failed step is reported by the
        // failing rank, and the group is not used again (see docs/MULTI-GPU.md).
    }
}

// ---------------------------------------------------------------------------------------------------
// Loopback

/// Barrier state: the generation counts completed barriers.
struct Gate {
    arrived: usize,
    generation: u64,
    aborted: bool,
    /// Each rank's buffer of the reduction in progress (device pointers in the one context).
    bufs: Vec<u64>,
}

pub struct Loopback {
    world: usize,
    gate: Mutex<Gate>,
    cv: Condvar,
    /// Rank 0's staging copy of another rank's partial sums.
    scratch: Mutex<Option<CudaSlice<f32>>>,
}

impl Loopback {
    pub fn new(world: usize) -> Self {
        Self {
            world,
            gate: Mutex::new(Gate {
                arrived: 0,
                generation: 0,
                aborted: false,
                bufs: vec![0; world],
            }),
            cv: Condvar::new(),
            scratch: Mutex::new(None),
        }
    }

    /// Waits until every rank arrived (or one aborted).
    fn barrier(&self) -> anyhow::Result<()> {
        let mut g = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        if g.aborted {
            bail!("another rank of the tensor-parallel group failed");
        }
        let generation = g.generation;
        g.arrived += 1;
        if g.arrived == self.world {
            g.arrived = 0;
            g.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        while g.generation == generation && !g.aborted {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        if g.aborted {
            bail!("another rank of the tensor-parallel group failed");
        }
        Ok(())
    }
}

impl Communicator for Loopback {
    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(
        &self,
        rank: usize,
        dev: &GpuDevice,
        buf: &mut CudaSlice<f32>,
        len: usize,
    ) -> anyhow::Result<()> {
        let s = &dev.stream;
        let bytes = len * std::mem::size_of::<f32>();
        anyhow::ensure!(
            buf.len() >= len,
            "all-reduce of {len} values in a buffer of {}",
            buf.len()
        );
        // This rank's partial sums are complete once its stream is idle.
        s.synchronize()?;
        let ptr = {
            let (p, _sync) = buf.device_ptr(s);
            p
        };
        self.gate.lock().unwrap_or_else(|e| e.into_inner()).bufs[rank] = ptr;
        self.barrier()?;
        if rank == 0 {
            let peers: Vec<u64> =
                self.gate.lock().unwrap_or_else(|e| e.into_inner()).bufs[1..].to_vec();
            let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            if scratch.as_ref().is_none_or(|t| t.len() < len) {
                *scratch = Some(s.alloc_zeros::<f32>(len)?);
            }
            let t = scratch.as_mut().context("loopback scratch")?;
            for &p in &peers {
                let (dst, _sync) = t.device_ptr_mut(s);
                // SAFETY: `p` is a peer's f32 buffer of at least `len` values in this same context,
                // idle (its stream was synchronised before the barrier) and not touched by its rank
                // until the second barrier; `dst` holds `len` values.
                unsafe { cudarc::driver::result::memcpy_dtod_async(dst, p, bytes, s.cu_stream()) }?;
                drop(_sync);
                dev.add_inplace(buf, &*t, len)?;
            }
            let (src, _sync) = buf.device_ptr(s);
            for &p in &peers {
                // SAFETY: as above; the sum is copied back into each peer's buffer.
                unsafe { cudarc::driver::result::memcpy_dtod_async(p, src, bytes, s.cu_stream()) }?;
            }
            drop(_sync);
            s.synchronize()?;
        }
        self.barrier()
    }

    fn abort(&self) {
        let mut g = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        g.aborted = true;
        self.cv.notify_all();
    }
}
