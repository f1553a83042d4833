//! `moe-daemon`: the node daemon's command line.
use clap::{Parser, Subcommand};
use moe_daemon::cli;

#[derive(Parser)]
#[command(
    name = "moe-daemon",
    version,
    about = "CPU-GPU hybrid MoE inference daemon"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate from one prompt offline (no server).
    Generate(cli::generate::GenerateArgs),
    /// Serve the OpenAI-compatible API (chat, completions, metrics).
    Serve(Box<cli::serve::ServeArgs>),
    /// Benchmarks and benchmark inputs.
    #[command(subcommand)]
    Bench(cli::bench::BenchCommand),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let command = Cli::parse().command;
    if let Err(e) = moe_daemon::engine::gpu::switches::check_env_knobs() {
        eprintln!("error: {e}");
        return std::process::ExitCode::FAILURE;
    }
    let result = match command {
        Command::Generate(a) => cli::generate::run(a),
        Command::Serve(a) => cli::serve::run(*a),
        Command::Bench(c) => cli::bench::run(c),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}` prints the whole context chain on one line, without a backtrace.
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
