//! Unit tests of request parsing and the canonical prompt.

use super::completions::{NEXT_PROMPT, TOKEN_IDS};
use super::*;
use crate::prefix::block::{seed_with_tools, BlockHasher};
use serde_json::{json, Value};
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const CHAT: ApiKind = ApiKind::ChatCompletions;
const COMP: ApiKind = ApiKind::Completions;

/// One byte per block: the blocks then pin the canonical bytes exactly.
fn bytewise() -> PrefixConfig {
    PrefixConfig {
        block_tokens: 1,
        bytes_per_token: 1,
        max_prompt_tokens: 1 << 30,
        ..PrefixConfig::default()
    }
}

fn p(kind: ApiKind, body: &str) -> Result<InferenceRequest, RequestError> {
    parse(kind, body.as_bytes(), &bytewise())
}

/// Asserts that `body` canonicalizes to exactly `want`.
fn assert_canonical(kind: ApiKind, body: &str, want: &[u8]) {
    assert_canonical_with_tools(kind, body, None, want);
}

/// Asserts that `body` has the tools text `tools` (which seeds the prompt
/// and stands for its leading blocks) and the canonical messages `want`.
fn assert_canonical_with_tools(kind: ApiKind, body: &str, tools: Option<&[u8]>, want: &[u8]) {
    let r = p(kind, body).unwrap_or_else(|e| panic!("{body}: {e}"));
    let mut seed = seed(&r.model, r.cache_salt.as_deref());
    let lead = tools.map_or(0, |t| t.len());
    if let Some(t) = tools {
        seed = seed_with_tools(seed, xxhash_rust::xxh3::xxh3_64(t));
    }
    let mut h = BlockHasher::new(1, usize::MAX);
    h.write(want);
    let expect = h.finish(seed, lead);
    let same = r
        .blocks
        .iter()
        .zip(&expect)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(
        r.blocks == expect && r.prompt_bytes == lead + want.len(),
        "{body}\n first differing byte {same} of want {:?}",
        String::from_utf8_lossy(want)
    );
}

fn tokens(ids: &[u32]) -> Vec<u8> {
    let mut v = TOKEN_IDS.to_vec();
    for id in ids {
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

fn is_prefix(a: &[u64], b: &[u64]) -> bool {
    b.len() >= a.len() && b[..a.len()] == *a
}

#[test]
fn api_kind_from_path() {
    for (path, want) in [
        ("/v1/completions", Some(COMP)),
        ("/v1/chat/completions", Some(CHAT)),
        ("/v1/chat/completions?x=1", Some(CHAT)),
        ("/v1/completions#f", Some(COMP)),
        ("/v1/models", None),
        ("/v1/chat/completions/", None),
        ("", None),
    ] {
        assert_eq!(ApiKind::from_path(path), want, "{path}");
    }
}

#[test]
fn completions_prompt_shapes() {
    let mut batch = b"a".to_vec();
    batch.extend_from_slice(NEXT_PROMPT);
    batch.extend_from_slice(b"b\nc");
    let mut tok_batch = tokens(&[1, 2]);
    tok_batch.extend_from_slice(NEXT_PROMPT);
    tok_batch.extend_from_slice(&tokens(&[3]));
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (r#"{"model":"m","prompt":"hello"}"#, b"hello".to_vec()),
        (r#"{"model":"m","prompt":["hello"]}"#, b"hello".to_vec()),
        (
            r#"{"model":"m","prompt":"a\nb\u00e9"}"#,
            "a\nbé".as_bytes().to_vec(),
        ),
        (r#"{"model":"m","prompt":""}"#, vec![]),
        (r#"{"model":"m","prompt":["a","b\nc"]}"#, batch),
        (
            r#"{"model":"m","prompt":[1,2,4294967295]}"#,
            tokens(&[1, 2, u32::MAX]),
        ),
        (r#"{"model":"m","prompt":[[1,2,3]]}"#, tokens(&[1, 2, 3])),
        (r#"{"model":"m","prompt":[[1,2],[3]]}"#, tok_batch),
        (r#"{"model":"m","prompt":[[]]}"#, tokens(&[])),
        (
            r#"{"prompt":"x","messages":[{"role":"user","content":"ignored"}],"model":"m"}"#,
            b"x".to_vec(),
        ),
    ];
    for (body, want) in cases {
        assert_canonical(COMP, body, &want);
    }
}

#[test]
fn chat_message_shapes() {
    let cases: Vec<(&str, &str)> = vec![
        (
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            "hi<|user|><|end|>\n",
        ),
        (
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
            "hi<|user|><|end|>\n",
        ),
        (
            r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"developer","content":"d"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"input_text","text":"b"}]}]}"#,
            "s<|system|><|end|>\nd<|developer|><|end|>\na\nb<|user|><|end|>\n",
        ),
        (
            r#"{"model":"m","messages":[{"role":"user","name":"bob","content":"x"},{"role":"assistant","content":[{"type":"refusal","refusal":"no"}]}]}"#,
            "x<|user name=bob|><|end|>\nno<|assistant|><|end|>\n",
        ),
        (
            r#"{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"type":"function","id":"c1","function":{"name":"f","arguments":"{\"a\":1}"}}]},{"role":"tool","tool_call_id":"c1","content":"42"}]}"#,
            concat!(
                "<|assistant|><|tool_calls|>",
                r#"[{"function":{"arguments":"{\"a\":1}","name":"f"},"id":"c1","type":"function"}]"#,
                "<|end|>\n42<|tool tool_call_id=c1|><|end|>\n"
            ),
        ),
        // Empty / null tools and tool_calls are like absent ones.
        (
            r#"{"model":"m","tools":[],"messages":[{"role":"assistant","content":"a","tool_calls":[]}]}"#,
            "a<|assistant|><|end|>\n",
        ),
        (
            r#"{"model":"m","tools":null,"messages":[{"role":"assistant","tool_calls":null}]}"#,
            "<|assistant|><|end|>\n",
        ),
        // Fields of the other API and unknown fields are ignored.
        (
            r#"{"model":"m","prompt":"nope","x":{"y":[1,2]},"messages":[{"role":"user","content":"hi","extra":1}]}"#,
            "hi<|user|><|end|>\n",
        ),
    ];
    for (body, want) in cases {
        assert_canonical(CHAT, body, want.as_bytes());
    }
    // Tools seed the prompt and stand for its leading blocks, wherever
    // they are in the body.
    let tools = concat!(
        "<|tools|>\n",
        r#"[{"function":{"name":"f"},"type":"function"}]"#,
        "\n<|end|>\n"
    );
    for body in [
        r#"{"model":"m","tools":[{"type":"function","function":{"name":"f"}}],"messages":[{"role":"user","content":"q"}]}"#,
        r#"{"messages":[{"role":"user","content":"q"}],"model":"m","tools":[{"function":{"name":"f"},"type":"function"}]}"#,
    ] {
        assert_canonical_with_tools(CHAT, body, Some(tools.as_bytes()), b"q<|user|><|end|>\n");
    }
}

#[test]
fn fixture_turn1_pins_the_format() {
    let body = include_str!("../../../tests/fixtures/requests/chat-tools-turn1.json");
    let tools = concat!(
        "<|tools|>\n",
        r#"[{"function":{"description":"Current weather for a city","name":"get_weather","parameters":{"properties":{"city":{"type":"string"},"unit":{"enum":["celsius","fahrenheit"],"type":"string"}},"required":["city"],"type":"object"}},"type":"function"}]"#,
        "\n<|end|>\n",
    );
    let want = concat!(
        "You are a helpful assistant. Use the tools when they help.\nAnswer in one sentence.<|system|><|end|>\n",
        "What's the weather in Paris right now, in °C?<|user|><|end|>\n",
    );
    assert_canonical_with_tools(CHAT, body, Some(tools.as_bytes()), want.as_bytes());
    let r = p(CHAT, body).unwrap();
    assert_eq!(r.model, "Qwen/Qwen2.5-7B-Instruct");
    assert!(r.stream);
    assert_eq!(r.cache_salt, None);
}

#[test]
fn fixture_turn2_extends_turn1() {
    // Turn 2 is pretty-printed with every key order changed.
    let t1 = include_str!("../../../tests/fixtures/requests/chat-tools-turn1.json");
    let t2 = include_str!("../../../tests/fixtures/requests/chat-tools-turn2.json");
    for cfg in [bytewise(), PrefixConfig::default()] {
        let a = parse(CHAT, t1.as_bytes(), &cfg).unwrap();
        let b = parse(CHAT, t2.as_bytes(), &cfg).unwrap();
        assert!(b.prompt_bytes > a.prompt_bytes);
        assert!(
            is_prefix(&a.blocks, &b.blocks),
            "turn 2 does not extend turn 1"
        );
        assert!(b.blocks.len() > a.blocks.len());
    }
}

#[test]
fn fixtures_parse() {
    let vision = include_str!("../../../tests/fixtures/requests/chat-vision.json");
    let r = p(CHAT, vision).unwrap();
    assert_eq!(r.cache_salt.as_deref(), Some("tenant-42"));
    assert!(!r.stream);
    let d = "Describe images precisely.<|developer|><|end|>\n".len();
    let u = "What is in this image?\n<|image_url:0123456789abcdef|>\n<|image_url:0123456789abcdef|><|user|><|end|>\n".len();
    assert_eq!(r.prompt_bytes, d + u, "media parts are fixed-size digests");

    let toks = include_str!("../../../tests/fixtures/requests/completions-tokens.json");
    let r = p(COMP, toks).unwrap();
    assert_eq!(
        r.prompt_bytes,
        2 * (TOKEN_IDS.len() + 6 * 4) + NEXT_PROMPT.len()
    );

    let text = include_str!("../../../tests/fixtures/requests/completions-text.json");
    let r = p(COMP, text).unwrap();
    let want = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n".len();
    assert_eq!(r.prompt_bytes, want);
    assert_eq!(r.prompt_tokens(&PrefixConfig::default()), (want / 4) as u64);
    let empty = p(COMP, r#"{"model":"m","prompt":""}"#).unwrap();
    assert_eq!(
        empty.prompt_tokens(&PrefixConfig::default()),
        1,
        "at least 1"
    );
}

#[test]
fn media_digest_is_stable_and_distinct() {
    let body = |url: &str, detail: &str| {
        json!({"model":"m","messages":[{"role":"user","content":[
            {"type":"image_url","image_url":{"url":url,"detail":detail}}]}]})
        .to_string()
    };
    let a = p(CHAT, &body("https://x/a.png", "low")).unwrap();
    let a2 = p(CHAT, &body("https://x/a.png", "high")).unwrap();
    let b = p(CHAT, &body("https://x/b.png", "low")).unwrap();
    assert_eq!(a.blocks, a2.blocks, "detail is not part of the image");
    assert_ne!(a.blocks, b.blocks);
    let big = format!("data:image/png;base64,{}", "A".repeat(3 << 20));
    let c = p(CHAT, &body(&big, "auto")).unwrap();
    assert_eq!(c.prompt_bytes, a.prompt_bytes, "a 3 MiB image is a digest");
    // Other media and unknown part types are digests too.
    let other = json!({"model":"m","messages":[{"role":"user","content":[
        {"type":"input_audio","input_audio":{"data":"UklGRg==","format":"wav"}},
        {"type":"video_url","video_url":{"url":"https://x/v.mp4"}},
        {"type":"file","file":{"file_id":"file-1"}},
        {"type":"something_new","whatever":[1,2]}]}]});
    assert!(p(CHAT, &other.to_string()).is_ok());
}

/// A conversation: tools, system, then turns of user / assistant (with a
/// tool round trip on turn 2).
fn conversation_turns(tools: bool) -> Vec<String> {
    let mut msgs = vec![
        json!({"role":"system","content":"Be brief."}),
        json!({"role":"user","content":"Plan a trip to Rome."}),
    ];
    let mut turns = Vec::new();
    let push = |msgs: &Vec<Value>, turns: &mut Vec<String>| {
        let mut b = json!({"model":"m","cache_salt":"s","messages":msgs});
        if tools {
            b["tools"] = json!([{"type":"function","function":{"name":"search","parameters":{"type":"object"}}}]);
        }
        turns.push(b.to_string());
    };
    push(&msgs, &mut turns);
    msgs.push(json!({"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"search","arguments":"{\"q\":\"Rome\"}"}}]}));
    msgs.push(
        json!({"role":"tool","tool_call_id":"c1","content":"Colosseum, Vatican, Trastevere"}),
    );
    push(&msgs, &mut turns);
    msgs.push(json!({"role":"assistant","content":"Day 1: Colosseum. Day 2: Vatican."}));
    msgs.push(json!({"role":"user","content":[{"type":"text","text":"Add food tips."},{"type":"image_url","image_url":{"url":"https://x/menu.jpg"}}]}));
    push(&msgs, &mut turns);
    msgs.push(json!({"role":"assistant","content":"Try cacio e pepe.\n".repeat(40)}));
    msgs.push(json!({"role":"user","content":"Thanks!"}));
    push(&msgs, &mut turns);
    turns
}

#[test]
fn chat_turn_n_plus_one_extends_turn_n() {
    for tools in [false, true] {
        for cfg in [
            bytewise(),
            PrefixConfig::default(),
            PrefixConfig {
                block_tokens: 3,
                bytes_per_token: 1,
                ..PrefixConfig::default()
            },
        ] {
            let turns = conversation_turns(tools);
            let reqs: Vec<_> = turns
                .iter()
                .map(|t| parse(CHAT, t.as_bytes(), &cfg).unwrap())
                .collect();
            for w in reqs.windows(2) {
                assert!(
                    is_prefix(&w[0].blocks, &w[1].blocks),
                    "tools={tools} {cfg:?}"
                );
                assert!(w[1].prompt_bytes > w[0].prompt_bytes);
            }
        }
    }
    // Tools change everything after them: they come first (in the seed).
    let with = p(CHAT, &conversation_turns(true)[0]).unwrap();
    let without = p(CHAT, &conversation_turns(false)[0]).unwrap();
    assert!(with.blocks.iter().all(|b| !without.blocks.contains(b)));
    assert!(with.prompt_bytes > without.prompt_bytes);
}

#[test]
fn each_turn_finds_the_previous_turns_leaf() {
    for tools in [false, true] {
        for cfg in [
            PrefixConfig::default(),
            PrefixConfig {
                block_tokens: 16,
                ..PrefixConfig::default()
            },
        ] {
            let reqs: Vec<_> = conversation_turns(tools)
                .iter()
                .map(|t| parse(CHAT, t.as_bytes(), &cfg).unwrap())
                .collect();
            let mut leaves = 0;
            for w in reqs.windows(2) {
                let k = w[0].blocks.len();
                let learned = w[0].learned();
                assert_eq!(learned[..k], w[0].blocks[..]);
                let Some(leaf) = w[0].leaves.leaf() else {
                    assert_eq!(learned.len(), k);
                    continue;
                };
                leaves += 1;
                assert_eq!(learned[k..], [leaf]);
                assert!(
                    w[1].prompt().leaves.unwrap().at(k).any(|(_, h)| h == leaf),
                    "tools={tools} {cfg:?} turn of {k} blocks"
                );
                // Never a block of the next turn.
                assert!(!w[1].blocks.contains(&leaf));
            }
            assert!(leaves >= 2, "tools={tools} {cfg:?}: {leaves} leaves");
        }
    }
    // A turn shorter than a block: no block, yet a leaf to learn.
    let short = parse(
        CHAT,
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        &PrefixConfig::default(),
    )
    .unwrap();
    assert!(short.blocks.is_empty());
    assert_eq!(
        short.leaves.leaf_sixteenths(),
        1,
        "18 bytes: one 16-byte piece"
    );
    assert_eq!(short.learned().len(), 1);
    // One byte per block: no room for checkpoints, no leaf.
    let b = p(CHAT, &conversation_turns(false)[0]).unwrap();
    assert_eq!(b.leaves.leaf(), None);
    assert_eq!(b.learned(), b.blocks);
}

#[test]
fn completions_continuation_extends_prefix() {
    let mut prompt = String::from("User: hello\nAssistant:");
    let mut ids: Vec<u32> = vec![128000, 1, 2, 3];
    let mut prev: Option<(InferenceRequest, InferenceRequest)> = None;
    for turn in 0..4 {
        let text = p(COMP, &json!({"model":"m","prompt":prompt}).to_string()).unwrap();
        let toks = p(COMP, &json!({"model":"m","prompt":ids}).to_string()).unwrap();
        if let Some((pt, pk)) = &prev {
            assert!(is_prefix(&pt.blocks, &text.blocks), "turn {turn}");
            assert!(is_prefix(&pk.blocks, &toks.blocks), "turn {turn}");
        }
        prompt.push_str(&format!(
            " answer {turn}\nUser: more \"{turn}\"\nAssistant:"
        ));
        ids.extend([10 + turn, 20, 30]);
        prev = Some((text, toks));
    }
}

#[test]
fn missing_model_is_the_default_models_namespace() {
    let cfg = PrefixConfig::default();
    let prompt = "x".repeat(600);
    let get = |b: Value| parse(COMP, b.to_string().as_bytes(), &cfg).unwrap();
    let none = get(json!({"prompt": prompt}));
    assert_eq!(none.model, "");
    assert_eq!(none.blocks.len(), 2);
    assert_eq!(
        get(json!({"model": null, "prompt": prompt})).blocks,
        none.blocks
    );
    assert_eq!(
        get(json!({"model": "", "prompt": prompt})).blocks,
        none.blocks
    );
    assert_ne!(
        get(json!({"model": "m", "prompt": prompt})).blocks,
        none.blocks
    );
    assert_eq!(
        parse(COMP, br#"{"model":5,"prompt":"x"}"#, &cfg),
        Err(RequestError::WrongType("model"))
    );
}

#[test]
fn model_and_salt_separate_blocks() {
    let body = |model: &str, salt: Value| {
        json!({"model":model,"cache_salt":salt,"prompt":"x".repeat(600)}).to_string()
    };
    let cfg = PrefixConfig::default();
    let get = |b: String| parse(COMP, b.as_bytes(), &cfg).unwrap().blocks;
    let base = get(body("a", Value::Null));
    assert_eq!(base.len(), 2);
    for other in [
        get(body("b", Value::Null)),
        get(body("a", json!("s1"))),
        get(body("A", Value::Null)),
    ] {
        assert_eq!(other.len(), 2);
        assert!(base.iter().all(|h| !other.contains(h)), "shared block hash");
    }
    assert_ne!(get(body("a", json!("s1"))), get(body("a", json!("s2"))));
    assert_eq!(get(body("a", json!(""))), base, "empty salt = no salt");
    let r = parse(COMP, body("a", json!("")).as_bytes(), &cfg).unwrap();
    assert_eq!(r.cache_salt.as_deref(), Some(""));
}

#[test]
fn bad_input_is_an_error() {
    use RequestError::*;
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let cases: Vec<(ApiKind, String, RequestError)> = vec![
        (COMP, "".into(), InvalidJson(String::new())),
        (COMP, "not json".into(), InvalidJson(String::new())),
        (COMP, r#"{"model":"m","prompt":"x""#.into(), InvalidJson(String::new())),
        (COMP, r#"{"model":"m","prompt":"x"} trailing"#.into(), InvalidJson(String::new())),
        (COMP, r#"{"model":"m","prompt":"x",}"#.into(), InvalidJson(String::new())),
        (CHAT, format!(r#"{{"model":"m","messages":[{{"role":"a","tool_calls":{}}}]}}"#, deep(200)), InvalidJson(String::new())),
        (CHAT, format!(r#"{{"model":"m","tools":{},"messages":[{{"role":"user","content":"x"}}]}}"#, deep(200)), InvalidJson(String::new())),
        // The prompt's own shape stops at depth 3: a type error, no recursion.
        (COMP, format!(r#"{{"model":"m","prompt":{}}}"#, deep(100_000)), WrongType("prompt")),
        (COMP, "[]".into(), WrongType("body")),
        (COMP, "\"str\"".into(), WrongType("body")),
        (COMP, "null".into(), WrongType("body")),
        (COMP, r#"{"model":5,"prompt":"x"}"#.into(), WrongType("model")),
        (COMP, r#"{"model":"m","stream":"yes","prompt":"x"}"#.into(), WrongType("stream")),
        (COMP, r#"{"model":"m","cache_salt":1,"prompt":"x"}"#.into(), WrongType("cache_salt")),
        (COMP, r#"{"model":"m","prompt":5}"#.into(), WrongType("prompt")),
        (COMP, r#"{"model":"m","prompt":{"a":1}}"#.into(), WrongType("prompt")),
        (COMP, r#"{"model":"m","prompt":[1,"a"]}"#.into(), WrongType("prompt")),
        (COMP, r#"{"model":"m","prompt":["a",[1]]}"#.into(), WrongType("prompt")),
        (COMP, r#"{"model":"m","prompt":[-1]}"#.into(), WrongType("prompt")),
        (COMP, r#"{"model":"m","prompt":[1.5]}"#.into(), WrongType("prompt")),
        (COMP, r#"{"model":"m","prompt":[4294967296]}"#.into(), WrongType("prompt")),
        (COMP, r#"{"model":"m","prompt":[[1,"a"]]}"#.into(), WrongType("prompt")),
        (COMP, r#"{"model":"m","prompt":[[[1]]]}"#.into(), WrongType("prompt")),
        (CHAT, r#"{"model":"m","messages":"hi"}"#.into(), WrongType("messages")),
        (CHAT, r#"{"model":"m","messages":[{"content":"no role"}]}"#.into(), WrongType("messages")),
        (CHAT, r#"{"model":"m","messages":[{"role":7,"content":"x"}]}"#.into(), WrongType("messages")),
        (CHAT, r#"{"model":"m","messages":[{"role":"user","content":5}]}"#.into(), WrongType("messages")),
        (CHAT, r#"{"model":"m","messages":[{"role":"user","content":[{"text":"no type"}]}]}"#.into(), WrongType("messages")),
        (CHAT, r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":5}]}]}"#.into(), WrongType("messages")),
        (CHAT, r#"{"model":"m","messages":[{"role":"user","content":"x","content":"y"}]}"#.into(), WrongType("messages")),
        (CHAT, r#"{"model":"m","tools":{"a":1},"messages":[{"role":"user","content":"x"}]}"#.into(), WrongType("tools")),
        (COMP, r#"{"model":"m"}"#.into(), MissingPrompt),
        (COMP, r#"{"model":"m","prompt":null}"#.into(), MissingPrompt),
        (COMP, r#"{"model":"m","prompt":[]}"#.into(), MissingPrompt),
        (COMP, r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#.into(), MissingPrompt),
        (CHAT, r#"{"model":"m","messages":[]}"#.into(), MissingPrompt),
        (CHAT, r#"{"model":"m","prompt":"x"}"#.into(), MissingPrompt),
    ];
    for (kind, body, want) in cases {
        let got = p(kind, &body).expect_err(&body);
        match (&got, &want) {
            (InvalidJson(_), InvalidJson(_)) => {}
            _ => assert_eq!(got, want, "{}", &body[..body.len().min(120)]),
        }
        assert!(!got.to_string().is_empty());
    }
}

#[test]
fn non_utf8_is_an_error() {
    let bodies: [&[u8]; 4] = [
        b"{\"model\":\"m\",\"prompt\":\"a\xff\"}",
        b"{\"model\":\"m\",\"ignored\":\"\xc3\x28\",\"prompt\":\"a\"}",
        b"\xef\xbb\xbf\xff{}",
        b"{\"model\":\"m\xed\xa0\x80\",\"prompt\":\"a\"}",
    ];
    for b in bodies {
        assert!(
            matches!(
                parse(COMP, b, &bytewise()),
                Err(RequestError::InvalidJson(_))
            ),
            "{b:?}"
        );
    }
}

#[test]
fn last_duplicate_key_wins() {
    assert_canonical(
        COMP,
        r#"{"model":"x","prompt":"first","model":"m","prompt":"second"}"#,
        b"second",
    );
    assert_eq!(
        p(COMP, r#"{"model":"x","model":"m","prompt":""}"#)
            .unwrap()
            .model,
        "m"
    );
}

#[test]
fn huge_prompts_are_capped_not_refused() {
    let cfg = PrefixConfig::default(); // 256-byte blocks, 16384 max
    let big = "a".repeat(8 << 20);
    let r = parse(
        COMP,
        json!({"model":"m","prompt":big}).to_string().as_bytes(),
        &cfg,
    )
    .unwrap();
    assert_eq!(r.prompt_bytes, 8 << 20);
    assert_eq!(r.blocks.len(), cfg.max_blocks());
    // Escapes force an owned copy of the string; same result shape.
    let escaped = "line\n\"q\"\t".repeat(200_000);
    let r = parse(
        COMP,
        json!({"model":"m","prompt":escaped}).to_string().as_bytes(),
        &cfg,
    )
    .unwrap();
    assert_eq!(r.prompt_bytes, escaped.len());
    assert_eq!(r.blocks.len(), (escaped.len() / 256).min(cfg.max_blocks()));
    // A small cap.
    let capped = PrefixConfig {
        max_prompt_tokens: 640,
        ..cfg.clone()
    };
    let r = parse(
        COMP,
        json!({"model":"m","prompt":escaped}).to_string().as_bytes(),
        &capped,
    )
    .unwrap();
    assert_eq!(r.blocks.len(), 10);
    // Many messages.
    let msgs: Vec<Value> = (0..100_000)
        .map(|i| json!({"role":"user","content":i.to_string()}))
        .collect();
    let r = parse(
        CHAT,
        json!({"model":"m","messages":msgs}).to_string().as_bytes(),
        &cfg,
    )
    .unwrap();
    assert!(r.prompt_bytes > 100_000 * 20);
    // Many tokens.
    let ids: Vec<u32> = (0..1_000_000).collect();
    let r = parse(
        COMP,
        json!({"model":"m","prompt":ids}).to_string().as_bytes(),
        &cfg,
    )
    .unwrap();
    assert_eq!(r.prompt_bytes, TOKEN_IDS.len() + 4_000_000);
    assert_eq!(r.prompt_tokens(&cfg), 1_000_003);
}

#[test]
fn deep_nesting_in_ignored_fields_does_not_overflow() {
    // serde_json skips ignored values without recursion: accepted, no panic.
    let deep = format!("{}{}", "[".repeat(200_000), "]".repeat(200_000));
    let body = format!(r#"{{"model":"m","extra":{deep},"prompt":"x"}}"#);
    assert_canonical(COMP, &body, b"x");
    let body =
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x","meta":{deep}}}]}}"#);
    assert!(p(CHAT, &body).is_ok());
}

#[test]
fn mutated_fixtures_never_panic() {
    let fixtures: [&str; 5] = [
        include_str!("../../../tests/fixtures/requests/chat-tools-turn1.json"),
        include_str!("../../../tests/fixtures/requests/chat-tools-turn2.json"),
        include_str!("../../../tests/fixtures/requests/chat-vision.json"),
        include_str!("../../../tests/fixtures/requests/completions-tokens.json"),
        include_str!("../../../tests/fixtures/requests/completions-text.json"),
    ];
    let noise = b"[]{}\",:\\0-e9.nulltruefalse\xff\x00\xc3";
    let mut rng = fastrand::Rng::with_seed(11);
    let cfg = PrefixConfig {
        block_tokens: 2,
        bytes_per_token: 1,
        ..PrefixConfig::default()
    };
    for i in 0..3000 {
        let mut b = fixtures[i % fixtures.len()].as_bytes().to_vec();
        for _ in 0..rng.usize(1..4) {
            let at = rng.usize(0..b.len());
            match rng.u8(0..4) {
                0 => b.truncate(at),
                1 => b[at] = noise[rng.usize(0..noise.len())],
                2 => b.insert(at, noise[rng.usize(0..noise.len())]),
                _ => {
                    b.remove(at);
                }
            }
            if b.is_empty() {
                break;
            }
        }
        for kind in [CHAT, COMP] {
            let _ = parse(kind, &b, &cfg);
        }
    }
}

#[test]
fn tools_and_tool_calls_over_the_value_budget_are_too_complex() {
    let cfg = PrefixConfig {
        max_json_nodes: 9,
        ..bytewise()
    };
    // [ {type: "function", function: {name: "f"}} ] = array, object, 2 keys,
    // 2 values, 1 key + 1 value inside: 8 values and keys.
    let tools = r#"[{"type":"function","function":{"name":"f"}}]"#;
    let chat = |tools: &str, calls: &str| {
        format!(
            r#"{{"model":"m","tools":{tools},"messages":[{{"role":"assistant","tool_calls":{calls}}}]}}"#
        )
    };
    assert!(parse(CHAT, chat(tools, "[]").as_bytes(), &cfg).is_ok());
    // The budget is per request: tools and every message's tool_calls.
    assert_eq!(
        parse(CHAT, chat(tools, "[1,2]").as_bytes(), &cfg),
        Err(RequestError::TooComplex)
    );
    assert!(
        matches!(
            parse(CHAT, chat("[]", &"[".repeat(10)).as_bytes(), &cfg),
            Err(RequestError::InvalidJson(_))
        ),
        "broken JSON stays InvalidJson"
    );
    let nested = format!("{}{}", "[".repeat(10), "]".repeat(10));
    assert_eq!(
        parse(CHAT, chat("[]", &nested).as_bytes(), &cfg),
        Err(RequestError::TooComplex)
    );
}

#[test]
fn past_the_cap_elements_are_counted_not_read() {
    // 4-byte blocks, at most 8 of them: 32 canonical bytes are hashed.
    let cfg = PrefixConfig {
        block_tokens: 4,
        bytes_per_token: 1,
        max_prompt_tokens: 32,
        ..PrefixConfig::default()
    };
    let head = r#"{"role":"user","content":"0123456789abcdef0123456789abcdef"}"#;
    let good = format!(r#"{{"model":"m","messages":[{head}]}}"#);
    // Past the cap, later messages and parts are skipped unread: a malformed
    // one no longer matters to routing; its length still counts.
    let tail = r#"{"no_role":1,"content":[{"type":5}]}"#;
    let long = format!(r#"{{"model":"m","messages":[{head},{tail}]}}"#);
    let a = parse(CHAT, good.as_bytes(), &cfg).unwrap();
    let b = parse(CHAT, long.as_bytes(), &cfg).unwrap();
    assert_eq!(a.blocks.len(), 8);
    assert_eq!(a.blocks, b.blocks);
    assert_eq!(b.prompt_bytes, a.prompt_bytes + tail.len());
    // Content parts past the cap, likewise.
    let parts = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"{}"}},{{"bad":[]}}]}}]}}"#,
        "x".repeat(40)
    );
    let r = parse(CHAT, parts.as_bytes(), &cfg).unwrap();
    assert_eq!(r.blocks.len(), 8);
    assert_eq!(
        r.prompt_bytes,
        40 + 1 + r#"{"bad":[]}"#.len() + "<|user|><|end|>\n".len()
    );
    // Before the cap the same malformed message is a type error.
    let early = format!(r#"{{"model":"m","messages":[{tail},{head}]}}"#);
    assert_eq!(
        parse(CHAT, early.as_bytes(), &cfg),
        Err(RequestError::WrongType("messages"))
    );
}

#[test]
fn message_field_order_does_not_matter() {
    let want = "42<|tool name=n tool_call_id=c1|><|tool_calls|>[1]<|end|>\n";
    for body in [
        r#"{"model":"m","messages":[{"role":"tool","content":"42","name":"n","tool_call_id":"c1","tool_calls":[1]}]}"#,
        r#"{"model":"m","messages":[{"tool_calls":[1],"content":"42","tool_call_id":"c1","name":"n","role":"tool"}]}"#,
        r#"{"model":"m","messages":[{"name":"n","role":"tool","x":{"y":1},"tool_call_id":"c1","content":"42","tool_calls":[1]}]}"#,
    ] {
        assert_canonical(CHAT, body, want.as_bytes());
    }
    for body in [
        r#"{"model":"m","messages":[{"role":"a","role":"b","content":"x"}]}"#,
        r#"{"model":"m","messages":[{"content":"x","role":"a","content":"y"}]}"#,
        r#"{"model":"m","messages":[{"role":"a","name":"x","name":"y"}]}"#,
    ] {
        assert_eq!(
            p(CHAT, body),
            Err(RequestError::WrongType("messages")),
            "{body}"
        );
    }
}
