//! Clients that go away: a user presses "stop" while the engine is still
//! prefilling, or in the middle of the answer, and the client closes its
//! connection. Envoy resets the upstream request; kvroute must stop counting
//! that work. Leaked in-flight requests would read as load (new prompts
//! steered away from the pod for good) and, never answered, as a stalled pod
//! (`failover.stall_after_ms`) taken out of the pool.
//!
//! Through the real Envoy and a real `kvroute-sim`, with the connections
//! closed by the client mid-request.

mod support;

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};
use support::*;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// A streaming completion request with a prompt no pod has seen, sent on a
/// connection of its own; the caller decides when to close it.
fn open_stream(port: u16, n: usize, max_tokens: u32) -> TcpStream {
    let body: Value = json!({
        "model": MODEL,
        "prompt": format!("cancelled request {n} {}", "lorem ipsum dolor ".repeat(40)),
        "max_tokens": max_tokens,
        "stream": true,
    });
    let payload = serde_json::to_vec(&body).unwrap();
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        payload.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(&payload).unwrap();
    s
}

/// Reads `s` until its first SSE event (the first token has arrived).
fn read_first_event(s: &TcpStream) {
    let mut reader = BufReader::new(s);
    let mut line = String::new();
    while reader.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
        if line.starts_with("data: ") {
            return;
        }
        line.clear();
    }
    panic!("the stream ended before its first event");
}

/// kvroute's in-flight requests per pod, as its gauges show them.
fn inflight(envoy: &Envoy, sim: &Sim) -> Vec<f64> {
    (0..2)
        .map(|i| {
            let label = sim.endpoint(i).replace(['.', ':'], "_");
            envoy.stat(&format!(
                "wasmcustom.kvroute.endpoint.{label}.inflight_requests"
            ))
        })
        .collect()
}

/// Waits until `done` holds of the in-flight gauges, for at most `within`;
/// returns how long it took.
fn wait_for(
    envoy: &Envoy,
    sim: &Sim,
    within: Duration,
    what: &str,
    done: impl Fn(&[f64]) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        let now = inflight(envoy, sim);
        if done(&now) {
            return start.elapsed();
        }
        assert!(start.elapsed() < within, "{what}: in flight {now:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// After the cancellations both pods still serve new prompts, and neither
/// was taken for stalled (a leaked request waits for a first byte that
/// never comes).
fn assert_pool_serves(envoy: &Envoy) {
    let mut per_pod = [0; 2];
    for n in 0..8 {
        let r = post_json(
            &envoy.url("/v1/completions"),
            &json!({"model": MODEL, "max_tokens": 2,
                    "prompt": format!("after the cancellations {n} {}", "sit amet ".repeat(40))}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        per_pod[r.pod().expect("the sim names its pod")] += 1;
    }
    assert!(per_pod.iter().all(|&n| n >= 2), "per pod {per_pod:?}");
    assert_eq!(envoy.stat("wasmcustom.kvroute.failover.stalled"), 0.0);
}

#[test]
fn requests_cancelled_before_their_first_token_stop_counting_as_load() {
    let sim = Sim::start(2, &["--time-scale", "1"]);
    let envoy = Envoy::start(&sim.endpoints(), json!({}), 2);
    // Each request waits 4 s in the pod before its prefill starts: the
    // client gives up long before its first token.
    for i in 0..2 {
        sim.fault(i, json!({"extra_latency_ms": 4000}));
    }
    let streams: Vec<TcpStream> = (0..8).map(|n| open_stream(envoy.port, n, 16)).collect();
    // Counted while they wait (the gauges are written once a tick).
    wait_for(
        &envoy,
        &sim,
        Duration::from_secs(2),
        "the waiting requests were never counted",
        |now| now.iter().sum::<f64>() == 8.0,
    );
    drop(streams);
    // Released at the cancellation, well before the pods would have
    // answered (4 s after each request came in).
    let took = wait_for(
        &envoy,
        &sim,
        Duration::from_millis(2000),
        "cancelled requests still counted",
        |now| now.iter().all(|&x| x == 0.0),
    );
    println!("released {took:?} after the clients closed");
    for i in 0..2 {
        sim.fault(i, json!({"extra_latency_ms": 0}));
    }
    assert_pool_serves(&envoy);
}

#[test]
fn streams_cancelled_mid_answer_stop_counting_as_load() {
    // Real time: a 4000-token answer streams for tens of seconds.
    let sim = Sim::start(2, &["--time-scale", "1"]);
    let envoy = Envoy::start(&sim.endpoints(), json!({}), 2);
    let streams: Vec<TcpStream> = (0..6)
        .map(|n| open_stream(envoy.port, 100 + n, 4000))
        .collect();
    for s in &streams {
        read_first_event(s);
    }
    wait_for(
        &envoy,
        &sim,
        Duration::from_secs(2),
        "the streams were never counted",
        |now| now.iter().sum::<f64>() == 6.0,
    );
    drop(streams);
    wait_for(
        &envoy,
        &sim,
        Duration::from_secs(2),
        "cancelled streams still counted",
        |now| now.iter().all(|&x| x == 0.0),
    );
    assert_pool_serves(&envoy);
}
