//! A mixed fleet through the real Envoy and real kvroute-sim pods, one of
//! them four times slower (`--pod-speeds`): kvroute learns from the streams
//! it passes how much slower each pod answers (`scheduling.decode_speed`,
//! `core/src/decode_speed.rs`), moves cold picks and conversations off the
//! slow pod, and says so in its stats and debug header; with the model off,
//! the cold rotation keeps sending the slow pod every other new prompt.

mod support;

use serde_json::{json, Value};
use support::*;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const DEBUG: &str = "x-kvroute-debug";

/// Two pods; pod 1 steps four times slower.
fn fleet() -> Sim {
    Sim::start(2, &["--time-scale", "0.25", "--pod-speeds", "1,0.25"])
}

fn envoy(sim: &Sim, decode_speed: bool) -> Envoy {
    Envoy::start(
        &sim.endpoints(),
        json!({"debug_header": DEBUG, "scheduling": {"decode_speed": decode_speed}}),
        1,
    )
}

/// A streamed completion of 48 tokens (several KiB of SSE after the first
/// chunk) for a prompt no other request shares.
fn cold(envoy: &Envoy, tag: &str) -> Reply {
    let body: Value = json!({
        "model": MODEL,
        "prompt": format!("{tag} new prompt ").repeat(200),
        "max_tokens": 48,
        "stream": true,
    });
    let r = post_json(&envoy.url("/v1/completions"), &body);
    assert_eq!(r.status, 200, "{}", r.body);
    r
}

/// Pods that served `n` cold prompts sent one after another.
fn serve_cold(envoy: &Envoy, phase: &str, n: usize) -> Vec<(usize, String)> {
    (0..n)
        .map(|i| {
            let r = cold(envoy, &format!("{phase}-{i}"));
            (
                r.pod().expect("pod header"),
                r.header(DEBUG).unwrap_or("").to_string(),
            )
        })
        .collect()
}

#[test]
fn new_prompts_leave_a_pod_that_streams_answers_slower() {
    let sim = fleet();
    let envoy = envoy(&sim, true);
    // The rotation alternates while nothing is known: both pods stream
    // answers and are learnt (3 each at least).
    let learning = serve_cold(&envoy, "learn", 8);
    let slow_then = learning.iter().filter(|(p, _)| *p == 1).count();
    assert!((3..=5).contains(&slow_then), "{learning:?}");
    // Now the slow pod's cold picks move to the fast one.
    let after = serve_cold(&envoy, "after", 16);
    let slow = after.iter().filter(|(p, _)| *p == 1).count();
    assert!(slow <= 2, "slow pod served {slow} of 16: {after:?}");
    let moved = envoy.stat("wasmcustom.kvroute.decision.moved_by_decode");
    assert!(moved >= 5.0, "moved_by_decode {moved}");
    let fast = sim.endpoint(0);
    assert!(
        after
            .iter()
            .any(|(_, d)| d.contains(&format!("moved_by_decode={fast}="))
                && d.contains("reason=Cold")),
        "{after:?}"
    );
}

#[test]
fn without_the_model_the_rotation_keeps_feeding_the_slow_pod() {
    let sim = fleet();
    let envoy = envoy(&sim, false);
    let all = serve_cold(&envoy, "all", 24);
    let slow = all.iter().filter(|(p, _)| *p == 1).count();
    assert!((10..=14).contains(&slow), "slow pod served {slow} of 24");
    assert_eq!(
        envoy.stat("wasmcustom.kvroute.decision.moved_by_decode"),
        0.0
    );
}

#[test]
fn conversations_placed_on_the_slow_pod_move_to_the_fast_one() {
    let sim = fleet();
    let envoy = envoy(&sim, true);
    let turn = |conv: usize, turn: usize| {
        let mut body = conversation_turn(MODEL, &format!("conversation-{conv}"), turn);
        body["stream"] = json!(true);
        body["max_tokens"] = json!(48);
        let r = post_json(&envoy.url("/v1/chat/completions"), &body);
        assert_eq!(r.status, 200, "{}", r.body);
        // Each decision, printed for a failing run.
        eprintln!("conv {conv} turn {turn}: {}", r.header(DEBUG).unwrap_or(""));
        r.pod().expect("pod header")
    };
    // Four conversations start while nothing is known: the rotation puts
    // two on each pod. Then both pods are learnt.
    let first: Vec<usize> = (0..4).map(|c| turn(c, 0)).collect();
    assert_eq!(first.iter().filter(|&&p| p == 1).count(), 2, "{first:?}");
    serve_cold(&envoy, "learn", 8);
    // Their next turns: the slow pod's conversations move, and stay moved.
    let later: Vec<Vec<usize>> = (0..4)
        .map(|c| (1..4).map(|t| turn(c, t)).collect())
        .collect();
    for (c, pods) in later.iter().enumerate() {
        assert_eq!(
            pods[1..],
            [0, 0],
            "conversation {c} (turn 1 on pod {}): {later:?}",
            first[c]
        );
    }
    let moved = envoy.stat("wasmcustom.kvroute.decision.moved_by_cost");
    assert!(
        moved >= 2.0,
        "moved_by_cost {moved}: {first:?} then {later:?}"
    );
}
