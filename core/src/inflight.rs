//! kvroute's own count of what it has sent each endpoint and not yet seen
//! finish: the load between two scrapes. Scrapes arrive every 50 ms, a
//! burst arrives in between; the filter updates this table the moment it
//! routes, so the next request already sees the burst (no herding).
//!
//! Life of one request on endpoint `e` with `u` uncached prompt tokens, at
//! time `t`:
//!
//! ```text
//! route:         add(e, u, t)             requests += 1, tokens += u,
//!                                         waiting += 1 (progress = t if it was 0)
//! first chunk:   first_chunk(e, u, t)     tokens -= u (prefill done), waiting -= 1,
//!                                         progress = t (the endpoint answered)
//! end of stream: finish(e, r, w)          requests -= 1, tokens -= r, waiting -= w
//!                (r = u and w = 1 if the first chunk never came, else 0)
//! ```
//!
//! `waiting` and `progress_ms` are what stall detection reads (see
//! `stall.rs`): requests sent that have not had a response byte yet, and the
//! last time the endpoint answered one (or started being waited on). A
//! request that ends without a response byte (reset, timeout, client gone)
//! is not progress.
//!
//! All arithmetic saturates: a lost or doubled event never underflows nor
//! wraps, and an entry back to zero is dropped, so the table holds at most
//! the endpoints with work outstanding (bounded by the pool after `retain`).
//!
//! The table lives in one proxy-wasm shared-data key, updated with CAS by
//! every worker, so it has a compact binary form ([`InFlightTable::encode`]):
//!
//! ```text
//! "KVIF" u8:version=2 u16:count, then per entry (sorted by endpoint):
//!   u8:family (4|6)  ip (4|16 bytes)  u16:port  u32:requests  u64:tokens
//!   u32:waiting  u64:progress_ms
//! all integers little-endian
//! ```
//!
//! [`InFlightTable::decode`] rejects anything else (`None`), never panics.

use crate::endpoint::Endpoint;
use crate::sorted_lookup::SortedLookup;
use serde::{Deserialize, Serialize};

/// Outstanding work kvroute sent to one endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InFlight {
    /// Requests sent and not finished.
    pub requests: u32,
    /// Uncached prompt tokens sent whose first response chunk has not arrived.
    pub tokens: u64,
    /// Requests sent whose first response chunk has not arrived.
    pub waiting: u32,
    /// Last time (wall ms) the endpoint answered a request with a first
    /// chunk, or started being waited on (`waiting` went from 0 to 1).
    pub progress_ms: u64,
}

impl InFlight {
    /// True when nothing is outstanding (`progress_ms` alone is not kept).
    pub fn is_idle(&self) -> bool {
        self.requests == 0 && self.tokens == 0 && self.waiting == 0
    }
}

/// In-flight work per endpoint (sorted by endpoint; zero entries dropped).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InFlightTable {
    entries: Vec<(Endpoint, InFlight)>,
}

const MAGIC: &[u8; 4] = b"KVIF";
const VERSION: u8 = 2;

impl InFlightTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Outstanding work on `endpoint` (zero when unknown).
    pub fn get(&self, endpoint: &Endpoint) -> InFlight {
        match self.entries.binary_search_by(|(e, _)| e.cmp(endpoint)) {
            Ok(i) => self.entries[i].1,
            Err(_) => InFlight::default(),
        }
    }

    /// [`Self::get`] for a walk over endpoints in ascending order (a
    /// decision's walk over the pool): each lookup resumes where the last
    /// one stopped (`sorted_lookup`); any order is still answered right.
    pub fn lookup(&self) -> impl Fn(&Endpoint) -> InFlight + '_ {
        let cursor = SortedLookup::new(&self.entries, |(e, _)| e);
        move |e| cursor.get(e).map_or_else(InFlight::default, |(_, v)| *v)
    }

    /// Endpoints with outstanding work, in endpoint order.
    pub fn iter(&self) -> impl Iterator<Item = (Endpoint, InFlight)> + '_ {
        self.entries.iter().copied()
    }

    /// Number of endpoints with outstanding work.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is outstanding anywhere.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn update(&mut self, endpoint: Endpoint, f: impl FnOnce(&mut InFlight)) {
        match self.entries.binary_search_by(|(e, _)| e.cmp(&endpoint)) {
            Ok(i) => {
                f(&mut self.entries[i].1);
                if self.entries[i].1.is_idle() {
                    self.entries.remove(i);
                }
            }
            Err(i) => {
                let mut v = InFlight::default();
                f(&mut v);
                if !v.is_idle() {
                    self.entries.insert(i, (endpoint, v));
                }
            }
        }
    }

    /// A request with `tokens` uncached prompt tokens was routed to
    /// `endpoint` at `now_ms`.
    pub fn add(&mut self, endpoint: Endpoint, tokens: u64, now_ms: u64) {
        self.update(endpoint, |v| {
            v.requests = v.requests.saturating_add(1);
            v.tokens = v.tokens.saturating_add(tokens);
            if v.waiting == 0 {
                v.progress_ms = v.progress_ms.max(now_ms);
            }
            v.waiting = v.waiting.saturating_add(1);
        });
    }

    /// The endpoint answered a request at `now_ms` (its first response
    /// chunk): its prompt `tokens` are prefilled, it is no longer waited on.
    pub fn first_chunk(&mut self, endpoint: Endpoint, tokens: u64, now_ms: u64) {
        self.update(endpoint, |v| {
            v.tokens = v.tokens.saturating_sub(tokens);
            v.waiting = v.waiting.saturating_sub(1);
            v.progress_ms = v.progress_ms.max(now_ms);
        });
    }

    /// The request ended (any way). Without a first chunk (reset, timeout,
    /// client gone) `unanswered` is its uncached prompt tokens and it stops
    /// being waited on; after one, pass `None`.
    pub fn finish(&mut self, endpoint: Endpoint, unanswered: Option<u64>) {
        self.update(endpoint, |v| {
            v.requests = v.requests.saturating_sub(1);
            if let Some(tokens) = unanswered {
                v.tokens = v.tokens.saturating_sub(tokens);
                v.waiting = v.waiting.saturating_sub(1);
            }
        });
    }

    /// Drops endpoints that are no longer in the pool.
    pub fn retain(&mut self, pool: &[Endpoint]) {
        self.entries.retain(|(e, _)| pool.contains(e));
    }

    /// The compact binary form (see the module comment).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(7 + self.entries.len() * 43);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        let n = self.entries.len().min(u16::MAX as usize);
        out.extend_from_slice(&(n as u16).to_le_bytes());
        for (e, v) in self.entries.iter().take(n) {
            e.encode_into(&mut out);
            out.extend_from_slice(&v.requests.to_le_bytes());
            out.extend_from_slice(&v.tokens.to_le_bytes());
            out.extend_from_slice(&v.waiting.to_le_bytes());
            out.extend_from_slice(&v.progress_ms.to_le_bytes());
        }
        out
    }

    /// Reads [`encode`](Self::encode)'s output; `None` for anything else
    /// (wrong magic or version, truncated, trailing bytes, unsorted or
    /// duplicate endpoints, port 0, zero entries).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader(bytes);
        if r.take(4)? != MAGIC || r.take(1)?[0] != VERSION {
            return None;
        }
        let n = u16::from_le_bytes(r.array()?) as usize;
        let mut entries: Vec<(Endpoint, InFlight)> = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let e = Endpoint::decode_from(&mut r.0)?;
            let v = InFlight {
                requests: u32::from_le_bytes(r.array()?),
                tokens: u64::from_le_bytes(r.array()?),
                waiting: u32::from_le_bytes(r.array()?),
                progress_ms: u64::from_le_bytes(r.array()?),
            };
            if v.is_idle() || entries.last().is_some_and(|(last, _)| *last >= e) {
                return None;
            }
            entries.push((e, v));
        }
        if !r.0.is_empty() {
            return None;
        }
        Some(InFlightTable { entries })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    type Step = (
        &'static str,
        Box<dyn Fn(&mut InFlightTable)>,
        (u32, u64, u32),
        (u32, u64, u32),
    );

    fn ep(s: &str) -> Endpoint {
        s.parse().unwrap()
    }

    fn view(v: InFlight) -> (u32, u64, u32) {
        (v.requests, v.tokens, v.waiting)
    }

    #[test]
    fn lifecycle_table() {
        let a = ep("10.0.0.1:8000");
        let b = ep("[::1]:9000");
        let mut t = InFlightTable::new();
        // (step, endpoint a after, endpoint b after): (requests, tokens, waiting)
        let steps: Vec<Step> = vec![
            (
                "add a",
                Box::new(move |t| t.add(a, 100, 1)),
                (1, 100, 1),
                (0, 0, 0),
            ),
            (
                "add a",
                Box::new(move |t| t.add(a, 50, 2)),
                (2, 150, 2),
                (0, 0, 0),
            ),
            (
                "add b",
                Box::new(move |t| t.add(b, 0, 3)),
                (2, 150, 2),
                (1, 0, 1),
            ),
            (
                "chunk a",
                Box::new(move |t| t.first_chunk(a, 100, 4)),
                (2, 50, 1),
                (1, 0, 1),
            ),
            (
                "end a",
                Box::new(move |t| t.finish(a, None)),
                (1, 50, 1),
                (1, 0, 1),
            ),
            (
                "end a unanswered",
                Box::new(move |t| t.finish(a, Some(50))),
                (0, 0, 0),
                (1, 0, 1),
            ),
            (
                "double end a",
                Box::new(move |t| t.finish(a, Some(999))),
                (0, 0, 0),
                (1, 0, 1),
            ),
            (
                "chunk b",
                Box::new(move |t| t.first_chunk(b, 7, 5)),
                (0, 0, 0),
                (1, 0, 0),
            ),
            (
                "end b",
                Box::new(move |t| t.finish(b, None)),
                (0, 0, 0),
                (0, 0, 0),
            ),
        ];
        for (what, f, wa, wb) in steps {
            f(&mut t);
            assert_eq!(view(t.get(&a)), wa, "{what}");
            assert_eq!(view(t.get(&b)), wb, "{what}");
        }
        assert!(t.is_empty());
    }

    #[test]
    fn progress_marks_answers_and_the_start_of_waiting_only() {
        let a = ep("10.0.0.1:8000");
        let mut t = InFlightTable::new();
        t.add(a, 0, 100);
        assert_eq!(t.get(&a).progress_ms, 100, "waiting starts");
        t.add(a, 0, 200);
        assert_eq!(t.get(&a).progress_ms, 100, "already waited on");
        t.finish(a, Some(0));
        assert_eq!(
            t.get(&a).progress_ms,
            100,
            "an unanswered end is no progress"
        );
        t.first_chunk(a, 0, 300);
        assert_eq!(t.get(&a).progress_ms, 300, "an answer is progress");
        assert_eq!(t.get(&a).waiting, 0);
        t.add(a, 0, 250);
        assert_eq!(t.get(&a).progress_ms, 300, "never goes back in time");
    }

    #[test]
    fn saturates_at_the_top() {
        let a = ep("10.0.0.1:8000");
        let mut t = InFlightTable::new();
        t.add(a, u64::MAX, 0);
        t.add(a, 5, 0);
        assert_eq!(t.get(&a).tokens, u64::MAX);
    }

    #[test]
    fn retain_drops_endpoints_outside_the_pool() {
        let (a, b) = (ep("10.0.0.1:8000"), ep("10.0.0.2:8000"));
        let mut t = InFlightTable::new();
        t.add(a, 1, 0);
        t.add(b, 1, 0);
        t.retain(&[b]);
        assert_eq!(t.iter().map(|(e, _)| e).collect::<Vec<_>>(), vec![b]);
    }

    #[test]
    fn codec_roundtrip() {
        let mut t = InFlightTable::new();
        assert_eq!(InFlightTable::decode(&t.encode()), Some(t.clone()));
        t.add(ep("10.0.0.2:8000"), 7, 5);
        t.add(ep("10.0.0.1:8001"), u64::MAX, u64::MAX);
        t.add(ep("[2001:db8::1]:443"), 0, 0);
        let bytes = t.encode();
        assert_eq!(bytes.len(), 7 + 2 * 31 + 43);
        assert_eq!(InFlightTable::decode(&bytes), Some(t));
    }

    #[test]
    fn codec_rejects_garbage_without_panicking() {
        let mut t = InFlightTable::new();
        t.add(ep("10.0.0.1:8000"), 3, 1);
        t.add(ep("10.0.0.2:8000"), 4, 1);
        let good = t.encode();
        for cut in 0..good.len() {
            assert_eq!(InFlightTable::decode(&good[..cut]), None, "cut {cut}");
        }
        let mut trailing = good.clone();
        trailing.push(0);
        let mut magic = good.clone();
        magic[0] = b'X';
        let mut version = good.clone();
        version[4] = 9;
        let mut family = good.clone();
        family[7] = 5;
        let mut port0 = good.clone();
        port0[12] = 0;
        port0[13] = 0;
        let mut unsorted = good.clone();
        unsorted[7 + 4] = 9; // first ip becomes 10.0.0.9 > 10.0.0.2
        let mut idle = good.clone();
        idle[14..30].fill(0);
        for (what, b) in [
            ("trailing", trailing),
            ("magic", magic),
            ("version", version),
            ("family", family),
            ("port 0", port0),
            ("unsorted", unsorted),
            ("idle entry", idle),
            ("empty", vec![]),
        ] {
            assert_eq!(InFlightTable::decode(&b), None, "{what}");
        }
        let mut rng = fastrand::Rng::with_seed(1);
        for _ in 0..2000 {
            let mut b = good.clone();
            b[rng.usize(..good.len())] = rng.u8(..);
            let _ = InFlightTable::decode(&b);
            let len = rng.usize(..64);
            let junk: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
            let _ = InFlightTable::decode(&junk);
        }
    }
}
