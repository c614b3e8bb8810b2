//! The root context: one per VM (each Envoy worker thread, the main thread,
//! and a short-lived canary). It validates the configuration, creates the
//! per-request contexts, and on every tick refreshes the shared view and, if
//! it holds the scraper lease, scrapes every endpoint's `/metrics`.

use crate::filter::RequestFilter;
use crate::stats::{Counter, EndpointCounter, EndpointGauge};
use crate::vm_state::VmState;
use kvroute_core::config::Config;
use kvroute_core::discovery::cluster_members;
use kvroute_core::endpoint::Endpoint;
use kvroute_core::metrics::scrape::{classify, ScrapeOutcome};
use log::{error, info, warn};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

/// An HTTP call this VM is waiting for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    /// `GET /metrics` of an endpoint.
    Scrape(Endpoint),
    /// `GET /clusters?format=json` of Envoy's admin API.
    Discovery,
}

/// Root context of one VM.
#[derive(Default)]
pub struct KvRouteRoot {
    state: Option<Rc<RefCell<VmState>>>,
    /// Calls in flight, by token.
    pending: HashMap<u32, Call>,
    /// When membership was last requested.
    last_discovery_ms: u64,
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

impl KvRouteRoot {
    fn scrape(&mut self, state: &VmState) {
        let cfg = state.config();
        let timeout = Duration::from_millis(cfg.metrics.scrape_timeout_ms);
        for &endpoint in state.router.pool() {
            if self.pending.values().any(|c| *c == Call::Scrape(endpoint)) {
                continue; // the previous scrape has not answered yet
            }
            let authority = endpoint.to_string();
            let headers = vec![
                (":method", "GET"),
                (":path", cfg.metrics.path.as_str()),
                (":authority", authority.as_str()),
                (cfg.destination_header.as_str(), authority.as_str()),
                ("accept", "text/plain"),
            ];
            match self.dispatch_http_call(&cfg.upstream_cluster, headers, None, vec![], timeout) {
                Ok(token) => {
                    self.pending.insert(token, Call::Scrape(endpoint));
                }
                Err(status) => {
                    warn!(
                        "kvroute: cannot dispatch scrape of {endpoint} via cluster {}: {status:?}",
                        cfg.upstream_cluster
                    );
                }
            }
        }
    }

    /// Asks Envoy's admin API for the upstream cluster's members.
    fn discover(&mut self, state: &VmState, now: u64) {
        let Some(d) = &state.config().discovery else {
            return;
        };
        if now.saturating_sub(self.last_discovery_ms) < d.interval_ms
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
        let timeout = Duration::from_millis(d.interval_ms.max(1000));
        match self.dispatch_http_call(&d.admin_cluster, headers, None, vec![], timeout) {
            Ok(token) => {
                self.pending.insert(token, Call::Discovery);
            }
            Err(status) => warn!(
                "kvroute: cannot reach admin cluster {}: {status:?}",
                d.admin_cluster
            ),
        }
    }

    fn on_discovery(&mut self, body_size: usize) {
        let Some(state) = self.state.clone() else {
            return;
        };
        if self.get_http_call_response_header(":status").as_deref() != Some("200") {
            warn!("kvroute: discovery: admin API did not answer 200");
            return;
        }
        let body = self
            .get_http_call_response_body(0, body_size)
            .unwrap_or_default();
        let mut state = state.borrow_mut();
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

    fn on_scrape(&mut self, endpoint: Endpoint, body_size: usize) {
        let Some(state) = self.state.clone() else {
            return;
        };
        let now = now_ms(self);
        let status = self
            .get_http_call_response_header(":status")
            .and_then(|s| s.parse::<u16>().ok());
        let body = self
            .get_http_call_response_body(0, body_size)
            .unwrap_or_default();
        let outcome = classify(status, &body, &state.borrow().config().metrics);
        let mut state = state.borrow_mut();
        let pool = state.router.pool().to_vec();
        let threshold = state.config().metrics.unhealthy_after_failures;
        let states = state.store.update_endpoint_states(|t| {
            t.retain(&pool);
            t.record(endpoint, outcome, now);
        });
        let current = states.get(endpoint);
        if matches!(outcome, ScrapeOutcome::Snapshot(_)) {
            state.stats.inc(Counter::ScrapeSuccess);
        } else {
            state.stats.inc(Counter::ScrapeFailure);
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
            state
                .stats
                .endpoint_gauge(endpoint, EndpointGauge::Waiting, s.waiting.max(0.0) as u64);
        }
        state.states = states;
    }
}

impl Context for KvRouteRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        match self.pending.remove(&token_id) {
            Some(Call::Scrape(endpoint)) => self.on_scrape(endpoint, body_size),
            Some(Call::Discovery) => self.on_discovery(body_size),
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
        self.state = Some(Rc::new(RefCell::new(VmState::new(config, vm_id))));
        self.pending.clear();
        self.set_tick_period(interval);
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
            self.discover(&state, now);
            self.scrape(&state);
            for (endpoint, s) in &state.states.entries.clone() {
                let age = now.saturating_sub(s.scraped_at_ms);
                state
                    .stats
                    .endpoint_gauge(*endpoint, EndpointGauge::SnapshotAgeMs, age);
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let state = self.state.clone()?;
        Some(Box::new(RequestFilter::new(state)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
