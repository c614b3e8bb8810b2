//! `kvroute-bench`: command line entry point; all logic lives in the library.
use clap::{Parser, Subcommand};

/// Routing-quality and in-proxy-cost benchmarks for kvroute.
#[derive(Debug, Parser)]
#[command(name = "kvroute-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// In-proxy cost: Envoy with kvroute vs the same Envoy without the filter.
    Overhead(kvroute_bench::overhead::OverheadArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Overhead(args) => kvroute_bench::overhead::run(&args),
    }
}
