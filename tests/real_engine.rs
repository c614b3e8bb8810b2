//! kvroute in the real Envoy in front of real llama.cpp `llama-server` pods
//! (issue 13): nothing here is simulated. Ground truth comes from the engines
//! themselves: which pod computed a prompt and how much of it came from its
//! prompt cache (`llamacpp:prompt_tokens_total`,
//! `llamacpp:prompt_tokens_cached_total`, `usage.prompt_tokens_details`).

#[path = "support/llama.rs"]
mod llama;
mod support;

use std::time::{Duration, Instant};

use llama::{engine, LlamaServer};
use serde_json::{json, Value};
use support::{get, post_json, Envoy, Reply, Sim};

const DEBUG: &str = "x-kvroute-debug";

fn config() -> Value {
    // Auto-detection must recognise llama.cpp's /metrics on its own.
    json!({"debug_header": DEBUG})
}

/// The pod whose engine computed the last request: the one whose prompt
/// counters moved since `before`.
fn answered_by(pods: &[LlamaServer], before: &[(f64, f64)]) -> usize {
    let moved: Vec<usize> = pods
        .iter()
        .enumerate()
        .filter(|(i, p)| {
            let (a, c) = p.prompt_tokens();
            a + c > before[*i].0 + before[*i].1
        })
        .map(|(i, _)| i)
        .collect();
    assert_eq!(
        moved.len(),
        1,
        "exactly one engine must have answered: {moved:?}"
    );
    moved[0]
}

fn counters(pods: &[LlamaServer]) -> Vec<(f64, f64)> {
    pods.iter().map(LlamaServer::prompt_tokens).collect()
}

fn cached_tokens(r: &Reply) -> u64 {
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

fn prompt_tokens(r: &Reply) -> u64 {
    r.json()["usage"]["prompt_tokens"].as_u64().unwrap_or(0)
}

/// Waits until kvroute has scraped every pod's llama.cpp metrics.
fn wait_for_scrapes(envoy: &Envoy) {
    let start = Instant::now();
    while envoy.stat("wasmcustom.kvroute.scrape.success") < 4.0 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "kvroute never scraped the engines:\n{}",
            envoy.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn turn_two_lands_on_turn_one_pod_and_the_engine_reuses_its_cache() {
    let Some(e) = engine() else { return };
    let pods: Vec<LlamaServer> = (0..2).map(|_| LlamaServer::start(&e, 2, 4096)).collect();
    let endpoints: Vec<String> = pods.iter().map(LlamaServer::endpoint).collect();
    let envoy = Envoy::start(&endpoints, config(), 2);
    wait_for_scrapes(&envoy);
    // Four conversations with their own ~700-token system prompts: a router
    // blind to prefixes keeps turn 2 on turn 1's pod for all four 1 time in 16.
    for c in 0..4 {
        let tag = format!("conversation{c}");
        let before = counters(&pods);
        let t1 = post_json(&envoy.url("/v1/chat/completions"), &turn(&tag, 0));
        assert_eq!(t1.status, 200, "{}", t1.body);
        let pod1 = answered_by(&pods, &before);
        let before = counters(&pods);
        let t2 = post_json(&envoy.url("/v1/chat/completions"), &turn(&tag, 1));
        assert_eq!(t2.status, 200, "{}", t2.body);
        let pod2 = answered_by(&pods, &before);
        let dbg = t2.header(DEBUG).unwrap_or_default();
        assert_eq!(pod2, pod1, "{tag}: turn 2 left turn 1's engine ({dbg})");
        assert!(
            dbg.contains("reason=Prefix"),
            "{tag}: not a prefix decision: {dbg}"
        );
        // The engine itself says the shared prefix was not computed again.
        let (cached, total) = (cached_tokens(&t2), prompt_tokens(&t2));
        assert!(
            cached * 10 >= total * 8,
            "{tag}: engine reused {cached} of {total} prompt tokens"
        );
        let engine_cached = pods[pod2].prompt_tokens().1 - before[pod2].1;
        assert!(engine_cached >= cached as f64, "{engine_cached} < {cached}");
    }
    // Every scrape of the real /metrics was understood (auto-detected llama.cpp).
    assert_eq!(
        envoy.stat("wasmcustom.kvroute.scrape.failure"),
        0.0,
        "{}",
        envoy.log()
    );
    // Each engine told its slot count (`-np 2`) through its real /props.
    assert_eq!(envoy.stat("wasmcustom.kvroute.engine_slots.read"), 2.0);
    assert_eq!(envoy.stat("wasmcustom.kvroute.engine_slots.failure"), 0.0);
    for ep in &endpoints {
        let label = ep.replace(['.', ':'], "_");
        let gauge = format!("wasmcustom.kvroute.endpoint.{label}.engine_slots");
        assert_eq!(envoy.stat(&gauge), 2.0, "{gauge}");
    }
}

#[test]
fn a_killed_engine_is_avoided_and_requests_keep_succeeding() {
    let Some(e) = engine() else { return };
    let mut pods: Vec<LlamaServer> = (0..2).map(|_| LlamaServer::start(&e, 2, 4096)).collect();
    let endpoints: Vec<String> = pods.iter().map(LlamaServer::endpoint).collect();
    let envoy = Envoy::start(&endpoints, config(), 2);
    wait_for_scrapes(&envoy);
    let before = counters(&pods);
    let t1 = post_json(&envoy.url("/v1/chat/completions"), &turn("doomed", 0));
    assert_eq!(t1.status, 200, "{}", t1.body);
    let dead = answered_by(&pods, &before);
    let alive = 1 - dead;
    pods[dead].kill();
    // Turn 2 prefers the dead pod's prefix; Envoy's retry and then kvroute's
    // health view must carry it and every later request to the live engine.
    let before = pods[alive].prompt_tokens();
    for i in 0..6 {
        let body = if i == 0 {
            turn("doomed", 1)
        } else {
            turn(&format!("after{i}"), 0)
        };
        let r = post_json(&envoy.url("/v1/chat/completions"), &body);
        assert_eq!(r.status, 200, "request {i} failed: {}", r.body);
    }
    let after = pods[alive].prompt_tokens();
    assert!(
        after.0 + after.1 > before.0 + before.1,
        "the live engine computed nothing"
    );
    // kvroute stopped choosing the dead pod once its scrapes failed.
    std::thread::sleep(Duration::from_millis(500));
    let r = post_json(&envoy.url("/v1/chat/completions"), &turn("doomed", 2));
    assert_eq!(r.status, 200, "{}", r.body);
    let dbg = r.header(DEBUG).unwrap_or_default().to_string();
    assert!(
        dbg.starts_with(&format!("endpoint={}", endpoints[alive])),
        "kvroute still chooses the dead engine: {dbg}"
    );
}

/// A real engine's refusal: llama.cpp answers 400 for a prompt longer than
/// its slot's context. In a fleet of unequal engines the prompt was never
/// cached by the one that refused it, so the client's retry must not go back
/// there by prefix (kvroute un-teaches the refusal), and the engine with room
/// answers it.
#[test]
fn a_prompt_an_engine_refused_for_its_context_is_not_sent_back_there() {
    let Some(e) = engine() else { return };
    // 512 tokens of context against 2 x 2048.
    let pods = [
        LlamaServer::start(&e, 1, 512),
        LlamaServer::start(&e, 2, 4096),
    ];
    let endpoints: Vec<String> = pods.iter().map(LlamaServer::endpoint).collect();
    let small = format!("endpoint={};", endpoints[0]);
    let envoy = Envoy::start(&endpoints, config(), 2);
    wait_for_scrapes(&envoy);
    let ask = |prompt: &str| {
        let body = json!({"model": "smollm2", "prompt": prompt, "max_tokens": 2, "temperature": 0});
        let r = post_json(&envoy.url("/v1/completions"), &body);
        (
            r.status,
            r.header(DEBUG).unwrap_or_default().to_string(),
            r.body,
        )
    };
    // ~1000-token prompts until the small engine refuses one.
    let mut refused = None;
    for i in 0..8 {
        let prompt = format!(
            "Document {i}. {}",
            "The quick brown fox jumps over the lazy dog. ".repeat(100)
        );
        let (status, dbg, body) = ask(&prompt);
        if dbg.starts_with(&small) {
            assert_eq!(status, 400, "{dbg}: {body}");
            refused = Some(prompt);
            break;
        }
        assert_eq!(status, 200, "{dbg}: {body}");
    }
    let prompt = refused.expect("the small engine was never chosen");
    // Placed like a new prompt, a retry may try the small engine again, but
    // never by the refused prompt's prefix; the big engine answers one.
    let mut answered = false;
    for retry in 0..4 {
        let (status, dbg, body) = ask(&prompt);
        assert!(
            !(dbg.starts_with(&small) && dbg.contains("reason=Prefix")),
            "retry {retry} went back by prefix to the engine that refused it: {dbg}"
        );
        if status == 200 {
            answered = true;
            break;
        }
        assert_eq!(status, 400, "{dbg}: {body}");
    }
    assert!(answered, "no retry was answered");
    assert!(envoy.stat("wasmcustom.kvroute.prefix.forgotten") >= 1.0);
}

/// Turn `turn` (0-based) of conversation `tag`: a system prompt of its own
/// (~700 tokens), then the user/assistant turns so far; short answers.
fn turn(tag: &str, turn: usize) -> Value {
    let mut system = format!("You are assistant {tag}. ");
    let mut i = 0;
    while system.len() < 3_000 {
        system.push_str(&format!("Rule {i} of {tag}: answer briefly and politely. "));
        i += 1;
    }
    let mut messages = vec![json!({"role": "system", "content": system})];
    for t in 0..=turn {
        messages.push(json!({"role": "user", "content": format!("Question {t}: name a colour.")}));
        if t < turn {
            messages.push(json!({"role": "assistant", "content": format!("Colour {t}.")}));
        }
    }
    json!({"model": "smollm2", "max_tokens": 4, "temperature": 0, "messages": messages})
}

/// The harness itself: a llama-server whose port is taken (here by a
/// simulated pod, which answers `/health` with 200 as llama-server does)
/// exits, and its start is an error with the server's reason, not a
/// `LlamaServer` that is someone else's server. `LlamaServer::start` then
/// starts again on a new port.
#[test]
fn a_llama_server_that_cannot_bind_its_port_is_not_started() {
    let Some(e) = engine() else { return };
    let sim = Sim::start(1, &[]);
    let err = LlamaServer::try_start(&e, 1, 512, sim.base_port)
        .err()
        .expect("a llama-server on a taken port must not count as started");
    assert!(err.contains("couldn't bind"), "{err}");
    assert_eq!(get(&sim.url(0, "/health")).status, 200);
}

/// llama.cpp's `llama-server` closes its connection after every streamed
/// answer, though the answer says `Keep-Alive` and not `Connection: close`
/// (build 11434, the one `./build.sh engine` makes). Envoy puts the
/// connection back in its pool when the last chunk arrives; a request Envoy
/// dispatched to that pod before it read the close went out on a dead
/// connection and was reset unanswered
/// (`upstream_cx_destroy_remote_with_active_rq`): 2 of these 200 streams on
/// each of three runs before kvroute asked for the close itself. Its retry
/// went to another pod, away from the prompt's cache, and kvroute set the
/// first pod aside as if it had failed. Concurrent streams through the real
/// Envoy: none may be lost to that race.
#[test]
fn streams_from_llama_server_are_never_sent_on_a_connection_it_is_closing() {
    let Some(e) = engine() else { return };
    let pods: Vec<LlamaServer> = (0..2).map(|_| LlamaServer::start(&e, 4, 4096)).collect();
    let endpoints: Vec<String> = pods.iter().map(LlamaServer::endpoint).collect();
    let envoy = Envoy::start(&endpoints, config(), 2);
    wait_for_scrapes(&envoy);
    // Every worker's copy of the scrape state (refreshed each tick) says
    // the pods run llama.cpp.
    std::thread::sleep(Duration::from_millis(300));
    let port = envoy.port;
    let clients: Vec<_> = (0..8)
        .map(|c| {
            std::thread::spawn(move || {
                for i in 0..25 {
                    let body = json!({
                        "model": "smollm2",
                        "prompt": format!("client {c} request {i}: say something"),
                        "max_tokens": 2,
                        "stream": true,
                    });
                    let (_, events) = support::sse_events(port, "/v1/completions", &body);
                    assert!(
                        events.iter().any(|e| e == "[DONE]"),
                        "client {c} request {i}: the stream did not finish: {events:?}"
                    );
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    let reset = envoy.stat("cluster.kvroute_upstream.upstream_cx_destroy_remote_with_active_rq");
    let retried = envoy.stat("cluster.kvroute_upstream.upstream_rq_retry");
    let unanswered = envoy.stat("wasmcustom.kvroute.failover.unanswered");
    let closed = envoy.stat("wasmcustom.kvroute.failover.connection_close");
    assert_eq!(closed, 200.0, "streams that asked for the close");
    assert_eq!(
        (reset, retried, unanswered),
        (0.0, 0.0, 0.0),
        "requests went out on connections llama-server was closing \
         (reset with a request on it, retried, unanswered)"
    );
}
