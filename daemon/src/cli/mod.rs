//! Command-line subcommands of `moe-daemon`.
pub mod generate;
