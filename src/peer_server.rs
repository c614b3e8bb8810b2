//! The HTTP context of the peer listener (root id `kvroute_peer`): answers
//! other replicas' sync requests with this replica's own recent decisions
//! and in-flight work (`kvroute_core::peer`). Nothing on this listener is
//! ever proxied: every other request gets a JSON 404. The public listener's
//! filter never serves sync, so the endpoint is reachable only where the
//! operator puts the peer listener.

use crate::stats::Counter;
use crate::vm_state::VmState;
use kvroute_core::endpoint::Endpoint;
use kvroute_core::error_reply::ErrorReply;
use kvroute_core::peer::wire::{plan_read, AnswerBuilder, SyncQuery};
use kvroute_core::peer::REFUSALS_HEADER;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::cell::RefCell;
use std::rc::Rc;

/// One sync request.
pub struct PeerServer {
    state: Rc<RefCell<VmState>>,
}

impl PeerServer {
    /// A context sharing its VM's state.
    pub fn new(state: Rc<RefCell<VmState>>) -> PeerServer {
        PeerServer { state }
    }

    fn reply(&self, error: ErrorReply) -> Action {
        let headers = vec![("content-type", "application/json")];
        self.send_http_response(error.status(), headers, Some(error.body().as_bytes()));
        Action::Pause
    }

    /// True when the request names a member other than the address it
    /// arrived on (the asker's override_host fell back to this replica).
    fn misdirected(&self) -> bool {
        let named = self
            .get_http_request_header(":authority")
            .and_then(|a| a.parse::<Endpoint>().ok());
        let local = self
            .get_property(vec!["destination", "address"])
            .and_then(|v| String::from_utf8(v).ok())
            .and_then(|a| a.parse::<Endpoint>().ok());
        matches!((named, local), (Some(n), Some(l)) if n != l)
    }
}

impl Context for PeerServer {}

impl HttpContext for PeerServer {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let method = self.get_http_request_header(":method");
        let query = self
            .get_http_request_header(":path")
            .and_then(|p| SyncQuery::from_path(&p));
        let Some(query) = query.filter(|_| method.as_deref() == Some("GET")) else {
            return self.reply(ErrorReply::PathNotAllowed);
        };
        if self.misdirected() {
            return self.reply(ErrorReply::MisdirectedSync);
        }
        let state = self.state.borrow();
        let Some(peers) = state.config().peers.clone() else {
            return self.reply(ErrorReply::PathNotAllowed);
        };
        let store = &state.store;
        let own = store.replica_id(|| state.vm_id);
        let (head, slots) = store.log_extent();
        let (start, skipped) = plan_read(&query, own, head, slots);
        let max_bytes = query.max_bytes.min(peers.max_response_bytes);
        let mut answer = AnswerBuilder::new(own, skipped, &store.inflight(), max_bytes);
        let next = store.serve_log(
            start,
            peers.max_entries_per_sync,
            query.refusals,
            &mut answer,
        );
        let body = answer.finish(next);
        state.stats.inc(Counter::PeerServed);
        self.send_http_response(
            200,
            vec![
                ("content-type", "application/octet-stream"),
                (REFUSALS_HEADER, "1"),
            ],
            Some(&body),
        );
        Action::Pause
    }
}
