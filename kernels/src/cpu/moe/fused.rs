//! The decode path of `CpuExpertSet::forward`: gate/up and down of a few tokens in ONE pool region.
//!
//! At decode sizes a layer reads ~70 MB of weights in ~0.5 ms, so every microsecond the DRAM is not
//! busy shows. The split path (`forward.rs`) runs gate/up, (int8) the down activations and down as
//! separate regions: each ends in a barrier where the threads that finished first wait for the last
//! item, and every item starts its weight streams cold. Here:
//! - one region: the items of a group are all its gate/up items, then all its down items, taken in
//!   that order from one counter. A down item needs the intermediate rows of its experts only; each
//!   expert's rows are ready once its own gate/up items are done (the thread finishing an expert's last
//!   item quantizes its rows for int8 kinds, the old region C). A down item computes the ready experts
//!   first and, while it waits for the rest, pulls their weights into L2, so the tail of gate/up is
//!   spent reading down's weights instead of waiting at a barrier. No deadlock: a down item only waits
//!   for gate/up items, which come before it in the order, so they were all taken by threads running
//!   them, and those never wait.
//! - warm streams: before a stream's first bytes are needed its head is prefetched: up's while gate
//!   runs, the next expert's down tiles while the current one runs, and the next unclaimed item's first
//!   stream while the current item runs its last one.
//! - item sizes by bytes (`Targets`), not by tile counts, so every shape and format gets items of a
//!   few hundred KiB; with many experts per call (8 tokens × top-8) a down chunk's experts are split
//!   into parts, summed in a fixed order by whichever thread finishes the chunk's last part.
//! - the experts whose gate/up finish last get a down part of their own, handed out last: the first
//!   down items never wait for them, and the region ends on small items (one expert, one chunk).
//!
//! Two plans build on this (`DecodePlan`, picked per set; A/B in one process with `cpu_moe_bench
//! --paths`):
//! - `chained`: a thread claims its next item from the counter just before its current item's last
//!   stream, and every kernel call is told where its weights end and which stream the thread reads
//!   next: the in-loop prefetch runs from one stream into the next without a gap, and never past a
//!   call's end into weights another item reads (the `fused` plan prefetched 4 KiB past every
//!   stream: a sixth more lines than a 24 KiB down stream needs, pulled in by the wrong core). Its
//!   kernels prefetch 8 KiB ahead into L2 unless told otherwise (the best setting timed, PERF.md
//!   "Decode sizes, part 2"). The default plan.
//! - `streams`: `chained` with down items of fewer, longer streams, as llama.cpp's `mul_mat_id`
//!   (contiguous rows of one expert per chunk): a few experts × [`STREAM_BYTES`] of each, their sums
//!   per N-tile added in part order.
//!
//! Results: each part sums its experts in order and the parts are added to the output in order, so
//! calls are deterministic; against the split path (one sum over all experts) only the f32
//! summation order differs (bit for bit when an N-tile has one part).

use std::cell::RefCell;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use super::act::{gated_row, ActBuf, ActKind, ActWriter};
use super::forward::{Active, Call, Scratch, SyncPtr};
use super::gemm::gemm;
use super::kern_avx512::{
    decode_prefetch, default_prefetch, prefetch_distance, prefetch_head, set_next_stream,
    StreamPrefetch, ThreadPrefetch,
};
use super::CpuExpertSet;
use crate::knob::Knob;

/// How calls of at most [`FUSED_MAX_TOKENS`] tokens in which no expert uses AMX tiles run: the plan,
/// and for the fused plans optionally the kernels' prefetch (else `decode_prefetch()` on the chained
/// plans, `default_prefetch()` on `fused`) and item sizes (else the set's, `MOE_CPU_DECODE_ITEM_KIB`).
/// Written and parsed as
/// `PLAN[:pfBYTES][:t0|t1|t2|nta][:wsKIB][:guKIB][:dnKIB][:stKIB][:ipN][:tail]`, e.g. `streams`,
/// `chained:pf8192:t1`, `chained:ws64`, `streams:dn384:st192` (gate/up and down bytes per item, the
/// streams plan's bytes per expert), `chained:ip8` (at least 8 items per thread in each half),
/// `chained:tail` (no claim-ahead among a group's last items).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodePath {
    pub plan: DecodePlan,
    /// The fused plans' kernel prefetch, set on every thread of their region.
    pub prefetch: Option<StreamPrefetch>,
    /// KiB of its first stream each thread prefetches into L2 before its first item of a call (the
    /// region's cold start); default none.
    pub warm_start_kib: Option<usize>,
    pub items: ItemKib,
    /// Items per thread each half of the region is cut into at least (default
    /// [`MIN_ITEMS_PER_THREAD`]): more, smaller items where a call's bytes are few.
    pub min_items: Option<usize>,
    /// Chained plans: a thread claims no item ahead once the group's counter is within one item
    /// per thread of the end, so the last items go to the threads that run out first instead of
    /// waiting behind a running item (the region's tail).
    pub tail_claims_off: bool,
}

/// Item sizes of a fused plan in KiB, each overriding the default where given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ItemKib {
    /// Gate plus up per gate/up item.
    pub gate_up: Option<usize>,
    /// Down per down item.
    pub down: Option<usize>,
    /// One expert's run of down N-tiles in a streams-plan down item.
    pub stream: Option<usize>,
}

/// The decode plans.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodePlan {
    /// Gate/up, down activations and down as separate regions with barriers between them.
    Split,
    /// One region with per-expert readiness instead of barriers (this module); down items span every
    /// expert of a chunk of N-tiles; stream heads warmed ahead.
    Fused,
    /// `Fused`, and each thread claims its next item before its current one's last stream, so the
    /// kernels' prefetch runs from one stream into the next without a gap and never past a stream's
    /// end into weights another item reads; by default 8 KiB ahead into L2. The default plan.
    Chained,
    /// `Chained` with down items of fewer, longer streams: a few experts × several N-tiles each
    /// (96 KiB per expert at the decode shapes), summed per N-tile in part order.
    Streams,
}

impl DecodePath {
    pub const SPLIT: DecodePath = DecodePath::plan(DecodePlan::Split);
    pub const FUSED: DecodePath = DecodePath::plan(DecodePlan::Fused);
    pub const CHAINED: DecodePath = DecodePath::plan(DecodePlan::Chained);
    pub const STREAMS: DecodePath = DecodePath::plan(DecodePlan::Streams);

    const fn plan(plan: DecodePlan) -> DecodePath {
        DecodePath {
            plan,
            prefetch: None,
            warm_start_kib: None,
            items: ItemKib {
                gate_up: None,
                down: None,
                stream: None,
            },
            min_items: None,
            tail_claims_off: false,
        }
    }

    /// `MOE_CPU_DECODE` (read once per process, see the type), else [`DecodePath::CHAINED`].
    pub fn from_env() -> DecodePath {
        static P: std::sync::OnceLock<DecodePath> = std::sync::OnceLock::new();
        *P.get_or_init(|| DECODE_PATH_KNOB.read_or(DecodePath::CHAINED))
    }

    /// The kernels' prefetch on this path's region: its own, else the chained plans'
    /// [`decode_prefetch`] or the others' [`default_prefetch`].
    fn kernel_prefetch(self) -> StreamPrefetch {
        self.prefetch.unwrap_or_else(|| {
            if self.chained() {
                decode_prefetch()
            } else {
                default_prefetch()
            }
        })
    }

    /// Whether decode-sized calls take the one-region path of this module.
    pub fn is_fused(self) -> bool {
        self.plan != DecodePlan::Split
    }

    /// Whether threads claim their next item ahead and chain the kernels' prefetch through it.
    fn chained(self) -> bool {
        matches!(self.plan, DecodePlan::Chained | DecodePlan::Streams)
    }
}

/// `MOE_CPU_DECODE`: the decode path ([`DecodePath::from_env`]).
pub(super) const DECODE_PATH_KNOB: Knob<DecodePath> = Knob {
    name: "MOE_CPU_DECODE",
    takes: "split, fused, chained or streams, options :pfBYTES :t0/t1/t2/nta :wsKIB :guKIB :dnKIB :stKIB :ipN :tail",
    parse: |v| DecodePath::from_str(v).ok(),
};

/// `MOE_CPU_DECODE_ITEM_KIB`: the fused plan's item sizes ([`Targets::from_env`]).
pub(super) const ITEM_KIB_KNOB: Knob<Targets> = Knob {
    name: "MOE_CPU_DECODE_ITEM_KIB",
    takes: "GATE_UP,DOWN in KiB, each at least 1, e.g. 512,384",
    parse: Targets::parse_kib,
};

impl FromStr for DecodePath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(':');
        let plan = match parts.next().unwrap_or_default() {
            "split" => DecodePlan::Split,
            "fused" => DecodePlan::Fused,
            "chained" => DecodePlan::Chained,
            "streams" => DecodePlan::Streams,
            p => {
                return Err(format!(
                    "unknown decode path {p:?} (expected split, fused, chained or streams)"
                ))
            }
        };
        let mut path = DecodePath::plan(plan);
        // a size in KiB that is at least 1 and fits usize in bytes
        let kib = |v: &str| {
            v.parse::<usize>()
                .ok()
                .filter(|&k| k > 0 && k.checked_mul(1024).is_some())
                .ok_or_else(|| format!("{s:?}: {v:?} is not a size in KiB"))
        };
        for opt in parts {
            let mut pf = path.kernel_prefetch();
            if let Some(bytes) = opt.strip_prefix("pf") {
                pf.distance = bytes.parse().map_err(|_| {
                    format!("{s:?}: prefetch distance {bytes:?} is not a byte count")
                })?;
                path.prefetch = Some(pf);
            } else if let Some(v) = opt.strip_prefix("ws") {
                path.warm_start_kib = Some(kib(v)?);
            } else if let Some(v) = opt.strip_prefix("gu") {
                path.items.gate_up = Some(kib(v)?);
            } else if let Some(v) = opt.strip_prefix("dn") {
                path.items.down = Some(kib(v)?);
            } else if let Some(v) = opt.strip_prefix("st") {
                path.items.stream = Some(kib(v)?);
            } else if let Some(v) = opt.strip_prefix("ip") {
                let n = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=MAX_ITEMS_PER_THREAD).contains(n))
                    .ok_or_else(|| {
                        format!("{s:?}: {v:?} is not a count of items per thread (1 to {MAX_ITEMS_PER_THREAD})")
                    })?;
                path.min_items = Some(n);
            } else if opt == "tail" {
                path.tail_claims_off = true;
            } else {
                pf.hint = opt.parse().map_err(|e| format!("{s:?}: {e}"))?;
                path.prefetch = Some(pf);
            }
        }
        if plan == DecodePlan::Split
            && (path.prefetch.is_some()
                || path.warm_start_kib.is_some()
                || path.items != ItemKib::default()
                || path.min_items.is_some()
                || path.tail_claims_off)
        {
            return Err(format!(
                "{s:?}: the split path takes MOE_CPU_PREFETCH* and no item sizes of its own"
            ));
        }
        if path.tail_claims_off && !path.chained() {
            return Err(format!(
                "{s:?}: only the chained plans claim items ahead (:tail)"
            ));
        }
        Ok(path)
    }
}

impl std::fmt::Display for DecodePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.plan {
            DecodePlan::Split => "split",
            DecodePlan::Fused => "fused",
            DecodePlan::Chained => "chained",
            DecodePlan::Streams => "streams",
        })?;
        if let Some(p) = self.prefetch {
            write!(f, ":pf{}:{}", p.distance, p.hint)?;
        }
        if let Some(n) = self.warm_start_kib {
            write!(f, ":ws{n}")?;
        }
        for (name, v) in [
            ("gu", self.items.gate_up),
            ("dn", self.items.down),
            ("st", self.items.stream),
        ] {
            if let Some(k) = v {
                write!(f, ":{name}{k}")?;
            }
        }
        if let Some(n) = self.min_items {
            write!(f, ":ip{n}")?;
        }
        if self.tail_claims_off {
            f.write_str(":tail")?;
        }
        Ok(())
    }
}

/// Largest call (tokens) the fused path takes; larger ones are prefill-like and keep the split path.
pub const FUSED_MAX_TOKENS: usize = 8;

/// Item sizes the fused plan aims at, in weight bytes read per item.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Targets {
    /// Gate plus up bytes of one gate/up item.
    pub gate_up: usize,
    /// Down bytes of one down item (all its experts).
    pub down: usize,
}

/// ~55 µs of one core's share of the DRAM bandwidth (150 GB/s over 16 cores) per gate/up item,
/// ~40 µs per down item, where [`MIN_ITEMS_PER_THREAD`] allows (at one token it decides: 96 gate/up
/// items at the Qwen3 and SmallThinker shapes): few stream starts and claims per byte. The region
/// still ends on small items, the down items of the experts whose gate/up finish last. Larger than
/// the 256 / 192 KiB before: 1-7 % less time at 2-8 tokens and level at one (PERF.md "Decode sizes,
/// part 3").
pub(super) const TARGETS: Targets = Targets {
    gate_up: 512 << 10,
    down: 384 << 10,
};

impl Targets {
    /// [`TARGETS`], or `MOE_CPU_DECODE_ITEM_KIB=GATE_UP,DOWN` (KiB per item; read once per process).
    pub fn from_env() -> Targets {
        static T: std::sync::OnceLock<Targets> = std::sync::OnceLock::new();
        *T.get_or_init(|| ITEM_KIB_KNOB.read_or(TARGETS))
    }

    /// `"GATE_UP,DOWN"` in KiB, both at least 1 and at most `usize::MAX` bytes.
    pub fn parse_kib(v: &str) -> Option<Targets> {
        let (g, d) = v.split_once(',')?;
        let kib = |s: &str| {
            s.trim()
                .parse::<usize>()
                .ok()
                .filter(|&k| k > 0)
                .and_then(|k| k.checked_mul(1024))
        };
        Some(Targets {
            gate_up: kib(g)?,
            down: kib(d)?,
        })
    }
}

/// At least this many items per thread in each half, so the counter can balance threads of unequal
/// speed.
pub(super) const MIN_ITEMS_PER_THREAD: usize = 4;

/// The most a path may ask for (`:ipN`): past it items shrink below one N-tile anyway.
const MAX_ITEMS_PER_THREAD: usize = 64;

/// Bytes of one expert's down weights a [`DecodePlan::Streams`] down item reads in one run (4 bf16
/// N-tiles at an intermediate width of 768): long enough that a stream's start is rare, short enough
/// for several items per thread.
pub(super) const STREAM_BYTES: usize = 96 << 10;

/// One work item of the fused region (indices are `u32` to keep the plan small).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Item {
    /// Gate and up of N-tiles `nt0 .. nt0 + nts` of active expert `ai` (index into `active`).
    GateUp { ai: u32, nt0: u32, nts: u32 },
    /// Down output tiles `nt0 .. nt0 + nts` over the group's experts `e0 .. e1` (indices into the
    /// group's list of active experts), summed into part `part` of those tiles.
    Down {
        part: u32,
        nt0: u32,
        nts: u32,
        e0: u32,
        e1: u32,
    },
}

/// How a group's down work is cut into items.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DownItems {
    /// Chunks of N-tiles over every expert (parts of experts when that is too many bytes).
    AcrossExperts,
    /// Parts of a few experts × chunks of this many bytes per expert ([`DecodePlan::Streams`]).
    Streams(usize),
}

/// The shape one group's plan is made for.
#[derive(Clone, Copy, Debug)]
pub(super) struct GroupShape {
    /// Active experts of the group (this call).
    pub experts: usize,
    pub gate_tiles: usize,
    /// Bytes of one N-tile of gate (and of up).
    pub gate_tile_bytes: usize,
    pub down_tiles: usize,
    pub down_tile_bytes: usize,
    pub threads: usize,
    /// Items per thread each half is cut into at least ([`MIN_ITEMS_PER_THREAD`] by default).
    pub min_items: usize,
}

/// One group's items and how its down work is cut.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct GroupPlan {
    pub items: Vec<Item>,
    /// Number of gate/up items of each of the group's experts (in group order).
    pub gate_up_items: Vec<u32>,
    /// Parts each down N-tile is summed in (1: its items add into the output directly).
    pub parts: usize,
}

/// Plans one group: every (expert, gate N-tile) once in gate/up items, then every (down N-tile,
/// expert) once in down items. `experts` are the group's active expert indices (into `active`).
#[cfg(test)]
pub(super) fn plan_group(
    shape: GroupShape,
    experts: &[u32],
    t: Targets,
    down: DownItems,
) -> GroupPlan {
    let mut plan = GroupPlan::default();
    plan_group_into(&mut plan, shape, experts, t, down);
    plan
}

/// [`plan_group`] into `plan`, reusing its storage from call to call.
pub(super) fn plan_group_into(
    plan: &mut GroupPlan,
    shape: GroupShape,
    experts: &[u32],
    t: Targets,
    down: DownItems,
) {
    let e = shape.experts;
    debug_assert_eq!(e, experts.len());
    plan.items.clear();
    plan.gate_up_items.clear();
    plan.parts = 1;
    if e == 0 {
        return;
    }
    let threads = shape.threads.max(1);
    let min_items = shape.min_items.max(1) * threads;
    // gate/up: `gc` N-tiles of gate and of up per item
    let g = shape.gate_tiles;
    let by_bytes = (t.gate_up / (2 * shape.gate_tile_bytes).max(1)).max(1);
    let by_count = (e * g / min_items).max(1);
    let gc = by_bytes.min(by_count).clamp(1, g);
    for &ai in experts {
        let mut n = 0;
        let mut nt = 0;
        while nt < g {
            let c = gc.min(g - nt);
            plan.items.push(Item::GateUp {
                ai,
                nt0: nt as u32,
                nts: c as u32,
            });
            nt += c;
            n += 1;
        }
        plan.gate_up_items.push(n);
    }
    match down {
        DownItems::AcrossExperts => plan_down_across(plan, shape, experts, t),
        DownItems::Streams(stream) => plan_down_streams(plan, shape, t, stream),
    }
}

/// Down items of chunks of N-tiles over all experts, or of one N-tile over parts of the experts.
fn plan_down_across(plan: &mut GroupPlan, shape: GroupShape, experts: &[u32], t: Targets) {
    let (e, threads) = (shape.experts, shape.threads.max(1));
    let min_items = shape.min_items.max(1) * threads;
    let d = shape.down_tiles;
    let per_tile_all = e * shape.down_tile_bytes;
    let (dc, per_part) = if per_tile_all <= t.down {
        let by_bytes = t.down / per_tile_all.max(1);
        let by_count = (d / min_items).max(1);
        (by_bytes.min(by_count).clamp(1, d), e)
    } else {
        let per_part = (t.down / shape.down_tile_bytes.max(1)).max(1);
        let parts = e.div_ceil(per_part);
        (1, e.div_ceil(parts))
    };
    let mut parts: Vec<(usize, usize)> = (0..e.div_ceil(per_part))
        .map(|p| (p * per_part, ((p + 1) * per_part).min(e)))
        .collect();
    // The experts of the last `threads` gate/up items may still be computing when the first down
    // item is taken: with one part they would make every early down item wait. They get a part of
    // their own, handed out after every other part: the early items never wait, and the late part's
    // items (one expert each per chunk) are the region's small last items.
    let late_from = plan
        .items
        .len()
        .checked_sub(threads)
        .map_or(0, |i| match plan.items[i] {
            Item::GateUp { ai, .. } => experts.iter().position(|&m| m == ai).unwrap_or(0),
            Item::Down { .. } => 0,
        });
    if parts.len() == 1 && late_from > 0 {
        parts = vec![(0, late_from), (late_from, e)];
    }
    // part-major: a later part holds later experts, which are ready later
    for (p, &(e0, e1)) in parts.iter().enumerate() {
        push_down_items(plan, p, (e0, e1), d, dc);
    }
    plan.parts = parts.len();
}

/// Down items of `stream` bytes per expert over parts of a few experts (about `t.down` bytes per
/// item, at least `MIN_ITEMS_PER_THREAD` items per thread); the last part, whose experts finish their
/// gate/up last, in single N-tiles, so the region ends on small items.
fn plan_down_streams(plan: &mut GroupPlan, shape: GroupShape, t: Targets, stream: usize) {
    let (e, d) = (shape.experts, shape.down_tiles);
    let tile = shape.down_tile_bytes.max(1);
    let min_items = shape.min_items.max(1) * shape.threads.max(1);
    let mut dc = (stream / tile).clamp(1, d);
    let mut per_part = (t.down / (dc * tile)).clamp(1, e);
    while d.div_ceil(dc) * e.div_ceil(per_part) < min_items && (per_part > 1 || dc > 1) {
        if per_part > 1 {
            per_part -= 1;
        } else {
            dc /= 2;
        }
    }
    let parts = e.div_ceil(per_part);
    for p in 0..parts {
        let (e0, e1) = (p * per_part, ((p + 1) * per_part).min(e));
        let tail = parts > 1 && p + 1 == parts;
        push_down_items(plan, p, (e0, e1), d, if tail { 1 } else { dc });
    }
    plan.parts = parts;
}

/// Down items of part `p` (experts `e0 .. e1`): N-tiles `0 .. d` in runs of `dc`.
fn push_down_items(plan: &mut GroupPlan, p: usize, (e0, e1): (usize, usize), d: usize, dc: usize) {
    let mut nt = 0;
    while nt < d {
        let c = dc.min(d - nt);
        plan.items.push(Item::Down {
            part: p as u32,
            nt0: nt as u32,
            nts: c as u32,
            e0: e0 as u32,
            e1: e1 as u32,
        });
        nt += c;
    }
}

/// Per-call state of the fused region, kept in the set's scratch between calls.
#[derive(Default)]
pub(super) struct FusedState {
    pub plans: Vec<GroupPlan>,
    /// Per group: its active expert indices, in order.
    pub members: Vec<Vec<u32>>,
    /// Per active expert: its gate/up items.
    items_of: Vec<u32>,
    /// Per active expert: gate/up items finished, and whether its down activations are complete.
    done: Vec<AtomicU32>,
    ready: Vec<AtomicBool>,
    /// Per group: the next item to take.
    next: Vec<AtomicUsize>,
    /// Per group and down N-tile: parts finished.
    arrived: Vec<Vec<AtomicU32>>,
    /// Per group: `parts × t × hidden` partial sums (only for groups whose chunks have parts).
    partial: Vec<Vec<f32>>,
    /// An item panicked: waiters stop waiting.
    abort: AtomicBool,
    /// Tests: the last gate/up item of each group sleeps this long first, so down items must wait.
    #[cfg(test)]
    pub slow_last_gate_up: Option<std::time::Duration>,
}

fn reset_atomics<T: Default>(v: &mut Vec<T>, n: usize, store: impl Fn(&T)) {
    if v.len() < n {
        v.resize_with(n, T::default);
    }
    v[..n].iter().for_each(store);
}

thread_local! {
    static YBUF: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static COMPUTED: RefCell<Vec<bool>> = const { RefCell::new(Vec::new()) };
}

/// Sets `abort` if dropped while unwinding (an item panicked), so no waiter spins forever.
struct AbortOnUnwind<'a>(&'a AtomicBool);
impl Drop for AbortOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Release);
        }
    }
}

/// Prefetches `bytes` from `p` into L2 (a waiting thread reading ahead; L1 is left to the kernels).
#[inline]
fn prefetch_l2(p: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let mut off = 0;
        while off < bytes {
            // SAFETY: prefetches never fault.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(off).cast()) };
            off += 64;
        }
    }
}

/// The first bytes of a stream into L1 ahead of use.
#[inline]
fn warm(p: &[u8]) {
    // SAFETY: prefetch only.
    unsafe { prefetch_head(p.as_ptr(), prefetch_distance().min(p.len())) };
}

/// [`warm`] for a stream known by its start (at least the prefetch distance long).
#[inline]
fn warm_ptr(p: *const u8) {
    // SAFETY: prefetch only.
    unsafe { prefetch_head(p, prefetch_distance()) };
}

/// The item a thread runs after its current one, on the chained plans: claimed from the group's
/// counter just before the current item's last stream, whose prefetch then runs into the claimed
/// item's first. No deadlock: a thread waits only inside a down item, and whatever it claimed while
/// running one comes after it in the order, so is a down item too, which nothing waits for.
struct Claim<'c> {
    g: usize,
    chained: bool,
    item: &'c mut Option<usize>,
}

impl CpuExpertSet {
    /// The fused region (see the module doc); `out` gets group 0's sums, `partial` (the split path's
    /// NUMA partial sums, `(groups − 1) × t × hidden`) the other groups'.
    pub(super) fn fused_region(&self, s: &mut Scratch, c: &Call<'_>, rows: usize, out: &mut [f32]) {
        let (t, hd, id, ip, hp) = (c.t, c.hd, c.id, c.ip, c.hp);
        let (tier, gkind, dkind) = (c.tier, c.gkind, c.dkind);
        let fuse = !matches!(dkind, ActKind::I8 { .. });
        let prows = s
            .active
            .last()
            .map_or(0, |a| a.pstart + a.m.div_ceil(16) * 16);
        s.ha.reserve(dkind, prows, ip);
        let hw = s.ha.writer(dkind, ip);
        if !fuse {
            s.h.resize(rows * id, 0.0);
        }
        if c.groups > 1 {
            s.partial.clear();
            s.partial.resize((c.groups - 1) * t * hd, 0.0);
        }
        self.plan_fused(s, c);
        let f = &mut s.fused;
        let n_active = s.active.len();
        reset_atomics(&mut f.done, n_active, |a| a.store(0, Ordering::Relaxed));
        reset_atomics(&mut f.ready, n_active, |a| {
            a.store(false, Ordering::Relaxed)
        });
        reset_atomics(&mut f.next, c.groups, |a| a.store(0, Ordering::Relaxed));
        f.abort.store(false, Ordering::Relaxed);
        f.arrived.resize_with(c.groups, Vec::new);
        f.partial.resize_with(c.groups, Vec::new);
        for g in 0..c.groups {
            let p = &f.plans[g];
            reset_atomics(&mut f.arrived[g], self.down_l.n_tiles, |a| {
                a.store(0, Ordering::Relaxed)
            });
            if p.parts > 1 {
                f.partial[g].resize(p.parts * t * hd, 0.0);
            }
        }
        // Per active expert: how many gate/up items it has (from its group's plan).
        f.items_of.clear();
        f.items_of.resize(n_active, 0);
        for (g, p) in f.plans.iter().enumerate() {
            for (k, &ai) in f.members[g].iter().enumerate() {
                f.items_of[ai as usize] = p.gate_up_items[k];
            }
        }
        let part_sums: Vec<SyncPtr<f32>> = f
            .partial
            .iter_mut()
            .map(|v| SyncPtr(v.as_mut_ptr()))
            .collect();
        let region = Region {
            set: self,
            c,
            path: c.path,
            fuse,
            hw,
            h: SyncPtr(s.h.as_mut_ptr()),
            out: SyncPtr(out.as_mut_ptr()),
            numa_partial: SyncPtr(s.partial.as_mut_ptr()),
            part_sums,
            st: &s.fused,
            active: &s.active,
            tok: &s.tok,
            wt: &s.wt,
            seq: &s.seq,
            xa: &s.xa,
            ha: &s.ha,
            tier,
            gkind,
            dkind,
            hp,
            ip,
        };
        let per_group: Vec<usize> = (0..c.groups).map(|g| c.pool.threads_in_group(g)).collect();
        c.pool.run(&per_group, &|g, _, _| region.worker(g));
    }

    /// Fills `s.fused.plans` / `members` for this call's active experts.
    fn plan_fused(&self, s: &mut Scratch, c: &Call<'_>) {
        let f = &mut s.fused;
        f.members.resize_with(c.groups, Vec::new);
        f.plans.resize_with(c.groups, GroupPlan::default);
        for (g, m) in f.members.iter_mut().enumerate() {
            m.clear();
            m.extend(
                s.active
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| a.group == g)
                    .map(|(i, _)| i as u32),
            );
        }
        let tile = |l: &super::pack::MatLayout| l.k_tiles * l.tile_bytes;
        let items = c.path.items;
        let down = match c.path.plan {
            DecodePlan::Streams => {
                DownItems::Streams(items.stream.map_or(STREAM_BYTES, |k| k << 10))
            }
            _ => DownItems::AcrossExperts,
        };
        let targets = Targets {
            gate_up: items
                .gate_up
                .map_or(self.fused_targets.gate_up, |k| k << 10),
            down: items.down.map_or(self.fused_targets.down, |k| k << 10),
        };
        for g in 0..c.groups {
            let shape = GroupShape {
                experts: f.members[g].len(),
                gate_tiles: self.gate_l.n_tiles,
                gate_tile_bytes: tile(&self.gate_l),
                down_tiles: self.down_l.n_tiles,
                down_tile_bytes: tile(&self.down_l),
                threads: c.pool.threads_in_group(g),
                min_items: c.path.min_items.unwrap_or(MIN_ITEMS_PER_THREAD),
            };
            plan_group_into(&mut f.plans[g], shape, &f.members[g], targets, down);
        }
    }
}

/// What every thread of the fused region reads.
struct Region<'a> {
    set: &'a CpuExpertSet,
    c: &'a Call<'a>,
    path: DecodePath,
    fuse: bool,
    hw: ActWriter,
    h: SyncPtr<f32>,
    out: SyncPtr<f32>,
    numa_partial: SyncPtr<f32>,
    part_sums: Vec<SyncPtr<f32>>,
    st: &'a FusedState,
    active: &'a [Active],
    tok: &'a [u32],
    wt: &'a [f32],
    seq: &'a [u32],
    xa: &'a ActBuf,
    /// Down activations: rows of an expert are read only after its `ready` flag was acquired, and
    /// are written (through `hw`) only before that flag is released.
    ha: &'a ActBuf,
    tier: crate::cpu::features::CpuTier,
    gkind: ActKind,
    dkind: ActKind,
    hp: usize,
    ip: usize,
}

// SAFETY: the raw pointers inside are only written at disjoint ranges (see each write), and the
// region outlives the pool call that shares it.
unsafe impl Sync for Region<'_> {}

impl Region<'_> {
    /// One thread's share: items of group `g` from its counter until none is left.
    fn worker(&self, g: usize) {
        let _guard = AbortOnUnwind(&self.st.abort);
        let chained = self.path.chained();
        let _prefetch = (chained || self.path.prefetch.is_some())
            .then(|| ThreadPrefetch::set(self.path.kernel_prefetch(), chained));
        let items = &self.st.plans[g].items;
        // the item this thread claimed while running its previous one (chained plans)
        let mut claimed = None;
        let mut first = true;
        loop {
            let i = claimed
                .take()
                .unwrap_or_else(|| self.st.next[g].fetch_add(1, Ordering::Relaxed));
            let Some(&item) = items.get(i) else {
                break;
            };
            if std::mem::take(&mut first) {
                if let Some(kib) = self.path.warm_start_kib {
                    let (head, len) = self.item_stream(g, item);
                    prefetch_l2(head, len.min(kib << 10));
                }
            }
            #[cfg(test)]
            if let Some(d) = self.st.slow_last_gate_up {
                let last = items.iter().rposition(|i| matches!(i, Item::GateUp { .. }));
                if last == Some(i) {
                    std::thread::sleep(d);
                }
            }
            let mut next = Claim {
                g,
                chained,
                item: &mut claimed,
            };
            match item {
                Item::GateUp { ai, nt0, nts } => self.gate_up(g, ai as usize, nt0, nts, &mut next),
                Item::Down {
                    part,
                    nt0,
                    nts,
                    e0,
                    e1,
                } => self.down(g, part, (nt0 as usize, nts as usize), (e0, e1), &mut next),
            }
        }
    }

    /// Where the first stream of item `i` of group `g` starts (null past the last item).
    fn item_head(&self, g: usize, i: usize) -> *const u8 {
        match self.st.plans[g].items.get(i) {
            Some(&Item::GateUp { ai, nt0, .. }) => {
                let [gate, _, _] = self.set.mats(self.active[ai as usize].e);
                gate.ntile(nt0 as usize).as_ptr()
            }
            Some(&Item::Down { nt0, e0, .. }) => self.down_head(g, e0 as usize, nt0 as usize),
            None => std::ptr::null(),
        }
    }

    /// The first stream of `item` of group `g`: where it starts and its bytes.
    fn item_stream(&self, g: usize, item: Item) -> (*const u8, usize) {
        let tile = |l: &super::pack::MatLayout| l.k_tiles * l.tile_bytes;
        match item {
            Item::GateUp { ai, nt0, nts } => {
                let [gate, _, _] = self.set.mats(self.active[ai as usize].e);
                (
                    gate.ntile(nt0 as usize).as_ptr(),
                    nts as usize * tile(&self.set.gate_l),
                )
            }
            Item::Down { nt0, nts, e0, .. } => (
                self.down_head(g, e0 as usize, nt0 as usize),
                nts as usize * tile(&self.set.down_l),
            ),
        }
    }

    /// Where down N-tile `nt` of the group's `k`-th expert starts.
    fn down_head(&self, g: usize, k: usize, nt: usize) -> *const u8 {
        let ai = self.st.members[g][k] as usize;
        let [_, _, down] = self.set.mats(self.active[ai].e);
        down.ntile(nt).as_ptr()
    }

    /// Prefetches the head of the first stream of the item the group's counter hands out next (most
    /// likely this thread's next one).
    fn warm_next(&self, g: usize) {
        let items = &self.st.plans[g].items;
        let Some(&item) = items.get(self.st.next[g].load(Ordering::Relaxed)) else {
            return;
        };
        match item {
            Item::GateUp { ai, nt0, .. } => {
                let [gate, _, _] = self.set.mats(self.active[ai as usize].e);
                warm(gate.ntile(nt0 as usize));
            }
            Item::Down { nt0, e0, .. } => {
                let ai = self.st.members[g][e0 as usize] as usize;
                let [_, _, down] = self.set.mats(self.active[ai].e);
                warm(down.ntile(nt0 as usize));
            }
        }
    }

    /// The item after the current one: claimed now (chained plans), its first stream's start
    /// returned for the current item's last kernel call to prefetch into.
    /// With `tail_claims_off`, nothing is claimed once the counter is within one item per thread
    /// of the group's end (null: the current item's prefetch stops at its own end).
    fn claim_next(&self, next: &mut Claim<'_>) -> *const u8 {
        let counter = &self.st.next[next.g];
        if self.path.tail_claims_off {
            let left = self.st.plans[next.g]
                .items
                .len()
                .saturating_sub(counter.load(Ordering::Relaxed));
            if left <= self.c.pool.threads_in_group(next.g) {
                return std::ptr::null();
            }
        }
        let i = counter.fetch_add(1, Ordering::Relaxed);
        *next.item = Some(i);
        self.item_head(next.g, i)
    }

    fn gate_up(&self, g: usize, ai: usize, nt0: u32, nts: u32, next: &mut Claim<'_>) {
        let (nt0, nts) = (nt0 as usize, nts as usize);
        let a = self.active[ai];
        let [gate, up, _] = self.set.mats(a.e);
        if next.chained {
            set_next_stream(up.ntile(nt0).as_ptr());
        } else {
            warm(up.ntile(nt0));
        }
        let view = self
            .xa
            .view(self.gkind, self.hp, &self.tok[a.start..a.start + a.m]);
        let ld = 16 * nts;
        let id = self.c.id;
        YBUF.with(|b| {
            let mut b = b.borrow_mut();
            if b.len() < 3 * a.m * ld {
                b.resize(3 * a.m * ld, 0.0);
            }
            let (gy, rest) = b.split_at_mut(a.m * ld);
            let (uy, hy) = rest.split_at_mut(a.m * ld);
            gemm(self.tier, false, &gate, nt0, nts, &view, gy, ld);
            if next.chained {
                set_next_stream(self.claim_next(next));
            } else {
                self.warm_next(g);
            }
            gemm(self.tier, false, &up, nt0, nts, &view, uy, ld);
            let cols = (id - nt0 * 16).min(ld);
            let (actf, limit) = (self.set.cfg.activation, self.set.cfg.swiglu_limit);
            for r in 0..a.m {
                let (gr, ur) = (&gy[r * ld..r * ld + cols], &uy[r * ld..r * ld + cols]);
                let w = self.wt[a.start + r];
                if self.fuse {
                    let hr = &mut hy[..cols];
                    gated_row(actf, limit, gr, ur, w, hr);
                    // SAFETY: these columns of padded row pstart + r belong to this item.
                    unsafe {
                        self.hw
                            .write_cols(a.pstart + r, nt0 * 16, hr, nt0 * 16 + cols == id)
                    };
                } else {
                    // SAFETY: row (start + r), columns nt0*16.. of h belong to this item.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(
                            self.h.get().add((a.start + r) * id + nt0 * 16),
                            cols,
                        )
                    };
                    gated_row(actf, limit, gr, ur, w, dst);
                }
            }
        });
        // The expert's last item makes its down activations whole (int8: quantized rows).
        let done = self.st.done[ai].fetch_add(1, Ordering::AcqRel) + 1;
        if done == self.st.items_of[ai] {
            if !self.fuse {
                for r in 0..a.m {
                    // SAFETY: every item of this expert is done (acquired above): its rows of h are
                    // complete and no one else writes padded row pstart + r.
                    unsafe {
                        let src =
                            std::slice::from_raw_parts(self.h.get().add((a.start + r) * id), id);
                        self.hw.write_row(a.pstart + r, src)
                    };
                }
            }
            self.st.ready[ai].store(true, Ordering::Release);
        }
    }

    /// Down of output tiles `nt0 .. nt0 + nts` over the group's experts `e0 .. e1`: the ready ones
    /// first, the others' weights pulled into L2 while waiting for them; then each expert's rows
    /// added in order (into the output, or into part `part`'s sums of those tiles).
    fn down(
        &self,
        g: usize,
        part: u32,
        (nt0, nts): (usize, usize),
        (e0, e1): (u32, u32),
        next: &mut Claim<'_>,
    ) {
        let members = &self.st.members[g][e0 as usize..e1 as usize];
        let ld = 16 * nts;
        let rows: usize = members.iter().map(|&ai| self.active[ai as usize].m).sum();
        YBUF.with(|yb| {
            COMPUTED.with(|cb| {
                let (mut y, mut computed) = (yb.borrow_mut(), cb.borrow_mut());
                if y.len() < rows * ld {
                    y.resize(rows * ld, 0.0);
                }
                computed.clear();
                computed.resize(members.len(), false);
                // ready experts first, each warming (chained: prefetching into) the next one's stream
                let mut waiting = false;
                let mut row0 = 0;
                for (k, &ai) in members.iter().enumerate() {
                    let a = self.active[ai as usize];
                    if self.st.ready[ai as usize].load(Ordering::Acquire) {
                        let following = (k + 1 < members.len())
                            .then(|| self.down_head(g, e0 as usize + k + 1, nt0));
                        match (next.chained, following) {
                            (true, Some(h)) => set_next_stream(h),
                            (true, None) if !waiting => set_next_stream(self.claim_next(next)),
                            (true, None) => {}
                            (false, Some(h)) => warm_ptr(h),
                            (false, None) => self.warm_next(g),
                        }
                        self.down_expert(a, nt0, nts, &mut y[row0 * ld..]);
                        computed[k] = true;
                    } else {
                        waiting = true;
                    }
                    row0 += a.m;
                }
                if waiting {
                    for (k, &ai) in members.iter().enumerate() {
                        if !computed[k] {
                            let [_, _, d] = self.set.mats(self.active[ai as usize].e);
                            let w = &d.w[nt0 * d.ntile(0).len()..];
                            prefetch_l2(w.as_ptr(), nts * d.ntile(0).len());
                        }
                    }
                    let last = computed.iter().rposition(|&c| !c);
                    let mut row0 = 0;
                    for (k, &ai) in members.iter().enumerate() {
                        let a = self.active[ai as usize];
                        if !computed[k] {
                            self.wait_ready(ai as usize);
                            if next.chained && last == Some(k) {
                                set_next_stream(self.claim_next(next));
                            }
                            self.down_expert(a, nt0, nts, &mut y[row0 * ld..]);
                        }
                        row0 += a.m;
                    }
                }
                self.sum_down(g, part, (nt0, nts), members, &y);
            })
        });
    }

    /// A down item's rows `y` (of `members`, stacked in order) added to the group's sums: into the
    /// output directly when each N-tile has one part; else into part `part`'s sums, and the part
    /// finishing an N-tile last adds all its parts to the output in order (deterministic).
    fn sum_down(
        &self,
        g: usize,
        part: u32,
        (nt0, nts): (usize, usize),
        members: &[u32],
        y: &[f32],
    ) {
        let (t, hd) = (self.c.t, self.c.hd);
        let ld = 16 * nts;
        let cols = (hd - nt0 * 16).min(ld);
        let dst = self.group_out(g);
        let parts = self.st.plans[g].parts;
        if parts == 1 {
            // SAFETY: columns nt0*16.. of every output row belong to this item.
            unsafe { self.add_rows(members, y, ld, nt0, cols, dst) };
            return;
        }
        let part_base = self.part_sums[g].get();
        // SAFETY: part `part`'s rows, columns nt0*16.. belong to this item.
        unsafe {
            let pd = part_base.add(part as usize * t * hd);
            for tk in 0..t {
                std::slice::from_raw_parts_mut(pd.add(tk * hd + nt0 * 16), cols).fill(0.0);
            }
            self.add_rows(members, y, ld, nt0, cols, pd);
        }
        for nt in nt0..nt0 + nts {
            let arrived = self.st.arrived[g][nt].fetch_add(1, Ordering::AcqRel) + 1;
            if arrived as usize != parts {
                continue;
            }
            let (c0, c) = (nt * 16, (hd - nt * 16).min(16));
            for p in 0..parts {
                for tk in 0..t {
                    // SAFETY: every part of N-tile nt is done (acquired above); its columns of the
                    // output belong to the item that finished it alone.
                    unsafe {
                        let src =
                            std::slice::from_raw_parts(part_base.add(p * t * hd + tk * hd + c0), c);
                        let o = std::slice::from_raw_parts_mut(dst.add(tk * hd + c0), c);
                        for (v, q) in o.iter_mut().zip(src) {
                            *v += q;
                        }
                    }
                }
            }
        }
    }

    /// `y` (rows of `members` stacked in order) added into `dst` (t × hidden) at columns nt0*16...
    ///
    /// # Safety
    /// Those columns of `dst` are this caller's alone.
    unsafe fn add_rows(
        &self,
        members: &[u32],
        y: &[f32],
        ld: usize,
        nt0: usize,
        cols: usize,
        dst: *mut f32,
    ) {
        let hd = self.c.hd;
        let mut row = 0;
        for &ai in members {
            let a = self.active[ai as usize];
            for r in 0..a.m {
                let tk = self.tok[a.start + r] as usize;
                // SAFETY: (caller) these columns are ours.
                let o =
                    unsafe { std::slice::from_raw_parts_mut(dst.add(tk * hd + nt0 * 16), cols) };
                for (v, q) in o.iter_mut().zip(&y[(row + r) * ld..]) {
                    *v += q;
                }
            }
            row += a.m;
        }
    }

    fn down_expert(&self, a: Active, nt0: usize, nts: usize, y: &mut [f32]) {
        let [_, _, down] = self.set.mats(a.e);
        let view = self
            .ha
            .view(self.dkind, self.ip, &self.seq[a.pstart..a.pstart + a.m]);
        gemm(self.tier, false, &down, nt0, nts, &view, y, 16 * nts);
    }

    fn wait_ready(&self, ai: usize) {
        let mut spins = 0u32;
        while !self.st.ready[ai].load(Ordering::Acquire) {
            if self.st.abort.load(Ordering::Acquire) {
                panic!("another item of the fused expert region panicked");
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1 << 16) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Where group `g`'s sums go: the output for group 0, its NUMA partial buffer otherwise.
    fn group_out(&self, g: usize) -> *mut f32 {
        if g == 0 {
            self.out.get()
        } else {
            self.numa_partial
                .get()
                .wrapping_add((g - 1) * self.c.t * self.c.hd)
        }
    }
}
