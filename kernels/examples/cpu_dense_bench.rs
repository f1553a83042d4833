//! Dense GEMV/GEMM benchmark of the CPU kernels (attention projections, lm_head) on random GGML
//! blocks, without building the daemon. Flags (all optional): `--shapes name=RxC[+RxC…],…`,
//! `--ggml q8_0|q4_0|q4_1|q4_k|q6_k|f16`, `--input int8,bf16`, `--tokens 1,4,…`, `--threads N`,
//! `--iters N`, `--probe-mib N`, `--tier scalar|avx2|avx512|amx`.
//!
//!     cargo run --release -p moe-kernels --example cpu_dense_bench -- --threads 2 --tokens 1

use moe_kernels::cpu::bench_dense::{run_cpu_dense_bench, CpuDenseBenchArgs};
use moe_kernels::cpu::{GgmlBlock, GroupedInput};

fn list<T>(v: &str, f: impl Fn(&str) -> Result<T, String>) -> Result<Vec<T>, String> {
    v.split(',').map(f).collect()
}

fn parse(args: &[String]) -> Result<CpuDenseBenchArgs, String> {
    let mut a = CpuDenseBenchArgs::default();
    for pair in args.chunks(2) {
        let [flag, v] = pair else {
            return Err(format!("{} needs a value", pair[0]));
        };
        let num = |s: &str| s.parse::<usize>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--shapes" => a.shapes = list(v, |s| s.parse())?,
            "--ggml" => {
                a.kind = match v.as_str() {
                    "q8_0" => GgmlBlock::Q8_0,
                    "q4_0" => GgmlBlock::Q4_0,
                    "q4_1" => GgmlBlock::Q4_1,
                    "q4_k" => GgmlBlock::Q4K,
                    "q5_k" => GgmlBlock::Q5K,
                    "q6_k" => GgmlBlock::Q6K,
                    "f16" => GgmlBlock::F16,
                    _ => return Err(format!("--ggml: unknown type {v:?}")),
                }
            }
            "--input" => {
                a.inputs = list(v, |s| {
                    s.parse::<GroupedInput>()
                        .map_err(|e| format!("--input: {e}"))
                })?
            }
            "--tokens" => a.tokens = list(v, num)?,
            "--threads" => a.threads = num(v)?,
            "--iters" => a.iters = num(v)?,
            "--probe-mib" => a.probe_mib = num(v)?,
            "--tier" => a.tier = Some(v.parse().map_err(|e| format!("--tier: {e}"))?),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match parse(&args).map(|a| run_cpu_dense_bench(&a)) {
        Ok(Ok(report)) => print!("{report}"),
        Ok(Err(e)) => {
            eprintln!("{e}");
            std::process::exit(1)
        }
        Err(e) => {
            eprintln!("cpu_dense_bench: {e}");
            std::process::exit(2)
        }
    }
}
