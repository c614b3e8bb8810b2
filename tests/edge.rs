//! The gateway's edge (issue: hostile input), through the real Envoy and
//! real simulator pods: only the inference API reaches the pool (blocked
//! paths and path tricks get a JSON 404/400 and never reach a pod), every
//! error the gateway generates is an OpenAI-style JSON error (503 with
//! `Retry-After` when no endpoint can serve, 413, ...) while a model
//! server's own error passes untouched, and HTTP/2 requests, also those
//! that end with trailers, are routed exactly like HTTP/1 ones.

#[path = "support/h2c.rs"]
mod h2c;
mod support;

use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;
use support::*;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn chat(tag: &str, turn: usize) -> Value {
    conversation_turn(MODEL, tag, turn)
}

/// Status, headers and body of a raw HTTP/1.1 response.
fn parse_raw(resp: &str) -> Reply {
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((resp, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Reply {
        status,
        headers,
        body: body.to_string(),
    }
}

/// `method path` sent byte for byte (no client-side normalization).
fn raw_request(port: u16, method: &str, path: &str, body: &str) -> Reply {
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    parse_raw(&raw_http(port, req.as_bytes()))
}

/// Asserts an OpenAI-style JSON error (`{"error":{message,type,param,code}}`)
/// and returns its `code`.
fn json_error(r: &Reply) -> String {
    assert_eq!(
        r.header("content-type"),
        Some("application/json"),
        "not JSON: {} {:?} {}",
        r.status,
        r.headers,
        r.body
    );
    let v = r.json();
    let e = v["error"]
        .as_object()
        .unwrap_or_else(|| panic!("no error object: {}", r.body));
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].as_str().is_some(), "{v}");
    assert!(e.contains_key("param") && e["param"].is_null(), "{v}");
    e["code"].as_str().unwrap_or_default().to_string()
}

/// (endpoint, reason, matched) from the debug header.
fn decision(r: &Reply) -> (String, String, String) {
    let d = r
        .header("x-kvroute-debug")
        .unwrap_or_else(|| panic!("no debug header: {} {}", r.status, r.body));
    let field = |name: &str| {
        d.split("; ")
            .find_map(|kv| kv.strip_prefix(name))
            .unwrap_or_default()
            .to_string()
    };
    (field("endpoint="), field("reason="), field("matched="))
}

#[test]
fn blocked_paths_get_json_404_and_never_reach_a_pod() {
    let sim = Sim::start(1, &["--time-scale", "0.01"]);
    let envoy = Envoy::start(&sim.endpoints(), json!({}), 1);
    let fault = r#"{"error_rate":1}"#;
    let mut blocked = 0.0;
    // Plain non-inference paths, then tricks that a lax matcher or server
    // would turn into /sim/fault.
    for (method, path) in [
        ("POST", "/sim/fault"),
        ("GET", "/sim/state"),
        ("POST", "/reset_prefix_cache"),
        ("GET", "/metrics"),
        ("GET", "/health"),
        ("POST", "/sim/fault?next=/v1/models"),
        ("POST", "/v1/models/../../sim/fault"),
        ("POST", "/v1/models/%2e%2e/%2e%2e/sim/fault"),
        ("POST", "/v1/models/%2E%2E/%2E%2E/sim/fault"),
        ("POST", "/v1/models/..%2F..%2Fsim%2Ffault"),
        ("POST", "/v1/models/..%5C..%5Csim%5Cfault"),
        ("POST", "/v1/models/%252e%252e/%252e%252e/sim/fault"),
        ("POST", "/v1/models/..;/..;/sim/fault"),
        ("POST", "//sim/fault"),
        ("POST", "/v1//../sim/fault"),
        ("POST", "/SIM/FAULT"),
        ("POST", "/Sim/fault"),
        ("POST", "/v1/chat/completions/../../sim/fault"),
    ] {
        let r = raw_request(envoy.port, method, path, fault);
        assert!(
            r.status == 404 || r.status == 400,
            "{method} {path}: {} {}",
            r.status,
            r.body
        );
        assert_eq!(r.pod(), None, "{method} {path} reached a pod: {}", r.body);
        let code = json_error(&r);
        if r.status == 404 {
            // kvroute's own reply, not rewritten by Envoy's mappers.
            assert_eq!(code, "path_not_allowed", "{method} {path}");
            assert_eq!(r.header("retry-after"), None);
            blocked += 1.0;
        }
    }
    // Checked on the pod itself: no fault was set through the gateway.
    let state = sim.state(0);
    assert_eq!(state["faults"]["error_rate"], 0.0, "{state}");
    assert!(blocked >= 12.0, "only {blocked} answered by kvroute");
    assert!(envoy.stat("wasmcustom.kvroute.path_blocked") >= blocked);

    // The inference API still works.
    let r = get(&envoy.url("/v1/models"));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.pod(), Some(0));
    let r = post_json(&envoy.url("/v1/chat/completions?x=1"), &chat("ok", 0));
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn configured_paths_pass_and_replace_the_default_list() {
    let sim = Sim::start(1, &["--time-scale", "0.01"]);
    let config =
        json!({"allowed_paths": ["/v1/chat/completions", "/v1/models", "/health", "/sim/*"]});
    let envoy = Envoy::start(&sim.endpoints(), config, 1);
    let r = get(&envoy.url("/health"));
    assert_eq!((r.status, r.pod()), (200, Some(0)), "{}", r.body);
    let r = get(&envoy.url("/sim/state"));
    assert_eq!((r.status, r.pod()), (200, Some(0)), "{}", r.body);
    let r = get(&envoy.url("/v1/models"));
    assert_eq!((r.status, r.pod()), (200, Some(0)), "{}", r.body);
    let r = post_json(&envoy.url("/v1/chat/completions"), &chat("ok", 0));
    assert_eq!(r.status, 200, "{}", r.body);
    // Not in this list any more.
    let r = post_json(
        &envoy.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": "x"}),
    );
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(json_error(&r), "path_not_allowed");
    assert_eq!(r.pod(), None);
    // A prefix rule still refuses tricks below it.
    let r = raw_request(envoy.port, "GET", "/sim/../metrics", "");
    assert_eq!(r.pod(), None, "{}", r.body);
}

fn all_pods_down(handoff: &str) {
    let sim = Sim::start(2, &["--time-scale", "0.01"]);
    let envoy = Envoy::start(&sim.endpoints(), json!({"handoff": handoff}), 1);
    let r = post_json(&envoy.url("/v1/chat/completions"), &chat("up", 0));
    assert_eq!(r.status, 200, "{}", r.body);
    for i in 0..2 {
        sim.fault(i, json!({"down": true}));
    }
    std::thread::sleep(Duration::from_millis(300)); // open connections closed
    for (what, r) in [
        (
            "chat",
            post_json(&envoy.url("/v1/chat/completions"), &chat("down", 0)),
        ),
        ("models", get(&envoy.url("/v1/models"))),
    ] {
        assert_eq!(r.status, 503, "{handoff} {what}: {}", r.body);
        assert_eq!(json_error(&r), "upstream_unavailable", "{handoff} {what}");
        assert_eq!(r.header("retry-after"), Some("1"), "{handoff} {what}");
    }
}

#[test]
fn all_pods_down_gives_json_503_with_retry_after_original_dst() {
    all_pods_down("original_dst");
}

#[test]
fn all_pods_down_gives_json_503_with_retry_after_override_host() {
    all_pods_down("override_host");
}

fn write_empty_eds(path: &Path) {
    let doc = json!({"resources": [{
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        "cluster_name": "kvroute_upstream",
        "endpoints": []
    }]});
    std::fs::write(path, serde_json::to_vec(&doc).unwrap()).unwrap();
}

#[test]
fn empty_pool_gives_json_503_with_retry_after() {
    let dir = TempDir::new("eds-empty");
    let eds = dir.0.join("eds.json");
    write_empty_eds(&eds);
    let config = json!({"handoff": "override_host", "discovery": {}});
    let envoy = Envoy::start_with(&[], config, 1, &["--eds-file", eds.to_str().unwrap()]);
    let r = post_json(&envoy.url("/v1/chat/completions"), &chat("nobody", 0));
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(json_error(&r), "upstream_unavailable");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(envoy.stat("wasmcustom.kvroute.no_endpoint") >= 1.0);
}

#[test]
fn body_too_large_for_envoys_buffer_gives_json_413() {
    let sim = Sim::start(1, &["--time-scale", "0.01"]);
    // A 64 KiB gateway buffer (Istio's EDGE profile is 32 KiB) under the
    // default max_body_bytes (8 MiB): kvroute holds the body, Envoy's
    // buffer overflows first.
    let envoy = Envoy::start_with(&sim.endpoints(), json!({}), 1, &["--buffer-limit", "65536"]);
    let big = json!({"model": MODEL, "max_tokens": 2, "prompt": "x".repeat(256 << 10)});
    let r = post_json(&envoy.url("/v1/completions"), &big);
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(json_error(&r), "request_too_large");
    let r = post_json(&envoy.url("/v1/chat/completions"), &chat("small", 0));
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn an_upstream_error_body_passes_untouched() {
    let sim = Sim::start(1, &["--time-scale", "0.01"]);
    // Passive health off: every request reaches the failing pod.
    let config = json!({"outlier_detection": {"consecutive_errors": 0}});
    let envoy = Envoy::start(&sim.endpoints(), config, 1);
    sim.fault(0, json!({"error_rate": 1.0}));
    let body = chat("fails", 0);
    let direct = post_json(&sim.url(0, "/v1/chat/completions"), &body);
    let through = post_json(&envoy.url("/v1/chat/completions"), &body);
    assert_eq!(direct.status, 500, "{}", direct.body);
    assert_eq!(through.status, 500, "{}", through.body);
    assert_eq!(through.pod(), Some(0));
    assert_eq!(through.body, direct.body);
    assert_eq!(
        through.header("content-type"),
        direct.header("content-type")
    );
    assert_eq!(through.header("retry-after"), None);
}

#[test]
fn http2_and_trailers_route_like_http1_original_dst() {
    parity("original_dst");
}

#[test]
fn http2_and_trailers_route_like_http1_override_host() {
    parity("override_host");
}

fn parity(handoff: &str) {
    let sim = Sim::start(3, &["--time-scale", "0.01"]);
    let config = json!({"debug_header": "x-kvroute-debug", "handoff": handoff});
    let envoy = Envoy::start(&sim.endpoints(), config, 2);
    let path = "/v1/chat/completions";
    for c in 0..4 {
        let tag = format!("conv{c}");
        // Turn 0 over HTTP/2 with trailers: routed (not 503), by its body.
        let t0 = serde_json::to_vec(&chat(&tag, 0)).unwrap();
        let first = h2c::post(envoy.port, path, &t0, true);
        assert_eq!(first.status, 200, "{tag}: {}", first.body);
        let (endpoint, _, _) = decision(&first);
        assert_eq!(endpoint, sim.endpoint(first.pod().unwrap()), "{tag}");

        // Turn 1 over HTTP/1.1 learns it; then the same body over h2,
        // h2 + trailers and h1 again: same endpoint, same decision.
        let t1 = chat(&tag, 1);
        let t1_bytes = serde_json::to_vec(&t1).unwrap();
        let r = post_json(&envoy.url(path), &t1);
        assert_eq!(r.status, 200, "{}", r.body);
        let (e, reason, _) = decision(&r);
        assert_eq!(
            (e.as_str(), reason.as_str()),
            (endpoint.as_str(), "Prefix"),
            "{tag} h1"
        );
        let replies = [
            ("h2", h2c::post(envoy.port, path, &t1_bytes, false)),
            ("h2+trailers", h2c::post(envoy.port, path, &t1_bytes, true)),
            ("h1", post_json(&envoy.url(path), &t1)),
        ];
        let want = decision(&replies[2].1);
        for (proto, r) in &replies {
            assert_eq!(r.status, 200, "{tag} {proto}: {}", r.body);
            assert_eq!(r.pod().map(|p| sim.endpoint(p)), Some(endpoint.clone()));
            let d = decision(r);
            assert_eq!(d, want, "{tag} {proto}");
            assert_eq!(d.1, "Prefix", "{tag} {proto}");
            let (m, n) = d.2.split_once('/').unwrap();
            assert!(m == n && m != "0", "{tag} {proto}: matched {}", d.2);
        }
    }
    // 4 conversations x 5 requests, every body understood.
    assert_eq!(envoy.stat("wasmcustom.kvroute.parsed"), 20.0);
}
