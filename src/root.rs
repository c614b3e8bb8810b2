//! The root context: one per VM (each Envoy worker thread, the main thread,
//! and a short-lived canary) and plugin. It validates the configuration,
//! creates the per-request contexts, and on every tick refreshes the shared
//! view and, if it holds the scraper lease, scrapes every endpoint's
//! `/metrics` and syncs with the peers (`peer_sync`). The plugin whose root
//! id is [`PEER_ROOT_ID`] (on the peer listener) only answers peers' sync
//! requests (`peer_server`): it has no tick and routes nothing.

use crate::filter::RequestFilter;
use crate::peer_server::PeerServer;
use crate::peer_sync;
use crate::stats::{Counter, EndpointCounter, EndpointGauge};
use crate::vm_state::VmState;
use kvroute_core::config::Config;
use kvroute_core::discovery::cluster_members;
use kvroute_core::endpoint::Endpoint;
use kvroute_core::engine_slots::{self, SlotAsks};
use kvroute_core::metrics::schedule::{self, ListingSchedule, ScrapeSchedule};
use kvroute_core::metrics::scrape::{classify, ScrapeOutcome};
use kvroute_core::models::served::{self, ListingOutcome, ServedModels};
use kvroute_core::peer::REFUSALS_HEADER;
use kvroute_core::shared::endpoint_state::CounterNews;
use log::{debug, error, info, warn};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

/// An HTTP call this VM is waiting for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    /// `GET /metrics` of an endpoint.
    Scrape(Endpoint),
    /// `GET /v1/models` of an endpoint (`models` entries without endpoints).
    ListModels(Endpoint),
    /// An endpoint's slot count, where its engine reports one
    /// (`engine_slots.rs`: llama.cpp's `GET /props`).
    EngineSlots(Endpoint),
    /// `GET /clusters?format=json` of Envoy's admin API.
    Discovery,
    /// A sync request to a member of the peers cluster.
    PeerSync(Endpoint),
}

/// Root id of the plugin on the peer listener.
pub const PEER_ROOT_ID: &str = "kvroute_peer";

/// What a plugin does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Role {
    /// Routes requests (the public listener).
    #[default]
    Router,
    /// Answers peers' sync requests (the peer listener).
    PeerServer,
}

/// Root context of one VM.
#[derive(Default)]
pub struct KvRouteRoot {
    state: Option<Rc<RefCell<VmState>>>,
    /// Calls in flight, by token.
    pending: HashMap<u32, Call>,
    /// Endpoints whose scrape is in flight (a map: a linear search of
    /// `pending` per endpoint made a tick quadratic in the pool), with
    /// kvroute's requests on each when it was sent
    /// (`EndpointStates::counted_own`).
    scraping: HashMap<Endpoint, u32>,
    /// Which endpoints are due on a tick (the pool's scrape budget).
    schedule: ScrapeSchedule,
    /// Endpoints whose `/v1/models` call is in flight.
    listing: HashSet<Endpoint>,
    /// Which endpoints' `/v1/models` to read on a tick.
    list_schedule: ListingSchedule,
    /// `/v1/models` answers not yet published (with `answers`).
    listings: Vec<(Endpoint, ListingOutcome, u64)>,
    /// Where each endpoint whose last readable scrape came from an engine
    /// that reports its slot count answers it.
    slot_paths: HashMap<Endpoint, &'static str>,
    /// When each of those was last asked.
    slot_asks: SlotAsks,
    /// Slot counts read and not yet published (with `answers`).
    slot_counts: Vec<(Endpoint, u32)>,
    /// Scrape answers not yet published to shared data: they are written
    /// in one update once every scrape in flight has answered (or on the
    /// next tick), not one rewrite of the whole pool's state per answer.
    /// With each: when it came, and kvroute's requests there when it was sent.
    answers: Vec<(Endpoint, ScrapeOutcome, u64, u32)>,
    /// What this VM has warned about each endpoint: once each (pool
    /// members only).
    warned: HashSet<(Endpoint, Warning)>,
    /// When the per-endpoint snapshot-age gauges were last written.
    last_ages_ms: u64,
    /// When membership was last requested.
    last_discovery_ms: u64,
    /// When peers were last asked for their news.
    last_sync_ms: u64,
    role: Role,
}

/// Wall-clock milliseconds from a context's clock.
pub fn now_ms(ctx: &dyn Context) -> u64 {
    ctx.get_current_time()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A VM id unlikely to collide with another VM's: wall-clock nanos mixed
/// with the host's random source (WASI `random_get`, via std's hasher keys).
fn new_vm_id(ctx: &dyn Context) -> u64 {
    let nanos = ctx
        .get_current_time()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(nanos);
    h.finish() | 1
}

/// Warnings logged once per endpoint: each holds for as long as the endpoint
/// is misconfigured, and would otherwise repeat on every scrape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Warning {
    /// Its prompt-token counter goes up and down (several engines behind it).
    CounterFlaps,
    /// Its `/metrics` answers are over `metrics.max_body_bytes`.
    MetricsTooLarge,
}

/// What Envoy says of an HTTP call's answer when it calls back.
#[derive(Clone, Copy, Debug)]
struct CallAnswer {
    num_headers: usize,
    body_size: usize,
}

impl KvRouteRoot {
    /// The status of a call's answer; `None` when the call failed after it
    /// was sent. Envoy then calls back without headers (the stream was
    /// reset, e.g. by a server dying mid-answer, or the answer outgrew the
    /// 32 MiB Envoy buffers for a call), and reading a header of it is an
    /// error the SDK panics on: the VM would die, and every request on its
    /// worker with it.
    fn call_status(&self, answer: CallAnswer) -> Option<u16> {
        if answer.num_headers == 0 {
            return None;
        }
        self.get_http_call_response_header(":status")
            .and_then(|s| s.parse::<u16>().ok())
    }

    /// The body of a call's answer, if it has headers and at most `max`
    /// bytes: a larger one is never copied into the VM (its memory never
    /// shrinks).
    fn call_body(&self, answer: CallAnswer, max: usize) -> Option<Vec<u8>> {
        (answer.num_headers > 0 && answer.body_size <= max).then(|| {
            self.get_http_call_response_body(0, answer.body_size)
                .unwrap_or_default()
        })
    }

    /// Whether to warn about `endpoint` now: the first time only (while it
    /// stays in `pool`, sorted).
    fn first_warning(&mut self, endpoint: Endpoint, warning: Warning, pool: &[Endpoint]) -> bool {
        self.warned.retain(|(e, _)| pool.binary_search(e).is_ok());
        self.warned.insert((endpoint, warning))
    }

    fn scrape(&mut self, state: &VmState, now: u64) {
        let cfg = state.config();
        let scraping = &self.scraping;
        // An endpoint whose previous scrape has not answered yet is skipped.
        let due = self.schedule.due(
            state.router.pool(),
            &cfg.metrics,
            now,
            |e| scraping.contains_key(&e),
            |e| state.states.get(e).answered_at_ms,
        );
        if due.is_empty() {
            return;
        }
        let own = state.own_requests(due.iter().copied());
        for (endpoint, own) in due.into_iter().zip(own) {
            if self.get(
                cfg,
                endpoint,
                &cfg.metrics.path,
                "text/plain",
                Call::Scrape(endpoint),
            ) {
                self.scraping.insert(endpoint, own);
            }
        }
    }

    /// Sends `GET path` to `endpoint` through the upstream cluster (the
    /// destination header steers it there), its answer to come back as
    /// `call`; false (and a warning) when Envoy refuses the call.
    fn get(
        &mut self,
        cfg: &Config,
        endpoint: Endpoint,
        path: &str,
        accept: &str,
        call: Call,
    ) -> bool {
        let authority = endpoint.to_string();
        let headers = vec![
            (":method", "GET"),
            (":path", path),
            (":authority", authority.as_str()),
            (cfg.destination_header.as_str(), authority.as_str()),
            ("accept", accept),
        ];
        let timeout = Duration::from_millis(cfg.metrics.scrape_timeout_ms);
        match self.dispatch_http_call(&cfg.upstream_cluster, headers, None, vec![], timeout) {
            Ok(token) => {
                self.pending.insert(token, call);
                true
            }
            Err(status) => {
                warn!(
                    "kvroute: cannot dispatch GET {path} to {endpoint} via cluster {}: {status:?}",
                    cfg.upstream_cluster
                );
                false
            }
        }
    }

    /// Reads `GET /v1/models` of the endpoints due (only when a `models`
    /// entry leaves its endpoints to it): what each serves.
    fn list_models(&mut self, state: &VmState, now: u64) {
        if !state.router.models().lists() {
            return;
        }
        let cfg = state.config();
        let pool = state.router.pool();
        let listing = &self.listing;
        let due = self.list_schedule.due(
            pool,
            cfg.metrics.models_refresh_ms,
            schedule::period_ms(&cfg.metrics, pool.len()),
            now,
            |e| listing.contains(&e),
            |e| state.states.listed_at(e),
        );
        self.schedule.spend(due.len(), pool.len());
        for endpoint in due {
            let call = Call::ListModels(endpoint);
            if self.get(cfg, endpoint, served::LIST_PATH, "application/json", call) {
                self.listing.insert(endpoint);
            }
        }
    }

    fn on_list_models(&mut self, endpoint: Endpoint, answer: CallAnswer) {
        self.listing.remove(&endpoint);
        let Some(state) = self.state.clone() else {
            return;
        };
        let status = self.call_status(answer);
        let body = self.call_body(answer, served::MAX_BODY_BYTES);
        let outcome = served::classify(status, body.as_deref());
        self.list_schedule
            .answered(endpoint, outcome != ListingOutcome::Unreachable);
        self.listings.push((endpoint, outcome, now_ms(self)));
        if self.scraping.is_empty() && self.listing.is_empty() {
            self.publish_answers(&mut state.borrow_mut());
        }
    }

    /// Asks the endpoints whose engine reports its slot count and has not
    /// told it yet (or not since it restarted) for it, each at most once a
    /// `engine_slots::RETRY_MS`, paid from the scrape budget.
    fn ask_engine_slots(&mut self, state: &VmState, now: u64) {
        let cfg = state.config();
        if !(cfg.metrics.ask_engine_slots && cfg.scheduling.slot_wait) || self.slot_paths.is_empty()
        {
            return;
        }
        let pool = state.router.pool();
        self.slot_paths.retain(|e, _| pool.binary_search(e).is_ok());
        self.slot_asks.retain(pool);
        let due: Vec<(Endpoint, &'static str)> = self
            .slot_paths
            .iter()
            .filter(|(e, _)| {
                self.slot_asks
                    .due(e, state.states.engine_slots(**e).is_some(), now)
            })
            .map(|(e, p)| (*e, *p))
            .collect();
        if due.is_empty() {
            return;
        }
        self.schedule.spend(due.len(), pool.len());
        for (endpoint, path) in due {
            self.slot_asks.asked(endpoint, now);
            self.get(
                cfg,
                endpoint,
                path,
                "application/json",
                Call::EngineSlots(endpoint),
            );
        }
    }

    fn on_engine_slots(&mut self, endpoint: Endpoint, answer: CallAnswer) {
        let Some(state) = self.state.clone() else {
            return;
        };
        let status = self.call_status(answer);
        let body = self.call_body(answer, engine_slots::MAX_BODY_BYTES);
        let mut state = state.borrow_mut();
        match engine_slots::read_total_slots(status, body.as_deref()) {
            Ok(n) => {
                state.stats.inc(Counter::EngineSlotsRead);
                state
                    .stats
                    .endpoint_gauge(endpoint, EndpointGauge::EngineSlots, u64::from(n));
                self.slot_counts.push((endpoint, n));
            }
            Err(e) => {
                state.stats.inc(Counter::EngineSlotsFailure);
                debug!(
                    "kvroute: no slot count from {endpoint}: {e:?}; asked again in {} s",
                    engine_slots::RETRY_MS / 1000
                );
            }
        }
    }

    /// Asks Envoy's admin API for the members of the upstream cluster
    /// (discovery on) and of the peers cluster (peers on).
    fn discover(&mut self, state: &VmState, now: u64) {
        let cfg = state.config();
        let (admin_cluster, interval) = match (&cfg.discovery, &cfg.peers) {
            (Some(d), Some(p)) => (&d.admin_cluster, d.interval_ms.min(p.members_interval_ms)),
            (Some(d), None) => (&d.admin_cluster, d.interval_ms),
            (None, Some(p)) => (&p.admin_cluster, p.members_interval_ms),
            (None, None) => return,
        };
        if now.saturating_sub(self.last_discovery_ms) < interval
            || self.pending.values().any(|c| *c == Call::Discovery)
        {
            return;
        }
        self.last_discovery_ms = now;
        let headers = vec![
            (":method", "GET"),
            (":path", "/clusters?format=json"),
            (":authority", "kvroute-admin"),
        ];
        let timeout = Duration::from_millis(interval.max(1000));
        match self.dispatch_http_call(admin_cluster, headers, None, vec![], timeout) {
            Ok(token) => {
                self.pending.insert(token, Call::Discovery);
            }
            Err(status) => warn!("kvroute: cannot reach admin cluster {admin_cluster}: {status:?}"),
        }
    }

    fn on_discovery(&mut self, answer: CallAnswer) {
        let Some(state) = self.state.clone() else {
            return;
        };
        if self.call_status(answer) != Some(200) {
            warn!("kvroute: discovery: admin API did not answer 200");
            return;
        }
        // Envoy's own admin API, trusted: as large as Envoy delivers.
        let body = self.call_body(answer, usize::MAX).unwrap_or_default();
        let mut state = state.borrow_mut();
        if let Some(peers) = state.config().peers.clone() {
            peer_sync::update_members(&state, &peers, &body);
        }
        if state.config().discovery.is_none() {
            return;
        }
        let cluster = state.config().upstream_cluster.clone();
        match cluster_members(&body, &cluster) {
            Ok(members) => {
                if members.as_slice() != state.router.pool() {
                    info!(
                        "kvroute: pool of {cluster} is now {} endpoints",
                        members.len()
                    );
                }
                state.store.set_pool(&members);
                state.router.set_pool(members);
            }
            Err(e) => warn!("kvroute: discovery: {e:?}"),
        }
    }

    /// Asks the peers for their news, every `peers.sync_interval_ms`.
    fn sync_peers(&mut self, state: &VmState, now: u64) {
        let Some(peers) = &state.config().peers else {
            return;
        };
        // Ticks jitter: half a tick early counts as on time (else a 50 ms
        // interval on a 50 ms tick would often sync every other tick).
        let half_tick = state.config().metrics.scrape_interval_ms / 2;
        if now.saturating_sub(self.last_sync_ms) + half_tick < peers.sync_interval_ms {
            return;
        }
        self.last_sync_ms = now;
        let pending = &self.pending;
        let calls = peer_sync::ask_all(state, peers, |m| {
            pending.values().any(|c| *c == Call::PeerSync(m))
        });
        for (token, member) in calls {
            self.pending.insert(token, Call::PeerSync(member));
        }
    }

    fn on_peer_answer(&mut self, member: Endpoint, answer: CallAnswer) {
        let Some(state) = self.state.clone() else {
            return;
        };
        let mut state = state.borrow_mut();
        let Some(max) = state.config().peers.as_ref().map(|p| p.max_response_bytes) else {
            return;
        };
        let status = self.call_status(answer);
        let refusals = status.and_then(|_| self.get_http_call_response_header(REFUSALS_HEADER));
        let body = self.call_body(answer, max);
        let answer = peer_sync::Answer {
            status,
            body,
            offers_refusals: refusals.as_deref() == Some("1"),
        };
        peer_sync::take_answer(&mut state, member, answer, now_ms(self));
    }

    fn on_scrape(&mut self, endpoint: Endpoint, answer: CallAnswer) {
        let own_at_dispatch = self.scraping.remove(&endpoint).unwrap_or(0);
        let Some(state) = self.state.clone() else {
            return;
        };
        let now = now_ms(self);
        let status = self.call_status(answer);
        let max = state.borrow().config().metrics.max_body_bytes;
        let body = self.call_body(answer, max);
        if status.is_some() && body.is_none() {
            let st = state.borrow();
            st.stats.inc(Counter::ScrapeTooLarge);
            if self.first_warning(endpoint, Warning::MetricsTooLarge, st.router.pool()) {
                warn!(
                    "kvroute: /metrics of {endpoint} answered {} bytes, over metrics.max_body_bytes ({max}): not read, so kvroute routes to it without its load figures (raise metrics.max_body_bytes if the engine's metrics are that large)",
                    answer.body_size
                );
            }
        }
        let outcome = classify(status, body.as_deref(), &state.borrow().config().metrics);
        if let ScrapeOutcome::Snapshot(r) = &outcome {
            match r.slots_path {
                Some(path) => self.slot_paths.insert(endpoint, path),
                None => self.slot_paths.remove(&endpoint),
            };
        }
        self.answers.push((endpoint, outcome, now, own_at_dispatch));
        if self.scraping.is_empty() && self.listing.is_empty() {
            self.publish_answers(&mut state.borrow_mut());
        }
    }

    /// Writes the scrape answers gathered so far into the shared scrape
    /// state, in one update.
    fn publish_answers(&mut self, state: &mut VmState) {
        if self.answers.is_empty() && self.listings.is_empty() && self.slot_counts.is_empty() {
            return;
        }
        let answers = std::mem::take(&mut self.answers);
        let listings = std::mem::take(&mut self.listings);
        let slot_counts = std::mem::take(&mut self.slot_counts);
        let pool = state.router.pool().to_vec();
        let threshold = state.config().metrics.unhealthy_after_failures;
        let flap_window = schedule::flap_window_ms(&state.config().metrics, pool.len());
        let lists = state.router.models().lists();
        // Endpoints answering again after leaving the candidate set.
        let mut back = Vec::new();
        // Endpoints whose prompt-token counter went down: an engine that
        // restarted, or one in front of several engines.
        let mut dropped = Vec::new();
        // kvroute's requests each scrape counted: the engine read its
        // figures between the scrape's dispatch and its answer, so the
        // most kvroute had there at either (now stands for the answer).
        let own_now = state.own_requests(answers.iter().map(|a| a.0));
        let states = state.store.update_endpoint_states(|t| {
            t.retain(&pool);
            back.clear();
            dropped.clear();
            for (&(endpoint, outcome, at, own_at_dispatch), &own_now) in
                answers.iter().zip(&own_now)
            {
                let was = t.healthy(endpoint, threshold);
                let read = matches!(outcome, ScrapeOutcome::Snapshot(..));
                match t.record(endpoint, outcome, at, flap_window) {
                    CounterNews::Quiet => {}
                    news => dropped.push((endpoint, news)),
                }
                if read {
                    t.counted_own(endpoint, own_at_dispatch.max(own_now));
                }
                // Maybe restarted with other models (or without the adapters
                // loaded at run time): it serves no listed model until its
                // list is read again, on the next tick.
                if lists && !was && t.healthy(endpoint, threshold) {
                    t.forget_served(endpoint);
                    back.push(endpoint);
                }
            }
            for &(endpoint, slots) in &slot_counts {
                if pool.binary_search(&endpoint).is_ok() {
                    t.engine_slots_read(endpoint, slots);
                }
            }
            for (endpoint, outcome, at) in &listings {
                // An endpoint that left the pool meanwhile is not added back.
                if let (ListingOutcome::Listed { ids, .. }, true) =
                    (outcome, pool.binary_search(endpoint).is_ok())
                {
                    t.listed(*endpoint, ServedModels::new(ids.clone(), *at));
                }
            }
        });
        for (endpoint, news) in dropped {
            if news == CounterNews::Restarted {
                state.stats.inc(Counter::EngineRestarts);
                // It may run with another slot count: asked again.
                self.slot_asks.forget(&endpoint);
                warn!("kvroute: the engine at {endpoint} restarted (its prompt-token counter went down); every worker forgets the prefixes it cached");
                continue;
            }
            state.stats.inc(Counter::EngineCounterFlaps);
            if self.first_warning(endpoint, Warning::CounterFlaps, &pool) {
                warn!("kvroute: the prompt-token counter of {endpoint} keeps going up and down: it is not one engine (a Service or load balancer in front of several?); its drops are not counted as restarts while they come within {} s of each other, and prefix affinity to it holds only as far as that balancer keeps prompts on one engine", flap_window / 1000);
            }
        }
        for (endpoint, outcome, _) in &listings {
            match outcome {
                ListingOutcome::Listed { truncated, .. } => {
                    state.stats.inc(Counter::ModelsListRead);
                    if *truncated {
                        state.stats.inc(Counter::ModelsListTruncated);
                    }
                }
                _ => {
                    state.stats.inc(Counter::ModelsListFailure);
                    debug!(
                        "kvroute: /v1/models of {endpoint}: {outcome:?}; its previous list is kept"
                    );
                }
            }
        }
        let failed = answers
            .iter()
            .filter(|(_, o, _, _)| !matches!(o, ScrapeOutcome::Snapshot(..)))
            .count();
        state
            .stats
            .add(Counter::ScrapeSuccess, (answers.len() - failed) as u64);
        state.stats.add(Counter::ScrapeFailure, failed as u64);
        for endpoint in back {
            self.list_schedule.relist(endpoint);
        }
        for &(endpoint, outcome, _, _) in &answers {
            let current = states.get(endpoint);
            if !matches!(outcome, ScrapeOutcome::Snapshot(..)) {
                state
                    .stats
                    .endpoint_inc(endpoint, EndpointCounter::ScrapeFailures);
                if current.failures == threshold {
                    warn!("kvroute: endpoint {endpoint} leaves the candidate set after {threshold} failed scrapes");
                }
            }
            state.stats.endpoint_gauge(
                endpoint,
                EndpointGauge::Healthy,
                current.healthy(threshold) as u64,
            );
            if let Some(s) = current.snapshot {
                state.stats.endpoint_gauge(
                    endpoint,
                    EndpointGauge::Waiting,
                    s.waiting.max(0.0) as u64,
                );
            }
        }
        state.states = states;
    }
}

impl Context for KvRouteRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let answer = CallAnswer {
            num_headers,
            body_size,
        };
        match self.pending.remove(&token_id) {
            Some(Call::Scrape(endpoint)) => self.on_scrape(endpoint, answer),
            Some(Call::ListModels(endpoint)) => self.on_list_models(endpoint, answer),
            Some(Call::EngineSlots(endpoint)) => self.on_engine_slots(endpoint, answer),
            Some(Call::Discovery) => self.on_discovery(answer),
            Some(Call::PeerSync(member)) => self.on_peer_answer(member, answer),
            None => {}
        }
    }
}

impl RootContext for KvRouteRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        let config = match Config::from_json(&bytes) {
            Ok(c) => c,
            Err(e) => {
                error!("{e}");
                return false;
            }
        };
        let interval = Duration::from_millis(config.metrics.scrape_interval_ms);
        info!(
            "kvroute: configured with {} endpoints, profile {:?}, scrape every {:?}",
            config.endpoints.len(),
            config.scheduling.profile,
            interval
        );
        let vm_id = new_vm_id(self);
        self.role = match self.get_property(vec!["plugin_root_id"]).as_deref() {
            Some(id) if id == PEER_ROOT_ID.as_bytes() => Role::PeerServer,
            _ => Role::Router,
        };
        if self.role == Role::PeerServer && config.peers.is_none() {
            error!(
                "kvroute: the {PEER_ROOT_ID} plugin needs a `peers` section in its configuration"
            );
            return false;
        }
        self.state = Some(Rc::new(RefCell::new(VmState::new(config, vm_id))));
        self.pending.clear();
        self.scraping.clear();
        self.answers.clear();
        self.schedule = ScrapeSchedule::default();
        self.listing.clear();
        self.listings.clear();
        self.list_schedule = ListingSchedule::default();
        self.slot_paths.clear();
        self.slot_asks = SlotAsks::default();
        self.slot_counts.clear();
        if self.role == Role::Router {
            self.set_tick_period(interval);
        }
        true
    }

    fn on_tick(&mut self) {
        let Some(state) = self.state.clone() else {
            return;
        };
        let now = now_ms(self);
        let mut state = state.borrow_mut();
        state.refresh(now);
        let interval = state.config().metrics.scrape_interval_ms;
        let ttl = (3 * interval).max(200);
        if state.store.claim_lease(state.vm_id, now, ttl) {
            // Answers still waiting for a slow scrape are published now.
            self.publish_answers(&mut state);
            self.discover(&state, now);
            self.scrape(&state, now);
            self.list_models(&state, now);
            self.ask_engine_slots(&state, now);
            self.sync_peers(&state, now);
            state.publish_inflight_gauges(now);
            // Once a scrape period (every tick for a pool within budget).
            let period = schedule::period_ms(&state.config().metrics, state.router.pool().len());
            if now.saturating_sub(self.last_ages_ms) + interval / 2 >= period {
                self.last_ages_ms = now;
                for (endpoint, s) in &state.states.entries.clone() {
                    let age = now.saturating_sub(s.scraped_at_ms);
                    state
                        .stats
                        .endpoint_gauge(*endpoint, EndpointGauge::SnapshotAgeMs, age);
                }
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let state = self.state.clone()?;
        match self.role {
            Role::Router => Some(Box::new(RequestFilter::new(state))),
            Role::PeerServer => Some(Box::new(PeerServer::new(state))),
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
