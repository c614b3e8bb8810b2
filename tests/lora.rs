//! LoRA adapters through the real Envoy and real `kvroute-sim` pods
//! (issue 15): the pods report vLLM's `vllm:lora_requests_info`; a request
//! naming an adapter goes where the adapter already runs, and not to a pod
//! whose only adapter slot is busy with another one.

mod support;

use serde_json::json;
use std::time::{Duration, Instant};
use support::*;

const BASE: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn ask(envoy: &Envoy, model: &str, i: usize) -> Reply {
    let body = json!({"model": model, "max_tokens": 2,
                      "messages": [{"role": "user", "content": format!("question {i} for {model}")}]});
    post_json(&envoy.url("/v1/chat/completions"), &body)
}

#[test]
fn an_adapter_request_lands_where_the_adapter_runs() {
    // Real time: the long request below keeps its adapter running ~3 s.
    let sim = Sim::start(
        3,
        &[
            "--lora-adapters",
            "sql,fin",
            "--max-loras",
            "1",
            "--lora-load-ms",
            "20",
        ],
    );
    let config = json!({
        "models": [{"name": BASE, "endpoints": sim.endpoints(), "adapters": ["sql", "fin"]}],
        "debug_header": "x-kvroute-debug",
    });
    let envoy = Envoy::start(&sim.endpoints(), config, 2);
    // A long `sql` request runs on pod 1, sent to it directly.
    let url = sim.url(1, "/v1/chat/completions");
    let long = std::thread::spawn(move || {
        let body = json!({"model": "sql", "max_tokens": 500,
                          "messages": [{"role": "user", "content": "a long report"}]});
        post_json(&url, &body)
    });
    let start = Instant::now();
    while !get(&sim.url(1, "/metrics"))
        .body
        .contains(r#"running_lora_adapters="sql""#)
    {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "sql never ran on pod 1"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300)); // scraped by every worker
                                                    // sql runs on pod 1 (1.0); pods 0 and 2 have a free slot (0.8).
    for i in 0..8 {
        let r = ask(&envoy, "sql", i);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["model"], "sql");
        assert_eq!(
            r.pod(),
            Some(1),
            "sql request not sent where sql runs: {:?}",
            r.header("x-kvroute-debug")
        );
    }
    // fin: pod 1's only slot runs sql (0): fin goes to the free pods.
    for i in 0..8 {
        let r = ask(&envoy, "fin", i);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_ne!(r.pod(), Some(1), "fin sent to the pod whose slot is busy");
    }
    // Base-model requests are not scored for adapters: they spread.
    let mut pods: Vec<usize> = (0..9).filter_map(|i| ask(&envoy, BASE, i).pod()).collect();
    pods.sort();
    pods.dedup();
    assert!(pods.len() >= 2, "base requests all on {pods:?}");
    assert!(long.join().unwrap().status == 200);
}
