//! The HTTP path through the real Envoy (issue: body-aware routing end to
//! end): body-based routing on both OpenAI paths, pass-through of everything
//! else, incremental SSE, large prompts, the steering hole closed, multiple
//! workers, and config errors that name the field.

mod support;

use serde_json::{json, Value};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use support::*;

fn debug_config() -> Value {
    json!({"debug_header": "x-kvroute-debug"})
}

fn chat(system: &str, user: &str) -> Value {
    json!({
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user}
        ]
    })
}

fn long_text(tag: &str, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 64);
    let mut i = 0;
    while s.len() < bytes {
        s.push_str(&format!(
            "{tag} sentence {i} about routing prompts to cached prefixes. "
        ));
        i += 1;
    }
    s
}

#[test]
fn routes_by_body_on_both_openai_paths() {
    let sim = Sim::start(2, &["--time-scale", "0.01"]);
    let envoy = Envoy::start(&sim.endpoints(), debug_config(), 1);

    // Two different long conversations: each sticks to one pod, and the
    // second (cold) one is spread to the other pod.
    let a = chat(&long_text("alpha", 8_000), "question one");
    let b = json!({
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "max_tokens": 4,
        "prompt": long_text("bravo", 8_000)
    });
    let mut pods_a = Vec::new();
    let mut pods_b = Vec::new();
    for _ in 0..3 {
        let r = post_json(&envoy.url("/v1/chat/completions"), &a);
        assert_eq!(r.status, 200, "{}", r.body);
        pods_a.push(r.pod().expect("answered by a pool pod"));
        let r = post_json(&envoy.url("/v1/completions"), &b);
        assert_eq!(r.status, 200, "{}", r.body);
        pods_b.push(r.pod().expect("answered by a pool pod"));
        let dbg = r
            .header("x-kvroute-debug")
            .expect("debug header")
            .to_string();
        assert!(dbg.contains("endpoint=127.0.0.1:"), "{dbg}");
    }
    assert!(
        pods_a.iter().all(|p| *p == pods_a[0]),
        "chat turns split: {pods_a:?}"
    );
    assert!(
        pods_b.iter().all(|p| *p == pods_b[0]),
        "completions split: {pods_b:?}"
    );
    assert_ne!(
        pods_a[0], pods_b[0],
        "two cold conversations landed on one pod"
    );

    // The repeats matched their whole prefix: the debug header says so.
    let r = post_json(&envoy.url("/v1/chat/completions"), &a);
    let dbg = r.header("x-kvroute-debug").unwrap();
    let matched = dbg
        .split("; ")
        .find_map(|kv| kv.strip_prefix("matched="))
        .and_then(|m| m.split_once('/'))
        .expect("matched=M/N in the debug header");
    assert!(matched.0 != "0" && matched.0 == matched.1, "{dbg}");
    assert!(envoy.stat("wasmcustom.kvroute.parsed") >= 7.0);
    assert!(envoy.stat("wasmcustom.kvroute.decision.prefix") >= 5.0);
}

#[test]
fn non_inference_and_unparsable_requests_still_pass() {
    let sim = Sim::start(2, &["--time-scale", "0.01"]);
    let envoy = Envoy::start(&sim.endpoints(), json!({}), 1);

    let r = get(&envoy.url("/v1/models"));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.pod().is_some());
    // Allowed (prefix rule `/v1/models/*`): reaches a pod, which answers.
    let r = get(&envoy.url("/v1/models/meta-llama/Llama-3.1-8B-Instruct"));
    assert!(r.pod().is_some(), "{} {}", r.status, r.body);
    // Off the default allow-list (tests/edge.rs has the path policy).
    let r = get(&envoy.url("/health"));
    assert_eq!(r.status, 404);
    assert!(r.pod().is_none());

    // Not JSON: still routed (the pod answers 400 itself).
    let r = post_raw(
        &envoy.url("/v1/completions"),
        "text/plain",
        b"hello".to_vec(),
        &[],
    );
    assert!(r.pod().is_some(), "not routed: {} {}", r.status, r.body);
    let r = post_raw(
        &envoy.url("/v1/chat/completions"),
        "application/json",
        b"{\"messages\": [".to_vec(),
        &[],
    );
    assert!(r.pod().is_some(), "not routed: {} {}", r.status, r.body);
    let r = post_raw(
        &envoy.url("/v1/chat/completions"),
        "application/json",
        vec![0xff, 0xfe, b'{'],
        &[],
    );
    assert!(r.pod().is_some(), "not routed: {} {}", r.status, r.body);
    assert!(envoy.stat("wasmcustom.kvroute.unparsed") >= 3.0);
    assert!(envoy.stat("wasmcustom.kvroute.passthrough") >= 2.0);
}

#[test]
fn sse_stream_reaches_the_client_incrementally() {
    let sim = Sim::start(1, &["--time-scale", "1"]);
    let envoy = Envoy::start(&sim.endpoints(), json!({}), 1);
    let body = json!({
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "max_tokens": 40,
        "stream": true,
        "messages": [{"role": "user", "content": "count slowly"}]
    });
    let (times, events) = sse_events(envoy.port, "/v1/chat/completions", &body);
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert!(events.len() >= 10, "{} events", events.len());
    let first = times[0];
    let last = *times.last().unwrap();
    // Buffered responses arrive all at once; streamed ones spread out.
    assert!(
        last - first >= Duration::from_millis(150),
        "first {first:?} last {last:?}"
    );
    assert!(
        first < last / 2,
        "first chunk only at {first:?} of {last:?}"
    );
}

#[test]
fn one_mib_prompt_routes() {
    let sim = Sim::start(2, &["--time-scale", "0.001"]);
    let envoy = Envoy::start(&sim.endpoints(), debug_config(), 1);
    let body = chat("You are helpful.", &long_text("mega", 1 << 20));
    assert!(serde_json::to_vec(&body).unwrap().len() > 1 << 20);
    let r = post_json(&envoy.url("/v1/chat/completions"), &body);
    assert_eq!(r.status, 200, "{}", &r.body[..r.body.len().min(300)]);
    let dbg = r.header("x-kvroute-debug").unwrap();
    assert!(dbg.contains("/4096") || dbg.contains("matched=0/"), "{dbg}");
    assert_eq!(envoy.stat("wasmcustom.kvroute.parsed"), 1.0);
}

#[test]
fn body_over_max_body_bytes_is_routed_by_load() {
    let sim = Sim::start(2, &["--time-scale", "0.001"]);
    // Over max_body_bytes, within Envoy's buffer (2 x 64 KiB + 64 KiB).
    let envoy = Envoy::start(&sim.endpoints(), json!({"max_body_bytes": 65536}), 1);
    let r = post_json(
        &envoy.url("/v1/chat/completions"),
        &chat("s", &long_text("big", 180_000)),
    );
    assert_eq!(r.status, 200, "{}", &r.body[..r.body.len().min(300)]);
    assert_eq!(envoy.stat("wasmcustom.kvroute.body_too_large"), 1.0);
}

/// A listener outside the pool that counts every connection made to it.
fn trap() -> (u16, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            h.fetch_add(1, Ordering::SeqCst);
            drop(s);
        }
    });
    (port, hits)
}

#[test]
fn client_cannot_steer_to_a_host_outside_the_pool() {
    let sim = Sim::start(2, &["--time-scale", "0.01"]);
    let (evil, hits) = trap();
    let envoy = Envoy::start(&sim.endpoints(), json!({}), 2);
    let dest = format!("127.0.0.1:{evil}");
    let body = serde_json::to_string(&chat("sys", "hi")).unwrap();
    let variants = [
        format!("x-kvroute-destination: {dest}\r\n"),
        format!("X-KVRoute-Destination: {dest}\r\n"),
        format!("X-KVROUTE-DESTINATION: {dest}\r\n"),
        format!("x-kvroute-destination: {dest}\r\nX-Kvroute-Destination: {dest}\r\n"),
        format!("x-kvroute-destination: {dest},{dest}\r\n"),
        format!(
            "x-kvroute-destination: {}\r\nx-kvroute-destination: {dest}\r\n",
            sim.endpoint(0)
        ),
    ];
    let mut answered = 0;
    for v in &variants {
        for (method, path, ctype, payload) in [
            (
                "POST",
                "/v1/chat/completions",
                "application/json",
                body.as_str(),
            ),
            ("POST", "/v1/completions", "text/plain", "not json"),
            ("GET", "/v1/models", "text/plain", ""),
        ] {
            let req = format!(
                "{method} {path} HTTP/1.1\r\nhost: kvroute\r\n{v}content-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{payload}",
                payload.len()
            );
            let resp = raw_http(envoy.port, req.as_bytes());
            assert!(
                resp.to_ascii_lowercase().contains("x-kvroute-sim-pod:"),
                "not answered by a pool pod:\n{resp}"
            );
            answered += 1;
        }
    }
    assert_eq!(answered, 18);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "Envoy connected to the client-chosen host"
    );
    assert!(envoy.stat("wasmcustom.kvroute.steering_header_removed") >= 18.0);
}

/// A header value that is not UTF-8 (obs-text, which Envoy passes on) in
/// the destination header, or in any header, neither steers nor kills the
/// VM: kvroute reads headers as bytes (the SDK's string reads panicked on
/// such a value, and the VM failed closed for every later request).
#[test]
fn a_non_utf8_header_value_neither_steers_nor_kills_the_vm() {
    let sim = Sim::start(2, &["--time-scale", "0.01"]);
    let (evil, hits) = trap();
    let envoy = Envoy::start(&sim.endpoints(), json!({}), 1);
    let body = serde_json::to_string(&chat("sys", "hi")).unwrap();
    // 0xff and 0xe9 are obs-text: not UTF-8 on their own.
    let mut steer = b"x-kvroute-destination: ".to_vec();
    steer.push(0xff);
    steer.extend(format!("127.0.0.1:{evil}\r\n").as_bytes());
    let mut other = b"x-other: caf".to_vec();
    other.extend([0xe9, b'\r', b'\n']);
    for header in [steer, other] {
        for _ in 0..3 {
            let mut req = b"POST /v1/chat/completions HTTP/1.1\r\nhost: kvroute\r\n".to_vec();
            req.extend(&header);
            req.extend(
                format!(
                    "content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            );
            let resp = raw_http(envoy.port, &req);
            assert!(
                resp.to_ascii_lowercase().contains("x-kvroute-sim-pod:"),
                "not answered by a pool pod:\n{resp}"
            );
        }
    }
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "Envoy connected to the client-chosen host"
    );
    assert!(!envoy.log().contains("panicked"), "{}", envoy.log());
}

#[test]
fn two_workers_route_and_stick() {
    let sim = Sim::start(2, &["--time-scale", "0.01"]);
    let envoy = Envoy::start(&sim.endpoints(), json!({}), 2);
    for c in 0..4 {
        let system = long_text(&format!("conversation{c}"), 4_000);
        let mut pods = Vec::new();
        for turn in 0..4 {
            let r = post_json(
                &envoy.url("/v1/chat/completions"),
                &chat(&system, &format!("turn {turn}")),
            );
            assert_eq!(r.status, 200, "{}", r.body);
            pods.push(r.pod().unwrap());
        }
        assert!(
            pods.iter().all(|p| *p == pods[0]),
            "conversation {c} split: {pods:?}"
        );
    }
}

#[test]
fn invalid_config_is_refused_naming_the_field() {
    let sim = Sim::start(1, &[]);
    let err = Envoy::try_start(
        &sim.endpoints(),
        json!({"metrics": {"scrape_interval_ms": 1}}),
        1,
    )
    .err()
    .expect("Envoy accepted an invalid kvroute config");
    assert!(
        err.contains("metrics.scrape_interval_ms"),
        "log does not name the field:\n{err}"
    );
    let err = Envoy::try_start(&sim.endpoints(), json!({"no_such_knob": true}), 1)
        .err()
        .expect("Envoy accepted an unknown field");
    assert!(
        err.contains("no_such_knob"),
        "log does not name the field:\n{err}"
    );
}
