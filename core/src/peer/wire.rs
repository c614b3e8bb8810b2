//! The sync wire: the query a replica sends a peer and the answer.
//!
//! Query: `GET /kvroute/peer/v1/log?replica=<hex>&since=<seq>&max_bytes=<n>[&refusals=1]`,
//! `replica` being the id the asker last heard from this peer (absent the
//! first time), `since` the sequence number to read from, and `refusals=1`
//! asking for the decision log's `forget` entries too. An asker sends
//! `refusals=1` only to a peer whose last answer carried the header
//! [`super::REFUSALS_HEADER`]: a build from before refusals refuses a
//! query with a parameter it does not know, and drops a whole answer
//! holding an entry it cannot decode, so neither ever meets one.
//!
//! Answer (`application/octet-stream`, little-endian):
//!
//! ```text
//! "KVPS" u8 version = 1
//! u64 replica     the answering replica's id
//! u64 next        the cursor to ask with next time
//! u64 skipped     decisions between `since` and the first one read that the ring lost
//! u32 len, len bytes   the answering replica's in-flight table (`inflight.rs` encoding)
//! u32 n, then n x (u32 len, len bytes)   decisions (`decision_log.rs` encoding)
//! ```
//!
//! [`SyncAnswer::decode`] checks every length against the bytes present
//! before allocating and rejects anything else (`None`).

use crate::inflight::InFlightTable;
use crate::shared::decision_log::LogEntry;

const MAGIC: &[u8; 4] = b"KVPS";
const VERSION: u8 = 1;
/// Smallest encoded decision with its length prefix (IPv4, no blocks).
const MIN_ENTRY_BYTES: usize = 4 + 3 + 4 + 2 + 8 + 8 + 4;
/// Bytes of the answer before its entries, besides the in-flight table.
const HEADER_BYTES: usize = 4 + 1 + 8 + 8 + 8 + 4 + 4;

/// What a replica asks a peer for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncQuery {
    /// The peer's id as last heard (`None`: first contact).
    pub replica: Option<u64>,
    /// First sequence number wanted.
    pub since: u64,
    /// Largest answer the asker reads.
    pub max_bytes: usize,
    /// Also send refusals (`forget` entries): the asker takes them.
    pub refusals: bool,
}

impl SyncQuery {
    /// The request path (`SYNC_PATH` and the query string).
    pub fn to_path(&self) -> String {
        let mut p = format!(
            "{}?since={}&max_bytes={}",
            super::SYNC_PATH,
            self.since,
            self.max_bytes
        );
        if let Some(r) = self.replica {
            p.push_str("&replica=");
            p.push_str(&super::format_replica(r));
        }
        if self.refusals {
            p.push_str("&refusals=1");
        }
        p
    }

    /// Parses a request path; `None` unless it is `SYNC_PATH` with a valid
    /// query (unknown or repeated parameters are refused).
    pub fn from_path(path: &str) -> Option<SyncQuery> {
        let (p, q) = path.split_once('?').unwrap_or((path, ""));
        if p != super::SYNC_PATH {
            return None;
        }
        let (mut replica, mut since, mut max_bytes, mut refusals) = (None, None, None, None);
        for pair in q.split('&').filter(|s| !s.is_empty()) {
            let (k, v) = pair.split_once('=')?;
            let slot_was_empty = match k {
                "replica" => replica.replace(super::parse_replica(v)?).is_none(),
                "since" => since.replace(v.parse::<u64>().ok()?).is_none(),
                "max_bytes" => max_bytes.replace(v.parse::<usize>().ok()?).is_none(),
                "refusals" => refusals
                    .replace(match v {
                        "0" => false,
                        "1" => true,
                        _ => return None,
                    })
                    .is_none(),
                _ => return None,
            };
            if !slot_was_empty {
                return None;
            }
        }
        Some(SyncQuery {
            replica,
            since: since.unwrap_or(0),
            max_bytes: max_bytes?,
            refusals: refusals.unwrap_or(false),
        })
    }
}

/// Where an answer starts reading a ring whose next sequence number is
/// `head` and which holds `slots` entries: `(start, skipped)`. A query for
/// another replica id (first contact, or this replica restarted) or a cursor
/// past the head starts at the oldest entry held, with nothing counted as
/// skipped; a cursor the ring has lost resumes at the oldest, counting the gap.
pub fn plan_read(query: &SyncQuery, own: u64, head: u64, slots: u64) -> (u64, u64) {
    let oldest = head.saturating_sub(slots);
    if query.replica != Some(own) || query.since > head {
        return (oldest, 0);
    }
    if query.since < oldest {
        (oldest, oldest - query.since)
    } else {
        (query.since, 0)
    }
}

/// A peer's answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncAnswer {
    /// The answering replica's id.
    pub replica: u64,
    /// Cursor for the next query.
    pub next: u64,
    /// Decisions the answering ring lost before they could be sent.
    pub skipped: u64,
    /// The answering replica's in-flight work (its own requests only).
    pub inflight: InFlightTable,
    /// Its decisions, in sequence order (its own only).
    pub entries: Vec<LogEntry>,
}

/// Builds an answer within a byte budget, entry by entry.
#[derive(Debug)]
pub struct AnswerBuilder {
    bytes: Vec<u8>,
    skipped: u64,
    count: u32,
    count_at: usize,
    max_bytes: usize,
}

impl AnswerBuilder {
    /// Starts an answer; `max_bytes` bounds the whole encoding (the header
    /// and in-flight table always fit: they are written even past it).
    pub fn new(replica: u64, skipped: u64, inflight: &InFlightTable, max_bytes: usize) -> Self {
        let table = inflight.encode();
        let mut bytes = Vec::with_capacity(HEADER_BYTES + table.len());
        bytes.extend_from_slice(MAGIC);
        bytes.push(VERSION);
        bytes.extend_from_slice(&replica.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes()); // next, set by finish
        bytes.extend_from_slice(&0u64.to_le_bytes()); // skipped, set by finish
        bytes.extend_from_slice(&(table.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&table);
        let count_at = bytes.len();
        bytes.extend_from_slice(&0u32.to_le_bytes());
        AnswerBuilder {
            bytes,
            skipped,
            count: 0,
            count_at,
            max_bytes,
        }
    }

    /// Adds an encoded decision; false (nothing added) when it would not fit.
    pub fn push(&mut self, entry: &[u8]) -> bool {
        if self.bytes.len() + 4 + entry.len() > self.max_bytes || self.count == u32::MAX {
            return false;
        }
        self.bytes
            .extend_from_slice(&(entry.len() as u32).to_le_bytes());
        self.bytes.extend_from_slice(entry);
        self.count += 1;
        true
    }

    /// Counts a decision that cannot be sent (larger than the whole budget).
    pub fn skip(&mut self) {
        self.skipped += 1;
    }

    /// Decisions added so far.
    pub fn len(&self) -> usize {
        self.count as usize
    }

    /// True when no decision was added.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The encoded answer, telling the asker to resume at `next`.
    pub fn finish(mut self, next: u64) -> Vec<u8> {
        self.bytes[13..21].copy_from_slice(&next.to_le_bytes());
        self.bytes[21..29].copy_from_slice(&self.skipped.to_le_bytes());
        let at = self.count_at;
        self.bytes[at..at + 4].copy_from_slice(&self.count.to_le_bytes());
        self.bytes
    }
}

impl SyncAnswer {
    /// The encoding (module doc); every entry is included.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = AnswerBuilder::new(self.replica, self.skipped, &self.inflight, usize::MAX);
        for e in &self.entries {
            b.push(&e.encode());
        }
        b.finish(self.next)
    }

    /// Parses [`SyncAnswer::encode`]'s output; `None` for anything else,
    /// including a single undecodable entry.
    pub fn decode(bytes: &[u8]) -> Option<SyncAnswer> {
        let mut r = bytes;
        if take(&mut r, 4)? != MAGIC || take(&mut r, 1)? != [VERSION] {
            return None;
        }
        let replica = u64_le(take(&mut r, 8)?);
        let next = u64_le(take(&mut r, 8)?);
        let skipped = u64_le(take(&mut r, 8)?);
        let len = u32_le(take(&mut r, 4)?) as usize;
        let inflight = InFlightTable::decode(take(&mut r, len)?)?;
        let n = u32_le(take(&mut r, 4)?) as usize;
        // Each entry takes at least its length prefix and the smallest
        // decision: a lying count cannot reserve more than the bytes allow.
        let mut entries = Vec::with_capacity(n.min(r.len() / MIN_ENTRY_BYTES));
        for _ in 0..n {
            let len = u32_le(take(&mut r, 4)?) as usize;
            entries.push(LogEntry::decode(take(&mut r, len)?)?);
        }
        if !r.is_empty() {
            return None;
        }
        Some(SyncAnswer {
            replica,
            next,
            skipped,
            inflight,
            entries,
        })
    }
}

fn take<'a>(r: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if r.len() < n {
        return None;
    }
    let (head, rest) = r.split_at(n);
    *r = rest;
    Some(head)
}

fn u64_le(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    u64::from_le_bytes(a)
}

fn u32_le(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(b);
    u32::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn entry(seq: u64, ep: &str, blocks: Vec<u64>) -> LogEntry {
        LogEntry {
            seq,
            endpoint: ep.parse().unwrap(),
            at_ms: 1_000 + seq,
            blocks,
            from_peer: false,
            forget: false,
        }
    }

    fn answer() -> SyncAnswer {
        let mut inflight = InFlightTable::new();
        inflight.add("10.0.0.1:8000".parse().unwrap(), 300, 5);
        SyncAnswer {
            replica: 0xfeed_beef,
            next: 42,
            skipped: 3,
            inflight,
            entries: vec![
                entry(40, "10.0.0.1:8000", vec![1, 2, 3]),
                entry(41, "[::1]:9000", vec![]),
            ],
        }
    }

    #[test]
    fn query_roundtrips_and_refuses_junk() {
        for q in [
            SyncQuery {
                replica: None,
                since: 0,
                max_bytes: 4096,
                refusals: false,
            },
            SyncQuery {
                replica: Some(u64::MAX),
                since: u64::MAX,
                max_bytes: 1 << 22,
                refusals: true,
            },
        ] {
            assert_eq!(SyncQuery::from_path(&q.to_path()), Some(q));
        }
        // What a build from before refusals asks.
        assert_eq!(
            SyncQuery::from_path("/kvroute/peer/v1/log?since=3&max_bytes=9").map(|q| q.refusals),
            Some(false)
        );
        for bad in [
            "/kvroute/peer/v1/log",
            "/kvroute/peer/v1/logx?max_bytes=1",
            "/v1/chat/completions?max_bytes=1",
            "/kvroute/peer/v1/log?max_bytes=1&max_bytes=2",
            "/kvroute/peer/v1/log?max_bytes=1&since=-1",
            "/kvroute/peer/v1/log?max_bytes=1&replica=xyz",
            "/kvroute/peer/v1/log?max_bytes=1&replica=1",
            "/kvroute/peer/v1/log?max_bytes=1&evil=1",
            "/kvroute/peer/v1/log?max_bytes=1&refusals=yes",
            "/kvroute/peer/v1/log?max_bytes=1&refusals=1&refusals=1",
            "/kvroute/peer/v1/log?max_bytes",
        ] {
            assert_eq!(SyncQuery::from_path(bad), None, "{bad}");
        }
    }

    #[test]
    fn plan_resumes_restarts_and_counts_gaps() {
        let q = |replica, since| SyncQuery {
            replica,
            since,
            max_bytes: 1,
            refusals: false,
        };
        // (query, own id, head, slots) -> (start, skipped)
        let cases = [
            (q(Some(7), 90), 7, 100, 512, (90, 0)),      // resume
            (q(Some(7), 100), 7, 100, 512, (100, 0)),    // up to date
            (q(None, 0), 7, 1000, 512, (488, 0)),        // first contact: the ring
            (q(Some(8), 990), 7, 1000, 512, (488, 0)),   // this replica restarted
            (q(Some(7), 2000), 7, 1000, 512, (488, 0)),  // cursor from the future
            (q(Some(7), 100), 7, 1000, 512, (488, 388)), // slow asker: gap counted
        ];
        for (query, own, head, slots, want) in cases {
            assert_eq!(plan_read(&query, own, head, slots), want, "{query:?}");
        }
    }

    #[test]
    fn answer_roundtrips() {
        let a = answer();
        assert_eq!(SyncAnswer::decode(&a.encode()), Some(a));
        let empty = SyncAnswer::default();
        assert_eq!(SyncAnswer::decode(&empty.encode()), Some(empty));
    }

    #[test]
    fn builder_stays_within_the_budget() {
        let inflight = InFlightTable::new();
        let e = entry(1, "10.0.0.1:8000", (0..100).collect()).encode();
        let mut b = AnswerBuilder::new(1, 0, &inflight, 2048);
        while b.push(&e) {}
        assert_eq!(b.len(), 2, "two 830-byte entries fit in 2 KiB");
        b.skip();
        let bytes = b.finish(9);
        assert!(bytes.len() <= 2048);
        let a = SyncAnswer::decode(&bytes).unwrap();
        assert_eq!((a.next, a.skipped, a.entries.len()), (9, 1, 2));
    }

    #[test]
    fn garbage_and_truncations_decode_to_none() {
        let good = answer().encode();
        for i in 0..good.len() {
            assert_eq!(SyncAnswer::decode(&good[..i]), None, "truncated at {i}");
        }
        let mut longer = good.clone();
        longer.push(0);
        assert_eq!(SyncAnswer::decode(&longer), None);
        let mut lying = SyncAnswer::default().encode();
        let n = lying.len() - 4;
        lying[n..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(SyncAnswer::decode(&lying), None);
        for junk in [&b""[..], b"KVPS", b"GET / HTTP/1.1\r\n\r\n", &[0xff; 64]] {
            assert_eq!(SyncAnswer::decode(junk), None);
        }
    }
}
