//! The load generator: replays a trace against one router URL with streaming requests,
//! closed loop (N concurrent users) or open loop (sessions arriving at a target rate).
//!
//! Latencies are converted to simulated time (wall / `--time-scale`) so numbers read
//! like the GPU server the sim models, whatever the compression of the run.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use futures_util::StreamExt;
use indicatif::ProgressBar;

use crate::theory::RequestBlocks;
use crate::trace::{Session, Trace};

/// How the trace is replayed.
#[derive(Debug, Clone)]
pub struct RunSettings {
    /// Closed loop: concurrent users (each runs whole sessions, one after another).
    pub users: usize,
    /// Open loop: sessions started per simulated second (Poisson); `None` = closed loop.
    pub rate: Option<f64>,
    /// Wall seconds per simulated second (the sim's `--time-scale`).
    pub time_scale: f64,
    /// The pods' block size (for the theoretical maximum).
    pub block_size: usize,
    /// Timeout of one request (wall).
    pub request_timeout: Duration,
    /// Seed of the open-loop arrivals.
    pub seed: u64,
    /// TTFT objective, simulated ms (goodput in the report).
    pub ttft_slo_ms: f64,
    /// Model name sent in requests.
    pub model: String,
}

/// One request as the client saw it.
#[derive(Debug, Clone)]
pub struct Exchange {
    /// Session index and step.
    pub session: usize,
    /// Step within the session.
    pub step: usize,
    /// Start time since the run began (wall).
    pub started: Duration,
    /// Time to first token, simulated ms (`None` on error).
    pub ttft_ms: Option<f64>,
    /// End-to-end latency, simulated ms.
    pub e2e_ms: f64,
    /// Output tokens received.
    pub output_tokens: u64,
    /// Error text, if the request failed.
    pub error: Option<String>,
    /// Pod that answered (`x-kvroute-sim-pod`), when the router passes it through.
    pub pod: Option<usize>,
    /// kvroute's debug header (its decision), when the run asked for it
    /// (`matrix --decisions-log`).
    pub decision: Option<String>,
    /// Block keys of the prompt and prompt + answer (theoretical maximum).
    pub blocks: RequestBlocks,
    /// The engine's own count of the prompt: its tokens and those it
    /// served from its prefix cache, when it reports them ([`Answer`]).
    pub prompt: Option<PromptCount>,
}

/// A prompt as the engine that answered counted it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptCount {
    /// Prompt tokens.
    pub tokens: u64,
    /// Of them, served from the engine's prefix cache.
    pub cached: u64,
}

impl PromptCount {
    /// From a stream chunk: OpenAI's `usage.prompt_tokens` and
    /// `usage.prompt_tokens_details.cached_tokens` (vLLM, SGLang,
    /// kvroute-sim, llama.cpp), else llama.cpp's `timings` (`prompt_n`
    /// tokens computed, `cache_n` reused).
    fn of(v: &serde_json::Value) -> Option<PromptCount> {
        let u = &v["usage"];
        if let (Some(tokens), Some(cached)) = (
            u["prompt_tokens"].as_u64(),
            u["prompt_tokens_details"]["cached_tokens"].as_u64(),
        ) {
            return Some(PromptCount { tokens, cached });
        }
        let t = &v["timings"];
        let (computed, cached) = (t["prompt_n"].as_u64()?, t["cache_n"].as_u64()?);
        Some(PromptCount {
            tokens: computed + cached,
            cached,
        })
    }
}

/// The model name sent to the sim (it accepts any).
pub const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// A streamed completion as the client saw it.
pub struct Answer {
    /// Time to the first token (wall).
    pub ttft: Option<Duration>,
    /// The generated text.
    pub text: String,
    /// Output tokens.
    pub tokens: u64,
    /// Pod that answered (`x-kvroute-sim-pod`).
    pub pod: Option<usize>,
    /// kvroute's debug header ([`DEBUG_HEADER`]), when configured.
    pub decision: Option<String>,
    /// The prompt as the engine counted it, when it says.
    pub prompt: Option<PromptCount>,
}

/// The debug header a run with `matrix --decisions-log` configures.
pub const DEBUG_HEADER: &str = "x-kvroute-debug";

async fn complete(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    prompt: &str,
    max_tokens: u32,
) -> Result<Answer> {
    complete_as(client, url, model, &[], prompt, max_tokens).await
}

/// A streaming `/v1/completions` request for `model` with extra request
/// `headers`; an HTTP error is an `Err` whose text starts `HTTP <status>`.
pub async fn complete_as(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    headers: &[(&str, &str)],
    prompt: &str,
    max_tokens: u32,
) -> Result<Answer> {
    let body = serde_json::json!({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": true,
        "stream_options": {"include_usage": true}, "temperature": 0.0,
    });
    let t0 = Instant::now();
    let mut req = client.post(format!("{url}/v1/completions")).json(&body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await?;
    let status = resp.status();
    let pod = resp
        .headers()
        .get("x-kvroute-sim-pod")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let decision = resp
        .headers()
        .get(DEBUG_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        anyhow::bail!(
            "HTTP {status}: {}",
            text.chars().take(200).collect::<String>()
        );
    }
    let mut ans = Answer {
        ttft: None,
        text: String::new(),
        tokens: 0,
        pod,
        decision,
        prompt: None,
    };
    let mut usage_tokens = None;
    let mut buf: Vec<u8> = Vec::new();
    let mut stream = resp.bytes_stream();
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        buf.extend_from_slice(&chunk?);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            let Some(data) = std::str::from_utf8(&event)
                .ok()
                .and_then(|e| e.trim().strip_prefix("data:"))
            else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(data)?;
            if let Some(text) = v["choices"][0]["text"].as_str() {
                if !text.is_empty() {
                    ans.ttft.get_or_insert_with(|| t0.elapsed());
                    ans.text.push_str(text);
                    ans.tokens += 1;
                }
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                usage_tokens = Some(n);
            }
            ans.prompt = PromptCount::of(&v).or(ans.prompt);
        }
    }
    if !done {
        anyhow::bail!("stream ended without [DONE]");
    }
    if let Some(n) = usage_tokens {
        ans.tokens = n;
    }
    Ok(ans)
}

async fn run_session(
    client: &reqwest::Client,
    url: &str,
    session: &Session,
    s: &RunSettings,
    t0: Instant,
    pb: &ProgressBar,
) -> Vec<Exchange> {
    let mut out = Vec::with_capacity(session.steps.len());
    let mut history = String::from(&*session.prefix);
    for (k, step) in session.steps.iter().enumerate() {
        if step.think_ms > 0 {
            tokio::time::sleep(Duration::from_secs_f64(
                step.think_ms as f64 / 1000.0 * s.time_scale,
            ))
            .await;
        }
        history.push_str(&step.append);
        let started = t0.elapsed();
        let begun = Instant::now();
        let result = tokio::time::timeout(
            s.request_timeout,
            complete(client, url, &s.model, &history, step.max_tokens),
        )
        .await;
        let sim_ms = |d: Duration| d.as_secs_f64() * 1000.0 / s.time_scale;
        let e2e_ms = sim_ms(begun.elapsed());
        pb.inc(1);
        match result {
            Ok(Ok(ans)) => {
                out.push(Exchange {
                    session: session.id,
                    step: k,
                    started,
                    ttft_ms: ans.ttft.map(sim_ms),
                    e2e_ms,
                    output_tokens: ans.tokens,
                    error: None,
                    pod: ans.pod,
                    decision: ans.decision,
                    blocks: RequestBlocks::new(&history, &ans.text, s.block_size),
                    prompt: ans.prompt,
                });
                history.push_str(&ans.text);
            }
            other => {
                let error = match other {
                    Ok(Err(e)) => format!("{e:#}"),
                    _ => format!("timeout after {:?}", s.request_timeout),
                };
                out.push(Exchange {
                    session: session.id,
                    step: k,
                    started,
                    ttft_ms: None,
                    e2e_ms,
                    output_tokens: 0,
                    error: Some(error),
                    pod: None,
                    decision: None,
                    blocks: RequestBlocks::new(&history, "", s.block_size),
                    prompt: None,
                });
                // The rest of the conversation depends on this answer: count it as failed.
                pb.inc((session.steps.len() - k - 1) as u64);
                break;
            }
        }
    }
    out
}

/// Replays `trace` against `url`; returns every exchange, ordered by start time.
pub async fn run(
    url: &str,
    trace: &Trace,
    s: &RunSettings,
    pb: &ProgressBar,
) -> Result<Vec<Exchange>> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(s.users.max(64))
        .tcp_nodelay(true)
        .no_proxy()
        .build()?;
    let sessions = Arc::new(trace.sessions.clone());
    let t0 = Instant::now();
    let mut handles = Vec::new();
    match s.rate {
        None => {
            let next = Arc::new(AtomicUsize::new(0));
            for _ in 0..s.users.max(1) {
                let (client, url, sessions, next, s, pb) = (
                    client.clone(),
                    url.to_string(),
                    sessions.clone(),
                    next.clone(),
                    s.clone(),
                    pb.clone(),
                );
                handles.push(tokio::spawn(async move {
                    let mut out = Vec::new();
                    // Bounded by the number of sessions: each index is taken once.
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(session) = sessions.get(i) else {
                            break;
                        };
                        out.extend(run_session(&client, &url, session, &s, t0, &pb).await);
                    }
                    out
                }));
            }
        }
        Some(rate) => {
            let mut rng = fastrand::Rng::with_seed(s.seed);
            let mut at = 0.0f64;
            for i in 0..sessions.len() {
                at += -(1.0 - rng.f64()).ln() / rate.max(1e-6);
                let start = t0 + Duration::from_secs_f64(at * s.time_scale);
                let (client, url, sessions, s, pb) = (
                    client.clone(),
                    url.to_string(),
                    sessions.clone(),
                    s.clone(),
                    pb.clone(),
                );
                handles.push(tokio::spawn(async move {
                    tokio::time::sleep_until(start.into()).await;
                    run_session(&client, &url, &sessions[i], &s, t0, &pb).await
                }));
            }
        }
    }
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await?);
    }
    all.sort_by_key(|e| e.started);
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_prompt_count_is_read_from_usage_or_llama_cpp_timings() {
        let usage = json!({"usage": {"prompt_tokens": 300, "completion_tokens": 16,
            "prompt_tokens_details": {"cached_tokens": 256}}});
        let want = Some(PromptCount {
            tokens: 300,
            cached: 256,
        });
        assert_eq!(PromptCount::of(&usage), want);
        // llama.cpp's timings: tokens computed and tokens reused.
        let timings = json!({"choices": [], "timings": {"prompt_n": 44, "cache_n": 256}});
        assert_eq!(PromptCount::of(&timings), want);
        // Usage without the details (an engine that does not say) and a
        // text chunk: no count.
        assert_eq!(
            PromptCount::of(&json!({"usage": {"prompt_tokens": 300}})),
            None
        );
        assert_eq!(PromptCount::of(&json!({"choices": [{"text": "hi"}]})), None);
    }
}
