//! In-proxy cost of kvroute (placeholder; owned by the overhead benchmark).
/// Arguments of `kvroute-bench overhead`.
#[derive(Debug, Clone, clap::Args)]
pub struct OverheadArgs {}
/// Runs the overhead benchmark.
pub fn run(_args: &OverheadArgs) -> anyhow::Result<()> { anyhow::bail!("not yet implemented") }
