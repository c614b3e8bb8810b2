//! Queueing and latency seen from outside: `max-num-seqs` makes requests wait, the
//! waiting shows in `/metrics`, and TTFT depends on the queue and on cache hits.

mod common;

use std::time::Duration;

use common::*;
use kvroute_sim::SimConfig;

#[test]
fn requests_queue_behind_max_num_seqs() {
    let s = TestSim::start(SimConfig {
        max_num_seqs: 1,
        time_scale: 1.0,
        ..SimConfig::default()
    });
    let url = s.url(0, "/v1/completions");
    // Each request decodes 30 tokens at ~6.5 ms a step: ~0.2 s each, run one at a time.
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let url = url.clone();
            std::thread::spawn(move || post(&url, &completion(&format!("request number {i}"), 30)))
        })
        .collect();
    let mut max_waiting = 0.0f64;
    let mut max_running = 0.0f64;
    for _ in 0..40 {
        let m = get(&s.url(0, "/metrics")).body;
        max_waiting = max_waiting.max(metric(&m, "vllm:num_requests_waiting", &[]).unwrap());
        max_running = max_running.max(metric(&m, "vllm:num_requests_running", &[]).unwrap());
        if max_waiting >= 2.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(15));
    }
    let mut elapsed: Vec<Duration> = handles
        .into_iter()
        .map(|h| {
            let r = h.join().unwrap();
            assert_eq!(r.status, 200);
            r.elapsed
        })
        .collect();
    assert_eq!(max_running, 1.0);
    assert!(max_waiting >= 2.0, "waiting never exceeded {max_waiting}");
    elapsed.sort();
    // Served one after another: the last one took about four times the first.
    assert!(elapsed[3] > elapsed[0] * 2, "{elapsed:?}");
    let m = get(&s.url(0, "/metrics")).body;
    assert!(metric(&m, "vllm:request_queue_time_seconds_sum", &[]).unwrap() > 0.2);
}

#[test]
fn ttft_depends_on_cache_hits_and_time_scale() {
    let s = TestSim::start(SimConfig {
        time_scale: 1.0,
        ..SimConfig::default()
    });
    // ~8000 uncached tokens: ~330 ms of prefill; cached: one ~7 ms step.
    let body = completion(&"lorem ipsum dolor sit amet ".repeat(1200), 1);
    let cold = post(&s.url(0, "/v1/completions"), &body);
    let warm = post(&s.url(0, "/v1/completions"), &body);
    assert!(
        warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 7000
    );
    assert!(
        cold.elapsed > warm.elapsed + Duration::from_millis(150),
        "cold {:?} warm {:?}",
        cold.elapsed,
        warm.elapsed
    );
    let m = get(&s.url(0, "/metrics")).body;
    let ttft_sum = metric(&m, "vllm:time_to_first_token_seconds_sum", &[]).unwrap();
    assert!(ttft_sum > 0.3 && ttft_sum < 1.0, "{ttft_sum}");

    // Ten times faster: the same cold prefill takes a tenth of the wall time, while the
    // metrics still report simulated seconds.
    let fast = TestSim::start(SimConfig {
        time_scale: 0.1,
        ..SimConfig::default()
    });
    let r = post(&fast.url(0, "/v1/completions"), &body);
    assert!(
        r.elapsed < cold.elapsed / 2,
        "{:?} vs {:?}",
        r.elapsed,
        cold.elapsed
    );
    let m = get(&fast.url(0, "/metrics")).body;
    assert!(metric(&m, "vllm:time_to_first_token_seconds_sum", &[]).unwrap() > 0.3);
}

#[test]
fn client_disconnect_aborts_the_request() {
    let s = TestSim::start(SimConfig {
        time_scale: 1.0,
        ..SimConfig::default()
    });
    // A long generation with a 200 ms client timeout: the client goes away mid-way.
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_millis(200)))
        .build()
        .into();
    let _ = agent
        .post(&s.url(0, "/v1/completions"))
        .header("content-type", "application/json")
        .send(completion("abort me", 2000).as_str());
    let mut aborted = 0.0;
    for _ in 0..50 {
        let m = get(&s.url(0, "/metrics")).body;
        aborted = metric(
            &m,
            "vllm:request_success_total",
            &["finished_reason=\"abort\""],
        )
        .unwrap();
        if aborted == 1.0 {
            assert_eq!(metric(&m, "vllm:num_requests_running", &[]), Some(0.0));
            assert_eq!(metric(&m, "vllm:kv_cache_usage_perc", &[]), Some(0.0));
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(aborted, 1.0);
}

#[test]
fn a_slower_pod_takes_longer_for_the_same_work() {
    // --pod-speeds 1,0.5: pod 1's steps take twice as long.
    let s = TestSim::start(SimConfig {
        pods: 2,
        time_scale: 1.0,
        pod_speeds: vec![1.0, 0.5],
        ..SimConfig::default()
    });
    // ~4000 uncached tokens and 20 decode steps: ~300 ms on pod 0.
    let prompt = "tokens of a long prompt ".repeat(1000);
    let time = |pod: usize| post(&s.url(pod, "/v1/completions"), &completion(&prompt, 20)).elapsed;
    let (fast, slow) = (time(0), time(1));
    assert!(
        slow.as_secs_f64() > 1.6 * fast.as_secs_f64(),
        "fast {fast:?}, slow {slow:?}"
    );
}
