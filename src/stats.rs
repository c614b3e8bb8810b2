//! Every stat kvroute exports, defined once per VM and recorded through typed
//! functions, so no call site spells a stat name. In Envoy they appear as
//! `wasmcustom.kvroute.*` (Prometheus: `kvroute_*`, without Envoy's
//! custom-stat namespace); per-endpoint
//! stats carry the endpoint in the name (`kvroute.endpoint.<ip>_<port>.*`),
//! which the Envoy bootstrap's `stats_tags` turns into an `endpoint` label.
//! Counters add up across VMs; gauges are last-write-wins, so per-endpoint
//! gauges are written from the shared (cross-worker) values.

use kvroute_core::endpoint::Endpoint;
use kvroute_core::scheduler::Reason;
use kvroute_core::ttft::observed_percent;
use proxy_wasm::hostcalls::{define_metric, increment_metric, record_metric};
use proxy_wasm::types::MetricType;
use std::collections::{HashMap, HashSet};

/// Request and scrape counters (the table in `docs/CONFIG.md#stats`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Every request the filter saw.
    Requests,
    /// Requests an endpoint was chosen for.
    Routed,
    /// Inference requests whose body was understood.
    Parsed,
    /// Inference requests whose body was not understood (routed by load).
    Unparsed,
    /// Inference requests whose body exceeded `max_body_bytes` (routed by load).
    BodyTooLarge,
    /// Non-inference requests (routed by load without buffering).
    Passthrough,
    /// Requests refused because the pool was empty.
    NoEndpoint,
    /// Client-supplied destination headers removed.
    SteeringHeaderRemoved,
    /// Requests refused because their path is not in `allowed_paths`.
    PathBlocked,
    /// Decisions made by a cached prefix.
    DecisionPrefix,
    /// Decisions made by load.
    DecisionLoad,
    /// Decisions for requests no endpoint held a prefix of.
    DecisionCold,
    /// Decisions made without a healthy candidate.
    DecisionFallback,
    /// Decisions where `keep_cheaper_holder` kept a prefix holder the
    /// scores would have left (also counted as prefix decisions).
    DecisionKeptByCost,
    /// Decisions where `leave_costlier_holder` left the prefix holder the
    /// scores picked for a cheaper endpoint (also counted as load
    /// decisions).
    DecisionMovedByCost,
    /// Cold and load decisions moved off an endpoint that streams answers
    /// slower than the fleet's fastest (`scheduling.decode_speed`; also
    /// counted under their reason).
    DecisionMovedByDecode,
    /// Cold decisions moved off an endpoint whose every slot was taken
    /// (`scheduling.slot_wait`; also counted as cold decisions).
    DecisionMovedBySlots,
    /// Decisions made again because another worker changed the in-flight
    /// table while they were being made (`VmState::route`): the first one
    /// had not seen that change.
    DecisionRedecided,
    /// Engine restarts seen by the scraper (an endpoint's prompt-token
    /// counter went down): the prefix index forgets what it held there.
    EngineRestarts,
    /// Drops of an endpoint's prompt-token counter within
    /// `shared::endpoint_state::FLAP_WINDOW_MS` of its last one, not counted
    /// as restarts: the endpoint is in front of several engines.
    EngineCounterFlaps,
    /// Verdicts of a worker that an engine keeps (almost) none of the
    /// prompts sent to it (`prefix.verify_engine_cache`): its prefixes count
    /// for nothing in that worker's decisions until it keeps them again.
    EngineCacheDistrusted,
    /// Successful `/metrics` scrapes.
    ScrapeSuccess,
    /// Failed `/metrics` scrapes (connect error, timeout, non-200, unreadable).
    ScrapeFailure,
    /// `/metrics` answers over `metrics.max_body_bytes`, not read (also
    /// failures).
    ScrapeTooLarge,
    /// Decision-log entries overwritten before this VM replayed them.
    LogLost,
    /// Endpoints ejected by passive health (consecutive 5xx).
    OutlierEjected,
    /// Requests the chosen endpoint sent no response byte for (connect
    /// failure, reset, first-byte timeout, or answered by a retry elsewhere).
    Unanswered,
    /// Endpoints found stalled (requests without a first byte and a silent
    /// `/metrics` while others answer), counted by each VM that noticed.
    Stalled,
    /// Answers the client got with a `failover.retry_statuses` status (an
    /// engine refusing work while overloaded): not retried (`original_dst`)
    /// or refused by every try. (A refusal a fallback answered counts as
    /// `Unanswered`: the filter sees only the fallback's answer.)
    Refused,
    /// Requests a fallback answered (2xx) after the chosen endpoint did not:
    /// the prefix index now records the prompt on that fallback.
    FallbackAnswered,
    /// Requests whose chosen endpoint answered other than 2xx (or not at
    /// all) after their decision taught the prefix index: unlearnt.
    PrefixForgotten,
    /// Sync calls a peer answered.
    PeerSyncOk,
    /// Sync calls that failed (connect error, timeout, not 200).
    PeerSyncFailed,
    /// Sync answers refused: too large or not the sync format.
    PeerMalformed,
    /// Peers' decisions learned.
    PeerLearned,
    /// Peers' refusals (`forget` entries) unlearnt.
    PeerRefusals,
    /// Peers' decisions refused (endpoint outside the pool, no or too many blocks, echoed).
    PeerDropped,
    /// Peers' decisions their rings lost before this replica asked.
    PeerSkipped,
    /// Bytes of sync answers read.
    PeerBytes,
    /// Sync requests this replica answered.
    PeerServed,
    /// Requests for a model no `models` entry serves (JSON 404).
    ModelNotFound,
    /// `GET /v1/models` (and `/v1/models/{id}`) answered from the config.
    ModelsListed,
    /// Requests shed (429): sheddable objective, every endpoint saturated.
    Shed,
    /// Requests for a configured model no answering endpoint lists yet (503).
    ModelUnavailable,
    /// Endpoints' `GET /v1/models` answers read (`models` without endpoints).
    ModelsListRead,
    /// `GET /v1/models` calls unanswered or unreadable (previous list kept).
    ModelsListFailure,
    /// `GET /v1/models` answers listing more ids than are kept (64).
    ModelsListTruncated,
    /// Slot counts read from engines that report one (llama.cpp's
    /// `GET /props`).
    EngineSlotsRead,
    /// Asks for an engine's slot count unanswered, or answered without one.
    EngineSlotsFailure,
    /// Streamed requests sent with `Connection: close` to an engine that
    /// closes its connection after a stream anyway (llama.cpp), so that
    /// Envoy does not send another request on it as it closes.
    ConnectionClose,
    /// Per-endpoint stat updates not recorded: the endpoint came after
    /// `per_endpoint_stats` others.
    EndpointStatsDropped,
    /// `shadow` mode: requests Envoy's balancer sent to the endpoint
    /// kvroute chose.
    ShadowSameEndpoint,
    /// `shadow` mode: requests Envoy's balancer sent elsewhere.
    ShadowOtherEndpoint,
    /// `shadow` mode: prompt tokens the prefix index believed cached at
    /// kvroute's choice, summed over the requests counted above.
    ShadowCachedTokensKvroute,
    /// `shadow` mode: the same at the endpoint Envoy's balancer chose.
    ShadowCachedTokensBalancer,
}

const COUNTERS: [(Counter, &str); 55] = [
    (Counter::Requests, "kvroute.requests"),
    (Counter::Routed, "kvroute.routed"),
    (Counter::Parsed, "kvroute.parsed"),
    (Counter::Unparsed, "kvroute.unparsed"),
    (Counter::BodyTooLarge, "kvroute.body_too_large"),
    (Counter::Passthrough, "kvroute.passthrough"),
    (Counter::NoEndpoint, "kvroute.no_endpoint"),
    (
        Counter::SteeringHeaderRemoved,
        "kvroute.steering_header_removed",
    ),
    (Counter::PathBlocked, "kvroute.path_blocked"),
    (Counter::DecisionPrefix, "kvroute.decision.prefix"),
    (Counter::DecisionLoad, "kvroute.decision.load"),
    (Counter::DecisionCold, "kvroute.decision.cold"),
    (Counter::DecisionFallback, "kvroute.decision.fallback"),
    (Counter::DecisionKeptByCost, "kvroute.decision.kept_by_cost"),
    (
        Counter::DecisionMovedByCost,
        "kvroute.decision.moved_by_cost",
    ),
    (
        Counter::DecisionMovedByDecode,
        "kvroute.decision.moved_by_decode",
    ),
    (
        Counter::DecisionMovedBySlots,
        "kvroute.decision.moved_by_slots",
    ),
    (Counter::DecisionRedecided, "kvroute.decision.redecided"),
    (Counter::EngineRestarts, "kvroute.engine_restarts"),
    (Counter::EngineCounterFlaps, "kvroute.engine_counter_flaps"),
    (
        Counter::EngineCacheDistrusted,
        "kvroute.engine_cache_distrusted",
    ),
    (Counter::ScrapeSuccess, "kvroute.scrape.success"),
    (Counter::ScrapeFailure, "kvroute.scrape.failure"),
    (Counter::ScrapeTooLarge, "kvroute.scrape.too_large"),
    (Counter::LogLost, "kvroute.log_lost"),
    (Counter::OutlierEjected, "kvroute.outlier.ejected"),
    (Counter::Unanswered, "kvroute.failover.unanswered"),
    (Counter::Stalled, "kvroute.failover.stalled"),
    (Counter::Refused, "kvroute.failover.refused"),
    (
        Counter::FallbackAnswered,
        "kvroute.failover.fallback_answered",
    ),
    (Counter::PrefixForgotten, "kvroute.prefix.forgotten"),
    (Counter::PeerSyncOk, "kvroute.peer.sync_ok"),
    (Counter::PeerSyncFailed, "kvroute.peer.sync_failed"),
    (Counter::PeerMalformed, "kvroute.peer.malformed"),
    (Counter::PeerLearned, "kvroute.peer.learned"),
    (Counter::PeerRefusals, "kvroute.peer.refusals"),
    (Counter::PeerDropped, "kvroute.peer.dropped"),
    (Counter::PeerSkipped, "kvroute.peer.skipped"),
    (Counter::PeerBytes, "kvroute.peer.bytes"),
    (Counter::PeerServed, "kvroute.peer.served"),
    (Counter::ModelNotFound, "kvroute.model_not_found"),
    (Counter::ModelsListed, "kvroute.models_listed"),
    (Counter::Shed, "kvroute.shed"),
    (Counter::ModelUnavailable, "kvroute.model_unavailable"),
    (Counter::ModelsListRead, "kvroute.models_list.read"),
    (Counter::EngineSlotsRead, "kvroute.engine_slots.read"),
    (Counter::EngineSlotsFailure, "kvroute.engine_slots.failure"),
    (
        Counter::ConnectionClose,
        "kvroute.failover.connection_close",
    ),
    (Counter::ModelsListFailure, "kvroute.models_list.failure"),
    (
        Counter::ModelsListTruncated,
        "kvroute.models_list.truncated",
    ),
    (
        Counter::EndpointStatsDropped,
        "kvroute.endpoint_stats_dropped",
    ),
    (Counter::ShadowSameEndpoint, "kvroute.shadow.same_endpoint"),
    (
        Counter::ShadowOtherEndpoint,
        "kvroute.shadow.other_endpoint",
    ),
    (
        Counter::ShadowCachedTokensKvroute,
        "kvroute.shadow.cached_tokens_kvroute",
    ),
    (
        Counter::ShadowCachedTokensBalancer,
        "kvroute.shadow.cached_tokens_balancer",
    ),
];

/// What happened to a request of an objective (per-objective counters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectiveCounter {
    /// Requests naming the objective that reached a decision (routed or shed).
    Requests,
    /// Of those, requests shed with 429.
    Shed,
}

/// Per-endpoint gauges.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EndpointGauge {
    /// Requests kvroute has in flight to the endpoint (all workers).
    InflightRequests,
    /// 1 when the endpoint is a candidate, 0 when its scrapes keep failing.
    Healthy,
    /// Age of the endpoint's latest snapshot when last scraped, in ms.
    SnapshotAgeMs,
    /// Waiting requests in the latest snapshot.
    Waiting,
    /// The slot count its engine reported (`GET /props` on llama.cpp).
    EngineSlots,
    /// 1 while its engine is believed to keep (almost) none of the prompts
    /// sent to it (`prefix.verify_engine_cache`), 0 once it keeps them again.
    CacheDistrusted,
}

impl EndpointGauge {
    fn suffix(self) -> &'static str {
        match self {
            EndpointGauge::InflightRequests => "inflight_requests",
            EndpointGauge::Healthy => "healthy",
            EndpointGauge::SnapshotAgeMs => "snapshot_age_ms",
            EndpointGauge::Waiting => "waiting",
            EndpointGauge::EngineSlots => "engine_slots",
            EndpointGauge::CacheDistrusted => "cache_distrusted",
        }
    }
}

/// Per-endpoint counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EndpointCounter {
    /// Requests routed to the endpoint.
    Routed,
    /// Failed scrapes of the endpoint.
    ScrapeFailures,
    /// Passive-health ejections of the endpoint.
    Ejections,
    /// Requests the endpoint, when chosen, sent no response byte for.
    Unanswered,
    /// Times a VM found the endpoint stalled.
    Stalls,
}

impl EndpointCounter {
    fn suffix(self) -> &'static str {
        match self {
            EndpointCounter::Routed => "routed",
            EndpointCounter::ScrapeFailures => "scrape_failures",
            EndpointCounter::Ejections => "ejections",
            EndpointCounter::Unanswered => "unanswered",
            EndpointCounter::Stalls => "stalls",
        }
    }
}

/// Metric ids of one VM.
#[derive(Debug, Default)]
pub struct Stats {
    counters: Vec<Option<u32>>,
    matched_prefix_percent: Option<u32>,
    ttft_ms: Option<u32>,
    ttft_vs_predicted_percent: Option<u32>,
    peer_lag_ms: Option<u32>,
    peer_replicas: Option<u32>,
    per_endpoint: HashMap<(Endpoint, &'static str), Option<u32>>,
    /// Endpoints given per-endpoint stats, at most `endpoint_limit`: Envoy
    /// keeps a stat for good, so new addresses (pods replaced under
    /// discovery) must not add series, and entries here, without end.
    endpoints: HashSet<Endpoint>,
    endpoint_limit: usize,
    /// `[requests, shed, ttft_ms]` per listed objective (sorted names),
    /// then the default (requests naming no listed objective).
    per_objective: Vec<[Option<u32>; 3]>,
}

impl Stats {
    /// Defines the fixed stats (once per VM); at most `endpoint_limit`
    /// endpoints get per-endpoint stats (`per_endpoint_stats`).
    pub fn define(endpoint_limit: usize) -> Stats {
        Stats {
            counters: COUNTERS
                .iter()
                .map(|(_, name)| define_metric(MetricType::Counter, name).ok())
                .collect(),
            matched_prefix_percent: define_metric(
                MetricType::Histogram,
                "kvroute.matched_prefix_percent",
            )
            .ok(),
            ttft_ms: define_metric(MetricType::Histogram, "kvroute.ttft_ms").ok(),
            ttft_vs_predicted_percent: define_metric(
                MetricType::Histogram,
                "kvroute.ttft_vs_predicted_percent",
            )
            .ok(),
            peer_lag_ms: define_metric(MetricType::Histogram, "kvroute.peer.lag_ms").ok(),
            peer_replicas: define_metric(MetricType::Gauge, "kvroute.peer.replicas").ok(),
            per_endpoint: HashMap::new(),
            endpoints: HashSet::new(),
            endpoint_limit,
            per_objective: Vec::new(),
        }
    }

    /// Defines the per-objective counters and time-to-first-token
    /// histograms (`objectives.priorities` names, sorted, then the default
    /// bucket), once per VM.
    pub fn define_objectives<'a>(&mut self, names: impl Iterator<Item = &'a str>) {
        let define = |prefix: String| {
            [
                define_metric(MetricType::Counter, &format!("{prefix}.requests")).ok(),
                define_metric(MetricType::Counter, &format!("{prefix}.shed")).ok(),
                define_metric(MetricType::Histogram, &format!("{prefix}.ttft_ms")).ok(),
            ]
        };
        self.per_objective = names
            .map(|n| define(format!("kvroute.objective.{n}")))
            .collect();
        self.per_objective
            .push(define("kvroute.objective_default".into()));
    }

    /// Adds one to a counter of objective `index` (`None`: the default).
    pub fn objective_inc(&self, index: Option<usize>, counter: ObjectiveCounter) {
        if let Some(id) = self.objective_metric(index, counter as usize) {
            let _ = increment_metric(id, 1);
        }
    }

    /// Metric `which` (`ObjectiveCounter`, or 2: the time to first token)
    /// of objective `index` (`None`: the default), when objectives are set.
    fn objective_metric(&self, index: Option<usize>, which: usize) -> Option<u32> {
        let i = index.unwrap_or(self.per_objective.len().saturating_sub(1));
        *self.per_objective.get(i)?.get(which)?
    }

    /// Adds one to a counter.
    pub fn inc(&self, counter: Counter) {
        self.add(counter, 1);
    }

    /// Adds `n` to a counter.
    pub fn add(&self, counter: Counter, n: u64) {
        let i = COUNTERS.iter().position(|(c, _)| *c == counter);
        if let Some(Some(id)) = i.and_then(|i| self.counters.get(i)) {
            if n > 0 {
                let _ = increment_metric(*id, n.min(i64::MAX as u64) as i64);
            }
        }
    }

    /// Records how long a peer's decision took to reach this replica.
    pub fn peer_lag(&self, ms: u64) {
        if let Some(id) = self.peer_lag_ms {
            let _ = record_metric(id, ms);
        }
    }

    /// Sets the number of peers heard from recently.
    pub fn peer_replicas(&self, n: u64) {
        if let Some(id) = self.peer_replicas {
            let _ = record_metric(id, n);
        }
    }

    /// Counts a decision by its reason.
    pub fn decision(&self, reason: Reason) {
        self.inc(match reason {
            Reason::Prefix => Counter::DecisionPrefix,
            Reason::Load => Counter::DecisionLoad,
            Reason::Cold => Counter::DecisionCold,
            Reason::Fallback => Counter::DecisionFallback,
        });
    }

    /// Records the matched share of a request's prompt blocks (0..=100).
    pub fn matched_prefix(&self, percent: u64) {
        if let Some(id) = self.matched_prefix_percent {
            let _ = record_metric(id, percent.min(100));
        }
    }

    /// Records a stream's time to first token as the gateway saw it (routing
    /// to the first response chunk, ms), also under its objective (`index`,
    /// `None`: the default) when objectives are set, and, when the TTFT model
    /// predicted it, the observed time as a percentage of the prediction
    /// (100: exact; at most 100x either way).
    pub fn first_token(&self, ms: u64, objective: Option<usize>, predicted_ms: Option<f64>) {
        for id in [self.ttft_ms, self.objective_metric(objective, 2)]
            .into_iter()
            .flatten()
        {
            let _ = record_metric(id, ms);
        }
        if let (Some(id), Some(predicted)) = (self.ttft_vs_predicted_percent, predicted_ms) {
            let _ = record_metric(id, observed_percent(ms, predicted));
        }
    }

    /// Sets a per-endpoint gauge.
    pub fn endpoint_gauge(&mut self, endpoint: Endpoint, gauge: EndpointGauge, value: u64) {
        if let Some(id) = self.endpoint_metric(endpoint, gauge.suffix(), MetricType::Gauge) {
            let _ = record_metric(id, value);
        }
    }

    /// Adds one to a per-endpoint counter.
    pub fn endpoint_inc(&mut self, endpoint: Endpoint, counter: EndpointCounter) {
        if let Some(id) = self.endpoint_metric(endpoint, counter.suffix(), MetricType::Counter) {
            let _ = increment_metric(id, 1);
        }
    }

    fn endpoint_metric(
        &mut self,
        endpoint: Endpoint,
        suffix: &'static str,
        kind: MetricType,
    ) -> Option<u32> {
        if !self.endpoints.contains(&endpoint) {
            if self.endpoints.len() >= self.endpoint_limit {
                self.inc(Counter::EndpointStatsDropped);
                return None;
            }
            self.endpoints.insert(endpoint);
        }
        *self
            .per_endpoint
            .entry((endpoint, suffix))
            .or_insert_with(|| {
                let name = format!("kvroute.endpoint.{}.{}", stat_label(endpoint), suffix);
                define_metric(kind, &name).ok()
            })
    }
}

/// An endpoint as a stat-name segment: `10.0.0.1:8000` -> `10_0_0_1_8000`.
pub fn stat_label(endpoint: Endpoint) -> String {
    endpoint
        .to_string()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect::<String>()
        .trim_matches('_')
        .to_string()
}
