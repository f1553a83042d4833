//! Standalone `bench cpu-moe` (the daemon's subcommand calls the same function):
//! `cpu_moe_bench --experts 128 --topk 8 --hidden 2048 --inter 768 --dtype bf16 --tokens 1,64 --threads 16`
fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    match moe_kernels::cpu::bench::parse_bench_args(&argv)
        .and_then(|a| moe_kernels::cpu::bench::run_cpu_moe_bench(&a))
    {
        Ok(report) => print!("{report}"),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    }
}
