//! Subcommand implementations called from `main.rs`.
pub mod serve;
