//! The load the overhead benchmark offers: chat bodies of an exact size with
//! a unique prefix, a paired sequential latency probe (requests alternate
//! between the two Envoys, so drift on a shared 2-core box hits both
//! alike), and a closed loop at fixed concurrency for requests/s and CPU.

use anyhow::{bail, Context as _, Result};
use hdrhistogram::Histogram;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Model name sent in every body (the simulator accepts any).
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// Makes `/v1/chat/completions` bodies of an exact byte size whose prompt
/// starts with a unique 16-hex-digit id, so no two requests share a prefix
/// block (neither in kvroute's index nor in the simulator's cache).
#[derive(Debug)]
pub struct Bodies {
    filler: String,
    nonce: u64,
    next: AtomicU64,
}

impl Bodies {
    /// A generator for bodies up to `max_size` bytes; `nonce` keeps ids of
    /// different runs apart.
    pub fn new(max_size: usize, nonce: u64) -> Bodies {
        const WORDS: [&str; 10] = [
            "cache", "prefix", "token", "router", "envoy", "model", "block", "the", "of", "and",
        ];
        let mut rng = fastrand::Rng::with_seed(nonce);
        let mut filler = String::with_capacity(max_size + 16);
        while filler.len() < max_size {
            filler.push_str(WORDS[rng.usize(..WORDS.len())]);
            filler.push(' ');
        }
        Bodies {
            filler,
            nonce,
            next: AtomicU64::new(0),
        }
    }

    /// The next body of exactly `size` bytes (at least [`Bodies::MIN_SIZE`]).
    pub fn make(&self, size: usize) -> Vec<u8> {
        let id = self.next.fetch_add(1, Ordering::Relaxed) ^ self.nonce.rotate_left(32);
        let head = format!(
            r#"{{"model":"{MODEL}","max_tokens":1,"messages":[{{"role":"user","content":"{id:016x} "#
        );
        let tail = r#""}]}"#;
        let fill = size.saturating_sub(head.len() + tail.len());
        let mut body = Vec::with_capacity(size);
        body.extend_from_slice(head.as_bytes());
        body.extend_from_slice(&self.filler.as_bytes()[..fill.min(self.filler.len())]);
        body.extend_from_slice(tail.as_bytes());
        body
    }

    /// Smallest body [`Bodies::make`] can produce exactly.
    pub const MIN_SIZE: usize = 160;
}

/// An HTTP/1.1 keep-alive client for loopback (no proxy, Nagle off).
pub fn client() -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .no_proxy()
        .http1_only()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(256)
        .timeout(Duration::from_secs(30))
        .build()
        .context("building the HTTP client")
}

/// Sends one body and reads the whole answer; the latency in ns.
async fn one(client: &reqwest::Client, url: &str, body: Vec<u8>) -> Result<u64> {
    let start = Instant::now();
    let resp = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await?;
    let status = resp.status();
    let bytes = resp.bytes().await?;
    let ns = start.elapsed().as_nanos() as u64;
    if !status.is_success() {
        bail!(
            "{url}: {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        );
    }
    Ok(ns)
}

/// A latency histogram in ns (1 us .. 60 s, 3 significant digits).
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1_000, 60_000_000_000, 3).expect("valid histogram bounds")
}

/// Sequential requests alternating between `urls` (the order flips every
/// round), `warmup` rounds discarded then `rounds` measured: one latency
/// histogram per URL.
pub async fn paired_latency(
    client: &reqwest::Client,
    urls: &[String],
    bodies: &Bodies,
    size: usize,
    warmup: usize,
    rounds: usize,
) -> Result<Vec<Histogram<u64>>> {
    let mut hists: Vec<Histogram<u64>> = urls.iter().map(|_| histogram()).collect();
    for round in 0..warmup + rounds {
        for k in 0..urls.len() {
            let i = if round % 2 == 0 {
                k
            } else {
                urls.len() - 1 - k
            };
            let body = bodies.make(size);
            let ns = one(client, &urls[i], body).await?;
            if round >= warmup {
                hists[i].saturating_record(ns);
            }
        }
    }
    Ok(hists)
}

/// What a closed loop achieved.
#[derive(Debug)]
pub struct LoopResult {
    /// Requests answered 2xx.
    pub ok: u64,
    /// Requests that failed (transport or non-2xx).
    pub errors: u64,
    /// Wall time of the loop.
    pub elapsed: Duration,
    /// Latency of the successful requests.
    pub latency: Histogram<u64>,
    /// First error seen, if any.
    pub first_error: Option<String>,
}

/// A closed loop: `concurrency` workers each send one request at a time
/// until `stop` says so (checked before each request; `sent` is the number
/// sent so far, across workers).
pub async fn closed_loop(
    client: &reqwest::Client,
    url: &str,
    bodies: Arc<Bodies>,
    size: usize,
    concurrency: usize,
    stop: Stop,
) -> Result<LoopResult> {
    let sent = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        let (client, url, bodies, sent) =
            (client.clone(), url.to_owned(), bodies.clone(), sent.clone());
        tasks.push(tokio::spawn(async move {
            let mut hist = histogram();
            let (mut ok, mut errors, mut first_error) = (0u64, 0u64, None);
            loop {
                let n = sent.fetch_add(1, Ordering::Relaxed);
                if stop.done(n, start) {
                    break;
                }
                match one(&client, &url, bodies.make(size)).await {
                    Ok(ns) => {
                        ok += 1;
                        hist.saturating_record(ns);
                    }
                    Err(e) => {
                        errors += 1;
                        first_error.get_or_insert_with(|| format!("{e:#}"));
                        if errors > 100 {
                            break; // something is badly wrong: stop hammering
                        }
                    }
                }
            }
            (ok, errors, hist, first_error)
        }));
    }
    let mut result = LoopResult {
        ok: 0,
        errors: 0,
        elapsed: Duration::ZERO,
        latency: histogram(),
        first_error: None,
    };
    for t in tasks {
        let (ok, errors, hist, first_error) = t.await?;
        result.ok += ok;
        result.errors += errors;
        result.latency.add(&hist)?;
        if result.first_error.is_none() {
            result.first_error = first_error;
        }
    }
    result.elapsed = start.elapsed();
    Ok(result)
}

/// When a closed loop stops.
#[derive(Debug, Clone, Copy)]
pub enum Stop {
    /// After this much wall time.
    After(Duration),
    /// After this many requests were sent.
    Count(u64),
}

impl Stop {
    fn done(self, sent: u64, start: Instant) -> bool {
        match self {
            Stop::After(d) => start.elapsed() >= d,
            Stop::Count(n) => sent >= n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_have_the_exact_size_and_unique_prefixes() {
        let b = Bodies::new(600 << 10, 42);
        for size in [Bodies::MIN_SIZE, 1024, 16 << 10, 512 << 10] {
            let x = b.make(size);
            let y = b.make(size);
            assert_eq!((x.len(), y.len()), (size, size));
            let content = |body: &[u8]| {
                let v: serde_json::Value = serde_json::from_slice(body).unwrap();
                v["messages"][0]["content"].as_str().unwrap()[..17].to_owned()
            };
            assert_ne!(content(&x), content(&y), "the prompts start differently");
        }
    }
}
