//! Typed access to the proxy-wasm shared data kvroute keeps, so every Envoy
//! worker (each its own VM) sees one view. All keys start with
//! `shared.key_prefix` and their number is fixed by the configuration:
//!
//! | key | value | written by |
//! |---|---|---|
//! | `lease` | scraper lease (16 bytes) | every VM's tick, CAS |
//! | `pool` | discovered members (JSON list) | the lease holder (discovery on) |
//! | `endpoints` | scrape state of the pool (binary, `EndpointStates::encode`) | the lease holder (one update per batch of answers); any worker whose request the chosen endpoint did not answer; CAS |
//! | `inflight` | in-flight requests/tokens/waiting per endpoint | every request (route, first chunk, end), CAS |
//! | `outliers` | passive-health streaks and ejections | 5xx responses (and the success after one), CAS |
//! | `log/head` | next decision-log sequence number | every decision, CAS |
//! | `log/<slot>` | one decision (endpoint + block hashes), own or a peer's | its appender |
//! | `replica` | this gateway's replica id (random per Envoy process) | the first VM |
//! | `peers` | peers' cursors, last answer and in-flight work (JSON) | the lease holder (peers on), CAS |
//!
//! Shared data never expires and has no delete, so nothing here is keyed by
//! traffic: the decision log is a ring of `shared.log_slots` slots. CAS is
//! ignored by the host when a key does not exist yet, so [`SharedStore::create_keys`]
//! creates every CAS key before first use.

use kvroute_core::discovery::{decode_pool, encode_pool};
use kvroute_core::endpoint::Endpoint;
use kvroute_core::inflight::InFlightTable;
use kvroute_core::outlier::OutlierTable;
use kvroute_core::peer::table::PeerTable;
use kvroute_core::peer::wire::AnswerBuilder;
use kvroute_core::shared::decision_log::{slot_of, LogCursor, LogEntry, STALL_SKIP};
use kvroute_core::shared::endpoint_state::EndpointStates;
use kvroute_core::shared::lease::Lease;
use proxy_wasm::hostcalls::{get_shared_data, set_shared_data};
use proxy_wasm::types::Status;

/// CAS retries before an update is given up (contention is brief: the host
/// holds one global mutex per get/set).
const CAS_ATTEMPTS: usize = 16;

/// Shared-data keys of one plugin configuration.
#[derive(Debug)]
pub struct SharedStore {
    lease: String,
    pool: String,
    endpoints: String,
    inflight: String,
    outliers: String,
    log_head: String,
    log_slot: String,
    log_slots: u32,
    replica: String,
    peers: String,
}

/// Entries replayed by [`SharedStore::read_log`], and how many were lost.
#[derive(Debug, Default)]
pub struct LogRead {
    /// Entries in sequence order.
    pub entries: Vec<LogEntry>,
    /// Entries overwritten before they could be read.
    pub lost: u64,
    /// The log head as read (value and CAS token): an append right after
    /// the read tries it first and saves reading the head again.
    pub head: Option<Snapshot<u64>>,
}

/// A shared value as read, with the CAS token that proves it unchanged.
#[derive(Debug, Clone, Copy, Default)]
pub struct Snapshot<T> {
    /// The decoded value.
    pub value: T,
    /// The host's CAS token (`None`: the key did not exist).
    pub cas: Option<u32>,
}

/// The log head's value (0 when unreadable).
fn decode_head(v: &[u8]) -> u64 {
    v.get(..8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0)
}

fn get(key: &str) -> (Option<Vec<u8>>, Option<u32>) {
    get_shared_data(key).unwrap_or((None, None))
}

/// A decoded value (default when absent or undecodable).
fn read_value<T: Default>(key: &str, decode: fn(&[u8]) -> Option<T>) -> T {
    get(key).0.and_then(|v| decode(&v)).unwrap_or_default()
}

impl SharedStore {
    /// Keys under `prefix`, with a decision log of `log_slots` slots.
    pub fn new(prefix: &str, log_slots: u32) -> SharedStore {
        SharedStore {
            lease: format!("{prefix}lease"),
            pool: format!("{prefix}pool"),
            endpoints: format!("{prefix}endpoints"),
            inflight: format!("{prefix}inflight"),
            outliers: format!("{prefix}outliers"),
            log_head: format!("{prefix}log/head"),
            log_slot: format!("{prefix}log/"),
            log_slots,
            replica: format!("{prefix}replica"),
            peers: format!("{prefix}peers"),
        }
    }

    /// Creates absent CAS keys with empty values (a benign race at start-up:
    /// two VMs creating the same key both write the same empty value).
    pub fn create_keys(&self) {
        for (key, empty) in [
            (&self.lease, Vec::new()),
            (&self.endpoints, EndpointStates::default().encode()),
            (&self.inflight, InFlightTable::default().encode()),
            (&self.outliers, OutlierTable::default().encode()),
            (&self.log_head, 0u64.to_le_bytes().to_vec()),
            (&self.peers, PeerTable::default().encode()),
        ] {
            if get(key).1.is_none() {
                let _ = set_shared_data(key, Some(&empty), None);
            }
        }
    }

    /// Read-modify-write with CAS; `f` returns the new value or `None` to
    /// leave it. Returns whether a write happened.
    fn update(&self, key: &str, mut f: impl FnMut(Option<&[u8]>) -> Option<Vec<u8>>) -> bool {
        for _ in 0..CAS_ATTEMPTS {
            let (value, cas) = get(key);
            let Some(new) = f(value.as_deref()) else {
                return false;
            };
            match set_shared_data(key, Some(&new), cas) {
                Ok(()) => return true,
                Err(Status::CasMismatch) => continue,
                Err(_) => return false,
            }
        }
        false
    }

    /// Takes or renews the scraper lease; true when this VM holds it.
    pub fn claim_lease(&self, me: u64, now_ms: u64, ttl_ms: u64) -> bool {
        self.update(&self.lease, |cur| {
            Lease::claim(cur, me, now_ms, ttl_ms).map(|l| l.encode().to_vec())
        })
    }

    /// The discovered pool, if discovery has published one.
    pub fn pool(&self) -> Option<Vec<Endpoint>> {
        get(&self.pool).0.and_then(|v| decode_pool(&v))
    }

    /// Publishes the discovered pool (only when it changed).
    pub fn set_pool(&self, pool: &[Endpoint]) {
        if self.pool().as_deref() != Some(pool) {
            let _ = set_shared_data(&self.pool, Some(&encode_pool(pool)), None);
        }
    }

    /// The pool's scrape state.
    pub fn endpoint_states(&self) -> EndpointStates {
        read_value(&self.endpoints, EndpointStates::decode)
    }

    /// Updates the pool's scrape state.
    pub fn update_endpoint_states(&self, f: impl FnMut(&mut EndpointStates)) -> EndpointStates {
        self.update_value(
            &self.endpoints,
            EndpointStates::decode,
            EndpointStates::encode,
            f,
        )
    }

    /// In-flight accounting of all workers.
    pub fn inflight(&self) -> InFlightTable {
        read_value(&self.inflight, InFlightTable::decode)
    }

    /// In-flight accounting with its CAS token, for [`Self::commit_inflight`].
    pub fn inflight_snapshot(&self) -> Snapshot<InFlightTable> {
        let (bytes, cas) = get(&self.inflight);
        Snapshot {
            value: bytes
                .and_then(|v| InFlightTable::decode(&v))
                .unwrap_or_default(),
            cas,
        }
    }

    /// Applies `f` to a table read by [`Self::inflight_snapshot`] and writes
    /// it if no VM changed the table since (one host call): `Ok`. `Err`
    /// with the table as it is now when one did, nothing written: a
    /// decision made on the old table did not see that change.
    pub fn commit_inflight(
        &self,
        snapshot: Snapshot<InFlightTable>,
        f: impl FnOnce(&mut InFlightTable),
    ) -> Result<(), Snapshot<InFlightTable>> {
        let mut table = snapshot.value;
        f(&mut table);
        // Absent keys ignore CAS (`set_shared_data` without a token
        // writes): only a token read proves the table unchanged.
        match snapshot.cas {
            Some(cas)
                if set_shared_data(&self.inflight, Some(&table.encode()), Some(cas)).is_ok() =>
            {
                Ok(())
            }
            _ => Err(self.inflight_snapshot()),
        }
    }

    /// Updates the in-flight accounting; returns the table written.
    pub fn update_inflight(&self, f: impl FnMut(&mut InFlightTable)) -> InFlightTable {
        self.update_value(
            &self.inflight,
            InFlightTable::decode,
            InFlightTable::encode,
            f,
        )
    }

    /// Passive-health state of the pool (all workers' responses).
    pub fn outliers(&self) -> OutlierTable {
        read_value(&self.outliers, OutlierTable::decode)
    }

    /// Updates the passive-health state; returns the table written.
    pub fn update_outliers(&self, f: impl FnMut(&mut OutlierTable)) -> OutlierTable {
        self.update_value(
            &self.outliers,
            OutlierTable::decode,
            OutlierTable::encode,
            f,
        )
    }

    /// CAS read-modify-write of a decoded value (undecodable counts as
    /// default); returns the value written.
    fn update_value<T: Default>(
        &self,
        key: &str,
        decode: fn(&[u8]) -> Option<T>,
        encode: fn(&T) -> Vec<u8>,
        mut f: impl FnMut(&mut T),
    ) -> T {
        let mut out = T::default();
        self.update(key, |cur| {
            let mut value = cur.and_then(decode).unwrap_or_default();
            f(&mut value);
            let bytes = encode(&value);
            out = value;
            Some(bytes)
        });
        out
    }

    /// This gateway's replica id: the first VM to ask draws it (`fresh`),
    /// every VM reads the same value afterwards.
    pub fn replica_id(&self, fresh: impl FnOnce() -> u64) -> u64 {
        let read = || {
            get(&self.replica)
                .0
                .and_then(|v| v.get(..8).and_then(|b| b.try_into().ok()))
                .map(u64::from_le_bytes)
        };
        if let Some(id) = read() {
            return id;
        }
        // Absent keys ignore CAS: two first VMs may both write; both then
        // read the value that stayed.
        let _ = set_shared_data(&self.replica, Some(&fresh().to_le_bytes()), None);
        read().unwrap_or(0)
    }

    /// What this replica knows of its peers.
    pub fn peer_table(&self) -> PeerTable {
        read_value(&self.peers, PeerTable::decode)
    }

    /// Updates the peer table; returns the table written.
    pub fn update_peer_table(&self, f: impl FnMut(&mut PeerTable)) -> PeerTable {
        self.update_value(&self.peers, PeerTable::decode, PeerTable::encode, f)
    }

    /// Next sequence number of the decision log, and its number of slots.
    pub fn log_extent(&self) -> (u64, u64) {
        (self.head(), u64::from(self.log_slots))
    }

    /// Adds this replica's own decisions from sequence number `start` to
    /// `answer` (peers' decisions are never served again), and its refusals
    /// (`forget` entries) when the asker takes them, up to `max_entries` or
    /// the answer's byte budget; returns where the next read starts. A
    /// decision larger than the whole budget, or lost to the ring, is
    /// counted as skipped.
    pub fn serve_log(
        &self,
        start: u64,
        max_entries: usize,
        refusals: bool,
        answer: &mut AnswerBuilder,
    ) -> u64 {
        let head = self.head();
        let mut next = start;
        while next < head && answer.len() < max_entries {
            let key = self.slot_key(next);
            let value = get(&key).0;
            match value.as_deref().map(|v| (LogEntry::decode(v), v)) {
                Some((Some(e), raw)) if e.seq == next => {
                    // Refusals only to an asker that takes them
                    // (`decision_log`: older peers would drop the whole
                    // answer).
                    let serve = !e.from_peer && (refusals || !e.forget);
                    if serve && !answer.push(raw) {
                        if !answer.is_empty() {
                            break; // the rest goes in the next answer
                        }
                        answer.skip();
                    }
                }
                Some((Some(e), _)) if e.seq > next => answer.skip(),
                // Reserved but not written yet: stop here (unless its writer
                // must have failed).
                _ if head - next <= STALL_SKIP => break,
                _ => answer.skip(),
            }
            next += 1;
        }
        next
    }

    /// The shared-data key of the ring slot holding sequence number `seq`.
    fn slot_key(&self, seq: u64) -> String {
        format!("{}{}", self.log_slot, slot_of(seq, self.log_slots))
    }

    fn head(&self) -> u64 {
        self.head_snapshot().value
    }

    fn head_snapshot(&self) -> Snapshot<u64> {
        let (bytes, cas) = get(&self.log_head);
        Snapshot {
            value: bytes.as_deref().map(decode_head).unwrap_or(0),
            cas,
        }
    }

    /// Appends a decision; returns its sequence number. `head`, the log
    /// head as [`Self::read_log`] just read it, is tried first: when no
    /// other VM appended since, the slot is reserved without reading the
    /// head again.
    pub fn append_log(&self, entry: &mut LogEntry, head: Option<Snapshot<u64>>) -> Option<u64> {
        let mut seq = 0;
        let fast = head.filter(|h| h.cas.is_some()).is_some_and(|h| {
            seq = h.value;
            set_shared_data(&self.log_head, Some(&(seq + 1).to_le_bytes()), h.cas).is_ok()
        });
        let reserved = fast
            || self.update(&self.log_head, |cur| {
                seq = cur.map(decode_head).unwrap_or(0);
                Some((seq + 1).to_le_bytes().to_vec())
            });
        if !reserved {
            return None;
        }
        entry.seq = seq;
        let key = self.slot_key(seq);
        set_shared_data(&key, Some(&entry.encode()), None).ok()?;
        Some(seq)
    }

    /// The entry of sequence number `seq`, if the ring still holds it.
    pub fn read_entry(&self, seq: u64) -> Option<LogEntry> {
        let key = self.slot_key(seq);
        get(&key)
            .0
            .and_then(|v| LogEntry::decode(&v))
            .filter(|e| e.seq == seq)
    }

    /// A cursor that replays what the ring still holds.
    pub fn cursor(&self) -> LogCursor {
        LogCursor {
            next: self.head().saturating_sub(self.log_slots as u64),
            ahead: Vec::new(),
        }
    }

    /// Entries appended since `cursor` (by any VM), advancing it
    /// (`LogCursor::replay`: an entry reserved but not yet written is read
    /// next time, the ones after it now). Entries `own` says this VM wrote
    /// are skipped unread: it learnt them when it made them.
    pub fn read_log(&self, cursor: &mut LogCursor, own: impl Fn(u64) -> bool) -> LogRead {
        let snapshot = self.head_snapshot();
        let replay = cursor.replay(snapshot.value, self.log_slots, own, |seq| {
            get(&self.slot_key(seq))
                .0
                .and_then(|v| LogEntry::decode(&v))
        });
        LogRead {
            entries: replay.entries,
            lost: replay.lost,
            head: Some(snapshot),
        }
    }
}
