//! Fleet scale through the real Envoy (issue 14): a pool of 1024 endpoints
//! (one `kvroute-sim` process) is scraped within the pool's scrape budget and
//! every snapshot stays younger than 500 ms; a small pool keeps the 50 ms
//! interval. The CPU side is measured by `kvroute-bench scrape-scale`
//! (bench/README.md, "Fleet scale"), not asserted here.

mod support;

use serde_json::json;
use std::time::{Duration, Instant};
use support::{get, post_json, Envoy, Sim};

/// Every `kvroute.endpoint.*.snapshot_age_ms` gauge.
fn snapshot_ages(envoy: &Envoy) -> Vec<u64> {
    get(&format!(
        "http://127.0.0.1:{}/stats?filter=snapshot_age_ms$",
        envoy.admin
    ))
    .body
    .lines()
    .filter_map(|l| l.split_once(": "))
    .filter_map(|(_, v)| v.trim().parse().ok())
    .collect()
}

fn scrapes(envoy: &Envoy) -> f64 {
    envoy.stat("wasmcustom.kvroute.scrape.success")
        + envoy.stat("wasmcustom.kvroute.scrape.failure")
}

/// The two tests with a pool of 1024 run one at a time: each measures what
/// the other's 1024-pod simulator and Envoy would disturb.
static LARGE_POOL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn a_pool_of_1024_is_scraped_within_budget_and_every_snapshot_stays_fresh() {
    let _one_at_a_time = LARGE_POOL.lock().unwrap_or_else(|e| e.into_inner());
    let sim = Sim::start(1024, &["--no-latency", "--threads", "1"]);
    let envoy = Envoy::start(
        &sim.endpoints(),
        json!({ "debug_header": "x-kvroute-debug" }),
        2,
    );
    // The first round takes one period (228 ms at 4500 scrapes/s).
    std::thread::sleep(Duration::from_secs(2));
    let (s0, t0) = (scrapes(&envoy), Instant::now());
    let mut all = Vec::new();
    let mut samples = 0;
    while t0.elapsed() < Duration::from_secs(4) {
        let ages = snapshot_ages(&envoy);
        assert_eq!(ages.len(), 1024, "every endpoint has a snapshot");
        all.extend(ages);
        samples += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    let rate = (scrapes(&envoy) - s0) / t0.elapsed().as_secs_f64();
    all.sort_unstable();
    let (p99, worst) = (all[all.len() * 99 / 100], all[all.len() - 1]);
    eprintln!(
        "1024 endpoints: {rate:.0} scrapes/s, snapshot age p99 {p99} ms, max {worst} ms over {samples} samples"
    );
    // The old design (every endpoint every 50 ms) managed 600-2000 scrapes/s
    // here with snapshots 2-10 s old; the budget is 4500/s (period 228 ms).
    // The target (every snapshot under 500 ms) is the benchmark's
    // number on a quiet box; a shared CI box delays ticks now and then, so
    // the test holds p99 to it and the oldest to twice it.
    assert!((3200.0..=4950.0).contains(&rate), "{rate} scrapes/s");
    assert!(p99 < 500, "p99 snapshot age {p99} ms");
    assert!(worst < 1000, "a snapshot {worst} ms old");
    assert_eq!(envoy.stat("wasmcustom.kvroute.scrape.failure"), 0.0);
    // And it routes: a request lands on a pool member.
    let r = post_json(
        &envoy.url("/v1/completions"),
        &json!({"model": "m", "prompt": "fleet scale", "max_tokens": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let debug = r.header("x-kvroute-debug").unwrap_or_default().to_owned();
    assert!(debug.contains("reason="), "{debug}");
}

#[test]
fn a_pool_within_budget_keeps_the_50_ms_interval() {
    let sim = Sim::start(8, &["--no-latency"]);
    let envoy = Envoy::start(&sim.endpoints(), json!({}), 2);
    std::thread::sleep(Duration::from_millis(500));
    let before: Vec<f64> = (0..8).map(|i| sim.metrics_scrapes(i)).collect();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    let secs = t0.elapsed().as_secs_f64();
    for (i, b) in before.iter().enumerate() {
        let per_s = (sim.metrics_scrapes(i) - b) / secs;
        // 20/s at 50 ms; ticks jitter, and the box is shared
        assert!(
            (14.0..=22.0).contains(&per_s),
            "pod {i}: {per_s:.1} scrapes/s"
        );
    }
    let worst = snapshot_ages(&envoy).into_iter().max().unwrap();
    assert!(worst < 200, "a snapshot {worst} ms old");
}

/// The distinct endpoints named by `kvroute.endpoint.<ep>.*` stats.
fn endpoints_with_stats(envoy: &Envoy) -> std::collections::BTreeSet<String> {
    get(&format!(
        "http://127.0.0.1:{}/stats?filter=kvroute\\.endpoint\\.",
        envoy.admin
    ))
    .body
    .lines()
    .filter_map(|l| l.split_once("kvroute.endpoint.")?.1.split_once('.'))
    .map(|(ep, _)| ep.to_owned())
    .collect()
}

#[test]
fn per_endpoint_stats_are_bounded_by_the_config() {
    let sim = Sim::start(6, &["--no-latency"]);
    let run = |limit: usize| {
        let envoy = Envoy::start(&sim.endpoints(), json!({ "per_endpoint_stats": limit }), 2);
        for i in 0..24 {
            let prompt = format!("request {i} with a prompt of its own");
            let body = json!({"model": "m", "prompt": prompt, "max_tokens": 1});
            let r = post_json(&envoy.url("/v1/completions"), &body);
            assert_eq!(r.status, 200, "{}", r.body);
        }
        std::thread::sleep(Duration::from_millis(500));
        (
            endpoints_with_stats(&envoy),
            envoy.stat("wasmcustom.kvroute.endpoint_stats_dropped"),
            envoy.stat("wasmcustom.kvroute.routed"),
        )
    };
    // The default: every endpoint of a small pool has its stats.
    let (all, dropped, _) = run(1024);
    assert_eq!(all.len(), 6, "{all:?}");
    assert_eq!(dropped, 0.0);
    // One endpoint per VM (two workers and the main thread's): at most 3 of
    // the 6 named, whatever each VM saw first; routing is unaffected.
    let (some, dropped, routed) = run(1);
    assert!((1..=3).contains(&some.len()), "{some:?}");
    assert!(dropped > 0.0);
    assert_eq!(routed, 24.0);
    let (none, dropped, routed) = run(0);
    assert!(none.is_empty(), "{none:?}");
    assert!(dropped > 0.0);
    assert_eq!(routed, 24.0);
}

/// Envoy's RSS growth while `n` requests are routed and held open (their
/// pods answer only after 30 s): what a request in flight costs.
fn rss_growth_with_requests_in_flight(pods: usize, n: usize) -> f64 {
    use std::io::Write;
    let sim = Sim::start(pods, &["--no-latency", "--threads", "1"]);
    for i in 0..pods {
        sim.fault(i, json!({ "extra_latency_ms": 30_000 }));
    }
    // predicted_ttft: the profile whose decision was the largest.
    let envoy = Envoy::start(
        &sim.endpoints(),
        json!({ "scheduling": { "profile": "predicted_ttft" } }),
        1,
    );
    // Every pod scraped at least once.
    std::thread::sleep(Duration::from_secs(2));
    let open = |n: usize, tag: &str| -> Vec<std::net::TcpStream> {
        (0..n)
            .map(|i| {
                let body = json!({"model": "m", "prompt": format!("{tag} {i} held open"), "max_tokens": 1})
                    .to_string();
                let mut s = std::net::TcpStream::connect(("127.0.0.1", envoy.port)).unwrap();
                write!(
                    s,
                    "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                )
                .unwrap();
                s
            })
            .collect()
    };
    let routed = |want: f64| {
        let t0 = Instant::now();
        while envoy.stat("wasmcustom.kvroute.routed") < want {
            assert!(t0.elapsed() < Duration::from_secs(20), "not routed");
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    // A first batch grows the heap to what connections and streams need;
    // it is closed, then the measured batch opens as many again.
    drop(open(n, "warm"));
    routed(n as f64);
    std::thread::sleep(Duration::from_millis(500));
    let before = envoy.rss_bytes() as f64;
    let held = open(n, "held");
    routed(2.0 * n as f64);
    let after = envoy.rss_bytes() as f64;
    drop(held);
    after - before
}

#[test]
fn a_request_in_flight_costs_the_same_in_a_large_pool_as_in_a_small_one() {
    // The routed request's state is kept for its whole life (a stream can
    // last minutes). It used to keep the whole decision: every candidate's
    // score and, with predicted_ttft, prediction, ~140 bytes per endpoint,
    // so 300 requests held at 1024 endpoints cost ~40 MiB more than at 8,
    // in a linear memory that never shrinks. Now only the choice, its
    // fallbacks and its prediction are kept. What remains of the difference
    // is Envoy's own: 300 upstream hosts instead of 8 (2-4 MiB measured).
    let _one_at_a_time = LARGE_POOL.lock().unwrap_or_else(|e| e.into_inner());
    let n = 300;
    let small = rss_growth_with_requests_in_flight(8, n);
    let large = rss_growth_with_requests_in_flight(1024, n);
    eprintln!(
        "RSS growth with {n} requests in flight: 8 endpoints {:.1} MiB, 1024 endpoints {:.1} MiB",
        small / 1048576.0,
        large / 1048576.0
    );
    assert!(
        large - small < 10.0 * 1048576.0,
        "a request in flight grows with the pool: {:.1} vs {:.1} MiB",
        large / 1048576.0,
        small / 1048576.0
    );
}

#[test]
fn the_debug_header_stays_small_in_a_large_pool() {
    // It listed every candidate: at 1024 endpoints with predicted_ttft a
    // 128 KB header, which HTTP clients refuse (this one caps headers at
    // 64 KiB). It lists the chosen one and the best others.
    let _one_at_a_time = LARGE_POOL.lock().unwrap_or_else(|e| e.into_inner());
    let sim = Sim::start(1024, &["--no-latency", "--threads", "1"]);
    let envoy = Envoy::start(
        &sim.endpoints(),
        json!({ "debug_header": "x-kvroute-debug", "scheduling": {"profile": "predicted_ttft"} }),
        1,
    );
    std::thread::sleep(Duration::from_secs(1));
    let r = post_json(
        &envoy.url("/v1/completions"),
        &json!({"model": "m", "prompt": "fleet scale", "max_tokens": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let debug = r.header("x-kvroute-debug").unwrap_or_default().to_owned();
    let scores = debug.split("; scores=").nth(1).unwrap_or_default();
    let listed = scores
        .split(';')
        .next()
        .unwrap_or_default()
        .split(',')
        .count();
    assert_eq!(listed, 8, "{debug}");
    assert!(debug.len() < 4096, "{} bytes", debug.len());
}
