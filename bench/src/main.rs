//! `kvroute-bench`: command line entry point; all logic lives in the library.
use clap::{Parser, Subcommand};
use kvroute_bench::commands;

/// Routing-quality and in-proxy-cost benchmarks for kvroute.
#[derive(Debug, Parser)]
#[command(name = "kvroute-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Short side-by-side demo: Envoy round robin vs kvroute on a multi-turn chat (4 pods).
    Demo(commands::DemoArgs),
    /// Full comparison: every workload x every router, fresh pods for each run.
    Matrix(Box<commands::MatrixArgs>),
    /// Gateway replicas (issue 11): one kvroute vs N replicas behind a round-robin front
    /// Envoy, with and without peer sync, on pressure and chat; with their cost.
    Replicas(Box<commands::ReplicasArgs>),
    /// Install what the bench needs beyond `./build.sh build` (sglang-router in .venv).
    Setup(commands::SetupArgs),
    /// In-proxy cost: Envoy with kvroute vs the same Envoy without the filter.
    Overhead(kvroute_bench::overhead::OverheadArgs),
    /// Fleet scale (issue 14): Envoy CPU of scraping and snapshot freshness at 64-1024 idle endpoints.
    ScrapeScale(kvroute_bench::scrape_scale::ScrapeScaleArgs),
    /// Several models (issue 15): two base models, LoRA adapters, interactive chat beside a
    /// batch stream, with the batch objective sheddable and then not.
    Mixed(kvroute_bench::mixed::MixedArgs),
}

/// Runs `fut`, turning Ctrl-C into an error so that every process guard is dropped.
fn block_on<F: std::future::Future<Output = anyhow::Result<()>>>(fut: F) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        tokio::select! {
            r = fut => r,
            _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted"),
        }
    })
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Demo(a) => block_on(commands::demo(&a)),
        Command::Matrix(a) => block_on(commands::matrix(&a)),
        Command::Replicas(a) => block_on(commands::replicas(&a)),
        Command::Setup(a) => commands::setup(&a),
        Command::Overhead(args) => kvroute_bench::overhead::run(&args),
        Command::ScrapeScale(args) => kvroute_bench::scrape_scale::run(&args),
        Command::Mixed(a) => block_on(kvroute_bench::mixed::mixed(&a)),
    }
}
