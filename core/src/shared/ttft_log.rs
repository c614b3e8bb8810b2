//! The TTFT observations every Envoy worker shares, so that each worker's
//! model (`ttft.rs`) learns from every streamed first byte, not only from
//! the ones its own requests saw: one view across workers, and a worker
//! that routes few requests (or a VM that restarted) is not left at the
//! priors.
//!
//! A worker learns its own observations at once and keeps them until its
//! next tick, when it appends them to one shared value (CAS) and learns the
//! other workers' observations appended since its last look. The value is a
//! ring of the last [`CAPACITY`] observations with their sequence numbers:
//! a worker that falls more than that behind skips the rest (counted as
//! lost). Every worker's model sees the same observations, its own a tick
//! sooner.
//!
//! Wire format (little-endian), version 1:
//!
//! ```text
//! [u8; 4] magic = "KVTO"
//! u8      version = 1
//! u64     next seq (the sequence number the next appended observation gets)
//! u16     n (<= CAPACITY), the last n observations, oldest first:
//!   u64   writer (VM id)
//!   endpoint (`Endpoint::encode_into`)
//!   u64   work tokens
//!   f64   running requests
//!   u64   routing to first byte, ms
//! ```
//!
//! Decoding checks everything and returns `None` on any mismatch, so a torn
//! or foreign value reads as empty.

use crate::endpoint::Endpoint;
use crate::ttft::Observation;
use std::collections::VecDeque;

/// Observations the shared value keeps (about 45 bytes each).
pub const CAPACITY: usize = 256;

const MAGIC: &[u8; 4] = b"KVTO";
const VERSION: u8 = 1;

/// The shared ring of recent observations.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TtftLog {
    /// Sequence number of the next observation appended.
    next_seq: u64,
    /// The last observations (at most [`CAPACITY`]) with their writers.
    entries: VecDeque<(u64, Observation)>,
}

/// What a worker has not learnt yet: observations after its cursor.
#[derive(Debug, Default, PartialEq)]
pub struct Unseen<'a> {
    /// Observations overwritten before the worker looked.
    pub lost: u64,
    /// The others' observations, oldest first (the worker's own skipped).
    pub observations: Vec<&'a Observation>,
    /// Where the worker's cursor goes next.
    pub next_seq: u64,
}

impl TtftLog {
    /// Appends `writer`'s observations, dropping the oldest beyond
    /// [`CAPACITY`].
    pub fn append(&mut self, writer: u64, observations: impl IntoIterator<Item = Observation>) {
        for o in observations {
            if self.entries.len() == CAPACITY {
                self.entries.pop_front();
            }
            self.entries.push_back((writer, o));
            self.next_seq += 1;
        }
    }

    /// Observations from sequence number `cursor` on that `reader` did not
    /// write itself.
    pub fn unseen(&self, reader: u64, cursor: u64) -> Unseen<'_> {
        let first = self.next_seq - self.entries.len() as u64;
        // A cursor past the head (the value was reset) starts over.
        let cursor = if cursor > self.next_seq { 0 } else { cursor };
        let skip = cursor.saturating_sub(first) as usize;
        Unseen {
            lost: first.saturating_sub(cursor),
            observations: self
                .entries
                .iter()
                .skip(skip)
                .filter(|(w, _)| *w != reader)
                .map(|(_, o)| o)
                .collect(),
            next_seq: self.next_seq,
        }
    }

    /// The compact binary form (see the module doc).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(15 + self.entries.len() * 45);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&self.next_seq.to_le_bytes());
        out.extend_from_slice(&(self.entries.len() as u16).to_le_bytes());
        for (writer, o) in &self.entries {
            out.extend_from_slice(&writer.to_le_bytes());
            o.endpoint.encode_into(&mut out);
            out.extend_from_slice(&o.work_tokens.to_le_bytes());
            out.extend_from_slice(&o.running.to_le_bytes());
            out.extend_from_slice(&o.ttft_ms.to_le_bytes());
        }
        out
    }

    /// Reads [`encode`](Self::encode)'s output; `None` for anything else
    /// (magic, version, a count above [`CAPACITY`] or above `next seq`,
    /// truncation, trailing bytes, a bad endpoint).
    pub fn decode(bytes: &[u8]) -> Option<TtftLog> {
        fn next<const N: usize>(r: &mut &[u8]) -> Option<[u8; N]> {
            let (head, rest) = r.split_first_chunk::<N>()?;
            *r = rest;
            Some(*head)
        }
        let r = &mut &bytes[..];
        if next::<4>(r)? != *MAGIC || next::<1>(r)? != [VERSION] {
            return None;
        }
        let next_seq = u64::from_le_bytes(next(r)?);
        let n = usize::from(u16::from_le_bytes(next(r)?));
        if n > CAPACITY || n as u64 > next_seq {
            return None;
        }
        let mut entries = VecDeque::with_capacity(n);
        for _ in 0..n {
            let writer = u64::from_le_bytes(next(r)?);
            let endpoint = Endpoint::decode_from(r)?;
            let o = Observation {
                endpoint,
                work_tokens: u64::from_le_bytes(next(r)?),
                running: f64::from_le_bytes(next(r)?),
                ttft_ms: u64::from_le_bytes(next(r)?),
            };
            entries.push_back((writer, o));
        }
        r.is_empty().then_some(TtftLog { next_seq, entries })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn obs(i: u64) -> Observation {
        Observation {
            endpoint: format!("10.0.0.{}:8000", i % 200 + 1).parse().unwrap(),
            work_tokens: 100 * i,
            running: i as f64 / 2.0,
            ttft_ms: 10 + i,
        }
    }

    #[test]
    fn a_worker_sees_the_others_observations_once_and_never_its_own() {
        let mut log = TtftLog::default();
        log.append(1, [obs(0), obs(1)]);
        log.append(2, [obs(2)]);
        let seen = log.unseen(2, 0);
        assert_eq!(seen.observations, vec![&obs(0), &obs(1)]);
        assert_eq!((seen.lost, seen.next_seq), (0, 3));
        log.append(1, [obs(3)]);
        let seen = log.unseen(2, 3);
        assert_eq!(seen.observations, vec![&obs(3)]);
        assert_eq!(log.unseen(1, 4).observations, Vec::<&Observation>::new());
    }

    #[test]
    fn the_ring_keeps_the_last_observations_and_counts_what_a_slow_reader_lost() {
        let mut log = TtftLog::default();
        log.append(1, (0..CAPACITY as u64 + 10).map(obs));
        let seen = log.unseen(2, 4);
        assert_eq!(seen.lost, 6);
        assert_eq!(seen.observations.len(), CAPACITY);
        assert_eq!(seen.observations[0], &obs(10));
        // A cursor past the head (the value was reset under it) starts over.
        assert_eq!(log.unseen(2, 1 << 40).observations.len(), CAPACITY);
    }

    #[test]
    fn roundtrips_v4_and_v6() {
        let mut log = TtftLog::default();
        let mut v6 = obs(7);
        v6.endpoint = "[fd00::7]:8000".parse().unwrap();
        log.append(u64::MAX, [obs(1), v6]);
        assert_eq!(TtftLog::decode(&log.encode()), Some(log.clone()));
        assert_eq!(
            TtftLog::decode(&TtftLog::default().encode()),
            Some(TtftLog::default())
        );
        let mut full = TtftLog::default();
        full.append(3, (0..1000).map(obs));
        assert_eq!(TtftLog::decode(&full.encode()), Some(full));
    }

    #[test]
    fn garbage_decodes_to_none() {
        let mut log = TtftLog::default();
        log.append(1, [obs(1)]);
        let good = log.encode();
        assert_eq!(TtftLog::decode(&[]), None);
        assert_eq!(TtftLog::decode(&good[..good.len() - 1]), None);
        let mut trailing = good.clone();
        trailing.push(0);
        assert_eq!(TtftLog::decode(&trailing), None);
        let mut version = good.clone();
        version[4] = 2;
        assert_eq!(TtftLog::decode(&version), None);
        // More entries than sequence numbers, or than the ring holds.
        let mut count = good.clone();
        count[13] = 2;
        assert_eq!(TtftLog::decode(&count), None);
        let mut huge = TtftLog::default().encode();
        huge[5..13].copy_from_slice(&u64::MAX.to_le_bytes());
        huge[13..15].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(TtftLog::decode(&huge), None);
        // Port 0.
        let mut port = good;
        let at = 15 + 8 + 1 + 4;
        port[at..at + 2].copy_from_slice(&[0, 0]);
        assert_eq!(TtftLog::decode(&port), None);
    }
}
