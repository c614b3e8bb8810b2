//! The root context: one per VM (each Envoy worker thread, the main thread,
//! and a short-lived canary). It validates the configuration, creates the
//! per-request contexts, and on every tick refreshes the shared view and, if
//! it holds the scraper lease, scrapes every endpoint's `/metrics`.

use crate::filter::RequestFilter;
use crate::stats::{Counter, EndpointCounter, EndpointGauge};
use crate::vm_state::VmState;
use kvroute_core::config::Config;
use kvroute_core::endpoint::Endpoint;
use kvroute_core::metrics::read_snapshot;
use log::{error, info, warn};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

/// Root context of one VM.
#[derive(Default)]
pub struct KvRouteRoot {
    state: Option<Rc<RefCell<VmState>>>,
    /// Scrapes in flight: call token -> endpoint.
    pending: HashMap<u32, Endpoint>,
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
            if self.pending.values().any(|e| *e == endpoint) {
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
                    self.pending.insert(token, endpoint);
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
}

impl Context for KvRouteRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some(endpoint) = self.pending.remove(&token_id) else {
            return;
        };
        let Some(state) = self.state.clone() else {
            return;
        };
        let now = now_ms(self);
        let ok = self.get_http_call_response_header(":status").as_deref() == Some("200");
        let snapshot = if ok {
            let body = self
                .get_http_call_response_body(0, body_size)
                .unwrap_or_default();
            let text = String::from_utf8_lossy(&body);
            read_snapshot(&text, &state.borrow().config().metrics).ok()
        } else {
            None
        };
        let mut state = state.borrow_mut();
        let pool = state.router.pool().to_vec();
        let threshold = state.config().metrics.unhealthy_after_failures;
        let states = state.store.update_endpoint_states(|t| {
            t.retain(&pool);
            match snapshot {
                Some(s) => t.succeed(endpoint, s, now),
                None => {
                    t.fail(endpoint);
                }
            }
        });
        let current = states.get(endpoint);
        if snapshot.is_some() {
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
        state.refresh();
        let interval = state.config().metrics.scrape_interval_ms;
        let ttl = (3 * interval).max(200);
        if state.store.claim_lease(state.vm_id, now, ttl) {
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
