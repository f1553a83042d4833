//! Persistent worker pool: threads pinned once, woken per parallel region, work handed out through atomic
//! counters (llama.cpp style), short spin then park when idle.
//!
//! Threads are grouped (one group per NUMA node). A region gives each group its own item count; a thread
//! only takes items of its group, so a node's threads only touch the experts that live in that node's
//! memory. The calling thread is worker 0 of group 0 and works too: with N threads on N cores nothing
//! competes for a core, which is how kt-kernel's extra task thread collapses at 16 of 16 cores.
//!
//! Cost: waking spinning workers is ~1 µs; parked workers (idle longer than `spin`) need a futex wake,
//! tens of µs. Decode calls come every few hundred µs, so the default spin keeps workers hot across layers.
//!
//! A worker takes part in a region only if it joins before the region closes: once every item has been
//! taken, the caller closes the region and waits only for the workers that joined. A worker the OS has
//! not scheduled (its core lent to another process: a shared build machine, a container at its CPU
//! limit, an HTTP thread of the same server) is not waited for; the caller does its share instead.
//! Waiting for it cost a whole scheduler slice per region, ~1 s for a short prompt on a loaded 2-core
//! machine.
//!
//! Every region is clocked ([`RegionStats`], always on: two clock reads per joining worker and two per
//! region): how long after the region opened each worker joined it (a late wake delays the region's
//! first loads), how long the caller waited for the workers in it once its own items were done, and
//! the region's tail: from the first thread to run out of items to the last one done (the caller
//! included, which the caller's wait does not see when the caller itself is the last).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use super::topology::{pin_current_thread, SavedAffinity};

/// Work function of one region: `(group, item, thread)`.
pub type RegionFn<'a> = dyn Fn(usize, usize, usize) + Sync + 'a;

/// Upper bound of groups (NUMA nodes) per pool.
pub const MAX_GROUPS: usize = 8;

fn noop_region(_: usize, _: usize, _: usize) {}
static NOOP: fn(usize, usize, usize) = noop_region;

#[repr(align(64))]
struct Padded(AtomicUsize);

struct Job {
    f: *const RegionFn<'static>,
    items: [usize; MAX_GROUPS],
}

/// [`Shared::joined`]: set once the caller has closed the region; the low bits count the workers in it.
const CLOSED: usize = 1 << (usize::BITS - 1);

struct Shared {
    generation: AtomicU64,
    job: UnsafeCell<Job>,
    next: Vec<Padded>,
    /// Workers inside the current region, and [`CLOSED`] once no worker may join it any more.
    joined: AtomicUsize,
    /// Workers that have started (and pinned themselves).
    started: AtomicUsize,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
    panicked: AtomicBool,
    /// Whether the caller of `run` takes items itself (the default) or only opens the region and
    /// waits for the workers ([`WorkerPool::set_caller_works`]).
    caller_works: AtomicBool,
    /// Workers with the highest thread indices kept out of regions, asleep: their cores left to the
    /// OS ([`WorkerPool::set_spare_cores`]).
    spare: AtomicUsize,
    threads: usize,
    spin: Duration,
    clock: RegionClock,
    /// Each region's time from opening to its last thread done (ns), while `logging` is on
    /// ([`WorkerPool::set_region_log`]).
    logging: AtomicBool,
    log: Mutex<Vec<u64>>,
}

/// The regions' clock: nanoseconds since `epoch` when the current region opened, the current region's
/// joins and latest join, and the totals [`RegionStats`] reports.
struct RegionClock {
    epoch: Instant,
    opened_ns: AtomicU64,
    region_joins: AtomicUsize,
    region_max_lag_ns: AtomicU64,
    /// The current region's first and last finish (ns after it opened) of a thread that ran items.
    region_first_done_ns: AtomicU64,
    region_last_done_ns: AtomicU64,
    regions: AtomicU64,
    joins: AtomicU64,
    missed: AtomicU64,
    lag_ns: AtomicU64,
    max_lag_ns: AtomicU64,
    close_wait_ns: AtomicU64,
    caller_changes: AtomicU64,
    tail_ns: AtomicU64,
    busy_ns: AtomicU64,
    caller_last: AtomicU64,
}

impl RegionClock {
    fn new() -> Self {
        RegionClock {
            epoch: Instant::now(),
            opened_ns: AtomicU64::new(0),
            region_joins: AtomicUsize::new(0),
            region_max_lag_ns: AtomicU64::new(0),
            regions: AtomicU64::new(0),
            joins: AtomicU64::new(0),
            missed: AtomicU64::new(0),
            lag_ns: AtomicU64::new(0),
            max_lag_ns: AtomicU64::new(0),
            close_wait_ns: AtomicU64::new(0),
            caller_changes: AtomicU64::new(0),
            region_first_done_ns: AtomicU64::new(u64::MAX),
            region_last_done_ns: AtomicU64::new(0),
            tail_ns: AtomicU64::new(0),
            busy_ns: AtomicU64::new(0),
            caller_last: AtomicU64::new(0),
        }
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Before the region is published (the workers read these after the Acquire of the join).
    fn open(&self) {
        self.region_joins.store(0, Ordering::Relaxed);
        self.region_max_lag_ns.store(0, Ordering::Relaxed);
        self.region_first_done_ns.store(u64::MAX, Ordering::Relaxed);
        self.region_last_done_ns.store(0, Ordering::Relaxed);
        self.opened_ns.store(self.now_ns(), Ordering::Relaxed);
    }

    /// A thread of the open region ran out of items after running some; returns when (ns after the
    /// region opened).
    fn done(&self) -> u64 {
        let at = self
            .now_ns()
            .saturating_sub(self.opened_ns.load(Ordering::Relaxed));
        self.region_first_done_ns.fetch_min(at, Ordering::Relaxed);
        self.region_last_done_ns.fetch_max(at, Ordering::Relaxed);
        at
    }

    /// A worker joined the open region.
    fn joined(&self) {
        let lag = self
            .now_ns()
            .saturating_sub(self.opened_ns.load(Ordering::Relaxed));
        self.region_joins.fetch_add(1, Ordering::Relaxed);
        self.region_max_lag_ns.fetch_max(lag, Ordering::Relaxed);
        self.lag_ns.fetch_add(lag, Ordering::Relaxed);
    }

    /// The region closed with no worker left in it (every join's writes happened before: the
    /// workers' Release decrements, the caller's Acquire wait); `waited_ns` the caller's wait for them,
    /// `caller_done` when the caller ran out of items (`None`: it ran none).
    /// Returns when the region's last thread was done (ns after it opened; `None` if none ran items).
    fn closed(&self, workers: usize, waited_ns: u64, caller_done: Option<u64>) -> Option<u64> {
        let joins = self.region_joins.load(Ordering::Relaxed);
        self.regions.fetch_add(1, Ordering::Relaxed);
        self.joins.fetch_add(joins as u64, Ordering::Relaxed);
        self.missed
            .fetch_add(workers.saturating_sub(joins) as u64, Ordering::Relaxed);
        let max = self.region_max_lag_ns.load(Ordering::Relaxed);
        self.max_lag_ns.fetch_add(max, Ordering::Relaxed);
        self.close_wait_ns.fetch_add(waited_ns, Ordering::Relaxed);
        let first = self.region_first_done_ns.load(Ordering::Relaxed);
        let last = self.region_last_done_ns.load(Ordering::Relaxed);
        if first > last {
            return None;
        }
        self.tail_ns.fetch_add(last - first, Ordering::Relaxed);
        self.busy_ns.fetch_add(last, Ordering::Relaxed);
        if caller_done == Some(last) {
            self.caller_last.fetch_add(1, Ordering::Relaxed);
        }
        Some(last)
    }

    fn stats(&self) -> RegionStats {
        let s = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 * 1e-9;
        RegionStats {
            regions: self.regions.load(Ordering::Relaxed),
            joins: self.joins.load(Ordering::Relaxed),
            missed: self.missed.load(Ordering::Relaxed),
            join_lag_s: s(&self.lag_ns),
            max_join_lag_s: s(&self.max_lag_ns),
            close_wait_s: s(&self.close_wait_ns),
            caller_changes: self.caller_changes.load(Ordering::Relaxed),
            tail_s: s(&self.tail_ns),
            busy_s: s(&self.busy_ns),
            caller_last: self.caller_last.load(Ordering::Relaxed),
        }
    }
}

/// Totals over a pool's regions so far (subtract two snapshots for a span: [`RegionStats::since`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RegionStats {
    pub regions: u64,
    /// Workers (the caller not counted) that joined a region, and those that did not (its items were
    /// all taken before they woke).
    pub joins: u64,
    pub missed: u64,
    /// Summed over joins: from the region's opening to the worker joining it.
    pub join_lag_s: f64,
    /// Summed over regions: the region's latest join.
    pub max_join_lag_s: f64,
    /// Summed over regions: the caller's wait, once its own items were done, for the workers still in
    /// the region (the region's tail).
    pub close_wait_s: f64,
    /// Regions whose calling thread was not the previous region's (each re-pins the new caller).
    pub caller_changes: u64,
    /// Summed over regions: from the first thread (caller or worker) that ran out of items to the
    /// last one done: the region's tail, in which fewer and fewer threads read.
    pub tail_s: f64,
    /// Summed over regions: from the region's opening to its last thread done.
    pub busy_s: f64,
    /// Regions whose last thread done was the caller.
    pub caller_last: u64,
}

impl RegionStats {
    /// What happened between the snapshot `earlier` and this one.
    pub fn since(&self, earlier: &RegionStats) -> RegionStats {
        RegionStats {
            regions: self.regions - earlier.regions,
            joins: self.joins - earlier.joins,
            missed: self.missed - earlier.missed,
            join_lag_s: self.join_lag_s - earlier.join_lag_s,
            max_join_lag_s: self.max_join_lag_s - earlier.max_join_lag_s,
            close_wait_s: self.close_wait_s - earlier.close_wait_s,
            caller_changes: self.caller_changes - earlier.caller_changes,
            tail_s: self.tail_s - earlier.tail_s,
            busy_s: self.busy_s - earlier.busy_s,
            caller_last: self.caller_last - earlier.caller_last,
        }
    }

    pub fn add(&mut self, o: &RegionStats) {
        self.regions += o.regions;
        self.joins += o.joins;
        self.missed += o.missed;
        self.join_lag_s += o.join_lag_s;
        self.max_join_lag_s += o.max_join_lag_s;
        self.close_wait_s += o.close_wait_s;
        self.caller_changes += o.caller_changes;
        self.tail_s += o.tail_s;
        self.busy_s += o.busy_s;
        self.caller_last += o.caller_last;
    }
}

// SAFETY: `job` is written only by the caller of `run` while every worker waits for the next generation
// (published with Release, read with Acquire), and read-only while a region runs.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// A persistent pool of pinned worker threads.
pub struct WorkerPool {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    group_of_thread: Vec<usize>,
    groups: usize,
    pinned: usize,
    nodes: Vec<Option<usize>>,
    /// CPU the caller stands in for, when pinning.
    caller_cpu: Option<usize>,
    /// Serializes regions; holds the last calling thread (pinned once per new caller).
    run_lock: Mutex<Caller>,
}

/// The thread that opened the last region, and the affinity it had before the pool pinned it.
#[derive(Default)]
struct Caller {
    thread: Option<ThreadId>,
    affinity: Option<SavedAffinity>,
}

impl WorkerPool {
    /// One thread per entry of `cpus_per_group[g]`; the caller of [`run`](Self::run) stands in for the
    /// first CPU of group 0. `pin` pins the workers to their CPU, and each new calling thread to that
    /// first CPU on its first `run` (else it could share a core with a worker and make every region's
    /// tail twice as long).
    pub fn new(cpus_per_group: &[Vec<usize>], pin: bool, spin: Duration) -> WorkerPool {
        assert!(
            !cpus_per_group.is_empty() && cpus_per_group.len() <= MAX_GROUPS,
            "1..={MAX_GROUPS} groups"
        );
        assert!(
            cpus_per_group.iter().all(|g| !g.is_empty()),
            "every group needs a CPU"
        );
        let groups = cpus_per_group.len();
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(Job {
                f: &NOOP as *const RegionFn<'static>,
                items: [0; MAX_GROUPS],
            }),
            next: (0..groups).map(|_| Padded(AtomicUsize::new(0))).collect(),
            joined: AtomicUsize::new(CLOSED),
            started: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            caller_works: AtomicBool::new(true),
            spare: AtomicUsize::new(0),
            threads: cpus_per_group.iter().map(Vec::len).sum(),
            spin,
            clock: RegionClock::new(),
            logging: AtomicBool::new(false),
            log: Mutex::new(Vec::new()),
        });
        let mut group_of_thread = Vec::new();
        let mut handles = Vec::new();
        let pinned = Arc::new(AtomicUsize::new(0));
        for (g, cpus) in cpus_per_group.iter().enumerate() {
            for &cpu in cpus {
                let tid = group_of_thread.len();
                group_of_thread.push(g);
                if tid == 0 {
                    continue; // the caller
                }
                let sh = Arc::clone(&shared);
                let pinned = Arc::clone(&pinned);
                let h = std::thread::Builder::new()
                    .name(format!("moe-cpu-{tid}"))
                    .spawn(move || {
                        if pin && pin_current_thread(cpu) {
                            pinned.fetch_add(1, Ordering::Relaxed);
                        }
                        sh.started.fetch_add(1, Ordering::Release);
                        worker_loop(&sh, g, tid);
                    })
                    .expect("spawn worker thread");
                handles.push(h);
            }
        }
        // Wait until the workers have pinned themselves so `pinned_threads` is meaningful.
        while shared.started.load(Ordering::Acquire) < handles.len() {
            std::thread::yield_now();
        }
        let mut pool = WorkerPool {
            shared,
            handles,
            group_of_thread,
            groups,
            pinned: 0,
            nodes: vec![None; groups],
            caller_cpu: None, // set below: the constructing thread is not pinned
            run_lock: Mutex::new(Caller::default()),
        };
        pool.run(&vec![0; groups], &|_, _, _| {});
        pool.pinned = pinned.load(Ordering::Relaxed);
        pool.caller_cpu = pin.then_some(cpus_per_group[0][0]);
        pool
    }

    /// Threads including the caller.
    pub fn threads(&self) -> usize {
        self.group_of_thread.len()
    }

    /// Whether the caller of [`run`](Self::run) takes items itself (on by default). Off, it opens the
    /// region and waits while the workers take every item (pools of one thread always work): for
    /// measuring whether the calling thread slows its regions down (a benchmark's A/B; results do not
    /// depend on which thread runs an item). Applies from the next region on.
    pub fn set_caller_works(&self, on: bool) {
        self.shared.caller_works.store(on, Ordering::Relaxed);
    }

    pub fn caller_works(&self) -> bool {
        self.shared.caller_works.load(Ordering::Relaxed)
    }

    /// Keeps the `n` workers of the highest thread indices out of the regions, asleep, so that their
    /// cores are free for whatever else the machine runs (the OS, a driver's threads, the process's
    /// other threads) instead of time-sliced with a worker in the middle of a region; 0 (the
    /// default) lets every worker in. Only pools of one group, keeping the caller and one worker at
    /// least; returns whether it was applied. For A/B runs: results do not depend on which thread
    /// runs an item.
    pub fn set_spare_cores(&self, n: usize) -> bool {
        if self.groups != 1 || n + 2 > self.threads() {
            return n == 0;
        }
        self.shared.spare.store(n, Ordering::Relaxed);
        let _l = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.shared.wake.notify_all();
        true
    }

    pub fn spare_cores(&self) -> usize {
        self.shared.spare.load(Ordering::Relaxed)
    }

    /// Starts (or stops) logging each region's time from its opening to its last thread done, for
    /// the distribution of a benchmark's regions ([`WorkerPool::take_region_log`]); off by default.
    pub fn set_region_log(&self, on: bool) {
        self.shared.logging.store(on, Ordering::Relaxed);
    }

    /// The regions logged since the last call, in seconds, oldest first (logging stays as it is).
    pub fn take_region_log(&self) -> Vec<f64> {
        let mut log = self.shared.log.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut *log)
            .into_iter()
            .map(|ns| ns as f64 * 1e-9)
            .collect()
    }

    /// The regions' clock so far (see [`RegionStats`]).
    pub fn region_stats(&self) -> RegionStats {
        self.shared.clock.stats()
    }

    pub fn groups(&self) -> usize {
        self.groups
    }

    /// Threads of group `g` (the caller counts in group 0).
    pub fn threads_in_group(&self, g: usize) -> usize {
        self.group_of_thread.iter().filter(|&&x| x == g).count()
    }

    /// Records the NUMA node of each group; expert memory of group g is then bound to that node.
    pub fn with_group_nodes(mut self, nodes: Vec<Option<usize>>) -> WorkerPool {
        assert_eq!(nodes.len(), self.groups);
        self.nodes = nodes;
        self
    }

    /// NUMA node of group `g`, if known.
    pub fn group_node(&self, g: usize) -> Option<usize> {
        self.nodes.get(g).copied().flatten()
    }

    /// Worker threads that were pinned successfully (not counting the caller). Note that threads a
    /// pinned caller spawns later inherit its one-CPU affinity.
    pub fn pinned_threads(&self) -> usize {
        self.pinned
    }

    /// Runs `f(group, item, thread)` for every `item < items[group]`, on the threads of that group, and
    /// returns when all are done. `thread` is < `threads()`, unique among concurrently running calls, so
    /// it can index per-thread scratch. Panics if `f` panicked on any thread.
    pub fn run(&self, items: &[usize], f: &RegionFn<'_>) {
        assert_eq!(items.len(), self.groups, "one item count per group");
        let mut caller = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        let me = std::thread::current().id();
        if caller.thread != Some(me) {
            if let Some(cpu) = self.caller_cpu {
                let own = SavedAffinity::of_current_thread();
                pin_current_thread(cpu);
                // The caller before this one leaves the caller's CPU with the affinity it came with.
                if let Some(previous) = std::mem::replace(&mut caller.affinity, own) {
                    previous.restore();
                }
            }
            caller.thread = Some(me);
            self.shared
                .clock
                .caller_changes
                .fetch_add(1, Ordering::Relaxed);
        }
        let sh = &*self.shared;
        // SAFETY: no worker reads `job` outside a region it joined, and the previous region was closed
        // with no worker left in it before `run` returned. The lifetime is erased only for the
        // duration of this call: we close the region and wait for every worker in it before returning.
        unsafe {
            let job = &mut *sh.job.get();
            job.f = std::mem::transmute::<*const RegionFn<'_>, *const RegionFn<'static>>(f);
            job.items = [0; MAX_GROUPS];
            job.items[..items.len()].copy_from_slice(items);
        }
        for c in &sh.next {
            c.0.store(0, Ordering::Relaxed);
        }
        sh.clock.open();
        // Opens the region: a worker that joins reads this value (Acquire), so it sees the job and the
        // counters written above.
        sh.joined.store(0, Ordering::Release);
        sh.generation.fetch_add(1, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        let rests = !sh.caller_works.load(Ordering::Relaxed) && self.threads_in_group(0) > 1;
        let caller_ran = if rests {
            Ok(0)
        } else {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // SAFETY: job was published above and stays valid until we return.
                unsafe { do_items(sh, 0, 0) }
            }))
        };
        let caller_ok = caller_ran.is_ok();
        let caller_done = matches!(caller_ran, Ok(n) if n > 0).then(|| sh.clock.done());
        let done_ns = sh.clock.now_ns();
        // Every item taken (group 0's by the caller above unless it rests; other groups' only by their
        // own workers): close the region, then wait for the workers in it to finish theirs.
        let mut spins = 0u32;
        let mut wait = || {
            spins += 1;
            if spins < 1 << 16 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        };
        while (0..self.groups).any(|g| sh.next[g].0.load(Ordering::Relaxed) < items[g]) {
            wait();
        }
        sh.joined.fetch_or(CLOSED, Ordering::AcqRel);
        while sh.joined.load(Ordering::Acquire) != CLOSED {
            wait();
        }
        let waited = sh.clock.now_ns().saturating_sub(done_ns);
        let workers = self.threads() - 1 - sh.spare.load(Ordering::Relaxed);
        let busy = sh.clock.closed(workers, waited, caller_done);
        if let (true, Some(ns)) = (sh.logging.load(Ordering::Relaxed), busy) {
            sh.log.lock().unwrap_or_else(|e| e.into_inner()).push(ns);
        }
        if !caller_ok || sh.panicked.swap(false, Ordering::Relaxed) {
            panic!("a worker-pool region panicked");
        }
    }
}

/// Takes items of `group` from its counter until exhausted; returns how many it ran.
unsafe fn do_items(sh: &Shared, group: usize, tid: usize) -> usize {
    // SAFETY (caller): the job of the current generation is published and alive.
    let job = unsafe { &*sh.job.get() };
    let n = job.items[group];
    let f = unsafe { &*job.f };
    let mut ran = 0;
    loop {
        let i = sh.next[group].0.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            return ran;
        }
        f(group, i, tid);
        ran += 1;
    }
}

/// Whether worker `tid` is kept out of the regions ([`WorkerPool::set_spare_cores`]).
fn spared(sh: &Shared, tid: usize) -> bool {
    tid + sh.spare.load(Ordering::Relaxed) >= sh.threads
}

/// Sleeps while worker `tid` is spared (checking every millisecond, and when woken).
fn sleep_while_spared(sh: &Shared, tid: usize) {
    let mut l = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
    while spared(sh, tid) && !sh.shutdown.load(Ordering::SeqCst) {
        l = sh
            .wake
            .wait_timeout(l, Duration::from_millis(1))
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

fn worker_loop(sh: &Shared, group: usize, tid: usize) {
    let mut seen = 0u64;
    loop {
        if spared(sh, tid) {
            sleep_while_spared(sh, tid);
            // regions opened meanwhile were done without this worker
            seen = sh.generation.load(Ordering::Acquire);
        }
        // Spin, checking the clock every 256 rounds, then park on the condvar.
        let start = Instant::now();
        let mut rounds = 0u32;
        let mut gen = sh.generation.load(Ordering::Acquire);
        while gen == seen && !sh.shutdown.load(Ordering::Relaxed) {
            std::hint::spin_loop();
            rounds += 1;
            if rounds.is_multiple_of(256) && start.elapsed() > sh.spin {
                let mut l = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
                sh.sleepers.fetch_add(1, Ordering::SeqCst);
                while sh.generation.load(Ordering::SeqCst) == seen
                    && !sh.shutdown.load(Ordering::SeqCst)
                {
                    l = sh.wake.wait(l).unwrap_or_else(|e| e.into_inner());
                }
                sh.sleepers.fetch_sub(1, Ordering::SeqCst);
                drop(l);
            }
            gen = sh.generation.load(Ordering::Acquire);
        }
        if sh.shutdown.load(Ordering::Acquire) {
            return;
        }
        seen = gen;
        if spared(sh, tid) || !join(sh) {
            continue; // closed already: the caller and the other workers did its items
        }
        sh.clock.joined();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: we joined an open region (Acquire on the value `run` published with the job);
            // `run` keeps the job alive until we leave it below.
            unsafe { do_items(sh, group, tid) }
        }));
        match r {
            Ok(0) => {}
            Ok(_) => {
                sh.clock.done();
            }
            Err(_) => sh.panicked.store(true, Ordering::Relaxed),
        }
        sh.joined.fetch_sub(1, Ordering::Release);
    }
}

/// Enters the open region, if any: false once it is closed.
fn join(sh: &Shared) -> bool {
    let mut v = sh.joined.load(Ordering::Acquire);
    loop {
        if v & CLOSED != 0 {
            return false;
        }
        match sh
            .joined
            .compare_exchange_weak(v, v + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return true,
            Err(now) => v = now,
        }
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _l = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread that opened a region and another that opens the next: the first gets the affinity it
    /// had before the pool pinned it (it would otherwise stay on the caller's CPU for good).
    #[test]
    fn a_new_caller_gives_the_previous_one_its_affinity_back() {
        let Some(before) = SavedAffinity::of_current_thread() else {
            return; // no affinity on this system
        };
        let cpu = before.cpus()[0];
        let pool = WorkerPool::new(&[vec![cpu]], true, Duration::from_micros(50));
        let (ran, release) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
        std::thread::scope(|s| {
            let first = s.spawn(|| {
                let own = SavedAffinity::of_current_thread().unwrap();
                pool.run(&[1], &|_, _, _| {});
                let pinned = SavedAffinity::of_current_thread().unwrap();
                ran.wait();
                release.wait();
                (
                    own.cpus(),
                    pinned.cpus(),
                    SavedAffinity::of_current_thread().unwrap().cpus(),
                )
            });
            ran.wait();
            pool.run(&[1], &|_, _, _| {}); // this thread takes the caller's place
            release.wait();
            let (own, pinned, after) = first.join().unwrap();
            if pinned != vec![cpu] {
                return; // the system refused to pin: nothing to give back
            }
            assert_eq!(
                after, own,
                "the previous caller keeps the caller's CPU only"
            );
        });
        before.restore();
    }

    #[test]
    fn every_item_runs_once_per_group() {
        let pool = WorkerPool::new(
            &[vec![0, 0, 0], vec![0, 0]],
            false,
            Duration::from_micros(50),
        );
        assert_eq!(pool.threads(), 5);
        for round in 0..50 {
            let counts: Vec<AtomicUsize> = (0..300).map(|_| AtomicUsize::new(0)).collect();
            let items = [100 + round, 37];
            pool.run(&items, &|g, i, t| {
                assert!(t < 5);
                counts[g * 150 + i].fetch_add(1, Ordering::Relaxed);
            });
            for g in 0..2 {
                for i in 0..150 {
                    let want = usize::from(i < items[g]);
                    assert_eq!(counts[g * 150 + i].load(Ordering::Relaxed), want);
                }
            }
            if round % 10 == 0 {
                std::thread::sleep(Duration::from_millis(1)); // let workers park
            }
        }
    }

    /// The caller and a worker on one CPU (what a busy machine does to them): the worker often has not
    /// run yet when the caller has taken every item, and the caller closes the region without it. Every
    /// item still runs exactly once, and no region touches another region's job.
    #[test]
    fn regions_close_without_workers_that_did_not_join() {
        let cpu = crate::cpu::topology::allowed_cpus()
            .first()
            .copied()
            .unwrap_or(0);
        let pool = WorkerPool::new(&[vec![cpu, cpu]], true, Duration::from_millis(5));
        for round in 0..2000 {
            let n = 1 + round % 7;
            let counts: Vec<AtomicUsize> = (0..8).map(|_| AtomicUsize::new(0)).collect();
            pool.run(&[n], &|_, i, t| {
                assert!(t < 2);
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            for (i, c) in counts.iter().enumerate() {
                assert_eq!(
                    c.load(Ordering::Relaxed),
                    usize::from(i < n),
                    "round {round}"
                );
            }
        }
    }

    /// Every region is counted once, and every worker either joined it or missed it.
    #[test]
    fn region_clock_counts_every_region_and_worker() {
        let pool = WorkerPool::new(&[vec![0, 0, 0]], false, Duration::from_millis(5));
        let before = pool.region_stats();
        for _ in 0..20 {
            pool.run(&[64], &|_, _, _| std::hint::spin_loop());
        }
        let d = pool.region_stats().since(&before);
        assert_eq!(d.regions, 20);
        assert_eq!(d.joins + d.missed, 20 * 2);
        assert!(d.join_lag_s >= 0.0 && d.max_join_lag_s >= 0.0 && d.close_wait_s >= 0.0);
        assert!(d.max_join_lag_s <= d.join_lag_s + 1e-12);
        assert!(d.busy_s > 0.0 && d.tail_s >= 0.0 && d.tail_s <= d.busy_s);
        assert!(d.caller_last <= d.regions);
        assert_eq!(d.caller_changes, 0, "one calling thread throughout");
        let before = pool.region_stats();
        std::thread::scope(|s| {
            s.spawn(|| pool.run(&[4], &|_, _, _| {}));
        });
        pool.run(&[4], &|_, _, _| {});
        assert_eq!(pool.region_stats().since(&before).caller_changes, 2);
        let mut sum = RegionStats::default();
        sum.add(&d);
        sum.add(&d);
        assert_eq!((sum.regions, sum.joins + sum.missed), (40, 80));
    }

    /// A caller slower than every worker is the region's last thread done, every time.
    #[test]
    fn a_slow_caller_is_counted_last() {
        let pool = WorkerPool::new(&[vec![0, 0]], false, Duration::from_millis(5));
        let before = pool.region_stats();
        let slow = Duration::from_millis(2);
        for _ in 0..5 {
            pool.run(&[2], &|_, _, t| {
                if t == 0 {
                    std::thread::sleep(slow);
                }
            });
        }
        let d = pool.region_stats().since(&before);
        assert_eq!((d.regions, d.caller_last), (5, 5));
        // the log has each region's time once it is on, and is emptied by taking it
        pool.set_region_log(true);
        for _ in 0..3 {
            pool.run(&[2], &|_, _, t| {
                if t == 0 {
                    std::thread::sleep(slow);
                }
            });
        }
        let log = pool.take_region_log();
        assert_eq!(log.len(), 3);
        assert!(log.iter().all(|&s| s >= slow.as_secs_f64()), "{log:?}");
        assert!(pool.take_region_log().is_empty());
        pool.set_region_log(false);
        pool.run(&[2], &|_, _, _| {});
        assert!(pool.take_region_log().is_empty());
        assert!(d.busy_s >= 5.0 * slow.as_secs_f64(), "{d:?}");
        assert!(d.tail_s <= d.busy_s, "{d:?}");
    }

    /// A resting caller leaves every item to the workers, each once; a pool of one thread still runs
    /// its items on the caller.
    #[test]
    fn a_resting_caller_leaves_every_item_to_the_workers() {
        let pool = WorkerPool::new(&[vec![0, 0, 0], vec![0]], false, Duration::from_millis(5));
        pool.set_caller_works(false);
        assert!(!pool.caller_works());
        for round in 0..50 {
            let counts: Vec<AtomicUsize> = (0..80).map(|_| AtomicUsize::new(0)).collect();
            let items = [1 + round % 33, 7];
            pool.run(&items, &|g, i, t| {
                assert_ne!(t, 0, "the caller rests");
                counts[g * 40 + i].fetch_add(1, Ordering::Relaxed);
            });
            for g in 0..2 {
                for i in 0..40 {
                    let want = usize::from(i < items[g]);
                    assert_eq!(counts[g * 40 + i].load(Ordering::Relaxed), want);
                }
            }
        }
        let alone = WorkerPool::new(&[vec![0]], false, Duration::from_millis(5));
        alone.set_caller_works(false);
        let n = AtomicUsize::new(0);
        alone.run(&[5], &|_, _, t| {
            assert_eq!(t, 0);
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 5);
    }

    /// Spared workers take no items while spared and all take part again once let back in; every item
    /// runs once either way. Pools of several groups, or with too few threads, refuse.
    #[test]
    fn spared_workers_take_no_items() {
        let pool = WorkerPool::new(&[vec![0, 0, 0, 0]], false, Duration::from_millis(5));
        assert!(pool.set_spare_cores(2));
        assert_eq!(pool.spare_cores(), 2);
        for round in 0..50 {
            let counts: Vec<AtomicUsize> = (0..40).map(|_| AtomicUsize::new(0)).collect();
            let n = 1 + round % 37;
            pool.run(&[n], &|_, i, t| {
                assert!(t < 2, "worker {t} is spared");
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            for (i, c) in counts.iter().enumerate() {
                assert_eq!(c.load(Ordering::Relaxed), usize::from(i < n));
            }
        }
        assert!(pool.set_spare_cores(0));
        let seen: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..200 {
            pool.run(&[64], &|_, _, t| {
                seen[t].fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(20));
            });
        }
        assert!(seen[3].load(Ordering::Relaxed) > 0, "let back in");
        assert!(!pool.set_spare_cores(3), "caller and one worker stay");
        let two = WorkerPool::new(&[vec![0, 0], vec![0, 0]], false, Duration::from_millis(5));
        assert!(!two.set_spare_cores(1));
        assert!(two.set_spare_cores(0));
    }

    #[test]
    fn worker_panic_reaches_caller() {
        let pool = WorkerPool::new(&[vec![0, 0]], false, Duration::from_micros(10));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&[64], &|_, i, _| assert!(i != 33, "boom"));
        }));
        assert!(r.is_err());
        // The pool still works afterwards.
        let n = AtomicUsize::new(0);
        pool.run(&[10], &|_, _, _| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 10);
    }
}
