//! Model pools under discovery (issue 15, "static or discovered"), through
//! the real Envoy and real `kvroute-sim` processes: the pool comes from an
//! EDS file (as Istio or any xDS control plane feeds it), `models` entries
//! name no endpoints, and each pod's own `GET /v1/models` says what it
//! serves. A model's requests land only on the pods listing it; a
//! configured model no live pod lists gets the gateway's 503 (with
//! `Retry-After`), and serves again as soon as a pod listing it joins; an
//! unknown model keeps the 404.
//!
//! Before this, a config with both `models` and `discovery` was refused at
//! load (Envoy does not start): the test fails there.

mod support;

use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::*;

fn chat(model: &str, text: &str) -> Value {
    json!({"model": model, "max_tokens": 4,
           "messages": [{"role": "user", "content": text}]})
}

/// The endpoint kvroute chose, from the debug header.
fn chosen(r: &Reply) -> String {
    r.header("x-kvroute-debug")
        .and_then(|d| d.split(';').next())
        .map(|e| e.trim_start_matches("endpoint=").to_string())
        .unwrap_or_default()
}

/// Sends `model` requests until one gets `status`; how long it took.
fn until_status(envoy: &Envoy, model: &str, status: u16, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut i = 0;
    while start.elapsed() < limit {
        i += 1;
        let r = post_json(
            &envoy.url("/v1/chat/completions"),
            &chat(model, &format!("probe {i}")),
        );
        if r.status == status {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// The gateway's own error: its status, `code` and `Retry-After`.
fn gateway_error(r: &Reply) -> (u16, String, Option<String>) {
    assert!(r.pod().is_none(), "answered by a pod: {r:?}");
    let e = kvroute_error(r);
    (
        r.status,
        e["code"].as_str().unwrap().to_string(),
        r.header("retry-after").map(str::to_string),
    )
}

#[test]
fn discovered_pods_serve_the_models_they_list() {
    let a = Sim::start(
        2,
        &[
            "--time-scale",
            "0.01",
            "--model",
            "model-a",
            "--lora-adapters",
            "model-a-sql",
        ],
    );
    let b = Sim::start(1, &["--time-scale", "0.01", "--model", "model-b"]);
    let mut c = Sim::start(1, &["--time-scale", "0.01", "--model", "model-c"]);
    let dir = TempDir::new("eds");
    let eds = dir.0.join("eds.json");
    let mut members = a.endpoints();
    members.extend(b.endpoints());
    write_eds(&eds, &members);
    let config = json!({
        "handoff": "override_host",
        "discovery": {},
        "debug_header": "x-kvroute-debug",
        "models": [
            {"name": "model-a", "adapters": ["model-a-*"]},
            {"name": "model-b"},
            {"name": "model-c"},
        ],
    });
    let envoy = Envoy::start_with(&[], config, 2, &["--eds-file", eds.to_str().unwrap()]);

    // Discovery, then each new member's list: model-a and model-b serve.
    for model in ["model-a", "model-b"] {
        let t = until_status(&envoy, model, 200, Duration::from_secs(10));
        assert!(t.is_some(), "{model} never served:\n{}", envoy.log());
    }
    // Every worker has read the lists by its next tick.
    std::thread::sleep(Duration::from_millis(200));

    // Each model's requests land only on the pods listing it, adapters
    // included; the same prompt for all, so prefix affinity cannot pull a
    // request across.
    let mut a_pods = Vec::new();
    for i in 0..36 {
        let (model, pods) = match i % 3 {
            0 => ("model-a", a.endpoints()),
            1 => ("model-a-sql", a.endpoints()),
            _ => ("model-b", b.endpoints()),
        };
        let r = post_json(
            &envoy.url("/v1/chat/completions"),
            &chat(model, &format!("shared prompt {}", i / 3)),
        );
        assert_eq!(r.status, 200, "{model}: {}", r.body);
        let e = chosen(&r);
        assert!(pods.contains(&e), "{model} went to {e}, not {pods:?}");
        if model == "model-b" {
            assert_eq!(r.json()["model"], "model-b");
        } else {
            a_pods.push(e);
        }
    }
    a_pods.sort();
    a_pods.dedup();
    assert_eq!(a_pods.len(), 2, "both model-a pods take work: {a_pods:?}");

    // Configured, but no pod lists it: 503 with Retry-After, from the
    // gateway. A name the family admits but no pod lists: the same.
    for model in ["model-c", "model-a-unknown-adapter"] {
        let r = post_json(&envoy.url("/v1/chat/completions"), &chat(model, "hi"));
        let (status, code, retry) = gateway_error(&r);
        assert_eq!(
            (status, code.as_str(), retry.as_deref()),
            (503, "model_unavailable", Some("1")),
            "{model}"
        );
    }
    // Not configured at all: still the 404.
    let r = post_json(&envoy.url("/v1/chat/completions"), &chat("model-z", "hi"));
    let (status, code, retry) = gateway_error(&r);
    assert_eq!(
        (status, code.as_str(), retry),
        (404, "model_not_found", None)
    );

    // GET /v1/models through the gateway answers from the config.
    let listed = get(&envoy.url("/v1/models"));
    assert_eq!(listed.status, 200, "{}", listed.body);
    assert!(listed.pod().is_none());
    let ids: Vec<String> = listed.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, ["model-a", "model-b", "model-c"]);

    // A pod serving model-c joins: model-c serves within about a
    // discovery interval and a tick, on that pod only.
    members.extend(c.endpoints());
    write_eds(&eds, &members);
    let t = until_status(&envoy, "model-c", 200, Duration::from_secs(5));
    let t = t.expect("model-c never served after its pod joined");
    assert!(
        t < Duration::from_secs(2),
        "model-c served only after {t:?}"
    );
    std::thread::sleep(Duration::from_millis(200));
    for i in 0..6 {
        let r = post_json(
            &envoy.url("/v1/chat/completions"),
            &chat("model-c", &format!("c {i}")),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(chosen(&r), c.endpoint(0));
        assert_eq!(r.json()["model"], "model-c");
    }

    // Its pod dies (still in EDS, as until the control plane notices): once
    // its scrapes fail, model-c is unavailable again, and the others serve on.
    c.kill();
    let t = until_status(&envoy, "model-c", 503, Duration::from_secs(5));
    assert!(t.is_some(), "model-c still routed to a dead pod");
    std::thread::sleep(Duration::from_millis(200));
    let r = post_json(&envoy.url("/v1/chat/completions"), &chat("model-c", "gone"));
    assert_eq!(gateway_error(&r).1, "model_unavailable");
    let r = post_json(&envoy.url("/v1/chat/completions"), &chat("model-a", "on"));
    assert_eq!(r.status, 200, "{}", r.body);

    // The pod comes back on the same address serving model-b instead (a
    // restart with another served name). Its old list must not outlive the
    // restart: model-c never reaches it, and it is listed again at once
    // (not at the next refresh, 5 s away), so model-b soon does.
    let c2 = Sim::start_at(
        c.base_port,
        1,
        &["--time-scale", "0.01", "--model", "model-b"],
    );
    let start = Instant::now();
    let mut reached = None;
    let mut i = 0;
    while start.elapsed() < Duration::from_secs(4) {
        i += 1;
        let r = post_json(
            &envoy.url("/v1/chat/completions"),
            &chat("model-c", &format!("after restart {i}")),
        );
        assert_eq!(
            gateway_error(&r).1,
            "model_unavailable",
            "model-c went to the restarted pod"
        );
        let r = post_json(
            &envoy.url("/v1/chat/completions"),
            &chat("model-b", &format!("after restart {i}")),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["model"], "model-b");
        if chosen(&r) == c2.endpoint(0) {
            reached = Some(start.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let reached = reached.expect("the restarted pod never got model-b");
    assert!(
        reached < Duration::from_secs(2),
        "listed again only after {reached:?}"
    );

    assert!(envoy.stat("wasmcustom.kvroute.models_list.read") >= 4.0);
    assert!(envoy.stat("wasmcustom.kvroute.model_unavailable") >= 3.0);
    assert_eq!(envoy.stat("wasmcustom.kvroute.model_not_found"), 1.0);
}
