//! Reading experts ahead. When a layer's routing is known before its expert inputs are (SmallThinker
//! routes from the layer input, so before attention runs), one background thread walks the chosen
//! experts' packed bytes with cache prefetch hints while the caller does other work; the expert kernels
//! then find the first part of those weights in cache instead of DRAM.
//!
//! Cost: one thread issuing hints, at most `budget` bytes per job. A prefetch hint never faults and
//! changes no data, so a job over memory that is gone or no longer wanted costs bandwidth only; a newer
//! job or [`ExpertPrefetcher::cancel`] stops the running one within 256 cache lines.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

const LINE: usize = 64;
/// Lines between checks of the job's epoch.
const LINES_PER_CHECK: usize = 256;

/// Address ranges (start, length) to prefetch; addresses only, never dereferenced.
struct Job {
    regions: Vec<(usize, usize)>,
    epoch: u64,
}

struct Shared {
    job: Mutex<Option<Job>>,
    wake: Condvar,
    /// Bumped by every `start` and `cancel`; a job whose epoch is older stops.
    epoch: AtomicU64,
    shutdown: AtomicBool,
    /// Bytes hinted so far (all jobs).
    hinted: AtomicU64,
}

/// A background thread that prefetches expert weights into the CPU caches.
pub struct ExpertPrefetcher {
    shared: Arc<Shared>,
    handle: Option<JoinHandle<()>>,
}

impl ExpertPrefetcher {
    pub fn new() -> std::io::Result<ExpertPrefetcher> {
        let shared = Arc::new(Shared {
            job: Mutex::new(None),
            wake: Condvar::new(),
            epoch: AtomicU64::new(0),
            shutdown: AtomicBool::new(false),
            hinted: AtomicU64::new(0),
        });
        let sh = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name("moe-prefetch".into())
            .spawn(move || worker(&sh))?;
        Ok(ExpertPrefetcher {
            shared,
            handle: Some(handle),
        })
    }

    /// Replaces any running job by one over `regions`: the first `budget / regions.len()` bytes of each
    /// (an expert's packed bytes start with its gate and up rows, which the kernels read first).
    pub fn start(&self, regions: &[&[u8]], budget: usize) {
        if regions.is_empty() || budget == 0 {
            return;
        }
        let each = budget / regions.len();
        let epoch = self.shared.epoch.fetch_add(1, Ordering::AcqRel) + 1;
        let job = Job {
            regions: regions
                .iter()
                .map(|r| (r.as_ptr() as usize, r.len().min(each)))
                .collect(),
            epoch,
        };
        *self.shared.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(job);
        self.shared.wake.notify_one();
    }

    /// Stops the running job (the caller is about to read the weights itself).
    pub fn cancel(&self) {
        self.shared.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// Bytes hinted since the start.
    pub fn hinted_bytes(&self) -> u64 {
        self.shared.hinted.load(Ordering::Relaxed)
    }
}

impl Drop for ExpertPrefetcher {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.cancel();
        self.shared.wake.notify_one();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn worker(sh: &Shared) {
    loop {
        let job = {
            let mut slot = sh.job.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if sh.shutdown.load(Ordering::Acquire) {
                    return;
                }
                if let Some(j) = slot.take() {
                    break j;
                }
                slot = sh.wake.wait(slot).unwrap_or_else(|e| e.into_inner());
            }
        };
        let mut hinted = 0u64;
        'job: for &(start, len) in &job.regions {
            let lines = len.div_ceil(LINE);
            for chunk in (0..lines).step_by(LINES_PER_CHECK) {
                for l in chunk..(chunk + LINES_PER_CHECK).min(lines) {
                    prefetch_line(start + l * LINE);
                }
                hinted += ((chunk + LINES_PER_CHECK).min(lines) - chunk) as u64 * LINE as u64;
                // Checked after each chunk: a job taken late (this thread got no CPU while the pool
                // was busy) still hints its first lines, then stops.
                if sh.epoch.load(Ordering::Acquire) != job.epoch {
                    break 'job;
                }
            }
        }
        sh.hinted.fetch_add(hinted, Ordering::Relaxed);
    }
}

/// A hint to bring the line at `addr` into L2 (and so L3); no load, no fault.
#[inline(always)]
fn prefetch_line(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT1 is a hint: it does not access memory architecturally and never faults, whatever
    // the address (SSE, present on every x86_64 CPU).
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        _mm_prefetch::<_MM_HINT_T1>(addr as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn wait_for(p: &ExpertPrefetcher, bytes: u64) -> bool {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            if p.hinted_bytes() >= bytes {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    #[test]
    fn hints_the_budget_split_over_the_regions() {
        let p = ExpertPrefetcher::new().unwrap();
        let a = vec![1u8; 1 << 20];
        let b = vec![2u8; 1 << 20];
        // 256 KiB budget over two regions: 128 KiB of each.
        p.start(&[&a, &b], 256 << 10);
        assert!(wait_for(&p, 256 << 10), "hinted {}", p.hinted_bytes());
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(p.hinted_bytes(), 256 << 10);
        // a region shorter than its share is hinted whole
        p.start(&[&a[..1000]], 1 << 20);
        assert!(wait_for(&p, (256 << 10) + 1024));
        // nothing to do
        p.start(&[], 1 << 20);
        p.start(&[&a], 0);
        drop(p);
    }

    #[test]
    fn cancel_stops_a_long_job() {
        let p = ExpertPrefetcher::new().unwrap();
        let big = vec![0u8; 64 << 20];
        p.start(&[&big], big.len());
        p.cancel();
        std::thread::sleep(Duration::from_millis(50));
        let after = p.hinted_bytes();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(p.hinted_bytes(), after, "no progress after cancel");
    }
}
