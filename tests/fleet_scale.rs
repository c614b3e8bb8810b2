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

#[test]
fn a_pool_of_1024_is_scraped_within_budget_and_every_snapshot_stays_fresh() {
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
