//! Typed plugin configuration: the JSON Envoy passes as the wasm plugin's
//! `configuration`, parsed with defaults, unknown fields rejected, then
//! checked semantically. Every error names the field, the value and the
//! reason, so Envoy's log says exactly what to fix. `docs/CONFIG.md` is the
//! user-facing reference and must list every field here with its default.
//! The types and their defaults are here; the checks in `validate.rs`.

use crate::endpoint::Endpoint;
use crate::models::{self, ModelPool};
use crate::objectives::ObjectivesConfig;
use crate::path_policy::{default_allowed_paths, PathRule};
use crate::saturation::SaturationConfig;
use serde::Deserialize;

mod validate;
pub(crate) use validate::err;
pub use validate::ConfigError;

/// Request header kvroute sets on streaming inference requests (after
/// removing any client copy), for Envoy's route table: streaming requests
/// get `failover.first_byte_timeout_ms` as their per-try timeout, others
/// `failover.response_timeout_ms`. The route removes it before the request
/// leaves Envoy.
pub const STREAM_HEADER: &str = "x-kvroute-stream";

/// The whole plugin configuration.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The pool: model-server endpoints (`ip:port`). The only hosts kvroute
    /// ever routes to. May be empty when `discovery` is set.
    pub endpoints: Vec<Endpoint>,
    /// How the chosen endpoint is handed to Envoy (default `override_host`:
    /// the only handoff whose retries can reach another endpoint).
    pub handoff: Handoff,
    /// Decide, but do not steer: the destination header is not set, so
    /// Envoy's own balancer (the override_host policy's fallback) picks
    /// the endpoint, and kvroute learns where each request went once the
    /// response names its upstream. Its decisions, their debug header and
    /// the `kvroute.shadow.*` stats show what it would have done (rollout
    /// and tuning without changing traffic). Needs `handoff: override_host`.
    pub shadow: bool,
    /// Learn the pool from Envoy's own view of the upstream cluster (EDS
    /// included) instead of `endpoints`. Needs `handoff: override_host`.
    pub discovery: Option<DiscoveryConfig>,
    /// Request header that carries the chosen endpoint to Envoy (read by the
    /// ORIGINAL_DST cluster or the override_host policy). Client copies are
    /// always removed first.
    pub destination_header: String,
    /// Largest request body kvroute buffers and parses; larger bodies are
    /// routed by load alone. Envoy's own buffer limits must be at least this.
    pub max_body_bytes: usize,
    /// Envoy cluster used for `/metrics` scrapes (the upstream cluster).
    pub upstream_cluster: String,
    /// When set, a response header of this name explains each decision.
    pub debug_header: Option<String>,
    /// Request paths that reach the pool (exact, or `/dir/*`); every other
    /// path gets a JSON 404 from the gateway (see `path_policy.rs`).
    pub allowed_paths: Vec<PathRule>,
    /// Scraping of the endpoints' `/metrics`.
    pub metrics: MetricsConfig,
    /// Prompt hashing and the prefix index.
    pub prefix: PrefixConfig,
    /// Filters, scorer weights and picker.
    pub scheduling: SchedulingConfig,
    /// Passive health: endpoints answering 5xx in a row are ejected.
    pub outlier_detection: OutlierConfig,
    /// State shared across Envoy workers.
    pub shared: SharedConfig,
    /// Surviving endpoints that die or hang (see `stall.rs`).
    pub failover: FailoverConfig,
    /// Other kvroute gateways (replicas) to share decisions and in-flight
    /// work with (see `peer/`); absent: this gateway is alone.
    pub peers: Option<PeersConfig>,
    /// Model-aware pools: which endpoints serve which model and adapters
    /// (see `models/`); empty: every endpoint serves every model.
    pub models: Vec<ModelPool>,
    /// Request priorities named by a header (see `objectives.rs`); absent:
    /// every request has priority 0 and none is ever shed.
    pub objectives: Option<ObjectivesConfig>,
    /// When an endpoint counts as saturated, for shedding (`saturation.rs`).
    pub saturation: SaturationConfig,
    /// Most distinct endpoints given per-endpoint stats by one VM (0: none).
    /// Envoy never deletes a stat, and under discovery every new pod address
    /// would add its series for good: past the limit, endpoints not seen
    /// before get none (their updates are counted as dropped).
    pub per_endpoint_stats: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            endpoints: Vec::new(),
            handoff: Handoff::OverrideHost,
            shadow: false,
            discovery: None,
            destination_header: "x-kvroute-destination".into(),
            max_body_bytes: 8 * 1024 * 1024,
            upstream_cluster: "kvroute_upstream".into(),
            debug_header: None,
            allowed_paths: default_allowed_paths(),
            metrics: MetricsConfig::default(),
            prefix: PrefixConfig::default(),
            scheduling: SchedulingConfig::default(),
            outlier_detection: OutlierConfig::default(),
            shared: SharedConfig::default(),
            failover: FailoverConfig::default(),
            peers: None,
            models: Vec::new(),
            objectives: None,
            saturation: SaturationConfig::default(),
            per_endpoint_stats: MAX_ENDPOINTS,
        }
    }
}

/// How the chosen endpoint reaches Envoy's load balancer.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Handoff {
    /// An ORIGINAL_DST cluster connects to exactly the header's `ip:port`.
    OriginalDst,
    /// A cluster with members and the `override_host` policy: the header
    /// lists the choice then fallbacks for retries; Envoy's health checks,
    /// outlier detection and retries still apply.
    OverrideHost,
}

/// Most endpoints in `endpoints` (and the default `per_endpoint_stats`).
pub const MAX_ENDPOINTS: usize = 1024;

/// `discovery.*`: following the upstream cluster's membership.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// Envoy cluster that reaches Envoy's own admin API (read-only use:
    /// `GET /clusters?format=json`).
    pub admin_cluster: String,
    /// How often membership is read.
    pub interval_ms: u64,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig {
            admin_cluster: "kvroute_admin".into(),
            interval_ms: 250,
        }
    }
}

/// `peers.*`: active-active replicas sharing one prefix view (`peer/`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PeersConfig {
    /// Envoy cluster whose members are the replicas' peer listeners (this
    /// replica may be one of them: it recognises itself). Its load balancer
    /// must honour `destination_header` (override_host), like the upstream.
    pub cluster: String,
    /// Envoy cluster that reaches Envoy's own admin API: the members of
    /// `cluster` are read from `GET /clusters?format=json`.
    pub admin_cluster: String,
    /// How often every peer is asked for its new decisions.
    pub sync_interval_ms: u64,
    /// Timeout of one sync call.
    pub timeout_ms: u64,
    /// How often the member list of `cluster` is re-read.
    pub members_interval_ms: u64,
    /// Most peers synced with (members past this are ignored, counted).
    pub max_peers: usize,
    /// Most decisions one sync answer carries (a peer further behind
    /// catches up over several syncs, or skips what its ring lost).
    pub max_entries_per_sync: usize,
    /// Largest sync answer read; a larger one is refused and counted.
    pub max_response_bytes: usize,
    /// A peer not heard from for this long no longer counts: its in-flight
    /// work is ignored.
    pub stale_after_ms: u64,
}

impl Default for PeersConfig {
    fn default() -> Self {
        PeersConfig {
            cluster: "kvroute_peers".into(),
            admin_cluster: "kvroute_admin".into(),
            sync_interval_ms: 50,
            timeout_ms: 250,
            members_interval_ms: 1000,
            max_peers: 16,
            max_entries_per_sync: 512,
            max_response_bytes: 4 * 1024 * 1024,
            stale_after_ms: 1000,
        }
    }
}

/// Which metric names a scrape is read with.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// Detect from the names present (vLLM, SGLang, TensorRT-LLM, llama.cpp).
    Auto,
    /// vLLM (`vllm:*`).
    Vllm,
    /// SGLang (`sglang:*`).
    Sglang,
    /// TensorRT-LLM serve (`trtllm_*`).
    Trtllm,
    /// llama.cpp's `llama-server` started with `--metrics` (`llamacpp:*`).
    Llamacpp,
    /// Only the names given in `metrics.names`.
    Custom,
}

/// Metric names for engines kvroute does not know (or to override one).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MetricNames {
    /// Gauge of requests waiting in the queue.
    pub waiting: Option<String>,
    /// Gauge of requests running.
    pub running: Option<String>,
    /// Gauge of KV-cache utilization.
    pub kv_usage: Option<String>,
    /// Multiplier that brings `kv_usage` to 0..1 (0.01 for a percentage).
    pub kv_usage_scale: Option<f64>,
}

/// `metrics.*`: how and how often endpoints are scraped.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Path scraped on every endpoint.
    pub path: String,
    /// Scrape period; exactly one scraper across all workers.
    pub scrape_interval_ms: u64,
    /// Scrapes per second the whole pool may cost; a pool larger than
    /// `max_scrapes_per_s x scrape_interval_ms / 1000` is scraped less often
    /// (`metrics::schedule`).
    pub max_scrapes_per_s: u64,
    /// Timeout of one scrape.
    pub scrape_timeout_ms: u64,
    /// Largest `/metrics` body read: a larger one is never copied into the
    /// VM (its memory never shrinks) and counts as unreadable.
    pub max_body_bytes: usize,
    /// How often each endpoint's `GET /v1/models` is read again, when a
    /// `models` entry leaves its endpoints to it (an endpoint never listed
    /// is read at once).
    pub models_refresh_ms: u64,
    /// Ask engines that report their slot count (llama.cpp's `GET /props`)
    /// for it, once each and again after a restart (`engine_slots.rs`):
    /// with `scheduling.slot_wait`, each one's limit from the first request.
    pub ask_engine_slots: bool,
    /// A snapshot older than this is not trusted as fresh.
    pub stale_after_ms: u64,
    /// Consecutive failed scrapes after which an endpoint leaves the
    /// candidate set (until a scrape succeeds again).
    pub unhealthy_after_failures: u32,
    /// Metric-name profile.
    pub engine: Engine,
    /// Names for `engine: custom`, or overrides for a known engine.
    pub names: MetricNames,
}

/// Bounds of `metrics.max_body_bytes`: a real engine's `/metrics` is
/// 2-30 KB per model and rank (vLLM 0.29: 28.5 KB), and Envoy gives a call
/// at most 32 MiB of answer (it resets a larger one).
const MIN_METRICS_BODY_BYTES: usize = 64 << 10;
const MAX_METRICS_BODY_BYTES: usize = 32 << 20;

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            path: "/metrics".into(),
            scrape_interval_ms: 50,
            max_scrapes_per_s: 4500,
            scrape_timeout_ms: 1000,
            max_body_bytes: 4 << 20,
            models_refresh_ms: 5000,
            ask_engine_slots: true,
            stale_after_ms: 2000,
            unhealthy_after_failures: 3,
            engine: Engine::Auto,
            names: MetricNames::default(),
        }
    }
}

/// `prefix.*`: how prompts become chained block hashes, and the index bound.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixConfig {
    /// Tokens per hashed block.
    pub block_tokens: usize,
    /// Approximate bytes per token (the filter does not tokenize).
    pub bytes_per_token: usize,
    /// Only the first this-many tokens of a prompt are hashed.
    pub max_prompt_tokens: usize,
    /// Blocks remembered per endpoint (LRU beyond it).
    pub capacity_blocks: usize,
    /// Follow `vllm:cache_config_info` (block_size x num_gpu_blocks) when an
    /// endpoint reports it, instead of `capacity_blocks`.
    pub follow_engine_capacity: bool,
    /// Check each engine's prefix-cache hit counter against what kvroute's
    /// requests believed cached there, and stop valuing the prefixes of an
    /// engine that keeps (almost) none of them (`cache_trust.rs`).
    pub verify_engine_cache: bool,
    /// Most JSON values (and keys) of `tools` and `tool_calls` one request
    /// may hold; the only parts of a body built as values (to sort their
    /// keys). A body over it is routed by load.
    pub max_json_nodes: usize,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            block_tokens: 64,
            bytes_per_token: 4,
            max_prompt_tokens: 262_144,
            capacity_blocks: 31_250,
            follow_engine_capacity: true,
            verify_engine_cache: true,
            max_json_nodes: 32_768,
        }
    }
}

impl PrefixConfig {
    /// Bytes of canonical prompt text per block.
    pub fn block_bytes(&self) -> usize {
        self.block_tokens * self.bytes_per_token
    }

    /// Most blocks one request is hashed into.
    pub fn max_blocks(&self) -> usize {
        self.max_prompt_tokens / self.block_tokens
    }
}

/// Which scheduling profile runs.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Profile {
    /// Weighted sum of all scorers, then max-score picker (llm-d's default
    /// scorer profile, plus kvroute's in-flight scorers).
    Weighted,
    /// Prefix-affinity filter with a load gate, then load scorers (the shape
    /// of llm-d's optimized-baseline profile).
    AffinityGate,
    /// The lowest predicted time to first token for this request: prefill
    /// work ahead of it plus its own uncached tokens, at rates learnt online
    /// per endpoint (`ttft.rs`).
    PredictedTtft,
}

/// `scheduling.ttft.*`: the predicted-TTFT model's priors and learning
/// (`ttft.rs`). The priors hold until the fleet has answered a few
/// streaming requests.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TtftConfig {
    /// Prior prefill time per uncached prompt token, in ms (0.1: 10k
    /// tokens/s, a mid-size model on one GPU).
    pub prior_ms_per_token: f64,
    /// Prior fixed part of a first token (a decode step, network), in ms.
    pub prior_overhead_ms: f64,
    /// Weight of one new observation in an endpoint's factor once warmed
    /// up (the first observations are averaged plainly).
    pub learning_rate: f64,
}

impl Default for TtftConfig {
    fn default() -> Self {
        TtftConfig {
            prior_ms_per_token: 0.1,
            prior_overhead_ms: 20.0,
            learning_rate: 0.1,
        }
    }
}

/// Scorer weights. A weight of 0 disables the scorer.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Weights {
    /// Longest cached prefix, as a fraction of the request.
    pub prefix: f64,
    /// Queue depth (waiting requests), min-max normalized.
    pub queue: f64,
    /// 1 - KV-cache utilization.
    pub kv_cache: f64,
    /// Requests kvroute has in flight to the endpoint.
    pub inflight_requests: f64,
    /// Uncached prompt tokens kvroute expects the endpoint still to prefill.
    pub inflight_tokens: f64,
    /// LoRA adapter running / free slot / waiting (adapter requests only).
    pub lora_affinity: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            prefix: 3.0,
            queue: 2.0,
            kv_cache: 2.0,
            // kvroute's own load between scrapes: 2 so that queue (2) plus
            // in-flight requests (2) can outweigh a full prefix match (3)
            // once an endpoint is clearly overloaded (see scheduler docs).
            inflight_requests: 2.0,
            inflight_tokens: 1.0,
            // Above 3.33: "running" beats "free slot" by more than the cold
            // margin at equal load (scorer/lora_affinity.rs).
            lora_affinity: 6.0,
        }
    }
}

/// Largest `scheduling.engine_slots`: more than any engine runs at once
/// (vLLM's `max_num_seqs` defaults to 256 to 1024).
pub const MAX_ENGINE_SLOTS: u32 = 65_536;

/// `scheduling.*`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulingConfig {
    /// Profile to run.
    pub profile: Profile,
    /// Scorer weights.
    pub weights: Weights,
    /// Affinity filter: keep endpoints whose prefix score is at least this.
    pub affinity_threshold: f64,
    /// Affinity filter load gate: ignore affinity when the sticky endpoints'
    /// queue exceeds the least loaded endpoint's by more than this.
    pub gate_max_queue_excess: f64,
    /// Affinity filter token gate: also ignore affinity when the sticky
    /// endpoints' in-flight uncached prompt tokens exceed the least loaded
    /// endpoint's by more than this (llm-d's `maxTokensInFlightPenalty`;
    /// `null` disables it).
    pub gate_max_tokens_excess: Option<f64>,
    /// RNG seed for tie-breaks (random per VM when absent).
    pub seed: Option<u64>,
    /// Smallest spread (in waiting requests) the queue scorer normalizes
    /// over: score = 1 - (x - min) / max(max - min, this). 0 gives llm-d's
    /// pure min-max, where a 1-request difference already swings the whole
    /// weight.
    pub min_range_requests: f64,
    /// Smallest spread (in requests) the in-flight-requests scorer
    /// normalizes over. Larger than `min_range_requests`: requests in flight
    /// on an engine that is not queueing mostly share its batch.
    pub min_range_inflight: f64,
    /// Smallest spread (in prompt tokens) the in-flight-tokens scorer
    /// normalizes over.
    pub min_range_tokens: f64,
    /// Cold requests (no prefix match anywhere): endpoints within this
    /// fraction of the total weight of the best score count as equal, and
    /// the one with the fewest prompt tokens waiting for their prefill
    /// wins, then the fewest requests in flight, then the least recently
    /// picked.
    pub cold_margin: f64,
    /// `weighted` and `affinity_gate`: when their pick leaves the holder
    /// of the longest prefix for load and would prefill again at least
    /// `keep_cheaper_holder_min_saved` of the prompt, keep the holder if
    /// the TTFT model (`ttft`) prices it cheaper, its queue included, than
    /// the pick (`Router::keep_cheaper_holder`). On by default: long
    /// documents stay on their holders and saturation re-prefills less
    /// (bench/README.md, issue 12).
    pub keep_cheaper_holder: bool,
    /// Share of the prompt (0..=1) the holder must hold beyond the pick for
    /// `keep_cheaper_holder` to weigh in. Smaller differences (a
    /// conversation's last turn, with its shared system prompt everywhere)
    /// are left to the load scores, which also see what the model does not
    /// price: a larger batch's slower steps, a hot prefix gaining holders.
    pub keep_cheaper_holder_min_saved: f64,
    /// `weighted` and `affinity_gate`: when their pick holds the request's
    /// longest prefix, but the TTFT model (`ttft`) prices one of the best
    /// other candidates cheaper even once charged again for the prefill
    /// the move repeats, go there (`Router::leave_costlier_holder`): a hot
    /// prefix gains a holder instead of piling onto the first. The load
    /// scores saturate at their weights and cannot see a holder's decode
    /// load growing; this prices it. On by default (bench/README.md,
    /// issue 12: agentic without an idle pod, hotspot spread, saturation's
    /// TTFT p50 9 % slower on average).
    pub leave_costlier_holder: bool,
    /// For a mixed fleet: price how much slower each endpoint streams its
    /// answers than the fleet's fastest (`decode_speed.rs`, learnt from the
    /// streams the filter passes) into the TTFT model's costs:
    /// `predicted_ttft` and the two cost checks above weigh it, and a cold
    /// or load pick on an endpoint that streams slower moves to a cheaper
    /// one (`Router::check_by_cost`). Changes nothing on a fleet of like
    /// endpoints (rates within x1.5 of the fastest count as equal). Off by
    /// default: on a mixed fleet it raises throughput but, on a cache-bound
    /// workload, costs hit rate (bench/README.md, "A mixed fleet").
    pub decode_speed: bool,
    /// Price the wait for a free slot into the TTFT model's costs
    /// (`slots.rs`): an endpoint seen queueing at the most requests it
    /// ever ran holds that many at once (llama.cpp's slots, vLLM's
    /// `max_num_seqs`), and a request beyond them waits for whole requests
    /// to finish. `predicted_ttft` and the two cost checks above weigh it.
    /// Changes nothing on an endpoint never seen queueing at its highest
    /// running count. On by default (bench/README.md, "Engines with few
    /// slots").
    pub slot_wait: bool,
    /// With `slot_wait`: the most requests each engine runs at once, when
    /// the operator knows it (llama.cpp's `--parallel`, vLLM's
    /// `max_num_seqs`, SGLang's `max_running_requests`). Priced from the
    /// first request, before scrapes could show it; a limit learnt from an
    /// endpoint's scrapes, or a count above this one, replaces it there.
    /// `None` (default): learnt only.
    pub engine_slots: Option<u32>,
    /// The predicted-TTFT model (`profile: predicted_ttft`, and the
    /// cost checks of the other profiles).
    pub ttft: TtftConfig,
}

impl Default for SchedulingConfig {
    fn default() -> Self {
        SchedulingConfig {
            profile: Profile::Weighted,
            weights: Weights::default(),
            affinity_threshold: 0.8,
            gate_max_queue_excess: 8.0,
            gate_max_tokens_excess: Some(286_720.0),
            seed: None,
            min_range_requests: 4.0,
            min_range_inflight: 8.0,
            min_range_tokens: 4096.0,
            cold_margin: 0.05,
            keep_cheaper_holder: true,
            keep_cheaper_holder_min_saved: 0.5,
            leave_costlier_holder: true,
            decode_speed: false,
            slot_wait: true,
            engine_slots: None,
            ttft: TtftConfig::default(),
        }
    }
}

/// `outlier_detection.*`: passive health from inference responses (see
/// `outlier.rs`), with the semantics of Envoy's `consecutive_5xx`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OutlierConfig {
    /// 5xx responses in a row (across workers) that eject an endpoint;
    /// 0 disables passive health.
    pub consecutive_errors: u32,
    /// First ejection length; the n-th ejection in a row lasts n times this.
    pub base_ejection_ms: u64,
    /// Longest ejection.
    pub max_ejection_ms: u64,
    /// Most of the pool (percent) ejected at once; a pool is never emptied.
    pub max_ejection_percent: u32,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        // Envoy's defaults, except: 10 s base (a model server that restarts
        // its engine is back within seconds; Envoy's 30 s would keep a good
        // pod's cache idle) and 50% (Envoy's 10% rounds to nothing in small
        // model-server pools).
        OutlierConfig {
            consecutive_errors: 5,
            base_ejection_ms: 10_000,
            max_ejection_ms: 300_000,
            max_ejection_percent: 50,
        }
    }
}

/// `shared.*`: bounds of the proxy-wasm shared data kvroute uses.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SharedConfig {
    /// Prefix of every shared-data key (Istio plugins share one namespace).
    pub key_prefix: String,
    /// Slots of the decision log that replicates prefix learning across
    /// workers (a ring: older decisions are overwritten).
    pub log_slots: u32,
}

impl Default for SharedConfig {
    fn default() -> Self {
        SharedConfig {
            key_prefix: "kvroute/".into(),
            log_slots: 512,
        }
    }
}

/// `failover.*`: endpoints that die or hang under traffic (see `stall.rs`
/// and docs/ARCHITECTURE.md "Failure behaviour").
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FailoverConfig {
    /// An endpoint is stalled (avoided) when requests have waited this long
    /// on it without any response byte, its `/metrics` has not answered for
    /// as long, and another endpoint's has; 0 disables.
    pub stall_after_ms: u64,
    /// Envoy's per-try timeout (route `retry_policy.per_try_timeout`) for
    /// streaming inference requests (`"stream": true`, marked by kvroute
    /// with [`STREAM_HEADER`]): an attempt with no response headers after
    /// this long is cut, and with `override_host` retried on a fallback.
    /// Engines send a stream's headers when it starts (vLLM, SGLang), so
    /// this bounds the wait on a frozen pod, not a long prefill; 0: none.
    pub first_byte_timeout_ms: u64,
    /// The same bound for every other request: a non-streaming response's
    /// headers come only with its last token, so this cuts generations
    /// longer than it; 0 (default): none (the route idle timeout remains).
    pub response_timeout_ms: u64,
    /// A request Envoy could not get an answer for from the chosen endpoint
    /// (connect failure, reset or timeout before any response byte; with
    /// `override_host` also a retry served elsewhere) takes the endpoint out
    /// of the candidate set for every worker until one of its scrapes answers.
    pub eject_unanswered: bool,
    /// With `override_host`: Envoy also retries (on the fallbacks) a request
    /// whose connection was reset, or timed out, before any response byte
    /// (`retry_on: reset`), not only connect failures.
    pub retry_before_response: bool,
    /// With `override_host`: statuses the chosen endpoint may answer that
    /// Envoy retries on the fallbacks (route `retriable_status_codes`):
    /// an engine that refuses work while overloaded (429, 503) sends the
    /// client's request to the next-best endpoint instead of back to the
    /// client. Such a refusal comes before any byte of the answer and costs
    /// no generation. Empty: none.
    pub retry_statuses: Vec<u16>,
    /// Streamed requests to an endpoint whose engine closes its connection
    /// after every stream without saying so (llama.cpp's `llama-server`,
    /// told by its `/metrics`) carry `Connection: close`, so that Envoy
    /// never sends another request on that connection as it closes.
    pub close_after_stream: bool,
}

/// Most statuses `failover.retry_statuses` may list.
pub const MAX_RETRY_STATUSES: usize = 16;

impl Default for FailoverConfig {
    fn default() -> Self {
        FailoverConfig {
            stall_after_ms: 500,
            first_byte_timeout_ms: 60_000,
            response_timeout_ms: 0,
            eject_unanswered: true,
            retry_before_response: true,
            retry_statuses: vec![429, 503],
            close_after_stream: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn parse(json: &str) -> Result<Config, ConfigError> {
        Config::from_json(json.as_bytes())
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = parse(r#"{"endpoints":["127.0.0.1:8001","127.0.0.1:8002"]}"#).unwrap();
        assert_eq!(c.endpoints.len(), 2);
        assert_eq!(c.destination_header, "x-kvroute-destination");
        assert_eq!(c.metrics.scrape_interval_ms, 50);
        assert_eq!(c.prefix.block_bytes(), 256);
        assert_eq!(c.scheduling.weights.prefix, 3.0);
        assert_eq!(c.scheduling.weights.inflight_requests, 2.0);
        assert_eq!(c.scheduling.min_range_requests, 4.0);
        assert_eq!(c.scheduling.min_range_inflight, 8.0);
        assert_eq!(c.scheduling.min_range_tokens, 4096.0);
        assert_eq!(c.scheduling.cold_margin, 0.05);
        assert!(c.scheduling.keep_cheaper_holder);
        assert_eq!(c.scheduling.keep_cheaper_holder_min_saved, 0.5);
        assert!(c.scheduling.leave_costlier_holder);
        assert!(!c.scheduling.decode_speed);
        assert!(c.scheduling.slot_wait);
        assert_eq!(c.scheduling.engine_slots, None);
        assert_eq!(c.allowed_paths, default_allowed_paths());
        let c = parse(
            r#"{"endpoints":["1.2.3.4:80"],"scheduling":{"min_range_requests":0,"min_range_tokens":0,"cold_margin":0,"keep_cheaper_holder":true}}"#,
        )
        .unwrap();
        assert_eq!(c.scheduling.min_range_requests, 0.0);
        assert!(c.scheduling.keep_cheaper_holder);
        assert_eq!(c.scheduling.gate_max_tokens_excess, Some(286_720.0));
        let c =
            parse(r#"{"endpoints":["1.2.3.4:80"],"scheduling":{"gate_max_tokens_excess":null}}"#)
                .unwrap();
        assert_eq!(c.scheduling.gate_max_tokens_excess, None);
    }

    #[test]
    fn shadow_needs_a_balancer_of_envoy_s_own() {
        let c = parse(r#"{"endpoints":["1.2.3.4:80"],"shadow":true}"#).unwrap();
        assert!(c.shadow);
        assert!(!parse(r#"{"endpoints":["1.2.3.4:80"]}"#).unwrap().shadow);
        let e = parse(r#"{"handoff":"original_dst","shadow":true,"endpoints":["1.2.3.4:80"]}"#)
            .unwrap_err();
        assert_eq!((e.field.as_str(), e.value.as_str()), ("shadow", "true"));
        assert!(e.reason.contains("override_host"), "{e}");
    }

    #[test]
    fn discovery_replaces_endpoints_only_with_override_host() {
        let c = parse(r#"{"discovery":{}}"#).unwrap();
        assert!(c.endpoints.is_empty());
        assert_eq!(c.handoff, Handoff::OverrideHost);
        assert_eq!(c.discovery.unwrap().interval_ms, 250);
        for (json, field) in [
            (r#"{"handoff":"original_dst","discovery":{}}"#, "discovery"),
            (
                r#"{"handoff":"override_host","discovery":{"interval_ms":1}}"#,
                "discovery.interval_ms",
            ),
            (
                r#"{"handoff":"sideways","endpoints":["1.2.3.4:80"]}"#,
                "handoff",
            ),
        ] {
            assert_eq!(parse(json).unwrap_err().field, field, "{json}");
        }
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            ("{}", "endpoints"),
            (r#"{"endpoints":["localhost:80"]}"#, "endpoints[0]"),
            (
                r#"{"endpoints":["1.2.3.4:80","1.2.3.4:80"]}"#,
                "endpoints[1]",
            ),
            (r#"{"endpoints":["1.2.3.4:80"],"bogus":1}"#, "bogus"),
            (
                r#"{"endpoints":["1.2.3.4:80"],"metrics":{"scrape_interval_ms":"x"}}"#,
                "metrics.scrape_interval_ms",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"metrics":{"scrape_interval_ms":1}}"#,
                "metrics.scrape_interval_ms",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"metrics":{"max_scrapes_per_s":0}}"#,
                "metrics.max_scrapes_per_s",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"metrics":{"max_body_bytes":1000}}"#,
                "metrics.max_body_bytes",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"metrics":{"max_body_bytes":67108864}}"#,
                "metrics.max_body_bytes",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"destination_header":"Host"}"#,
                "destination_header",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"scheduling":{"weights":{"queue":-1}}}"#,
                "scheduling.weights.queue",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"scheduling":{"profile":"nope"}}"#,
                "scheduling.profile",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"prefix":{"block_tokens":0}}"#,
                "prefix.block_tokens",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"prefix":{"max_json_nodes":0}}"#,
                "prefix.max_json_nodes",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"scheduling":{"min_range_requests":-1}}"#,
                "scheduling.min_range_requests",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"scheduling":{"min_range_tokens":1e12}}"#,
                "scheduling.min_range_tokens",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"scheduling":{"cold_margin":2}}"#,
                "scheduling.cold_margin",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"scheduling":{"min_range_inflight":"x"}}"#,
                "scheduling.min_range_inflight",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"scheduling":{"min_range_inflight":-1}}"#,
                "scheduling.min_range_inflight",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"scheduling":{"gate_max_tokens_excess":-5}}"#,
                "scheduling.gate_max_tokens_excess",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"scheduling":{"engine_slots":0}}"#,
                "scheduling.engine_slots",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"scheduling":{"engine_slots":4,"slot_wait":false}}"#,
                "scheduling.engine_slots",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"outlier_detection":{"max_ejection_percent":101}}"#,
                "outlier_detection.max_ejection_percent",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"outlier_detection":{"base_ejection_ms":20000,"max_ejection_ms":1000}}"#,
                "outlier_detection.max_ejection_ms",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"outlier_detection":{"consecutive_5xx":3}}"#,
                "outlier_detection.consecutive_5xx",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"allowed_paths":[]}"#,
                "allowed_paths",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"allowed_paths":["/v1/models","/v1/../sim"]}"#,
                "allowed_paths[1]",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"allowed_paths":["/a","/a"]}"#,
                "allowed_paths[1]",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"failover":{"stall_after_ms":10}}"#,
                "failover.stall_after_ms",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"failover":{"first_byte_timeout_ms":99}}"#,
                "failover.first_byte_timeout_ms",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"failover":{"response_timeout_ms":5}}"#,
                "failover.response_timeout_ms",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"failover":{"retry_statuses":[429,200]}}"#,
                "failover.retry_statuses[1]",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"failover":{"retry_statuses":[429,70000]}}"#,
                "failover.retry_statuses[1]",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"failover":{"retry_statuses":[429,429,429,429,429,429,429,429,429,429,429,429,429,429,429,429,429]}}"#,
                "failover.retry_statuses",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"failover":{"retry":true}}"#,
                "failover.retry",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"models":[{"name":"a*b","endpoints":["1.2.3.4:80"]}]}"#,
                "models[0].name",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"models":[{"name":"a","endpoints":["1.2.3.4:80"],"adapter":[]}]}"#,
                "models[0].adapter",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"models":[{"name":"a","endpoints":["1.2.3.4:81"]}]}"#,
                "models[0].endpoints[0]",
            ),
            (
                r#"{"discovery":{},"models":[{"name":"a","endpoints":["1.2.3.4:81"]}]}"#,
                "models[0].endpoints",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"metrics":{"models_refresh_ms":999}}"#,
                "metrics.models_refresh_ms",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"objectives":{"header":"x-kvroute-destination"}}"#,
                "objectives.header",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"objectives":{"header":"X-Objective"}}"#,
                "objectives.header",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"objectives":{"priorities":{"batch":"low"}}}"#,
                "objectives.priorities.batch",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"objectives":{"priorities":{"Batch":-1}}}"#,
                "objectives.priorities.Batch",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"saturation":{"kv_usage_threshold":80}}"#,
                "saturation.kv_usage_threshold",
            ),
            (
                r#"{"endpoints":["1.2.3.4:80"],"per_endpoint_stats":70000}"#,
                "per_endpoint_stats",
            ),
            ("not json", "(config)"),
        ];
        for (json, field) in cases {
            let e = parse(json).unwrap_err();
            assert_eq!(e.field, field, "{json}: {e}");
            assert!(e.to_string().contains(field), "{e}");
        }
    }

    #[test]
    fn models_objectives_and_saturation_default_to_todays_behaviour() {
        let c = parse(r#"{"endpoints":["1.2.3.4:80"]}"#).unwrap();
        assert!(c.models.is_empty());
        assert!(c.objectives.is_none());
        assert_eq!(c.saturation.queue_threshold, 5.0);
        assert_eq!(c.saturation.kv_usage_threshold, 0.8);
        assert_eq!(c.saturation.stale_after(c.metrics.scrape_interval_ms), 200);
        let c = parse(
            r#"{"endpoints":["1.2.3.4:80","1.2.3.4:81"],
                "models":[{"name":"a","endpoints":["1.2.3.4:80"],"adapters":["a-*"]},{"name":"b","endpoints":["1.2.3.4:81"]}],
                "objectives":{"priorities":{"batch":-1}}}"#,
        )
        .unwrap();
        assert_eq!(c.models.len(), 2);
        let o = c.objectives.unwrap();
        assert_eq!(o.header, "x-gateway-inference-objective");
        assert_eq!(o.priorities["batch"], -1);
        // Discovered pools: entries without endpoints (their pods' own
        // /v1/models decides), read every 5 s by default.
        let c = parse(
            r#"{"discovery":{},"models":[{"name":"a"},{"name":"b-*","adapters":["b-sql"]}]}"#,
        )
        .unwrap();
        assert!(c.models.iter().all(|m| m.endpoints.is_empty()));
        assert_eq!(c.metrics.models_refresh_ms, 5000);
        assert!(c.metrics.ask_engine_slots);
    }

    #[test]
    fn non_utf8_is_an_error_not_a_panic() {
        assert!(Config::from_json(&[0xff, 0xfe]).is_err());
    }
}
