//! The asking side of peer sync (`kvroute_core::peer`), run by the VM that
//! holds the scraper lease: learn the members of `peers.cluster` (from the
//! admin API, with discovery), ask each member for its decisions since the
//! cursor, and take in the answer: decisions into this replica's decision
//! log (marked `from_peer`, so every worker learns them), the peer's cursor
//! and in-flight work into the shared peer table. All of it runs on the
//! tick and in HTTP-call callbacks, never on a request's path: a dead or
//! slow peer only makes its own calls fail.

use crate::stats::Counter;
use crate::vm_state::VmState;
use kvroute_core::config::PeersConfig;
use kvroute_core::discovery::cluster_members;
use kvroute_core::endpoint::Endpoint;
use kvroute_core::peer::intake::accept;
use kvroute_core::peer::wire::SyncAnswer;
use kvroute_core::shared::decision_log::LogEntry;
use log::{info, warn};
use proxy_wasm::hostcalls::dispatch_http_call;
use std::time::Duration;

/// Follows the membership of `peers.cluster` from the admin API's
/// `/clusters?format=json` output.
pub fn update_members(state: &VmState, peers: &PeersConfig, clusters_json: &[u8]) {
    match cluster_members(clusters_json, &peers.cluster) {
        Ok(members) => {
            let mut left_out = 0;
            let before = state.store.peer_table().peers.len();
            let table = state
                .store
                .update_peer_table(|t| left_out = t.set_members(&members, peers.max_peers));
            if table.peers.len() != before {
                info!(
                    "kvroute: peers: cluster {} has {} members",
                    peers.cluster,
                    table.peers.len()
                );
            }
            if left_out > 0 {
                warn!(
                    "kvroute: peers: {left_out} members of {} past peers.max_peers = {} are not synced",
                    peers.cluster, peers.max_peers
                );
            }
        }
        Err(e) => warn!("kvroute: peers: {e:?}"),
    }
}

/// Asks every member (but this replica) for its news; `busy` tells whether
/// a member's previous call is still pending. Returns the calls made.
pub fn ask_all(
    state: &VmState,
    peers: &PeersConfig,
    busy: impl Fn(Endpoint) -> bool,
) -> Vec<(u32, Endpoint)> {
    let table = state.store.peer_table();
    let timeout = Duration::from_millis(peers.timeout_ms);
    let dest = state.config().destination_header.as_str();
    let mut calls = Vec::new();
    for member in table.to_ask().filter_map(|p| p.member) {
        if busy(member) {
            continue;
        }
        let path = table.query(member, peers.max_response_bytes).to_path();
        let authority = member.to_string();
        let headers = vec![
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", authority.as_str()),
            (dest, authority.as_str()),
        ];
        match dispatch_http_call(&peers.cluster, headers, None, vec![], timeout) {
            Ok(token) => calls.push((token, member)),
            Err(status) => {
                state.stats.inc(Counter::PeerSyncFailed);
                warn!(
                    "kvroute: peers: cannot dispatch sync to {member} via cluster {}: {status:?}",
                    peers.cluster
                );
            }
        }
    }
    calls
}

/// What a member sent back.
pub struct Answer {
    /// Its HTTP status.
    pub status: Option<u16>,
    /// Its body, when it was small enough to read.
    pub body: Option<Vec<u8>>,
    /// It carried `REFUSALS_HEADER`: ask it for refusals from now on.
    pub offers_refusals: bool,
}

/// Takes in `member`'s answer at `now_ms`.
pub fn take_answer(state: &mut VmState, member: Endpoint, answer: Answer, now_ms: u64) {
    let Answer {
        status,
        body,
        offers_refusals,
    } = answer;
    if status != Some(200) {
        state.stats.inc(Counter::PeerSyncFailed);
        return;
    }
    let Some(body) = body else {
        state.stats.inc(Counter::PeerMalformed);
        return;
    };
    state.stats.add(Counter::PeerBytes, body.len() as u64);
    let Some(answer) = SyncAnswer::decode(&body) else {
        state.stats.inc(Counter::PeerMalformed);
        warn!("kvroute: peers: {member} answered something that is not a sync answer");
        return;
    };
    state.stats.inc(Counter::PeerSyncOk);
    let vm_id = state.vm_id;
    let own = state.store.replica_id(|| vm_id);
    let mut load = Vec::new();
    if answer.replica != own {
        let intake = accept(
            answer.entries,
            &answer.inflight,
            state.router.pool(),
            // The blocks, and a leaf after them (short prompts).
            state.config().prefix.max_blocks() + 1,
        );
        state.stats.add(Counter::PeerDropped, intake.dropped);
        state.stats.add(Counter::PeerSkipped, answer.skipped);
        for e in intake.entries {
            state.stats.peer_lag(now_ms.saturating_sub(e.at_ms));
            let forget = e.forget;
            // Learned now, on this replica's clock (peers' clocks differ).
            let mut learned = LogEntry {
                at_ms: now_ms,
                from_peer: true,
                ..e
            };
            if state.store.append_log(&mut learned, None).is_some() {
                state.stats.inc(if forget {
                    Counter::PeerRefusals
                } else {
                    Counter::PeerLearned
                });
            }
        }
        load = intake.load;
    }
    let (replica, next) = (answer.replica, answer.next);
    state.store.update_peer_table(|t| {
        t.heard(member, own, replica, next, load.clone(), now_ms);
        t.offers_refusals(member, offers_refusals);
    });
}
