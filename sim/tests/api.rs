//! The OpenAI API, SSE framing, the prefix cache seen through `usage` and `/metrics`,
//! over real HTTP against in-process pods.

mod common;

use common::*;
use kvroute_sim::{EngineFlavor, SimConfig};

#[test]
fn repeated_request_hits_the_cache_and_every_response_names_its_pod() {
    let s = TestSim::start(fast(2));
    let body = chat(&[("user", "Hello there, how are you today?")], 8, false);
    let first = post(&s.url(0, "/v1/chat/completions"), &body);
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.pod.as_deref(), Some("0"));
    let j = first.json();
    assert_eq!(j["object"], "chat.completion");
    assert_eq!(j["usage"]["completion_tokens"], 8);
    assert_eq!(j["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(j["choices"][0]["finish_reason"], "length");
    let text = j["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(text.len(), 8 * 4);

    let hits_before = metric(
        &get(&s.url(0, "/metrics")).body,
        "vllm:prefix_cache_hits_total",
        &[],
    )
    .unwrap();
    let again = post(&s.url(0, "/v1/chat/completions"), &body).json();
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0);
    assert_eq!(cached % 16, 0);
    // Same prompt, same seed: same answer.
    assert_eq!(again["choices"][0]["message"]["content"], text.as_str());
    let m = get(&s.url(0, "/metrics"));
    assert_eq!(m.pod.as_deref(), Some("0"));
    assert!(m.content_type.starts_with("text/plain"));
    let hits_after = metric(&m.body, "vllm:prefix_cache_hits_total", &[]).unwrap();
    assert_eq!(hits_after - hits_before, cached as f64);

    // Pod 1 is independent: its cache is cold.
    let other = post(&s.url(1, "/v1/chat/completions"), &body);
    assert_eq!(other.pod.as_deref(), Some("1"));
    assert_eq!(
        other.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );

    for path in ["/health", "/v1/models", "/sim/state", "/no/such/path"] {
        assert_eq!(get(&s.url(1, path)).pod.as_deref(), Some("1"), "{path}");
    }
    assert_eq!(get(&s.url(1, "/health")).status, 200);
    let models = get(&s.url(0, "/v1/models")).json();
    assert_eq!(models["data"][0]["id"], "meta-llama/Llama-3.1-8B-Instruct");
    assert_eq!(get(&s.url(0, "/nope")).status, 404);
}

#[test]
fn next_turn_hits_the_previous_prompt_and_answer() {
    let s = TestSim::start(fast(1));
    let user1 = "Please summarise the plot of a long novel about whales and a captain.";
    let t1 = post(
        &s.url(0, "/v1/chat/completions"),
        &chat(&[("user", user1)], 40, false),
    )
    .json();
    let p1 = t1["usage"]["prompt_tokens"].as_u64().unwrap();
    let answer = t1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let t2 = post(
        &s.url(0, "/v1/chat/completions"),
        &chat(
            &[
                ("user", user1),
                ("assistant", &answer),
                ("user", "Shorter, please."),
            ],
            4,
            false,
        ),
    )
    .json();
    let cached = t2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // At least every full block of turn 1's prompt, plus full blocks of the answer.
    assert!(
        cached >= p1 / 16 * 16,
        "cached {cached}, turn-1 prompt {p1}"
    );
    assert!(
        cached > p1,
        "generated blocks are cached too: cached {cached}, p1 {p1}"
    );
}

#[test]
fn lru_eviction_end_to_end() {
    // 8 blocks of 16 tokens; each request below needs 4 (about 53 prompt + 4 output tokens).
    let s = TestSim::start(SimConfig {
        kv_blocks: 8,
        ..fast(1)
    });
    let prompt = |c: char| c.to_string().repeat(190);
    let cached = |p: &str| {
        post(&s.url(0, "/v1/completions"), &completion(p, 4)).json()["usage"]
            ["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(cached(&prompt('a')), 0);
    assert_eq!(cached(&prompt('a')), 48);
    assert_eq!(cached(&prompt('b')), 0);
    // c needs 4 blocks, 2 are free: the 2 least recently used go, which are a's last
    // two blocks (a finished before b, and a sequence's tail is evicted first).
    assert_eq!(cached(&prompt('c')), 0);
    assert_eq!(cached(&prompt('b')), 48);
    assert_eq!(cached(&prompt('a')), 16);
    let st = get(&s.url(0, "/sim/state")).json();
    assert!(st["kv_blocks_cached"].as_u64().unwrap() <= 8);
    assert_eq!(st["kv_blocks_used"], 0);
    // Too long for the whole cache: a 400, not a hang.
    let r = post(
        &s.url(0, "/v1/completions"),
        &completion(&"x".repeat(1000), 4),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
}

fn sse_events(body: &str) -> Vec<&str> {
    assert!(body.ends_with("\n\n"), "{body:?}");
    body.split_terminator("\n\n")
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad event {e:?}"))
        })
        .collect()
}

#[test]
fn sse_framing_chat_and_completions() {
    for no_latency in [true, false] {
        let s = TestSim::start(SimConfig {
            no_latency,
            time_scale: 0.01,
            ..SimConfig::default()
        });
        let r = post(
            &s.url(0, "/v1/chat/completions"),
            &chat(&[("user", "stream me")], 5, true),
        );
        assert_eq!(r.status, 200);
        assert!(r.content_type.starts_with("text/event-stream"));
        let ev = sse_events(&r.body);
        assert_eq!(*ev.last().unwrap(), "[DONE]");
        let chunks: Vec<serde_json::Value> = ev[..ev.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        // role chunk + 5 token chunks + usage chunk
        assert_eq!(chunks.len(), 7, "{}", r.body);
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        let content: String = chunks[1..6]
            .iter()
            .map(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        assert_eq!(chunks[5]["choices"][0]["finish_reason"], "length");
        assert!(chunks[1..5]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null()));
        assert!(chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk"));
        assert_eq!(chunks[6]["usage"]["completion_tokens"], 5);
        assert_eq!(chunks[6]["choices"].as_array().unwrap().len(), 0);
        // The stream says what the non-streaming answer says.
        let full = post(
            &s.url(0, "/v1/chat/completions"),
            &chat(&[("user", "stream me")], 5, false),
        )
        .json();
        assert_eq!(full["choices"][0]["message"]["content"], content.as_str());

        let r = post(
            &s.url(0, "/v1/completions"),
            r#"{"prompt":"once upon a time","max_tokens":3,"stream":true}"#,
        );
        let ev = sse_events(&r.body);
        assert_eq!(ev.len(), 4, "{}", r.body); // 3 tokens, no usage chunk, [DONE]
        let last: serde_json::Value = serde_json::from_str(ev[2]).unwrap();
        assert_eq!(last["object"], "text_completion");
        assert_eq!(last["choices"][0]["finish_reason"], "length");
    }
}

#[test]
fn bad_input_is_an_openai_error_not_a_crash() {
    let s = TestSim::start(fast(1));
    for (path, body) in [
        ("/v1/chat/completions", "{not json"),
        ("/v1/chat/completions", r#"{"messages":[]}"#),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#,
        ),
        ("/v1/completions", r#"{"prompt":"x","n":3}"#),
        ("/v1/completions", ""),
        ("/v1/completions", "\u{0}\u{1}"),
    ] {
        let r = post(&s.url(0, path), body);
        assert_eq!(r.status, 400, "{path} {body:?}: {}", r.body);
        assert_eq!(r.pod.as_deref(), Some("0"));
        let j = r.json();
        assert_eq!(j["error"]["type"], "invalid_request_error");
        assert!(j["error"]["message"].as_str().is_some());
    }
    // Still serving.
    assert_eq!(
        post(&s.url(0, "/v1/completions"), &completion("ok", 1)).status,
        200
    );
}

#[test]
fn metrics_match_the_state() {
    let s = TestSim::start(fast(1));
    let mut prompt = 0;
    let mut gen = 0;
    let mut cached = 0;
    for i in 0..6 {
        let j = post(
            &s.url(0, "/v1/completions"),
            &completion(&"abcd".repeat(20 + i % 2), 3),
        )
        .json();
        prompt += j["usage"]["prompt_tokens"].as_u64().unwrap();
        gen += j["usage"]["completion_tokens"].as_u64().unwrap();
        cached += j["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
    }
    let m = get(&s.url(0, "/metrics")).body;
    let v = |n: &str, l: &[&str]| metric(&m, n, l).unwrap_or_else(|| panic!("no {n}"));
    assert_eq!(v("vllm:prompt_tokens_total", &[]), prompt as f64);
    assert_eq!(v("vllm:generation_tokens_total", &[]), gen as f64);
    assert_eq!(v("vllm:prefix_cache_hits_total", &[]), cached as f64);
    assert_eq!(v("vllm:prefix_cache_queries_total", &[]), prompt as f64);
    assert_eq!(
        v(
            "vllm:request_success_total",
            &["finished_reason=\"length\""]
        ),
        6.0
    );
    assert_eq!(v("vllm:time_to_first_token_seconds_count", &[]), 6.0);
    assert_eq!(v("vllm:num_requests_running", &[]), 0.0);
    assert_eq!(v("vllm:num_requests_waiting", &[]), 0.0);
    assert_eq!(v("vllm:kv_cache_usage_perc", &[]), 0.0);
    assert_eq!(
        v(
            "vllm:cache_config_info",
            &["block_size=\"16\"", "num_gpu_blocks=\"26000\""]
        ),
        1.0
    );
    assert!(m.contains("model_name=\"meta-llama/Llama-3.1-8B-Instruct\""));
    assert!(m.contains("engine=\"0\""));
    // Every sample has HELP and TYPE lines before it.
    for line in m.lines().filter(|l| !l.starts_with('#')) {
        let name = line.split(['{', ' ']).next().unwrap();
        let family = name
            .strip_suffix("_bucket")
            .or_else(|| name.strip_suffix("_count"))
            .or_else(|| name.strip_suffix("_sum"))
            .filter(|f| m.contains(&format!("# TYPE {f} histogram")))
            .unwrap_or(name);
        assert!(
            m.contains(&format!("# TYPE {family} ")),
            "no TYPE for {name}"
        );
    }
    let st = get(&s.url(0, "/sim/state")).json();
    assert_eq!(st["requests_served"], 6);
    assert_eq!(st["metrics_requests"], 1);
    assert_eq!(st["prefix_cache_hit_tokens"].as_u64(), Some(cached));
    assert_eq!(st["prefix_cache_query_tokens"].as_u64(), Some(prompt));
}

#[test]
fn sglang_flavour_names() {
    let s = TestSim::start(SimConfig {
        engine: EngineFlavor::Sglang,
        ..fast(1)
    });
    let body = completion(&"z".repeat(200), 2);
    post(&s.url(0, "/v1/completions"), &body);
    post(&s.url(0, "/v1/completions"), &body);
    let m = get(&s.url(0, "/metrics")).body;
    for name in [
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:cached_tokens_total",
        "sglang:time_to_first_token_seconds_count",
    ] {
        assert!(
            metric(&m, name, &["model_name="]).is_some(),
            "missing {name}"
        );
    }
    assert!(!m.contains("vllm:"));
    let rate = metric(&m, "sglang:cache_hit_rate", &[]).unwrap();
    assert!(rate > 0.3 && rate < 1.0, "{rate}");
    assert_eq!(metric(&m, "sglang:generation_tokens_total", &[]), Some(4.0));
    // The second request found the first's prompt cached (counted when it
    // finished, as SGLang does).
    let cached = metric(&m, "sglang:cached_tokens_total", &[]).unwrap();
    assert!(cached > 0.0, "{cached}");
}

#[test]
fn a_chat_stream_opens_with_its_first_token_not_before_the_prefill() {
    // vLLM writes the `delta.role` event on the engine's first output, after the
    // prefill; a router may take the first body bytes as "prefill done".
    use std::io::Read;
    let s = TestSim::start(SimConfig {
        time_scale: 1.0,
        ..SimConfig::default()
    });
    let prompt = "word ".repeat(8_000); // ~10k tokens: ~0.4 s of prefill
    let t0 = std::time::Instant::now();
    let mut res = agent()
        .post(&s.url(0, "/v1/chat/completions"))
        .header("content-type", "application/json")
        .send(chat(&[("user", &prompt)], 3, true))
        .expect("request");
    let mut first = [0u8; 1];
    res.body_mut()
        .as_reader()
        .read_exact(&mut first)
        .expect("first byte");
    let waited = t0.elapsed();
    assert!(
        waited >= std::time::Duration::from_millis(300),
        "first body byte after {waited:?}, before the prefill could finish"
    );
}

#[test]
fn lora_adapters_are_served_listed_and_reported() {
    let s = TestSim::start(SimConfig {
        lora_adapters: vec!["sql-lora".into(), "fin-lora".into()],
        max_loras: 1,
        ..fast(1)
    });
    let ask = |model: &str| {
        let body = serde_json::json!({"model": model, "prompt": "hello there", "max_tokens": 2});
        post(&s.url(0, "/v1/completions"), &body.to_string())
    };
    let r = ask("sql-lora");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["model"], "sql-lora");
    let base = SimConfig::default().model;
    assert_eq!(ask(&base).json()["model"], base.as_str());
    // A model the pod does not serve: vLLM's 404.
    let r = ask("nope-lora");
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(
        r.json()["error"]["message"],
        "The model `nope-lora` does not exist."
    );
    let ids: Vec<String> = get(&s.url(0, "/v1/models")).json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| format!("{}<{}", m["id"].as_str().unwrap(), m["parent"]))
        .collect();
    assert_eq!(
        ids,
        [
            format!("{base}<null"),
            format!("sql-lora<\"{base}\""),
            format!("fin-lora<\"{base}\"")
        ]
    );
    // The gauge: the current label set has the largest value; sql-lora was
    // loaded and has nothing running.
    let m = get(&s.url(0, "/metrics")).body;
    let line = m
        .lines()
        .filter(|l| l.starts_with("vllm:lora_requests_info{"))
        .max_by(|a, b| {
            let v = |l: &str| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap();
            v(a).total_cmp(&v(b))
        })
        .unwrap_or_else(|| panic!("no gauge in {m}"));
    assert!(
        line.starts_with(r#"vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""} "#),
        "{line}"
    );
    // Without --lora-adapters: any model is served and there is no gauge.
    let plain = TestSim::start(fast(1));
    let body = serde_json::json!({"model": "whatever", "prompt": "hi", "max_tokens": 2});
    assert_eq!(
        post(&plain.url(0, "/v1/completions"), &body.to_string()).status,
        200
    );
    assert!(!get(&plain.url(0, "/metrics")).body.contains("lora"));
}
