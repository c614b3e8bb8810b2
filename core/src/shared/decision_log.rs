//! The decision log: after each routing decision a worker appends one
//! [`LogEntry`] (which endpoint was sent which blocks) to a ring of
//! `shared.log_slots` proxy-wasm shared-data keys, so the other workers can
//! replay it into their own [`crate::prefix::PrefixIndex`] and every worker
//! learns every decision. Slot of sequence number `seq` is `seq % slots`:
//! the key space is fixed, old decisions are overwritten.
//!
//! Entries learned from other gateways (`peer/`) go into the same ring,
//! marked `from_peer`, so every worker learns them too; a replica serves its
//! peers only its own decisions (no echo between replicas).
//!
//! Wire format (little-endian), version 2:
//!
//! ```text
//! u8  version = 2
//! u8  flags   = bit 0: from_peer, bit 1: forget (other bits zero)
//! u8  family  = 4 | 6
//! ip  4 bytes (v4) | 16 bytes + u32 scope id (v6)
//! u16 port (non-zero)
//! u64 seq
//! u64 at_ms
//! u32 n
//! n x u64 hashes to record: the request's block hashes, then its leaf
//!           (`prefix::Leaves`) when its prompt ends mid-block
//! ```
//!
//! A `forget` entry undoes part of an earlier one: the endpoint refused the
//! request (a non-2xx answer, or none), so it never cached the hashes its
//! decision taught; every worker unlearns them. A build from before forget
//! entries decodes one to `None` and skips it (it keeps the record, as
//! before). A peer answer with an undecodable entry is dropped whole by
//! such a build, so replicas send forget entries only to a peer that asks
//! for them, and ask only a peer that offers them (`peer/`): between two
//! current replicas a refusal is unlearnt by both; with an older peer it
//! stays with the replica that saw it, and the peer's copy of the record
//! ages out of its LRU.
//!
//! The leaf is one more hash to record, so the format did not change with
//! it. The block hashes themselves did (`prefix/v3`: the chain runs over
//! quarter blocks): during a rolling upgrade, entries of the other version
//! are recorded but never match, and age out of the LRU; keeping version 2
//! keeps replicas of both versions sharing in-flight counts (a peer answer
//! with one undecodable entry is dropped whole).
//!
//! Decoding checks everything (version, family, port, exact length) and
//! returns `None` on any mismatch, so garbage, a torn or foreign value, or a
//! value of another version is simply skipped.

use crate::endpoint::Endpoint;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

/// Current wire-format version (first byte of every encoded entry).
pub const VERSION: u8 = 2;

const FROM_PEER: u8 = 1;
const FORGET: u8 = 2;

/// One routing decision as replicated across workers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogEntry {
    /// Monotonic sequence number of the decision in the log.
    pub seq: u64,
    /// The endpoint the request was sent to.
    pub endpoint: Endpoint,
    /// When the decision was made (ms, the filter's clock).
    pub at_ms: u64,
    /// The request's chained block hashes, then its leaf if it has one
    /// (`InferenceRequest::learned`): what the index records.
    pub blocks: Vec<u64>,
    /// Learned from another gateway (not routed here).
    pub from_peer: bool,
    /// Unlearn `blocks` for `endpoint` instead of recording them: it
    /// refused a request it had been sent them for.
    pub forget: bool,
}

impl LogEntry {
    /// This gateway's own decision: `endpoint` was sent `blocks` at `at_ms`
    /// (its sequence number is set when it is appended).
    pub fn own(endpoint: Endpoint, at_ms: u64, blocks: Vec<u64>) -> LogEntry {
        LogEntry {
            seq: 0,
            endpoint,
            at_ms,
            blocks,
            from_peer: false,
            forget: false,
        }
    }

    /// Size of the encoding in bytes.
    pub fn encoded_len(&self) -> usize {
        let addr = match self.endpoint.addr() {
            SocketAddr::V4(_) => 4,
            SocketAddr::V6(_) => 16 + 4,
        };
        3 + addr + 2 + 8 + 8 + 4 + 8 * self.blocks.len()
    }

    /// The compact binary form (see the module doc). Entries with more
    /// than `u32::MAX` blocks are encoded with the first `u32::MAX`.
    pub fn encode(&self) -> Vec<u8> {
        let n = self.blocks.len().min(u32::MAX as usize);
        let mut out = Vec::with_capacity(self.encoded_len());
        out.push(VERSION);
        let mut flags = 0;
        if self.from_peer {
            flags |= FROM_PEER;
        }
        if self.forget {
            flags |= FORGET;
        }
        out.push(flags);
        match self.endpoint.addr() {
            SocketAddr::V4(a) => {
                out.push(4);
                out.extend_from_slice(&a.ip().octets());
            }
            SocketAddr::V6(a) => {
                out.push(6);
                out.extend_from_slice(&a.ip().octets());
                out.extend_from_slice(&a.scope_id().to_le_bytes());
            }
        }
        out.extend_from_slice(&self.endpoint.addr().port().to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.at_ms.to_le_bytes());
        out.extend_from_slice(&(n as u32).to_le_bytes());
        for b in self.blocks.iter().take(n) {
            out.extend_from_slice(&b.to_le_bytes());
        }
        out
    }

    /// Parses [`LogEntry::encode`]'s output; `None` for anything else.
    pub fn decode(bytes: &[u8]) -> Option<LogEntry> {
        let mut r = Reader(bytes);
        if r.take::<1>()? != [VERSION] {
            return None;
        }
        let [flags] = r.take::<1>()?;
        if flags & !(FROM_PEER | FORGET) != 0 {
            return None;
        }
        let ip: std::net::IpAddr = match r.take::<1>()? {
            [4] => Ipv4Addr::from(r.take::<4>()?).into(),
            [6] => Ipv6Addr::from(r.take::<16>()?).into(),
            _ => return None,
        };
        let scope = if ip.is_ipv6() {
            u32::from_le_bytes(r.take()?)
        } else {
            0
        };
        let port = u16::from_le_bytes(r.take()?);
        if port == 0 {
            return None;
        }
        let addr = match ip {
            std::net::IpAddr::V4(v4) => SocketAddr::V4(SocketAddrV4::new(v4, port)),
            std::net::IpAddr::V6(v6) => SocketAddr::V6(SocketAddrV6::new(v6, port, 0, scope)),
        };
        let seq = u64::from_le_bytes(r.take()?);
        let at_ms = u64::from_le_bytes(r.take()?);
        let n = u32::from_le_bytes(r.take()?) as usize;
        // Exact length before allocating: a garbage count cannot allocate.
        if r.0.len() / 8 != n || r.0.len() % 8 != 0 {
            return None;
        }
        let blocks =
            r.0.chunks_exact(8)
                .map(|c| {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(c);
                    u64::from_le_bytes(b)
                })
                .collect();
        Some(LogEntry {
            seq,
            endpoint: Endpoint::new(addr),
            at_ms,
            blocks,
            from_peer: flags & FROM_PEER != 0,
            forget: flags & FORGET != 0,
        })
    }
}

/// The ring slot of sequence number `seq` among `slots` slots
/// (`seq % slots`; 0 when `slots` is 0).
pub fn slot_of(seq: u64, slots: u32) -> u32 {
    if slots == 0 {
        0
    } else {
        (seq % u64::from(slots)) as u32
    }
}

/// An entry still missing (reserved, not written) while this many later
/// ones exist is taken as lost: its writer must have failed.
pub const STALL_SKIP: u64 = 64;

/// Where a VM is in replaying the log.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogCursor {
    /// The first sequence number not replayed yet.
    pub next: u64,
    /// Sequence numbers after `next` already replayed: read past an entry
    /// reserved but not yet written, which `next` waits at (fewer than
    /// [`STALL_SKIP`]).
    pub ahead: Vec<u64>,
}

/// What one [`LogCursor::replay`] read.
#[derive(Debug, Default)]
pub struct Replay {
    /// Entries in sequence order (one reserved but not yet written is
    /// replayed later, after the ones read past it).
    pub entries: Vec<LogEntry>,
    /// Entries overwritten before they could be read, or never written.
    pub lost: u64,
}

impl LogCursor {
    /// Replays the entries before `head` (the next sequence number to be
    /// reserved) of a ring of `slots`: `read(seq)` is what slot `seq` holds
    /// (`None`: nothing decodable yet); `own(seq)` marks this VM's own
    /// entries, skipped unread.
    ///
    /// An entry reserved but not yet written does not stop the replay:
    /// its writer reserves the slot, then writes it, and a later writer may
    /// already have written its own and counted its decision in the
    /// in-flight table. A VM that then sees that count must see what the
    /// decision taught (the decision log is written before the count), so
    /// the entries after the missing one are read now and the missing one
    /// next time. Out of order is safe: a `forget` entry only ever follows
    /// the written entry it retracts (the same VM wrote both, in turn), and
    /// the rest are records of separate decisions.
    pub fn replay(
        &mut self,
        head: u64,
        slots: u32,
        own: impl Fn(u64) -> bool,
        mut read: impl FnMut(u64) -> Option<LogEntry>,
    ) -> Replay {
        let mut out = Replay::default();
        if head <= self.next {
            return out;
        }
        let oldest = head.saturating_sub(u64::from(slots));
        if self.next < oldest {
            out.lost = oldest - self.next;
            self.next = oldest;
        }
        // The first entry reserved but not yet written, if any.
        let mut waiting = None;
        for seq in self.next..head {
            if own(seq) || self.ahead.contains(&seq) {
                continue;
            }
            match read(seq) {
                Some(e) if e.seq == seq => out.entries.push(e),
                // Overwritten by a later lap: lost.
                Some(e) if e.seq > seq => out.lost += 1,
                _ if head - seq <= STALL_SKIP => {
                    waiting.get_or_insert(seq);
                    continue;
                }
                _ => out.lost += 1,
            }
            if waiting.is_some() {
                self.ahead.push(seq);
            }
        }
        self.next = waiting.unwrap_or(head);
        let next = self.next;
        self.ahead.retain(|&s| s > next);
        out
    }
}

/// Bounds-checked little reader over a byte slice.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// A ring of 8 slots whose writers reserved sequence numbers 0..5 and
    /// wrote all but `unwritten`.
    fn written(seq: u64, unwritten: &[u64]) -> Option<LogEntry> {
        let ep: Endpoint = "10.0.0.1:8000".parse().unwrap();
        (!unwritten.contains(&seq)).then(|| LogEntry {
            seq,
            ..LogEntry::own(ep, seq, vec![seq])
        })
    }

    fn seqs(r: &Replay) -> Vec<u64> {
        r.entries.iter().map(|e| e.seq).collect()
    }

    /// Entry 1 is reserved and not yet written while entries 2-4 are (a
    /// worker that reserved after it wrote first, and counted its decision
    /// in the in-flight table). The replay reads 2-4 now and 1 once it is
    /// written, each once. It stopped at 1: a worker that saw entry 3's
    /// decision counted did not see what it taught, took its copy of the
    /// same new prompt for another one and placed it elsewhere
    /// (`tests/routing.rs`, copies of a new prompt routed by four workers).
    #[test]
    fn an_entry_not_yet_written_does_not_hide_the_ones_after_it() {
        let mut c = LogCursor::default();
        let r = c.replay(5, 8, |_| false, |s| written(s, &[1]));
        assert_eq!(seqs(&r), [0, 2, 3, 4]);
        assert_eq!((c.next, &c.ahead[..], r.lost), (1, &[2, 3, 4][..], 0));
        // Still missing: nothing new.
        let r = c.replay(5, 8, |_| false, |s| written(s, &[1]));
        assert!(r.entries.is_empty());
        // Written, and one more after it.
        let r = c.replay(6, 8, |_| false, |s| written(s, &[]));
        assert_eq!(seqs(&r), [1, 5]);
        assert_eq!((c.next, c.ahead.len()), (6, 0));
    }

    #[test]
    fn own_entries_are_skipped_and_lost_ones_counted() {
        let mut c = LogCursor::default();
        let r = c.replay(4, 8, |s| s == 1, |s| written(s, &[]));
        assert_eq!(seqs(&r), [0, 2, 3]);
        // The ring lapped the cursor: 12 entries since, 8 slots.
        let r = c.replay(16, 8, |_| false, |s| written(s, &[]));
        assert_eq!((r.lost, seqs(&r)), (4, (8..16).collect::<Vec<_>>()));
        // A slot never written while more than STALL_SKIP later ones
        // exist: its writer failed, it is lost.
        let mut c = LogCursor {
            next: 16,
            ahead: Vec::new(),
        };
        let head = 16 + STALL_SKIP + 1;
        let r = c.replay(head, 128, |_| false, |s| written(s, &[16]));
        assert_eq!(
            (r.lost, r.entries.len() as u64, c.next),
            (1, STALL_SKIP, head)
        );
    }

    fn entry(ep: &str, blocks: Vec<u64>) -> LogEntry {
        LogEntry {
            seq: 0x0102_0304_0506_0708,
            endpoint: ep.parse().unwrap(),
            at_ms: 1_764_000_000_123,
            blocks,
            from_peer: false,
            forget: false,
        }
    }

    #[test]
    fn roundtrips_v4_and_v6() {
        let cases = [
            entry("10.0.0.1:8000", vec![]),
            entry("10.0.0.1:8000", vec![1, u64::MAX, 0x8000_0000_0000_0000]),
            entry("[::1]:9000", vec![42]),
            entry("[2001:db8::7]:65535", (0..1000).collect()),
            entry("[fe80::1%3]:80", vec![7]),
        ];
        for e in cases {
            let bytes = e.encode();
            assert_eq!(bytes.len(), e.encoded_len(), "{e:?}");
            assert_eq!(bytes[0], VERSION);
            assert_eq!(LogEntry::decode(&bytes), Some(e.clone()), "{e:?}");
        }
    }

    #[test]
    fn layout_is_little_endian() {
        let mut e = entry("1.2.3.4:258", vec![0x1122]);
        let b = e.encode();
        assert_eq!(&b[..9], &[2, 0, 4, 1, 2, 3, 4, 2, 1]);
        assert_eq!(&b[9..17], &e.seq.to_le_bytes());
        assert_eq!(&b[25..29], &[1, 0, 0, 0]);
        assert_eq!(&b[29..], &[0x22, 0x11, 0, 0, 0, 0, 0, 0]);
        e.from_peer = true;
        assert_eq!(e.encode()[1], 1);
        assert_eq!(LogEntry::decode(&e.encode()), Some(e.clone()));
        e.forget = true;
        assert_eq!(e.encode()[1], 3);
        assert_eq!(LogEntry::decode(&e.encode()), Some(e.clone()));
        e.from_peer = false;
        assert_eq!(e.encode()[1], 2);
        assert_eq!(LogEntry::decode(&e.encode()), Some(e));
    }

    #[test]
    fn garbage_decodes_to_none() {
        let good = entry("10.0.0.1:8000", vec![1, 2, 3]).encode();
        let mut cases: Vec<Vec<u8>> = vec![
            vec![],
            vec![1],
            vec![2, 0, 4, 1, 2, 3, 4],
            b"hello world, this is not a log entry".to_vec(),
            vec![0xff; 64],
        ];
        // Every truncation and one extra byte.
        for i in 0..good.len() {
            cases.push(good[..i].to_vec());
        }
        let mut longer = good.clone();
        longer.push(0);
        cases.push(longer);
        // Wrong version, flags, family, zero port, lying counts.
        for (at, v) in [
            (0, 1u8),
            (1, 4),
            (1, 0x80),
            (2, 5),
            (7, 0),
            (25, 4),
            (28, 0xff),
        ] {
            let mut bad = good.clone();
            bad[at] = v;
            if at == 7 {
                bad[8] = 0;
            }
            cases.push(bad);
        }
        for c in cases {
            assert_eq!(LogEntry::decode(&c), None, "{c:?}");
        }
    }

    #[test]
    fn slots_wrap() {
        for (seq, slots, want) in [
            (0, 512, 0),
            (511, 512, 511),
            (512, 512, 0),
            (u64::MAX, 16, 15),
            (5, 0, 0),
            (5, 1, 0),
        ] {
            assert_eq!(slot_of(seq, slots), want, "{seq} % {slots}");
        }
    }
}
