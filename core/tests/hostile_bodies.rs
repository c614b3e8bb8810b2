//! Hostile request bodies: the parser's peak allocation and time stay within
//! the documented bound whatever the body's shape (docs/ARCHITECTURE.md,
//! "Memory and CPU per request"). Each shape below once grew a VM by tens to
//! hundreds of MB (wasm linear memory never shrinks).
//!
//! Native only: a counting global allocator measures the peak heap of each
//! `parse` call (the wasm32 build allocates the same structures, at most the
//! same sizes: pointers are half as wide there).
#![cfg(not(target_arch = "wasm32"))]

mod support;

use kvroute_core::config::PrefixConfig;
use kvroute_core::request::{parse, parse_cost_bound, ApiKind};
use std::time::{Duration, Instant};
use support::{peak_alloc, Counting};

#[global_allocator]
static GLOBAL: Counting = Counting;

const CHAT: ApiKind = ApiKind::ChatCompletions;
const COMP: ApiKind = ApiKind::Completions;
const BODY: usize = 8 << 20;

/// `head` + `item` repeated (comma-separated) + `tail`, about `BODY` bytes.
fn repeated(head: &str, item: &str, tail: &str) -> Vec<u8> {
    let n = (BODY - head.len() - tail.len()) / (item.len() + 1);
    let mut b = Vec::with_capacity(BODY);
    b.extend_from_slice(head.as_bytes());
    for i in 0..n {
        if i > 0 {
            b.push(b',');
        }
        b.extend_from_slice(item.as_bytes());
    }
    b.extend_from_slice(tail.as_bytes());
    b
}

/// The shapes an attacker would send: many tiny elements where the parser
/// used to allocate a large structure per element.
fn hostile() -> Vec<(&'static str, ApiKind, Vec<u8>)> {
    let msg = r#"{"model":"m","messages":[{"role":"user","content":["#;
    let mut escaped = br#"{"model":"m","prompt":""#.to_vec();
    escaped.extend(std::iter::repeat_n(b"\\n".iter().copied(), BODY / 2 - 16).flatten());
    escaped.extend_from_slice(br#""}"#);
    let mut long_role = br#"{"model":"m","messages":[{"role":""#.to_vec();
    long_role.extend(std::iter::repeat_n(b"\\t".iter().copied(), BODY / 2 - 32).flatten());
    long_role.extend_from_slice(br#"","content":"x"}]}"#);
    vec![
        (
            "empty content parts",
            CHAT,
            repeated(msg, r#"{"type":""}"#, "]}]}"),
        ),
        (
            "text content parts",
            CHAT,
            repeated(msg, r#"{"type":"text","text":"x"}"#, "]}]}"),
        ),
        (
            "tools of empty arrays",
            CHAT,
            repeated(
                r#"{"model":"m","tools":["#,
                "[]",
                r#"],"messages":[{"role":"user","content":"x"}]}"#,
            ),
        ),
        ("tools object of many keys", CHAT, {
            let mut b =
                br#"{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"#.to_vec();
            let mut i = 0u64;
            while b.len() < BODY - 32 {
                if i > 0 {
                    b.push(b',');
                }
                b.extend_from_slice(format!(r#""{i:x}":0"#).as_bytes());
                i += 1;
            }
            b.extend_from_slice(b"}]}");
            b
        }),
        (
            "tool_calls of empty objects",
            CHAT,
            repeated(
                r#"{"model":"m","messages":[{"role":"assistant","tool_calls":["#,
                "{}",
                "]}]}",
            ),
        ),
        (
            "tiny messages",
            CHAT,
            repeated(r#"{"model":"m","messages":["#, r#"{"role":"a"}"#, "]}"),
        ),
        (
            "prompt of empty strings",
            COMP,
            repeated(r#"{"model":"m","prompt":["#, r#""""#, "]}"),
        ),
        (
            "prompt of token ids",
            COMP,
            repeated(r#"{"model":"m","prompt":["#, "1", "]}"),
        ),
        (
            "prompt of token lists",
            COMP,
            repeated(r#"{"model":"m","prompt":["#, "[1]", "]}"),
        ),
        ("escaped prompt string", COMP, escaped),
        ("escaped role", CHAT, long_role),
        ("deep ignored field", COMP, {
            let mut b = br#"{"model":"m","x":"#.to_vec();
            b.extend(std::iter::repeat_n(b'[', BODY / 2 - 32));
            b.extend(std::iter::repeat_n(b']', BODY / 2 - 32));
            b.extend_from_slice(br#","prompt":"p"}"#);
            b
        }),
    ]
}

/// Best of three: the time `f` takes.
fn best_of_three(mut f: impl FnMut()) -> Duration {
    (0..3)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

#[test]
fn hostile_bodies_stay_within_the_parse_bound() {
    let cfg = PrefixConfig::default();
    let mut failures = Vec::new();
    for (name, kind, body) in hostile() {
        let (result, peak) = peak_alloc(|| parse(kind, &body, &cfg));
        drop(result);
        let took = best_of_three(|| drop(parse(kind, &body, &cfg)));
        // The yardstick, same body, same run: serde_json only checking that
        // it is JSON (the least any reader of it must spend).
        let scan = best_of_three(|| {
            let _ = serde_json::from_slice::<serde::de::IgnoredAny>(&body);
        });
        let bound = parse_cost_bound(body.len(), &cfg);
        let ratio = took.as_secs_f64() / scan.as_secs_f64().max(1e-6);
        println!(
            "{name:<28} body {:>5} KiB  peak {:>6} KiB  bound {:>6} KiB  {:>7.1} ms ({ratio:.1}x a JSON scan)",
            body.len() >> 10,
            peak >> 10,
            bound >> 10,
            took.as_secs_f64() * 1e3
        );
        if peak > bound {
            failures.push(format!("{name}: peak {peak} > bound {bound}"));
        }
        // Linear in the body with a small constant, whatever its shape: a
        // few JSON scans (the old parser took up to 100x one scan).
        if ratio > 8.0 {
            failures.push(format!("{name}: {ratio:.1}x the time of a JSON scan"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
