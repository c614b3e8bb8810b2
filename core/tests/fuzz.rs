//! Fuzzing that stays: every parser that reads bytes from outside (client
//! request bodies, engines' `/metrics`, the plugin configuration, and the
//! shared-data formats other VMs write) is run on generated and mutated
//! inputs, seeded from the real fixtures. Properties: no panic (a panic
//! kills the wasm VM and every request behind it), and no allocation above
//! the documented bound.
//!
//! `./build.sh test` runs a short pass (`KVROUTE_FUZZ_CASES`, default 1000
//! per target). A longer run, as documented in docs/ARCHITECTURE.md:
//!
//! ```sh
//! KVROUTE_FUZZ_CASES=100000 cargo test --release -p kvroute-core --test fuzz
//! ```
//!
//! proptest shrinks a failure to a small input and records its seed under
//! `core/tests/proptest-regressions/`; commit that file so the case is
//! replayed by every later run.
#![cfg(not(target_arch = "wasm32"))]

mod support;

use kvroute_core::config::{Config, MetricsConfig, PrefixConfig};
use kvroute_core::discovery::{cluster_members, decode_pool, encode_pool};
use kvroute_core::endpoint::Endpoint;
use kvroute_core::metrics::lora::LoraSnapshot;
use kvroute_core::metrics::scrape::classify;
use kvroute_core::metrics::{read_snapshot, MetricsSnapshot};
use kvroute_core::models::served::{self, ListingOutcome, ServedModels};
use kvroute_core::peer::table::PeerTable;
use kvroute_core::peer::wire::{SyncAnswer, SyncQuery};
use kvroute_core::request::{parse, parse_cost_bound, ApiKind};
use kvroute_core::shared::decision_log::LogEntry;
use kvroute_core::shared::endpoint_state::{EndpointStates, ScrapeState, MIN_ENTRY_BYTES};
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Value};
use support::{peak_alloc, Counting};

#[global_allocator]
static GLOBAL: Counting = Counting;

fn cases() -> u32 {
    std::env::var("KVROUTE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: cases(),
        // Mutations of a fixture rarely need many shrink steps to be clear.
        max_shrink_iters: 2048,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------
// Seeds and mutations

/// Engines' `GET /v1/models` answers (tests/fixtures/models/SOURCES.md).
const MODEL_LISTS: [&str; 4] = [
    include_str!("../../tests/fixtures/models/llamacpp-11434-smollm2.json"),
    include_str!("../../tests/fixtures/models/sglang.json"),
    include_str!("../../tests/fixtures/models/vllm-lora-adapters.json"),
    include_str!("../../tests/fixtures/models/vllm-served-model-names.json"),
];

const REQUESTS: [&str; 5] = [
    include_str!("../../tests/fixtures/requests/chat-tools-turn1.json"),
    include_str!("../../tests/fixtures/requests/chat-tools-turn2.json"),
    include_str!("../../tests/fixtures/requests/chat-vision.json"),
    include_str!("../../tests/fixtures/requests/completions-tokens.json"),
    include_str!("../../tests/fixtures/requests/completions-text.json"),
];

const METRICS: [&str; 12] = [
    include_str!(
        "../../tests/fixtures/metrics/sglang-aibrix1614-deepseek-r1-dp-ranks-fragment.txt"
    ),
    include_str!("../../tests/fixtures/metrics/sglang-docs-production-metrics-llama3.1-8b.txt"),
    include_str!("../../tests/fixtures/metrics/sglang-pr4412-llama3-8b-fragment.txt"),
    include_str!("../../tests/fixtures/metrics/sglang-pr7944-deepseek-r1-fragment.txt"),
    include_str!("../../tests/fixtures/metrics/triton-base-metrics-readme.txt"),
    include_str!("../../tests/fixtures/metrics/triton-trtllm-backend-readme-inflight-batcher.txt"),
    include_str!("../../tests/fixtures/metrics/vllm-0.10.0-v1-glm4.5-fragment.txt"),
    include_str!("../../tests/fixtures/metrics/vllm-0.29.0-v1-qwen2.5-1.5b-inferstack.txt"),
    include_str!("../../tests/fixtures/metrics/vllm-llm-d-inference-sim-kthena1129-fragment.txt"),
    include_str!("../../tests/fixtures/metrics/vllm-v1-0.8-era-qwen2.5-coder-32b-fragment.txt"),
    include_str!("../../tests/fixtures/metrics/llamacpp-11434-smollm2-np2-one-processing.txt"),
    include_str!("../../tests/fixtures/metrics/llamacpp-11434-smollm2-after-3-requests.txt"),
];

const CONFIGS: [&str; 4] = [
    include_str!("../../deploy/compose/kvroute.json"),
    r#"{"endpoints":["10.0.0.1:8000","[::1]:9000"],"handoff":"override_host","discovery":{},"debug_header":"x-d"}"#,
    r#"{"endpoints":["10.0.0.1:8000"],"metrics":{"engine":"custom","names":{"waiting":"q","running":"r","kv_usage":"kv","kv_usage_scale":0.01}},"prefix":{"block_tokens":16,"max_json_nodes":100},"scheduling":{"profile":"affinity_gate","weights":{"prefix":1},"seed":3}}"#,
    r#"{"endpoints":["10.0.0.1:8000"],"outlier_detection":{"consecutive_errors":0},"shared":{"key_prefix":"k/","log_slots":64},"max_body_bytes":4096}"#,
];

/// Bytes that make mutations interesting to a JSON or Prometheus parser.
const DICTIONARY: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b"\"",
    b",",
    b":",
    b"null",
    b"true",
    b"-0",
    b"1e309",
    b"\\u0000",
    b"\\ud800",
    b"\\",
    b"\xff",
    b"\xc3",
    b"\n",
    b" ",
    b"#",
    b"{}",
    b"[]",
    b"NaN",
    b"+Inf",
    b"{le=\"",
    b"\"}",
    b"=",
    b"18446744073709551616",
    b"\"\"",
];

/// One edit of a seed.
#[derive(Clone, Debug)]
enum Edit {
    Flip(Index, u8),
    Insert(Index, Index),
    Delete(Index, u8),
    Truncate(Index),
    /// Copies `len` bytes from one place to another (grows structures).
    Splice(Index, Index, u16),
    /// Repeats a short run `times` times in place: the element floods that
    /// amplify a parser's memory (`{"type":""},` x 100k).
    Repeat(Index, u8, u16),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Edit::Flip(i, b)),
        (any::<Index>(), any::<Index>()).prop_map(|(i, d)| Edit::Insert(i, d)),
        (any::<Index>(), 1u8..32).prop_map(|(i, n)| Edit::Delete(i, n)),
        any::<Index>().prop_map(Edit::Truncate),
        (any::<Index>(), any::<Index>(), 1u16..4096).prop_map(|(a, b, n)| Edit::Splice(a, b, n)),
        (any::<Index>(), 1u8..24, 1u16..8192).prop_map(|(a, n, k)| Edit::Repeat(a, n, k)),
    ]
}

fn mutate(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for e in edits {
        if b.is_empty() {
            break;
        }
        match e {
            Edit::Flip(i, v) => {
                let at = i.index(b.len());
                b[at] = *v;
            }
            Edit::Insert(i, d) => {
                let at = i.index(b.len() + 1);
                let word = DICTIONARY[d.index(DICTIONARY.len())];
                b.splice(at..at, word.iter().copied());
            }
            Edit::Delete(i, n) => {
                let at = i.index(b.len());
                let end = (at + *n as usize).min(b.len());
                b.drain(at..end);
            }
            Edit::Truncate(i) => b.truncate(i.index(b.len())),
            Edit::Splice(from, to, n) => {
                let from = from.index(b.len());
                let end = (from + *n as usize).min(b.len());
                let chunk = b[from..end].to_vec();
                let at = to.index(b.len() + 1);
                b.splice(at..at, chunk);
            }
            Edit::Repeat(from, n, times) => {
                let from = from.index(b.len());
                let end = (from + *n as usize).min(b.len());
                let chunk = b[from..end].repeat(*times as usize);
                b.splice(end..end, chunk);
            }
        }
    }
    b
}

/// Any JSON value, a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u32>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,12}".prop_map(Value::from),
        prop_oneof![
            Just("text"),
            Just("image_url"),
            Just("user"),
            Just("refusal")
        ]
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("type".to_string()),
                    Just("text".to_string()),
                    Just("url".to_string()),
                    Just("image_url".to_string()),
                    "[a-z]{1,3}".prop_map(String::from),
                ],
                inner,
                0..5
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// An OpenAI-shaped body whose fields hold arbitrary values: the shapes
/// clients get almost right.
fn shaped_body() -> impl Strategy<Value = Value> {
    let message = (
        json_value(),
        json_value(),
        json_value(),
        prop::option::of(json_value()),
    )
        .prop_map(|(role, content, calls, name)| {
            let mut m = json!({"role": role, "content": content, "tool_calls": calls});
            if let Some(n) = name {
                m["name"] = n;
            }
            m
        });
    (
        json_value(),
        prop::collection::vec(message, 0..4),
        json_value(),
        json_value(),
        json_value(),
    )
        .prop_map(|(model, messages, tools, prompt, salt)| {
            json!({"model": model, "messages": messages, "tools": tools,
                   "prompt": prompt, "cache_salt": salt, "stream": true})
        })
}

// ---------------------------------------------------------------------------
// Targets

fn check_request(body: &[u8], cfg: &PrefixConfig) -> Result<(), TestCaseError> {
    for kind in [ApiKind::ChatCompletions, ApiKind::Completions] {
        let (result, peak) = peak_alloc(|| parse(kind, body, cfg));
        let bound = parse_cost_bound(body.len(), cfg);
        prop_assert!(peak <= bound, "peak {peak} > bound {bound}");
        if let Ok(r) = result {
            prop_assert!(r.blocks.len() <= cfg.max_blocks());
            prop_assert!(r.prompt_tokens(cfg) >= 1);
        }
    }
    Ok(())
}

/// Small blocks so that fuzzed prompts span many of them and hit the cap.
fn small_blocks() -> PrefixConfig {
    PrefixConfig {
        block_tokens: 2,
        bytes_per_token: 2,
        max_prompt_tokens: 64,
        max_json_nodes: 64,
        ..PrefixConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn request_mutated_fixtures(seed in 0..REQUESTS.len(), edits in prop::collection::vec(edit(), 1..12)) {
        let body = mutate(REQUESTS[seed].as_bytes(), &edits);
        check_request(&body, &PrefixConfig::default())?;
        check_request(&body, &small_blocks())?;
    }

    #[test]
    fn request_generated_bodies(body in shaped_body()) {
        let bytes = serde_json::to_vec(&body).unwrap();
        check_request(&bytes, &PrefixConfig::default())?;
        check_request(&bytes, &small_blocks())?;
    }

    #[test]
    fn request_tools_key_order_does_not_matter(tools in prop::collection::vec(json_value(), 1..4)) {
        // Re-serializing with keys in reverse order keeps the blocks.
        let body = json!({"model":"m","tools":tools,"messages":[{"role":"user","content":"q"}]});
        let sorted = serde_json::to_string(&body).unwrap();
        let reversed = reverse_keys(&body);
        let cfg = PrefixConfig { block_tokens: 1, bytes_per_token: 1, ..PrefixConfig::default() };
        let a = parse(ApiKind::ChatCompletions, sorted.as_bytes(), &cfg);
        let b = parse(ApiKind::ChatCompletions, reversed.as_bytes(), &cfg);
        prop_assert_eq!(a, b);
    }

    #[test]
    fn metrics_mutated_fixtures(seed in 0..METRICS.len(), edits in prop::collection::vec(edit(), 1..16)) {
        let text = mutate(METRICS[seed].as_bytes(), &edits);
        let cfg = MetricsConfig::default();
        let (_, peak) = peak_alloc(|| classify(Some(200), Some(&text), &cfg));
        // Reading a scrape keeps a handful of numbers, never a copy of it.
        prop_assert!(peak <= 64 << 10, "peak {peak} for {} bytes", text.len());
        if let Ok(t) = std::str::from_utf8(&text) {
            let _ = read_snapshot(t, &cfg);
        }
    }

    #[test]
    fn model_lists_mutated_fixtures(seed in 0..MODEL_LISTS.len(), edits in prop::collection::vec(edit(), 1..16)) {
        let body = mutate(MODEL_LISTS[seed].as_bytes(), &edits);
        let (outcome, peak) = peak_alloc(|| served::classify(Some(200), Some(&body)));
        // Borrowed ids (copied only when escaped) and the cards' vector.
        prop_assert!(peak <= 4 * body.len() + 4096, "peak {peak} for {} bytes", body.len());
        if let ListingOutcome::Listed { ids, .. } = outcome {
            prop_assert!(ids.len() <= served::MAX_IDS);
        }
    }

    #[test]
    fn model_lists_generated(cards in prop::collection::vec(json_value(), 0..80)) {
        let data: Vec<Value> = cards
            .into_iter()
            .enumerate()
            .map(|(i, v)| if i % 2 == 0 { json!({"id": v.to_string(), "parent": v}) } else { json!({"id": v}) })
            .collect();
        let body = serde_json::to_vec(&json!({"object": "list", "data": data})).unwrap();
        match served::classify(Some(200), Some(&body)) {
            ListingOutcome::Listed { ids, truncated } => {
                prop_assert!(ids.len() <= served::MAX_IDS);
                prop_assert!(!truncated || ids.len() == served::MAX_IDS);
            }
            // A non-string id makes the whole list unreadable.
            ListingOutcome::Unreadable => {}
            ListingOutcome::Unreachable => prop_assert!(false, "a 200 is an answer"),
        }
    }

    #[test]
    fn metrics_generated_lines(lines in prop::collection::vec(
        (prop_oneof![Just("vllm:num_requests_waiting".to_string()), Just("sglang:token_usage".into()),
                     Just("vllm:cache_config_info".into()), Just("# TYPE x gauge".into()),
                     "[a-z:_]{0,8}"],
         "(\\{[a-z_]{0,4}=\"[^\"\n]{0,6}\"(,[a-z]{1,3}=\"[a-z0-9.]{0,4}\"){0,3}\\})?",
         prop_oneof![Just(" 1".to_string()), Just(" NaN".into()), Just(" -Inf".into()),
                     Just(" 1e400".into()), "( [-+0-9.eE]{0,8}){0,3}".prop_map(String::from)]),
        0..40)) {
        let text: String = lines.iter().map(|(n, l, v)| format!("{n}{l}{v}\n")).collect();
        let cfg = MetricsConfig::default();
        let (_, peak) = peak_alloc(|| read_snapshot(&text, &cfg));
        prop_assert!(peak <= 64 << 10, "peak {peak}");
    }

    #[test]
    fn config_mutated_seeds(seed in 0..CONFIGS.len(), edits in prop::collection::vec(edit(), 1..8)) {
        let bytes = mutate(CONFIGS[seed].as_bytes(), &edits);
        if let Ok(c) = Config::from_json(&bytes) {
            // Whatever is accepted holds together.
            prop_assert!(c.prefix.max_blocks() >= 1);
            prop_assert!(!c.endpoints.is_empty() || c.discovery.is_some());
        }
    }

    #[test]
    fn config_generated_values(v in json_value(), field in prop_oneof![
        Just("endpoints"), Just("handoff"), Just("metrics"), Just("prefix"), Just("scheduling"),
        Just("max_body_bytes"), Just("outlier_detection"), Just("shared"), Just("discovery")]) {
        let mut c = json!({"endpoints":["10.0.0.1:8000"]});
        c[field] = v;
        let _ = Config::from_json(&serde_json::to_vec(&c).unwrap());
    }

    #[test]
    fn shared_formats_decode_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = LogEntry::decode(&bytes);
        let _ = EndpointStates::decode(&bytes);
        let _ = decode_pool(&bytes);
        let _ = cluster_members(&bytes, "kvroute_upstream");
        // What a peer can send, and what reaches the peer listener.
        let _ = SyncAnswer::decode(&bytes);
        let _ = PeerTable::decode(&bytes);
        let _ = SyncQuery::from_path(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn peer_answers_decode_mutated_encodings(
        replica in any::<u64>(),
        blocks in prop::collection::vec(prop::collection::vec(any::<u64>(), 0..16), 0..6),
        edits in prop::collection::vec(edit(), 1..6),
    ) {
        let endpoint: Endpoint = "10.0.0.1:8000".parse().unwrap();
        let entries: Vec<LogEntry> = blocks
            .iter()
            .enumerate()
            .map(|(i, b)| LogEntry { seq: i as u64, endpoint, at_ms: 1, blocks: b.clone(), from_peer: false, forget: false })
            .collect();
        let answer = SyncAnswer { replica, next: 9, skipped: 1, entries, ..SyncAnswer::default() };
        let bytes = answer.encode();
        prop_assert_eq!(SyncAnswer::decode(&bytes), Some(answer));
        // A mutated answer: any outcome but a panic, and nothing decoded
        // that the bytes could not hold.
        let mutated = mutate(&bytes, &edits);
        let (decoded, peak) = peak_alloc(|| SyncAnswer::decode(&mutated));
        // (The in-flight table reserves up to 1024 entries whatever its count says.)
        prop_assert!(peak <= 4 * mutated.len() + 72 * 1024, "{} bytes for {}", peak, mutated.len());
        drop(decoded);
        let path = SyncQuery { replica: Some(replica), since: 3, max_bytes: 4096, refusals: true }.to_path();
        let _ = SyncQuery::from_path(&String::from_utf8_lossy(&mutate(path.as_bytes(), &edits)));
    }

    #[test]
    fn shared_formats_decode_mutated_encodings(
        endpoints in prop::collection::vec((any::<[u8; 4]>(), 1u16..), 0..8),
        blocks in prop::collection::vec(any::<u64>(), 0..16),
        edits in prop::collection::vec(edit(), 0..4),
    ) {
        let pool: Vec<Endpoint> = endpoints
            .iter()
            .filter_map(|(ip, port)| format!("{}.{}.{}.{}:{port}", ip[0], ip[1], ip[2], ip[3]).parse().ok())
            .collect();
        let encoded = encode_pool(&pool);
        prop_assert_eq!(decode_pool(&encoded), Some(pool.clone()));
        if let Some(&endpoint) = pool.first() {
            let entry = LogEntry { seq: 7, endpoint, at_ms: 9, blocks: blocks.clone(), from_peer: false, forget: blocks.len() % 2 == 0 };
            let bytes = entry.encode();
            prop_assert_eq!(LogEntry::decode(&bytes), Some(entry));
            // Mutations of a valid encoding: any outcome but a panic.
            let _ = LogEntry::decode(&mutate(&bytes, &edits));
        }
        let _ = decode_pool(&mutate(&encoded, &edits));
        // The scrape state (binary since issue 14): every kind of entry.
        let mut states = EndpointStates::default();
        for (i, &e) in pool.iter().enumerate() {
            let b = blocks.get(i).copied().unwrap_or(i as u64) >> 11;
            match b % 3 {
                0 => {
                    states.fail(e);
                }
                1 => states.reachable(e, b),
                _ => states.succeed_with_lora(e, MetricsSnapshot {
                    waiting: b as f64,
                    running: 1.5,
                    kv_usage: (b % 2 == 0).then_some(0.25),
                    kv_capacity_tokens: (b % 5 == 0).then_some(b),
                }, (b % 7 != 0).then(|| LoraSnapshot::from_labels(
                    &(0..b % 11).map(|k| format!("a{k}")).collect::<Vec<_>>().join(","),
                    if b % 2 == 0 { "w1,w2" } else { "" },
                    "2",
                )), b),
            }
            // Its /v1/models list (none, empty, up to the cap).
            if b % 4 != 1 {
                let n = [0, 1, 2, served::MAX_IDS][(b % 4) as usize];
                let ids = (0..n).map(|k| served::model_id(&format!("m{}", b.wrapping_add(k as u64)))).collect();
                states.listed(e, ServedModels::new(ids, b));
            }
        }
        let bytes = states.encode();
        prop_assert_eq!(EndpointStates::decode(&bytes), Some(states));
        let mutated = mutate(&bytes, &edits);
        let (decoded, peak) = peak_alloc(|| EndpointStates::decode(&mutated));
        // The entries as reserved for the most the bytes can hold, plus what
        // each one's lists hold (at most about the bytes they were read from).
        let entries = mutated.len() / MIN_ENTRY_BYTES * std::mem::size_of::<(Endpoint, ScrapeState)>();
        prop_assert!(peak <= entries + 2 * mutated.len() + 4096, "{} bytes for {}", peak, mutated.len());
        drop(decoded);
    }
}

/// `v` serialized with every object's keys in reverse order.
fn reverse_keys(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let items: Vec<String> = m
                .iter()
                .rev()
                .map(|(k, v)| format!("{}:{}", Value::from(k.as_str()), reverse_keys(v)))
                .collect();
            format!("{{{}}}", items.join(","))
        }
        Value::Array(a) => format!(
            "[{}]",
            a.iter().map(reverse_keys).collect::<Vec<_>>().join(",")
        ),
        v => v.to_string(),
    }
}
