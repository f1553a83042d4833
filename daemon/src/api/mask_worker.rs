//! Token masks computed off the engine thread, overlapped with the forward pass (as SGLang and vLLM
//! overlap grammar bitmasks with the GPU step): before a step runs, each constrained sequence that will
//! sample in it hands its matcher to a mask worker ([`MaskWorkers::start`]); when the logits are back,
//! sampling takes the finished mask ([`PendingMask::wait`]) and blocks only if it is not done yet.
//!
//! Cost: a mask is tens of microseconds to a few milliseconds of one core (llguidance's fuel limits
//! bound it); a decode step is milliseconds, so with a few workers the masks of a batch are normally
//! ready before the logits. The workers are few (they share the machine with the CPU expert pool).
use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// One computed mask: the tokens allowed next, whether the grammar may end here, and what it cost.
pub struct ComputedMask {
    pub mask: Result<SimpleVob, String>,
    pub accepting: bool,
    pub seconds: f64,
}

/// Computes `matcher`'s next mask on the calling thread.
pub fn compute(matcher: &Mutex<Matcher>) -> ComputedMask {
    let mut m = matcher.lock().unwrap_or_else(|e| e.into_inner());
    let t0 = Instant::now();
    let mask = m.compute_mask().map_err(|e| e.to_string());
    let accepting = m.is_accepting().unwrap_or(false);
    ComputedMask {
        mask,
        accepting,
        seconds: t0.elapsed().as_secs_f64(),
    }
}

/// A mask being computed on a worker.
pub struct PendingMask(mpsc::Receiver<ComputedMask>);

impl PendingMask {
    /// The mask, once computed (blocks until then), and how long this call waited. None: the worker
    /// is gone (it panicked), so the caller computes the mask itself.
    pub fn wait(self) -> (Option<ComputedMask>, Duration) {
        let t0 = Instant::now();
        let got = self.0.recv().ok();
        (got, t0.elapsed())
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// The process's mask workers: a few threads taking jobs from one queue.
pub struct MaskWorkers {
    jobs: Mutex<mpsc::Sender<Job>>,
}

/// How many mask workers run: enough for a batch's masks to finish within a step, few enough not to
/// take cores from the CPU experts.
const MAX_WORKERS: usize = 4;

impl MaskWorkers {
    /// The shared workers, started on first use.
    pub fn get() -> &'static MaskWorkers {
        static WORKERS: OnceLock<MaskWorkers> = OnceLock::new();
        WORKERS.get_or_init(|| {
            let n = std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .clamp(1, MAX_WORKERS);
            Self::spawn(n)
        })
    }

    fn spawn(n: usize) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..n {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("moe-mask-{i}"))
                .spawn(move || loop {
                    let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot start a mask worker");
            }
        }
        Self {
            jobs: Mutex::new(tx),
        }
    }

    /// Starts computing `matcher`'s next mask on a worker. `delay` holds the worker back first
    /// (tests of late masks). None: no worker could take it (the caller computes inline).
    pub fn start(&self, matcher: Arc<Mutex<Matcher>>, delay: Duration) -> Option<PendingMask> {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move || {
            if !delay.is_zero() {
                std::thread::sleep(delay);
            }
            let _ = tx.send(compute(&matcher));
        });
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        jobs.send(job).ok().map(|()| PendingMask(rx))
    }
}
