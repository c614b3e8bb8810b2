//! What a replica knows of its peers, kept in one shared-data key (JSON,
//! written by the VM holding the scraper lease after every sync, read by
//! every worker on its tick): per member of `peers.cluster`, the peer's id,
//! the cursor into its decision log, when it last answered, and its
//! in-flight work. At most `peers.max_peers` members are kept.

use super::wire::SyncQuery;
use crate::endpoint::Endpoint;
use crate::sorted_lookup::SortedLookup;
use serde::{Deserialize, Serialize};

/// One member of the peers cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerState {
    /// The member's address (its peer listener).
    pub member: Option<Endpoint>,
    /// The replica id it answered with last (`None`: never answered).
    pub replica: Option<u64>,
    /// Cursor into its decision log (valid for `replica`).
    pub next: u64,
    /// When it last answered (wall ms).
    pub heard_ms: u64,
    /// It answered with this replica's own id: never asked again.
    pub is_self: bool,
    /// Its in-flight work: (endpoint, requests, tokens).
    pub load: Vec<(Endpoint, u32, u64)>,
    /// Its last answer said it serves refusals (`forget` entries) to an
    /// asker that asks for them (`wire`).
    #[serde(default)]
    pub refusals: bool,
}

/// Every peer, in member order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerTable {
    /// Per member.
    pub peers: Vec<PeerState>,
}

impl PeerTable {
    /// The encoding (JSON).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses [`PeerTable::encode`]'s output.
    pub fn decode(bytes: &[u8]) -> Option<PeerTable> {
        serde_json::from_slice(bytes).ok()
    }

    /// Follows the cluster's membership: state of members still present is
    /// kept, new ones start blank, at most `max` are kept (sorted by
    /// address, so every replica keeps the same ones). Returns how many
    /// members were left out.
    pub fn set_members(&mut self, members: &[Endpoint], max: usize) -> usize {
        let mut sorted = members.to_vec();
        sorted.sort();
        sorted.dedup();
        let left_out = sorted.len().saturating_sub(max);
        sorted.truncate(max);
        let old = std::mem::take(&mut self.peers);
        self.peers = sorted
            .into_iter()
            .map(|m| {
                old.iter()
                    .find(|p| p.member == Some(m))
                    .cloned()
                    .unwrap_or(PeerState {
                        member: Some(m),
                        ..PeerState::default()
                    })
            })
            .collect();
        left_out
    }

    /// Members to ask now (every one but this replica itself).
    pub fn to_ask(&self) -> impl Iterator<Item = &PeerState> {
        self.peers
            .iter()
            .filter(|p| !p.is_self && p.member.is_some())
    }

    /// The query for `member`.
    pub fn query(&self, member: Endpoint, max_bytes: usize) -> SyncQuery {
        let p = self.peers.iter().find(|p| p.member == Some(member));
        SyncQuery {
            replica: p.and_then(|p| p.replica),
            since: p.map_or(0, |p| p.next),
            max_bytes,
            refusals: p.is_some_and(|p| p.refusals),
        }
    }

    /// Whether `member`'s last answer offered refusals.
    pub fn offers_refusals(&mut self, member: Endpoint, offered: bool) {
        if let Some(p) = self.peers.iter_mut().find(|p| p.member == Some(member)) {
            p.refusals = offered;
        }
    }

    /// `member` answered at `now_ms` as `replica` with cursor `next` and
    /// in-flight `load`; `own` is this replica's id. Returns false when the
    /// member is not (or no longer) in the table.
    pub fn heard(
        &mut self,
        member: Endpoint,
        own: u64,
        replica: u64,
        next: u64,
        load: Vec<(Endpoint, u32, u64)>,
        now_ms: u64,
    ) -> bool {
        let Some(p) = self.peers.iter_mut().find(|p| p.member == Some(member)) else {
            return false;
        };
        p.is_self = replica == own;
        p.replica = Some(replica);
        p.next = next;
        p.heard_ms = now_ms;
        p.load = if p.is_self { Vec::new() } else { load };
        true
    }

    /// Peers (not this replica) heard from within `stale_after_ms` of `now_ms`.
    pub fn live(&self, now_ms: u64, stale_after_ms: u64) -> impl Iterator<Item = &PeerState> {
        self.peers.iter().filter(move |p| {
            !p.is_self && p.replica.is_some() && now_ms.saturating_sub(p.heard_ms) <= stale_after_ms
        })
    }

    /// In-flight work of the live peers, summed per endpoint: (requests, tokens).
    pub fn load(&self, now_ms: u64, stale_after_ms: u64) -> PeerLoad {
        let mut sum: Vec<(Endpoint, u32, u64)> = Vec::new();
        for p in self.live(now_ms, stale_after_ms) {
            for &(e, r, t) in &p.load {
                match sum.binary_search_by(|(x, _, _)| x.cmp(&e)) {
                    Ok(i) => {
                        sum[i].1 = sum[i].1.saturating_add(r);
                        sum[i].2 = sum[i].2.saturating_add(t);
                    }
                    Err(i) => sum.insert(i, (e, r, t)),
                }
            }
        }
        PeerLoad(sum)
    }
}

/// Peers' in-flight work per endpoint (sorted by endpoint).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerLoad(Vec<(Endpoint, u32, u64)>);

impl PeerLoad {
    /// (requests, tokens) the live peers have in flight on `endpoint`.
    pub fn get(&self, endpoint: &Endpoint) -> (u32, u64) {
        match self.0.binary_search_by(|(x, _, _)| x.cmp(endpoint)) {
            Ok(i) => (self.0[i].1, self.0[i].2),
            Err(_) => (0, 0),
        }
    }

    /// [`Self::get`] for a walk over endpoints in ascending order, each
    /// lookup resuming where the last one stopped (`sorted_lookup`).
    pub fn lookup(&self) -> impl Fn(&Endpoint) -> (u32, u64) + '_ {
        let cursor = SortedLookup::new(&self.0, |(e, _, _)| e);
        move |e| cursor.get(e).map_or((0, 0), |&(_, r, t)| (r, t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn ep(s: &str) -> Endpoint {
        s.parse().unwrap()
    }

    #[test]
    fn membership_keeps_state_and_bounds_the_table() {
        let (a, b, c) = (
            ep("10.0.0.1:15100"),
            ep("10.0.0.2:15100"),
            ep("10.0.0.3:15100"),
        );
        let mut t = PeerTable::default();
        assert_eq!(t.set_members(&[b, a, a], 8), 0);
        assert!(t.heard(a, 1, 7, 40, vec![], 100));
        assert_eq!(t.set_members(&[c, a, b], 2), 1);
        let members: Vec<_> = t.peers.iter().map(|p| p.member.unwrap()).collect();
        assert_eq!(members, vec![a, b]);
        assert_eq!(
            t.query(a, 10),
            SyncQuery {
                replica: Some(7),
                since: 40,
                max_bytes: 10,
                refusals: false,
            }
        );
        assert_eq!(
            t.query(b, 10),
            SyncQuery {
                replica: None,
                since: 0,
                max_bytes: 10,
                refusals: false,
            }
        );
        // Refusals are asked for only from a member that offered them.
        t.offers_refusals(a, true);
        assert!(t.query(a, 10).refusals);
        assert!(!t.query(b, 10).refusals);
        t.offers_refusals(a, false); // downgraded
        assert!(!t.query(a, 10).refusals);
        t.offers_refusals(a, true);
        assert!(!t.heard(c, 1, 9, 1, vec![], 100), "not a member: ignored");
        assert_eq!(PeerTable::decode(&t.encode()), Some(t));
        assert_eq!(PeerTable::decode(b"junk"), None);
    }

    #[test]
    fn self_is_skipped_and_stale_peers_do_not_count() {
        let (a, b, c) = (
            ep("10.0.0.1:15100"),
            ep("10.0.0.2:15100"),
            ep("10.0.0.3:15100"),
        );
        let pod = ep("10.1.0.1:8000");
        let mut t = PeerTable::default();
        t.set_members(&[a, b, c], 8);
        t.heard(a, 1, 1, 0, vec![(pod, 9, 900)], 1_000); // itself
        t.heard(b, 1, 2, 0, vec![(pod, 2, 200)], 1_000);
        t.heard(c, 1, 3, 0, vec![(pod, 3, 300)], 100); // stale at 1_500
        let asked: Vec<_> = t.to_ask().map(|p| p.member.unwrap()).collect();
        assert_eq!(asked, vec![b, c]);
        assert_eq!(t.load(1_000, 1_000).get(&pod), (5, 500));
        assert_eq!(t.load(1_500, 1_000).get(&pod), (2, 200));
        assert_eq!(t.live(1_500, 1_000).count(), 1);
        assert_eq!(t.load(1_500, 1_000).get(&ep("10.1.0.2:8000")), (0, 0));
    }
}
