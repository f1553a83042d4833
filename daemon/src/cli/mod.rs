//! Command-line subcommands of `moe-daemon`.
pub mod engine_args;
pub mod generate;
pub mod serve;
