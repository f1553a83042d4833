//! What `cpu_moe_bench` adds to make its timed calls look like the layers of the engine's decode step,
//! and the anchor that says what the same bytes cost to read (PERF.md "Decode sizes, part 3").
//!
//! In the engine a layer's CPU experts run after an idle window (~74 µs: the GPU segment) in which
//! the engine thread spins on the hand-off's routing flag, the pool's workers spin in their wait
//! (the window is shorter than the pool's spin time) and the DRAM is idle; the activation rows
//! arrive from the GPU through mapped memory, so they are not in any CPU cache; and 48-52 layers
//! take turns, so the pages read per token are three times the bench's usual 16 layers. Each of
//! these is a list here, timed in turn in one process: `gaps_us` (0 = back to back), `cycles`
//! (layers cycled through). The read anchor streams exactly the bytes a call's experts occupy with
//! the DRAM probe's loop on the same pool, so a kernel row's share of it is free of where the probe's
//! buffer and the experts happen to lie in memory (the probe moves by up to 20 % between processes
//! on one host; the kernels' GB/s much less).

use std::time::{Duration, Instant};

use super::moe::{CpuExpertSet, DecodePath, PrefetchHint, StreamPrefetch};
use super::pool::WorkerPool;

/// One row kind of the bench's table: a decode path, or the read anchor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchRow {
    Path(DecodePath),
    Read(ReadAnchor),
}

/// The read anchor: every thread of the pool sums `chunk`-byte pieces of the call's experts (their
/// packed bytes, expert after expert) with 512-bit loads, optionally with a software prefetch
/// `distance` bytes ahead inside the piece (else the hardware prefetchers alone, as the DRAM probe).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadAnchor {
    pub prefetch: Option<StreamPrefetch>,
    pub chunk: usize,
}

/// Bytes per read-anchor item by default: about a kernel item's size, so the anchor pays the same
/// stream starts and region tail as the kernels do (`read:ck1024` reads the probe's 1 MiB).
pub const READ_CHUNK: usize = 256 << 10;

impl std::str::FromStr for BenchRow {
    type Err = String;
    /// `read[:ckKIB][:pfBYTES][:t0|t1|t2|nta]`, or a decode path (`DecodePath`'s syntax).
    fn from_str(s: &str) -> Result<Self, String> {
        let Some(opts) = s.strip_prefix("read") else {
            return s.parse().map(BenchRow::Path);
        };
        if !(opts.is_empty() || opts.starts_with(':')) {
            return Err(format!("unknown row {s:?}"));
        }
        let mut pf: Option<StreamPrefetch> = None;
        let mut chunk = READ_CHUNK;
        for opt in opts.split(':').filter(|o| !o.is_empty()) {
            if let Some(k) = opt.strip_prefix("ck") {
                chunk = k
                    .parse::<usize>()
                    .ok()
                    .filter(|&k| (1..=1 << 20).contains(&k))
                    .ok_or_else(|| format!("{s:?}: {k:?} is not a chunk size in KiB"))?
                    << 10;
                continue;
            }
            let p = pf.get_or_insert(StreamPrefetch {
                distance: 8192,
                hint: PrefetchHint::T1,
            });
            if let Some(b) = opt.strip_prefix("pf") {
                p.distance = b
                    .parse()
                    .map_err(|_| format!("{s:?}: prefetch distance {b:?} is not a byte count"))?;
            } else {
                p.hint = opt.parse().map_err(|e| format!("{s:?}: {e}"))?;
            }
        }
        Ok(BenchRow::Read(ReadAnchor {
            prefetch: pf,
            chunk,
        }))
    }
}

impl std::fmt::Display for BenchRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BenchRow::Path(p) => p.fmt(f),
            BenchRow::Read(r) => {
                f.write_str("read")?;
                if r.chunk != READ_CHUNK {
                    write!(f, ":ck{}", r.chunk >> 10)?;
                }
                if let Some(p) = r.prefetch {
                    write!(f, ":pf{}:{}", p.distance, p.hint)?;
                }
                Ok(())
            }
        }
    }
}

/// Which experts the timed calls read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RoutingMode {
    /// One routing for every call of a token count: each layer's same experts, pass after pass
    /// (what the bench always did; a part of a cycle 4-6x the L3 may still hit in it).
    #[default]
    Fixed,
    /// A routing drawn per call, as the engine's change every token: no reuse across passes.
    Fresh,
}

impl std::str::FromStr for RoutingMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fixed" => Ok(RoutingMode::Fixed),
            "fresh" => Ok(RoutingMode::Fresh),
            _ => Err(format!("unknown routing {s:?} (expected fixed or fresh)")),
        }
    }
}

/// The engine-like conditions of the timed calls (see the module doc); the default is the bench as
/// it was: back to back over every layer, one routing, decode paths only.
#[derive(Clone, Debug, Default)]
pub struct DecodeStepArgs {
    /// Routings, each entry timed in turn (empty: `[fixed]`).
    pub routings: Vec<RoutingMode>,
    /// Idle µs before each call, each entry timed in turn (empty: `[0]`).
    pub gaps_us: Vec<u64>,
    /// Layers cycled through, each entry timed in turn (empty: all `--layers`).
    pub cycles: Vec<usize>,
    /// The rows per token count, in order (empty: the bench args' decode paths).
    pub rows: Vec<BenchRow>,
}

impl DecodeStepArgs {
    /// Every (routing, layers cycled, gap) to time, in that nesting.
    pub(crate) fn conditions(&self, layers: usize) -> Vec<(RoutingMode, usize, u64)> {
        let routings = if self.routings.is_empty() {
            vec![RoutingMode::Fixed]
        } else {
            self.routings.clone()
        };
        let mut v = Vec::new();
        for &r in &routings {
            for &c in &self.cycles(layers) {
                for &g in &self.gaps() {
                    v.push((r, c, g));
                }
            }
        }
        v
    }

    pub(crate) fn gaps(&self) -> Vec<u64> {
        if self.gaps_us.is_empty() {
            vec![0]
        } else {
            self.gaps_us.clone()
        }
    }

    /// The cycle lengths, each within 1..=layers.
    pub(crate) fn cycles(&self, layers: usize) -> Vec<usize> {
        if self.cycles.is_empty() {
            vec![layers]
        } else {
            self.cycles.iter().map(|&c| c.clamp(1, layers)).collect()
        }
    }

    pub(crate) fn rows(&self, paths: &[DecodePath]) -> Vec<BenchRow> {
        if self.rows.is_empty() {
            paths.iter().map(|&p| BenchRow::Path(p)).collect()
        } else {
            self.rows.clone()
        }
    }
}

/// What a row's label adds for conditions other than the defaults: `/fresh`, `/g74` (µs), `/L48`.
pub(crate) fn row_label(
    row: BenchRow,
    (routing, gap_us, cycle): (RoutingMode, u64, usize),
    layers: usize,
) -> String {
    let mut s = row.to_string();
    if routing == RoutingMode::Fresh {
        s += "/fresh";
    }
    if gap_us > 0 {
        s += &format!("/g{gap_us}");
    }
    if cycle != layers {
        s += &format!("/L{cycle}");
    }
    s
}

/// The idle window before a call: `x` (the call's input rows) flushed from every cache level, as
/// rows the GPU wrote into mapped memory are, then the calling thread spins on the clock until
/// `gap` has passed (the pool's workers spin in their own wait meanwhile).
pub(crate) fn idle_gap(gap: Duration, x: &[f32]) {
    if gap.is_zero() {
        return;
    }
    let t = Instant::now();
    flush(x);
    while t.elapsed() < gap {
        std::hint::spin_loop();
    }
}

/// Writes back and evicts the cache lines of `x`.
fn flush(x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let p = x.as_ptr().cast::<u8>();
        let bytes = std::mem::size_of_val(x);
        let mut off = 0;
        while off < bytes {
            // SAFETY: the line lies inside `x` (SSE2 is baseline on x86_64).
            unsafe { std::arch::x86_64::_mm_clflush(p.add(off)) };
            off += 64;
        }
        // SAFETY: a fence only.
        unsafe { std::arch::x86_64::_mm_mfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// The chunks (address, bytes) of `experts`' packed bytes in `set`, `chunk` bytes each at most,
/// expert after expert.
pub fn read_chunks(set: &CpuExpertSet, experts: &[u32], chunk: usize) -> Vec<(usize, usize)> {
    let mut chunks = Vec::new();
    for r in experts.iter().filter_map(|&e| set.packed_expert(e)) {
        for c in r.chunks(chunk.max(64)) {
            chunks.push((c.as_ptr() as usize, c.len()));
        }
    }
    chunks
}

/// One read-anchor call: the pool's first group sums every chunk (one item each). The bench hosts
/// have one NUMA group; with more, the other groups' threads stay idle.
pub fn read_call(pool: &WorkerPool, chunks: &[(usize, usize)], anchor: ReadAnchor) {
    let mut items = vec![0; pool.groups()];
    items[0] = chunks.len();
    pool.run(&items, &|_, c, _| {
        let (p, len) = chunks[c];
        // SAFETY: a live chunk of a packed expert, read only.
        let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
        std::hint::black_box(sum_bytes(bytes, anchor.prefetch));
    });
}

/// The DRAM probe's measure (every thread summing 1 MiB pieces, best of 4 passes) over `regions`
/// instead of a buffer of its own: the packed experts' pages, all of them. GB/s.
pub(crate) fn probe_over(pool: &WorkerPool, regions: &[&[u8]]) -> f64 {
    let chunks: Vec<(usize, usize)> = regions
        .iter()
        .flat_map(|r| r.chunks(1 << 20))
        .map(|c| (c.as_ptr() as usize, c.len()))
        .collect();
    let bytes: usize = chunks.iter().map(|c| c.1).sum();
    let anchor = ReadAnchor {
        prefetch: None,
        chunk: 1 << 20,
    };
    let best = (0..4)
        .map(|_| {
            let t = Instant::now();
            read_call(pool, &chunks, anchor);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min);
    bytes as f64 / best / 1e9
}

/// Sum of `b` as u64 lanes (the tail as bytes): a read of every byte the compiler cannot drop.
fn sum_bytes(b: &[u8], prefetch: Option<StreamPrefetch>) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if super::features::CpuTier::Avx512.clamp_to_cpu() == super::features::CpuTier::Avx512 {
        // SAFETY: AVX-512F present (tier check above).
        return unsafe { sum_bytes_avx512(b, prefetch) };
    }
    let _ = prefetch;
    b.iter().fold(0u64, |a, &v| a.wrapping_add(v as u64))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_bytes_avx512(b: &[u8], prefetch: Option<StreamPrefetch>) -> u64 {
    use std::arch::x86_64::*;
    let p = b.as_ptr();
    let end = p as usize + b.len();
    let mut acc = [_mm512_setzero_si512(); 4];
    let blocks = b.len() / 256;
    for i in 0..blocks {
        let at = p.wrapping_add(i * 256);
        if let Some(pf) = prefetch.filter(|pf| pf.distance > 0) {
            for line in 0..4 {
                let q = at.wrapping_add(pf.distance + line * 64);
                if (q as usize) < end {
                    // (a prefetch never faults)
                    match pf.hint {
                        PrefetchHint::T0 => _mm_prefetch::<_MM_HINT_T0>(q.cast()),
                        PrefetchHint::T1 => _mm_prefetch::<_MM_HINT_T1>(q.cast()),
                        PrefetchHint::T2 => _mm_prefetch::<_MM_HINT_T2>(q.cast()),
                        PrefetchHint::Nta => _mm_prefetch::<_MM_HINT_NTA>(q.cast()),
                    }
                }
            }
        }
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: i*256 + j*64 + 64 <= len.
            *a = _mm512_add_epi64(*a, unsafe { _mm512_loadu_si512(at.add(j * 64).cast()) });
        }
    }
    let v = _mm512_add_epi64(
        _mm512_add_epi64(acc[0], acc[1]),
        _mm512_add_epi64(acc[2], acc[3]),
    );
    let tail = b[blocks * 256..]
        .iter()
        .fold(0u64, |a, &v| a.wrapping_add(v as u64));
    (_mm512_reduce_add_epi64(v) as u64).wrapping_add(tail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_parse_and_name() {
        for s in [
            "read",
            "read:pf8192:t1",
            "read:pf4096:t0",
            "read:ck1024",
            "read:ck64:pf8192:t1",
            "chained",
            "split",
        ] {
            let r: BenchRow = s.parse().unwrap();
            assert_eq!(r.to_string(), s);
        }
        let r: BenchRow = "read:t0".parse().unwrap();
        assert_eq!(r.to_string(), "read:pf8192:t0");
        assert!("read:pfx".parse::<BenchRow>().is_err());
        assert!("read:t9".parse::<BenchRow>().is_err());
        assert!("reed".parse::<BenchRow>().is_err());
        assert!("readx".parse::<BenchRow>().is_err());
        assert!("read:ck0".parse::<BenchRow>().is_err());
    }

    #[test]
    fn labels_name_only_what_differs_from_the_defaults() {
        let r = BenchRow::Path(DecodePath::CHAINED);
        let fixed = RoutingMode::Fixed;
        assert_eq!(row_label(r, (fixed, 0, 16), 16), "chained");
        assert_eq!(row_label(r, (fixed, 74, 48), 48), "chained/g74");
        assert_eq!(
            row_label(r, (RoutingMode::Fresh, 74, 16), 48),
            "chained/fresh/g74/L16"
        );
    }

    #[test]
    fn byte_sum_reads_every_byte_with_and_without_prefetch() {
        let b: Vec<u8> = (0..(3 * 256 + 77)).map(|i| (i * 7 % 251) as u8).collect();
        let want = b.iter().map(|&v| v as u64).sum::<u64>();
        // u64 lanes and bytes sum differently; both must be a function of every byte: compare
        // against the same lane split computed plainly.
        let lanes = |b: &[u8]| {
            let n = b.len() / 256 * 256;
            let l: u64 = b[..n]
                .chunks(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .fold(0u64, |a, v| a.wrapping_add(v));
            l.wrapping_add(b[n..].iter().map(|&v| v as u64).sum::<u64>())
        };
        let avx = super::super::features::CpuTier::Avx512.clamp_to_cpu()
            == super::super::features::CpuTier::Avx512;
        let expect = if avx { lanes(&b) } else { want };
        for pf in [
            None,
            Some(StreamPrefetch {
                distance: 512,
                hint: PrefetchHint::T1,
            }),
        ] {
            assert_eq!(sum_bytes(&b, pf), expect);
        }
    }

    /// A set's chunks cover exactly the chosen experts' packed bytes, each byte once, in order.
    #[test]
    fn read_chunks_cover_the_chosen_experts_once() {
        use super::super::moe::{ExpertSetConfig, ExpertSource, SourceTensor, WeightFormat};
        let (h, i) = (64, 32);
        let w = vec![0u16; h * i];
        let src: Vec<ExpertSource<'_>> = (0..4)
            .map(|_| ExpertSource {
                gate: SourceTensor::Bf16(&w),
                up: SourceTensor::Bf16(&w),
                down: SourceTensor::Bf16(&w),
            })
            .collect();
        let pool = WorkerPool::new(&[vec![0, 0]], false, Duration::from_micros(50));
        let cfg = ExpertSetConfig::new(h, i, WeightFormat::Bf16);
        let set = CpuExpertSet::new(&cfg, &[0, 1, 2, 3], &src, &pool).unwrap();
        let per = set.bytes_per_expert();
        for chunk in [64, 1000, 1 << 20] {
            let c = read_chunks(&set, &[3, 1], chunk);
            assert_eq!(c.iter().map(|c| c.1).sum::<usize>(), 2 * per);
            assert!(c.iter().all(|c| c.1 <= chunk.max(64)));
            let e3 = set.packed_expert(3).unwrap().as_ptr() as usize;
            assert_eq!(c[0].0, e3);
            // consecutive within an expert
            assert!(c.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0
                || w[1].0 == set.packed_expert(1).unwrap().as_ptr() as usize));
        }
        read_call(
            &pool,
            &read_chunks(&set, &[0, 2], 4096),
            ReadAnchor {
                prefetch: None,
                chunk: 4096,
            },
        );
        let gbs = probe_over(&pool, &[set.packed_expert(0).unwrap()]);
        assert!(gbs.is_finite() && gbs > 0.0);
    }

    #[test]
    fn gaps_and_cycles_default_to_the_old_bench() {
        let d = DecodeStepArgs::default();
        assert_eq!(d.gaps(), vec![0]);
        assert_eq!(d.cycles(16), vec![16]);
        let c = DecodeStepArgs {
            cycles: vec![0, 8, 99],
            ..Default::default()
        };
        assert_eq!(c.cycles(16), vec![1, 8, 16]);
        assert_eq!(d.conditions(4), vec![(RoutingMode::Fixed, 4, 0)]);
        let e = DecodeStepArgs {
            routings: vec![RoutingMode::Fresh, RoutingMode::Fixed],
            gaps_us: vec![0, 74],
            ..Default::default()
        };
        assert_eq!(e.conditions(4).len(), 4);
        assert_eq!(e.conditions(4)[1], (RoutingMode::Fresh, 4, 74));
        assert_eq!("fresh".parse(), Ok(RoutingMode::Fresh));
        assert!("random".parse::<RoutingMode>().is_err());
        assert_eq!(
            d.rows(&[DecodePath::SPLIT]),
            vec![BenchRow::Path(DecodePath::SPLIT)]
        );
    }
}
