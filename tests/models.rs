//! Several models behind one gateway (issue 15), through the real Envoy and
//! real `kvroute-sim` processes: model-aware pools (a request only reaches
//! the endpoints serving its model; unknown models get the gateway's 404;
//! `GET /v1/models` lists what the pools serve), and objectives with load
//! shedding (a sheddable request gets 429 when every endpoint of its model
//! is saturated, while priority >= 0 keeps flowing).
//!
//! The simulator answers every request with its own `--model`, so the
//! response's `model` says which pool served it.

mod support;

use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::*;

const OBJECTIVE: &str = "x-gateway-inference-objective";

fn chat(model: &str, text: &str) -> Value {
    json!({"model": model, "max_tokens": 4,
           "messages": [{"role": "user", "content": text}]})
}

fn post(envoy: &Envoy, body: &Value, headers: &[(&str, &str)]) -> Reply {
    post_raw(
        &envoy.url("/v1/chat/completions"),
        "application/json",
        serde_json::to_vec(body).unwrap(),
        headers,
    )
}

/// An OpenAI error body: its `code`, after checking the shape.
fn error_code(r: &Reply) -> String {
    let e = kvroute_error(r);
    assert!(e["param"].is_null());
    assert!(e["type"].is_string());
    e["code"].as_str().unwrap().to_string()
}

fn two_model_gateway() -> (Sim, Sim, Envoy) {
    let a = Sim::start(2, &["--time-scale", "0.01", "--model", "model-a"]);
    let b = Sim::start(2, &["--time-scale", "0.01", "--model", "model-b"]);
    let mut endpoints = a.endpoints();
    endpoints.extend(b.endpoints());
    let config = json!({
        "models": [
            {"name": "model-a", "endpoints": a.endpoints(), "adapters": ["model-a-sql"]},
            {"name": "model-b*", "endpoints": b.endpoints()},
        ],
    });
    let envoy = Envoy::start(&endpoints, config, 2);
    (a, b, envoy)
}

#[test]
fn two_models_on_disjoint_pools_never_cross() {
    let (_a, _b, envoy) = two_model_gateway();
    let mut served = Vec::new();
    for i in 0..40 {
        // The same prompt for both models: prefix affinity must not pull a
        // request to the other model's pod.
        let (asked, want) = match i % 3 {
            0 => ("model-a", "model-a"),
            1 => ("model-a-sql", "model-a"),
            _ => ("model-b-chat", "model-b"),
        };
        let r = post(
            &envoy,
            &chat(asked, &format!("shared prompt {}", i / 3)),
            &[],
        );
        assert_eq!(r.status, 200, "{asked}: {}", r.body);
        assert_eq!(r.json()["model"], want, "{asked} served by the wrong pool");
        served.push((want, r.pod().unwrap()));
    }
    // Both pods of each model take work (the pools are not shrunk to one).
    for asked in ["model-a", "model-b"] {
        let mut pods: Vec<usize> = served
            .iter()
            .filter(|(m, _)| *m == asked)
            .map(|(_, p)| *p)
            .collect();
        pods.sort();
        pods.dedup();
        assert_eq!(pods.len(), 2, "{asked}: {pods:?}");
    }
    // Completions are scoped the same way.
    let r = post_json(
        &envoy.url("/v1/completions"),
        &json!({"model": "model-b-base", "prompt": "hello", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["model"], "model-b");
    assert!(envoy.stat("wasmcustom.kvroute.model_not_found") == 0.0);
}

#[test]
fn unknown_or_missing_model_gets_the_gateways_404() {
    let (_a, _b, envoy) = two_model_gateway();
    for body in [
        chat("model-c", "hi"),
        chat("MODEL-A", "hi"),
        chat(&"model-x".repeat(5000), "hi"),
        json!({"max_tokens": 4, "messages": [{"role": "user", "content": "no model"}]}),
    ] {
        let r = post(&envoy, &body, &[]);
        assert_eq!(r.status, 404, "{}", r.body);
        assert_eq!(error_code(&r), "model_not_found");
        assert_eq!(r.json()["error"]["type"], "invalid_request_error");
        assert!(r.pod().is_none(), "answered by a pod");
    }
    // Unreadable as a chat body, but its model is readable: scoped, and
    // unknown.
    let r = post(
        &envoy,
        &json!({"model": "model-c", "messages": "not a list"}),
        &[],
    );
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(error_code(&r), "model_not_found");
    assert!(envoy.stat("wasmcustom.kvroute.model_not_found") >= 5.0);
}

#[test]
fn models_are_listed_by_the_gateway() {
    let (_a, _b, envoy) = two_model_gateway();
    let r = get(&envoy.url("/v1/models"));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert!(r.pod().is_none(), "answered by a pod");
    let v = r.json();
    assert_eq!(v["object"], "list");
    let listed: Vec<(String, Value)> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap().to_string(), m["parent"].clone()))
        .collect();
    assert_eq!(
        listed,
        [
            ("model-a".to_string(), Value::Null),
            ("model-a-sql".to_string(), json!("model-a")),
        ],
        "the `model-b*` family is not a listable id"
    );
    let one = get(&envoy.url("/v1/models/model-a-sql"));
    assert_eq!(one.status, 200, "{}", one.body);
    assert_eq!(one.json()["id"], "model-a-sql");
    let none = get(&envoy.url("/v1/models/model-c"));
    assert_eq!(none.status, 404);
    assert_eq!(error_code(&none), "model_not_found");
}

/// Sends a `model-a` request with `objective` until it gets `want` or
/// `timeout` passes; the last reply.
fn until_status(envoy: &Envoy, objective: &str, want: u16, timeout: Duration) -> Reply {
    let start = Instant::now();
    loop {
        let r = post(envoy, &chat("model-a", "poll"), &[(OBJECTIVE, objective)]);
        if r.status == want || start.elapsed() > timeout {
            return r;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until a `model-a` batch request is shed, then until every worker
/// has read the scrape that saturated the pool (one saw it; the others read
/// it on their next tick).
fn wait_until_shed(envoy: &Envoy) {
    let shed = until_status(envoy, "batch", 429, Duration::from_secs(5));
    assert_eq!(shed.status, 429, "model-a never shed: {}", shed.body);
    std::thread::sleep(Duration::from_millis(200));
}

/// The shedding gateway: `model-a` on two pods, objectives `batch` (-1,
/// sheddable) and `chat` (5).
/// Waits until every endpoint has been scraped: before its first scrape an
/// endpoint's load is unknown, so it counts as saturated.
fn shedding_gateway(extra_model: Option<&Sim>) -> (Sim, Envoy) {
    let a = Sim::start(2, &["--time-scale", "0.01", "--model", "model-a"]);
    let mut endpoints = a.endpoints();
    let mut models = vec![json!({"name": "model-a", "endpoints": a.endpoints()})];
    if let Some(b) = extra_model {
        endpoints.extend(b.endpoints());
        models.push(json!({"name": "model-b", "endpoints": b.endpoints()}));
    }
    let config = json!({
        "models": models,
        "objectives": {"priorities": {"batch": -1, "chat": 5}},
        // The box is shared: give scrapes time (the thresholds are GIE's).
        "saturation": {"stale_after_ms": 1000},
    });
    let envoy = Envoy::start(&endpoints, config, 2);
    let mut sims = vec![&a];
    sims.extend(extra_model);
    for sim in sims {
        for i in 0..sim.pods {
            let start = Instant::now();
            while sim.metrics_scrapes(i) < 2.0 {
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "pod {i} never scraped"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    // Every worker reads the scrapes on its next tick.
    std::thread::sleep(Duration::from_millis(200));
    (a, envoy)
}

#[test]
fn saturated_pool_sheds_sheddable_requests_and_keeps_serving_the_rest() {
    let (sim, envoy) = shedding_gateway(None);
    // Unsaturated: sheddable requests are routed.
    for i in 0..10 {
        let r = post(
            &envoy,
            &chat("model-a", &format!("b{i}")),
            &[(OBJECTIVE, "batch")],
        );
        assert_eq!(r.status, 200, "unsaturated pool shed a request: {}", r.body);
    }
    // One pod saturated (6 waiting >= 5): the other still serves, nothing shed.
    sim.fault(0, json!({"queue_inflate": 6}));
    let gauge = format!(
        "wasmcustom.kvroute.endpoint.{}.waiting",
        sim.endpoint(0).replace(['.', ':'], "_")
    );
    let start = Instant::now();
    while envoy.stat(&gauge) < 6.0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "pod 0's queue never scraped"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for i in 0..10 {
        let r = post(
            &envoy,
            &chat("model-a", &format!("c{i}")),
            &[(OBJECTIVE, "batch")],
        );
        assert_eq!(
            r.status, 200,
            "shed with an unsaturated endpoint left: {}",
            r.body
        );
    }
    // Both saturated: batch is shed with 429, Retry-After and a JSON body.
    sim.fault(1, json!({"queue_inflate": 6}));
    wait_until_shed(&envoy);
    for i in 0..10 {
        let r = post(
            &envoy,
            &chat("model-a", &format!("d{i}")),
            &[(OBJECTIVE, "batch")],
        );
        assert_eq!(r.status, 429, "{}", r.body);
        assert_eq!(r.header("retry-after"), Some("1"));
        assert_eq!(error_code(&r), "pool_saturated");
        assert!(r.pod().is_none());
    }
    // Priority >= 0 keeps flowing: a listed one, none, and names a client
    // invents (they get the default 0, never more).
    for objective in [
        Some("chat"),
        None,
        Some("vip"),
        Some("CHAT"),
        Some("batch-2"),
    ] {
        for i in 0..5 {
            let headers: Vec<(&str, &str)> = objective.iter().map(|o| (OBJECTIVE, *o)).collect();
            let r = post(&envoy, &chat("model-a", &format!("e{i}")), &headers);
            assert_eq!(r.status, 200, "{objective:?}: {}", r.body);
        }
    }
    // Recovery: queues drain, batch flows again.
    sim.fault(0, json!({"queue_inflate": 0}));
    let r = until_status(&envoy, "batch", 200, Duration::from_secs(5));
    assert_eq!(
        r.status, 200,
        "still shed after the queue drained: {}",
        r.body
    );
    // Per-objective stats.
    assert!(envoy.stat("wasmcustom.kvroute.shed") >= 11.0);
    assert!(envoy.stat("wasmcustom.kvroute.objective.batch.shed") >= 11.0);
    assert!(envoy.stat("wasmcustom.kvroute.objective.batch.requests") >= 31.0);
    assert_eq!(
        envoy.stat("wasmcustom.kvroute.objective.chat.requests"),
        5.0
    );
    assert_eq!(envoy.stat("wasmcustom.kvroute.objective.chat.shed"), 0.0);
    assert!(envoy.stat("wasmcustom.kvroute.objective_default.requests") >= 20.0);
    assert_eq!(envoy.stat("wasmcustom.kvroute.objective_default.shed"), 0.0);
}

#[test]
fn saturation_is_per_model() {
    let b = Sim::start(1, &["--time-scale", "0.01", "--model", "model-b"]);
    let (a, envoy) = shedding_gateway(Some(&b));
    a.fault(0, json!({"queue_inflate": 8}));
    a.fault(1, json!({"queue_inflate": 8}));
    wait_until_shed(&envoy);
    // model-b's endpoint is idle: its batch requests are routed.
    for i in 0..10 {
        let r = post(
            &envoy,
            &chat("model-b", &format!("f{i}")),
            &[(OBJECTIVE, "batch")],
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["model"], "model-b");
    }
}
