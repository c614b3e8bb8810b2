//! Human and machine output: the comparison table and the JSON results file.

use std::path::Path;

use anyhow::Result;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, Table};
use serde::Serialize;

use crate::experiment::RunResult;

/// The comparison table of one workload's results.
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

/// A results file: what ran, on what, and every result.
#[derive(Debug, Serialize)]
pub struct ResultsFile<'a, S: Serialize> {
    /// `demo` or `matrix`.
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
