//! What the pods say about the run: prefix-cache counters, requests served and the
//! queue depth, read from their vLLM `/metrics` (and `/sim/state` for the request count).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::measure::prom_sum;

/// One pod's counters at the end of a run.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PodCounters {
    /// `vllm:prefix_cache_hits_total` (tokens).
    pub hit_tokens: u64,
    /// `vllm:prefix_cache_queries_total` (tokens).
    pub query_tokens: u64,
    /// Inference requests answered (`/sim/state` `requests_served`).
    pub requests: u64,
}

async fn get_text(client: &reqwest::Client, url: &str) -> Result<String> {
    let r = client.get(url).send().await?.error_for_status()?;
    Ok(r.text().await?)
}

/// Reads every pod's counters.
pub async fn read_counters(
    client: &reqwest::Client,
    pods: &[SocketAddr],
) -> Result<Vec<PodCounters>> {
    let mut out = Vec::with_capacity(pods.len());
    for p in pods {
        let m = get_text(client, &format!("http://{p}/metrics"))
            .await
            .with_context(|| format!("metrics of {p}"))?;
        let state: serde_json::Value =
            serde_json::from_str(&get_text(client, &format!("http://{p}/sim/state")).await?)?;
        out.push(PodCounters {
            hit_tokens: prom_sum(&m, "vllm:prefix_cache_hits_total").unwrap_or(0.0) as u64,
            query_tokens: prom_sum(&m, "vllm:prefix_cache_queries_total").unwrap_or(0.0) as u64,
            requests: state["requests_served"].as_u64().unwrap_or(0),
        });
    }
    Ok(out)
}

/// Background poller of `vllm:num_requests_waiting` on every pod, keeping the peak.
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
                        let w = prom_sum(&m, "vllm:num_requests_waiting").unwrap_or(0.0) as u64;
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
