//! AVX-512 kernels for few tokens per expert (decode): one 64-byte load of a packed tile row feeds 16
//! outputs of every token in the block through `vdpbf16ps` (bf16) or `vpdpbusd` (int8, int4); FP8 lives
//! in `kern_fp8`, on the helpers here.
//! At one token these are memory-bound by design: ~1 dot instruction per 64 bytes, two independent
//! accumulator chains per token to cover the instruction latency, and a software prefetch
//! [`prefetch_distance`] bytes ahead in the contiguous N-tile stream: without it one core keeps too few
//! cache-line misses in flight and a decode token reached only ~65% of the DRAM bandwidth.
//! Tokens are taken in blocks of up to 8, so the
//! weight stream is read from DRAM once and from L2 once per further block. Twins:
//! `kern_generic::{gemm_scalar, gemm_i8_twin}`.
//!
//! Safety contract of every `pub(crate) unsafe fn` here: the CPU has the tier `Avx512` (F, BW, VL, BF16,
//! VNNI), `y` holds `rows × ldy` values with `16·nts ≤ ldy`, activation rows hold `k_pad` values of the
//! kind the kernel reads, and `w` is a packed matrix of the kernel's format.

use std::arch::x86_64::*;
use std::mem::transmute;
use std::sync::OnceLock;

use super::act::ActRef;
use super::pack::{GroupedCodes, MatRef};
use crate::knob::Knob;

/// Bytes ahead of the current weight row that the kernels prefetch: the calling thread's
/// [`ThreadPrefetch`] setting, else env `MOE_CPU_PREFETCH` (0 disables), else 4 KiB ≈ DRAM latency ×
/// one core's share of the bandwidth, with margin.
pub(crate) fn prefetch_distance() -> usize {
    CONTEXT
        .get()
        .map_or_else(|| default_prefetch().distance, |c| c.prefetch.distance)
}

/// The kernels' prefetch outside the chained decode plans (the split path, prefill-sized calls, the
/// `fused` plan): `MOE_CPU_PREFETCH` (bytes) and `MOE_CPU_PREFETCH_HINT` where set, else 4 KiB into L1.
pub fn default_prefetch() -> StreamPrefetch {
    env_prefetch(StreamPrefetch {
        distance: 4096,
        hint: PrefetchHint::T0,
    })
}

/// The chained decode plans' prefetch when their path names none: `MOE_CPU_PREFETCH` and
/// `MOE_CPU_PREFETCH_HINT` where set, else 8 KiB ahead into L2, the best of the settings timed at the
/// decode shapes (docs/PERF.md, "Decode sizes, part 2").
pub fn decode_prefetch() -> StreamPrefetch {
    env_prefetch(StreamPrefetch {
        distance: 8192,
        hint: PrefetchHint::T1,
    })
}

/// `MOE_CPU_PREFETCH`: the distance of [`default_prefetch`] and [`decode_prefetch`].
pub(super) const PREFETCH_KNOB: Knob<usize> = Knob {
    name: "MOE_CPU_PREFETCH",
    takes: "bytes ahead, 0 disables",
    parse: |v| v.parse().ok(),
};

/// `MOE_CPU_PREFETCH_HINT`: the hint of [`default_prefetch`] and [`decode_prefetch`].
pub(super) const PREFETCH_HINT_KNOB: Knob<PrefetchHint> = Knob {
    name: "MOE_CPU_PREFETCH_HINT",
    takes: "t0, t1, t2 or nta",
    parse: |v| v.parse().ok(),
};

/// `fallback` with what `MOE_CPU_PREFETCH` / `MOE_CPU_PREFETCH_HINT` set (read once per process; a
/// value a knob does not take warns once and leaves the fallback).
fn env_prefetch(fallback: StreamPrefetch) -> StreamPrefetch {
    static ENV: OnceLock<(Option<usize>, Option<PrefetchHint>)> = OnceLock::new();
    fn set<T>(knob: &Knob<T>) -> Option<T> {
        knob.check().unwrap_or_else(|e| {
            eprintln!("warning: {e}; using the default");
            None
        })
    }
    let (distance, hint) = *ENV.get_or_init(|| (set(&PREFETCH_KNOB), set(&PREFETCH_HINT_KNOB)));
    StreamPrefetch {
        distance: distance.unwrap_or(fallback.distance),
        hint: hint.unwrap_or(fallback.hint),
    }
}

/// Cache level the in-stream prefetches of the kernels fill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefetchHint {
    /// L1 (and L2): the default.
    T0,
    /// L2 only.
    T1,
    /// "L3 and higher" by the ISA's wording; what a core does with it is its own choice (on many
    /// Intel cores the same as T1).
    T2,
    /// Non-temporal: L1 without L2 / L3 allocation, for data read once (the weights of a decode call).
    Nta,
}

impl std::str::FromStr for PrefetchHint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "t0" => Ok(PrefetchHint::T0),
            "t1" => Ok(PrefetchHint::T1),
            "t2" => Ok(PrefetchHint::T2),
            "nta" => Ok(PrefetchHint::Nta),
            _ => Err(format!(
                "unknown prefetch hint {s:?} (expected t0, t1, t2 or nta)"
            )),
        }
    }
}

impl std::fmt::Display for PrefetchHint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PrefetchHint::T0 => "t0",
            PrefetchHint::T1 => "t1",
            PrefetchHint::T2 => "t2",
            PrefetchHint::Nta => "nta",
        })
    }
}

/// How far ahead (bytes; 0: no software prefetch) and into which cache level the kernels prefetch
/// their weight stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamPrefetch {
    pub distance: usize,
    pub hint: PrefetchHint,
}

/// What the fused decode region tells the kernels its thread calls (see [`ThreadPrefetch`]).
#[derive(Clone, Copy)]
struct CallContext {
    prefetch: StreamPrefetch,
    /// Prefetches stop at the end of each call's weights and continue into `next`.
    chained: bool,
    /// The first byte of the stream the thread reads after the next kernel call (null: unknown);
    /// taken by that call.
    next: *const u8,
}

thread_local! {
    static CONTEXT: std::cell::Cell<Option<CallContext>> = const { std::cell::Cell::new(None) };
}

/// Sets the prefetch of the kernel calls of this thread until dropped (then the previous setting
/// is back): the fused decode region, so that decode paths with different settings can be timed in
/// one process. `chained`: each call prefetches up to the end of its own weights and then into the
/// stream named by [`set_next_stream`], never into weights another item reads.
pub(super) struct ThreadPrefetch(Option<CallContext>);

impl ThreadPrefetch {
    pub(super) fn set(prefetch: StreamPrefetch, chained: bool) -> ThreadPrefetch {
        ThreadPrefetch(CONTEXT.replace(Some(CallContext {
            prefetch,
            chained,
            next: std::ptr::null(),
        })))
    }
}

impl Drop for ThreadPrefetch {
    fn drop(&mut self) {
        CONTEXT.set(self.0);
    }
}

/// Names the stream this thread reads after its next kernel call (chained prefetch only; no effect
/// outside a [`ThreadPrefetch`]).
pub(super) fn set_next_stream(next: *const u8) {
    if let Some(mut c) = CONTEXT.get() {
        c.next = next;
        CONTEXT.set(Some(c));
    }
}

/// The prefetch of one kernel call: `distance` bytes ahead of the row being read, with `hint`; in a
/// chained call, addresses at or past `end` (one past the call's weights) are moved into `next`
/// (none when null).
#[derive(Clone, Copy)]
pub(crate) struct Pf {
    distance: usize,
    hint: PrefetchHint,
    end: usize,
    next: *const u8,
}

impl Pf {
    /// For a call over N-tiles `nt0 .. nt0 + nts` of `w` (takes the thread's next stream).
    pub(crate) fn for_call(w: &MatRef<'_>, nt0: usize, nts: usize) -> Pf {
        let Some(c) = CONTEXT.get() else {
            let d = default_prefetch();
            return Pf::unchained(d);
        };
        if !c.chained {
            return Pf::unchained(c.prefetch);
        }
        set_next_stream(std::ptr::null());
        let tile = w.l.k_tiles * w.l.tile_bytes;
        Pf {
            distance: c.prefetch.distance,
            hint: c.prefetch.hint,
            end: (w.w.as_ptr() as usize).saturating_add((nt0 + nts) * tile),
            next: c.next,
        }
    }

    /// The thread's distance and hint, prefetching past the call's end (calls that convert weights
    /// tile by tile, outside the fused region's streams).
    pub(crate) fn plain() -> Pf {
        Pf::unchained(CONTEXT.get().map_or_else(default_prefetch, |c| c.prefetch))
    }

    fn unchained(p: StreamPrefetch) -> Pf {
        Pf {
            distance: p.distance,
            hint: p.hint,
            end: usize::MAX,
            next: std::ptr::null(),
        }
    }
}

impl Pf {
    /// The address a kernel reading `p` prefetches, if any.
    #[inline(always)]
    fn target(self, p: *const u8) -> Option<*const u8> {
        if self.distance == 0 {
            return None;
        }
        let at = p.wrapping_add(self.distance);
        if (at as usize) < self.end {
            Some(at)
        } else if self.next.is_null() {
            None
        } else {
            Some(self.next.wrapping_add(at as usize - self.end))
        }
    }
}

#[inline(always)]
pub(super) unsafe fn prefetch(p: *const u8, pf: Pf) {
    let Some(at) = pf.target(p) else {
        return;
    };
    let at = at.cast();
    // SAFETY: prefetches never fault, whatever the address. The hint and the end check are
    // predictable branches per 64 weight bytes of a memory-bound loop.
    unsafe {
        match pf.hint {
            PrefetchHint::T0 => _mm_prefetch::<_MM_HINT_T0>(at),
            PrefetchHint::T1 => _mm_prefetch::<_MM_HINT_T1>(at),
            PrefetchHint::T2 => _mm_prefetch::<_MM_HINT_T2>(at),
            PrefetchHint::Nta => _mm_prefetch::<_MM_HINT_NTA>(at),
        }
    }
}

/// Prefetches the first `pf` bytes of a weight stream: the in-loop prefetch only covers what lies
/// `pf` ahead, so without this each short stream (a down N-tile is 24 KiB) would start with a run of
/// serial misses.
#[inline(always)]
pub(super) unsafe fn prefetch_head(p: *const u8, pf: usize) {
    let mut off = 0;
    while off < pf {
        // SAFETY: prefetches never fault.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off).cast()) };
        off += 64;
    }
}

#[inline(always)]
pub(super) unsafe fn bh(v: __m512i) -> __m512bh {
    // SAFETY: same size, any bit pattern is a valid bf16 vector.
    unsafe { transmute::<__m512i, __m512bh>(v) }
}

/// Calls `$f::<R>(args)` for the block size `$n` (1..=$max).
macro_rules! by_rows {
    ($n:expr, 4, $f:ident($($a:expr),*)) => {
        match $n {
            4 => $f::<4>($($a),*), 3 => $f::<3>($($a),*), 2 => $f::<2>($($a),*), _ => $f::<1>($($a),*),
        }
    };
    ($n:expr, 8, $f:ident($($a:expr),*)) => {
        match $n {
            8 => $f::<8>($($a),*), 7 => $f::<7>($($a),*), 6 => $f::<6>($($a),*), 5 => $f::<5>($($a),*),
            4 => $f::<4>($($a),*), 3 => $f::<3>($($a),*), 2 => $f::<2>($($a),*), _ => $f::<1>($($a),*),
        }
    };
    ($n:expr, 8, skipping $f:ident(true, $($a:expr),*)) => {
        match $n {
            8 => $f::<8, true>($($a),*), 7 => $f::<7, true>($($a),*), 6 => $f::<6, true>($($a),*),
            5 => $f::<5, true>($($a),*), 4 => $f::<4, true>($($a),*), 3 => $f::<3, true>($($a),*),
            2 => $f::<2, true>($($a),*), _ => $f::<1, true>($($a),*),
        }
    };
    ($n:expr, 8, skipping $f:ident(false, $($a:expr),*)) => {
        match $n {
            8 => $f::<8, false>($($a),*), 7 => $f::<7, false>($($a),*), 6 => $f::<6, false>($($a),*),
            5 => $f::<5, false>($($a),*), 4 => $f::<4, false>($($a),*), 3 => $f::<3, false>($($a),*),
            2 => $f::<2, false>($($a),*), _ => $f::<1, false>($($a),*),
        }
    };
    // `$f::<R, SKIP>` with the arguments of a tuple, for `$skip` known at run time.
    ($n:expr, 8, $skip:expr, $f:ident $args:expr) => {{
        let (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9) = $args;
        if $skip {
            by_rows!($n, 8, skipping $f(true, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9))
        } else {
            by_rows!($n, 8, skipping $f(false, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9))
        }
    }};
}

pub(super) const MAX_ROWS: usize = 8;

/// Per block: activation row pointers (as 32-bit units), output pointers, and row indices.
pub(super) struct Block<T> {
    pub(super) x: [*const T; MAX_ROWS],
    pub(super) out: [*mut f32; MAX_ROWS],
    row: [usize; MAX_ROWS],
}

/// The token-block loop of every few-token kernel: for each N-tile `nt0 .. nt0 + nts` (the head of
/// the weight stream prefetched first) and each block of at most `max` of the view's rows, calls
/// `f(nt, weights of N-tile nt, block, rows in the block)`; N-tile `nt` writes output columns
/// `16·(nt − nt0) ..`. `base` and `elem`: the activation storage the kernel reads, its element size.
///
/// # Safety
/// As the module contract for `w`, `a`, `y` and `ldy`; `base` is the view's storage of that kind.
#[inline(always)]
pub(super) unsafe fn for_tiles<T>(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    (base, elem): (*const u8, usize),
    (y, ldy): (*mut f32, usize),
    max: usize,
    mut f: impl FnMut(usize, *const u8, &Block<T>, usize),
) {
    // SAFETY: prefetch only.
    unsafe { prefetch_head(w.ntile(nt0).as_ptr(), prefetch_distance()) };
    let m = a.rows.len();
    for nt in nt0..nt0 + nts {
        let wp = w.ntile(nt).as_ptr();
        let col = (nt - nt0) * 16;
        let mut r = 0;
        while r < m {
            let n = (m - r).min(max);
            let mut b = Block {
                x: [std::ptr::null(); MAX_ROWS],
                out: [std::ptr::null_mut(); MAX_ROWS],
                row: [0; MAX_ROWS],
            };
            for i in 0..n {
                let row = a.rows[r + i] as usize;
                b.row[i] = row;
                // SAFETY: (contract) rows and y in range.
                unsafe {
                    b.x[i] = base.add(row * a.k_pad * elem).cast();
                    b.out[i] = y.add((r + i) * ldy + col);
                }
            }
            f(nt, wp, &b, n);
            r += n;
        }
    }
}

/// Bf16 weights × bf16 activations.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn gemm_bf16(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: *mut f32,
    ldy: usize,
) {
    let pairs = w.l.k_pad / 2;
    let pf = Pf::for_call(w, nt0, nts);
    let act = (a.b.as_ptr().cast(), 2);
    // SAFETY: (contract).
    unsafe {
        for_tiles::<u32>(w, nt0, nts, a, act, (y, ldy), 8, |_, wp, b, n| {
            by_rows!(n, 8, bf16_block(wp, pairs, pf, &b.x, &b.out))
        })
    }
}

#[inline(always)]
unsafe fn bf16_block<const R: usize>(
    wp: *const u8,
    pairs: usize,
    pf: Pf,
    x: &[*const u32; MAX_ROWS],
    out: &[*mut f32; MAX_ROWS],
) {
    // SAFETY: (caller) pointers cover `pairs` u32 / rows of 64 bytes.
    unsafe {
        let mut acc0 = [_mm512_setzero_ps(); R];
        let mut acc1 = [_mm512_setzero_ps(); R];
        let mut i = 0;
        while i < pairs {
            prefetch(wp.add(i * 64), pf);
            prefetch(wp.add(i * 64 + 64), pf);
            let w0 = bh(_mm512_loadu_si512(wp.add(i * 64).cast()));
            let w1 = bh(_mm512_loadu_si512(wp.add(i * 64 + 64).cast()));
            for r in 0..R {
                let x0 = bh(_mm512_set1_epi32(x[r].add(i).read_unaligned() as i32));
                let x1 = bh(_mm512_set1_epi32(x[r].add(i + 1).read_unaligned() as i32));
                acc0[r] = _mm512_dpbf16_ps(acc0[r], w0, x0);
                acc1[r] = _mm512_dpbf16_ps(acc1[r], w1, x1);
            }
            i += 2;
        }
        for r in 0..R {
            _mm512_storeu_ps(out[r], _mm512_add_ps(acc0[r], acc1[r]));
        }
    }
}

/// F16 weights × f32 activations: per 64-byte row (16 outputs × 2 inputs) two `vcvtph2ps` and two
/// FMAs against the input pair broadcast as one 64-bit lane pattern; each output's two lanes are
/// summed at the end. Exact f16 values, f32 products: no rounding of weights or activations.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn gemm_f16(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: *mut f32,
    ldy: usize,
) {
    let pairs = w.l.k_pad / 2;
    let pf = Pf::for_call(w, nt0, nts);
    let act = (a.f.as_ptr().cast(), 4);
    // SAFETY: (contract).
    unsafe {
        for_tiles::<u64>(w, nt0, nts, a, act, (y, ldy), 4, |_, wp, b, n| {
            by_rows!(n, 4, f16_block(wp, pairs, pf, &b.x, &b.out))
        })
    }
}

#[inline(always)]
unsafe fn f16_block<const R: usize>(
    wp: *const u8,
    pairs: usize,
    pf: Pf,
    x: &[*const u64; MAX_ROWS],
    out: &[*mut f32; MAX_ROWS],
) {
    // SAFETY: (caller) `pairs` (even) rows of 64 bytes; x rows hold `pairs` f32 pairs.
    unsafe {
        // Lanes 2j, 2j+1 of `lo` hold output j's two products (j < 8), of `hi` output 8 + j.
        let mut lo = [[_mm512_setzero_ps(); 2]; R];
        let mut hi = [[_mm512_setzero_ps(); 2]; R];
        let mut i = 0;
        while i < pairs {
            prefetch(wp.add(i * 64), pf);
            prefetch(wp.add(i * 64 + 64), pf);
            for u in 0..2 {
                let v = _mm512_loadu_si512(wp.add((i + u) * 64).cast());
                let wl = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
                let wh = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(v));
                for r in 0..R {
                    let xp = _mm512_castsi512_ps(_mm512_set1_epi64(
                        x[r].add(i + u).read_unaligned() as i64,
                    ));
                    lo[r][u] = _mm512_fmadd_ps(wl, xp, lo[r][u]);
                    hi[r][u] = _mm512_fmadd_ps(wh, xp, hi[r][u]);
                }
            }
            i += 2;
        }
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        for r in 0..R {
            let (l, h) = (
                _mm512_add_ps(lo[r][0], lo[r][1]),
                _mm512_add_ps(hi[r][0], hi[r][1]),
            );
            let sum = _mm512_add_ps(
                _mm512_permutex2var_ps(l, even, h),
                _mm512_permutex2var_ps(l, odd, h),
            );
            _mm512_storeu_ps(out[r], sum);
        }
    }
}

/// Int8 (u8 = q + 128, per-row scales) or int4 (u4 = q + 8, group scales) weights × int8 activations.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn gemm_int(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: *mut f32,
    ldy: usize,
) {
    let groups = a.groups();
    let pf = Pf::for_call(w, nt0, nts);
    let act = (a.q.as_ptr().cast(), 1);
    // SAFETY: (contract).
    unsafe {
        prefetch_scales(w, nt0);
        for_tiles::<i32>(w, nt0, nts, a, act, (y, ldy), 8, |nt, wp, b, n| {
            if b.row[0] == a.rows[0] as usize && nt + 1 < nt0 + nts {
                prefetch_scales(w, nt + 1);
            }
            let (gs, xs) = row_terms(a, b, n, groups);
            let (x, out) = (&b.x, &b.out);
            let gl = Groups {
                all: groups,
                live: a.live,
            };
            // A view restricted to live groups is a residual view: skip its dead rows.
            let skip = !a.live.is_empty();
            match GroupedCodes::of(w.l.format) {
                Some(c) if c.int4 => {
                    let s = &w.s16()[c.scale_at(groups, nt, 0)..];
                    let args = (wp, c.group, gl, c.with_min, pf, s, x, &gs, &xs, out);
                    by_rows!(n, 8, skip, i4_block args)
                }
                Some(c) => {
                    let s = &w.s16()[c.scale_at(groups, nt, 0)..];
                    let args = (wp, c.group, gl, c.with_min, pf, s, x, &gs, &xs, out);
                    by_rows!(n, 8, skip, i8_grouped_block args)
                }
                None => {
                    let s = &w.s[nt * 16..];
                    by_rows!(n, 8, i8_block(wp, a.k_pad / 4, pf, s, x, &gs, &xs, out))
                }
            }
        })
    }
}

/// The groups a grouped kernel visits: all `all` of them, or only the `live` ones.
#[derive(Clone, Copy)]
struct Groups<'a> {
    all: usize,
    live: &'a [u16],
}

impl Groups<'_> {
    #[inline(always)]
    fn len(self) -> usize {
        if self.live.is_empty() {
            self.all
        } else {
            self.live.len()
        }
    }

    /// The `i`-th group visited.
    #[inline(always)]
    fn get(self, i: usize) -> usize {
        if self.live.is_empty() {
            i
        } else {
            self.live[i] as usize
        }
    }
}

/// Prefetches the scales of N-tile `nt`: a grouped format's f16 scales (and mins), or Int8's 16 f32
/// row scales. They live apart from the tiles, so the weight stream's prefetch does not cover them:
/// without this every 64 bytes of group scales was a demand miss in the middle of the weight stream,
/// and Int8's row scales one at the end of every N-tile (12 KiB of weights in an int8 down tile at an
/// intermediate width of 768).
#[inline(always)]
unsafe fn prefetch_scales(w: &MatRef<'_>, nt: usize) {
    // bytes of scales per N-tile
    let per_tile = match GroupedCodes::of(w.l.format) {
        Some(c) => 2 * c.scale_at(w.l.k_pad / c.group, 1, 0),
        None if w.l.format == super::pack::WeightFormat::Int8 => 16 * 4,
        None => return,
    };
    let base = w.s.as_ptr().cast::<u8>().wrapping_add(nt * per_tile);
    let mut off = 0;
    while off < per_tile {
        // SAFETY: prefetches never fault.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(off).cast()) };
        off += 64;
    }
}

/// Group-sum and activation-scale pointers (one per group) of a block's rows.
#[inline(always)]
fn row_terms(
    a: &ActRef<'_>,
    b: &Block<i32>,
    n: usize,
    groups: usize,
) -> ([*const i32; MAX_ROWS], [*const f32; MAX_ROWS]) {
    let mut gs = [std::ptr::null(); MAX_ROWS];
    let mut xs = [std::ptr::null(); MAX_ROWS];
    for i in 0..n {
        gs[i] = a.gsum[b.row[i] * groups..].as_ptr();
        xs[i] = a.scale[b.row[i] * groups..].as_ptr();
    }
    (gs, xs)
}

/// Per token: Σ over the quad rows `from .. to` (an even count, 64 bytes each: 16 outputs × 4 inputs)
/// of `vpdpbusd(weights, activation quad)`, in two accumulator chains summed at the end. Rows not `live`
/// (a group of zero codes: the residual row of a group without outliers) are skipped and give 0.
#[inline(always)]
unsafe fn dot_quads<const R: usize>(
    wp: *const u8,
    from: usize,
    to: usize,
    pf: Pf,
    x: &[*const i32; MAX_ROWS],
    live: [bool; R],
) -> [__m512i; R] {
    // SAFETY: (caller) rows `from .. to` of 64 bytes; x rows hold `to` i32.
    unsafe {
        let mut acc0 = [_mm512_setzero_si512(); R];
        let mut acc1 = [_mm512_setzero_si512(); R];
        let mut i = from;
        while i < to {
            prefetch(wp.add(i * 64), pf);
            prefetch(wp.add(i * 64 + 64), pf);
            let w0 = _mm512_loadu_si512(wp.add(i * 64).cast());
            let w1 = _mm512_loadu_si512(wp.add(i * 64 + 64).cast());
            for r in 0..R {
                if !live[r] {
                    continue;
                }
                let x0 = _mm512_set1_epi32(x[r].add(i).read_unaligned());
                let x1 = _mm512_set1_epi32(x[r].add(i + 1).read_unaligned());
                acc0[r] = _mm512_dpbusd_epi32(acc0[r], w0, x0);
                acc1[r] = _mm512_dpbusd_epi32(acc1[r], w1, x1);
            }
            i += 2;
        }
        std::array::from_fn(|r| _mm512_add_epi32(acc0[r], acc1[r]))
    }
}

/// Which rows of a block have a non-zero activation scale for group `g` (a zero scale marks a group
/// whose codes are all zero: [`dot_quads`] and `i4_block` skip it).
#[inline(always)]
unsafe fn live_rows<const R: usize>(xs: &[*const f32; MAX_ROWS], g: usize) -> [bool; R] {
    // SAFETY: (caller) every row has a scale for group g.
    std::array::from_fn(|r| unsafe { *xs[r].add(g) } != 0.0)
}

#[inline(always)]
unsafe fn i8_block<const R: usize>(
    wp: *const u8,
    quads: usize,
    pf: Pf,
    wscale: &[f32],
    x: &[*const i32; MAX_ROWS],
    gsum: &[*const i32; MAX_ROWS],
    xs: &[*const f32; MAX_ROWS],
    out: &[*mut f32; MAX_ROWS],
) {
    // SAFETY: (caller) `quads` rows of 64 bytes; x rows hold `quads` i32; 16 scales.
    unsafe {
        let acc = dot_quads::<R>(wp, 0, quads, pf, x, [true; R]);
        let ws = _mm512_loadu_ps(wscale.as_ptr());
        for r in 0..R {
            let acc = _mm512_sub_epi32(acc[r], _mm512_set1_epi32(128 * *gsum[r]));
            let s = _mm512_mul_ps(ws, _mm512_set1_ps(*xs[r]));
            _mm512_storeu_ps(out[r], _mm512_mul_ps(_mm512_cvtepi32_ps(acc), s));
        }
    }
}

/// Int4 with a group scale (Q4_0: `w = (u − 8)·d`) or, `with_min`, a group scale and min (Q4_1:
/// `w = u·d + m`): per group `d·Σ u·x − 8d·Σx`, or `d·Σ u·x + m·Σ x`, both sums from integer dots.
///
/// Cost per (row, group of 32 inputs × 16 outputs): 8 `vpdpbusd` and 4 more vector ops for the
/// scaling (convert, `d · x-scale`, two FMAs); the nibble split of the 4 weight loads is shared by
/// every row of the block. With `SKIP` (a residual view: most of its rows have no codes in most
/// groups) rows whose group scale is 0 are skipped one by one; otherwise every row runs branch-free
/// (a zero scale gives 0 all the same) and only a group no row has codes in is skipped.
#[inline(always)]
unsafe fn i4_block<const R: usize, const SKIP: bool>(
    wp: *const u8,
    group: usize,
    groups: Groups<'_>,
    with_min: bool,
    pf: Pf,
    scales: &[u16],
    x: &[*const i32; MAX_ROWS],
    gsum: &[*const i32; MAX_ROWS],
    xs: &[*const f32; MAX_ROWS],
    out: &[*mut f32; MAX_ROWS],
) {
    // SAFETY: (caller) `k_pad / 8` packed rows of 64 bytes; scales hold 16 (32 with the min) per
    // group.
    unsafe {
        let nib = _mm512_set1_epi8(0x0F);
        let mut total = [_mm512_setzero_ps(); R];
        let per_group = group / 8;
        let stride = if with_min { 32 } else { 16 };
        for gi in 0..groups.len() {
            let g = groups.get(gi);
            let live: [bool; R] = if SKIP { live_rows(xs, g) } else { [true; R] };
            if SKIP && live == [false; R] {
                continue; // residual rows of a group without outliers: no loads at all
            }
            let mut lo_acc = [_mm512_setzero_si512(); R];
            let mut hi_acc = [_mm512_setzero_si512(); R];
            let prs = g * per_group..(g + 1) * per_group;
            if SKIP && per_group == 4 {
                // A residual view: the group's 4 weight rows split into nibbles once (8 registers),
                // then one branch per row and a chain of 8 dots for each live one.
                let mut nibbles = [[_mm512_setzero_si512(); 2]; 4];
                for (i, pr) in prs.clone().enumerate() {
                    prefetch(wp.add(pr * 64), pf);
                    let v = _mm512_loadu_si512(wp.add(pr * 64).cast());
                    nibbles[i] = [
                        _mm512_and_si512(v, nib),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib),
                    ];
                }
                for r in 0..R {
                    if !live[r] {
                        continue;
                    }
                    let xr = x[r].add(2 * prs.start);
                    for (i, [lo, hi]) in nibbles.iter().enumerate() {
                        let xl = _mm512_set1_epi32(xr.add(2 * i).read_unaligned());
                        let xh = _mm512_set1_epi32(xr.add(2 * i + 1).read_unaligned());
                        lo_acc[r] = _mm512_dpbusd_epi32(lo_acc[r], *lo, xl);
                        hi_acc[r] = _mm512_dpbusd_epi32(hi_acc[r], *hi, xh);
                    }
                }
            } else {
                // Two accumulator chains per row when the block has few rows (the dot latency),
                // one otherwise (the rows interleave).
                for pr in prs {
                    prefetch(wp.add(pr * 64), pf);
                    let v = _mm512_loadu_si512(wp.add(pr * 64).cast());
                    let lo = _mm512_and_si512(v, nib);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib);
                    for r in 0..R {
                        if SKIP && !live[r] {
                            continue;
                        }
                        let xl = _mm512_set1_epi32(x[r].add(2 * pr).read_unaligned());
                        let xh = _mm512_set1_epi32(x[r].add(2 * pr + 1).read_unaligned());
                        if R <= 2 {
                            lo_acc[r] = _mm512_dpbusd_epi32(lo_acc[r], lo, xl);
                            hi_acc[r] = _mm512_dpbusd_epi32(hi_acc[r], hi, xh);
                        } else {
                            lo_acc[r] = _mm512_dpbusd_epi32(lo_acc[r], lo, xl);
                            lo_acc[r] = _mm512_dpbusd_epi32(lo_acc[r], hi, xh);
                        }
                    }
                }
            }
            let at = scales.as_ptr().add(g * stride);
            let dv = _mm512_cvtph_ps(_mm256_loadu_si256(at.cast()));
            let mv = if with_min {
                _mm512_cvtph_ps(_mm256_loadu_si256(at.add(16).cast()))
            } else {
                _mm512_setzero_ps()
            };
            for r in 0..R {
                if SKIP && !live[r] {
                    continue;
                }
                let acc = if R <= 2 || (SKIP && per_group == 4) {
                    _mm512_add_epi32(lo_acc[r], hi_acc[r])
                } else {
                    lo_acc[r]
                };
                let (gs, x_scale) = (*gsum[r].add(g), *xs[r].add(g));
                let dx = _mm512_mul_ps(dv, _mm512_set1_ps(x_scale));
                total[r] = if with_min {
                    let t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), dx, total[r]);
                    _mm512_fmadd_ps(mv, _mm512_set1_ps(gs as f32 * x_scale), t)
                } else {
                    let acc = _mm512_sub_epi32(acc, _mm512_set1_epi32(8 * gs));
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), dx, total[r])
                };
            }
        }
        store_rows(&total, out);
    }
}

/// 8-bit codes with a group scale (Q8_0 / Q6_K: `w = (u − 128)·d`) or, `with_min`, a group scale and min
/// (Q5_K: `w = u·d + m`): per group an integer dot, then `d·(Σ u·x − 128·Σ x)` or `d·Σ u·x + m·Σ x`.
/// `SKIP` as for [`i4_block`].
#[inline(always)]
unsafe fn i8_grouped_block<const R: usize, const SKIP: bool>(
    wp: *const u8,
    group: usize,
    groups: Groups<'_>,
    with_min: bool,
    pf: Pf,
    scales: &[u16],
    x: &[*const i32; MAX_ROWS],
    gsum: &[*const i32; MAX_ROWS],
    xs: &[*const f32; MAX_ROWS],
    out: &[*mut f32; MAX_ROWS],
) {
    // SAFETY: (caller) `groups * group / 4` rows of 64 bytes; scales hold 16 (32 with the min) per
    // group.
    unsafe {
        let mut total = [_mm512_setzero_ps(); R];
        let quads = group / 4;
        let stride = if with_min { 32 } else { 16 };
        for gi in 0..groups.len() {
            let g = groups.get(gi);
            let live: [bool; R] = if SKIP { live_rows(xs, g) } else { [true; R] };
            if SKIP && live == [false; R] {
                continue;
            }
            let acc = dot_quads::<R>(wp, g * quads, (g + 1) * quads, pf, x, live);
            let at = scales.as_ptr().add(g * stride);
            let dv = _mm512_cvtph_ps(_mm256_loadu_si256(at.cast()));
            let mv = if with_min {
                _mm512_cvtph_ps(_mm256_loadu_si256(at.add(16).cast()))
            } else {
                _mm512_setzero_ps()
            };
            for (r, &live) in live.iter().enumerate() {
                if SKIP && !live {
                    continue;
                }
                let (gs, x_scale) = (*gsum[r].add(g), *xs[r].add(g));
                let dx = _mm512_mul_ps(dv, _mm512_set1_ps(x_scale));
                total[r] = if with_min {
                    let t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), dx, total[r]);
                    _mm512_fmadd_ps(mv, _mm512_set1_ps(gs as f32 * x_scale), t)
                } else {
                    let acc = _mm512_sub_epi32(acc[r], _mm512_set1_epi32(128 * gs));
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), dx, total[r])
                };
            }
        }
        store_rows(&total, out);
    }
}

/// Stores each row's 16 outputs.
#[inline(always)]
unsafe fn store_rows<const R: usize>(total: &[__m512; R], out: &[*mut f32; MAX_ROWS]) {
    for r in 0..R {
        // SAFETY: (caller) each output row holds 16 values.
        unsafe { _mm512_storeu_ps(out[r], total[r]) };
    }
}

/// Int8 activation rows (code · row scale) as bf16 rows of `k_pad`, consecutive in `out`; rows
/// `rows.len() .. m_pad` are zero.
///
/// # Safety
/// As the module contract; `a` has int8 kind and `out` holds `m_pad * a.k_pad` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn i8_rows_to_bf16(a: &ActRef<'_>, m_pad: usize, out: &mut [u16]) {
    let k = a.k_pad;
    assert!(out.len() >= m_pad * k && k.is_multiple_of(32));
    for (r, &row) in a.rows.iter().enumerate() {
        let row = row as usize;
        let groups = a.groups();
        let group = k / groups;
        let src = a.q[row * k..(row + 1) * k].as_ptr();
        let dst = out[r * k..].as_mut_ptr();
        for c in (0..k).step_by(32) {
            // Groups are at least 16 inputs: each half of the 32 has one scale.
            let s_lo = _mm512_set1_ps(a.scale[row * groups + c / group]);
            let s_hi = _mm512_set1_ps(a.scale[row * groups + (c + 16) / group]);
            // SAFETY: 32 codes and 32 outputs in bounds.
            unsafe {
                let lo = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src.add(c).cast()))),
                    s_lo,
                );
                let hi = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                        src.add(c + 16).cast(),
                    ))),
                    s_hi,
                );
                _mm512_storeu_si512(
                    dst.add(c).cast(),
                    transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)),
                );
            }
        }
    }
    out[a.rows.len() * k..m_pad * k].fill(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chained call prefetches its own weights up to their end, then the next stream from its
    /// first byte on, and nothing past its end without one; an unchained call never stops.
    #[test]
    fn chained_prefetch_runs_into_the_next_stream() {
        let own = vec![0u8; 8192];
        let next = vec![0u8; 8192];
        let (p, end) = (own.as_ptr(), own.as_ptr() as usize + own.len());
        let pf = |next: *const u8| Pf {
            distance: 1024,
            hint: PrefetchHint::T0,
            end,
            next,
        };
        assert_eq!(pf(next.as_ptr()).target(p), Some(p.wrapping_add(1024)));
        let last_own = p.wrapping_add(8192 - 1024 - 64);
        assert_eq!(
            pf(next.as_ptr()).target(last_own),
            Some(p.wrapping_add(8192 - 64))
        );
        let first_past = p.wrapping_add(8192 - 1024);
        assert_eq!(pf(next.as_ptr()).target(first_past), Some(next.as_ptr()));
        assert_eq!(
            pf(next.as_ptr()).target(p.wrapping_add(8192 - 64)),
            Some(next.as_ptr().wrapping_add(1024 - 64))
        );
        assert_eq!(pf(std::ptr::null()).target(first_past), None);
        let plain = Pf::unchained(StreamPrefetch {
            distance: 1024,
            hint: PrefetchHint::T1,
        });
        assert_eq!(plain.target(first_past), Some(p.wrapping_add(8192)));
        let off = Pf::unchained(StreamPrefetch {
            distance: 0,
            hint: PrefetchHint::T0,
        });
        assert_eq!(off.target(p), None);
    }

    /// The thread's setting reaches the kernels' calls and is gone once dropped; the next stream is
    /// taken by one call only.
    #[test]
    fn thread_prefetch_is_scoped_and_next_stream_taken_once() {
        let w = vec![0u8; 4 * 1024];
        let m = MatRef {
            l: super::super::pack::MatLayout::new(super::super::pack::WeightFormat::Bf16, 64, 32),
            w: &w,
            s: &[],
        };
        let next = [0u8; 64];
        {
            let _s = ThreadPrefetch::set(
                StreamPrefetch {
                    distance: 256,
                    hint: PrefetchHint::T1,
                },
                true,
            );
            assert_eq!(prefetch_distance(), 256);
            set_next_stream(next.as_ptr());
            let a = Pf::for_call(&m, 0, 4);
            assert_eq!((a.end, a.next), (w.as_ptr() as usize + 4096, next.as_ptr()));
            let b = Pf::for_call(&m, 0, 2);
            assert_eq!(
                (b.end, b.next),
                (w.as_ptr() as usize + 2048, std::ptr::null())
            );
        }
        assert_eq!(prefetch_distance(), default_prefetch().distance);
        assert_eq!(Pf::for_call(&m, 0, 4).end, usize::MAX);
    }
}
