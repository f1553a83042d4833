use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "moe-daemon", version, about = "MoE inference node daemon")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API.
    Serve(moe_daemon::cli::serve::ServeArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Serve(args) => moe_daemon::cli::serve::run(args),
    }
}
