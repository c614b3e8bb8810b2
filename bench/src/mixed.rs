//! The mixed workload (issue 15): several models behind one kvroute, adapters, and a
//! batch stream beside interactive chat.
//!
//! Two `kvroute-sim` processes serve two base models (`model-a` with LoRA adapters,
//! `model-b`); kvroute routes them by `models` (docs/CONFIG.md). Interactive users run
//! multi-turn chats, each session on one of the base models or adapters; an open-loop
//! batch stream sends long unique documents to `model-a` with the objective header
//! `x-gateway-inference-objective: batch`. The run is made twice on fresh pods: `batch`
//! at priority -1 (sheddable: shed with 429 while every `model-a` pod is saturated) and
//! at priority 0 (never shed). Reported: per model, the pods' prefix-cache hit rate and
//! the interactive TTFT; the batch requests answered and shed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;
use tokio::sync::Mutex;

use crate::pod_metrics::read_counters;
use crate::procs::{start_sim, SimSettings, Tools};
use crate::router_under_test::{start, Instance, RouterKind};
use crate::runner::complete_as;

/// The models interactive sessions use, in rotation (adapters are of `model-a`).
const INTERACTIVE: [&str; 5] = ["model-a", "model-b", "sql-lora", "fin-lora", "chat-lora"];
const OBJECTIVE: &str = "x-gateway-inference-objective";

/// `kvroute-bench mixed` parameters.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct MixedArgs {
    /// Repository root.
    #[arg(long, default_value_os_t = crate::commands::default_root())]
    pub root: std::path::PathBuf,
    /// Pods per base model.
    #[arg(long, default_value_t = 2)]
    pub pods: usize,
    /// Running-batch limit per pod (a small GPU: a queue forms under load).
    #[arg(long, default_value_t = 8)]
    pub max_num_seqs: usize,
    /// Wall seconds per simulated second.
    #[arg(long, default_value_t = 0.2)]
    pub time_scale: f64,
    /// Interactive users (closed loop).
    #[arg(long, default_value_t = 10)]
    pub users: usize,
    /// Batch requests started per wall second (open loop).
    #[arg(long, default_value_t = 40.0)]
    pub batch_rate: f64,
    /// Output tokens of a batch request.
    #[arg(long, default_value_t = 256)]
    pub batch_max_tokens: u32,
    /// Wall seconds of traffic per run.
    #[arg(long, default_value_t = 30)]
    pub seconds: u64,
}

/// One request's outcome.
#[derive(Debug, Clone)]
struct Outcome {
    model: &'static str,
    batch: bool,
    status: Status,
    ttft_ms: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Ok,
    Shed,
    Failed,
}

/// The summary of one run.
#[derive(Debug, Clone, Serialize)]
pub struct MixedResult {
    /// `batch` priority in this run.
    pub batch_priority: i32,
    /// Per model (interactive requests): (model, requests, TTFT p50, p90 in simulated ms).
    pub interactive: Vec<(String, usize, f64, f64)>,
    /// Interactive requests on `model-a` and its adapters (the pool the batch
    /// stream loads): count, TTFT p50, p90, failed.
    pub interactive_a: (usize, f64, f64, usize),
    /// Prefix-cache hit rate of each base model's pods (tokens hit / queried).
    pub hit_rate: Vec<(String, f64)>,
    /// Batch requests answered, shed (429), failed otherwise.
    pub batch: (usize, usize, usize),
}

fn percentile(mut v: Vec<f64>, q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn system_prompt(model: &str, group: usize) -> String {
    let mut s = format!("You are the {model} assistant of team {group}. ");
    while s.len() < 3000 {
        s.push_str(&format!(
            "Team {group} rules for {model}: answer briefly and cite sources. "
        ));
    }
    s
}

async fn one(
    client: &reqwest::Client,
    url: &str,
    model: &'static str,
    batch: bool,
    prompt: &str,
    max_tokens: u32,
    time_scale: f64,
) -> (Outcome, String) {
    let headers: &[(&str, &str)] = if batch { &[(OBJECTIVE, "batch")] } else { &[] };
    let r = tokio::time::timeout(
        Duration::from_secs(120),
        complete_as(client, url, model, headers, prompt, max_tokens),
    )
    .await;
    let sim_ms = |d: Duration| d.as_secs_f64() * 1000.0 / time_scale;
    match r {
        Ok(Ok(a)) => (
            Outcome {
                model,
                batch,
                status: Status::Ok,
                ttft_ms: a.ttft.map(sim_ms),
            },
            a.text,
        ),
        Ok(Err(e)) => {
            let shed = format!("{e:#}").starts_with("HTTP 429");
            let status = if shed { Status::Shed } else { Status::Failed };
            (
                Outcome {
                    model,
                    batch,
                    status,
                    ttft_ms: None,
                },
                String::new(),
            )
        }
        Err(_) => (
            Outcome {
                model,
                batch,
                status: Status::Failed,
                ttft_ms: None,
            },
            String::new(),
        ),
    }
}

/// One run on fresh pods with `batch` at `priority`.
async fn run_once(a: &MixedArgs, tools: &Tools, priority: i32) -> Result<MixedResult> {
    let sim = |model: &str, lora: bool| {
        let mut extra = vec!["--model".to_string(), model.to_string()];
        if lora {
            extra.extend(
                [
                    "--lora-adapters",
                    "sql-lora,fin-lora,chat-lora",
                    "--max-loras",
                    "2",
                ]
                .map(String::from),
            );
        }
        SimSettings {
            pods: a.pods,
            kv_blocks: 26_000,
            block_size: 16,
            max_num_seqs: a.max_num_seqs,
            time_scale: a.time_scale,
            seed: 7,
            extra_args: extra,
        }
    };
    let sim_a = start_sim(&tools.sim, &sim("model-a", true), &tools.logs)?;
    let sim_b = start_sim(&tools.sim, &sim("model-b", false), &tools.logs)?;
    let eps =
        |pods: &[std::net::SocketAddr]| pods.iter().map(|p| p.to_string()).collect::<Vec<_>>();
    let mut all = sim_a.pods.clone();
    all.extend(&sim_b.pods);
    let config = serde_json::json!({
        "models": [
            {"name": "model-a", "endpoints": eps(&sim_a.pods), "adapters": ["sql-lora", "fin-lora", "chat-lora"]},
            {"name": "model-b", "endpoints": eps(&sim_b.pods)},
        ],
        "objectives": {"priorities": {"batch": priority, "interactive": 10}},
    });
    let router = start(
        RouterKind::Kvroute,
        &all,
        tools,
        2,
        Some(&config),
        &Instance::default(),
    )
    .await?;
    let url = router.url.clone();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()?;
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let end = Instant::now() + Duration::from_secs(a.seconds);
    let mut tasks = Vec::new();
    for u in 0..a.users {
        let (client, url, outcomes) = (client.clone(), url.clone(), Arc::clone(&outcomes));
        let time_scale = a.time_scale;
        tasks.push(tokio::spawn(async move {
            let model = INTERACTIVE[u % INTERACTIVE.len()];
            let mut session = 0;
            while Instant::now() < end {
                // Each session: a team's system prompt (shared by 2 users), 4 turns.
                let mut history = system_prompt(model, u / INTERACTIVE.len() % 2 + session % 3);
                for turn in 0..4 {
                    history.push_str(&format!(
                        "\nUser {u} session {session} question {turn}: what next?\n"
                    ));
                    let (o, text) =
                        one(&client, &url, model, false, &history, 24, time_scale).await;
                    let ok = o.status == Status::Ok;
                    outcomes.lock().await.push(o);
                    if !ok || Instant::now() >= end {
                        break;
                    }
                    history.push_str(&text);
                }
                session += 1;
            }
        }));
    }
    {
        let (client, url, outcomes) = (client.clone(), url.clone(), Arc::clone(&outcomes));
        let (rate, time_scale, max_tokens) = (a.batch_rate, a.time_scale, a.batch_max_tokens);
        tasks.push(tokio::spawn(async move {
            let mut inflight = Vec::new();
            let mut i = 0u64;
            let t0 = Instant::now();
            while Instant::now() < end {
                let doc = format!("Document {i}: ") + &"quarterly figures and notes ".repeat(200);
                let (client, url, outcomes) = (client.clone(), url.clone(), Arc::clone(&outcomes));
                inflight.push(tokio::spawn(async move {
                    let (o, _) =
                        one(&client, &url, "model-a", true, &doc, max_tokens, time_scale).await;
                    outcomes.lock().await.push(o);
                }));
                i += 1;
                let next = t0 + Duration::from_secs_f64(i as f64 / rate.max(0.01));
                tokio::time::sleep_until(next.into()).await;
            }
            for t in inflight {
                let _ = t.await;
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let out = outcomes.lock().await.clone();
    let interactive: Vec<&Outcome> = out.iter().filter(|o| !o.batch).collect();
    let ttfts = |f: &dyn Fn(&Outcome) -> bool| -> Vec<f64> {
        interactive
            .iter()
            .filter(|o| f(o))
            .filter_map(|o| o.ttft_ms)
            .collect()
    };
    let mut per_model = Vec::new();
    for m in INTERACTIVE {
        let v = ttfts(&|o| o.model == m);
        per_model.push((
            m.to_string(),
            v.len(),
            percentile(v.clone(), 0.5),
            percentile(v, 0.9),
        ));
    }
    let on_a = |o: &Outcome| o.model != "model-b";
    let a_v = ttfts(&on_a);
    let failed = interactive
        .iter()
        .filter(|o| on_a(o) && o.status != Status::Ok)
        .count();
    let batch = out.iter().filter(|o| o.batch);
    let count = |s| batch.clone().filter(|o| o.status == s).count();
    let mut hit_rate = Vec::new();
    for (name, pods) in [
        ("model-a (+ adapters)", &sim_a.pods),
        ("model-b", &sim_b.pods),
    ] {
        let c = read_counters(&client, pods).await?;
        let (hit, q) = c.iter().fold((0u64, 0u64), |(h, q), p| {
            (h + p.hit_tokens, q + p.query_tokens)
        });
        hit_rate.push((name.to_string(), hit as f64 / q.max(1) as f64));
    }
    drop(router);
    Ok(MixedResult {
        batch_priority: priority,
        interactive: per_model,
        interactive_a: (
            a_v.len(),
            percentile(a_v.clone(), 0.5),
            percentile(a_v, 0.9),
            failed,
        ),
        hit_rate,
        batch: (
            count(Status::Ok),
            count(Status::Shed),
            count(Status::Failed),
        ),
    })
}

/// Runs the mixed workload with `batch` sheddable, then not, and prints the tables.
pub async fn mixed(a: &MixedArgs) -> Result<()> {
    let tools = Tools::new(&a.root)?;
    let mut results = Vec::new();
    for priority in [-1, 0] {
        eprintln!("mixed: batch priority {priority} ...");
        results.push(run_once(a, &tools, priority).await?);
    }
    println!("| batch priority | interactive requests on model-a + adapters | their TTFT p50 / p90 (ms) | failed | batch answered / shed / failed | pods' hit rate model-a (+ adapters, + batch) / model-b |");
    println!("|---|--:|--:|--:|--:|--:|");
    for r in &results {
        let (n, p50, p90, failed) = r.interactive_a;
        println!(
            "| {} | {n} | {p50:.0} / {p90:.0} | {failed} | {} / {} / {} | {:.1} % / {:.1} % |",
            r.batch_priority,
            r.batch.0,
            r.batch.1,
            r.batch.2,
            r.hit_rate[0].1 * 100.0,
            r.hit_rate[1].1 * 100.0
        );
    }
    println!();
    println!("| model | batch priority | requests | TTFT p50 / p90 (ms) |");
    println!("|---|--:|--:|--:|");
    for m in 0..INTERACTIVE.len() {
        for r in &results {
            let (name, n, p50, p90) = &r.interactive[m];
            println!(
                "| {name} | {} | {n} | {p50:.0} / {p90:.0} |",
                r.batch_priority
            );
        }
    }
    let path = tools.logs.join("mixed.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&results)?)?;
    eprintln!("mixed: results in {}", path.display());
    Ok(())
}
