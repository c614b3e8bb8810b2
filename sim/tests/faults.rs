//! The fault switches (`/sim/fault`, `/sim/reset`, the control port) over real HTTP.

mod common;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use kvroute_sim::SimConfig;

fn refused(s: &TestSim, pod: usize) -> bool {
    TcpStream::connect_timeout(&s.addr(pod), Duration::from_millis(200)).is_err()
}

fn wait_until(mut f: impl FnMut() -> bool, limit: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

#[test]
fn error_rate_latency_and_metrics_faults() {
    let s = TestSim::start(fast(1));
    let infer = || post(&s.url(0, "/v1/completions"), &completion("hello", 2));

    let st = post(&s.url(0, "/sim/fault"), r#"{"error_rate":1.0}"#);
    assert_eq!(st.status, 200);
    assert_eq!(st.json()["faults"]["error_rate"], 1.0);
    let r = infer();
    assert_eq!(r.status, 500);
    assert_eq!(r.pod.as_deref(), Some("0"));
    assert!(r.json()["error"]["message"].is_string());

    post(&s.url(0, "/sim/fault"), r#"{"error_status":429}"#);
    let r = infer();
    assert_eq!(r.status, 429);
    assert_eq!(r.json()["error"]["type"], "rate_limit_exceeded");
    post(
        &s.url(0, "/sim/fault"),
        r#"{"error_rate":0.5,"error_status":500}"#,
    );
    let fails = (0..40).filter(|_| infer().status == 500).count();
    assert!((5..=35).contains(&fails), "{fails} of 40 failed");

    post(
        &s.url(0, "/sim/fault"),
        r#"{"error_rate":0,"extra_latency_ms":300}"#,
    );
    let r = infer();
    assert_eq!(r.status, 200);
    assert!(r.elapsed >= Duration::from_millis(300), "{:?}", r.elapsed);

    post(
        &s.url(0, "/sim/fault"),
        r#"{"extra_latency_ms":0,"metrics_delay_ms":300}"#,
    );
    let m = get(&s.url(0, "/metrics"));
    assert!(m.elapsed >= Duration::from_millis(300));
    assert!(m.body.contains("# TYPE vllm:num_requests_waiting gauge"));

    post(
        &s.url(0, "/sim/fault"),
        r#"{"metrics_delay_ms":0,"metrics_garbage":true}"#,
    );
    let m = get(&s.url(0, "/metrics"));
    assert_eq!(m.status, 200);
    assert!(!m.body.contains("# TYPE vllm:"));

    post(
        &s.url(0, "/sim/fault"),
        r#"{"metrics_garbage":false,"metrics_error":true}"#,
    );
    let m = get(&s.url(0, "/metrics"));
    assert_eq!(m.status, 500);
    assert!(!m.body.contains("# TYPE vllm:"));
    assert_eq!(infer().status, 200, "inference unaffected");

    let st = post(&s.url(0, "/sim/reset"), "").json();
    assert_eq!(st["faults"]["metrics_garbage"], false);
    assert_eq!(st["faults"]["metrics_error"], false);
    assert_eq!(st["faults"]["error_rate"], 0.0);
    assert_eq!(infer().status, 200);
    assert!(get(&s.url(0, "/metrics")).body.contains("# TYPE vllm:"));

    for bad in [
        r#"{"error_rate":1.5}"#,
        r#"{"error_status":302}"#,
        r#"{"typo":1}"#,
        "nope",
    ] {
        let r = post(&s.url(0, "/sim/fault"), bad);
        assert_eq!(r.status, 400, "{bad}");
        assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    }
}

#[test]
fn no_prefix_caching_keeps_nothing_for_the_next_request() {
    let hits = |s: &TestSim, pod| {
        let m = get(&s.url(pod, "/metrics")).body;
        metric(&m, "vllm:prefix_cache_hits_total", &[]).unwrap()
    };
    let prompt = "a long shared prefix ".repeat(40);
    // Per pod at run time (the fault), or for every pod (the flag).
    let s = TestSim::start(fast(2));
    post(&s.url(1, "/sim/fault"), r#"{"no_prefix_caching":true}"#);
    for pod in [0, 1] {
        for _ in 0..3 {
            let r = post(&s.url(pod, "/v1/completions"), &completion(&prompt, 2));
            assert_eq!(r.status, 200);
        }
    }
    assert!(hits(&s, 0) > 0.0, "a caching pod hits");
    assert_eq!(hits(&s, 1), 0.0);
    let s = TestSim::start(SimConfig {
        no_prefix_caching: true,
        ..fast(1)
    });
    for _ in 0..3 {
        post(&s.url(0, "/v1/completions"), &completion(&prompt, 2));
    }
    assert_eq!(hits(&s, 0), 0.0);
}

#[test]
fn queue_inflate_reports_and_delays() {
    let s = TestSim::start(SimConfig {
        time_scale: 1.0,
        ..SimConfig::default()
    });
    let st = post(&s.url(0, "/sim/fault"), r#"{"queue_inflate":12}"#).json();
    assert_eq!(st["phantom_waiting"], 12);
    let m = get(&s.url(0, "/metrics")).body;
    assert_eq!(metric(&m, "vllm:num_requests_waiting", &[]), Some(12.0));
    // 12 phantom requests x 25 ms = 300 ms before the request is queued.
    let r = post(
        &s.url(0, "/v1/completions"),
        &completion("behind phantoms", 1),
    );
    assert_eq!(r.status, 200);
    assert!(r.elapsed >= Duration::from_millis(300), "{:?}", r.elapsed);
    post(&s.url(0, "/sim/fault"), r#"{"queue_inflate":0}"#);
    let r = post(&s.url(0, "/v1/completions"), &completion("no phantoms", 1));
    assert!(r.elapsed < Duration::from_millis(200), "{:?}", r.elapsed);
}

#[test]
fn down_ms_refuses_connections_then_recovers() {
    let s = TestSim::start(fast(2));
    let r = post(&s.url(1, "/sim/fault"), r#"{"down_ms":400}"#);
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["up"], false);
    assert!(wait_until(|| refused(&s, 1), Duration::from_millis(300)));
    assert!(!refused(&s, 0), "other pods stay up");
    assert!(wait_until(|| !refused(&s, 1), Duration::from_secs(3)));
    let st = get(&s.url(1, "/sim/state")).json();
    assert_eq!(st["up"], true);
    assert_eq!(st["port"].as_u64(), Some(u64::from(s.addr(1).port())));
    assert_eq!(
        post(&s.url(1, "/v1/completions"), &completion("back", 1)).status,
        200
    );
}

#[test]
fn control_port_controls_a_pod_that_is_down() {
    let s = TestSim::start(SimConfig {
        control_port: Some(0),
        ..fast(2)
    });
    let pods = get(&s.control_url("/pods")).json();
    assert_eq!(pods.as_array().map(Vec::len), Some(2));
    assert_eq!(pods[1]["port"].as_u64(), Some(u64::from(s.addr(1).port())));

    let st = post(
        &s.control_url("/pods/0/fault"),
        r#"{"down":true,"queue_inflate":3}"#,
    )
    .json();
    assert_eq!(st["up"], false);
    assert!(wait_until(|| refused(&s, 0), Duration::from_millis(300)));
    // Stays down (no timer) until brought back.
    std::thread::sleep(Duration::from_millis(300));
    assert!(refused(&s, 0));
    post(&s.control_url("/pods/0/fault"), r#"{"down":false}"#);
    assert!(wait_until(|| !refused(&s, 0), Duration::from_secs(2)));
    let m = get(&s.url(0, "/metrics")).body;
    assert_eq!(metric(&m, "vllm:num_requests_waiting", &[]), Some(3.0));

    post(&s.control_url("/pods/0/fault"), r#"{"down":true}"#);
    assert!(wait_until(|| refused(&s, 0), Duration::from_millis(300)));
    let st = post(&s.control_url("/pods/0/reset"), "").json();
    assert_eq!(st["up"], true);
    assert_eq!(st["faults"]["queue_inflate"], 0);
    assert!(wait_until(|| !refused(&s, 0), Duration::from_secs(2)));

    assert_eq!(post(&s.control_url("/pods/9/fault"), "{}").status, 404);
    assert_eq!(post(&s.control_url("/pods/x/reset"), "").status, 404);
    assert_eq!(
        post(&s.control_url("/pods/1/fault"), r#"{"down":"yes"}"#).status,
        400
    );
}
