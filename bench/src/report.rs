//! Human and machine output: the comparison table and the JSON results file.

use std::path::Path;

use anyhow::Result;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, Table};
use serde::Serialize;

use crate::experiment::RunResult;

/// The comparison table of one workload's results (`TTFT<=SLO`: share of the
/// requests whose first token came within `--ttft-slo-ms`; `goodput/s`: those
/// requests per simulated second).
pub fn table(results: &[RunResult]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec![
        "router",
        "hit rate",
        "% of max",
        "TTFT p50",
        "p90",
        "p99",
        "E2E p50",
        "p99",
        "req/s",
        "out tok/s",
        "TTFT<=SLO",
        "goodput/s",
        "imbalance",
        "peak queue",
        "errors",
    ]);
    for r in results {
        if let Some(why) = &r.skipped {
            t.add_row(vec![
                Cell::new(&r.router),
                Cell::new(format!("skipped: {why}")),
            ]);
            continue;
        }
        let ms = |v: f64| format!("{v:.0} ms");
        let row = vec![
            r.router.clone(),
            format!("{:.1}%", r.hit_rate * 100.0),
            format!("{:.0}%", r.fraction_of_max * 100.0),
            ms(r.ttft_ms.p50),
            ms(r.ttft_ms.p90),
            ms(r.ttft_ms.p99),
            ms(r.e2e_ms.p50),
            ms(r.e2e_ms.p99),
            format!("{:.2}", r.req_per_s),
            format!("{:.0}", r.output_tokens_per_s),
            format!("{:.1}%", r.slo_met * 100.0),
            format!("{:.2}", r.goodput_req_per_s),
            format!("{:.2}", r.imbalance),
            format!("{}", r.peak_queue.iter().max().copied().unwrap_or(0)),
            format!("{}/{}", r.errors, r.requests),
        ];
        t.add_row(row.into_iter().enumerate().map(|(i, s)| {
            let c = Cell::new(s);
            if i == 0 {
                c
            } else {
                c.set_alignment(CellAlignment::Right)
            }
        }));
    }
    t
}

/// The gateway-cost table of one workload's results: Envoy CPU per request (wall
/// ms, the replicas together and the front Envoy), and with peer sync its traffic
/// per peer, the lag of learned decisions and the sync counters.
pub fn cost_table(results: &[RunResult]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec![
        "router",
        "replicas CPU ms/req",
        "front CPU ms/req",
        "sync B/s per peer",
        "lag p50",
        "lag p99",
        "learned",
        "sync ok / failed",
    ]);
    for r in results {
        let Some(c) = r.cost.as_ref().filter(|_| r.skipped.is_none()) else {
            continue;
        };
        let stat = |k: &str| r.router_stats.get(k).copied().unwrap_or(0);
        let sync = c.sync.as_ref();
        let lag = sync.and_then(|s| s.lag_ms);
        let dash = || "-".to_string();
        let row = vec![
            r.router.clone(),
            format!("{:.2}", c.replicas_cpu_ms_per_request),
            c.front_cpu_ms_per_request
                .map_or_else(dash, |v| format!("{v:.2}")),
            sync.map_or_else(dash, |s| format!("{:.0}", s.bytes_per_s_per_peer)),
            lag.map_or_else(dash, |l| format!("{:.0} ms", l.p50)),
            lag.map_or_else(dash, |l| format!("{:.0} ms", l.p99)),
            sync.map_or_else(dash, |_| stat("peer.learned").to_string()),
            sync.map_or_else(dash, |_| {
                format!("{} / {}", stat("peer.sync_ok"), stat("peer.sync_failed"))
            }),
        ];
        t.add_row(row.into_iter().enumerate().map(|(i, s)| {
            let c = Cell::new(s);
            if i == 0 {
                c
            } else {
                c.set_alignment(CellAlignment::Right)
            }
        }));
    }
    t
}

/// A results file: what ran, on what, and every result.
#[derive(Debug, Serialize)]
pub struct ResultsFile<'a, S: Serialize> {
    /// `demo`, `matrix` or `replicas`.
    pub command: &'a str,
    /// The command line.
    pub argv: Vec<String>,
    /// UTC time the run finished (seconds since the epoch).
    pub finished_unix: u64,
    /// Machine description (cores, memory).
    pub machine: String,
    /// The settings (sim, run, workload parameters).
    pub settings: S,
    /// Every run.
    pub results: &'a [RunResult],
}

/// `cores, memory` of this machine, from the OS.
pub fn machine() -> String {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem_kb = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .next()
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(0);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    format!(
        "{cores} cores ({cpu}), {:.1} GiB RAM, no GPU (simulated pods on loopback)",
        mem_kb as f64 / 1048576.0
    )
}

/// Writes `file` as pretty JSON to `path`.
pub fn write_json<S: Serialize>(path: &Path, file: &ResultsFile<'_, S>) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, serde_json::to_vec_pretty(file)?)?;
    Ok(())
}
