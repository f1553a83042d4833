//! `moe-daemon bench cpu-moe`: ms per MoE layer of the CPU expert path on random weights, the weight
//! bandwidth it reaches, and that as a share of the DRAM read bandwidth measured in the same process
//! (the anchor's probe: every thread sums its share of a 4 GiB buffer with 512-bit loads); the share
//! from the median call too, which a machine shared with other work disturbs less than the mean.
//!
//! `run_cpu_moe_bench(&args)` returns the report; the daemon's CLI parses the flags and prints it.

use std::time::Instant;

use thiserror::Error;

use super::bench_step::{
    idle_gap, probe_over, read_call, read_chunks, row_label, BenchRow, DecodeStepArgs, RoutingMode,
};
use super::features::CpuTier;
use super::memory::{HugeBuffer, HugepageMode};
use super::moe::{
    f32_to_bf16, CpuExpertSet, DecodePath, ExpertSetConfig, ExpertSource, SourceTensor,
    WeightFormat,
};
use super::options::{CpuMoeOptions, NumaMode};
use super::pool::WorkerPool;

#[derive(Debug, Error)]
pub enum BenchError {
    #[error("bench cpu-moe: {0}")]
    Args(&'static str),
    #[error(transparent)]
    Options(#[from] super::options::OptionsError),
    #[error(transparent)]
    Moe(#[from] super::moe::MoeError),
    #[error(transparent)]
    Dense(#[from] super::dense::DenseError),
}

/// Flags of `bench cpu-moe` (lists are comma separated).
#[derive(Clone, Debug)]
pub struct CpuMoeBenchArgs {
    pub experts: usize,
    pub topk: usize,
    pub hidden: usize,
    pub inter: usize,
    pub dtypes: Vec<WeightFormat>,
    pub tokens: Vec<usize>,
    pub threads: Vec<usize>,
    pub layers: usize,
    pub iters: usize,
    pub tier: Option<CpuTier>,
    pub amx_min_tokens: usize,
    pub hugepages: HugepageMode,
    pub numa: NumaMode,
    pub probe_mib: usize,
    /// Decode paths to time, each token count once per entry (repeats allowed: `split,fused,split,
    /// fused` alternates them); calls above `FUSED_MAX_TOKENS` tokens take the split path either way.
    pub paths: Vec<DecodePath>,
}

impl Default for CpuMoeBenchArgs {
    fn default() -> Self {
        CpuMoeBenchArgs {
            experts: 128,
            topk: 8,
            hidden: 2048,
            inter: 768,
            dtypes: vec![WeightFormat::Bf16],
            tokens: vec![1, 4, 16, 64, 256, 1024],
            threads: vec![std::thread::available_parallelism().map_or(1, |n| n.get())],
            layers: 8,
            iters: 30,
            tier: None,
            amx_min_tokens: 16,
            hugepages: HugepageMode::Auto,
            numa: NumaMode::Auto,
            probe_mib: 4096,
            paths: vec![DecodePath::from_env()],
        }
    }
}

/// Deterministic fast generator for weights (xorshift64).
struct Gen(u64);
impl Gen {
    #[inline]
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// One layer's random source tensors, generated in parallel: bf16 ~ U(-0.02, 0.02), or FP8 bytes with
/// block scales 1/448·0.02.
struct LayerSource {
    bf16: Vec<u16>,
    fp8: Vec<u8>,
    scales: Vec<f32>,
}

fn make_source(pool: &WorkerPool, a: &CpuMoeBenchArgs, fp8: bool, seed: u64) -> LayerSource {
    let per = 3 * a.hidden * a.inter;
    let n = a.experts * per;
    let mut src = LayerSource {
        bf16: Vec::new(),
        fp8: Vec::new(),
        scales: Vec::new(),
    };
    let chunk = 1 << 20;
    if fp8 {
        src.fp8 = vec![0u8; n];
        let p = src.fp8.as_mut_ptr() as usize;
        pool.run(&[n.div_ceil(chunk)], &|_, c, _| {
            let mut g = Gen(seed ^ (c as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let len = chunk.min(n - c * chunk);
            // SAFETY: chunk c is written by this item only.
            let d = unsafe { std::slice::from_raw_parts_mut((p as *mut u8).add(c * chunk), len) };
            for b in d {
                let v = g.next() as u8;
                *b = if v & 0x7F == 0x7F { 0x3E } else { v };
            }
        });
        let blocks = |r: usize, c: usize| r.div_ceil(128) * c.div_ceil(128);
        let per_expert = 2 * blocks(a.inter, a.hidden) + blocks(a.hidden, a.inter);
        src.scales = vec![0.02 / 448.0; a.experts * per_expert];
    } else {
        src.bf16 = vec![0u16; n];
        let p = src.bf16.as_mut_ptr() as usize;
        pool.run(&[n.div_ceil(chunk)], &|_, c, _| {
            let mut g = Gen(seed ^ (c as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let len = chunk.min(n - c * chunk);
            // SAFETY: chunk c is written by this item only.
            let d = unsafe { std::slice::from_raw_parts_mut((p as *mut u16).add(c * chunk), len) };
            for v in d {
                let u = (g.next() >> 40) as f32 / (1u64 << 24) as f32;
                *v = f32_to_bf16((u - 0.5) * 0.04);
            }
        });
    }
    src
}

fn sources<'a>(a: &CpuMoeBenchArgs, s: &'a LayerSource) -> Vec<ExpertSource<'a>> {
    let (h, i) = (a.hidden, a.inter);
    let per = 3 * h * i;
    let blocks = |r: usize, c: usize| r.div_ceil(128) * c.div_ceil(128);
    let (bg, bd) = (blocks(i, h), blocks(h, i));
    (0..a.experts)
        .map(|e| {
            let t = |off: usize, len: usize, soff: usize, slen: usize| {
                if s.fp8.is_empty() {
                    SourceTensor::Bf16(&s.bf16[e * per + off..e * per + off + len])
                } else {
                    let sb = e * (2 * bg + bd) + soff;
                    SourceTensor::Fp8E4M3 {
                        data: &s.fp8[e * per + off..e * per + off + len],
                        scale_inv: &s.scales[sb..sb + slen],
                    }
                }
            };
            ExpertSource {
                gate: t(0, h * i, 0, bg),
                up: t(h * i, h * i, bg, bg),
                down: t(2 * h * i, h * i, 2 * bg, bd),
            }
        })
        .collect()
}

/// DRAM read bandwidth in GB/s of `pool`'s threads over a fresh buffer of `mib` MiB (hugepages where
/// the system has them): what a bandwidth-bound kernel on this pool reads at most.
pub fn measure_dram_read_bw(pool: &WorkerPool, mib: usize) -> f64 {
    let mut probe = HugeBuffer::new(mib.max(1) << 20, HugepageMode::Auto, None);
    probe.iter_mut().step_by(4096).for_each(|b| *b = 1);
    dram_read_bw(pool, &probe)
}

/// DRAM read bandwidth in GB/s with every thread of `pool` summing its share of `buf` (best of 4).
pub(crate) fn dram_read_bw(pool: &WorkerPool, buf: &HugeBuffer) -> f64 {
    let chunk = 1 << 20;
    let n = buf.len() / chunk;
    let base = buf.as_ptr() as usize;
    let mut best = f64::MAX;
    for _ in 0..4 {
        let t = Instant::now();
        pool.run(&[n], &|_, c, _| {
            // SAFETY: in-bounds 1 MiB chunk of a live buffer, read only.
            let s =
                unsafe { std::slice::from_raw_parts((base + c * chunk) as *const u64, chunk / 8) };
            std::hint::black_box(sum_chunk(s));
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    (n * chunk) as f64 / best / 1e9
}

fn sum_chunk(s: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if CpuTier::Avx512.clamp_to_cpu() == CpuTier::Avx512 {
        // SAFETY: AVX-512F present (tier check above).
        return unsafe { sum_chunk_avx512(s) };
    }
    s.iter().fold(0u64, |a, &v| a.wrapping_add(v))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_chunk_avx512(s: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_si512(); 4];
    let p = s.as_ptr();
    for i in 0..s.len() / 32 {
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: i*32 + j*8 + 8 <= len.
            *a = _mm512_add_epi64(*a, unsafe {
                _mm512_loadu_si512(p.add(i * 32 + j * 8).cast())
            });
        }
    }
    let v = _mm512_add_epi64(
        _mm512_add_epi64(acc[0], acc[1]),
        _mm512_add_epi64(acc[2], acc[3]),
    );
    _mm512_reduce_add_epi64(v) as u64
}

/// Runs the benchmark and returns the report (a table per dtype, one line per threads × tokens).
pub fn run_cpu_moe_bench(a: &CpuMoeBenchArgs) -> Result<String, BenchError> {
    let mut report = String::new();
    run_cpu_moe_bench_with(a, &DecodeStepArgs::default(), &mut |s| report.push_str(s))?;
    Ok(report)
}

/// [`run_cpu_moe_bench`] with the engine-like conditions and read anchors of `step` (one line per
/// threads × tokens × routing × layers cycled × gap × row, labelled as [`row_label`] says), the
/// report handed to `emit` piece by piece as it is measured (a run cut short keeps its rows).
pub fn run_cpu_moe_bench_with(
    a: &CpuMoeBenchArgs,
    step: &DecodeStepArgs,
    emit: &mut dyn FnMut(&str),
) -> Result<(), BenchError> {
    use std::fmt::Write;
    if a.topk > a.experts {
        return Err(BenchError::Args("--topk exceeds --experts"));
    }
    if a.layers == 0 || a.iters == 0 || a.topk == 0 {
        return Err(BenchError::Args(
            "--layers, --iters and --topk must be at least 1",
        ));
    }
    let mut out = String::new();
    // what is in `out` goes to `emit`
    let mut flush = |out: &mut String| {
        emit(out);
        out.clear();
    };
    let max_threads = *a.threads.iter().max().unwrap_or(&1);
    let opts = |threads| CpuMoeOptions {
        threads: Some(threads),
        numa: a.numa,
        hugepages: a.hugepages,
        ..Default::default()
    };
    let _ = writeln!(
        out,
        "# bench cpu-moe: experts={} topk={} hidden={} inter={} layers={} iters={} tier={} (detected {})",
        a.experts,
        a.topk,
        a.hidden,
        a.inter,
        a.layers,
        a.iters,
        a.tier.unwrap_or(CpuTier::Amx).clamp_to_cpu(),
        super::features::detected_tier()
    );
    let allowed = super::topology::allowed_cpus();
    let nodes: Vec<String> = super::topology::numa_nodes(&allowed)
        .iter()
        .map(|n| format!("{}:[{}]", n.id, super::topology::format_cpulist(&n.cpus)))
        .collect();
    let _ = writeln!(
        out,
        "# CPU topology: {}; allowed CPUs {}; NUMA nodes {}",
        super::topology::topology_source(),
        super::topology::format_cpulist(&allowed),
        nodes.join(" ")
    );
    // DRAM read bandwidth per thread count, measured here.
    let mut bw = Vec::new();
    // kept for a second probe after each dtype: how far the DRAM bandwidth drifts over the run
    let mut probe = HugeBuffer::new(a.probe_mib.max(1) << 20, a.hugepages, None);
    probe.iter_mut().step_by(4096).for_each(|b| *b = 1);
    for &t in &a.threads {
        let pool = opts(t).build_pool()?;
        let g = dram_read_bw(&pool, &probe);
        let _ = writeln!(
            out,
            "# DRAM read bandwidth, {t} threads: {g:.1} GB/s ({} of {} workers pinned, {} NUMA groups)",
            pool.pinned_threads(),
            pool.threads() - 1,
            pool.groups()
        );
        bw.push(g);
    }
    for &fmt in &a.dtypes {
        let build_pool = opts(max_threads).build_pool()?;
        let mut cfg = ExpertSetConfig::new(a.hidden, a.inter, fmt)
            .with_hugepages(a.hugepages)
            .with_max_tier(a.tier);
        cfg.amx_min_tokens = a.amx_min_tokens;
        let ids: Vec<u32> = (0..a.experts as u32).collect();
        let t0 = Instant::now();
        let mut sets = Vec::new();
        let mut src = None;
        for l in 0..a.layers {
            // One random source serves two layers: packed copies are distinct memory either way.
            if l % 2 == 0 {
                src = Some(make_source(
                    &build_pool,
                    a,
                    fmt == WeightFormat::Fp8Block,
                    1 + l as u64,
                ));
            }
            let s = src.as_ref().expect("generated above");
            sets.push(CpuExpertSet::new(&cfg, &ids, &sources(a, s), &build_pool)?);
        }
        drop(src);
        drop(build_pool);
        let per_expert = sets[0].bytes_per_expert();
        // what the kernel backs the packed layers with (smaps), beside what was asked for
        let backing = crate::cpu::memory::backing_of(sets.iter().flat_map(|s| s.buffers()))
            .map_or_else(|e| format!("unknown ({e})"), |b| b.to_string());
        let _ = writeln!(
            out,
            "\n## dtype {fmt:?}: {:.2} GB packed per layer ({} per expert), memory {:?} ({backing}), tier {}, load {:.1}s",
            sets[0].bytes() as f64 / 1e9,
            per_expert,
            sets[0].page_kinds(),
            sets[0].tier(),
            t0.elapsed().as_secs_f64()
        );
        for (ti, &threads) in a.threads.iter().enumerate() {
            let pool = opts(threads).build_pool()?;
            let regions: Vec<&[u8]> = sets.iter().flat_map(|s| s.packed_regions()).collect();
            let _ = writeln!(
                out,
                "# DRAM read bandwidth over the packed experts ({:.1} GB), {threads} threads: {:.1} GB/s",
                regions.iter().map(|r| r.len()).sum::<usize>() as f64 / 1e9,
                probe_over(&pool, &regions)
            );
            let _ = writeln!(out, "| threads | tokens | ms/layer (mean) | ms/layer (median) | experts read | GB/s weights | % DRAM read BW | % (median) | × read limit | GFLOP/s | ms p90 / max | last join / tail µs (missed) | decode path |");
            let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
            for &q in &a.tokens {
                let wts: Vec<f32> = (0..q * a.topk)
                    .map(|i| 0.1 + (i % 7) as f32 * 0.1)
                    .collect();
                let x: Vec<f32> = (0..q * a.hidden)
                    .map(|i| ((i * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                let mut y = vec![0f32; q * a.hidden];
                for (mode, cycle, gap) in step.conditions(a.layers) {
                    // fixed: one routing for every call, as the bench always had; fresh: one per call
                    let calls = match mode {
                        RoutingMode::Fixed => 1,
                        RoutingMode::Fresh => cycle.max(3) + a.iters,
                    };
                    let routings: Vec<Routing> = (0..calls)
                        .map(|i| Routing::draw(a, q, (0xC0FFEE ^ q as u64) + 7919 * i as u64))
                        .collect();
                    for row in step.rows(&a.paths) {
                        let times = time_row(
                            a,
                            &mut sets,
                            &pool,
                            row,
                            (cycle, gap),
                            &routings,
                            (&x, &wts),
                            &mut y,
                        )?;
                        let label = row_label(row, (mode, gap, cycle), a.layers);
                        let flops = match row {
                            BenchRow::Path(_) => (6 * q * a.topk * a.hidden * a.inter) as f64,
                            BenchRow::Read(_) => 0.0,
                        };
                        let bytes = times.experts * per_expert as f64;
                        out += &table_row((threads, q), &times, (bytes, flops), bw[ti], &label);
                        flush(&mut out);
                    }
                }
            }
            let g = dram_read_bw(&pool, &probe);
            let _ = writeln!(
                out,
                "# DRAM read bandwidth after {fmt:?}, {threads} threads: {g:.1} GB/s (the shares above are of the first probe, {:.1})",
                bw[ti]
            );
        }
    }
    flush(&mut out);
    Ok(())
}

/// One line of the table: `bytes` and `flops` of a call, `probe` the DRAM probe's GB/s.
fn table_row(
    (threads, q): (usize, usize),
    t: &CallTimes,
    (bytes, flops): (f64, f64),
    probe: f64,
    label: &str,
) -> String {
    let gbs = bytes / t.mean / 1e9;
    format!(
        "| {threads} | {q} | {:.3} | {:.3} | {:.1} | {gbs:.1} | {:.0}% | {:.0}% | {:.2} | {:.0} | {:.3} / {:.3} | {:.1} / {:.1} ({}) | {label} |\n",
        t.mean * 1e3,
        t.median * 1e3,
        t.experts,
        100.0 * gbs / probe,
        100.0 * bytes / t.median / 1e9 / probe,
        t.mean / (bytes / (probe * 1e9)),
        flops / t.mean / 1e9,
        t.p90 * 1e3,
        t.max * 1e3,
        t.last_join_us,
        t.tail_us,
        t.missed,
    )
}

/// One call's routing: expert ids per (token, slot) and the distinct experts they read.
struct Routing {
    ids: Vec<u32>,
    distinct: Vec<u32>,
}

impl Routing {
    /// `q` tokens of `a.topk` distinct experts each, drawn from `seed` (nonzero).
    fn draw(a: &CpuMoeBenchArgs, q: usize, seed: u64) -> Routing {
        let mut g = Gen(seed.max(1));
        let mut ids = Vec::with_capacity(q * a.topk);
        for _ in 0..q {
            let mut chosen: Vec<u32> = Vec::with_capacity(a.topk);
            while chosen.len() < a.topk {
                let e = (g.next() % a.experts as u64) as u32;
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            ids.extend(chosen);
        }
        let mut distinct = ids.clone();
        distinct.sort_unstable();
        distinct.dedup();
        Routing { ids, distinct }
    }
}

/// Seconds of one layer call (mean, median, 90th percentile, slowest), and the pool's regions over
/// the timed calls (µs, means over regions): how long after a region opened its last worker joined,
/// how long the caller waited for the others once its own items were done (the region's tail: a
/// worker descheduled inside the region shows here), and how many workers missed a region.
struct CallTimes {
    /// Distinct experts read per timed call (mean).
    experts: f64,
    mean: f64,
    median: f64,
    p90: f64,
    max: f64,
    last_join_us: f64,
    tail_us: f64,
    missed: u64,
}

/// Times `a.iters` calls of `row` cycling through the first `cycle` layers, each after an idle
/// `gap` (µs), after warm-up calls that touch every one of those layers; call `i` takes routing
/// `i % routings.len()` (warm-up calls included).
#[allow(clippy::too_many_arguments)]
fn time_row(
    a: &CpuMoeBenchArgs,
    sets: &mut [CpuExpertSet],
    pool: &WorkerPool,
    row: BenchRow,
    (cycle, gap_us): (usize, u64),
    routings: &[Routing],
    (x, wts): (&[f32], &[f32]),
    y: &mut [f32],
) -> Result<CallTimes, BenchError> {
    let gap = std::time::Duration::from_micros(gap_us);
    let sets = &mut sets[..cycle];
    if let BenchRow::Path(path) = row {
        sets.iter_mut().for_each(|s| s.set_decode_path(path));
    }
    // Call `i`: its layer and routing, and for the read anchor its chunks (listed before the clock).
    let mut call = |i: usize, clock: &mut Option<Instant>| -> Result<(), BenchError> {
        let (l, r) = (i % cycle, &routings[i % routings.len()]);
        match row {
            BenchRow::Path(_) => {
                *clock = Some(Instant::now());
                sets[l].forward(pool, x, &r.ids, wts, a.topk, y)?
            }
            BenchRow::Read(anchor) => {
                let chunks = read_chunks(&sets[l], &r.distinct, anchor.chunk);
                *clock = Some(Instant::now());
                read_call(pool, &chunks, anchor)
            }
        }
        Ok(())
    };
    // Warm-up: every layer once (at least 3 calls), so no timed call is a layer's first since
    // packing (on the H200 host the first row of each dtype was 2-5x off otherwise).
    let warm = cycle.max(3);
    for i in 0..warm {
        idle_gap(gap, x);
        call(i, &mut None)?;
    }
    let mut times = Vec::with_capacity(a.iters);
    let mut experts = 0;
    let before = pool.region_stats();
    for i in warm..warm + a.iters {
        idle_gap(gap, x);
        let mut clock = None;
        call(i, &mut clock)?;
        times.push(clock.map_or(0.0, |t| t.elapsed().as_secs_f64()));
        experts += routings[i % routings.len()].distinct.len();
    }
    let regions = pool.region_stats().since(&before);
    let mean = times.iter().sum::<f64>() / a.iters.max(1) as f64;
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    Ok(CallTimes {
        experts: experts as f64 / a.iters.max(1) as f64,
        mean,
        median: times[times.len() / 2],
        p90: at(0.9),
        max: at(1.0),
        last_join_us: regions.max_join_lag_s / regions.regions.max(1) as f64 * 1e6,
        tail_us: regions.close_wait_s / regions.regions.max(1) as f64 * 1e6,
        missed: regions.missed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_more_active_experts_than_experts() {
        let a = CpuMoeBenchArgs {
            experts: 4,
            topk: 8,
            ..Default::default()
        };
        assert!(matches!(run_cpu_moe_bench(&a), Err(BenchError::Args(_))));
    }

    #[test]
    fn rejects_zero_layers_iterations_or_top_k() {
        for (layers, iters, topk) in [(0, 2, 2), (2, 0, 2), (2, 2, 0)] {
            let a = CpuMoeBenchArgs {
                experts: 4,
                topk,
                layers,
                iters,
                ..Default::default()
            };
            assert!(matches!(run_cpu_moe_bench(&a), Err(BenchError::Args(_))));
        }
    }

    /// The engine-like conditions and read anchors: one line per (routing, cycle, gap, row), each
    /// labelled with what differs from the defaults, and the read rows reading what the calls read.
    #[test]
    fn step_conditions_and_read_anchors_get_their_own_lines() {
        use super::super::bench_step::{BenchRow, DecodeStepArgs, RoutingMode};
        let a = CpuMoeBenchArgs {
            experts: 6,
            topk: 2,
            hidden: 64,
            inter: 32,
            tokens: vec![1, 3],
            threads: vec![2],
            layers: 3,
            iters: 3,
            probe_mib: 1,
            ..Default::default()
        };
        let step = DecodeStepArgs {
            routings: vec![RoutingMode::Fixed, RoutingMode::Fresh],
            gaps_us: vec![0, 5],
            cycles: vec![2, 3],
            rows: vec!["read".parse().unwrap(), BenchRow::Path(DecodePath::CHAINED)],
        };
        let mut r = String::new();
        run_cpu_moe_bench_with(&a, &step, &mut |s| r.push_str(s)).unwrap();
        let rows: Vec<&str> = r.lines().filter(|l| l.starts_with("| 2 |")).collect();
        assert_eq!(rows.len(), 2 * 2 * 2 * 2 * 2, "{r}");
        for label in [
            "| read/L2 |",
            "| chained/fresh/g5 |",
            "| read/fresh/g5/L2 |",
        ] {
            assert_eq!(
                rows.iter().filter(|l| l.ends_with(label)).count(),
                2,
                "{label}: {r}"
            );
        }
        // one token of top-2: every row reads 2 experts; read rows report no FLOPs
        assert!(rows
            .iter()
            .filter(|l| l.starts_with("| 2 | 1 |"))
            .all(|l| l.contains("| 2.0 |")));
        assert!(r.contains("over the packed experts"), "{r}");
    }

    #[test]
    fn tiny_bench_runs_and_reports_every_line() {
        let a = CpuMoeBenchArgs {
            experts: 8,
            topk: 2,
            hidden: 64,
            inter: 32,
            dtypes: vec![
                WeightFormat::Bf16,
                WeightFormat::Fp8Block,
                WeightFormat::Int8,
                WeightFormat::Int4 { group: 32 },
            ],
            tokens: vec![1, 5],
            threads: vec![1],
            layers: 2,
            iters: 2,
            probe_mib: 1,
            paths: vec![DecodePath::SPLIT, DecodePath::FUSED],
            ..Default::default()
        };
        let r = run_cpu_moe_bench(&a).unwrap();
        assert_eq!(
            r.lines().filter(|l| l.starts_with("| 1 |")).count(),
            16,
            "{r}"
        );
        for path in ["split", "fused"] {
            let rows = r.lines().filter(|l| l.ends_with(&format!("| {path} |")));
            assert_eq!(rows.count(), 8, "{r}");
        }
        assert!(r.contains("DRAM read bandwidth"));
        assert!(r.contains("# CPU topology: hwloc 2."), "{r}");
    }
}
