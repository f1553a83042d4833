//! The per-layer hand-off between the GPU and the CPU expert pool, through mapped pinned host memory
//! with flags polled on both sides (`moe_kernels::cuda::ops::handoff`): the GPU publishes a layer's
//! routing and normalised rows into host memory, the host polls for them, the CPU experts write their
//! sum into host memory and raise a flag that a GPU kernel (enqueued earlier, possibly before the
//! host even saw the routing) waits on before adding the sum into the residual rows.
//!
//! [`CpuHalf`] is the host's side of one layer. In pipelined steps (`forward`) the engine enqueues
//! the GPU's wait-and-add and the next layer's segment first and runs the CPU half afterwards, so
//! the GPU starts the next layer the moment the sum lands instead of after the host's launches.
//! With deferred experts on, part of a layer's CPU experts is computed after the flag and added one
//! layer later (see `dispatch::split_deferred`).
use super::host_profile::lap;
use super::GpuModel;
use crate::engine::moe::{dram_experts_forward_timed, GatedAct, Routing};
use crate::engine::StepTimes;
use crate::model::MoeBlock;
use cudarc::driver::CudaEvent;
use moe_kernels::cpu::WorkerPool;
use moe_kernels::cuda::ops::{HandoffPort, HandoffStamps, MappedHost};
use moe_kernels::cuda::GpuDevice;
use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

/// How long the host spins on the routing flag before asking the driver whether the GPU failed.
const POLL_CHECK_AFTER: Duration = Duration::from_millis(50);
/// Longest wait for one layer's routing (a decode layer takes well under a millisecond; a long
/// prefill layer well under a second): past it the step fails instead of hanging.
const ROUTING_TIMEOUT: Duration = Duration::from_secs(60);

/// What the engine stream is doing, asked without blocking.
enum StreamState {
    Busy,
    Idle,
}

/// `cuStreamQuery` on the engine stream: busy, idle, or the GPU's error.
fn stream_state(dev: &GpuDevice) -> anyhow::Result<StreamState> {
    use cudarc::driver::sys::{cuStreamQuery, CUresult};
    dev.ctx.bind_to_thread()?;
    // SAFETY: queries a live stream of the bound context; touches no memory.
    match unsafe { cuStreamQuery(dev.stream.cu_stream()) } {
        CUresult::CUDA_SUCCESS => Ok(StreamState::Idle),
        CUresult::CUDA_ERROR_NOT_READY => Ok(StreamState::Busy),
        e => anyhow::bail!("the GPU failed while the host waited for a layer's routing: {e:?}"),
    }
}

/// Mapped host buffers and flags of the per-layer hand-off, plus the deferred experts' carry. One set
/// per batch-size class of step buffers (`buffers`; graphs bake the buffers' addresses).
pub struct Handoff {
    pub(super) port: HandoffPort,
    deferred: RefCell<Deferred>,
    /// When the host last raised a CPU sum in this step, and when it last saw a routing land (for
    /// [`HandoffProfile`]); taken by the next use.
    raised_at: Cell<Option<Instant>>,
    landed_at: Cell<Option<Instant>>,
    /// The GPU's share of a decode layer's DRAM experts (`decode_split`), joined by the CPU half.
    pub(super) share: GpuShareSlot,
}

/// Where the GPU's share of a decode layer's DRAM experts lands (`decode_split`): the side stream
/// copies its weighted sum into `sum` (mapped host memory) and records `done` after it; the layer's
/// CPU half adds it into the CPU experts' sum before raising the flag, so the GPU's one wait covers
/// both shares and the hand-off kernels stay as they are.
pub(super) struct GpuShareSlot {
    pub sum: MappedHost<f32>,
    /// Recorded after the copy into `sum` (timing on: with the share's start event, the GPU side's span).
    pub done: CudaEvent,
    /// A share was issued for the layer whose CPU half runs next.
    pending: Cell<bool>,
    /// The CPU experts' seconds of the last layer's half (read by the next layer's decode split,
    /// whose balance learns the CPU's rate from it: `split::DecodeBalance`).
    pub cpu_s: Cell<Option<f64>>,
}

/// Where a decode step's time between two MoE layers' CPU experts goes, summed over layers: the
/// host's clock around the GPU's clock stamps of the hand-off kernels (`handoff.cu`). After the CPU
/// sum of layer l is raised, the GPU's wait sees it, adds it, runs layer l + 1's segment (norms,
/// attention, router) and publishes; the host sees the routing, plans, and starts its CPU experts.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HandoffProfile {
    /// Layers measured (those whose previous MoE layer raised a CPU sum in the same step).
    pub layers: u64,
    /// Host: from raising layer l's sum to seeing layer l + 1's routing.
    pub round_trip_s: f64,
    /// Host: from raising the sum to starting the wait for the next routing (launches, bookkeeping).
    pub host_launch_s: f64,
    /// GPU: from the wait seeing the flag to its add done (reading the sum from host memory).
    pub gpu_add_s: f64,
    /// GPU: from the add done to the next layer's routing published (its segment).
    pub gpu_segment_s: f64,
    /// Host: from seeing a layer's routing to starting its CPU experts (the dispatch plan, GPU expert
    /// launches, the next segment's launches), over `cpu_layers` layers.
    pub host_to_cpu_s: f64,
    pub cpu_layers: u64,
}

impl HandoffProfile {
    pub fn add(&mut self, o: &HandoffProfile) {
        self.layers += o.layers;
        self.round_trip_s += o.round_trip_s;
        self.host_launch_s += o.host_launch_s;
        self.gpu_add_s += o.gpu_add_s;
        self.gpu_segment_s += o.gpu_segment_s;
        self.host_to_cpu_s += o.host_to_cpu_s;
        self.cpu_layers += o.cpu_layers;
    }

    /// The flags' travel both ways (host → GPU wait, GPU publish → host poll): the round trip less
    /// the GPU's own time between seeing one flag and raising the next.
    pub fn flag_latency_s(&self) -> f64 {
        self.round_trip_s - self.gpu_add_s - self.gpu_segment_s
    }

    /// Adds one layer: the host raised the previous sum at `raised`, began waiting at `waited`, saw
    /// the routing at `landed`; `st` the GPU's stamps. Stamps out of order (a layer without a wait
    /// in between) are left out.
    fn record(&mut self, raised: Instant, waited: Instant, landed: Instant, st: HandoffStamps) {
        if st.seen_ns == 0 || st.added_ns < st.seen_ns || st.published_ns < st.added_ns {
            return;
        }
        let ns = |d: u64| d as f64 * 1e-9;
        self.layers += 1;
        self.round_trip_s += landed.saturating_duration_since(raised).as_secs_f64();
        self.host_launch_s += waited.saturating_duration_since(raised).as_secs_f64();
        self.gpu_add_s += ns(st.added_ns - st.seen_ns);
        self.gpu_segment_s += ns(st.published_ns - st.added_ns);
    }
}

/// Deferred experts of the previous MoE layer: its rows (copied before the GPU may overwrite the
/// port) and the sum computed from them, added with the next layer's CPU sum.
#[derive(Default)]
struct Deferred {
    x: Vec<f32>,
    sum: Vec<f32>,
    /// Elements of `sum` waiting to be added (0: nothing pending).
    pending: usize,
}

impl Handoff {
    pub(super) fn new(dev: &GpuDevice, routes: usize, elems: usize) -> anyhow::Result<Handoff> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        Ok(Handoff {
            port: HandoffPort::new(dev, routes, elems)?,
            deferred: RefCell::new(Deferred::default()),
            raised_at: Cell::new(None),
            landed_at: Cell::new(None),
            share: GpuShareSlot {
                sum: MappedHost::new(dev, elems)?,
                done: dev.ctx.new_event(Some(CU_EVENT_DEFAULT))?,
                pending: Cell::new(false),
                cpu_s: Cell::new(None),
            },
        })
    }

    /// A GPU share of the current layer was issued: its CPU half joins it before raising the flag.
    pub(super) fn share_issued(&self) {
        self.share.pending.set(true);
    }

    /// Adds the pending GPU share's sum into `y` (the CPU experts' sum, `y.len()` elements, which
    /// took `cpu_s`) once the side stream is done with it; returns the host's wait for it (zero
    /// without a share). A share whose GPU work failed adds nothing: the error comes back at the
    /// step's closing wait.
    fn join_share(&self, y: &mut [f32], cpu_s: f64) -> Duration {
        self.share.cpu_s.set(Some(cpu_s));
        if !self.share.pending.replace(false) {
            return Duration::ZERO;
        }
        let t = Instant::now();
        loop {
            match self.share.done.try_is_complete() {
                Ok(true) => break,
                Ok(false) => std::hint::spin_loop(),
                Err(e) => {
                    tracing::error!("the GPU share of a decode layer failed: {e}");
                    return t.elapsed();
                }
            }
        }
        let waited = t.elapsed();
        // SAFETY: the side stream's copy into `sum` finished (`done` passed) and nothing else
        // writes it before the next share, which the host issues after this layer's flag.
        let sum = unsafe { self.share.sum.host(y.len()) };
        for (a, b) in y.iter_mut().zip(sum) {
            *a += b;
        }
        waited
    }

    /// Starts a step: the flags lowered and nothing deferred, once the stream is idle (a step that
    /// failed half-way may have left kernels that still publish); fails if a GPU wait of the
    /// previous step timed out.
    pub(super) fn begin_step(&self, dev: &GpuDevice) -> anyhow::Result<()> {
        dev.stream.synchronize()?;
        // a failed step may have left a GPU share running on the side stream
        if self.share.pending.replace(false) {
            self.share.done.synchronize()?;
        }
        self.deferred.borrow_mut().pending = 0;
        self.raised_at.set(None);
        self.landed_at.set(None);
        anyhow::ensure!(
            !self.port.reset(),
            "the GPU timed out waiting for the CPU experts in the previous step"
        );
        Ok(())
    }

    /// Whether the previous MoE layer left deferred experts to add.
    pub(super) fn has_deferred(&self) -> bool {
        self.deferred.borrow().pending > 0
    }

    /// Waits until the GPU has published the layer's routing: polls the flag, and after
    /// `POLL_CHECK_AFTER` also asks the driver, without blocking, whether the stream failed or ran
    /// dry without publishing (the stream may hold a wait for the host's own flag of this layer,
    /// enqueued before the routing landed: a blocking synchronisation here could wait on ourselves).
    pub(super) fn wait_routing(&self, dev: &GpuDevice) -> anyhow::Result<()> {
        let t0 = Instant::now();
        let mut spins = 0u32;
        while !self.port.take_published() {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && t0.elapsed() > POLL_CHECK_AFTER {
                match stream_state(dev)? {
                    StreamState::Busy if t0.elapsed() < ROUTING_TIMEOUT => continue,
                    StreamState::Busy => anyhow::bail!(
                        "the GPU did not publish the layer's routing within {ROUTING_TIMEOUT:?}"
                    ),
                    StreamState::Idle => {
                        anyhow::ensure!(
                            self.port.take_published(),
                            "the GPU finished without publishing the layer's routing"
                        );
                        break;
                    }
                }
            }
        }
        // a layer whose early routing the host did not look at (no CPU experts) leaves EARLY up
        self.port.lower_early_routing();
        Ok(())
    }

    /// Profiles the layer whose routing was just seen (`wait_routing` returned), the host having
    /// begun waiting at `waited`: see [`HandoffProfile`].
    pub(super) fn profile_routing(&self, waited: Instant, profile: &mut HandoffProfile) {
        let landed = Instant::now();
        self.landed_at.set(Some(landed));
        if let Some(raised) = self.raised_at.take() {
            profile.record(raised, waited, landed, self.port.stamps());
        }
    }

    /// Routed ids and weights of the layer just published (`routes` pairs).
    pub(super) fn routing(&self, routes: usize) -> (Vec<u32>, Vec<f32>) {
        // SAFETY: after `wait_routing`, the GPU writes these only after the layer's CPU half raised
        // its flag, which happens after this copy.
        let (ids, w) = unsafe { (self.port.ids.host(routes), self.port.w.host(routes)) };
        (ids.iter().map(|&x| x as u32).collect(), w.to_vec())
    }
}

/// The host's side of one MoE layer: the CPU experts of its tokens (`now`) plus what the previous
/// layer deferred go into the port's sum, then the flag is raised; experts deferred from this layer
/// (`later`) run after the flag. Dropped without running (an error in between), it raises the flag
/// anyway so the GPU never waits on a host that gave up.
pub(super) struct CpuHalf<'a> {
    pub block: &'a MoeBlock,
    pub pool: Option<&'a WorkerPool>,
    pub act: GatedAct,
    pub now: Option<Routing>,
    pub later: Option<Routing>,
    /// Rows and hidden width of the step.
    pub n: usize,
    pub hd: usize,
    pub hand: &'a Handoff,
    pub raised: bool,
}

impl CpuHalf<'_> {
    /// Computes the layer's CPU experts and raises the flag; adds the host time (and the kernels'
    /// regions) to `times`.
    pub fn run(mut self, times: &mut StepTimes) {
        let t = Instant::now();
        if let Some(landed) = self.hand.landed_at.take() {
            let p = &mut times.handoff;
            p.host_to_cpu_s += t.saturating_duration_since(landed).as_secs_f64();
            p.cpu_layers += 1;
        }
        let regions = &mut times.cpu_regions;
        let nx = self.n * self.hd;
        let mut d = self.hand.deferred.borrow_mut();
        {
            // SAFETY: the GPU reads `y` and writes `x` only after the flag raised below; the rows
            // were published before this half was built (`wait_routing`).
            let (x, y) = unsafe { (self.hand.port.x.host(nx), self.hand.port.y.host_mut(nx)) };
            if d.pending == nx {
                y.copy_from_slice(&d.sum[..nx]);
            } else {
                y.fill(0.0);
            }
            d.pending = 0;
            let mut clock = t;
            times.host.half_in_s += lap(&mut clock);
            let mut cpu_s = 0.0;
            if let Some(r) = &self.now {
                let (b, p, a, hd) = (self.block, self.pool, self.act, self.hd);
                dram_experts_forward_timed(b, p, a, x, hd, r, y, Some(&mut *regions));
                let now = Instant::now();
                cpu_s = now.saturating_duration_since(clock).as_secs_f64();
                clock = now;
            }
            if self.later.is_some() {
                d.x.clear();
                d.x.extend_from_slice(x);
            }
            times.split_gpu_wait_s += self.hand.join_share(y, cpu_s).as_secs_f64();
            times.host.half_out_s += lap(&mut clock);
        }
        self.hand.port.raise_sum();
        self.hand.raised_at.set(Some(Instant::now()));
        self.raised = true;
        if let Some(r) = &self.later {
            let Deferred { x, sum, pending } = &mut *d;
            sum.clear();
            sum.resize(nx, 0.0);
            let (b, p, a, hd) = (self.block, self.pool, self.act, self.hd);
            dram_experts_forward_timed(b, p, a, x, hd, r, sum, Some(&mut *regions));
            *pending = nx;
        }
        times.cpu_experts_s += t.elapsed().as_secs_f64();
    }
}

impl Drop for CpuHalf<'_> {
    fn drop(&mut self) {
        if !self.raised {
            self.hand.port.raise_sum();
        }
    }
}

impl GpuModel {
    /// Whether a step's layers may be pipelined: the next layer's segment enqueued before the CPU
    /// half of this one. Only when nothing enqueued in between can make the host wait for the
    /// stream (which would wait on the flag the host has not raised yet): decode steps (one row per
    /// sequence) of GQA models without hybrid-attention state, whose segments enqueue kernels only
    /// (the same segments CUDA graphs capture).
    pub(super) fn pipelined(&self, long_prompt: bool, decode_rows: bool, rows: usize) -> bool {
        !long_prompt
            && decode_rows
            && rows <= super::buffers::MAX_GRAPH_ROWS
            && self.hybrid.is_none()
            && self.all_gqa()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_profile_splits_the_round_trip_and_skips_stamps_out_of_order() {
        let raised = Instant::now();
        let waited = raised + Duration::from_micros(30);
        let landed = raised + Duration::from_micros(130);
        let st = HandoffStamps {
            seen_ns: 1_000_000,
            added_ns: 1_004_000,
            published_ns: 1_104_000,
        };
        let mut p = HandoffProfile::default();
        p.record(raised, waited, landed, st);
        assert_eq!(p.layers, 1);
        let us = |s: f64| (s * 1e6).round();
        assert_eq!(us(p.round_trip_s), 130.0);
        assert_eq!(us(p.host_launch_s), 30.0);
        assert_eq!((us(p.gpu_add_s), us(p.gpu_segment_s)), (4.0, 100.0));
        assert_eq!(us(p.flag_latency_s()), 26.0);
        // a publish stamped before the add (a layer without a wait between) is left out
        let stale = HandoffStamps {
            published_ns: 900_000,
            ..st
        };
        p.record(raised, waited, landed, stale);
        p.record(raised, waited, landed, HandoffStamps::default());
        assert_eq!(p.layers, 1);
        let mut sum = HandoffProfile::default();
        sum.add(&p);
        sum.add(&p);
        assert_eq!((sum.layers, us(sum.round_trip_s)), (2, 260.0));
    }
}
