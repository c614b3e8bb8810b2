//! What the pods say about the run: prefix-cache counters, requests served and the
//! queue depth, read from their own `/metrics` (vLLM and the sim, llama.cpp, SGLang;
//! the sim's `/sim/state` for the request count).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::measure::prom_sum;

/// One pod's counters over a run (the difference of two reads).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PodCounters {
    /// Prompt tokens the engine took from its prefix cache: vLLM (and the sim)
    /// `vllm:prefix_cache_hits_total`, llama.cpp `llamacpp:prompt_tokens_cached_total`,
    /// SGLang `sglang:cached_tokens_total`.
    pub hit_tokens: u64,
    /// Prompt tokens asked for: vLLM `vllm:prefix_cache_queries_total`, llama.cpp
    /// computed + cached (`llamacpp:prompt_tokens_total` excludes the cached ones),
    /// SGLang `sglang:prompt_tokens_total`.
    pub query_tokens: u64,
    /// Inference requests answered: the sim's `/sim/state` `requests_served`, vLLM
    /// `vllm:request_success_total`, SGLang `sglang:num_requests_total`; 0 where the
    /// engine does not count them (llama.cpp).
    pub requests: u64,
}

impl PodCounters {
    /// What happened between `before` and `self`.
    pub fn since(&self, before: &PodCounters) -> PodCounters {
        PodCounters {
            hit_tokens: self.hit_tokens.saturating_sub(before.hit_tokens),
            query_tokens: self.query_tokens.saturating_sub(before.query_tokens),
            requests: self.requests.saturating_sub(before.requests),
        }
    }

    /// Reads the counters out of a `/metrics` text, whatever the engine.
    pub fn from_metrics(m: &str) -> PodCounters {
        let get = |name: &str| prom_sum(m, name);
        let (hits, queries) = if let Some(cached) = get("llamacpp:prompt_tokens_cached_total") {
            let computed = get("llamacpp:prompt_tokens_total").unwrap_or(0.0);
            (cached, computed + cached)
        } else if let Some(q) = get("vllm:prefix_cache_queries_total") {
            (get("vllm:prefix_cache_hits_total").unwrap_or(0.0), q)
        } else {
            (
                get("sglang:cached_tokens_total").unwrap_or(0.0),
                get("sglang:prompt_tokens_total").unwrap_or(0.0),
            )
        };
        let requests = get("vllm:request_success_total")
            .or_else(|| get("sglang:num_requests_total"))
            .unwrap_or(0.0);
        PodCounters {
            hit_tokens: hits as u64,
            query_tokens: queries as u64,
            requests: requests as u64,
        }
    }
}

/// Requests waiting in the engine's queue, whatever the engine.
pub fn waiting(m: &str) -> f64 {
    prom_sum(m, "vllm:num_requests_waiting")
        .or_else(|| prom_sum(m, "llamacpp:requests_deferred"))
        .or_else(|| prom_sum(m, "sglang:num_queue_reqs"))
        .unwrap_or(0.0)
}

async fn get_text(client: &reqwest::Client, url: &str) -> Result<String> {
    let r = client.get(url).send().await?.error_for_status()?;
    Ok(r.text().await?)
}

/// Reads every pod's counters (absolute; subtract a read before the run).
pub async fn read_counters(
    client: &reqwest::Client,
    pods: &[SocketAddr],
) -> Result<Vec<PodCounters>> {
    let mut out = Vec::with_capacity(pods.len());
    for p in pods {
        let m = get_text(client, &format!("http://{p}/metrics"))
            .await
            .with_context(|| format!("metrics of {p}"))?;
        let mut c = PodCounters::from_metrics(&m);
        // The sim counts every answered request in /sim/state; real engines 404.
        if let Ok(state) = get_text(client, &format!("http://{p}/sim/state")).await {
            let state: serde_json::Value = serde_json::from_str(&state)?;
            c.requests = state["requests_served"].as_u64().unwrap_or(0);
        }
        out.push(c);
    }
    Ok(out)
}

/// Background poller of the engine's queue ([`waiting`]) on every pod, keeping the peak.
#[derive(Debug)]
pub struct QueuePoller {
    stop: Arc<AtomicBool>,
    handle: tokio::task::JoinHandle<Vec<u64>>,
}

impl QueuePoller {
    /// Starts polling every `interval`.
    pub fn start(client: reqwest::Client, pods: Vec<SocketAddr>, interval: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = tokio::spawn(async move {
            let mut peak = vec![0u64; pods.len()];
            // Bounded: stops when told, or after a day of polling at most.
            let max_polls = (86_400_000 / interval.as_millis().max(1)) as u64;
            for _ in 0..max_polls {
                if flag.load(Ordering::Relaxed) {
                    break;
                }
                for (i, p) in pods.iter().enumerate() {
                    if let Ok(m) = get_text(&client, &format!("http://{p}/metrics")).await {
                        let w = waiting(&m) as u64;
                        peak[i] = peak[i].max(w);
                    }
                }
                tokio::time::sleep(interval).await;
            }
            peak
        });
        QueuePoller { stop, handle }
    }

    /// Stops and returns the peak waiting count per pod.
    pub async fn finish(self) -> Vec<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.await.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA: &str =
        include_str!("../../tests/fixtures/metrics/llamacpp-11434-smollm2-after-3-requests.txt");
    const VLLM: &str =
        include_str!("../../tests/fixtures/metrics/vllm-0.29.0-v1-qwen2.5-1.5b-inferstack.txt");

    #[test]
    fn llama_cpp_counts_cached_tokens_apart_from_computed_ones() {
        let c = PodCounters::from_metrics(LLAMA);
        // prompt_tokens_total (1249) excludes the 611 cached tokens.
        assert_eq!((c.hit_tokens, c.query_tokens, c.requests), (611, 1860, 0));
        assert_eq!(waiting(LLAMA), 0.0);
    }

    #[test]
    fn vllm_reads_its_prefix_cache_counters() {
        let c = PodCounters::from_metrics(VLLM);
        assert_eq!(
            c.hit_tokens as f64,
            prom_sum(VLLM, "vllm:prefix_cache_hits_total").unwrap()
        );
        assert_eq!(
            c.query_tokens as f64,
            prom_sum(VLLM, "vllm:prefix_cache_queries_total").unwrap()
        );
        assert!(c.query_tokens > 0);
    }

    #[test]
    fn a_row_counts_only_what_happened_during_it() {
        let before = PodCounters {
            hit_tokens: 10,
            query_tokens: 100,
            requests: 3,
        };
        let after = PodCounters {
            hit_tokens: 70,
            query_tokens: 300,
            requests: 5,
        };
        let d = after.since(&before);
        assert_eq!((d.hit_tokens, d.query_tokens, d.requests), (60, 200, 2));
        // A restarted engine (counters went back) counts nothing rather than wrapping.
        assert_eq!(before.since(&after).query_tokens, 0);
    }
}
