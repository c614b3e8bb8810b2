//! The predicted-TTFT profile (issue 12) through the real Envoy and real
//! kvroute-sim pods: the debug header shows every candidate's prediction
//! and its parts, the model learns each pod's rates from streaming first
//! bytes (a pod made slow is learnt slow and sent less), and conversations
//! keep their affinity; `keep_cheaper_holder` keeps a document on its
//! holder, `leave_costlier_holder` moves a short prompt off a queueing one,
//! and both say so; `slot_wait` moves a turn or a new conversation off a
//! pod whose slots are all taken; agents sharing a tool prompt reach every
//! pod.

mod support;

use serde_json::{json, Value};
use support::*;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const DEBUG: &str = "x-kvroute-debug";

fn envoy(sim: &Sim) -> Envoy {
    Envoy::start(
        &sim.endpoints(),
        json!({"debug_header": DEBUG, "scheduling": {"profile": "predicted_ttft"}}),
        1,
    )
}

/// (endpoint, predicted ms, ms per token) of each candidate in the header.
fn predictions(r: &Reply) -> Vec<(String, f64, f64)> {
    let d = r.header(DEBUG).expect("debug header");
    let ttft = d
        .split("; ttft=")
        .nth(1)
        .expect("predictions in the header");
    ttft.split("),")
        .map(|c| {
            let (ep, rest) = c.split_once('=').unwrap();
            let ms: f64 = rest.split("ms(").next().unwrap().parse().unwrap();
            let per_tok: f64 = rest
                .split(" x ")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            (ep.to_string(), ms, per_tok)
        })
        .collect()
}

fn long_prompt(tag: &str) -> String {
    format!("{tag} ").repeat(1_500)
}

fn stream_body(tag: &str) -> Value {
    json!({"model": MODEL, "prompt": long_prompt(tag), "max_tokens": 2, "stream": true})
}

fn stream(envoy: &Envoy, tag: &str) {
    let (times, _) = sse_events(envoy.port, "/v1/completions", &stream_body(tag));
    assert!(!times.is_empty(), "no stream for {tag}");
}

/// The predicted ms per token of endpoint `ep` in `predictions`.
fn rate_of(predictions: &[(String, f64, f64)], ep: &str) -> f64 {
    predictions
        .iter()
        .find(|(e, _, _)| e == ep)
        .map(|(_, _, r)| *r)
        .unwrap_or_else(|| panic!("no prediction for {ep}: {predictions:?}"))
}

/// A non-streaming request (it teaches nothing), answered by any pod.
fn probe_any(envoy: &Envoy, tag: &str) -> Reply {
    let body: Value = json!({"model": MODEL, "prompt": long_prompt(tag), "max_tokens": 1});
    post_json(&envoy.url("/v1/completions"), &body)
}

fn probe(envoy: &Envoy, tag: &str) -> Reply {
    let r = probe_any(envoy, tag);
    assert_eq!(r.status, 200, "{}", r.body);
    r
}

#[test]
fn predictions_are_visible_learnt_and_steer_away_from_a_slow_pod() {
    let sim = Sim::start(3, &["--time-scale", "0.2"]);
    let envoy = envoy(&sim);
    // Before any stream: every candidate at the prior rate (0.1 ms/token).
    let first = predictions(&probe(&envoy, "probe-0"));
    assert_eq!(first.len(), 3, "{first:?}");
    assert!(
        first.iter().all(|(_, _, r)| (*r - 0.1).abs() < 1e-9),
        "{first:?}"
    );

    // Pod 0 becomes slow; streams teach every pod's rate.
    sim.fault(0, json!({"extra_latency_ms": 400}));
    for i in 0..24 {
        stream(&envoy, &format!("learn-{i}"));
    }
    let learnt = predictions(&probe(&envoy, "probe-1"));
    let rate = |i: usize| rate_of(&learnt, &sim.endpoint(i));
    assert!(
        learnt.iter().any(|(_, _, r)| (*r - 0.1).abs() > 1e-3),
        "nothing learnt: {learnt:?}"
    );
    // The slow pod is learnt the slowest (its factor over the fleet).
    assert!(rate(0) > rate(1).max(rate(2)), "{learnt:?}");
    assert!(rate(0) > 1.5 * rate(1).min(rate(2)), "{learnt:?}");

    // New requests now avoid the slow pod.
    let before = sim.state(0)["requests_served"].as_u64().unwrap_or(0);
    for i in 0..12 {
        stream(&envoy, &format!("after-{i}"));
    }
    let to_slow = sim.state(0)["requests_served"].as_u64().unwrap_or(0) - before;
    assert!(
        to_slow <= 2,
        "{to_slow} of 12 new requests went to the slow pod"
    );

    // Affinity holds: the same prompt again goes where it was cached. Each
    // candidate shows its charge for leaving the holder: none on the
    // holder. (The others' can round to 0 here: on a quiet fleet it is
    // about one step, and the learnt step may be under half a ms.)
    let again = probe(&envoy, "after-3");
    let debug = again.header(DEBUG).unwrap();
    assert!(debug.contains("reason=Prefix"), "{debug}");
    let holder = again.pod().expect("pod header");
    for i in 0..3 {
        let part = debug
            .split(&format!("{}=", sim.endpoint(i)))
            .last()
            .and_then(|p| p.split("charged ").nth(1))
            .and_then(|p| p.split(')').next())
            .unwrap_or_else(|| panic!("no charge for pod {i}: {debug}"));
        let charged: f64 = part.parse().unwrap();
        assert!(charged >= 0.0, "pod {i}: {debug}");
        if i == holder {
            assert_eq!(charged, 0.0, "{debug}");
        }
    }
}

/// `scheduling.keep_cheaper_holder` with the default `weighted` profile: a
/// 30k-token document's holder reports a queue deep enough for the overload
/// filter to drop it. Without the flag the follow-up question goes to the
/// other pod by load (the whole document prefilled again); with it the TTFT
/// model prices the short queue of short requests below that prefill, keeps
/// the holder, and says so in the debug header and the stats.
#[test]
fn keep_cheaper_holder_keeps_a_document_on_its_queueing_holder() {
    let doc = "the contract says the following about liability ".repeat(2_500);
    let ask = |envoy: &Envoy, question: &str| {
        let body = json!({"model": MODEL, "max_tokens": 1, "prompt": format!("{doc}\n{question}")});
        let r = post_json(&envoy.url("/v1/completions"), &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r
    };
    for keep in [false, true] {
        let sim = Sim::start(2, &["--time-scale", "0.05"]);
        let envoy = Envoy::start(
            &sim.endpoints(),
            json!({"debug_header": DEBUG, "scheduling": {"keep_cheaper_holder": keep}}),
            1,
        );
        // Short requests first: the model prices queued requests kvroute
        // did not send at the mean size of those it routed.
        for i in 0..10 {
            probe_short(&envoy, i);
        }
        let holder = ask(&envoy, "Who pays?").pod().expect("pod header");
        // Its engine now queues 9 requests kvroute did not send (the overload
        // filter drops an endpoint 8 deeper than the least loaded).
        sim.fault(holder, json!({"queue_inflate": 9}));
        std::thread::sleep(std::time::Duration::from_millis(300));
        let r = ask(&envoy, "Who pays, and when?");
        let debug = r.header(DEBUG).expect("debug header").to_string();
        let kept = envoy.stat("wasmcustom.kvroute.decision.kept_by_cost");
        if keep {
            assert_eq!(r.pod(), Some(holder), "{debug}");
            assert!(debug.contains("reason=Prefix"), "{debug}");
            let other = sim.endpoint(1 - holder);
            assert!(
                debug.contains(&format!("kept_by_cost={}=", sim.endpoint(holder)))
                    && debug.contains(&format!(" over {other}=")),
                "{debug}"
            );
            assert_eq!(kept, 1.0);
        } else {
            assert_eq!(r.pod(), Some(1 - holder), "{debug}");
            assert!(debug.contains("reason=Load"), "{debug}");
            assert!(!debug.contains("kept_by_cost"), "{debug}");
            assert_eq!(kept, 0.0);
        }
    }
}

/// `scheduling.slot_wait` with the default `weighted` profile, engines
/// that prefill in steps of a token budget (kvroute-sim, as vLLM): a
/// document of ~37k tokens takes its holder about 2 s, and the questions
/// sent meanwhile queue behind it, so scrape after scrape the holder runs 1
/// request with 10 waiting. That is no slot limit: every one of them is
/// kvroute's, none past its first byte. Taken for a limit of 1 (before 6
/// Dec 2026) the next question was priced to wait for 12 whole requests
/// (1 s each until streams teach otherwise) and left to prefill the
/// document again on the idle pod.
#[test]
fn a_document_prefilling_with_its_questions_queued_keeps_the_next_one() {
    let doc = "the contract says the following about liability ".repeat(3_000);
    let body = |question: &str| json!({"model": MODEL, "max_tokens": 1, "prompt": format!("{doc}\n{question}")});
    let sim = Sim::start(2, &[]);
    let envoy = Envoy::start(&sim.endpoints(), json!({"debug_header": DEBUG}), 1);
    let url = envoy.url("/v1/completions");
    let ask = move |question: String| {
        let url = url.clone();
        let body = body(&question);
        std::thread::spawn(move || post_json(&url, &body))
    };
    let first = ask("Who pays?".into());
    std::thread::sleep(std::time::Duration::from_millis(100));
    let queued: Vec<_> = (1..=10).map(|i| ask(format!("Question {i}?"))).collect();
    // Scrapes every 50 ms: several show the queue behind the prefill.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let busy = sim.state(0)["running"].as_u64().unwrap_or(0)
        + sim.state(1)["running"].as_u64().unwrap_or(0);
    assert_eq!(
        busy,
        1,
        "one pod prefills the document: {:?}",
        (sim.state(0), sim.state(1))
    );
    let next = ask("And the next question?".into()).join().unwrap();
    let first = first.join().unwrap();
    let holder = first.pod().expect("pod header");
    for q in queued {
        assert_eq!(
            q.join().unwrap().pod(),
            Some(holder),
            "the queued questions followed the document"
        );
    }
    let debug = next.header(DEBUG).expect("debug header").to_string();
    assert_eq!(next.pod(), Some(holder), "{debug}");
    assert!(!debug.contains("moved_by_cost"), "{debug}");
}

/// Ten requests of `repeat` copies of a `label`ed question first: the
/// model prices queued requests kvroute did not send at the mean size of
/// those it routed.
fn route_ten(envoy: &Envoy, label: &str, repeat: usize) {
    for i in 0..10 {
        let body = json!({"model": MODEL, "max_tokens": 1,
                          "prompt": format!("{label} question number {i} ").repeat(repeat)});
        assert_eq!(post_json(&envoy.url("/v1/completions"), &body).status, 200);
    }
}

/// `r`, a request whose prefix pod `holder` of two holds, was moved off it
/// by a cost check (`moved`), saying so in its debug header and stats, or
/// stayed with its prefix.
fn assert_moved_off(r: &Reply, envoy: &Envoy, sim: &Sim, holder: usize, moved: bool) {
    let debug = r.header(DEBUG).expect("debug header").to_string();
    let count = envoy.stat("wasmcustom.kvroute.decision.moved_by_cost");
    if moved {
        assert_eq!(r.pod(), Some(1 - holder), "{debug}");
        assert!(debug.contains("reason=Load"), "{debug}");
        assert!(
            debug.contains(&format!("moved_by_cost={}=", sim.endpoint(1 - holder)))
                && debug.contains(&format!(" over {}=", sim.endpoint(holder))),
            "{debug}"
        );
        assert_eq!(count, 1.0);
    } else {
        assert_eq!(r.pod(), Some(holder), "{debug}");
        assert!(debug.contains("reason=Prefix"), "{debug}");
        assert!(!debug.contains("moved_by_cost"), "{debug}");
        assert_eq!(count, 0.0);
    }
}

/// `scheduling.leave_costlier_holder` with the default `weighted` profile:
/// the holder of a short prompt reports 7 queued requests kvroute did not
/// send, one short of the overload filter. The scores still pick it (a full
/// prefix match outweighs the queue score at its cap); the TTFT model
/// prices that queue (7 requests of kvroute's mean size, ~500 tokens each)
/// above prefilling the prompt again on the idle pod, even charged twice,
/// and moves the request there, saying so in the debug header and stats.
#[test]
fn leave_costlier_holder_moves_a_short_prompt_off_a_queueing_holder() {
    let prompt = "please summarise the incident report for the on-call team ".repeat(10);
    let ask = |envoy: &Envoy| {
        let body = json!({"model": MODEL, "max_tokens": 1, "prompt": prompt});
        let r = post_json(&envoy.url("/v1/completions"), &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r
    };
    for leave in [false, true] {
        let sim = Sim::start(2, &["--time-scale", "0.05"]);
        let envoy = Envoy::start(
            &sim.endpoints(),
            json!({"debug_header": DEBUG, "scheduling": {"leave_costlier_holder": leave}}),
            1,
        );
        // Requests of ~500 tokens first.
        route_ten(&envoy, "long", 80);
        let holder = ask(&envoy).pod().expect("pod header");
        sim.fault(holder, json!({"queue_inflate": 7}));
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert_moved_off(&ask(&envoy), &envoy, &sim, holder, leave);
    }
}

/// Agents sharing a tool prompt, with the default `weighted` profile: 24
/// first requests of ~2 100 tokens, ~2 000 of them the same tool
/// definitions, sent at once through two Envoy workers to 8 pods. Each
/// agent's later steps follow its first request's pod, so a pod none of
/// them reaches stays idle for the whole session. A move of the tool
/// prompt to a pod kvroute has sent nothing is charged for no arrivals
/// there (no one there to delay): as soon as a holder queues, the prompt
/// gains a holder on an idle pod. Charged by the fleet's arrivals, the
/// burst used 5 of the 8 pods (bench/README.md, "Eight pods").
#[test]
fn agents_sharing_a_tool_prompt_reach_every_pod() {
    let pods = 8;
    let sim = Sim::start(pods, &["--time-scale", "0.25", "--kv-blocks", "100000"]);
    let envoy = Envoy::start(&sim.endpoints(), json!({"debug_header": DEBUG}), 2);
    let tools = "tool definition: name, parameters, description. ".repeat(160);
    let url = envoy.url("/v1/completions");
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(24));
    let handles: Vec<_> = (0..24)
        .map(|i| {
            let (url, barrier) = (url.clone(), barrier.clone());
            let prompt = format!("{tools}TASK {i}: {}", "plan the next step ".repeat(20));
            std::thread::spawn(move || {
                let body = json!({"model": MODEL, "max_tokens": 40, "prompt": prompt});
                barrier.wait();
                let r = post_json(&url, &body);
                assert_eq!(r.status, 200, "{}", r.body);
                r.pod().expect("pool pod")
            })
        })
        .collect();
    let mut per_pod = vec![0; pods];
    for h in handles {
        per_pod[h.join().unwrap()] += 1;
    }
    assert!(
        per_pod.iter().all(|&n| n > 0),
        "a pod got no agent: {per_pod:?}"
    );
}

fn probe_short(envoy: &Envoy, i: usize) {
    let body = json!({"model": MODEL, "max_tokens": 1, "prompt": format!("short question number {i} ").repeat(8)});
    assert_eq!(post_json(&envoy.url("/v1/completions"), &body).status, 200);
}

/// A pod that answers streams with an error at once (here a 500; in the
/// field a 429 or a 400 for a prompt over the context) did no prefill: its
/// quick answers must not teach the model that it is fast, or it would draw
/// every new request. Passive health is off so that the pod stays a
/// candidate, as it does for answers that are not 5xx.
#[test]
fn error_answers_do_not_teach_the_model_a_pod_is_fast() {
    let sim = Sim::start(3, &["--time-scale", "0.2"]);
    let envoy = Envoy::start(
        &sim.endpoints(),
        json!({"debug_header": DEBUG, "scheduling": {"profile": "predicted_ttft"},
               "outlier_detection": {"consecutive_errors": 0}}),
        1,
    );
    sim.fault(0, json!({"error_rate": 1.0}));
    let send = |tag: &str| {
        let _ = sse_events(envoy.port, "/v1/completions", &stream_body(tag));
    };
    for i in 0..24 {
        send(&format!("learn-{i}"));
    }
    let seen = predictions(&probe_any(&envoy, "probe"));
    let rate = |p: usize| rate_of(&seen, &sim.endpoint(p));
    assert!(
        rate(0) >= 0.99 * rate(1).min(rate(2)),
        "the failing pod was learnt fast: {seen:?}"
    );
    let failed = |s: &Sim| s.state(0)["requests_failed"].as_u64().unwrap_or(0);
    let before = failed(&sim);
    for i in 0..12 {
        send(&format!("after-{i}"));
    }
    let to_failing = failed(&sim) - before;
    assert!(
        to_failing <= 8,
        "{to_failing} of 12 new requests went to the pod answering errors"
    );
}

/// `scheduling.slot_wait` with the default `weighted` profile: engines that
/// run one request at a time (`--max-num-seqs 1`, as llama.cpp with one
/// slot). The holder of a long conversation is busy with its long answer.
/// By the prefill tokens ahead it is cheap (what waits there is short), so
/// without a limit known the next turn stays and waits for the answer to
/// end. The limit (1) is known either from the holder's scrapes, which
/// show requests queued at that count scrape after scrape, or from
/// `scheduling.engine_slots` before any scrape could show it, or from the
/// engine itself (llama.cpp's `GET /props`, kvroute-sim's with `--engine
/// llamacpp`), with nothing configured. Then the
/// wait for the slot (whole requests, 1 s each until streams teach
/// otherwise) costs more than prefilling the conversation on the free pod,
/// even charged twice, and the turn moves there, saying so.
#[test]
fn slot_wait_moves_a_turn_off_a_holder_whose_slots_are_taken() {
    let history = "the customer asked about the refund policy for damaged parcels ".repeat(40);
    let turn = |n: usize, max_tokens: u32, stream: bool| {
        json!({"model": MODEL, "max_tokens": max_tokens, "stream": stream,
               "prompt": format!("{history} turn {n}")})
    };
    // (engine, scheduling config, requests the holder's scrapes show
    // queued, moved)
    let cases = [
        ("vllm", json!({"slot_wait": false}), 2, false),
        ("vllm", json!({"slot_wait": true}), 2, true),
        ("vllm", json!({}), 0, false),
        ("vllm", json!({"engine_slots": 1}), 0, true),
        ("llamacpp", json!({}), 0, true),
    ];
    for (engine, scheduling, queued, moved) in cases {
        let args = [
            "--max-num-seqs",
            "1",
            "--time-scale",
            "0.2",
            "--engine",
            engine,
        ];
        let sim = Sim::start(2, &args);
        let envoy = Envoy::start(
            &sim.endpoints(),
            json!({"debug_header": DEBUG, "scheduling": scheduling}),
            1,
        );
        if engine == "llamacpp" {
            // Each pod's slot count, from its /props.
            let start = std::time::Instant::now();
            while envoy.stat("wasmcustom.kvroute.engine_slots.read") < 2.0 {
                assert!(start.elapsed().as_secs() < 10, "{}", envoy.log());
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            for ep in sim.endpoints() {
                let label = ep.replace(['.', ':'], "_");
                let gauge = format!("wasmcustom.kvroute.endpoint.{label}.engine_slots");
                assert_eq!(envoy.stat(&gauge), 1.0, "{gauge}");
            }
            assert_eq!(envoy.stat("wasmcustom.kvroute.engine_slots.failure"), 0.0);
        }
        // Short requests first (the queued ones are priced at their size).
        route_ten(&envoy, "short", 4);
        let first = post_json(&envoy.url("/v1/completions"), &turn(1, 1, false));
        assert_eq!(first.status, 200, "{}", first.body);
        let holder = first.pod().expect("pod header");
        // A long answer on the holder's only slot, and a queue behind it.
        let port = envoy.port;
        let long = turn(2, 2_000, true);
        let answer = std::thread::spawn(move || sse_events(port, "/v1/completions", &long));
        std::thread::sleep(std::time::Duration::from_millis(300));
        sim.fault(holder, json!({"queue_inflate": queued}));
        std::thread::sleep(std::time::Duration::from_millis(600));
        assert_eq!(
            sim.state(holder)["running"].as_u64(),
            Some(1),
            "the answer runs"
        );
        let r = post_json(&envoy.url("/v1/completions"), &turn(3, 1, false));
        assert_eq!(r.status, 200, "{}", r.body);
        assert_moved_off(&r, &envoy, &sim, holder, moved);
        sim.fault(holder, json!({"queue_inflate": 0}));
        drop(envoy);
        drop(sim);
        let _ = answer.join();
    }
}

/// A scrape counts the requests running when it was read; kvroute's own
/// among them that finished since are gone from the engine, whatever that
/// scrape still says. Engines that run one request at a time
/// (`scheduling.engine_slots: 1`), scraped every 400 ms: the first turn of
/// a conversation streams for over a second, so the last scrape before
/// the second turn shows it running on its holder. Counted as running,
/// the holder's only slot looked taken for a whole request (about the
/// first turn's time), more than prefilling the conversation on the
/// other pod, and the second turn left its holder (the rare failure of
/// `slot_wait_moves_a_turn_off_a_holder_whose_slots_are_taken`, where a
/// 50 ms scrape caught the first turn). kvroute saw it finish: the turn
/// stays with its prefix.
#[test]
fn a_request_that_finished_since_the_scrape_no_longer_takes_a_slot() {
    let history = "the customer asked about the refund policy for damaged parcels ".repeat(40);
    let turn = |n: usize, max_tokens: u32| {
        json!({"model": MODEL, "max_tokens": max_tokens, "stream": true,
               "prompt": format!("{history} turn {n}")})
    };
    let sim = Sim::start(2, &["--max-num-seqs", "1"]);
    let envoy = Envoy::start(
        &sim.endpoints(),
        json!({"debug_header": DEBUG, "scheduling": {"engine_slots": 1},
               "metrics": {"scrape_interval_ms": 400}}),
        1,
    );
    let served = |i: usize| sim.state(i)["requests_served"].as_u64().unwrap_or(0);
    for round in 0..2 {
        let before = [served(0), served(1)];
        let (times, events) = sse_events(envoy.port, "/v1/completions", &turn(2 * round + 1, 180));
        assert!(
            times.last().is_some_and(|t| t.as_millis() > 900),
            "the first turn streams over two scrapes: {times:?}"
        );
        assert!(!events.is_empty());
        let holder = usize::from(served(1) > before[1]);
        assert_eq!(served(holder), before[holder] + 1);
        let r = post_json(&envoy.url("/v1/completions"), &turn(2 * round + 2, 1));
        assert_eq!(r.status, 200, "{}", r.body);
        let debug = r.header(DEBUG).expect("debug header").to_string();
        assert_eq!(r.pod(), Some(holder), "{debug}");
        assert!(!debug.contains("moved_by_cost"), "{debug}");
    }
    assert_eq!(envoy.stat("wasmcustom.kvroute.decision.moved_by_cost"), 0.0);
}

/// `scheduling.slot_wait` on a cold pick, with the default `weighted`
/// profile: engines of two slots (`engine_slots: 2`), the sim at a quarter
/// speed. One pod answers two long streams of a conversation: both its
/// slots are taken and no prefill waits there. The other prefills a new
/// 1500-token prompt, with a slot free. Then a new conversation comes:
/// both pods are within the cold margin, and the cold rank (the least
/// prefill waiting) takes the first pod, where the prompt would wait for
/// a whole answer to end (half a second of slot time, 1 s a request until
/// streams end in full) rather than for the prefill ahead of it on the
/// other (about a quarter of a second). The slot check prices both and
/// moves it, saying so; with `slot_wait` off it stays. (Its first token
/// then came after 3.1 s, when an answer ended, against 0.26 s moved.)
#[test]
fn a_new_conversation_leaves_a_pod_whose_slots_all_answer() {
    let history = "the customer asked about the refund policy for damaged parcels ".repeat(40);
    for slot_wait in [false, true] {
        let sim = Sim::start(2, &["--max-num-seqs", "2", "--time-scale", "4"]);
        let scheduling = match slot_wait {
            true => json!({"engine_slots": 2}),
            false => json!({"slot_wait": false}),
        };
        let envoy = Envoy::start(
            &sim.endpoints(),
            json!({"debug_header": DEBUG, "scheduling": scheduling}),
            1,
        );
        route_ten(&envoy, "short", 4);
        let running = |i: usize| sim.state(i)["running"].as_u64().unwrap_or(0);
        let port = envoy.port;
        let mut answers = Vec::new();
        for turn in 1..=2 {
            let body = json!({"model": MODEL, "max_tokens": 150, "stream": true,
                              "prompt": format!("{history} turn {turn}")});
            answers.push(std::thread::spawn(move || {
                sse_events(port, "/v1/completions", &body)
            }));
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
        let answering = usize::from(running(1) == 2);
        assert_eq!(
            [running(answering), running(1 - answering)],
            [2, 0],
            "both turns answer on one pod"
        );
        let url = envoy.url("/v1/completions");
        let long = json!({"model": MODEL, "max_tokens": 1, "prompt": "long ".repeat(1_200)});
        let prefilling = std::thread::spawn(move || post_json(&url, &long).pod());
        std::thread::sleep(std::time::Duration::from_millis(60));
        let new = json!({"model": MODEL, "max_tokens": 1,
                         "prompt": format!("a new conversation {}", "w".repeat(600))});
        let r = post_json(&envoy.url("/v1/completions"), &new);
        assert_eq!(r.status, 200, "{}", r.body);
        let debug = r.header(DEBUG).expect("debug header").to_string();
        assert_eq!(prefilling.join().unwrap(), Some(1 - answering));
        assert!(debug.contains("reason=Cold"), "{debug}");
        let moved = envoy.stat("wasmcustom.kvroute.decision.moved_by_slots");
        if slot_wait {
            assert_eq!(r.pod(), Some(1 - answering), "{debug}");
            let over = format!(" over {}=", sim.endpoint(answering));
            let to = format!("moved_by_slots={}=", sim.endpoint(1 - answering));
            assert!(debug.contains(&to) && debug.contains(&over), "{debug}");
            assert_eq!(moved, 1.0);
        } else {
            assert_eq!(r.pod(), Some(answering), "{debug}");
            assert!(!debug.contains("moved_by_slots"), "{debug}");
            assert_eq!(moved, 0.0);
        }
        drop(envoy);
        drop(sim);
        for a in answers {
            let _ = a.join();
        }
    }
}
