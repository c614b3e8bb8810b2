//! The two ways kvroute hands its choice to Envoy, and live discovery
//! (issue: deploy anywhere), through the real Envoy: `override_host` on a
//! cluster that knows its members (routing, fallback when the chosen pod
//! dies, no steering), and pool discovery from Envoy's own view of an EDS
//! cluster fed by a watched file.

mod support;

use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::*;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn chat(tag: &str, turn: usize) -> Value {
    conversation_turn(MODEL, tag, turn)
}

/// The endpoint kvroute chose, from the debug header ("" when kvroute had
/// no pool yet and let Envoy's fallback policy pick).
fn chosen(r: &Reply) -> String {
    r.header("x-kvroute-debug")
        .and_then(|d| d.split(';').next())
        .map(|e| e.trim_start_matches("endpoint=").to_string())
        .unwrap_or_default()
}

fn override_config() -> Value {
    json!({"handoff": "override_host", "debug_header": "x-kvroute-debug"})
}

#[test]
fn override_host_routes_with_affinity() {
    let sim = Sim::start(3, &["--time-scale", "0.01"]);
    let envoy = Envoy::start(&sim.endpoints(), override_config(), 2);
    for c in 0..6 {
        let tag = format!("conv{c}");
        let mut pods = Vec::new();
        for turn in 0..3 {
            let r = post_json(&envoy.url("/v1/chat/completions"), &chat(&tag, turn));
            assert_eq!(r.status, 200, "{}", r.body);
            assert_eq!(
                chosen(&r),
                sim.endpoint(r.pod().unwrap()),
                "Envoy did not honour the choice"
            );
            pods.push(r.pod().unwrap());
        }
        assert!(pods.iter().all(|p| *p == pods[0]), "{tag} split: {pods:?}");
    }
    let r = get(&envoy.url("/v1/models"));
    assert_eq!(r.status, 200);
}

/// The debug header's `reason=` ("" when absent).
fn reason(r: &Reply) -> String {
    r.header("x-kvroute-debug")
        .and_then(|d| d.split("; ").find_map(|p| p.strip_prefix("reason=")))
        .unwrap_or_default()
        .to_string()
}

#[test]
fn override_host_falls_back_when_the_chosen_pod_dies_and_the_next_turns_follow() {
    let sim = Sim::start(3, &["--time-scale", "0.01"]);
    // kvroute is told to trust its view for long, so the request really goes
    // to the dead pod first and only Envoy's retry can save it.
    let mut config = override_config();
    config["metrics"] = json!({"unhealthy_after_failures": 1000});
    let envoy = Envoy::start(&sim.endpoints(), config, 2);
    let url = envoy.url("/v1/chat/completions");
    let first = post_json(&url, &chat("victim", 0));
    assert_eq!(first.status, 200);
    let victim = first.pod().unwrap();
    sim.fault(victim, json!({"down_ms": 5000}));
    std::thread::sleep(Duration::from_millis(300)); // open connections closed
    let retries_before = envoy.stat("cluster.kvroute_upstream.upstream_rq_retry");
    let r = post_json(&url, &chat("victim", 1));
    assert_eq!(r.status, 200, "not rescued: {}", r.body);
    assert_eq!(
        chosen(&r),
        sim.endpoint(victim),
        "kvroute did not pick the dead pod first"
    );
    let rescuer = r.pod().unwrap();
    assert_ne!(rescuer, victim);
    assert!(envoy.stat("cluster.kvroute_upstream.upstream_rq_retry") > retries_before);
    // The fallback that answered now caches the conversation: the next
    // turns go there by their prefix, on either worker, not placed cold.
    assert_eq!(
        envoy.stat("wasmcustom.kvroute.failover.fallback_answered"),
        1.0
    );
    // The other worker learns that the victim did not answer at its next
    // tick (50 ms); until then it may still pick it (Envoy's retry then
    // rescues the request again) and the turn would not be a prefix pick.
    std::thread::sleep(Duration::from_millis(200));
    for turn in 2..4 {
        let r = post_json(&url, &chat("victim", turn));
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            (r.pod(), reason(&r).as_str()),
            (Some(rescuer), "Prefix"),
            "turn {turn} did not follow the fallback's cache: {:?}",
            r.header("x-kvroute-debug")
        );
    }
}

/// Streams to endpoints whose `/metrics` read as llama.cpp ask Envoy to
/// close the upstream connection after them (`llama-server` closes it
/// anyway, without saying so: `tests/real_engine.rs`); streams to other
/// engines, answers that do not stream, and every request with
/// `failover.close_after_stream: false` keep their connections.
#[test]
fn only_streams_to_llama_cpp_endpoints_close_their_connection() {
    for (engine, enabled, closes) in [
        ("llamacpp", true, true),
        ("llamacpp", false, false),
        ("vllm", true, false),
    ] {
        let sim = Sim::start(2, &["--time-scale", "0.01", "--engine", engine]);
        let mut config = override_config();
        config["failover"] = json!({"close_after_stream": enabled});
        let envoy = Envoy::start(&sim.endpoints(), config, 2);
        let start = Instant::now();
        while envoy.stat("wasmcustom.kvroute.scrape.success") < 4.0 {
            assert!(start.elapsed() < Duration::from_secs(10), "{}", envoy.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        let closed = || envoy.stat("wasmcustom.kvroute.failover.connection_close");
        for c in 0..6 {
            let mut body = chat(&format!("conv{c}"), 0);
            let stream = c % 3 != 0;
            body["stream"] = json!(stream);
            body["max_tokens"] = json!(4);
            let before = closed();
            let r = post_json(&envoy.url("/v1/chat/completions"), &body);
            assert_eq!(r.status, 200, "{}", r.body);
            let expected = f64::from(u8::from(closes && stream));
            assert_eq!(
                closed() - before,
                expected,
                "{engine} {enabled}: request {c}"
            );
        }
        // The close is the upstream connection's: the client's own
        // connection to Envoy stays open for its next streams.
        let before = closed();
        streams_on_one_connection(envoy.port, 3);
        assert_eq!(closed() - before, f64::from(u8::from(closes)) * 3.0);
    }
}

/// Sends `n` streamed chat requests one after another on one client
/// connection, each read to its last chunk; panics if Envoy closes it.
fn streams_on_one_connection(port: u16, n: usize) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for i in 0..n {
        let mut body = chat(&format!("kept{i}"), 0);
        body["stream"] = json!(true);
        body["max_tokens"] = json!(4);
        let body = serde_json::to_vec(&body).unwrap();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: kvroute\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(&body).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.ends_with(b"\r\n0\r\n\r\n") {
            let k = s.read(&mut buf).unwrap();
            assert!(
                k > 0,
                "Envoy closed the client's connection after {i} streams"
            );
            got.extend_from_slice(&buf[..k]);
        }
        let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
        assert!(text.starts_with("http/1.1 200"), "{text}");
        assert!(!text.contains("connection: close"), "{text}");
    }
}

#[test]
fn override_host_cannot_be_steered() {
    let sim = Sim::start(2, &["--time-scale", "0.01"]);
    let outsider = Sim::start(1, &["--time-scale", "0.01"]);
    let envoy = Envoy::start(&sim.endpoints(), override_config(), 1);
    let body = serde_json::to_string(&chat("steer", 0)).unwrap();
    for v in ["x-kvroute-destination", "X-KVRoute-Destination"] {
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: k\r\n{v}: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            outsider.endpoint(0),
            body.len()
        );
        assert!(raw_http(envoy.port, req.as_bytes()).contains(" 200 "));
    }
    assert_eq!(outsider.state(0)["requests_served"], 0);
}

/// Sends cold requests until `want(endpoint chosen)` holds; returns how long it took.
fn until_chosen(envoy: &Envoy, limit: Duration, want: impl Fn(&str) -> bool) -> Option<Duration> {
    let start = Instant::now();
    let mut i = 0;
    while start.elapsed() < limit {
        i += 1;
        let body = json!({"model": MODEL, "max_tokens": 2, "prompt": format!("probe {i} {}", "p".repeat(400))});
        let r = post_json(&envoy.url("/v1/completions"), &body);
        assert_eq!(r.status, 200, "{}", r.body);
        if want(&chosen(&r)) {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[test]
fn discovery_follows_eds_membership_within_a_second() {
    let sim = Sim::start(3, &["--time-scale", "0.01"]);
    let dir = TempDir::new("eds");
    let eds = dir.0.join("eds.json");
    write_eds(&eds, &[sim.endpoint(0), sim.endpoint(1)]);
    let config =
        json!({"handoff": "override_host", "discovery": {}, "debug_header": "x-kvroute-debug"});
    let envoy = Envoy::start_with(&[], config, 2, &["--eds-file", eds.to_str().unwrap()]);
    // Wait for the first discovery, then only members 0 and 1 are chosen.
    let first = until_chosen(&envoy, Duration::from_secs(5), |e| !e.is_empty());
    assert!(first.is_some(), "kvroute never chose an endpoint");
    for i in 0..12 {
        let r = post_json(
            &envoy.url("/v1/completions"),
            &json!({"model": MODEL, "max_tokens": 2, "prompt": format!("before {i} {}", "q".repeat(400))}),
        );
        assert_eq!(r.status, 200);
        assert_ne!(
            chosen(&r),
            sim.endpoint(2),
            "chose a pod not yet in the cluster"
        );
    }

    // Add pod 2: kvroute uses it within a second.
    write_eds(&eds, &[sim.endpoint(0), sim.endpoint(1), sim.endpoint(2)]);
    let added = until_chosen(&envoy, Duration::from_secs(3), |e| e == sim.endpoint(2));
    let added = added.expect("new member never chosen");
    assert!(
        added < Duration::from_secs(1),
        "new member used only after {added:?}"
    );

    // Remove pod 0: within a second kvroute stops choosing it.
    write_eds(&eds, &[sim.endpoint(1), sim.endpoint(2)]);
    std::thread::sleep(Duration::from_secs(1));
    for i in 0..20 {
        let r = post_json(
            &envoy.url("/v1/completions"),
            &json!({"model": MODEL, "max_tokens": 2, "prompt": format!("after {i} {}", "r".repeat(400))}),
        );
        assert_eq!(r.status, 200);
        assert_ne!(chosen(&r), sim.endpoint(0), "removed member still chosen");
        assert_ne!(r.pod(), Some(0));
    }
}
