//! One experiment: fresh pods, one router, one trace, everything measured.
//!
//! Every router gets its own freshly started simulator (cold caches, same seed), so
//! the runs of a comparison differ only by the router.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::admin_stats::{flushed_histogram, merged_histogram, quantile, total};
use crate::engine::{EngineArgs, Pods};
use crate::gateway::{start_gateway, Arm};
use crate::gateway_cost::{kvroute_counters, CostProbe, GatewayCost};
use crate::measure::{cdf, imbalance, LatencyRecorder, Percentiles};
use crate::pod_metrics::{read_counters, PodCounters, QueuePoller};
use crate::procs::{SimSettings, Tools};
use crate::runner::{run, Exchange, RunSettings};
use crate::theory::{theoretical_max, RequestBlocks};
use crate::trace::Trace;

/// Everything measured for one router on one workload.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    /// Workload name.
    pub workload: String,
    /// Router name (with replicas and sync when behind a front Envoy: `Arm::name`).
    pub router: String,
    /// Router replicas (1: a lone router).
    pub replicas: usize,
    /// kvroute's peer sync between the replicas.
    pub peer_sync: bool,
    /// Requests went through a front Envoy round-robining over the replicas.
    pub front: bool,
    /// Why the router was not measured (e.g. sglang-router unavailable).
    pub skipped: Option<String>,
    /// Number of pods.
    pub pods: usize,
    /// Requests attempted.
    pub requests: usize,
    /// Failed requests.
    pub errors: usize,
    /// The first error message.
    pub first_error: Option<String>,
    /// Prefix-cache hit rate from the pods' counters (hit tokens / query tokens).
    pub hit_rate: f64,
    /// Theoretical maximum hit rate of the executed trace (unlimited cache).
    pub theoretical_max: f64,
    /// `hit_rate / theoretical_max`.
    pub fraction_of_max: f64,
    /// Time to first token, simulated ms.
    pub ttft_ms: Percentiles,
    /// End-to-end latency, simulated ms.
    pub e2e_ms: Percentiles,
    /// Requests per simulated second.
    pub req_per_s: f64,
    /// Output tokens per simulated second.
    pub output_tokens_per_s: f64,
    /// The TTFT objective, simulated ms (`--ttft-slo-ms`).
    pub ttft_slo_ms: f64,
    /// Share of the trace's requests whose first token came within the objective
    /// (failed and never-sent requests miss it).
    pub slo_met: f64,
    /// Goodput: requests that met the TTFT objective per simulated second.
    pub goodput_req_per_s: f64,
    /// TTFT p50 (simulated ms) of each quarter of the answered requests in start
    /// order: flat when the fleet keeps up, rising when a queue builds.
    pub ttft_p50_by_quarter: [f64; 4],
    /// Wall-clock duration of the load phase, seconds.
    pub wall_s: f64,
    /// Requests served per pod.
    pub per_pod_requests: Vec<u64>,
    /// max / mean of `per_pod_requests` (of the pods' prompt tokens for engines that do
    /// not count requests).
    pub imbalance: f64,
    /// Peak `num_requests_waiting` per pod (polled every 100 ms wall).
    pub peak_queue: Vec<u64>,
    /// Raw per-pod counters.
    pub pod_counters: Vec<PodCounters>,
    /// kvroute's counters (`kvroute.decision.*`, `kvroute.peer.*`, ...), summed over
    /// the replicas, for kvroute variants: their increase over the load phase (peer
    /// sync also runs while the gateway starts).
    pub router_stats: BTreeMap<String, u64>,
    /// CPU per request of the gateway's Envoys; peer sync traffic and lag.
    pub cost: Option<GatewayCost>,
    /// For kvroute variants whose TTFT model predicted: how far off it was.
    pub ttft_model: Option<ModelError>,
    /// TTFT CDF (ms, fraction), downsampled, for the plot.
    pub ttft_cdf: Vec<(f64, f64)>,
}

impl RunResult {
    /// A placeholder for a router that could not run.
    pub fn skipped(workload: &str, arm: &Arm, pods: usize, why: String) -> Self {
        RunResult {
            workload: workload.into(),
            router: arm.name(),
            replicas: arm.topology.replicas,
            peer_sync: arm.topology.sync,
            front: arm.topology.front,
            skipped: Some(why),
            pods,
            requests: 0,
            errors: 0,
            first_error: None,
            hit_rate: 0.0,
            theoretical_max: 0.0,
            fraction_of_max: 0.0,
            ttft_ms: Percentiles::default(),
            e2e_ms: Percentiles::default(),
            req_per_s: 0.0,
            output_tokens_per_s: 0.0,
            ttft_slo_ms: 0.0,
            slo_met: 0.0,
            goodput_req_per_s: 0.0,
            ttft_p50_by_quarter: [0.0; 4],
            wall_s: 0.0,
            per_pod_requests: Vec::new(),
            imbalance: 0.0,
            peak_queue: Vec::new(),
            pod_counters: Vec::new(),
            router_stats: BTreeMap::new(),
            cost: None,
            ttft_model: None,
            ttft_cdf: Vec::new(),
        }
    }
}

/// The TTFT model's error over a run: each stream's observed time to first
/// token as a percentage of its prediction (`kvroute.ttft_vs_predicted_percent`,
/// the replicas' histograms merged; 100 is exact). The model's times are wall
/// times: on a time-scaled sim its priors (`scheduling.ttft`) are off by the scale
/// until it has learnt the pods' rates, so its first predictions read low
/// (bench/README.md, "How far off the TTFT model is").
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ModelError {
    /// Predicted streams in the histograms.
    pub samples: u64,
    /// Quantiles of observed / predicted, %.
    pub p10: f64,
    pub p50: f64,
    pub p90: f64,
}

impl ModelError {
    /// Reads the replicas' histograms once Envoy's stats flush (every 5 s) has
    /// caught up with the run's `streams` (`kvroute.ttft_ms` holds them all), or
    /// after 6 s; `None` without samples.
    async fn read(admins: &[&str], streams: u64) -> Option<ModelError> {
        let filter = "kvroute\\.ttft_";
        flushed_histogram(admins, filter, TTFT, streams, Duration::from_secs(6)).await;
        let buckets = merged_histogram(admins, filter, TTFT_VS_PREDICTED).await;
        Some(ModelError {
            samples: total(&buckets),
            p10: quantile(&buckets, 0.10)?,
            p50: quantile(&buckets, 0.50)?,
            p90: quantile(&buckets, 0.90)?,
        })
    }
}

/// kvroute's histograms of each stream's time to first token and of the TTFT
/// model's error (`docs/CONFIG.md`, "Stats").
const TTFT: &str = "kvroute.ttft_ms";
const TTFT_VS_PREDICTED: &str = "kvroute.ttft_vs_predicted_percent";

/// Settings shared by every experiment of a comparison.
#[derive(Debug, Clone)]
pub struct Experiment {
    /// The fleet: the sim's settings (`pods` and `time_scale` hold for every engine).
    pub sim: SimSettings,
    /// Which engine the pods run, or existing endpoints.
    pub engine: EngineArgs,
    /// How the trace is replayed.
    pub run: RunSettings,
    /// Envoy worker threads.
    pub envoy_workers: usize,
    /// Merged into every kvroute variant's configuration (`--kvroute-config`).
    pub kvroute_config: Option<serde_json::Value>,
    /// Where each row's request log goes (`--decisions-log`).
    pub decisions_log: Option<PathBuf>,
}

/// Runs `trace` through `arm` (a router, alone or replicated) against freshly
/// started pods.
pub async fn run_one(
    arm: &Arm,
    trace: &Trace,
    e: &Experiment,
    tools: &Tools,
    label: &str,
) -> Result<RunResult> {
    let router = arm.router;
    let pods = Pods::start(&e.engine, &e.sim, tools).await?;
    // Pods shared with earlier rows: this row's prompts get a prefix of their own.
    let salted;
    let trace = if e.engine.shared_pods() {
        salted = trace.salted(&format!("{label} {} {}", arm.name(), fastrand::u64(..)));
        &salted
    } else {
        trace
    };
    let gw = start_gateway(
        arm,
        &pods.addrs,
        tools,
        e.envoy_workers,
        e.kvroute_config.as_ref(),
    )
    .await?;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .no_proxy()
        .build()?;
    let counters_before = read_counters(&client, &pods.addrs).await?;
    let poller = QueuePoller::start(
        client.clone(),
        pods.addrs.clone(),
        Duration::from_millis(100),
    );
    let pb = ProgressBar::new(trace.requests() as u64);
    pb.set_style(
        ProgressStyle::with_template(
            "{prefix:>32} [{elapsed_precise}] {bar:30.cyan/blue} {pos}/{len} req ({eta})",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    pb.set_prefix(format!("{label} {}", arm.name()));
    let kvroute = router.kvroute_config().is_some();
    let stats_before = if kvroute {
        kvroute_counters(&gw.replica_admins()).await
    } else {
        BTreeMap::new()
    };
    let probe = CostProbe::start(&gw).await;
    let t0 = Instant::now();
    let exchanges = run(&gw.url, trace, &e.run, &pb).await?;
    let wall = t0.elapsed();
    pb.finish();
    if let Some(dir) = &e.decisions_log {
        write_decisions(
            dir,
            &format!("{label}-{}", arm.name()),
            &exchanges,
            e.run.time_scale,
        )?;
    }
    let completed = exchanges.iter().filter(|x| x.error.is_none()).count();
    let peak_queue = poller.finish().await;
    let cost = probe.finish(&gw, completed).await;
    // The sim updates counters at admission; give the last responses a moment to settle.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let counters: Vec<PodCounters> = read_counters(&client, &pods.addrs)
        .await?
        .iter()
        .zip(&counters_before)
        .map(|(after, before)| after.since(before))
        .collect();
    let mut router_stats = if kvroute {
        kvroute_counters(&gw.replica_admins()).await
    } else {
        BTreeMap::new()
    };
    for (k, v) in router_stats.iter_mut() {
        *v = v.saturating_sub(stats_before.get(k).copied().unwrap_or(0));
    }
    let ttft_model = if kvroute {
        ModelError::read(&gw.replica_admins(), completed as u64).await
    } else {
        None
    };
    drop(gw);
    drop(pods);

    let blocks: Vec<RequestBlocks> = exchanges.iter().map(|x| x.blocks.clone()).collect();
    let theory = theoretical_max(&blocks, e.sim.block_size);
    let hits: u64 = counters.iter().map(|c| c.hit_tokens).sum();
    let queries: u64 = counters.iter().map(|c| c.query_tokens).sum();
    let hit_rate = if queries == 0 {
        0.0
    } else {
        hits as f64 / queries as f64
    };
    let mut ttft = LatencyRecorder::new();
    let mut e2e = LatencyRecorder::new();
    let mut ttft_samples = Vec::new();
    let mut out_tokens = 0u64;
    for x in exchanges.iter().filter(|x| x.error.is_none()) {
        if let Some(t) = x.ttft_ms {
            ttft.record_ms(t);
            ttft_samples.push(t);
        }
        e2e.record_ms(x.e2e_ms);
        out_tokens += x.output_tokens;
    }
    let errors = exchanges.iter().filter(|x| x.error.is_some()).count();
    let slo = e.run.ttft_slo_ms;
    let met = exchanges
        .iter()
        .filter(|x| x.error.is_none() && x.ttft_ms.is_some_and(|t| t <= slo))
        .count();
    let mut quarters = [0.0; 4];
    let n = ttft_samples.len();
    for (q, out) in quarters.iter_mut().enumerate() {
        let mut rec = LatencyRecorder::new();
        for &t in &ttft_samples[q * n / 4..(q + 1) * n / 4] {
            rec.record_ms(t);
        }
        *out = rec.percentiles().p50;
    }
    let sim_s = wall.as_secs_f64() / e.sim.time_scale;
    let per_pod: Vec<u64> = counters.iter().map(|c| c.requests).collect();
    // Engines that do not count requests (llama.cpp): balance of prompt tokens.
    let balance: Vec<u64> = if per_pod.iter().all(|&r| r == 0) {
        counters.iter().map(|c| c.query_tokens).collect()
    } else {
        per_pod.clone()
    };
    let theoretical = theory.rate();
    Ok(RunResult {
        workload: trace.name.clone(),
        router: arm.name(),
        replicas: arm.topology.replicas,
        peer_sync: arm.topology.sync,
        front: arm.topology.front,
        skipped: None,
        pods: e.sim.pods,
        requests: trace.requests(),
        errors: errors + trace.requests().saturating_sub(exchanges.len()),
        first_error: exchanges.iter().find_map(|x| x.error.clone()),
        hit_rate,
        theoretical_max: theoretical,
        fraction_of_max: if theoretical > 0.0 {
            hit_rate / theoretical
        } else {
            0.0
        },
        ttft_ms: ttft.percentiles(),
        e2e_ms: e2e.percentiles(),
        req_per_s: (exchanges.len() - errors) as f64 / sim_s,
        output_tokens_per_s: out_tokens as f64 / sim_s,
        ttft_slo_ms: slo,
        slo_met: met as f64 / trace.requests().max(1) as f64,
        goodput_req_per_s: met as f64 / sim_s,
        ttft_p50_by_quarter: quarters,
        wall_s: wall.as_secs_f64(),
        imbalance: imbalance(&balance),
        per_pod_requests: per_pod,
        peak_queue,
        pod_counters: counters,
        router_stats,
        cost: Some(cost),
        ttft_model,
        ttft_cdf: cdf(&ttft_samples, 200),
    })
}

/// Writes one row's decisions log: a header line, then one tab-separated
/// line per request in start order (failed requests have an empty TTFT).
/// Times are simulated ms, as everywhere in the bench's reports, except
/// `ttft_wall_ms`: the same TTFT in wall ms, the unit of the predictions
/// in kvroute's debug header (`decision`), so the two compare directly.
/// `prompt_tokens` and `cached_tokens` are the engine's own count of the
/// prompt and of its part served from the prefix cache (empty when the
/// engine does not report them): where a pod's requests hit, whatever
/// router sent them, even when the pod that answered is not known.
fn write_decisions(dir: &Path, stem: &str, exchanges: &[Exchange], time_scale: f64) -> Result<()> {
    use std::fmt::Write as _;
    std::fs::create_dir_all(dir)?;
    let mut out =
        String::from("session\tstep\tstart_ms\tttft_ms\te2e_ms\tpod\tttft_wall_ms\tprompt_tokens\tcached_tokens\tdecision\n");
    for x in exchanges {
        let ms = |t: Option<f64>| t.map(|t| format!("{t:.1}")).unwrap_or_default();
        let _ = writeln!(
            out,
            "{}\t{}\t{:.1}\t{}\t{:.1}\t{}\t{}\t{}\t{}\t{}",
            x.session,
            x.step,
            x.started.as_secs_f64() * 1000.0 / time_scale,
            ms(x.ttft_ms),
            x.e2e_ms,
            x.pod.map(|p| p.to_string()).unwrap_or_default(),
            ms(x.ttft_ms.map(|t| t * time_scale)),
            x.prompt.map(|p| p.tokens.to_string()).unwrap_or_default(),
            x.prompt.map(|p| p.cached.to_string()).unwrap_or_default(),
            x.decision.as_deref().unwrap_or(""),
        );
    }
    let path = dir.join(format!("{stem}.tsv"));
    std::fs::write(&path, out)?;
    eprintln!("decisions: {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::PromptCount;

    fn exchange(step: usize, ttft_ms: Option<f64>, decision: Option<&str>) -> Exchange {
        Exchange {
            session: 3,
            step,
            started: Duration::from_millis(10),
            ttft_ms,
            e2e_ms: 120.0,
            output_tokens: 4,
            error: ttft_ms.is_none().then(|| "HTTP 503".to_owned()),
            pod: ttft_ms.map(|_| 1),
            decision: decision.map(str::to_owned),
            blocks: RequestBlocks::new("", "", 16),
            prompt: ttft_ms.map(|_| PromptCount {
                tokens: 300,
                cached: 256,
            }),
        }
    }

    #[test]
    fn the_decisions_log_has_one_line_per_request_in_simulated_ms() {
        let dir = std::env::temp_dir().join(format!("kvroute-decisions-{}", std::process::id()));
        let rows = [
            exchange(0, Some(50.0), Some("endpoint=127.0.0.1:1; reason=Cold")),
            exchange(1, None, None),
        ];
        write_decisions(&dir, "chat-kvroute", &rows, 0.25).unwrap();
        let text = std::fs::read_to_string(dir.join("chat-kvroute.tsv")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "session\tstep\tstart_ms\tttft_ms\te2e_ms\tpod\tttft_wall_ms\tprompt_tokens\tcached_tokens\tdecision"
        );
        // 10 wall ms at time scale 0.25 is 40 simulated ms; a simulated
        // TTFT of 50 ms is 12.5 wall ms, the unit of kvroute's predictions.
        assert_eq!(
            lines[1],
            "3\t0\t40.0\t50.0\t120.0\t1\t12.5\t300\t256\tendpoint=127.0.0.1:1; reason=Cold"
        );
        // A failed request: no TTFT, no pod, no count, no decision.
        assert_eq!(lines[2], "3\t1\t40.0\t\t120.0\t\t\t\t\t");
        assert_eq!(lines.len(), 3);
    }
}
