//! The all-reduce of a tensor-parallel group: each rank's partial sums of a layer's output, summed in
//! place on every rank. Two implementations behind one trait:
//! - [`Nccl`]: NCCL through cudarc (libnccl opened at run time, only when a group of more than one
//!   GPU starts), one communicator per GPU, each used by the thread driving that GPU;
//! - [`Loopback`]: every rank on the SAME GPU (separate buffers and streams), the sum made by device
//!   adds in rank order, stream-ordered through events as NCCL's is. It exists to test the sharded
//!   math on one GPU; its hosts meet at every reduce (a [`Rendezvous`] with a deadline, so a rank
//!   whose peers are not stepping fails with the ranks it waited for instead of hanging).
use anyhow::{bail, Context};
use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr, DevicePtrMut};
use moe_kernels::cuda::GpuDevice;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

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

    /// Before a step of the group, when no rank is inside a reduction: forget an earlier step's
    /// abort (where the implementation can recover from one), so one failed step (a warm-up that
    /// ran out of memory, say) does not fail every later one.
    fn reset(&self) {}
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

/// How long a rank waits at a loopback all-reduce for the others before it gives up (a peer that is
/// not stepping would otherwise leave it waiting forever). Far above any fixture's step.
pub const LOOPBACK_WAIT: Duration = Duration::from_secs(60);

/// Why a rank left a rendezvous without the others.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RendezvousError {
    #[error("another rank of the tensor-parallel group failed")]
    Aborted,
    #[error("tensor-parallel rank {rank} waited {waited_s} s at reduction {reduction} for rank(s) {missing:?}, which never arrived: a rank is not stepping (a step must run on every rank, through the group)")]
    TimedOut {
        rank: usize,
        reduction: u64,
        waited_s: u64,
        missing: Vec<usize>,
    },
}

/// A host-side barrier of the group's ranks with a deadline: every rank calls [`Rendezvous::meet`]
/// once per meeting point, in the same order; a rank that waits longer than the deadline fails, and
/// so does every other waiting rank (the group is aborted), each with the ranks that never came.
pub struct Rendezvous {
    world: usize,
    wait: Duration,
    gate: Mutex<Gate>,
    cv: Condvar,
}

/// Barrier state: the generation counts completed meetings.
struct Gate {
    arrived: Vec<bool>,
    generation: u64,
    aborted: bool,
}

impl Rendezvous {
    pub fn new(world: usize, wait: Duration) -> Self {
        Self {
            world,
            wait,
            gate: Mutex::new(Gate {
                arrived: vec![false; world],
                generation: 0,
                aborted: false,
            }),
            cv: Condvar::new(),
        }
    }

    /// Waits until every rank arrived at this meeting (or one failed, or the deadline passed).
    pub fn meet(&self, rank: usize) -> Result<(), RendezvousError> {
        let mut g = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        if g.aborted {
            return Err(RendezvousError::Aborted);
        }
        let generation = g.generation;
        g.arrived[rank] = true;
        if g.arrived.iter().all(|&a| a) {
            g.arrived.fill(false);
            g.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + self.wait;
        while g.generation == generation && !g.aborted {
            let now = Instant::now();
            if now >= deadline {
                let missing = (0..self.world).filter(|&r| !g.arrived[r]).collect();
                g.aborted = true;
                self.cv.notify_all();
                return Err(RendezvousError::TimedOut {
                    rank,
                    reduction: generation,
                    waited_s: self.wait.as_secs(),
                    missing,
                });
            }
            g = self
                .cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        if g.generation == generation {
            return Err(RendezvousError::Aborted);
        }
        Ok(())
    }

    /// Wakes every waiting rank with an error; later meetings fail at once (until [`Self::reset`]).
    pub fn abort(&self) {
        let mut g = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        g.aborted = true;
        self.cv.notify_all();
    }

    /// A fresh start: nobody arrived, not aborted. Only while no rank waits in [`Self::meet`].
    pub fn reset(&self) {
        let mut g = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        g.arrived.fill(false);
        g.aborted = false;
    }
}

/// What the ranks of a loopback reduction exchange at its two meetings.
#[derive(Default)]
struct Exchange {
    /// Each rank's buffer (device pointers in the one GPU's context) and the event its partial sums
    /// are complete at.
    bufs: Vec<u64>,
    ready: Vec<Option<CudaEvent>>,
    /// Rank 0's event after the sum was copied into every buffer.
    summed: Option<Arc<CudaEvent>>,
}

/// Every rank on one GPU. Stream-ordered as NCCL is: each rank records an event after its partial
/// sums; rank 0's stream waits for the others', adds their buffers into its own in rank order and
/// copies the sum back into theirs; their streams wait for that. The hosts only meet (twice per
/// reduction, to exchange pointers and events), so no host waits for a GPU inside a reduction: steps
/// that enqueue work a host flag releases later (pipelined decode) run as they do with NCCL.
pub struct Loopback {
    world: usize,
    meet: Rendezvous,
    exchange: Mutex<Exchange>,
    /// Rank 0's staging copy of another rank's partial sums.
    scratch: Mutex<Option<CudaSlice<f32>>>,
}

impl Loopback {
    pub fn new(world: usize) -> Self {
        Self::with_wait(world, LOOPBACK_WAIT)
    }

    /// A group whose ranks give up after `wait` at a reduction the others do not reach.
    pub fn with_wait(world: usize, wait: Duration) -> Self {
        Self {
            world,
            meet: Rendezvous::new(world, wait),
            exchange: Mutex::new(Exchange {
                bufs: vec![0; world],
                ready: (0..world).map(|_| None).collect(),
                summed: None,
            }),
            scratch: Mutex::new(None),
        }
    }

    fn exchange(&self) -> std::sync::MutexGuard<'_, Exchange> {
        self.exchange.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rank 0's part: the sum into `buf` and every peer's buffer, in its stream's order.
    fn sum_on_rank0(
        &self,
        dev: &GpuDevice,
        buf: &mut CudaSlice<f32>,
        len: usize,
    ) -> anyhow::Result<()> {
        let s = &dev.stream;
        let bytes = len * std::mem::size_of::<f32>();
        let peers: Vec<(u64, CudaEvent)> = {
            let mut x = self.exchange();
            let bufs = x.bufs.clone();
            (1..self.world)
                .map(|r| {
                    let ev = x.ready[r]
                        .take()
                        .context("a peer's partial sums without an event")?;
                    Ok((bufs[r], ev))
                })
                .collect::<anyhow::Result<_>>()?
        };
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if scratch.as_ref().is_none_or(|t| t.len() < len) {
            *scratch = Some(s.alloc_zeros::<f32>(len)?);
        }
        let t = scratch.as_mut().context("loopback scratch")?;
        for (p, ev) in &peers {
            s.wait(ev)?;
            let (dst, sync) = t.device_ptr_mut(s);
            // SAFETY: `p` is a peer's f32 buffer of at least `len` values in this same context; this
            // stream waited for the event its rank recorded after its partial sums, and the rank
            // enqueues nothing more on it until its stream waits for `summed`; `dst` holds `len`.
            unsafe { cudarc::driver::result::memcpy_dtod_async(dst, *p, bytes, s.cu_stream()) }?;
            drop(sync);
            dev.add_inplace(buf, &*t, len)?;
        }
        let (src, sync) = buf.device_ptr(s);
        for (p, _) in &peers {
            // SAFETY: as above; the sum is copied back into each peer's buffer.
            unsafe { cudarc::driver::result::memcpy_dtod_async(*p, src, bytes, s.cu_stream()) }?;
        }
        drop(sync);
        self.exchange().summed = Some(Arc::new(s.record_event(None)?));
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
        anyhow::ensure!(
            buf.len() >= len,
            "all-reduce of {len} values in a buffer of {}",
            buf.len()
        );
        anyhow::ensure!(
            rank < self.world,
            "rank {rank} outside a group of {}",
            self.world
        );
        let ready = s.record_event(None)?;
        let ptr = {
            let (p, _sync) = buf.device_ptr(s);
            p
        };
        {
            let mut x = self.exchange();
            x.bufs[rank] = ptr;
            x.ready[rank] = Some(ready);
        }
        self.meet.meet(rank)?;
        if rank == 0 {
            if let Err(e) = self.sum_on_rank0(dev, buf, len) {
                self.meet.abort();
                return Err(e);
            }
        }
        self.meet.meet(rank)?;
        if rank != 0 {
            // rank 0 replaces `summed` only after the next reduction's first meeting, which this
            // rank has not reached yet
            let summed = self.exchange().summed.clone();
            let summed = summed.context("the group's sum without an event")?;
            s.wait(&summed)?;
        }
        Ok(())
    }

    fn abort(&self) {
        self.meet.abort();
    }

    fn reset(&self) {
        self.meet.reset();
        let mut x = self.exchange();
        x.ready.iter_mut().for_each(|e| *e = None);
        x.summed = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rendezvous_releases_every_rank_each_generation() {
        let r = Rendezvous::new(3, Duration::from_secs(5));
        std::thread::scope(|s| {
            for rank in 0..3 {
                let r = &r;
                s.spawn(move || {
                    for _ in 0..100 {
                        r.meet(rank).unwrap();
                    }
                });
            }
        });
    }

    #[test]
    fn a_rank_waiting_for_a_peer_that_never_steps_times_out_and_names_it() {
        let r = Rendezvous::new(3, Duration::from_millis(500));
        let t = Instant::now();
        let err = std::thread::scope(|s| {
            let one = s.spawn(|| r.meet(1));
            let zero = r.meet(0);
            (zero, one.join().unwrap())
        });
        assert!(t.elapsed() < Duration::from_secs(5));
        // one of the two times out (naming rank 2), the other is woken by the abort
        let (a, b) = err;
        let errs = [a.unwrap_err(), b.unwrap_err()];
        let timed_out: Vec<_> = errs
            .iter()
            .filter_map(|e| match e {
                RendezvousError::TimedOut { missing, .. } => Some(missing.clone()),
                RendezvousError::Aborted => None,
            })
            .collect();
        assert!(!timed_out.is_empty(), "{errs:?}");
        assert!(timed_out.iter().all(|m| m == &vec![2]), "{timed_out:?}");
        assert!(
            errs[0].to_string().contains("not stepping")
                || errs[1].to_string().contains("not stepping")
        );
        // the group stays aborted until reset (between steps), then meets again
        assert_eq!(r.meet(2), Err(RendezvousError::Aborted));
        r.reset();
        let r = &r;
        std::thread::scope(|s| {
            let others: Vec<_> = (1..3).map(|k| s.spawn(move || r.meet(k))).collect();
            assert_eq!(r.meet(0), Ok(()));
            for o in others {
                assert_eq!(o.join().unwrap(), Ok(()));
            }
        });
    }

    #[test]
    fn abort_wakes_a_waiting_rank() {
        let r = Rendezvous::new(2, Duration::from_secs(60));
        let t = Instant::now();
        std::thread::scope(|s| {
            let waiting = s.spawn(|| r.meet(0));
            std::thread::sleep(Duration::from_millis(50));
            r.abort();
            assert_eq!(waiting.join().unwrap(), Err(RendezvousError::Aborted));
        });
        assert!(t.elapsed() < Duration::from_secs(5));
    }
}
