//! The benchmark behind `moe-daemon bench cpu-moe`, without building the daemon: a release build of
//! this example compiles only the kernels crate, so kernel work on a small machine can be timed in
//! minutes. Flags (all optional): `--experts --topk --hidden --inter --layers --iters --probe-mib N`,
//! `--dtype bf16,fp8,…`, `--tokens 1,4,…`, `--threads 1,2,…`, `--tier scalar|avx2|avx512|amx`,
//! `--paths split,fused,…` (decode paths timed one after the other per token count; default
//! `MOE_CPU_DECODE`, else fused).
//!
//!     cargo run --release -p moe-kernels --example cpu_moe_bench -- --dtype bf16,int8,fp8 --tokens 1,4

use moe_kernels::cpu::bench::{run_cpu_moe_bench, CpuMoeBenchArgs};

fn list<T: std::str::FromStr>(v: &str) -> Result<Vec<T>, String> {
    v.split(',')
        .map(|s| s.parse().map_err(|_| format!("bad list item {s:?}")))
        .collect()
}

fn parse(args: &[String]) -> Result<CpuMoeBenchArgs, String> {
    let mut a = CpuMoeBenchArgs::default();
    for pair in args.chunks(2) {
        let [flag, v] = pair else {
            return Err(format!("{} needs a value", pair[0]));
        };
        let num = || v.parse::<usize>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--experts" => a.experts = num()?,
            "--topk" => a.topk = num()?,
            "--hidden" => a.hidden = num()?,
            "--inter" => a.inter = num()?,
            "--layers" => a.layers = num()?,
            "--iters" => a.iters = num()?,
            "--probe-mib" => a.probe_mib = num()?,
            "--dtype" => a.dtypes = list(v)?,
            "--tokens" => a.tokens = list(v)?,
            "--threads" => a.threads = list(v)?,
            "--tier" => a.tier = Some(v.parse().map_err(|e| format!("--tier: {e}"))?),
            "--paths" => a.paths = list(v)?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match parse(&args).map(|a| run_cpu_moe_bench(&a)) {
        Ok(Ok(report)) => print!("{report}"),
        Ok(Err(e)) => {
            eprintln!("{e}");
            std::process::exit(1)
        }
        Err(e) => {
            eprintln!("cpu_moe_bench: {e}");
            std::process::exit(2)
        }
    }
}
