//! What one VM (one Envoy worker thread) knows, and the routing step.
//!
//! Each VM keeps its own [`Router`] (prefix index, pool, scheduler). The
//! shared view comes from [`SharedStore`]: other workers' decisions are
//! replayed from the decision log before each decision, so a request sees
//! what any worker routed before it; scrape states are refreshed on every
//! tick; in-flight counts are read and updated (CAS) on every request.

use crate::shared_store::{SharedStore, Snapshot};
use crate::stats::{Counter, EndpointCounter, EndpointGauge, Stats};
use kvroute_core::cache_trust::TrustChange;
use kvroute_core::config::{Config, Handoff};
use kvroute_core::endpoint::Endpoint;
use kvroute_core::inflight::{InFlight, InFlightTable};
use kvroute_core::models::Scope;
use kvroute_core::objectives::Objective;
use kvroute_core::outlier::{Outcome, OutlierTable};
use kvroute_core::peer::table::PeerLoad;
use kvroute_core::prefix::Prompt;
use kvroute_core::request::InferenceRequest;
use kvroute_core::router::Router;
use kvroute_core::scheduler::{CostCheck, Decision};
use kvroute_core::shared::decision_log::{LogCursor, LogEntry};
use kvroute_core::shared::deferred::{Deferred, Pending};
use kvroute_core::shared::endpoint_state::EndpointStates;
use kvroute_core::ttft::Prediction;
use log::{debug, info, warn};
use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

/// Endpoints listed after the choice for Envoy's retries (override_host).
const FALLBACKS: usize = 2;
// The fallbacks come from the scores a decision keeps.
const _: () = assert!(FALLBACKS < kvroute_core::scheduler::SCORES_KEPT);

/// Times a decision is made again when another VM changed the in-flight
/// table while it was made (`VmState::route`). Each costs a table read, a
/// replay of the decision log and a decision; past them the last decision
/// is counted on the table as it is (the count stays exact, the decision
/// missed a concurrent one).
const REDECISIONS: u64 = 4;

/// A decision written to the decision log while it is being counted
/// (`VmState::route`).
struct Logged {
    endpoint: Endpoint,
    /// Blocks of the prompt it already held (not retracted with it).
    held_blocks: usize,
    /// Its sequence number (`None`: the log did not take it).
    seq: Option<u64>,
}

/// The outcome of routing one request, kept by its HTTP context for the
/// request's life (a stream can last minutes). Its size does not grow with
/// the pool: the decision's per-candidate scores and predictions are
/// dropped once the fallbacks and the debug value are taken from them (at
/// 1024 endpoints they were ~40 KB, ~140 KB with `predicted_ttft`, per
/// request in flight, in a linear memory that never shrinks).
#[derive(Clone, Debug)]
pub struct Routed {
    /// The chosen endpoint.
    pub endpoint: Endpoint,
    /// Its predicted TTFT (when the TTFT model is in use: `predicted_ttft`
    /// or `keep_cheaper_holder`): what the model learns from when the first
    /// byte comes.
    pub prediction: Option<Prediction>,
    /// Uncached prompt tokens added to the endpoint's in-flight count.
    pub tokens: u64,
    /// Next-best endpoints for Envoy's retries (override_host handoff).
    pub fallbacks: Vec<Endpoint>,
    /// The debug header's value, when `debug_header` is set.
    pub debug: Option<String>,
    /// When it was routed (ms).
    pub at_ms: u64,
    /// Its decision-log entry (`None` when it taught the index nothing):
    /// read back when a fallback answers instead (`VmState::served_by`) or
    /// the endpoint refuses it (`VmState::refused`).
    pub log_seq: Option<u64>,
    /// Leading blocks of the prompt the endpoint already held by the
    /// index: what a refusal leaves it, and what a full answer shows its
    /// engine kept (`cache_trust`).
    pub held_blocks: usize,
    /// `shadow` mode, until the response names the endpoint Envoy's own
    /// balancer chose (`VmState::shadow_answered`): nothing of this
    /// request is learnt or in flight yet, and `endpoint` is kvroute's
    /// choice, not where the request went.
    pub shadow: Option<Box<ShadowPending>>,
}

/// What a `shadow` request keeps until its upstream is known: what routing
/// would have learnt and counted at once.
#[derive(Clone, Debug)]
pub struct ShadowPending {
    /// The decision-log hashes of the prompt (blocks, then its leaf).
    learned: Vec<u64>,
    /// How many of `learned` are full blocks.
    blocks: usize,
    /// The prompt's estimated tokens.
    prompt_tokens: u64,
}

impl Routed {
    /// The destination header value: the choice, then the fallbacks.
    pub fn header_value(&self) -> String {
        let mut v = self.endpoint.to_string();
        for e in &self.fallbacks {
            v.push(',');
            v.push_str(&e.to_string());
        }
        v
    }
}

/// The debug header's value: the decision, the scores it kept (the chosen
/// candidate's and the best others', at most `SCORES_KEPT`) and, with
/// `predicted_ttft`, each one's prediction and the prediction's parts.
fn debug_value(d: &Decision, total_blocks: usize) -> String {
    let mut v = format!(
        "endpoint={}; reason={:?}; matched={}/{}; scores=",
        d.endpoint, d.reason, d.matched_blocks, total_blocks
    );
    for (i, (e, s)) in d.scores.iter().enumerate() {
        let _ = write!(v, "{}{}={:.3}", if i > 0 { "," } else { "" }, e, s);
    }
    if let (Some(o), Some(p)) = (d.overruled, d.prediction) {
        let check = match o.check {
            CostCheck::KeptHolder => "kept_by_cost",
            CostCheck::LeftHolder => "moved_by_cost",
            CostCheck::LeftSlowerDecoder => "moved_by_decode",
            CostCheck::LeftTakenSlots => "moved_by_slots",
        };
        let _ = write!(
            v,
            "; {check}={}={:.0}ms over {}={:.0}ms",
            d.endpoint, p.cost_ms, o.endpoint, o.cost_ms
        );
    }
    if !d.predictions.is_empty() {
        v.push_str("; ttft=");
        for (i, ((e, _), p)) in d.scores.iter().zip(&d.predictions).enumerate() {
            let _ = write!(
                v,
                "{}{}={:.0}ms(overhead {:.0} + decode {:.0} + (ahead {:.0} + uncached {:.0}) x {:.4} ms/tok + slot wait {:.0}; delays {:.0} others {:.0}; streams {:.0} slower; charged {:.0})",
                if i > 0 { "," } else { "" },
                e,
                p.ttft_ms,
                p.overhead_ms,
                p.decode_ms,
                p.ahead_tokens,
                p.uncached_tokens,
                p.ms_per_token,
                p.slot_wait_ms,
                p.present,
                p.others_delay_ms,
                p.slow_decode_ms,
                p.move_charge_ms
            );
        }
    }
    v
}

/// Per-VM state shared by the root context and every HTTP context of the VM.
pub struct VmState {
    /// Pool, prefix index and scheduler.
    pub router: Router,
    /// Shared-data access.
    pub store: SharedStore,
    /// Stat ids.
    pub stats: Stats,
    /// This VM's id (scraper lease owner).
    pub vm_id: u64,
    /// Scrape states as of the last tick.
    pub states: EndpointStates,
    /// Passive-health state as of the last tick (or this VM's last write).
    pub outliers: OutlierTable,
    rng: fastrand::Rng,
    cursor: LogCursor,
    own_seqs: HashSet<u64>,
    /// Endpoints this VM last found stalled (to count each stall once).
    stalled: Vec<Endpoint>,
    /// What the other gateway replicas have in flight (as of the last tick).
    peer_load: PeerLoad,
    /// This VM has routed a request: only then does its tick replay the
    /// decision log (Envoy's main-thread VM never routes one, and replaying
    /// every worker's decisions there was pure cost).
    routes: bool,
    /// Index records put off until a decision needs them.
    deferred: Deferred,
    /// In-flight gauges as last written (see `publish_inflight_gauges`).
    inflight_gauges: HashMap<Endpoint, u64>,
    /// When this VM last wrote them.
    gauges_at_ms: u64,
}

/// kvroute's outstanding work on an endpoint as a decision counts it: this
/// gateway's (every worker's, `inflight`) and its peers': other replicas'
/// requests load the pods as much as this one's. Both are looked up in
/// order: for a walk in pool order, each lookup resumes where the last one
/// stopped.
fn with_peers<'a>(
    inflight: &'a InFlightTable,
    peers: &'a PeerLoad,
) -> impl Fn(&Endpoint) -> InFlight + 'a {
    let (inflight, peer_load) = (inflight.lookup(), peers.lookup());
    move |e| {
        let mut f = inflight(e);
        let (requests, tokens) = peer_load(e);
        f.requests = f.requests.saturating_add(requests);
        f.tokens = f.tokens.saturating_add(tokens);
        f
    }
}

impl VmState {
    /// kvroute's requests on each of `endpoints` now, as a decision counts
    /// them ([`with_peers`]): what a scrape of the endpoint is compared
    /// with (`EndpointStates::counted_own`).
    pub fn own_requests(&self, endpoints: impl Iterator<Item = Endpoint>) -> Vec<u32> {
        let table = self.store.inflight();
        let load = with_peers(&table, &self.peer_load);
        endpoints.map(|e| load(&e).requests).collect()
    }

    /// State for a validated config.
    pub fn new(config: Config, vm_id: u64) -> VmState {
        let store = SharedStore::new(&config.shared.key_prefix, config.shared.log_slots);
        store.create_keys();
        let cursor = store.cursor();
        let seed = config.scheduling.seed.unwrap_or(vm_id);
        let mut stats = Stats::define(config.per_endpoint_stats);
        if let Some(o) = &config.objectives {
            stats.define_objectives(o.names());
        }
        VmState {
            router: Router::new(config),
            store,
            stats,
            vm_id,
            states: EndpointStates::default(),
            outliers: OutlierTable::default(),
            rng: fastrand::Rng::with_seed(seed),
            cursor,
            own_seqs: HashSet::new(),
            stalled: Vec::new(),
            peer_load: PeerLoad::default(),
            routes: false,
            inflight_gauges: HashMap::new(),
            gauges_at_ms: 0,
            deferred: Deferred::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        self.router.config()
    }

    /// Replays other workers' decisions into the local router; returns
    /// the log head as read (an append right after uses it).
    pub fn replay_log(&mut self) -> Option<Snapshot<u64>> {
        let own = &self.own_seqs;
        let read = self
            .store
            .read_log(&mut self.cursor, |seq| own.contains(&seq));
        for _ in 0..read.lost {
            self.stats.inc(Counter::LogLost);
        }
        for entry in read.entries {
            if entry.forget {
                self.unlearn(entry.endpoint, &entry.blocks);
            } else {
                self.learn(entry.endpoint, entry.blocks, entry.at_ms);
            }
        }
        // Own entries the ring lost are never seen again: keep the set bounded.
        let next = self.cursor.next;
        self.own_seqs.retain(|s| *s >= next);
        read.head
    }

    /// Teaches the router a decision: when it was made at once (the cold
    /// rotation reads it), its prefix-index record now or, when it can
    /// wait, before the first decision that could match it
    /// (`kvroute_core::shared::deferred`).
    fn learn(&mut self, endpoint: Endpoint, hashes: Vec<u64>, at_ms: u64) {
        if !Deferred::can_wait(&hashes) {
            self.router.learn(endpoint, &hashes, at_ms);
            return;
        }
        self.router.learn(endpoint, &[] as &[u64], at_ms);
        self.deferred.push(Pending {
            endpoint,
            hashes,
            at_ms,
        });
        if self.deferred.full() {
            self.apply_deferred(None);
        }
    }

    /// Unlearns `hashes` for `endpoint` (a refused request's). Put-off
    /// records are made first: the one being undone may be among them, and
    /// must not come back after.
    fn unlearn(&mut self, endpoint: Endpoint, hashes: &[u64]) {
        self.apply_deferred(None);
        self.router.forget(endpoint, hashes);
    }

    /// Records the put-off decisions a prompt starting with `first` could
    /// match (all of them for `None`).
    fn apply_deferred(&mut self, first: Option<u64>) {
        if self.deferred.is_empty() {
            return;
        }
        for p in self.deferred.take(first) {
            self.router.learn(p.endpoint, &p.hashes, p.at_ms);
        }
    }

    /// Tick at `now_ms`: refresh the pool (discovery), scrape states and the
    /// replicated prefix index; count endpoints that became stalled.
    pub fn refresh(&mut self, now_ms: u64) {
        if self.config().discovery.is_some() {
            if let Some(pool) = self.store.pool() {
                self.router.set_pool(pool);
            }
        }
        self.states = self.store.endpoint_states();
        self.outliers = self.store.outliers();
        // This gateway's requests (every worker's): those still awaiting a
        // first byte tell a queue behind prefills from one out of slots
        // (`scheduling.slot_wait`), and stall detection reads them below.
        // One read of the shared table for both, none if neither is on.
        let stalls = self.config().failover.stall_after_ms > 0;
        let inflight = if self.config().scheduling.slot_wait || stalls {
            self.store.inflight()
        } else {
            InFlightTable::default()
        };
        for endpoint in self.router.observe(&self.states, inflight.lookup()) {
            debug!("kvroute: the engine at {endpoint} restarted: its prefixes are forgotten");
        }
        for (endpoint, change) in self.router.check_engine_caches(&self.states, now_ms) {
            self.note_cache_trust(endpoint, change);
        }
        if self.routes {
            self.replay_log();
            self.apply_deferred(None);
        } else {
            // Nothing to learn for: keep only the cursor within the ring, so
            // a first request replays at most one ring, as on start-up.
            self.cursor.next = self.cursor.next.max(self.store.cursor().next);
        }
        if let Some(stale_after) = self.config().peers.as_ref().map(|p| p.stale_after_ms) {
            let table = self.store.peer_table();
            self.peer_load = table.load(now_ms, stale_after);
            self.stats
                .peer_replicas(table.live(now_ms, stale_after).count() as u64);
        }
        // Stalls are counted and logged here, once a tick; each decision
        // checks them itself.
        if stalls {
            let stalled = self.router.stalled(&self.states, inflight.lookup(), now_ms);
            self.note_stalls(stalled);
        }
    }

    /// Whether a request of `objective` and `scope` is shed (as of the
    /// last tick's scrape states): see `Router::shed`.
    pub fn shed(&self, objective: Objective, scope: Scope, now_ms: u64) -> bool {
        self.router
            .shed(objective, scope, &self.states, &self.outliers, now_ms)
    }

    /// Routes one request (`None` when its body was not understood or it is
    /// not an inference request) among the endpoints of `scope` (its
    /// model's): decide, learn, publish, count.
    pub fn route(
        &mut self,
        request: Option<&InferenceRequest>,
        scope: Scope,
        now_ms: u64,
    ) -> Option<Routed> {
        self.routes = true;
        let (prompt, prompt_tokens) = match request {
            Some(r) => (r.prompt(), r.prompt_tokens(&self.config().prefix)),
            None => (Prompt::default(), 0),
        };
        let blocks = prompt.blocks;
        // Decided on the in-flight table it is counted in: the table is
        // read with its CAS token and the request is added to it only if
        // no other VM changed it since. When one did (another worker
        // routed in the same microseconds, or counted a response), this
        // decision had not seen that change; two workers deciding on the
        // same table send a burst of new requests to the same least-loaded
        // endpoint. The decision is then made again on the table as it is
        // now, at most `REDECISIONS` times, then counted as it stands.
        //
        // What a decision teaches is written to the decision log before
        // the decision is counted in the table, and the log is read after
        // the table: a pick this decision sees counted, it also sees the
        // blocks of. (Written after, a worker deciding in between saw a
        // pod loaded with a prompt it did not know it held, took its copy
        // of the prompt for a new one and placed it elsewhere: `tests/
        // routing.rs`, copies of a new prompt routed at once.)
        let shadow_mode = self.config().shadow;
        // Other workers only need decisions that teach the prefix index
        // (in-flight counts, which spread everything else, are shared anyway).
        let mut learned = request.map(InferenceRequest::learned).unwrap_or_default();
        let logs = !shadow_mode && !learned.is_empty();
        let mut snapshot = self.store.inflight_snapshot();
        let mut head = self.read_log_for(blocks.first().copied());
        let mut logged: Option<Logged> = None;
        let mut redecided = 0;
        let decision = loop {
            let decision = self.router.decide_in(
                scope,
                prompt,
                prompt_tokens,
                &self.states,
                &self.outliers,
                with_peers(&snapshot.value, &self.peer_load),
                now_ms,
                &mut self.rng,
            )?;
            if shadow_mode {
                break decision;
            }
            if logs {
                self.log_decision(&mut logged, &decision, &mut learned, head, now_ms);
            }
            let (endpoint, tokens) = (
                decision.endpoint,
                self.router.uncached_tokens(&decision, prompt_tokens),
            );
            let add = move |t: &mut InFlightTable| t.add(endpoint, tokens, now_ms);
            match self.store.commit_inflight(snapshot, add) {
                Ok(()) => break decision,
                Err(now) if redecided < REDECISIONS => {
                    snapshot = now;
                    head = self.read_log_for(blocks.first().copied());
                    redecided += 1;
                }
                Err(_) => {
                    self.store.update_inflight(add);
                    break decision;
                }
            }
        };
        if redecided > 0 {
            self.stats.add(Counter::DecisionRedecided, redecided);
        }
        let endpoint = decision.endpoint;
        let tokens = self.router.uncached_tokens(&decision, prompt_tokens);
        if request.is_some() {
            self.router.routed(tokens);
        }
        let mut log_seq = None;
        let mut shadow = None;
        if shadow_mode {
            // Envoy's balancer chooses: learnt and counted where it sent
            // the request, once the response says.
            shadow = Some(Box::new(ShadowPending {
                learned,
                blocks: blocks.len(),
                prompt_tokens,
            }));
        } else if let Some(logged) = logged {
            log_seq = logged.seq;
            // The same record every other worker makes of this decision.
            if Deferred::can_wait(&learned) {
                self.learn(endpoint, learned, now_ms);
            } else {
                self.router.learn(endpoint, prompt, now_ms);
            }
        } else {
            self.router.learn(endpoint, prompt, now_ms);
        }
        if shadow.is_none() {
            self.stats.endpoint_inc(endpoint, EndpointCounter::Routed);
        }
        self.stats.inc(Counter::Routed);
        self.stats.decision(decision.reason);
        match decision.overruled.map(|o| o.check) {
            Some(CostCheck::KeptHolder) => self.stats.inc(Counter::DecisionKeptByCost),
            Some(CostCheck::LeftHolder) => self.stats.inc(Counter::DecisionMovedByCost),
            Some(CostCheck::LeftSlowerDecoder) => self.stats.inc(Counter::DecisionMovedByDecode),
            Some(CostCheck::LeftTakenSlots) => self.stats.inc(Counter::DecisionMovedBySlots),
            None => {}
        }
        if !blocks.is_empty() {
            self.stats
                .matched_prefix((decision.matched_blocks * 100 / blocks.len()) as u64);
        }
        let fallbacks = match self.config().handoff {
            Handoff::OverrideHost if shadow.is_none() => Router::fallbacks(&decision, FALLBACKS),
            _ => Vec::new(),
        };
        let debug = self
            .config()
            .debug_header
            .is_some()
            .then(|| debug_value(&decision, blocks.len()));
        Some(Routed {
            endpoint,
            prediction: decision.prediction,
            tokens,
            fallbacks,
            debug,
            at_ms: now_ms,
            log_seq,
            held_blocks: decision.held_blocks,
            shadow,
        })
    }

    /// `shadow` mode: Envoy's balancer sent `routed` to `upstream`, which
    /// answered (`ok`: with a 2xx). Counts how kvroute's choice compares
    /// (the same endpoint or not; the prompt tokens the index believed
    /// cached at each), then does at `upstream` what routing does at once
    /// otherwise: the request is in flight there from now on, and a 2xx
    /// teaches the prefix index (here and, through the decision log, on
    /// every worker and replica). `routed` then stands for `upstream`; its
    /// TTFT prediction, made for kvroute's choice, is dropped when the two
    /// differ. `false` (nothing learnt or counted in flight) for an
    /// upstream outside the pool.
    pub fn shadow_answered(
        &mut self,
        routed: &mut Routed,
        upstream: Endpoint,
        ok: bool,
        now_ms: u64,
    ) -> bool {
        let Some(pending) = routed.shadow.take() else {
            return true;
        };
        if !self.router.contains(upstream) {
            return false;
        }
        let block_tokens = self.config().prefix.block_tokens as u64;
        let full_blocks = pending.learned.get(..pending.blocks).unwrap_or_default();
        let held = self.router.held_blocks(upstream, full_blocks);
        let same = upstream == routed.endpoint;
        self.stats.inc(if same {
            Counter::ShadowSameEndpoint
        } else {
            Counter::ShadowOtherEndpoint
        });
        self.stats.add(
            Counter::ShadowCachedTokensKvroute,
            (routed.held_blocks as u64 * block_tokens).min(pending.prompt_tokens),
        );
        self.stats.add(
            Counter::ShadowCachedTokensBalancer,
            (held as u64 * block_tokens).min(pending.prompt_tokens),
        );
        if !same {
            routed.endpoint = upstream;
            routed.held_blocks = held;
            routed.prediction = None;
            routed.tokens = pending
                .prompt_tokens
                .saturating_sub(held as u64 * block_tokens);
        }
        let tokens = routed.tokens;
        self.store
            .update_inflight(|t| t.add(upstream, tokens, now_ms));
        self.stats.endpoint_inc(upstream, EndpointCounter::Routed);
        if !ok {
            return true;
        }
        if pending.learned.is_empty() {
            self.router.learn(upstream, &[][..], now_ms);
        } else {
            routed.log_seq = self.publish(upstream, pending.learned, now_ms);
        }
        true
    }

    /// A request answered at `endpoint` taught the prefix index `hashes`
    /// (a decision-log entry's: blocks, then the leaf): appended to the
    /// decision log (every other worker, and with peers every replica,
    /// replays it) and recorded here. Its log sequence number.
    fn publish(&mut self, endpoint: Endpoint, hashes: Vec<u64>, now_ms: u64) -> Option<u64> {
        let mut entry = LogEntry::own(endpoint, now_ms, hashes);
        let seq = self.append_own(&mut entry, None);
        self.learn(endpoint, entry.blocks, now_ms);
        seq
    }

    /// Counts and logs a change of what this worker believes `endpoint`'s
    /// engine keeps (`cache_trust`).
    fn note_cache_trust(&mut self, endpoint: Endpoint, change: TrustChange) {
        let distrusted = matches!(change, TrustChange::Distrusted { .. });
        self.stats.endpoint_gauge(
            endpoint,
            EndpointGauge::CacheDistrusted,
            u64::from(distrusted),
        );
        match change {
            TrustChange::Distrusted { believed, hits } => {
                self.stats.inc(Counter::EngineCacheDistrusted);
                warn!(
                    "kvroute: the engine at {endpoint} reported {hits:.0} prompt tokens served from its prefix cache while this worker's requests to it expected about {believed:.0}: it keeps (almost) none of the prompts sent to it (prefix caching off, or a cache too small for them); its prefixes are not used for routing until it keeps them again (prefix.verify_engine_cache)"
                );
            }
            TrustChange::Trusted => {
                info!("kvroute: the engine at {endpoint} is trusted to keep prompts again: its prefixes count for routing");
            }
        }
    }

    /// Counts (and logs) endpoints that became stalled since the last look.
    fn note_stalls(&mut self, stalled: Vec<Endpoint>) {
        for &e in &stalled {
            if !self.stalled.contains(&e) {
                self.stats.inc(Counter::Stalled);
                self.stats.endpoint_inc(e, EndpointCounter::Stalls);
                warn!(
                    "kvroute: endpoint {e} stalled (requests without a first byte and a silent /metrics for {} ms): avoided",
                    self.config().failover.stall_after_ms
                );
            }
        }
        self.stalled = stalled;
    }

    /// The endpoint has started answering `routed` at `now_ms`: its prefill
    /// is done. When the chunk is a first token (`first_token`: a stream
    /// answered 2xx) and the request has a TTFT prediction, it teaches the
    /// model (a non-streaming answer's first chunk comes with its last
    /// token, and an error answer with no prefill: neither teaches).
    pub fn first_chunk(
        &mut self,
        routed: &Routed,
        objective: Objective,
        first_token: bool,
        now_ms: u64,
    ) {
        let (endpoint, tokens) = (routed.endpoint, routed.tokens);
        self.store
            .update_inflight(|t| t.first_chunk(endpoint, tokens, now_ms));
        self.learn_first_byte(routed, objective, first_token, now_ms);
    }

    /// A response whose first chunk was also its last (a non-streaming
    /// answer, or an error body) has ended: the first chunk's and the
    /// end's in-flight updates in one write instead of two (`on_log`
    /// follows the last chunk at once, so nothing is left waiting longer).
    pub fn answered_and_finished(
        &mut self,
        routed: &Routed,
        objective: Objective,
        first_token: bool,
        answered_ms: u64,
    ) {
        let (endpoint, tokens) = (routed.endpoint, routed.tokens);
        self.store.update_inflight(|t| {
            t.first_chunk(endpoint, tokens, answered_ms);
            t.finish(endpoint, None);
        });
        self.learn_first_byte(routed, objective, first_token, answered_ms);
    }

    /// The chosen endpoint answered `routed` in full with a 2xx: evidence
    /// of what its engine keeps (`cache_trust`; an engine may count its
    /// cache hits only when a request finishes, as SGLang does) and, for an
    /// answer streamed in several chunks (`times`: when its first chunk
    /// came, when it ended, ms), of how long a request holds an engine's
    /// slot (`scheduling.slot_wait`).
    pub fn completed(&mut self, routed: &Routed, times: Option<(u64, u64)>) {
        self.router
            .completed_with_prefix(routed.endpoint, routed.held_blocks, routed.at_ms);
        if let Some((first_ms, end_ms)) = times {
            self.router.streamed_in_full(
                routed.prediction.as_ref(),
                first_ms.saturating_sub(routed.at_ms),
                end_ms.saturating_sub(first_ms),
            );
        }
    }

    /// `endpoint` streamed `bytes` of a 2xx answer after its first chunk in
    /// `ms`: teaches the decode-speed model.
    pub fn streamed(&mut self, endpoint: Endpoint, bytes: u64, ms: u64) {
        self.router.streamed(endpoint, bytes, ms);
    }

    /// A stream's first chunk is its time to first token: recorded
    /// (`kvroute.ttft_ms`, under the request's `objective`, and against its
    /// prediction), and it teaches the TTFT model (see `first_chunk`).
    fn learn_first_byte(
        &mut self,
        routed: &Routed,
        objective: Objective,
        first_token: bool,
        now_ms: u64,
    ) {
        if !first_token {
            return;
        }
        let ttft_ms = now_ms.saturating_sub(routed.at_ms);
        let prediction = routed.prediction;
        self.stats
            .first_token(ttft_ms, objective.index, prediction.map(|p| p.ttft_ms));
        if let Some(p) = &prediction {
            self.router.first_byte(routed.endpoint, p, ttft_ms);
        }
    }

    /// `served_by`, a fallback of the destination header, answered `routed`
    /// (2xx) at `now_ms` after the chosen endpoint did not: the prompt is
    /// cached there now. Its decision is read back from the log and
    /// appended again for the fallback, so every worker (and, with peers,
    /// every replica) records it and the conversation's next turn follows
    /// the cache instead of being placed cold. Nothing is learnt when the
    /// entry left the ring meanwhile (a first-byte timeout on a busy
    /// gateway), nor for an endpoint outside the pool.
    pub fn served_by(&mut self, routed: &Routed, served_by: Endpoint, now_ms: u64) {
        self.stats.inc(Counter::FallbackAnswered);
        if !self.router.contains(served_by) {
            return;
        }
        let Some(entry) = self.own_entry(routed) else {
            return;
        };
        self.publish(served_by, entry.blocks, now_ms);
    }

    /// `routed`'s decision-log entry read back, if the ring still holds it.
    fn own_entry(&self, routed: &Routed) -> Option<LogEntry> {
        let entry = self.store.read_entry(routed.log_seq?)?;
        // Not this request's entry otherwise.
        (entry.endpoint == routed.endpoint && !entry.from_peer && !entry.forget).then_some(entry)
    }

    /// Appends this VM's own entry (after `head`, the log head as last
    /// read, if any): other workers replay it, this one skips it.
    fn append_own(&mut self, entry: &mut LogEntry, head: Option<Snapshot<u64>>) -> Option<u64> {
        let seq = self.store.append_log(entry, head)?;
        self.own_seqs.insert(seq);
        Some(seq)
    }

    /// Replays the decision log (`replay_log`), then makes the put-off
    /// records a prompt starting with `first` could match: a prompt without
    /// a first block matches only leaves, never put off.
    fn read_log_for(&mut self, first: Option<u64>) -> Option<Snapshot<u64>> {
        let head = self.replay_log();
        if first.is_some() {
            self.apply_deferred(first);
        }
        head
    }

    /// Writes `decision` to the decision log (after `head`) unless `logged`
    /// already holds it; `learned` (the prompt's hashes, `InferenceRequest::
    /// learned`) is lent to the entry, not copied. A decision made again on
    /// another endpoint first retracts the one written before (a `forget`
    /// entry for the blocks that endpoint did not already hold), so no
    /// worker keeps believing that endpoint was sent the prompt.
    fn log_decision(
        &mut self,
        logged: &mut Option<Logged>,
        decision: &Decision,
        learned: &mut Vec<u64>,
        head: Option<Snapshot<u64>>,
        now_ms: u64,
    ) {
        if let Some(before) = logged.as_ref() {
            if before.endpoint == decision.endpoint {
                return;
            }
            let held = before.held_blocks.min(learned.len());
            let mut retract = LogEntry::own(before.endpoint, now_ms, learned[held..].to_vec());
            retract.forget = true;
            if !retract.blocks.is_empty() {
                self.append_own(&mut retract, None);
            }
            // Every other worker that replays the entry retracted takes it
            // as a pick of that endpoint now (its cold rotation reads it),
            // and no retraction undoes that: this worker's rotation must
            // read the same, or the next copies of a new prompt routed at
            // once by this worker and another part ways.
            self.router.learn(before.endpoint, &[] as &[u64], now_ms);
        }
        let mut entry = LogEntry::own(decision.endpoint, now_ms, std::mem::take(learned));
        let seq = self.append_own(&mut entry, head);
        *learned = entry.blocks;
        *logged = Some(Logged {
            endpoint: decision.endpoint,
            held_blocks: decision.held_blocks,
            seq,
        });
    }

    /// The chosen endpoint did not answer `routed` with a 2xx: it refused it
    /// (e.g. 400, longer than its context; 429 or 503, overloaded), failed,
    /// or never got it. Either way it did not cache the prompt, so what the
    /// decision taught the index is unlearnt: the hashes beyond the blocks
    /// it already held (its leaf included), here and, through a `forget`
    /// entry in the decision log, on every worker. A client's retry is then
    /// placed like a new prompt instead of going back by prefix. Nothing is
    /// unlearnt when the entry left the ring meanwhile.
    pub fn refused(&mut self, routed: &Routed, now_ms: u64) {
        let Some(mut entry) = self.own_entry(routed) else {
            return;
        };
        entry
            .blocks
            .drain(..routed.held_blocks.min(entry.blocks.len()));
        if entry.blocks.is_empty() {
            return;
        }
        entry.forget = true;
        entry.at_ms = now_ms;
        self.append_own(&mut entry, None);
        self.unlearn(entry.endpoint, &entry.blocks);
        self.stats.inc(Counter::PrefixForgotten);
    }

    /// Envoy got no response byte from the chosen endpoint (connect failure,
    /// reset or timeout before the response; or a retry on a fallback
    /// answered): with `failover.eject_unanswered` it leaves the candidate
    /// set for every worker until one of its scrapes answers.
    pub fn not_answered(&mut self, endpoint: Endpoint) {
        self.stats.inc(Counter::Unanswered);
        self.stats
            .endpoint_inc(endpoint, EndpointCounter::Unanswered);
        if !self.config().failover.eject_unanswered {
            return;
        }
        if self.set_aside(endpoint) {
            warn!("kvroute: endpoint {endpoint} did not answer a request: out of the candidate set until a scrape answers");
        }
    }

    /// The endpoint refused a request with a `failover.retry_statuses`
    /// status (an engine refusing work while overloaded): it leaves the
    /// candidate set for every worker until one of its scrapes answers. Its
    /// refusals finish at once, so to the load scores it looks idle; without
    /// this it kept drawing its share of the traffic and refusing it
    /// (`original_dst` cannot retry elsewhere).
    pub fn refused_work(&mut self, endpoint: Endpoint) {
        self.stats.inc(Counter::Refused);
        if self.set_aside(endpoint) {
            // Every scrape period while it refuses: not a warning each time.
            debug!("kvroute: endpoint {endpoint} refused a request: out of the candidate set until a scrape answers");
        }
    }

    /// Takes `endpoint` out of the candidate set (every worker) until one
    /// of its scrapes answers; true if it was in.
    fn set_aside(&mut self, endpoint: Endpoint) -> bool {
        let pool = self.router.pool().to_vec();
        let threshold = self.config().metrics.unhealthy_after_failures;
        let mut changed = false;
        self.states = self.store.update_endpoint_states(|t| {
            t.retain(&pool);
            changed = t.unreachable(endpoint, threshold);
        });
        if changed {
            self.stats
                .endpoint_gauge(endpoint, EndpointGauge::Healthy, 0);
        }
        changed
    }

    /// The endpoint answered with HTTP `status` (or Envoy answered for it,
    /// e.g. 503 when it could not connect): feeds passive health. Only a
    /// 5xx, or the first success after one, writes shared data (nothing
    /// does when passive health is off).
    pub fn observe_response(
        &mut self,
        endpoint: Endpoint,
        status: u16,
        now_ms: impl FnOnce() -> u64,
    ) {
        let outcome = Outcome::from_status(status);
        let config = &self.router.config().outlier_detection;
        if !self.outliers.changes(endpoint, outcome, config) {
            return;
        }
        let now_ms = now_ms();
        let config = config.clone();
        let pool = self.router.pool().to_vec();
        let mut ejected_until = None;
        self.outliers = self.store.update_outliers(|t| {
            t.retain(&pool);
            ejected_until = t.record(endpoint, outcome, now_ms, pool.len(), &config);
        });
        if let Some(until) = ejected_until {
            self.stats.inc(Counter::OutlierEjected);
            self.stats
                .endpoint_inc(endpoint, EndpointCounter::Ejections);
            warn!(
                "kvroute: endpoint {endpoint} ejected for {} ms after {} consecutive 5xx",
                until - now_ms,
                config.consecutive_errors
            );
        }
    }

    /// The request is over (completed, failed or reset); `unanswered` holds
    /// its uncached prompt tokens when the endpoint never sent it a chunk.
    pub fn finish(&mut self, endpoint: Endpoint, unanswered: Option<u64>) {
        self.store
            .update_inflight(|t| t.finish(endpoint, unanswered));
    }

    /// Writes the per-endpoint in-flight gauges from the shared table (all
    /// workers), once a tick by the lease holder and only those that
    /// changed: not two stat writes on every request.
    pub fn publish_inflight_gauges(&mut self, now_ms: u64) {
        // Another VM may have written them while this one did not hold the
        // lease: forget what was written then.
        let tick = self.config().metrics.scrape_interval_ms;
        if now_ms.saturating_sub(self.gauges_at_ms) > 2 * tick {
            self.inflight_gauges.clear();
        }
        self.gauges_at_ms = now_ms;
        let table = self.store.inflight();
        let pool = self.router.pool().to_vec();
        for e in pool {
            let n = u64::from(table.get(&e).requests);
            if self.inflight_gauges.get(&e) != Some(&n) {
                self.inflight_gauges.insert(e, n);
                self.stats
                    .endpoint_gauge(e, EndpointGauge::InflightRequests, n);
            }
        }
        // The pool is sorted: a binary search, not a scan per entry.
        let pool = self.router.pool();
        self.inflight_gauges
            .retain(|e, _| pool.binary_search(e).is_ok());
    }
}
