//! `kvroute-bench overhead`: what kvroute costs inside Envoy (issue 5, item 4).
//!
//! The same Envoy listener is run twice side by side on loopback, once
//! without the filter (`--lb round_robin`) and once with kvroute, both in
//! front of the same `kvroute-sim` pods with the latency model off, so the
//! difference is the filter: buffering the body, copying it into the wasm
//! VM, parsing and hashing it, deciding, and the shared-data traffic.
//!
//! Phases (all bounded; every process is killed on exit, also on error):
//!
//! 1. **latency**: sequential requests alternating between the two Envoys,
//!    non-streaming, `max_tokens: 1`, chat bodies of each `--sizes` with a
//!    unique prefix: p50/p90/p99 each and the difference (added latency);
//! 2. **throughput**: a closed loop at `--load-concurrency` for
//!    `--load-secs` per router and size: requests/s and CPU per request of
//!    Envoy, the simulator and this client (from `/proc/<pid>/stat`);
//! 3. **memory**: a fresh Envoy per pass, `--rss-requests` requests with
//!    unique prefixes, Envoy's `VmRSS` sampled along the way; passes:
//!    baseline, kvroute with defaults, kvroute with a small
//!    `prefix.capacity_blocks` (to show the plateau follows the bound);
//! 4. **phase breakdown**: the baseline and kvroute variants that skip
//!    work (hash only one block; do not buffer at all) side by side, so the
//!    differences show where the added latency goes.
//!
//! Output: a table on stdout and JSON in `bench/results/overhead-<date>.json`.

mod load;
pub mod procs;

use anyhow::{bail, Context as _, Result};
use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use hdrhistogram::Histogram;
use load::{Bodies, Stop};
use procs::{Child, EnvoySpec, Tools};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Arguments of `kvroute-bench overhead`.
#[derive(Debug, Clone, clap::Args)]
pub struct OverheadArgs {
    /// Repository root (binaries, `envoy/render.py`, `.venv` and
    /// `bench/results` are found from here).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/.."))]
    pub root: PathBuf,
    /// First port used: pods on P..P+pods-1; Envoys from P+pods+8 (two
    /// ports each: listener, admin).
    #[arg(long, default_value_t = 19400)]
    pub base_port: u16,
    /// Simulated pods behind every Envoy of the run, 1..=1024: the pool
    /// kvroute decides over (and scrapes) on every request. Unique prompts
    /// spread over all of them, so use `--warmup-rounds` of at least twice
    /// the pool for both Envoys to have opened their upstream connections.
    #[arg(long, default_value_t = 2)]
    pub pods: u16,
    /// kvroute's plugin configuration in the latency and throughput phases
    /// (a JSON object; the endpoints are added), e.g.
    /// `'{"metrics":{"max_scrapes_per_s":1}}'` to tell a large pool's
    /// decision from its scraping. The other phases set their own.
    #[arg(long, value_parser = crate::commands::parse_json_object)]
    pub kvroute_config: Option<Value>,
    /// Envoy worker threads (`--concurrency`), the same for both Envoys.
    #[arg(long, default_value_t = 2)]
    pub workers: u16,
    /// Prompt body sizes in bytes for the latency phase.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1024,16384,131072,524288"
    )]
    pub sizes: Vec<usize>,
    /// Measured request pairs per size in the latency phase.
    #[arg(long, default_value_t = 2000)]
    pub latency_rounds: usize,
    /// Discarded warm-up pairs per size.
    #[arg(long, default_value_t = 200)]
    pub warmup_rounds: usize,
    /// Body sizes for the throughput phase.
    #[arg(long, value_delimiter = ',', default_value = "1024,16384")]
    pub load_sizes: Vec<usize>,
    /// Concurrent client connections in the throughput and memory phases.
    #[arg(long, default_value_t = 16)]
    pub load_concurrency: usize,
    /// Seconds per router and size in the throughput phase.
    #[arg(long, default_value_t = 10)]
    pub load_secs: u64,
    /// The throughput phase's seconds are split into this many windows per
    /// router, run in turn (round robin, kvroute, kvroute, ...).
    #[arg(long, default_value_t = 5)]
    pub load_rounds: u32,
    /// Requests with unique prefixes per memory pass (0 skips the phase).
    #[arg(long, default_value_t = 100_000)]
    pub rss_requests: u64,
    /// Body size of the memory phase's requests.
    #[arg(long, default_value_t = 4096)]
    pub rss_body_bytes: usize,
    /// RSS is sampled after every this many requests.
    #[arg(long, default_value_t = 10_000)]
    pub rss_sample_every: u64,
    /// `prefix.capacity_blocks` of the small-bound memory pass (0 skips it).
    #[arg(long, default_value_t = 512)]
    pub rss_small_capacity: usize,
    /// Body sizes of the phase breakdown (empty skips it): latency of
    /// kvroute variants that skip work, to see where the added time goes.
    #[arg(long, value_delimiter = ',', default_value = "16384,524288")]
    pub breakdown_sizes: Vec<usize>,
    /// Measured rounds per size of the phase breakdown.
    #[arg(long, default_value_t = 1000)]
    pub breakdown_rounds: usize,
    /// Phases to run (comma-separated): latency, throughput, memory, breakdown.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "latency,throughput,memory,breakdown"
    )]
    pub phases: Vec<Phase>,
    /// Where the JSON goes (default: `<root>/bench/results`).
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Other builds of `kvroute.wasm` (e.g. an older commit's), each run as
    /// one more Envoy (named after the file stem, prefixed `kvroute-` unless
    /// it starts so; give the builds distinct names) in the latency and throughput
    /// phases: before and after measured side by side in the same run.
    #[arg(long, value_delimiter = ',')]
    pub before_wasm: Vec<PathBuf>,
}

/// A part of the overhead benchmark (see the module comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Phase {
    /// Paired sequential added latency per body size.
    Latency,
    /// Requests/s and CPU per request at fixed concurrency.
    Throughput,
    /// Envoy RSS over many unique prefixes.
    Memory,
    /// Latency of kvroute variants that skip work.
    Breakdown,
}

/// Bytes per indexed block at most (`core/src/prefix/index.rs`: 24-byte node
/// plus a map entry at the lowest load factor).
const INDEX_BYTES_PER_BLOCK: u64 = 63;

/// Runs the overhead benchmark.
pub fn run(args: &OverheadArgs) -> Result<()> {
    validate(args)?;
    let root = args.root.canonicalize().context("--root")?;
    let tools = Tools::in_tree(&root, "overhead")?;
    if args.before_wasm.len() > 4 {
        bail!("--before-wasm: at most 4 builds");
    }
    for w in &args.before_wasm {
        if !w.is_file() {
            bail!("--before-wasm {}: not a file", w.display());
        }
    }
    let ports = Ports {
        base: args.base_port,
        pods: args.pods,
    };
    for port in ports.all() {
        procs::ensure_free(port)?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let started = SystemTime::now();
    let load_before = loadavg();
    let results = rt.block_on(measure(args, &tools, ports))?;
    let report = json!({
        "benchmark": "overhead",
        "date_utc": utc_datetime(started),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "machine": machine(),
        "load_average_before": load_before,
        "load_average_after": loadavg(),
        "client_shares_cores_with_envoy_and_sim": true,
        "config": {
            "workers": args.workers,
            "pods": args.pods,
            "sim": format!("kvroute-sim --pods {} --no-latency", args.pods),
            "request": "POST /v1/chat/completions, one user message, unique 16-hex prefix, max_tokens 1, non-streaming",
            "latency_rounds": args.latency_rounds,
            "warmup_rounds": args.warmup_rounds,
            "load_concurrency": args.load_concurrency,
            "load_secs": args.load_secs,
            "load_rounds": args.load_rounds,
            "rss_requests": args.rss_requests,
            "rss_body_bytes": args.rss_body_bytes,
            "before_wasm": args.before_wasm.iter().map(|w| w.display().to_string()).collect::<Vec<_>>(),
            "kvroute_config": args.kvroute_config,
        },
        "latency": results.latency,
        "throughput": results.throughput,
        "memory": results.memory,
        "phase_breakdown": results.breakdown,
        "kvroute_counters": results.counters,
        "goals": results.goals,
    });
    let out_dir = args
        .out_dir
        .clone()
        .unwrap_or_else(|| root.join("bench/results"));
    std::fs::create_dir_all(&out_dir)?;
    let path = out_dir.join(format!("overhead-{}.json", &utc_datetime(started)[..10]));
    std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")?;
    print_tables(&report);
    println!("results: {}", path.display());
    let _ = std::fs::remove_dir_all(&tools.work);
    Ok(())
}

fn validate(args: &OverheadArgs) -> Result<()> {
    for &s in args.sizes.iter().chain(&args.load_sizes) {
        if !(Bodies::MIN_SIZE..=(4 << 20)).contains(&s) {
            bail!("body size {s} out of range {}..=4 MiB", Bodies::MIN_SIZE);
        }
    }
    if !(Bodies::MIN_SIZE..=(4 << 20)).contains(&args.rss_body_bytes) {
        bail!("--rss-body-bytes out of range");
    }
    if args.load_concurrency == 0 || args.load_concurrency > 1024 {
        bail!("--load-concurrency must be 1..=1024");
    }
    if args.rss_sample_every == 0 || args.base_port > 65_000 || args.workers == 0 {
        bail!("--rss-sample-every and --workers must be > 0, --base-port <= 65000");
    }
    if !(1..=1024).contains(&args.pods) {
        bail!("--pods must be 1..=1024");
    }
    // The last port `Ports` hands out must fit.
    let last = u32::from(args.base_port) + u32::from(args.pods.max(2)) + 8 + 2 * u32::from(ENVOYS);
    if last > u32::from(u16::MAX) {
        bail!(
            "--base-port {} leaves no room for {} pods and the Envoys",
            args.base_port,
            args.pods
        );
    }
    Ok(())
}

/// Envoys a run may start (phases and `--before-wasm` builds together).
const ENVOYS: u16 = 14;

/// The ports of one run, all on 127.0.0.1, derived from `--base-port`:
/// the pods first, then the Envoys (with 2 pods, from `base + 10`).
#[derive(Debug, Clone, Copy)]
struct Ports {
    base: u16,
    pods: u16,
}

impl Ports {
    fn pod(self, i: u16) -> u16 {
        self.base + i
    }
    /// (listener, admin) of Envoy number `i`.
    fn envoy(self, i: u16) -> (u16, u16) {
        let first = self.base + self.pods.max(2) + 8;
        (first + 2 * i, first + 1 + 2 * i)
    }
    fn all(self) -> Vec<u16> {
        let mut v: Vec<u16> = (0..self.pods).map(|i| self.pod(i)).collect();
        for i in 0..ENVOYS {
            let (l, a) = self.envoy(i);
            v.extend([l, a]);
        }
        v
    }
}

/// One router's throughput windows, summed.
#[derive(Default)]
struct Acc {
    ok: u64,
    secs: f64,
    /// CPU seconds of Envoy, the simulator and this client.
    cpu: [f64; 3],
    latency: Option<Histogram<u64>>,
}

struct Results {
    breakdown: Value,
    latency: Value,
    throughput: Value,
    memory: Value,
    counters: Value,
    goals: Value,
}

fn spec(
    name: &str,
    lb: &'static str,
    plugin: Option<Value>,
    ports: (u16, u16),
    workers: u16,
) -> EnvoySpec {
    EnvoySpec {
        name: name.to_owned(),
        lb,
        plugin,
        listen: ports.0,
        admin: ports.1,
        workers,
        eds_file: None,
    }
}

fn url(port: u16) -> String {
    format!("http://127.0.0.1:{port}/v1/chat/completions")
}

async fn measure(args: &OverheadArgs, tools: &Tools, ports: Ports) -> Result<Results> {
    let sim = procs::start_sim(tools, args.pods, ports.pod(0))?;
    let endpoints: Vec<SocketAddr> = (0..args.pods)
        .map(|i| SocketAddr::from(([127, 0, 0, 1], ports.pod(i))))
        .collect();
    let client = load::client()?;
    let nonce = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos() as u64;
    let max_size = args
        .sizes
        .iter()
        .chain(&args.load_sizes)
        .copied()
        .chain([args.rss_body_bytes])
        .max()
        .unwrap_or(1024);
    let bodies = Arc::new(Bodies::new(max_size, nonce));

    // Phases 1 and 2: both Envoys side by side.
    let rr_spec = spec(
        "round_robin",
        "round_robin",
        None,
        ports.envoy(0),
        args.workers,
    );
    let plugin = args.kvroute_config.clone();
    let kv_spec = spec(
        "kvroute",
        "kvroute",
        plugin.clone(),
        ports.envoy(1),
        args.workers,
    );
    let rr = procs::start_envoy(tools, &rr_spec, &endpoints)?;
    let kv = procs::start_envoy(tools, &kv_spec, &endpoints)?;
    let mut urls = vec![url(rr_spec.listen), url(kv_spec.listen)];
    // Older builds, when given: more Envoys in the same alternation.
    let mut others = Vec::new();
    for (i, wasm) in args.before_wasm.iter().enumerate() {
        let stem = wasm
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let name = if stem.starts_with("kvroute") {
            stem
        } else {
            format!("kvroute-{stem}")
        };
        let s = spec(
            &name,
            "kvroute",
            plugin.clone(),
            ports.envoy(9 + i as u16),
            args.workers,
        );
        let before_tools = Tools {
            wasm: wasm.clone(),
            ..tools.clone()
        };
        urls.push(url(s.listen));
        others.push((name, procs::start_envoy(&before_tools, &s, &endpoints)?));
    }
    let mut latency = Vec::new();
    let sizes = if args.phases.contains(&Phase::Latency) {
        &args.sizes[..]
    } else {
        &[]
    };
    for &size in sizes {
        eprintln!(
            "overhead: latency, {} byte bodies, {} pairs",
            size, args.latency_rounds
        );
        let h = load::paired_latency(
            &client,
            &urls,
            &bodies,
            size,
            args.warmup_rounds,
            args.latency_rounds,
        )
        .await?;
        let named: Vec<(&str, &Histogram<u64>)> = others
            .iter()
            .map(|(n, _)| n.as_str())
            .zip(&h[2..])
            .collect();
        latency.push(latency_row(size, &h[0], &h[1], &named));
    }

    let ticks = procs::clock_ticks();
    let mut throughput = Vec::new();
    let load_sizes = if args.phases.contains(&Phase::Throughput) {
        &args.load_sizes[..]
    } else {
        &[]
    };
    let mut routers = vec![("round_robin", &rr, &urls[0]), ("kvroute", &kv, &urls[1])];
    for ((name, envoy), url) in others.iter().zip(&urls[2..]) {
        routers.push((name.as_str(), envoy, url));
    }
    for &size in load_sizes {
        // Interleaved rounds: every router runs a short window in turn, so
        // drift on the shared box (other jobs) hits them all alike.
        let rounds = args.load_rounds.max(1);
        let window = Duration::from_secs_f64(args.load_secs as f64 / rounds as f64);
        let mut acc: Vec<Acc> = routers.iter().map(|_| Acc::default()).collect();
        for round in 0..rounds {
            for (i, &(name, envoy, url)) in routers.iter().enumerate() {
                eprintln!(
                    "overhead: throughput, {name}, {size} byte bodies, {} connections, round {}/{rounds}, {:.1} s",
                    args.load_concurrency,
                    round + 1,
                    window.as_secs_f64()
                );
                tokio::time::sleep(Duration::from_millis(300)).await;
                let pids = [envoy.pid(), sim.pid(), std::process::id()];
                let before: Vec<f64> = pids
                    .iter()
                    .map(|&p| procs::cpu_seconds(p, ticks))
                    .collect::<Result<_>>()?;
                let r = load::closed_loop(
                    &client,
                    url,
                    bodies.clone(),
                    size,
                    args.load_concurrency,
                    Stop::After(window),
                )
                .await?;
                let after: Vec<f64> = pids
                    .iter()
                    .map(|&p| procs::cpu_seconds(p, ticks))
                    .collect::<Result<_>>()?;
                if r.errors > 0 {
                    bail!(
                        "{name}: {} errors, first: {}",
                        r.errors,
                        r.first_error.unwrap_or_default()
                    );
                }
                let a = &mut acc[i];
                a.ok += r.ok;
                a.secs += r.elapsed.as_secs_f64();
                for k in 0..3 {
                    a.cpu[k] += after[k] - before[k];
                }
                a.latency
                    .get_or_insert_with(load::histogram)
                    .add(&r.latency)?;
            }
        }
        for (&(name, _, _), a) in routers.iter().zip(&acc) {
            let per_req_us = |k: usize| a.cpu[k] * 1e6 / a.ok.max(1) as f64;
            let latency = a.latency.clone().unwrap_or_else(load::histogram);
            throughput.push(json!({
                "router": name,
                "body_bytes": size,
                "concurrency": args.load_concurrency,
                "rounds": rounds,
                "requests": a.ok,
                "seconds": round(a.secs, 3),
                "requests_per_s": round(a.ok as f64 / a.secs, 1),
                "latency_p50_us": us(&latency, 50.0),
                "latency_p99_us": us(&latency, 99.0),
                "envoy_cpu_us_per_request": round(per_req_us(0), 1),
                "sim_cpu_us_per_request": round(per_req_us(1), 1),
                "client_cpu_us_per_request": round(per_req_us(2), 1),
                "envoy_cores_busy": round(a.cpu[0] / a.secs, 2),
            }));
        }
    }
    let mut counters = serde_json::Map::new();
    counters.insert("side_by_side".into(), counters_json(kv_spec.admin)?);
    drop(routers);
    drop(others);
    drop(kv);
    drop(rr);

    // Phase 3: memory, one fresh Envoy per pass.
    let mut memory = Vec::new();
    if args.rss_requests > 0 && args.phases.contains(&Phase::Memory) {
        let engine_capacity = engine_index_capacity(endpoints[0])?;
        let mut passes = vec![
            (
                spec(
                    "round_robin-rss",
                    "round_robin",
                    None,
                    ports.envoy(2),
                    args.workers,
                ),
                None,
            ),
            (
                spec("kvroute-rss", "kvroute", None, ports.envoy(3), args.workers),
                Some(engine_capacity),
            ),
        ];
        if args.rss_small_capacity > 0 {
            let plugin = json!({"prefix": {
                "capacity_blocks": args.rss_small_capacity,
                "follow_engine_capacity": false,
            }});
            passes.push((
                spec(
                    "kvroute-rss-small",
                    "kvroute",
                    Some(plugin),
                    ports.envoy(4),
                    args.workers,
                ),
                Some(args.rss_small_capacity as u64),
            ));
        }
        for (spec, capacity) in passes {
            let pass =
                memory_pass(args, tools, &spec, &endpoints, &client, &bodies, capacity).await?;
            if spec.lb == "kvroute" {
                counters.insert(spec.name.clone(), counters_json(spec.admin)?);
            }
            memory.push(pass.0);
            drop(pass.1);
        }
    }
    let breakdown = if args.breakdown_sizes.is_empty() || !args.phases.contains(&Phase::Breakdown) {
        Value::Null
    } else {
        breakdown(args, tools, ports, &endpoints, &client, &bodies).await?
    };
    drop(sim);
    let goals = goals(&latency, &throughput, &memory);
    Ok(Results {
        latency: Value::Array(latency),
        throughput: Value::Array(throughput),
        memory: Value::Array(memory),
        counters: Value::Object(counters),
        breakdown,
        goals,
    })
}

/// The kvroute variants of the phase breakdown: each skips one more part of
/// the per-request work, so adjacent differences are the cost of that part.
fn breakdown_variants() -> [(&'static str, &'static str, Value); 3] {
    [
        (
            "kvroute",
            "everything: buffer, copy into wasm, parse, hash, decide, learn, decision log",
            json!({}),
        ),
        (
            "kvroute-hash-1-block",
            "prefix.max_prompt_tokens 64: body still buffered, copied and parsed as JSON, but 1 block hashed, learned and logged",
            json!({"prefix": {"max_prompt_tokens": 64}}),
        ),
        (
            "kvroute-no-buffer",
            "max_body_bytes 1024: the first body chunk is over the limit, so the request is routed by load at once and streams (no buffering, no parse)",
            json!({"max_body_bytes": 1024}),
        ),
    ]
}

/// Phase breakdown: the baseline and every [`breakdown_variants`] Envoy side
/// by side, paired sequential latency at each `--breakdown-sizes`.
async fn breakdown(
    args: &OverheadArgs,
    tools: &Tools,
    ports: Ports,
    endpoints: &[SocketAddr],
    client: &reqwest::Client,
    bodies: &Bodies,
) -> Result<Value> {
    let mut envoys = Vec::new();
    let mut names = vec!["round_robin".to_owned()];
    let mut urls = Vec::new();
    let rr = spec(
        "round_robin-bd",
        "round_robin",
        None,
        ports.envoy(5),
        args.workers,
    );
    envoys.push(procs::start_envoy(tools, &rr, endpoints)?);
    urls.push(url(rr.listen));
    let mut variants = Vec::new();
    for (i, (name, what, plugin)) in breakdown_variants().into_iter().enumerate() {
        let s = spec(
            &format!("{name}-bd"),
            "kvroute",
            Some(plugin.clone()),
            ports.envoy(6 + i as u16),
            args.workers,
        );
        envoys.push(procs::start_envoy(tools, &s, endpoints)?);
        urls.push(url(s.listen));
        names.push(name.to_owned());
        variants.push(json!({"name": name, "what": what, "plugin_config": plugin}));
    }
    let mut rows = Vec::new();
    for &size in &args.breakdown_sizes {
        eprintln!(
            "overhead: phase breakdown, {size} byte bodies, {} rounds x {} Envoys",
            args.breakdown_rounds,
            urls.len()
        );
        let hists = load::paired_latency(
            client,
            &urls,
            bodies,
            size,
            args.warmup_rounds,
            args.breakdown_rounds,
        )
        .await?;
        let base = us(&hists[0], 50.0);
        let mut p50 = serde_json::Map::new();
        let mut added = serde_json::Map::new();
        for (name, h) in names.iter().zip(&hists) {
            p50.insert(name.clone(), json!(us(h, 50.0)));
            added.insert(name.clone(), json!(round(us(h, 50.0) - base, 1)));
        }
        rows.push(json!({"body_bytes": size, "p50_us": p50, "added_p50_us": added}));
    }
    drop(envoys);
    Ok(json!({"variants": variants, "rows": rows}))
}

/// One memory pass: a fresh Envoy, RSS when ready, after a warm-up, and
/// every `rss_sample_every` requests. Returns the JSON and the (still
/// running) Envoy so its counters can be read.
async fn memory_pass(
    args: &OverheadArgs,
    tools: &Tools,
    spec: &EnvoySpec,
    endpoints: &[SocketAddr],
    client: &reqwest::Client,
    bodies: &Arc<Bodies>,
    capacity_blocks: Option<u64>,
) -> Result<(Value, Child)> {
    eprintln!(
        "overhead: memory, {}, {} requests of {} bytes with unique prefixes",
        spec.name, args.rss_requests, args.rss_body_bytes
    );
    let mut envoy = procs::start_envoy(tools, spec, endpoints)?;
    let pid = envoy.pid();
    let url = url(spec.listen);
    // Let the scraper run a few ticks so the idle figure is a steady one.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_ready = procs::rss_bytes(pid)?;
    let warmup = 1_000u64.min(args.rss_requests);
    run_count(client, &url, bodies, args, warmup).await?;
    let rss_warm = procs::rss_bytes(pid)?;
    let mut samples = vec![json!({"requests": 0, "rss_mib": mib(rss_warm)})];
    let started = Instant::now();
    let mut done = 0;
    while done < args.rss_requests {
        let n = args.rss_sample_every.min(args.rss_requests - done);
        run_count(client, &url, bodies, args, n).await?;
        envoy.check_alive()?;
        done += n;
        samples.push(json!({"requests": done, "rss_mib": mib(procs::rss_bytes(pid)?)}));
    }
    let rss_after = procs::rss_bytes(pid)?;
    let first = samples
        .get(1)
        .and_then(|s| s["rss_mib"].as_f64())
        .unwrap_or(mib(rss_warm));
    // RSS after 10 000 and 100 000 requests, when the pass got that far.
    let at = |n: u64| {
        samples
            .iter()
            .find(|s| s["requests"].as_u64() == Some(n))
            .map(|s| s["rss_mib"].clone())
            .unwrap_or(Value::Null)
    };
    let (rss_10k, rss_100k) = (at(10_000), at(100_000));
    let blocks_per_request = (args.rss_body_bytes / 256) as u64;
    let index_bound = capacity_blocks.map(|c| {
        // Every VM (one per worker plus the main thread's) holds an index.
        let vms = u64::from(spec.workers) + 1;
        vms * endpoints.len() as u64 * c * INDEX_BYTES_PER_BLOCK
    });
    let value = json!({
        "router": spec.name,
        "capacity_blocks_per_endpoint": capacity_blocks,
        "index_bound_mib": index_bound.map(mib),
        "requests": done,
        "blocks_offered_per_vm": done * blocks_per_request,
        "seconds": round(started.elapsed().as_secs_f64(), 1),
        "rss_ready_mib": mib(rss_ready),
        "rss_before_mib": mib(rss_warm),
        "rss_after_10k_mib": rss_10k,
        "rss_after_100k_mib": rss_100k,
        "rss_after_mib": mib(rss_after),
        "growth_mib": round(mib(rss_after) - mib(rss_warm), 2),
        "growth_after_first_sample_mib": round(mib(rss_after) - first, 2),
        "samples": samples,
    });
    Ok((value, envoy))
}

async fn run_count(
    client: &reqwest::Client,
    url: &str,
    bodies: &Arc<Bodies>,
    args: &OverheadArgs,
    n: u64,
) -> Result<()> {
    let r = load::closed_loop(
        client,
        url,
        bodies.clone(),
        args.rss_body_bytes,
        args.load_concurrency,
        Stop::Count(n),
    )
    .await?;
    if r.errors > 0 {
        bail!(
            "{url}: {} errors, first: {}",
            r.errors,
            r.first_error.unwrap_or_default()
        );
    }
    Ok(())
}

/// The index capacity kvroute follows by default: the pod's KV capacity in
/// tokens (`/sim/state`) over kvroute's 64-token blocks.
fn engine_index_capacity(pod: SocketAddr) -> Result<u64> {
    let (_, body) = procs::http_get(pod, "/sim/state")?;
    let state: Value = serde_json::from_str(&body).context("/sim/state")?;
    let blocks = state["kv_blocks_capacity"]
        .as_u64()
        .context("kv_blocks_capacity")?;
    let size = state["block_size"].as_u64().context("block_size")?;
    Ok(blocks * size / 64)
}

fn counters_json(admin: u16) -> Result<Value> {
    Ok(Value::Object(
        procs::kvroute_counters(admin)?
            .into_iter()
            .map(|(k, v)| (k, Value::from(v)))
            .collect(),
    ))
}

fn latency_row(
    size: usize,
    base: &Histogram<u64>,
    kv: &Histogram<u64>,
    others: &[(&str, &Histogram<u64>)],
) -> Value {
    let pcts = |h: &Histogram<u64>| json!({"p50": us(h, 50.0), "p90": us(h, 90.0), "p99": us(h, 99.0), "mean": round(h.mean() / 1e3, 1)});
    let added = |h: &Histogram<u64>| {
        let d = |q: f64| round(us(h, q) - us(base, q), 1);
        json!({"p50": d(50.0), "p90": d(90.0), "p99": d(99.0), "mean": round((h.mean() - base.mean()) / 1e3, 1)})
    };
    let mut row = json!({
        "body_bytes": size,
        "samples": kv.len(),
        "round_robin_us": pcts(base),
        "kvroute_us": pcts(kv),
        "added_us": added(kv),
    });
    if !others.is_empty() {
        row["others_us"] = others
            .iter()
            .map(|(n, h)| ((*n).to_owned(), pcts(h)))
            .collect();
        row["others_added_us"] = others
            .iter()
            .map(|(n, h)| ((*n).to_owned(), added(h)))
            .collect();
    }
    row
}

/// Issue 14's limits on kvroute's in-proxy cost (against round robin).
const GOAL_ADDED_P50_16K_US: f64 = 50.0;
const GOAL_ADDED_P50_512K_US: f64 = 400.0;
const GOAL_ADDED_CPU_1K_US: f64 = 25.0;

/// The issue's goals, judged on this run's numbers.
fn goals(latency: &[Value], throughput: &[Value], memory: &[Value]) -> Value {
    let cpu = |router: &str| {
        throughput
            .iter()
            .find(|r| r["router"] == router && r["body_bytes"].as_u64() == Some(1024))
            .and_then(|r| r["envoy_cpu_us_per_request"].as_f64())
    };
    let added_cpu = match (cpu("round_robin"), cpu("kvroute")) {
        (Some(rr), Some(kv)) => {
            let v = round(kv - rr, 1);
            json!({"added_envoy_cpu_us_per_request": v, "limit_us": GOAL_ADDED_CPU_1K_US, "met": v <= GOAL_ADDED_CPU_1K_US})
        }
        _ => Value::Null,
    };
    let added_p50 = |size: u64| {
        latency
            .iter()
            .find(|r| r["body_bytes"].as_u64() == Some(size))
            .and_then(|r| r["added_us"]["p50"].as_f64())
    };
    let judge = |got: Option<f64>, limit: f64| match got {
        Some(v) => json!({"added_p50_us": v, "limit_us": limit, "met": v <= limit}),
        None => Value::Null,
    };
    let rss: Vec<Value> = memory
        .iter()
        .filter(|m| m["index_bound_mib"].is_number())
        .map(|m| {
            let growth = m["growth_after_first_sample_mib"]
                .as_f64()
                .unwrap_or(f64::MAX);
            let bound = m["index_bound_mib"].as_f64().unwrap_or(0.0);
            json!({
                "router": m["router"],
                "growth_after_first_sample_mib": growth,
                "total_growth_mib": m["growth_mib"],
                "index_bound_mib": bound,
                "met": growth <= bound.max(1.0),
            })
        })
        .collect();
    json!({
        "added_latency_16KiB_p50": judge(added_p50(16 << 10), GOAL_ADDED_P50_16K_US),
        "added_latency_512KiB_p50": judge(added_p50(512 << 10), GOAL_ADDED_P50_512K_US),
        "added_envoy_cpu_1KiB": added_cpu,
        "rss_flat": rss,
    })
}

fn print_tables(report: &Value) {
    let mut t = Table::new();
    let others: Vec<String> = report["latency"][0]["others_us"]
        .as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default();
    let mut header: Vec<String> = [
        "body",
        "rr p50 us",
        "kv p50 us",
        "added p50",
        "rr p99 us",
        "kv p99 us",
        "added p99",
    ]
    .map(str::to_owned)
    .to_vec();
    for n in &others {
        header.extend([format!("{n} p50"), format!("{n} added p50")]);
    }
    t.load_preset(UTF8_FULL_CONDENSED).set_header(header);
    for r in report["latency"].as_array().into_iter().flatten() {
        let mut row = vec![
            size_label(r["body_bytes"].as_u64().unwrap_or(0)),
            r["round_robin_us"]["p50"].to_string(),
            r["kvroute_us"]["p50"].to_string(),
            r["added_us"]["p50"].to_string(),
            r["round_robin_us"]["p99"].to_string(),
            r["kvroute_us"]["p99"].to_string(),
            r["added_us"]["p99"].to_string(),
        ];
        for n in &others {
            row.extend([
                r["others_us"][n]["p50"].to_string(),
                r["others_added_us"][n]["p50"].to_string(),
            ]);
        }
        t.add_row(row);
    }
    println!("Added latency (sequential, client-observed, non-streaming, max_tokens 1)\n{t}");

    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED).set_header(vec![
        "router",
        "body",
        "conns",
        "req/s",
        "p50 us",
        "p99 us",
        "Envoy CPU us/req",
        "Envoy cores",
        "sim us/req",
        "client us/req",
    ]);
    for r in report["throughput"].as_array().into_iter().flatten() {
        t.add_row(vec![
            r["router"].as_str().unwrap_or("").to_owned(),
            size_label(r["body_bytes"].as_u64().unwrap_or(0)),
            r["concurrency"].to_string(),
            r["requests_per_s"].to_string(),
            r["latency_p50_us"].to_string(),
            r["latency_p99_us"].to_string(),
            r["envoy_cpu_us_per_request"].to_string(),
            r["envoy_cores_busy"].to_string(),
            r["sim_cpu_us_per_request"].to_string(),
            r["client_cpu_us_per_request"].to_string(),
        ]);
    }
    println!("Throughput at fixed concurrency (client, sim and Envoy share the 2 cores)\n{t}");

    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED).set_header(vec![
        "pass",
        "capacity/endpoint",
        "index bound MiB",
        "requests",
        "RSS ready MiB",
        "RSS before MiB",
        "after 10k",
        "after 100k",
        "RSS after MiB",
        "growth after 1st sample",
    ]);
    for r in report["memory"].as_array().into_iter().flatten() {
        t.add_row(vec![
            r["router"].as_str().unwrap_or("").to_owned(),
            r["capacity_blocks_per_endpoint"].to_string(),
            r["index_bound_mib"].to_string(),
            r["requests"].to_string(),
            r["rss_ready_mib"].to_string(),
            r["rss_before_mib"].to_string(),
            r["rss_after_10k_mib"].to_string(),
            r["rss_after_100k_mib"].to_string(),
            r["rss_after_mib"].to_string(),
            r["growth_after_first_sample_mib"].to_string(),
        ]);
    }
    println!("Envoy RSS over requests with unique prefixes\n{t}");
    if let Some(rows) = report["phase_breakdown"]["rows"].as_array() {
        let names: Vec<String> = report["phase_breakdown"]["variants"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v["name"].as_str().map(str::to_owned))
            .collect();
        let mut t = Table::new();
        let mut header = vec!["body".to_owned(), "round_robin p50 us".to_owned()];
        header.extend(names.iter().map(|n| format!("{n} added p50")));
        t.load_preset(UTF8_FULL_CONDENSED).set_header(header);
        for r in rows {
            let mut row = vec![
                size_label(r["body_bytes"].as_u64().unwrap_or(0)),
                r["p50_us"]["round_robin"].to_string(),
            ];
            row.extend(names.iter().map(|n| r["added_p50_us"][n].to_string()));
            t.add_row(row);
        }
        println!(
            "Phase breakdown (kvroute variants that skip work; the JSON says what each skips)\n{t}"
        );
    }
    println!(
        "goals: {}",
        serde_json::to_string_pretty(&report["goals"]).unwrap_or_default()
    );
}

/// Percentile of a ns histogram in us, one decimal.
fn us(h: &Histogram<u64>, q: f64) -> f64 {
    round(h.value_at_quantile(q / 100.0) as f64 / 1e3, 1)
}

fn mib(bytes: u64) -> f64 {
    round(bytes as f64 / (1024.0 * 1024.0), 2)
}

fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

fn size_label(bytes: u64) -> String {
    if bytes >= 1024 && bytes % 1024 == 0 {
        format!("{} KiB", bytes / 1024)
    } else {
        format!("{bytes} B")
    }
}

pub(crate) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub(crate) fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned());
    let mem_kb = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .map(str::to_owned)
        })
        .and_then(|l| {
            l.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        });
    json!({
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu_model": model,
        "memory_gib": mem_kb.map(|kb| round(kb as f64 / 1024.0 / 1024.0, 1)),
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
    })
}

/// `YYYY-MM-DDTHH:MM:SSZ` of a system time (UTC, proleptic Gregorian).
pub(crate) fn utc_datetime(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day) (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_utc_calendar_dates() {
        assert_eq!(utc_datetime(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_796_232_217);
        assert_eq!(utc_datetime(t), "2026-12-02T17:23:37Z");
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }

    /// `kvroute-bench overhead ARGS`, parsed.
    fn parse(extra: &[&str]) -> std::result::Result<OverheadArgs, clap::Error> {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            overhead: OverheadArgs,
        }
        let argv = std::iter::once("overhead").chain(extra.iter().copied());
        <Cli as clap::Parser>::try_parse_from(argv).map(|c| c.overhead)
    }

    #[test]
    fn the_pool_size_and_the_plugin_config_are_checked() {
        let checked = |a: &[&str]| validate(&parse(a).expect("parses"));
        assert!(checked(&[]).is_ok());
        assert!(checked(&["--pods", "1024"]).is_ok());
        let err = |a: &[&str]| checked(a).unwrap_err().to_string();
        assert!(err(&["--pods", "0"]).contains("--pods"));
        assert!(err(&["--pods", "1025"]).contains("--pods"));
        let e = err(&["--pods", "1024", "--base-port", "64500"]);
        assert!(e.contains("no room"), "{e}");
        let cfg = parse(&["--kvroute-config", r#"{"metrics":{"max_scrapes_per_s":1}}"#]);
        let cfg = cfg.expect("parses").kvroute_config.expect("given");
        assert_eq!(cfg["metrics"]["max_scrapes_per_s"], json!(1));
        assert!(parse(&["--kvroute-config", "[1]"]).is_err());
    }

    #[test]
    fn ports_do_not_overlap() {
        for pods in [1, 2, 3, 1024] {
            let ports = Ports { base: 19400, pods };
            let mut all = ports.all();
            let n = all.len();
            assert_eq!(n, usize::from(pods) + 2 * usize::from(ENVOYS));
            all.sort_unstable();
            all.dedup();
            assert_eq!(all.len(), n, "{pods} pods");
        }
        // The default run keeps its ports: pods 19400-19401, Envoys from 19410.
        assert_eq!(
            Ports {
                base: 19400,
                pods: 2
            }
            .envoy(0),
            (19410, 19411)
        );
    }

    #[test]
    fn added_latency_goal_is_judged_at_p50() {
        let mut base = load::histogram();
        let mut kv = load::histogram();
        for _ in 0..100 {
            base.record(200_000).unwrap();
            kv.record(250_000).unwrap();
        }
        let row = latency_row(16 << 10, &base, &kv, &[("kvroute-old", &kv)]);
        let added = row["added_us"]["p50"].as_f64().unwrap();
        assert!((added - 50.0).abs() < 0.5, "{added}"); // hdrhistogram rounds to 3 digits
        assert_eq!(
            row["others_added_us"]["kvroute-old"]["p50"],
            row["added_us"]["p50"]
        );
        let cpu = |router: &str, us: f64| json!({"router": router, "body_bytes": 1024, "envoy_cpu_us_per_request": us});
        let g = goals(
            &[row],
            &[cpu("round_robin", 35.0), cpu("kvroute", 61.0)],
            &[],
        );
        assert_eq!(
            g["added_latency_16KiB_p50"]["met"],
            json!(added <= GOAL_ADDED_P50_16K_US)
        );
        assert!(g["added_latency_512KiB_p50"].is_null());
        assert_eq!(g["added_envoy_cpu_1KiB"]["met"], json!(false), "26 us > 25");
    }
}
