//! Shared harness of the HTTP tests: starts a simulator in-process on free ports (its own
//! tokio runtime in the background) and talks to it with a blocking HTTP client.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvroute_sim::{start, Sim, SimConfig};
use serde_json::Value;

/// A running simulator and the runtime that drives it.
pub struct TestSim {
    pub sim: Sim,
    rt: Option<tokio::runtime::Runtime>,
}

impl Drop for TestSim {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl TestSim {
    /// Starts `cfg` with every pod on a free port.
    pub fn start(mut cfg: SimConfig) -> Self {
        cfg.base_port = 0;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let sim = rt.block_on(start(cfg)).expect("start");
        Self { sim, rt: Some(rt) }
    }

    pub fn addr(&self, pod: usize) -> SocketAddr {
        self.sim.addrs[pod]
    }

    pub fn url(&self, pod: usize, path: &str) -> String {
        format!("http://{}{}", self.addr(pod), path)
    }

    pub fn control_url(&self, path: &str) -> String {
        format!("http://{}{}", self.sim.control_addr.expect("control"), path)
    }
}

/// A client that reports every status instead of failing on non-2xx.
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(20)))
        .build()
        .into()
}

/// A response reduced to what tests look at.
pub struct Reply {
    pub status: u16,
    pub pod: Option<String>,
    pub content_type: String,
    pub body: String,
    pub elapsed: Duration,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

fn reply(res: Result<ureq::http::Response<ureq::Body>, ureq::Error>, t0: Instant) -> Reply {
    let mut res = res.expect("request");
    let header = |name: &str| {
        res.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let pod = header("x-kvroute-sim-pod");
    let content_type = header("content-type").unwrap_or_default();
    let status = res.status().as_u16();
    let body = res.body_mut().read_to_string().expect("body");
    Reply {
        status,
        pod,
        content_type,
        body,
        elapsed: t0.elapsed(),
    }
}

pub fn post(url: &str, body: &str) -> Reply {
    let t0 = Instant::now();
    reply(
        agent()
            .post(url)
            .header("content-type", "application/json")
            .send(body),
        t0,
    )
}

pub fn get(url: &str) -> Reply {
    let t0 = Instant::now();
    reply(agent().get(url).call(), t0)
}

/// The value of the first sample of `name` whose line contains all `label_parts`.
pub fn metric(text: &str, name: &str, label_parts: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .find(|l| label_parts.iter().all(|p| l.contains(p)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// A chat request body.
pub fn chat(messages: &[(&str, &str)], max_tokens: usize, stream: bool) -> String {
    let msgs: Vec<Value> = messages
        .iter()
        .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
        .collect();
    serde_json::json!({
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": msgs,
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
    .to_string()
}

/// A completion request body.
pub fn completion(prompt: &str, max_tokens: usize) -> String {
    serde_json::json!({"prompt": prompt, "max_tokens": max_tokens}).to_string()
}

/// Fast, latency-free configuration.
pub fn fast(pods: usize) -> SimConfig {
    SimConfig {
        pods,
        no_latency: true,
        ..SimConfig::default()
    }
}
