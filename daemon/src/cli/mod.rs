//! Command-line subcommands of `moe-daemon`.
pub mod bench;
mod bench_ab;
mod bench_dma;
mod bench_host;
mod bench_os;
pub mod bench_perplexity;
mod bench_replay;
pub mod bench_skew;
pub mod engine_args;
pub mod generate;
pub mod model_path;
pub mod serve;
pub mod synth;
mod synth_glm;
mod synth_glm5;
