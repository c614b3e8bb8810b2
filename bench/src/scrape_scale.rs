//! `kvroute-bench scrape-scale`: what scraping a large pool costs Envoy, and how
//! fresh it keeps the load figures (issue 14, deliverable 2).
//!
//! One `kvroute-sim` process hosts the largest pool asked for (`--endpoints`,
//! up to 1024 pods, latency model off); for each pool size N, each arm (the
//! tree's own kvroute build, extra `--wasm NAME=PATH` builds, and Envoy without
//! the filter over the same N members) gets a fresh Envoy started the way
//! `./build.sh serve --no-build` starts it (`envoy/render.py --run`, 2 workers),
//! in front of the first N pods, idle by default (all that runs is kvroute's
//! tick and scraper) or under `--load-rps` requests per second (the same for
//! every arm, so the no-filter arm prices the requests themselves). Per run:
//!
//! 1. warm-up (`--warmup-secs`), then **Envoy CPU** (utime + stime from
//!    `/proc/<pid>/stat`) over `--cpu-secs` without touching the admin API
//!    (except one counter read at each end), and the scrapes done in that time
//!    (`kvroute.scrape.{success,failure}`);
//! 2. **freshness**: for `--freshness-secs`, every `--sample-ms`, every
//!    endpoint's `kvroute.endpoint.<ep>.snapshot_age_ms` gauge (the shared
//!    scrape state at the scraper's tick; other workers read it on their next
//!    tick). A pool member without the gauge has never had a snapshot and
//!    counts as missing.
//!
//! Arms alternate order every round (`--rounds`) so drift on a shared box hits
//! them alike. Output: a table on stdout and `bench/results/scrape-scale-<date>.json`.

use crate::overhead::procs::{self, Child, EnvoySpec, Tools};
use crate::overhead::{loadavg, machine, utc_datetime};
use anyhow::{bail, Context as _, Result};
use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use serde::Serialize;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// Arguments of `kvroute-bench scrape-scale`.
#[derive(Debug, Clone, clap::Args)]
pub struct ScrapeScaleArgs {
    /// Repository root (binaries, `envoy/render.py`, `.venv`, `bench/results`).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/.."))]
    pub root: PathBuf,
    /// Pool sizes to measure (each at most 1024, the config's limit).
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
    pub endpoints: Vec<u16>,
    /// First port: pods on P..P+max(N)-1, Envoy's listener and admin above them.
    #[arg(long, default_value_t = 21000)]
    pub base_port: u16,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    pub workers: u16,
    /// Seconds after Envoy is ready before measuring.
    #[arg(long, default_value_t = 4.0)]
    pub warmup_secs: f64,
    /// Seconds of the CPU window.
    #[arg(long, default_value_t = 10.0)]
    pub cpu_secs: f64,
    /// Seconds of snapshot-age sampling after the CPU window.
    #[arg(long, default_value_t = 4.0)]
    pub freshness_secs: f64,
    /// Interval between snapshot-age samples.
    #[arg(long, default_value_t = 250)]
    pub sample_ms: u64,
    /// Rounds per pool size (arms alternate order every round).
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Another kvroute build to measure side by side: `NAME=PATH.wasm` (repeatable).
    #[arg(long = "wasm")]
    pub wasm_arms: Vec<String>,
    /// JSON object merged into every kvroute arm's plugin config.
    #[arg(long)]
    pub kvroute_config: Option<String>,
    /// Leave out the Envoy-without-the-filter arm.
    #[arg(long)]
    pub no_baseline: bool,
    /// Members from an EDS file and kvroute's `discovery` (it reads Envoy's
    /// admin `/clusters` every `discovery.interval_ms`), as under Kubernetes;
    /// default: a static list.
    #[arg(long)]
    pub discovery: bool,
    /// Requests per second sent through the listener during both windows
    /// (`POST /v1/completions`, a 1 KiB prompt with a unique prefix, 1 token;
    /// 0: idle). Every arm gets the same load.
    #[arg(long, default_value_t = 0.0)]
    pub load_rps: f64,
    /// Where the JSON goes (default: `<root>/bench/results`).
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
}

/// One Envoy configuration measured at every pool size.
#[derive(Debug, Clone)]
struct Arm {
    name: String,
    /// `None`: Envoy without the filter (round robin).
    wasm: Option<PathBuf>,
}

/// One run: one arm at one pool size.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// Arm name.
    pub arm: String,
    /// Pool size.
    pub endpoints: usize,
    /// Round (0-based).
    pub round: usize,
    /// Envoy CPU over the window, ms per wall second.
    pub envoy_cpu_ms_per_s: f64,
    /// The simulator's CPU over the window (answering scrapes and health checks).
    pub sim_cpu_ms_per_s: f64,
    /// Scrapes (success + failure) per second over the window.
    pub scrapes_per_s: f64,
    /// Failed scrapes over the window.
    pub scrape_failures: u64,
    /// Snapshot ages sampled (all endpoints, all samples), ms: p50, p99, max.
    pub age_ms: Option<[u64; 3]>,
    /// Pool members with no snapshot-age gauge in the last sample.
    pub missing: usize,
    /// Samples taken.
    pub samples: usize,
    /// Envoy's resident memory at the end of the run, MiB.
    pub envoy_rss_mib: f64,
    /// Requests answered 200 per second by the `--load-rps` client.
    pub load_requests_per_s: f64,
    /// Load requests that failed (not 200, or no answer).
    pub load_failed: u64,
    /// Admin reads (samples, counters) Envoy did not answer within 5 s.
    pub admin_timeouts: usize,
}

/// Runs the benchmark.
pub fn run(args: &ScrapeScaleArgs) -> Result<()> {
    let max_n = args.endpoints.iter().copied().max().unwrap_or(0);
    if args.endpoints.is_empty() || !(1..=1024).contains(&max_n) || args.endpoints.contains(&0) {
        bail!("--endpoints: pool sizes 1..=1024");
    }
    if args.rounds == 0 || args.cpu_secs <= 0.0 {
        bail!("--rounds and --cpu-secs must be > 0");
    }
    let root = args.root.canonicalize().context("--root")?;
    let tools = Tools::in_tree(&root, "scrape-scale")?;
    let mut arms = vec![Arm {
        name: "kvroute".into(),
        wasm: Some(tools.wasm.clone()),
    }];
    for a in &args.wasm_arms {
        let (name, path) = a.split_once('=').context("--wasm takes NAME=PATH")?;
        arms.push(Arm {
            name: name.into(),
            wasm: Some(PathBuf::from(path)),
        });
    }
    if !args.no_baseline {
        arms.push(Arm {
            name: "no-filter".into(),
            wasm: None,
        });
    }
    for p in arms.iter().filter_map(|a| a.wasm.as_ref()) {
        if !p.exists() {
            bail!("{} not found: run ./build.sh build first", p.display());
        }
    }
    let extra: Value = match &args.kvroute_config {
        Some(s) => serde_json::from_str(s).context("--kvroute-config")?,
        None => json!({}),
    };
    if !extra.is_object() {
        bail!("--kvroute-config must be a JSON object");
    }
    let listen = args
        .base_port
        .checked_add(max_n + 10)
        .context("--base-port too high")?;
    for port in (args.base_port..args.base_port + max_n).chain([listen, listen + 1]) {
        procs::ensure_free(port)?;
    }
    let started = SystemTime::now();
    let load_before = loadavg();
    let mut sim = start_sim(&tools, max_n, args.base_port, args.workers)?;
    let pods: Vec<SocketAddr> = (0..max_n)
        .map(|i| SocketAddr::from(([127, 0, 0, 1], args.base_port + i)))
        .collect();
    let mut runs = Vec::new();
    for &n in &args.endpoints {
        for round in 0..args.rounds {
            let mut order: Vec<&Arm> = arms.iter().collect();
            if round % 2 == 1 {
                order.reverse();
            }
            for arm in order {
                sim.check_alive()?;
                let r = measure(
                    args,
                    &tools,
                    arm,
                    &extra,
                    &pods[..n as usize],
                    listen,
                    round,
                    &sim,
                )?;
                eprintln!(
                    "N={n} {} round {round}: Envoy {:.1} ms/s, {:.0} scrapes/s, age p50/max {:?}",
                    r.arm, r.envoy_cpu_ms_per_s, r.scrapes_per_s, r.age_ms
                );
                runs.push(r);
            }
        }
    }
    drop(sim);
    let report = json!({
        "benchmark": "scrape-scale",
        "date_utc": utc_datetime(started),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "machine": machine(),
        "load_average_before": load_before,
        "load_average_after": loadavg(),
        "settings": {
            "workers": args.workers,
            "warmup_secs": args.warmup_secs,
            "cpu_secs": args.cpu_secs,
            "freshness_secs": args.freshness_secs,
            "sample_ms": args.sample_ms,
            "load_rps": args.load_rps,
            "discovery": args.discovery,
            "kvroute_config": extra,
            "arms": arms.iter().map(|a| json!({"name": a.name, "wasm": a.wasm})).collect::<Vec<_>>(),
            "sim": format!("kvroute-sim --pods {max_n} --no-latency --threads {}", args.workers),
        },
        "runs": runs,
    });
    let out_dir = args
        .out_dir
        .clone()
        .unwrap_or_else(|| root.join("bench/results"));
    std::fs::create_dir_all(&out_dir)?;
    let path = out_dir.join(format!(
        "scrape-scale-{}.json",
        &utc_datetime(started)[..10]
    ));
    std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")?;
    print_table(&runs);
    println!("results: {}", path.display());
    let _ = std::fs::remove_dir_all(&tools.work);
    Ok(())
}

/// `kvroute-sim` with `pods` pods (latency off), every pod answering `/health`.
fn start_sim(tools: &Tools, pods: u16, base_port: u16, threads: u16) -> Result<Child> {
    let mut cmd = std::process::Command::new(&tools.sim);
    cmd.args(["--pods", &pods.to_string(), "--no-latency"])
        .args(["--base-port", &base_port.to_string()])
        .args(["--threads", &threads.max(1).to_string()]);
    let mut child = Child::spawn("kvroute-sim", cmd, &tools.work.join("sim.log"))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    for i in 0..pods {
        let addr = SocketAddr::from(([127, 0, 0, 1], base_port + i));
        loop {
            child.check_alive()?;
            if procs::http_get(addr, "/health").is_ok_and(|(s, _)| s == 200) {
                break;
            }
            if Instant::now() > deadline {
                bail!("kvroute-sim pod {i} not up within 30 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(child)
}

#[allow(clippy::too_many_arguments)]
fn measure(
    args: &ScrapeScaleArgs,
    tools: &Tools,
    arm: &Arm,
    extra: &Value,
    pods: &[SocketAddr],
    listen: u16,
    round: usize,
    sim: &Child,
) -> Result<Run> {
    let n = pods.len();
    let mut tools = tools.clone();
    let plugin = arm.wasm.as_ref().map(|w| {
        tools.wasm = w.clone();
        let mut p = extra.clone();
        if args.discovery && p.get("discovery").is_none() {
            p["discovery"] = json!({});
        }
        p
    });
    let eds_file = if args.discovery {
        let path = tools.work.join(format!("eds-{n}.json"));
        write_eds(&path, pods)?;
        Some(path)
    } else {
        None
    };
    let spec = EnvoySpec {
        name: format!("{}-{n}", arm.name),
        lb: if arm.wasm.is_some() {
            "kvroute"
        } else {
            "round_robin"
        },
        plugin,
        listen,
        admin: listen + 1,
        workers: args.workers,
        eds_file,
    };
    let mut envoy = procs::start_envoy(&tools, &spec, pods)?;
    let admin = SocketAddr::from(([127, 0, 0, 1], listen + 1));
    std::thread::sleep(Duration::from_secs_f64(args.warmup_secs));
    envoy.check_alive()?;
    let load = Load::start(listen, args.load_rps);
    let ticks = procs::clock_ticks();
    let scrapes0 = scrape_counters(admin);
    let (e0, s0, t0) = (
        procs::cpu_seconds(envoy.pid(), ticks)?,
        procs::cpu_seconds(sim.pid(), ticks)?,
        Instant::now(),
    );
    std::thread::sleep(Duration::from_secs_f64(args.cpu_secs));
    let (e1, s1, wall) = (
        procs::cpu_seconds(envoy.pid(), ticks)?,
        procs::cpu_seconds(sim.pid(), ticks)?,
        t0.elapsed().as_secs_f64(),
    );
    let scrapes1 = scrape_counters(admin);
    let mut ages = Vec::new();
    let mut missing = n;
    let mut samples = 0;
    let mut admin_timeouts = 0;
    if arm.wasm.is_some() {
        let end = Instant::now() + Duration::from_secs_f64(args.freshness_secs);
        while Instant::now() < end {
            // An Envoy too busy to answer its admin API within 5 s counts as
            // an unanswered sample (the old design at 1024 endpoints).
            match procs::http_get(admin, "/stats?filter=snapshot_age_ms$") {
                Ok((_, body)) => {
                    let sample = parse_gauges(&body);
                    missing = n.saturating_sub(sample.len());
                    ages.extend(sample);
                    samples += 1;
                }
                Err(_) => admin_timeouts += 1,
            }
            std::thread::sleep(Duration::from_millis(args.sample_ms));
        }
    }
    let (load_ok, load_failed, load_secs) = load.stop();
    envoy.check_alive()?;
    let rss = procs::rss_bytes(envoy.pid()).unwrap_or(0);
    drop(envoy);
    ages.sort_unstable();
    let q = |p: f64| ages[((ages.len() - 1) as f64 * p).round() as usize];
    Ok(Run {
        arm: arm.name.clone(),
        endpoints: n,
        round,
        envoy_cpu_ms_per_s: (e1 - e0) * 1000.0 / wall,
        sim_cpu_ms_per_s: (s1 - s0) * 1000.0 / wall,
        scrapes_per_s: match (scrapes0, scrapes1) {
            (Some(a), Some(b)) => (b.0 + b.1).saturating_sub(a.0 + a.1) as f64 / wall,
            _ => f64::NAN,
        },
        scrape_failures: match (scrapes0, scrapes1) {
            (Some(a), Some(b)) => b.1.saturating_sub(a.1),
            _ => 0,
        },
        age_ms: (!ages.is_empty()).then(|| [q(0.5), q(0.99), q(1.0)]),
        missing: if arm.wasm.is_some() { missing } else { 0 },
        samples,
        envoy_rss_mib: rss as f64 / (1024.0 * 1024.0),
        load_requests_per_s: load_ok as f64 / load_secs.max(1e-9),
        load_failed,
        admin_timeouts: admin_timeouts
            + usize::from(scrapes0.is_none())
            + usize::from(scrapes1.is_none()),
    })
}

/// The `--load-rps` client: one thread sending requests at a fixed rate.
struct Load {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<(u64, u64)>>,
    t0: Instant,
}

impl Load {
    fn start(listen: u16, rps: f64) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let handle = (rps > 0.0).then(|| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let addr = SocketAddr::from(([127, 0, 0, 1], listen));
                let gap = Duration::from_secs_f64(1.0 / rps);
                let (mut ok, mut failed) = (0, 0);
                let mut next = Instant::now();
                let filler = "lorem ipsum dolor sit amet ".repeat(38);
                for i in 0u64.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let body = json!({
                        "model": "m",
                        "prompt": format!("{i:016x} {filler}"),
                        "max_tokens": 1,
                    })
                    .to_string();
                    match post(addr, "/v1/completions", &body) {
                        Ok(200) => ok += 1,
                        _ => failed += 1,
                    }
                    next += gap;
                    if let Some(wait) = next.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                }
                (ok, failed)
            })
        });
        Load {
            stop,
            handle,
            t0: Instant::now(),
        }
    }

    /// Stops the client: requests answered 200, failed, and seconds of load.
    fn stop(self) -> (u64, u64, f64) {
        self.stop.store(true, Ordering::Relaxed);
        let secs = self.t0.elapsed().as_secs_f64();
        let (ok, failed) = self.handle.and_then(|h| h.join().ok()).unwrap_or((0, 0));
        (ok, failed, secs)
    }
}

/// A blocking `POST` of a JSON body; the response status.
fn post(addr: SocketAddr, path: &str, body: &str) -> Result<u16> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no HTTP status line")
}

/// An EDS file (what `envoy/render.py --eds-file` watches) listing `pods`.
fn write_eds(path: &std::path::Path, pods: &[SocketAddr]) -> Result<()> {
    let lb: Vec<Value> = pods
        .iter()
        .map(|a| {
            json!({"endpoint": {"address": {"socket_address": {
                "address": a.ip().to_string(), "port_value": a.port()}}}})
        })
        .collect();
    let doc = json!({"resources": [{
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        "cluster_name": "kvroute_upstream",
        "endpoints": [{"lb_endpoints": lb}]
    }]});
    std::fs::write(path, serde_json::to_vec(&doc)?)?;
    Ok(())
}

/// `kvroute.scrape.success` and `.failure` (0 when absent: no filter);
/// `None` when the admin API did not answer.
fn scrape_counters(admin: SocketAddr) -> Option<(u64, u64)> {
    let body = procs::http_get(admin, "/stats?filter=kvroute%5C.scrape%5C.")
        .ok()?
        .1;
    let get = |suffix: &str| {
        body.lines()
            .filter_map(|l| l.split_once(": "))
            .filter(|(k, _)| k.ends_with(suffix))
            .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
            .sum()
    };
    Some((get("scrape.success"), get("scrape.failure")))
}

/// Values of the `name: value` lines of an admin `/stats` answer.
pub fn parse_gauges(body: &str) -> Vec<u64> {
    body.lines()
        .filter_map(|l| l.split_once(": "))
        .filter_map(|(_, v)| v.trim().parse().ok())
        .collect()
}

fn print_table(runs: &[Run]) {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED).set_header([
        "endpoints",
        "arm",
        "Envoy CPU ms/s (runs)",
        "minus no-filter",
        "scrapes/s",
        "snapshot age p50 / p99 / max",
        "missing",
        "admin timeouts",
        "Envoy RSS MiB",
        "load req/s (failed)",
        "sim CPU ms/s",
    ]);
    // Pool sizes in order, arms in the order of the first round.
    let mut keys: Vec<(usize, String)> = Vec::new();
    for r in runs {
        if !keys.contains(&(r.endpoints, r.arm.clone())) {
            keys.push((r.endpoints, r.arm.clone()));
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    for (n, arm) in keys {
        let of = |a: &str| -> Vec<&Run> {
            runs.iter()
                .filter(|r| r.endpoints == n && r.arm == a)
                .collect()
        };
        let mine = of(&arm);
        let cpu: Vec<f64> = mine.iter().map(|r| r.envoy_cpu_ms_per_s).collect();
        let base: Vec<f64> = of("no-filter")
            .iter()
            .map(|r| r.envoy_cpu_ms_per_s)
            .collect();
        let ages = mine
            .iter()
            .filter_map(|r| r.age_ms)
            .fold(None, |acc: Option<[u64; 3]>, a| {
                Some(acc.map_or(a, |b| [b[0].max(a[0]), b[1].max(a[1]), b[2].max(a[2])]))
            });
        t.add_row([
            n.to_string(),
            arm.clone(),
            format!(
                "{:.1} ({})",
                mean(&cpu),
                cpu.iter()
                    .map(|c| format!("{c:.0}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            if arm == "no-filter" || base.is_empty() {
                "-".into()
            } else {
                format!("{:+.1}", mean(&cpu) - mean(&base))
            },
            format!(
                "{:.0}",
                mean(&mine.iter().map(|r| r.scrapes_per_s).collect::<Vec<_>>())
            ),
            ages.map_or("-".into(), |a| format!("{} / {} / {} ms", a[0], a[1], a[2])),
            mine.iter()
                .map(|r| r.missing)
                .max()
                .unwrap_or(0)
                .to_string(),
            mine.iter()
                .map(|r| r.admin_timeouts)
                .sum::<usize>()
                .to_string(),
            format!(
                "{:.0}",
                mean(&mine.iter().map(|r| r.envoy_rss_mib).collect::<Vec<_>>())
            ),
            format!(
                "{:.0} ({})",
                mean(
                    &mine
                        .iter()
                        .map(|r| r.load_requests_per_s)
                        .collect::<Vec<_>>()
                ),
                mine.iter().map(|r| r.load_failed).sum::<u64>()
            ),
            format!(
                "{:.0}",
                mean(&mine.iter().map(|r| r.sim_cpu_ms_per_s).collect::<Vec<_>>())
            ),
        ]);
    }
    println!("{t}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauges_from_admin_text() {
        let body = "wasmcustom.kvroute.endpoint.127_0_0_1_21000.snapshot_age_ms: 41\n\
                    wasmcustom.kvroute.endpoint.127_0_0_1_21001.snapshot_age_ms: 90\nbad line\n";
        assert_eq!(parse_gauges(body), vec![41, 90]);
    }
}
