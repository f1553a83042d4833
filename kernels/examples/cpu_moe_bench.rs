//! The benchmark behind `moe-daemon bench cpu-moe`, without building the daemon: a release build of
//! this example compiles only the kernels crate, so kernel work on a small machine can be timed in
//! minutes. Flags (all optional): `--experts --hidden --inter --layers --iters --probe-mib N`,
//! `--topk 8` or a list (`--topk 2,4,8`: the whole bench once per entry, in one process: experts per
//! token, as a mixed layer's count of DRAM experts),
//! `--dtype bf16,fp8,…`, `--tokens 1,4,…`, `--threads 1,2,…`, `--tier scalar|avx2|avx512|amx`,
//! `--paths split,fused,chained,streams:pf8192:t1,read,read:pf8192:t1,…` (rows timed one after the
//! other per token count: decode paths, default `MOE_CPU_DECODE`, else chained; `read…` the read
//! anchor: the same experts' bytes streamed by the pool with the DRAM probe's loop), and the engine's
//! decode-step conditions (`moe_kernels::cpu::bench_step`), each list timed in turn in one process:
//! `--gaps 0,74` (µs idle before each call, the caller and the workers spinning, the input rows
//! flushed from the caches), `--cycles 16,48` (layers cycled through, at most `--layers`) and
//! `--routings fixed,fresh` (one routing for every call, or one drawn per call as the engine's
//! change every token: no L3 reuse from pass to pass). First it
//! prints what a pool region costs with no work, and how long after `run` the workers start (the
//! region start-up of every decode call).
//!
//!     cargo run --release -p moe-kernels --example cpu_moe_bench -- --dtype bf16,int8,fp8 --tokens 1,4

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use moe_kernels::cpu::bench::{run_cpu_moe_bench_with, CpuMoeBenchArgs};
use moe_kernels::cpu::bench_step::{BenchRow, DecodeStepArgs};
use moe_kernels::cpu::{CpuMoeOptions, WorkerPool};

/// Median of `v` (sorted in place).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Microseconds of a region with one empty item per thread (median of 2000), then, over 500 regions
/// of one 20 µs item per thread, the medians of when the first, the middle and the last item started
/// (an item starts late when its thread joined late: the caller takes it after its own).
fn pool_startup(pool: &WorkerPool) -> String {
    let items: Vec<usize> = (0..pool.groups())
        .map(|g| pool.threads_in_group(g))
        .collect();
    let n: usize = items.iter().sum();
    let mut empty: Vec<f64> = (0..2000)
        .map(|_| {
            let t = Instant::now();
            pool.run(&items, &|_, _, _| {});
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    // per group, its items' start times (ns after run())
    let starts: Vec<Vec<AtomicU64>> = items
        .iter()
        .map(|&k| (0..k).map(|_| AtomicU64::new(0)).collect())
        .collect();
    let (mut first, mut mid, mut last) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..500 {
        let t0 = Instant::now();
        pool.run(&items, &|g, i, _| {
            starts[g][i].store(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            let spin = Instant::now();
            while spin.elapsed() < Duration::from_micros(20) {
                std::hint::spin_loop();
            }
        });
        let mut s: Vec<f64> = starts
            .iter()
            .flatten()
            .map(|a| a.load(Ordering::Relaxed) as f64 / 1e3)
            .collect();
        s.sort_by(f64::total_cmp);
        first.push(s[0]);
        mid.push(s[n / 2]);
        last.push(s[n - 1]);
    }
    format!(
        "# pool of {n} threads: a region of {n} empty items {:.2} µs; items of 20 µs start {:.2} / {:.2} / {:.2} µs after run() (first / middle / last, medians of 500)\n",
        median(&mut empty),
        median(&mut first),
        median(&mut mid),
        median(&mut last)
    )
}

fn list<T: std::str::FromStr>(v: &str) -> Result<Vec<T>, String> {
    v.split(',')
        .map(|s| s.parse().map_err(|_| format!("bad list item {s:?}")))
        .collect()
}

fn parse(args: &[String]) -> Result<(CpuMoeBenchArgs, Vec<usize>, DecodeStepArgs), String> {
    let mut a = CpuMoeBenchArgs::default();
    let mut topks = vec![a.topk];
    let mut step = DecodeStepArgs::default();
    for pair in args.chunks(2) {
        let [flag, v] = pair else {
            return Err(format!("{} needs a value", pair[0]));
        };
        let num = || v.parse::<usize>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--experts" => a.experts = num()?,
            "--topk" => topks = list(v)?,
            "--hidden" => a.hidden = num()?,
            "--inter" => a.inter = num()?,
            "--layers" => a.layers = num()?,
            "--iters" => a.iters = num()?,
            "--probe-mib" => a.probe_mib = num()?,
            "--dtype" => a.dtypes = list(v)?,
            "--tokens" => a.tokens = list(v)?,
            "--threads" => a.threads = list(v)?,
            "--tier" => a.tier = Some(v.parse().map_err(|e| format!("--tier: {e}"))?),
            "--paths" => step.rows = list::<BenchRow>(v)?,
            "--gaps" => step.gaps_us = list(v)?,
            "--cycles" => step.cycles = list(v)?,
            "--routings" => step.routings = list(v)?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if topks.is_empty() || topks.contains(&0) {
        return Err("--topk: experts per token must be at least 1".into());
    }
    Ok((a, topks, step))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (args, topks, step) = match parse(&args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("cpu_moe_bench: {e}");
            std::process::exit(2)
        }
    };
    let opts = CpuMoeOptions {
        threads: args.threads.iter().max().copied(),
        ..Default::default()
    };
    // the pool is dropped before the bench builds its own
    match opts.build_pool() {
        Ok(pool) => print!("{}", pool_startup(&pool)),
        Err(e) => eprintln!("cpu_moe_bench: no pool for the start-up probe: {e}"),
    }
    let mut print = |s: &str| {
        print!("{s}");
        let _ = std::io::Write::flush(&mut std::io::stdout());
    };
    for topk in topks {
        let args = CpuMoeBenchArgs {
            topk,
            ..args.clone()
        };
        if let Err(e) = run_cpu_moe_bench_with(&args, &step, &mut print) {
            eprintln!("{e}");
            std::process::exit(1)
        }
    }
}
