//! What a replica takes from a peer's answer: only decisions a request of
//! its own could have produced, and refusals of them (`forget` entries,
//! served only to an asker that asks: `wire`). Entries naming an endpoint
//! outside the pool, claiming to be learned from a peer (a replica serves
//! only its own), with no blocks or more than a prompt can have are
//! dropped (counted by the caller). The peer's in-flight work is kept for
//! pool endpoints only.

use crate::endpoint::Endpoint;
use crate::inflight::InFlightTable;
use crate::shared::decision_log::LogEntry;
use std::collections::HashSet;

/// The accepted part of an answer.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Intake {
    /// Decisions to learn, in the peer's order.
    pub entries: Vec<LogEntry>,
    /// Decisions refused.
    pub dropped: u64,
    /// The peer's in-flight work on pool endpoints: (endpoint, requests, tokens).
    pub load: Vec<(Endpoint, u32, u64)>,
}

/// Filters a peer's decisions and in-flight table against `pool`.
pub fn accept(
    entries: Vec<LogEntry>,
    inflight: &InFlightTable,
    pool: &[Endpoint],
    max_blocks: usize,
) -> Intake {
    let pool: HashSet<Endpoint> = pool.iter().copied().collect();
    let mut out = Intake::default();
    for e in entries {
        let ok = pool.contains(&e.endpoint)
            && !e.from_peer
            && !e.blocks.is_empty()
            && e.blocks.len() <= max_blocks;
        if ok {
            out.entries.push(e);
        } else {
            out.dropped += 1;
        }
    }
    out.load = inflight
        .iter()
        .filter(|(e, _)| pool.contains(e))
        .map(|(e, f)| (e, f.requests, f.tokens))
        .collect();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn ep(s: &str) -> Endpoint {
        s.parse().unwrap()
    }

    fn entry(endpoint: &str, blocks: usize, from_peer: bool) -> LogEntry {
        LogEntry {
            seq: 0,
            endpoint: ep(endpoint),
            at_ms: 0,
            blocks: (0..blocks as u64).collect(),
            from_peer,
            forget: false,
        }
    }

    #[test]
    fn only_own_decisions_on_pool_endpoints_within_bounds_pass() {
        let pool = [ep("10.0.0.1:8000"), ep("10.0.0.2:8000")];
        let entries = vec![
            entry("10.0.0.1:8000", 3, false), // kept
            entry("10.0.0.9:8000", 3, false), // foreign host
            entry("10.0.0.1:8001", 3, false), // right ip, wrong port
            entry("10.0.0.2:8000", 3, true),  // echoed from a third replica
            entry("10.0.0.2:8000", 0, false), // nothing to learn
            entry("10.0.0.2:8000", 9, false), // more blocks than a prompt has
            entry("10.0.0.2:8000", 8, false), // kept
            LogEntry {
                forget: true, // a refusal: kept
                ..entry("10.0.0.2:8000", 3, false)
            },
            LogEntry {
                forget: true, // a refusal of a foreign host's
                ..entry("10.0.0.9:8000", 3, false)
            },
        ];
        let mut inflight = InFlightTable::new();
        inflight.add(ep("10.0.0.2:8000"), 50, 1);
        inflight.add(ep("192.168.1.1:80"), 50, 1);
        let got = accept(entries, &inflight, &pool, 8);
        assert_eq!(got.dropped, 6);
        let kept: Vec<_> = got
            .entries
            .iter()
            .map(|e| (e.endpoint, e.blocks.len()))
            .collect();
        assert_eq!(kept, vec![(pool[0], 3), (pool[1], 8), (pool[1], 3)]);
        assert!(got.entries[2].forget);
        assert_eq!(got.load, vec![(pool[1], 1, 50)]);
    }
}
