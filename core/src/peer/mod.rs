//! Active-active: several kvroute gateways (replicas behind one Service)
//! sharing one prefix view and one in-flight view, with no external store.
//!
//! Each replica serves its own recent decisions on a peer listener that is
//! not the public one, and pulls its peers' every `peers.sync_interval_ms`
//! (only the VM holding the scraper lease does, through the Envoy cluster
//! `peers.cluster`, member by member: Envoy keeps discovery, mTLS and
//! health). What a replica learns goes into its own decision log marked
//! `from_peer`, so all its workers learn it and it is never served again
//! (no echo, no loops). Refusals (the decision log's `forget` entries)
//! travel the same way, but only to an asker that asks for them, and an
//! asker asks only a peer that offers them ([`REFUSALS_HEADER`]): a build
//! from before them refuses the query and drops the whole answer.
//!
//! ```text
//!  replica A (lease VM, every sync_interval_ms)           replica B (any worker VM, peer listener)
//!  GET /kvroute/peer/v1/log?replica=<B's id>&since=<n>&max_bytes=<m>  ──▶  wire::plan_read: where to start
//!                                                                     reads its ring from there:
//!                                                                     own decisions only, bounded
//!  ◀── wire::SyncAnswer { replica, next, skipped, in-flight, entries }
//!  intake::accept: unknown endpoints, oversized entries dropped (counted)
//!  append to A's log (from_peer) ─▶ every worker of A replays them
//!  table::PeerTable (shared data): cursor, last heard, B's in-flight
//! ```
//!
//! **Cursor.** The cursor is B's sequence number, valid only for the replica
//! id it came with. A replica id is random per Envoy process, so a restarted
//! peer has a new id and its old cursor is dropped. A cursor the peer's ring
//! no longer holds resumes at the oldest entry held, and the gap is reported
//! (`skipped`) and counted: a slow or restarted peer catches up on at most
//! one ring (`shared.log_slots`) and never replays unbounded history.
//!
//! **Safety.** Nothing from a peer is trusted: answers larger than
//! `peers.max_response_bytes` are not read, malformed ones are counted and
//! ignored, and entries naming an endpoint outside the pool (or with more
//! blocks than a prompt can have) are dropped. A peer only ever adds
//! affinity hints (or withdraws its own, for a refusal: the index only
//! shrinks) and load counts; every decision still filters and scores the
//! pool. Sync runs on the tick, never on a request's path.

pub mod intake;
pub mod table;
pub mod wire;

/// Path of the sync endpoint on the peer listener.
pub const SYNC_PATH: &str = "/kvroute/peer/v1/log";

/// Response header of a sync answer (value `1`) by a replica that serves
/// refusals to an asker that asks (`refusals=1`, `wire`).
pub const REFUSALS_HEADER: &str = "x-kvroute-peer-refusals";

/// A replica id as written on the wire (16 lowercase hex digits).
pub fn format_replica(id: u64) -> String {
    format!("{id:016x}")
}

/// Parses [`format_replica`]'s output.
pub fn parse_replica(s: &str) -> Option<u64> {
    if s.len() != 16 {
        return None;
    }
    u64::from_str_radix(s, 16).ok()
}
