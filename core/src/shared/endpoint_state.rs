//! What the scraper learned about every endpoint, as one shared-data value
//! all workers read on their tick: the latest snapshot, when it was taken,
//! and how many scrapes in a row have failed (the health signal); and,
//! when a `models` entry leaves its endpoints to them, the models each
//! endpoint's `GET /v1/models` listed.

use crate::endpoint::Endpoint;
use crate::metrics::lora::{AdapterFit, AdapterId, LoraSnapshot, MAX_LISTED};
use crate::metrics::scrape::ScrapeOutcome;
use crate::metrics::MetricsSnapshot;
use crate::models::served::{ServedModels, MAX_IDS};
use serde::{Deserialize, Serialize};

/// Scrape state of one endpoint.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScrapeState {
    /// Latest successfully read snapshot.
    pub snapshot: Option<MetricsSnapshot>,
    /// The LoRA adapters that scrape listed (vLLM's
    /// `vllm:lora_requests_info`, `metrics::lora`), when the engine reports
    /// them; only with a snapshot, and as fresh as it. Kept beside the
    /// snapshot, not in it: a decision copies the snapshot per candidate
    /// and reads only an adapter request's fit of this (`AdapterFit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraSnapshot>,
    /// When `snapshot` was taken (wall-clock ms).
    pub scraped_at_ms: u64,
    /// Failed scrapes since the last success.
    pub failures: u32,
    /// When a scrape was last answered at all (readable or not, wall-clock
    /// ms): the endpoint's process is alive (stall detection reads it).
    #[serde(default)]
    pub answered_at_ms: u64,
    /// The models its `GET /v1/models` last listed (`models::served`);
    /// `None` until it has answered one readable list.
    #[serde(default)]
    pub served: Option<ServedModels>,
    /// The engine's prompt-token counter at the last scrape that had one
    /// (`metrics::Reading`).
    #[serde(default)]
    pub prompt_tokens_total: Option<f64>,
    /// Restarts of the engine seen (its prompt-token counter went down):
    /// each one emptied its prefix cache. Every worker's router forgets
    /// what its index holds for the endpoint when this changes
    /// (`Router::observe`).
    #[serde(default)]
    pub restarts: u32,
    /// When the prompt-token counter last went down (wall-clock ms; 0:
    /// never), a restart or not: a drop soon after the previous one is not
    /// counted as a restart ([`CounterNews::Flapped`]).
    #[serde(default)]
    pub counter_dropped_at_ms: u64,
    /// The engine's count of prompt tokens served from its prefix cache at
    /// the last scrape that had one (`metrics::Reading`): every worker
    /// compares its growth with what its own requests believed cached
    /// (`cache_trust`).
    #[serde(default)]
    pub prefix_hits_total: Option<f64>,
    /// The most requests kvroute had on the endpoint (all workers, and its
    /// peers') while `snapshot` was being read: at the scrape's dispatch
    /// and at its answer. The engine counted them; the ones kvroute has
    /// seen finish since are gone from it ([`ScrapeState::current`]).
    #[serde(default)]
    pub own_requests: u32,
    /// How many requests the engine runs at once, as it reports it
    /// (`engine_slots.rs`); `None` until an answer gave it, and again once
    /// its engine restarted (it may run with another count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_slots: Option<u32>,
    /// Whether its engine closes the connection after every streamed
    /// answer (`metrics::Reading::closes_after_stream`), as its last
    /// readable scrape said.
    #[serde(default)]
    pub closes_after_stream: bool,
}

/// A prompt-token counter that goes down again within this of its last
/// drop (or more when endpoints are scraped seldom:
/// `metrics::schedule::flap_window_ms`) is not one engine restarting: an
/// engine takes seconds to come back (a process start, a model load, a
/// readiness probe), and a supervisor backs off between restarts. It is an endpoint in front of several
/// engines (a Kubernetes Service, a load balancer, an engine's own router),
/// whose scrapes land on a different engine each time; counting each drop
/// as a restart would empty kvroute's prefix index for it on every other
/// scrape (and log a warning as often).
pub const FLAP_WINDOW_MS: u64 = 10_000;

/// What one scrape's prompt-token counter says about the engine behind the
/// endpoint ([`EndpointStates::record`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CounterNews {
    /// No news: it grew, held, appeared, or is not reported.
    Quiet,
    /// It went down: the engine restarted and its prefix cache is empty.
    Restarted,
    /// It went down again within the flap window of its last drop: not a
    /// restart (see [`FLAP_WINDOW_MS`]); `restarts` is left alone.
    Flapped,
}

impl ScrapeState {
    /// The snapshot if it is younger than `stale_after_ms` at `now_ms`.
    pub fn fresh(&self, now_ms: u64, stale_after_ms: u64) -> Option<MetricsSnapshot> {
        let age = now_ms.saturating_sub(self.scraped_at_ms);
        self.snapshot.filter(|_| age < stale_after_ms)
    }

    /// The fresh snapshot ([`ScrapeState::fresh`]) as the engine stands now,
    /// with kvroute's requests there down to `own_requests_now`: those of
    /// its requests the scrape counted that have finished since (at least
    /// `own_requests - own_requests_now`) are taken out of its counts
    /// ([`MetricsSnapshot::less_finished`]). A scrape is up to a period
    /// old: read during a request that has ended since, it showed that
    /// request's slot taken, and a conversation's next turn, sent as the
    /// last one ended, left its idle holder to wait for nothing (with
    /// `scheduling.engine_slots: 1`, a whole request's time:
    /// `tests/predicted_ttft.rs`). Requests of other clients are left as
    /// the engine counted them.
    pub fn current(
        &self,
        now_ms: u64,
        stale_after_ms: u64,
        own_requests_now: u32,
    ) -> Option<MetricsSnapshot> {
        self.fresh(now_ms, stale_after_ms)
            .map(|s| s.less_finished(self.own_requests.saturating_sub(own_requests_now)))
    }

    /// How the endpoint suits a request for `adapter`, by its adapters at
    /// the last scrape if that is younger than `stale_after_ms` at `now_ms`
    /// (unknown otherwise, and for a base-model request).
    pub fn adapter_fit(
        &self,
        adapter: Option<AdapterId>,
        now_ms: u64,
        stale_after_ms: u64,
    ) -> AdapterFit {
        match (adapter, &self.lora) {
            (Some(a), Some(l)) if self.fresh(now_ms, stale_after_ms).is_some() => l.fit(a),
            _ => AdapterFit::Unknown,
        }
    }

    /// Healthy unless `threshold` or more scrapes in a row failed.
    pub fn healthy(&self, threshold: u32) -> bool {
        self.failures < threshold
    }
}

/// Scrape state of the whole pool, keyed by endpoint.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EndpointStates {
    /// One entry per endpoint ever scraped and still in the pool, sorted by
    /// endpoint (lookups are binary searches: a decision reads every
    /// endpoint's state, so a linear search made it quadratic in the pool).
    pub entries: Vec<(Endpoint, ScrapeState)>,
}

impl EndpointStates {
    /// The state of `endpoint` (default when never scraped).
    pub fn get(&self, endpoint: Endpoint) -> ScrapeState {
        match self.entries.binary_search_by(|(e, _)| e.cmp(&endpoint)) {
            Ok(i) => self.entries[i].1.clone(),
            Err(_) => ScrapeState::default(),
        }
    }

    /// The state of each endpoint of `pool` (sorted, as `Router::pool`), in
    /// its order, `None` for one never scraped: one merge pass over both
    /// sorted lists, no state copied (it runs per request for sheddable
    /// traffic, over the whole pool).
    pub fn aligned<'a>(
        &'a self,
        pool: &'a [Endpoint],
    ) -> impl Iterator<Item = Option<&'a ScrapeState>> + 'a {
        let mut entries = self.entries.iter().peekable();
        pool.iter().map(move |e| {
            while entries.next_if(|(x, _)| x < e).is_some() {}
            match entries.peek() {
                Some((x, s)) if x == e => Some(s),
                _ => None,
            }
        })
    }

    /// Records a successful scrape (of an engine that lists no LoRA
    /// adapters).
    pub fn succeed(&mut self, endpoint: Endpoint, snapshot: MetricsSnapshot, now_ms: u64) {
        self.succeed_with_lora(endpoint, snapshot, None, now_ms);
    }

    /// Records a successful scrape and the LoRA adapters it listed.
    pub fn succeed_with_lora(
        &mut self,
        endpoint: Endpoint,
        snapshot: MetricsSnapshot,
        lora: Option<LoraSnapshot>,
        now_ms: u64,
    ) {
        let s = self.entry(endpoint);
        s.snapshot = Some(snapshot);
        s.lora = lora;
        s.scraped_at_ms = now_ms;
        s.answered_at_ms = now_ms;
        s.failures = 0;
        s.own_requests = 0;
    }

    /// Records how many requests kvroute had on `endpoint` while its last
    /// scrape was read ([`ScrapeState::own_requests`]); for an endpoint
    /// never scraped, nothing.
    pub fn counted_own(&mut self, endpoint: Endpoint, requests: u32) {
        if let Ok(i) = self.entries.binary_search_by(|(e, _)| e.cmp(&endpoint)) {
            self.entries[i].1.own_requests = requests;
        }
    }

    /// Records a scrape the endpoint answered without readable metrics: it
    /// is reachable (the failure streak ends) but its snapshot is not renewed.
    pub fn reachable(&mut self, endpoint: Endpoint, now_ms: u64) {
        let s = self.entry(endpoint);
        s.failures = 0;
        s.answered_at_ms = now_ms;
    }

    /// Envoy could not get an answer from the endpoint for a request (connect
    /// failure, reset or timeout before any response byte): it counts as
    /// `threshold` failed scrapes, so it leaves the candidate set at once and
    /// comes back with the next scrape it answers. Returns whether it was a
    /// candidate before (a change).
    pub fn unreachable(&mut self, endpoint: Endpoint, threshold: u32) -> bool {
        let s = self.entry(endpoint);
        let was = s.failures < threshold;
        s.failures = s.failures.max(threshold);
        was
    }

    /// Whether `endpoint` is healthy (see [`ScrapeState::healthy`]), without
    /// copying its state.
    pub fn healthy(&self, endpoint: Endpoint, threshold: u32) -> bool {
        match self.entries.binary_search_by(|(e, _)| e.cmp(&endpoint)) {
            Ok(i) => self.entries[i].1.healthy(threshold),
            Err(_) => true,
        }
    }

    /// When `endpoint`'s `/v1/models` list was read (`None`: never, or
    /// forgotten), without copying its state.
    pub fn listed_at(&self, endpoint: Endpoint) -> Option<u64> {
        let i = self
            .entries
            .binary_search_by(|(e, _)| e.cmp(&endpoint))
            .ok()?;
        self.entries[i].1.served.as_ref().map(|s| s.listed_at_ms)
    }

    /// Forgets `endpoint`'s `/v1/models` list: it serves no listed model
    /// until it is read again (it answers again after leaving the candidate
    /// set, and may have restarted with other models).
    pub fn forget_served(&mut self, endpoint: Endpoint) {
        if let Ok(i) = self.entries.binary_search_by(|(e, _)| e.cmp(&endpoint)) {
            self.entries[i].1.served = None;
        }
    }

    /// The slot count `endpoint`'s engine reported (`None`: not yet, or not
    /// since it restarted), without copying its state.
    pub fn engine_slots(&self, endpoint: Endpoint) -> Option<u32> {
        let i = self
            .entries
            .binary_search_by(|(e, _)| e.cmp(&endpoint))
            .ok()?;
        self.entries[i].1.engine_slots
    }

    /// Whether `endpoint`'s engine closes the connection after every
    /// streamed answer ([`ScrapeState::closes_after_stream`]; false for
    /// one never read), without copying its state.
    pub fn closes_after_stream(&self, endpoint: Endpoint) -> bool {
        self.entries
            .binary_search_by(|(e, _)| e.cmp(&endpoint))
            .is_ok_and(|i| self.entries[i].1.closes_after_stream)
    }

    /// Records the slot count `endpoint`'s engine reported
    /// (`engine_slots.rs`).
    pub fn engine_slots_read(&mut self, endpoint: Endpoint, slots: u32) {
        self.entry(endpoint).engine_slots = Some(slots);
    }

    /// Records a `/v1/models` list read from `endpoint`.
    pub fn listed(&mut self, endpoint: Endpoint, served: ServedModels) {
        self.entry(endpoint).served = Some(served);
    }

    /// Records one scrape's outcome, and what its prompt-token counter says
    /// about the engine: below the last value read, it restarted (a counter
    /// only a restart takes down; an engine that stops reporting it, or
    /// starts, is no news), unless the counter went down within
    /// `flap_window_ms` before as well (`metrics::schedule::flap_window_ms`):
    /// then the endpoint is in front of several engines, and the drop is
    /// [`CounterNews::Flapped`].
    pub fn record(
        &mut self,
        endpoint: Endpoint,
        outcome: ScrapeOutcome,
        now_ms: u64,
        flap_window_ms: u64,
    ) -> CounterNews {
        match outcome {
            ScrapeOutcome::Snapshot(r) => {
                self.succeed_with_lora(endpoint, r.snapshot, r.lora, now_ms);
                let s = self.entry(endpoint);
                s.prefix_hits_total = r.prefix_hits_total;
                s.closes_after_stream = r.closes_after_stream;
                let Some(now) = r.prompt_tokens_total else {
                    return CounterNews::Quiet;
                };
                let dropped = s.prompt_tokens_total.is_some_and(|before| now < before);
                s.prompt_tokens_total = Some(now);
                if !dropped {
                    return CounterNews::Quiet;
                }
                let last = std::mem::replace(&mut s.counter_dropped_at_ms, now_ms.max(1));
                if last != 0 && now_ms.saturating_sub(last) < flap_window_ms {
                    return CounterNews::Flapped;
                }
                s.restarts = s.restarts.wrapping_add(1);
                // It may run with another slot count: asked again.
                s.engine_slots = None;
                CounterNews::Restarted
            }
            ScrapeOutcome::Unreadable => {
                self.reachable(endpoint, now_ms);
                CounterNews::Quiet
            }
            ScrapeOutcome::Unreachable => {
                self.fail(endpoint);
                CounterNews::Quiet
            }
        }
    }

    /// Records a failed scrape; returns the failure streak.
    pub fn fail(&mut self, endpoint: Endpoint) -> u32 {
        let s = self.entry(endpoint);
        s.failures = s.failures.saturating_add(1);
        s.failures
    }

    /// Drops endpoints that left the pool (keeps the value bounded).
    pub fn retain(&mut self, pool: &[Endpoint]) {
        let members: hashbrown::HashSet<&Endpoint> = pool.iter().collect();
        self.entries.retain(|(e, _)| members.contains(e));
    }

    pub(crate) fn entry(&mut self, endpoint: Endpoint) -> &mut ScrapeState {
        let i = match self.entries.binary_search_by(|(e, _)| e.cmp(&endpoint)) {
            Ok(i) => i,
            Err(i) => {
                self.entries.insert(i, (endpoint, ScrapeState::default()));
                i
            }
        };
        &mut self.entries[i].1
    }

    /// Binary encoding: every worker decodes it on every tick, and the
    /// scraper rewrites it once per batch of answers, so at 1024 endpoints
    /// its size and decoding cost matter (JSON was ~170 bytes per endpoint,
    /// this is 36-86). Layout (little endian): `KVES`, version, entry count
    /// (u16), then per entry the endpoint (4 + 4 bytes or 6 + 16 bytes, then
    /// the port), `scraped_at_ms` (u64), `answered_at_ms` (u64), `failures`
    /// (u32), a flag byte (bit 0: snapshot, 1: kv_usage, 2: kv_capacity_tokens,
    /// 3: lora, 4: served, 5: prompt_tokens_total, 6: restarts, 7:
    /// counter_dropped_at_ms) and the
    /// snapshot's fields present; `lora` (the
    /// state's, written only with a snapshot) is its
    /// three counts (u16) and the listed adapter ids (u32 each, running then
    /// waiting, as many as the counts capped at [`MAX_LISTED`]); `served`
    /// (after the snapshot) is `listed_at_ms` (u64), a count (u8, at most
    /// [`MAX_IDS`]) and the sorted model ids (u32 each); then
    /// `prompt_tokens_total` (f64), `restarts` (u32, written when not 0) and
    /// `counter_dropped_at_ms` (u64, written when not 0); then a second flag
    /// byte (bit 0: `prefix_hits_total`, 1: `own_requests`, 2:
    /// `engine_slots`, 3: `closes_after_stream`) and the first three's
    /// fields (f64, u32, u32).
    pub fn encode(&self) -> Vec<u8> {
        self.encode_as(VERSION)
    }

    /// [`EndpointStates::encode`] in the layout of `version` (5 or 6: the
    /// tests write the older ones' bytes with it).
    fn encode_as(&self, version: u8) -> Vec<u8> {
        let n = self.entries.len().min(u16::MAX as usize);
        let mut out = Vec::with_capacity(7 + n * 64);
        out.extend_from_slice(MAGIC);
        out.push(version);
        out.extend_from_slice(&(n as u16).to_le_bytes());
        for (e, s) in self.entries.iter().take(n) {
            e.encode_into(&mut out);
            out.extend_from_slice(&s.scraped_at_ms.to_le_bytes());
            out.extend_from_slice(&s.answered_at_ms.to_le_bytes());
            out.extend_from_slice(&s.failures.to_le_bytes());
            // The flags that do not depend on a snapshot.
            let own = u8::from(s.served.is_some()) << 4
                | u8::from(s.prompt_tokens_total.is_some()) << 5
                | u8::from(s.restarts != 0) << 6
                | u8::from(s.counter_dropped_at_ms != 0) << 7;
            let Some(snap) = s.snapshot else {
                out.push(own);
                encode_own(s, version, &mut out);
                continue;
            };
            // Destructured so that a new snapshot field fails to compile here
            // until it is encoded.
            let MetricsSnapshot {
                waiting,
                running,
                kv_usage,
                kv_capacity_tokens,
            } = snap;
            let lora = s.lora;
            out.push(
                1 | u8::from(kv_usage.is_some()) << 1
                    | u8::from(kv_capacity_tokens.is_some()) << 2
                    | u8::from(lora.is_some()) << 3
                    | own,
            );
            out.extend_from_slice(&waiting.to_le_bytes());
            out.extend_from_slice(&running.to_le_bytes());
            if let Some(k) = kv_usage {
                out.extend_from_slice(&k.to_le_bytes());
            }
            if let Some(c) = kv_capacity_tokens {
                out.extend_from_slice(&c.to_le_bytes());
            }
            if let Some(l) = lora {
                encode_lora(&l, &mut out);
            }
            encode_own(s, version, &mut out);
        }
        out
    }

    /// Decodes [`EndpointStates::encode`]'s output (or the JSON an older
    /// build wrote: shared data outlives a plugin reload); garbage gives
    /// `None`.
    pub fn decode(bytes: &[u8]) -> Option<EndpointStates> {
        let mut states = match bytes.strip_prefix(MAGIC) {
            Some(rest) => decode_binary(rest)?,
            None => serde_json::from_slice(bytes).ok()?,
        };
        // Written sorted; a value from an older build may not be.
        if !states.entries.is_sorted_by(|a, b| a.0 < b.0) {
            states.entries.sort_by_key(|e| e.0);
            states.entries.dedup_by(|a, b| a.0 == b.0);
        }
        Some(states)
    }
}

const MAGIC: &[u8; 4] = b"KVES";
/// The fewest bytes an encoded entry takes (a v4 address, the two times,
/// the failure count, one flag byte): decoding reserves at most one entry
/// (`size_of::<(Endpoint, ScrapeState)>()`, 248 bytes natively) per this
/// many bytes of input, about 9 times the input.
pub const MIN_ENTRY_BYTES: usize = 28;
/// Version 2 added the `lora` flag, version 3 the `served` one, version 4
/// the engine's prompt-token counter and restarts, version 5 when the
/// counter last went down, version 6 a second flag byte (the prefix-cache
/// hit counter), version 7 its second bit (kvroute's requests counted by
/// the scrape), version 8 its third (the slot count the engine reports),
/// version 9 its fourth (the engine closes its connection after a stream);
/// values of the older versions (without those flags) decode as well.
const VERSION: u8 = 9;
/// Flag bits each version may set.
const FLAGS: [u8; 9] = [0x07, 0x0f, 0x1f, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff];
/// Bits of the second flag byte each version from 6 on may set.
const FLAGS2: [u8; 4] = [0x01, 0x03, 0x07, 0x0f];

/// What follows the snapshot whether or not there is one: `served`, the
/// prompt-token counter, the restarts, the counter's last drop (each when
/// its flag is set), the second flag byte and the prefix-hit counter.
fn encode_own(s: &ScrapeState, version: u8, out: &mut Vec<u8>) {
    encode_served(s.served.as_ref(), out);
    if let Some(t) = s.prompt_tokens_total {
        out.extend_from_slice(&t.to_le_bytes());
    }
    if s.restarts != 0 {
        out.extend_from_slice(&s.restarts.to_le_bytes());
    }
    if s.counter_dropped_at_ms != 0 {
        out.extend_from_slice(&s.counter_dropped_at_ms.to_le_bytes());
    }
    if version < 6 {
        return;
    }
    let own_requests = if version >= 7 { s.own_requests } else { 0 };
    let engine_slots = s.engine_slots.filter(|_| version >= 8);
    let closes_after_stream = s.closes_after_stream && version >= 9;
    out.push(
        u8::from(s.prefix_hits_total.is_some())
            | u8::from(own_requests != 0) << 1
            | u8::from(engine_slots.is_some()) << 2
            | u8::from(closes_after_stream) << 3,
    );
    if let Some(h) = s.prefix_hits_total {
        out.extend_from_slice(&h.to_le_bytes());
    }
    if own_requests != 0 {
        out.extend_from_slice(&own_requests.to_le_bytes());
    }
    if let Some(n) = engine_slots {
        out.extend_from_slice(&n.to_le_bytes());
    }
}

fn listed(count: u16) -> usize {
    usize::from(count).min(MAX_LISTED)
}

fn encode_lora(l: &LoraSnapshot, out: &mut Vec<u8>) {
    for c in [l.running_count, l.waiting_count, l.max_lora] {
        out.extend_from_slice(&c.to_le_bytes());
    }
    let running = &l.running[..listed(l.running_count)];
    let waiting = &l.waiting[..listed(l.waiting_count)];
    for id in running.iter().chain(waiting) {
        out.extend_from_slice(&id.to_le_bytes());
    }
}

fn decode_lora(r: &mut &[u8]) -> Option<LoraSnapshot> {
    let mut l = LoraSnapshot {
        running_count: u16::from_le_bytes(next(r)?),
        waiting_count: u16::from_le_bytes(next(r)?),
        max_lora: u16::from_le_bytes(next(r)?),
        ..LoraSnapshot::default()
    };
    for i in 0..listed(l.running_count) {
        l.running[i] = u32::from_le_bytes(next(r)?);
    }
    for i in 0..listed(l.waiting_count) {
        l.waiting[i] = u32::from_le_bytes(next(r)?);
    }
    Some(l)
}

fn encode_served(served: Option<&ServedModels>, out: &mut Vec<u8>) {
    let Some(s) = served else {
        return;
    };
    let ids = &s.ids[..s.ids.len().min(MAX_IDS)];
    out.extend_from_slice(&s.listed_at_ms.to_le_bytes());
    out.push(ids.len() as u8);
    for id in ids {
        out.extend_from_slice(&id.to_le_bytes());
    }
}

fn decode_served(r: &mut &[u8]) -> Option<ServedModels> {
    let listed_at_ms = u64::from_le_bytes(next(r)?);
    let n = usize::from(next::<1>(r)?[0]);
    if n > MAX_IDS {
        return None;
    }
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        ids.push(u32::from_le_bytes(next(r)?));
    }
    Some(ServedModels::new(ids, listed_at_ms))
}

/// The next `N` bytes of `r`, advancing it.
fn next<const N: usize>(r: &mut &[u8]) -> Option<[u8; N]> {
    let (head, rest) = r.split_first_chunk::<N>()?;
    *r = rest;
    Some(*head)
}

fn decode_binary(mut r: &[u8]) -> Option<EndpointStates> {
    let r = &mut r;
    let version = next::<1>(r)?[0];
    if !(1..=VERSION).contains(&version) {
        return None;
    }
    let known_flags = FLAGS[usize::from(version - 1)];
    let n = u16::from_le_bytes(next(r)?) as usize;
    // A count the bytes cannot hold is garbage.
    if n > r.len() / MIN_ENTRY_BYTES {
        return None;
    }
    let mut entries = Vec::with_capacity(n);
    for _ in 0..n {
        let endpoint = Endpoint::decode_from(r)?;
        let mut s = ScrapeState {
            scraped_at_ms: u64::from_le_bytes(next(r)?),
            answered_at_ms: u64::from_le_bytes(next(r)?),
            failures: u32::from_le_bytes(next(r)?),
            snapshot: None,
            lora: None,
            served: None,
            prompt_tokens_total: None,
            restarts: 0,
            counter_dropped_at_ms: 0,
            prefix_hits_total: None,
            own_requests: 0,
            engine_slots: None,
            closes_after_stream: false,
        };
        let flags = next::<1>(r)?[0];
        if flags & !known_flags != 0 {
            return None;
        }
        if flags & 1 == 1 {
            let f64_at = |r: &mut &[u8]| next(r).map(f64::from_le_bytes);
            s.snapshot = Some(MetricsSnapshot {
                waiting: f64_at(r)?,
                running: f64_at(r)?,
                kv_usage: if flags & 2 != 0 {
                    Some(f64_at(r)?)
                } else {
                    None
                },
                kv_capacity_tokens: if flags & 4 != 0 {
                    Some(u64::from_le_bytes(next(r)?))
                } else {
                    None
                },
            });
            if flags & 8 != 0 {
                s.lora = Some(decode_lora(r)?);
            }
        } else if flags & 0x0f != 0 {
            return None;
        }
        if flags & 0x10 != 0 {
            s.served = Some(decode_served(r)?);
        }
        if flags & 0x20 != 0 {
            s.prompt_tokens_total = Some(f64::from_le_bytes(next(r)?));
        }
        if flags & 0x40 != 0 {
            s.restarts = u32::from_le_bytes(next(r)?);
        }
        if flags & 0x80 != 0 {
            s.counter_dropped_at_ms = u64::from_le_bytes(next(r)?);
        }
        if version >= 6 {
            let flags2 = next::<1>(r)?[0];
            if flags2 & !FLAGS2[usize::from(version - 6)] != 0 {
                return None;
            }
            if flags2 & 1 != 0 {
                s.prefix_hits_total = Some(f64::from_le_bytes(next(r)?));
            }
            if flags2 & 2 != 0 {
                s.own_requests = u32::from_le_bytes(next(r)?);
            }
            if flags2 & 4 != 0 {
                s.engine_slots = Some(u32::from_le_bytes(next(r)?));
            }
            s.closes_after_stream = flags2 & 8 != 0;
        }
        entries.push((endpoint, s));
    }
    r.is_empty().then_some(EndpointStates { entries })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::served::model_id;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn ep(s: &str) -> Endpoint {
        s.parse().unwrap()
    }

    #[test]
    fn aligned_matches_get_for_every_pool_member() {
        let mut t = EndpointStates::default();
        for (i, e) in ["10.0.0.9:80", "10.0.0.1:80", "[::1]:80", "10.0.0.5:80"]
            .iter()
            .enumerate()
        {
            t.succeed(ep(e), MetricsSnapshot::default(), i as u64 + 1);
        }
        let mut pool: Vec<Endpoint> = [
            "10.0.0.1:80",
            "10.0.0.2:80",
            "10.0.0.9:80",
            "[::1]:80",
            "[::2]:80",
        ]
        .iter()
        .map(|e| ep(e))
        .collect();
        pool.sort();
        let want: Vec<ScrapeState> = pool.iter().map(|e| t.get(*e)).collect();
        let got: Vec<ScrapeState> = t
            .aligned(&pool)
            .map(|s| s.cloned().unwrap_or_default())
            .collect();
        assert_eq!(got, want);
        assert_eq!(t.aligned(&pool).filter(Option::is_none).count(), 2);
        assert_eq!(t.aligned(&[]).count(), 0);
    }

    #[test]
    fn success_failure_freshness_and_health() {
        let mut t = EndpointStates::default();
        let a = ep("10.0.0.1:8000");
        let snap = MetricsSnapshot {
            waiting: 3.0,
            ..Default::default()
        };
        t.succeed(a, snap, 1_000);
        assert_eq!(t.get(a).fresh(2_999, 2_000), Some(snap));
        assert_eq!(t.get(a).fresh(3_000, 2_000), None);
        assert!(t.get(a).healthy(3));
        assert_eq!(t.fail(a), 1);
        assert_eq!(t.fail(a), 2);
        assert!(t.get(a).healthy(3));
        assert_eq!(t.fail(a), 3);
        assert!(!t.get(a).healthy(3));
        t.succeed(a, snap, 5_000);
        assert!(t.get(a).healthy(3));
        // never scraped: healthy, no snapshot
        assert!(t.get(ep("10.0.0.2:8000")).healthy(3));
        assert_eq!(t.get(ep("10.0.0.2:8000")).snapshot, None);
    }

    #[test]
    fn unreadable_scrapes_keep_an_endpoint_healthy_but_stale() {
        let mut t = EndpointStates::default();
        let a = ep("10.0.0.1:8000");
        t.record(
            a,
            ScrapeOutcome::Snapshot(MetricsSnapshot::default().into()),
            1_000,
            FLAP_WINDOW_MS,
        );
        for _ in 0..5 {
            t.record(a, ScrapeOutcome::Unreachable, 1_050, FLAP_WINDOW_MS);
        }
        assert!(!t.get(a).healthy(3));
        t.record(a, ScrapeOutcome::Unreadable, 1_100, FLAP_WINDOW_MS);
        assert!(t.get(a).healthy(3));
        assert_eq!(t.get(a).scraped_at_ms, 1_000);
        assert_eq!(t.get(a).fresh(3_500, 2_000), None);
    }

    #[test]
    fn an_unanswered_request_makes_an_endpoint_unhealthy_until_a_scrape_answers() {
        let mut t = EndpointStates::default();
        let a = ep("10.0.0.1:8000");
        t.record(
            a,
            ScrapeOutcome::Snapshot(MetricsSnapshot::default().into()),
            1_000,
            FLAP_WINDOW_MS,
        );
        assert_eq!(t.get(a).answered_at_ms, 1_000);
        assert!(t.unreachable(a, 3), "was a candidate");
        assert!(!t.get(a).healthy(3));
        assert!(!t.unreachable(a, 3), "no change the second time");
        t.record(a, ScrapeOutcome::Unreachable, 1_050, FLAP_WINDOW_MS);
        assert_eq!(t.get(a).failures, 4);
        t.record(a, ScrapeOutcome::Unreadable, 1_100, FLAP_WINDOW_MS);
        assert!(t.get(a).healthy(3));
        assert_eq!(t.get(a).answered_at_ms, 1_100);
        // an old encoding without answered_at_ms still decodes
        let old =
            br#"{"entries":[["10.0.0.1:8000",{"snapshot":null,"scraped_at_ms":5,"failures":1}]]}"#;
        assert_eq!(
            EndpointStates::decode(old).unwrap().get(a).answered_at_ms,
            0
        );
    }

    #[test]
    fn codec_and_retain() {
        let mut t = EndpointStates::default();
        t.fail(ep("10.0.0.1:8000"));
        t.succeed(ep("[::1]:9000"), MetricsSnapshot::default(), 7);
        let back = EndpointStates::decode(&t.encode()).unwrap();
        assert_eq!(back, t);
        assert_eq!(EndpointStates::decode(b"\xff garbage"), None);
        t.retain(&[ep("[::1]:9000")]);
        assert_eq!(t.entries.len(), 1);
    }

    /// A pool of `n` with every kind of entry: never scraped, failing,
    /// unreadable, snapshots with and without the optional fields.
    fn mixed(n: u16) -> EndpointStates {
        let mut t = EndpointStates::default();
        for i in 0..n {
            let e = if i % 5 == 4 {
                ep(&format!("[fd00::{i:x}]:8000"))
            } else {
                ep(&format!("10.0.{}.{}:8000", i / 256, i % 256))
            };
            let snap = MetricsSnapshot {
                waiting: f64::from(i),
                running: 0.5,
                kv_usage: (i % 2 == 0).then_some(0.25),
                kv_capacity_tokens: (i % 3 == 0).then_some(416_000),
            };
            // Every listing length, up to more adapters than are kept.
            let lora = (i % 7 != 0).then(|| {
                let names: Vec<String> = (0..i % 11).map(|k| format!("lora-{k}")).collect();
                let (run, wait) = names.split_at(names.len() / 2);
                LoraSnapshot::from_labels(&run.join(","), &wait.join(","), "4")
            });
            match i % 4 {
                0 => {
                    t.fail(e);
                }
                1 => t.reachable(e, 5),
                _ => t.succeed_with_lora(e, snap, lora, 1_000 + u64::from(i)),
            }
            // Engine counters and restarts on some of each kind.
            if i % 6 < 4 {
                let s = t.entry(e);
                s.prompt_tokens_total = (i % 6 < 3).then_some(f64::from(i) * 1e6);
                s.restarts = u32::from(i % 6 % 2);
                s.counter_dropped_at_ms = if i % 6 == 1 { 7_000 + u64::from(i) } else { 0 };
            }
            if i % 4 != 1 {
                t.entry(e).prefix_hits_total = (i % 3 == 0).then_some(f64::from(i) * 1e5);
            }
            if i % 5 == 2 {
                t.counted_own(e, u32::from(i) * 1_000_003);
            }
            if i % 7 < 3 {
                t.engine_slots_read(e, u32::from(i) * 70_001 + 1);
            }
            t.entry(e).closes_after_stream = i % 4 == 3;
            // Lists of every length (none, empty, up to the cap; past the
            // first 50, the one or two names a real pod lists), on every
            // kind of entry.
            if i % 3 != 1 {
                let n = if i < 50 {
                    [0, 1, 2, 3, MAX_IDS]
                } else {
                    [0, 1, 2, 1, 2]
                };
                let n = n[usize::from(i % 5)];
                let ids = (0..n).map(|k| model_id(&format!("model-{k}"))).collect();
                t.listed(e, ServedModels::new(ids, 2_000 + u64::from(i)));
            }
        }
        t
    }

    #[test]
    fn a_list_can_be_forgotten_and_health_read_without_a_copy() {
        let mut t = EndpointStates::default();
        let a = ep("10.0.0.1:80");
        t.listed(a, ServedModels::new(vec![1, 2], 5));
        assert!(t.get(a).served.is_some_and(|s| s.serves(2)));
        for _ in 0..3 {
            t.fail(a);
        }
        assert!(!t.healthy(a, 3));
        assert!(t.healthy(ep("10.0.0.2:80"), 3), "never scraped");
        assert_eq!(t.listed_at(a), Some(5));
        t.forget_served(a);
        assert_eq!(t.get(a).served, None);
        assert_eq!(t.listed_at(a), None);
        t.forget_served(ep("10.0.0.2:80"));
        assert_eq!(t.entries.len(), 1, "forgetting adds nothing");
    }

    #[test]
    fn served_lists_roundtrip_and_older_versions_decode() {
        let t = mixed(40);
        let bytes = t.encode();
        assert_eq!(EndpointStates::decode(&bytes).as_ref(), Some(&t));
        // A version 2 value (no served lists) still decodes...
        let mut old = t.clone();
        for (_, s) in &mut old.entries {
            s.served = None;
            s.prompt_tokens_total = None;
            s.restarts = 0;
            s.counter_dropped_at_ms = 0;
            s.prefix_hits_total = None;
            s.own_requests = 0;
            s.engine_slots = None;
            s.closes_after_stream = false;
        }
        let v2 = old.encode_as(2);
        assert_eq!(EndpointStates::decode(&v2), Some(old.clone()));
        // ... and one claiming a flag its version did not have is garbage.
        let bad = t.encode_as(2);
        assert_eq!(EndpointStates::decode(&bad), None);
        // A count over the cap is garbage, not an allocation.
        let mut one = EndpointStates::default();
        one.listed(ep("10.0.0.1:80"), ServedModels::new(vec![7], 9));
        let mut b = one.encode();
        let count_at = b.len() - 6;
        assert_eq!(b[count_at], 1);
        b[count_at] = MAX_IDS as u8 + 1;
        assert_eq!(EndpointStates::decode(&b), None);
    }

    #[test]
    fn a_prompt_token_counter_going_down_is_a_restart() {
        use CounterNews::{Quiet, Restarted};
        let mut t = EndpointStates::default();
        let a = ep("10.0.0.1:80");
        assert_eq!(
            t.record(a, read(Some(100.0)), 1, FLAP_WINDOW_MS),
            Quiet,
            "first sight"
        );
        assert_eq!(t.record(a, read(Some(100.0)), 2, FLAP_WINDOW_MS), Quiet);
        assert_eq!(t.record(a, read(Some(5_000.0)), 3, FLAP_WINDOW_MS), Quiet);
        assert_eq!(
            t.record(a, read(None), 4, FLAP_WINDOW_MS),
            Quiet,
            "a scrape without it is no news"
        );
        assert_eq!(
            t.record(a, ScrapeOutcome::Unreachable, 5, FLAP_WINDOW_MS),
            Quiet
        );
        assert_eq!(
            t.record(a, ScrapeOutcome::Unreadable, 6, FLAP_WINDOW_MS),
            Quiet
        );
        assert_eq!(t.get(a).restarts, 0);
        assert_eq!(t.get(a).prompt_tokens_total, Some(5_000.0));
        assert_eq!(
            t.record(a, read(Some(12.0)), 7, FLAP_WINDOW_MS),
            Restarted,
            "a reset"
        );
        assert_eq!(t.get(a).restarts, 1);
        assert_eq!(t.record(a, read(Some(40.0)), 8, FLAP_WINDOW_MS), Quiet);
        // Restarted again, once the engine could have come back.
        let later = 7 + FLAP_WINDOW_MS;
        assert_eq!(
            t.record(a, read(Some(0.0)), later, FLAP_WINDOW_MS),
            Restarted
        );
        assert_eq!(
            (t.get(a).restarts, t.get(a).prompt_tokens_total),
            (2, Some(0.0))
        );
        // Both survive the codec.
        assert_eq!(EndpointStates::decode(&t.encode()).as_ref(), Some(&t));
    }

    fn read(n: Option<f64>) -> ScrapeOutcome {
        ScrapeOutcome::Snapshot(crate::metrics::Reading {
            prompt_tokens_total: n,
            ..crate::metrics::Reading::default()
        })
    }

    #[test]
    fn a_counter_that_keeps_going_up_and_down_is_several_engines_not_restarts() {
        use CounterNews::{Flapped, Quiet, Restarted};
        // A Service in front of two engines: scrapes alternate between them.
        let mut t = EndpointStates::default();
        let a = ep("10.0.0.1:80");
        let mut news = Vec::new();
        let mut now = 1_000;
        for k in 0..400u32 {
            // Both engines serve; the first stays behind the second, so every
            // scrape of it after one of the second is a drop (199 of them).
            let (x, y) = (1e6 + f64::from(k) * 900.0, 2e6 + f64::from(k) * 100.0);
            news.push(t.record(
                a,
                read(Some(if k % 2 == 0 { x } else { y })),
                now,
                FLAP_WINDOW_MS,
            ));
            now += 50;
        }
        assert_eq!(news.iter().filter(|&&n| n == Restarted).count(), 1);
        assert_eq!(news.iter().filter(|&&n| n == Flapped).count(), 198);
        assert_eq!(
            t.get(a).restarts,
            1,
            "only the first drop empties the index"
        );
        // It flaps for as long as it goes down within the window of the last
        // drop, however long that lasts; a drop after a quiet window is a
        // restart again.
        assert_eq!(t.record(a, read(Some(1.0)), now, FLAP_WINDOW_MS), Flapped);
        assert_eq!(t.record(a, read(Some(5.0)), now + 1, FLAP_WINDOW_MS), Quiet);
        let quiet = now + FLAP_WINDOW_MS;
        assert_eq!(
            t.record(a, read(Some(2.0)), quiet, FLAP_WINDOW_MS),
            Restarted
        );
        assert_eq!(t.get(a).restarts, 2);
        assert_eq!(EndpointStates::decode(&t.encode()).as_ref(), Some(&t));
        // Another endpoint has a window of its own.
        let b = ep("10.0.0.2:80");
        assert_eq!(t.record(b, read(Some(9.0)), quiet, FLAP_WINDOW_MS), Quiet);
        assert_eq!(
            t.record(b, read(Some(3.0)), quiet + 1, FLAP_WINDOW_MS),
            Restarted
        );
        // A pool scraped seldom has a longer window (40 scrape periods).
        let later = quiet + 1 + 2 * FLAP_WINDOW_MS;
        assert_eq!(t.record(b, read(Some(9.0)), later - 1, 60_000), Quiet);
        assert_eq!(t.record(b, read(Some(1.0)), later, 60_000), Flapped);
    }

    #[test]
    fn version_3_values_decode_without_counters() {
        let t = mixed(40);
        let mut old = t.clone();
        for (_, s) in &mut old.entries {
            s.prompt_tokens_total = None;
            s.restarts = 0;
            s.counter_dropped_at_ms = 0;
            s.prefix_hits_total = None;
            s.own_requests = 0;
            s.engine_slots = None;
            s.closes_after_stream = false;
        }
        let v3 = old.encode_as(3);
        assert_eq!(EndpointStates::decode(&v3), Some(old));
        // A version 3 value with the new flags is garbage.
        let bad = t.encode_as(3);
        assert_eq!(EndpointStates::decode(&bad), None);
    }

    #[test]
    fn version_4_values_decode_without_the_last_drop() {
        let t = mixed(40);
        let mut old = t.clone();
        for (_, s) in &mut old.entries {
            s.counter_dropped_at_ms = 0;
            s.prefix_hits_total = None;
            s.own_requests = 0;
            s.engine_slots = None;
            s.closes_after_stream = false;
        }
        let v4 = old.encode_as(4);
        assert_eq!(EndpointStates::decode(&v4), Some(old));
        assert!(t.entries.iter().any(|(_, s)| s.counter_dropped_at_ms != 0));
        let bad = t.encode_as(4);
        assert_eq!(EndpointStates::decode(&bad), None);
    }

    #[test]
    fn an_adapter_fits_by_the_fresh_scrape_only() {
        use crate::metrics::lora::adapter_id;
        let mut t = EndpointStates::default();
        let a = ep("10.0.0.1:8000");
        let vllm = "vllm:num_requests_waiting 0\n\
                    vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"sql\",waiting_lora_adapters=\"\"} 5\n";
        let outcome =
            crate::metrics::scrape::classify(Some(200), Some(vllm.as_bytes()), &Default::default());
        t.record(a, outcome, 1_000, FLAP_WINDOW_MS);
        let (sql, fin) = (Some(adapter_id("sql")), Some(adapter_id("fin")));
        let s = t.get(a);
        assert_eq!(s.adapter_fit(sql, 1_500, 2_000), AdapterFit::Running);
        assert_eq!(s.adapter_fit(fin, 1_500, 2_000), AdapterFit::Absent);
        assert_eq!(s.adapter_fit(None, 1_500, 2_000), AdapterFit::Unknown);
        assert_eq!(
            s.adapter_fit(sql, 3_000, 2_000),
            AdapterFit::Unknown,
            "stale"
        );
        // A scrape without the gauge forgets the adapters.
        t.record(
            a,
            ScrapeOutcome::Snapshot(MetricsSnapshot::default().into()),
            4_000,
            FLAP_WINDOW_MS,
        );
        assert_eq!(t.get(a).adapter_fit(sql, 4_000, 2_000), AdapterFit::Unknown);
    }

    /// The bytes the build before issue 14's split (LoRA inside the
    /// snapshot) wrote for these two entries: the LoRA adapters, now kept
    /// beside the snapshot, keep their place and flag on the wire.
    #[test]
    fn the_lora_wire_layout_is_unchanged() {
        const BEFORE: &str =
            "4b564553030200040a000001401f07000000000000000700000000000000000000000b00\
            00000000000040000000000000f03f000000000000e03f0100010002006d540f4509b4fb\
            91040a000002401f09000000000000000900000000000000000000000500000000000000\
            0000000000000008400010000000000000";
        let before: Vec<u8> = (0..BEFORE.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&BEFORE[i..i + 2], 16).unwrap())
            .collect();
        let mut t = EndpointStates::default();
        let snap = MetricsSnapshot {
            waiting: 2.0,
            running: 1.0,
            kv_usage: Some(0.5),
            kv_capacity_tokens: None,
        };
        let lora = LoraSnapshot::from_labels("sql", "fin", "2");
        t.succeed_with_lora(ep("10.0.0.1:8000"), snap, Some(lora), 7);
        let snap = MetricsSnapshot {
            waiting: 0.0,
            running: 3.0,
            kv_usage: None,
            kv_capacity_tokens: Some(4096),
        };
        t.succeed(ep("10.0.0.2:8000"), snap, 9);
        // The same bytes in version 5's layout (4 and 5 added only flags
        // these entries do not set; 6 a second flag byte per entry).
        let mut now = before.clone();
        now[4] = 5;
        assert_eq!(t.encode_as(5), now);
        assert_eq!(EndpointStates::decode(&before), Some(t));
    }

    #[test]
    fn version_5_values_decode_without_the_prefix_hit_counter() {
        let t = mixed(40);
        let mut old = t.clone();
        for (_, s) in &mut old.entries {
            s.prefix_hits_total = None;
            s.own_requests = 0;
            s.engine_slots = None;
            s.closes_after_stream = false;
        }
        assert_eq!(EndpointStates::decode(&old.encode_as(5)), Some(old));
        assert!(t.entries.iter().any(|(_, s)| s.prefix_hits_total.is_some()));
        // Version 6 bytes under version 5 are garbage (a byte too many per
        // entry), and so is an unknown bit in the second flag byte.
        let mut bad = t.encode();
        bad[4] = 5;
        assert_eq!(EndpointStates::decode(&bad), None);
        let mut one = EndpointStates::default();
        one.succeed(ep("10.0.0.1:80"), MetricsSnapshot::default(), 5);
        let mut bytes = one.encode();
        let flags2 = bytes.len() - 1;
        assert_eq!(bytes[flags2], 0);
        bytes[flags2] = 4;
        assert_eq!(EndpointStates::decode(&bytes), None);
    }

    #[test]
    fn version_6_values_decode_without_the_requests_a_scrape_counted() {
        let t = mixed(40);
        assert!(t.entries.iter().any(|(_, s)| s.own_requests > 65_536));
        let mut old = t.clone();
        for (_, s) in &mut old.entries {
            s.own_requests = 0;
            s.engine_slots = None;
            s.closes_after_stream = false;
        }
        assert_eq!(EndpointStates::decode(&t.encode_as(6)), Some(old));
        // The bit version 7 added is unknown to version 6.
        let mut one = EndpointStates::default();
        one.succeed(ep("10.0.0.1:80"), MetricsSnapshot::default(), 5);
        one.counted_own(ep("10.0.0.1:80"), 3);
        let mut bytes = one.encode();
        assert_eq!(EndpointStates::decode(&bytes), Some(one));
        bytes[4] = 6;
        assert_eq!(EndpointStates::decode(&bytes), None);
    }

    #[test]
    fn version_7_values_decode_without_the_slot_counts() {
        let t = mixed(40);
        assert!(t.entries.iter().any(|(_, s)| s.engine_slots > Some(65_536)));
        let mut old = t.clone();
        for (_, s) in &mut old.entries {
            s.engine_slots = None;
            s.closes_after_stream = false;
        }
        assert_eq!(EndpointStates::decode(&t.encode_as(7)), Some(old));
        // The bit version 8 added is unknown to version 7.
        let mut one = EndpointStates::default();
        one.engine_slots_read(ep("10.0.0.1:80"), 2);
        let mut bytes = one.encode();
        assert_eq!(EndpointStates::decode(&bytes), Some(one.clone()));
        assert_eq!(one.engine_slots(ep("10.0.0.1:80")), Some(2));
        assert_eq!(one.engine_slots(ep("10.0.0.2:80")), None);
        bytes[4] = 7;
        assert_eq!(EndpointStates::decode(&bytes), None);
    }

    #[test]
    fn version_8_values_decode_without_the_connection_closes() {
        let t = mixed(40);
        assert!(t.entries.iter().any(|(_, s)| s.closes_after_stream));
        let mut old = t.clone();
        for (_, s) in &mut old.entries {
            s.closes_after_stream = false;
        }
        assert_eq!(EndpointStates::decode(&t.encode_as(8)), Some(old));
        // Each readable scrape says it anew; the bit version 9 added is
        // unknown to version 8.
        let mut one = EndpointStates::default();
        let e = ep("10.0.0.1:80");
        let llamacpp = crate::metrics::Reading {
            closes_after_stream: true,
            ..crate::metrics::Reading::default()
        };
        one.record(e, ScrapeOutcome::Snapshot(llamacpp), 1, FLAP_WINDOW_MS);
        assert!(one.closes_after_stream(e));
        assert!(!one.closes_after_stream(ep("10.0.0.2:80")));
        let mut bytes = one.encode();
        assert_eq!(EndpointStates::decode(&bytes), Some(one.clone()));
        bytes[4] = 8;
        assert_eq!(EndpointStates::decode(&bytes), None);
        one.record(e, ScrapeOutcome::Unreadable, 2, FLAP_WINDOW_MS);
        assert!(one.closes_after_stream(e), "kept without a reading");
        let other = ScrapeOutcome::Snapshot(crate::metrics::Reading::default());
        one.record(e, other, 3, FLAP_WINDOW_MS);
        assert!(
            !one.closes_after_stream(e),
            "another engine answers there now"
        );
    }

    #[test]
    fn a_restart_drops_the_slot_count_the_engine_reported() {
        let mut t = EndpointStates::default();
        let e = ep("10.0.0.1:80");
        let reading = |total: f64| {
            ScrapeOutcome::Snapshot(crate::metrics::Reading {
                prompt_tokens_total: Some(total),
                ..crate::metrics::Reading::default()
            })
        };
        t.record(e, reading(100.0), 1, FLAP_WINDOW_MS);
        t.engine_slots_read(e, 4);
        assert_eq!(
            t.record(e, reading(200.0), 2, FLAP_WINDOW_MS),
            CounterNews::Quiet
        );
        assert_eq!(t.engine_slots(e), Some(4), "kept while the engine runs");
        assert_eq!(
            t.record(e, reading(10.0), 3, FLAP_WINDOW_MS),
            CounterNews::Restarted
        );
        assert_eq!(t.engine_slots(e), None);
    }

    #[test]
    fn a_scrape_no_longer_counts_kvroute_requests_that_finished_since() {
        let mut t = EndpointStates::default();
        let (a, never) = (ep("10.0.0.1:80"), ep("10.0.0.2:80"));
        let snap = MetricsSnapshot {
            waiting: 1.0,
            running: 4.0,
            ..MetricsSnapshot::default()
        };
        t.succeed(a, snap, 1_000);
        t.counted_own(a, 3);
        t.counted_own(never, 3);
        assert_eq!(t.get(never), ScrapeState::default(), "never scraped");
        let now = |own| {
            let s = t.get(a).current(1_040, 2_000, own).unwrap();
            (s.waiting, s.running)
        };
        assert_eq!(now(3), (1.0, 4.0), "all still there");
        assert_eq!(
            now(9),
            (1.0, 4.0),
            "more sent since: the engine counts them later"
        );
        assert_eq!(
            now(2),
            (0.0, 4.0),
            "one ended: the queued one took its slot"
        );
        assert_eq!(
            now(0),
            (0.0, 2.0),
            "three ended: two other clients' are left"
        );
        assert_eq!(t.get(a).current(3_000, 2_000, 0), None, "stale");
        // The next scrape counts afresh.
        t.succeed(a, snap, 1_050);
        t.counted_own(a, 0);
        assert_eq!(t.get(a).current(1_060, 2_000, 0), Some(snap));
    }

    #[test]
    fn the_prefix_hit_counter_of_a_scrape_is_kept_and_travels() {
        let mut t = EndpointStates::default();
        let a = ep("10.0.0.1:80");
        let reading = |hits| {
            ScrapeOutcome::Snapshot(crate::metrics::Reading {
                prefix_hits_total: hits,
                ..crate::metrics::Reading::default()
            })
        };
        t.record(a, reading(Some(640.0)), 1, FLAP_WINDOW_MS);
        assert_eq!(t.get(a).prefix_hits_total, Some(640.0));
        assert_eq!(EndpointStates::decode(&t.encode()).as_ref(), Some(&t));
        t.record(a, ScrapeOutcome::Unreadable, 2, FLAP_WINDOW_MS);
        assert_eq!(t.get(a).prefix_hits_total, Some(640.0), "not a reading");
        t.record(a, reading(None), 3, FLAP_WINDOW_MS);
        assert_eq!(t.get(a).prefix_hits_total, None, "no longer reported");
    }

    #[test]
    fn binary_codec_roundtrips_and_is_compact() {
        for n in [0, 1, 7, 1024] {
            let t = mixed(n);
            let bytes = t.encode();
            assert_eq!(EndpointStates::decode(&bytes).as_ref(), Some(&t), "n={n}");
            if n == 1024 {
                let json = serde_json::to_vec(&t).unwrap();
                assert!(
                    bytes.len() * 3 < json.len(),
                    "{} vs JSON {}",
                    bytes.len(),
                    json.len()
                );
                // 72.5 KiB (the mix has many LoRA lists); a vLLM endpoint
                // with a snapshot and its two counters takes ~80 bytes.
                assert!(bytes.len() < 76 * 1024, "{}", bytes.len());
            }
        }
    }

    #[test]
    fn the_json_an_older_build_wrote_still_decodes() {
        let t = mixed(20);
        let json = serde_json::to_vec(&t).unwrap();
        assert_eq!(EndpointStates::decode(&json), Some(t));
    }

    #[test]
    fn truncated_or_corrupt_binary_decodes_to_none() {
        let bytes = mixed(9).encode();
        for cut in 0..bytes.len() {
            if cut == 0 {
                continue; // empty: not binary, not JSON
            }
            assert_eq!(EndpointStates::decode(&bytes[..cut]), None, "cut at {cut}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(EndpointStates::decode(&long), None, "trailing byte");
        let mut bad_version = bytes.clone();
        bad_version[4] = 99;
        assert_eq!(EndpointStates::decode(&bad_version), None);
        let mut huge_count = bytes.clone();
        huge_count[5..7].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(EndpointStates::decode(&huge_count), None);
        assert_eq!(EndpointStates::decode(b""), None);
    }
}
