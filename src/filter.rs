//! The HTTP context: one per request. It only moves bytes between Envoy and
//! the core:
//!
//! 1. headers: remove every client-supplied copy of the destination header
//!    (no client can steer); a path off the allow-list (`allowed_paths`) is
//!    answered here with a JSON 404 and never reaches a pod; with `models`
//!    set, `GET /v1/models` is answered from the config; the objective
//!    header gives the request's priority; inference requests (`POST` to an
//!    OpenAI path with a body; with `models`, any `POST`) are held (`Pause`,
//!    which Envoy honours because the plugin sets
//!    `allow_on_headers_stop_iteration`); everything else is routed by load
//!    at once;
//! 2. body: wait for the whole body (up to `max_body_bytes`; it is complete at
//!    end of stream or when trailers arrive), parse it, resolve its model
//!    to the endpoints serving it (unknown: JSON 404; configured but listed
//!    by no answering endpoint yet: JSON 503), shed it when it is
//!    sheddable and all of them are saturated (JSON 429), route, write the
//!    chosen endpoint into the destination header, release;
//! 3. response: its status feeds passive health (consecutive 5xx eject the
//!    endpoint); a response the chosen endpoint did not send (connect
//!    failure, reset, first-byte timeout, or a retry answered by a fallback:
//!    `core::answer`) takes it out of the candidate set at once; the first
//!    body chunk from the chosen endpoint means the prefill is over (release
//!    the in-flight tokens, progress for stall detection); the stream itself
//!    passes untouched;
//! 4. log: the request is over (release the in-flight request).
//!
//! Fail-open, decided once here: a body the core cannot understand, or one
//! larger than `max_body_bytes`, is still routed (by load) and counted. Only
//! an empty pool answers (JSON 503 with `Retry-After`) with ORIGINAL_DST
//! handoff; with override_host the request goes on without a destination and
//! Envoy's fallback policy picks a cluster member. kvroute's own replies are
//! built by `kvroute_core::error_reply`; Envoy's (connect failure, 413, ...)
//! get the same JSON shape from the connection manager's local-reply mappers.

use crate::root::now_ms;
use crate::stats::{Counter, ObjectiveCounter};
use crate::vm_state::{Routed, VmState};
use kvroute_core::answer::{needs_code_details, verdict, Verdict};
use kvroute_core::config::{Handoff, STREAM_HEADER};
use kvroute_core::decode_speed;
use kvroute_core::endpoint::Endpoint;
use kvroute_core::error_reply::ErrorReply;
use kvroute_core::models::listing::{self, ModelsReply};
use kvroute_core::objectives::Objective;
use kvroute_core::path_policy;
use kvroute_core::request::{parse, read_model, ApiKind, InferenceRequest};
use log::debug;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::cell::RefCell;
use std::rc::Rc;

/// Per-request context.
pub struct RequestFilter {
    state: Rc<RefCell<VmState>>,
    api: Option<ApiKind>,
    routed: Option<Routed>,
    tokens_released: bool,
    /// The chosen endpoint's first response chunk was also the last, at
    /// this time (ms): `on_log` settles both in one in-flight update.
    answered_at: Option<u64>,
    /// When the chosen endpoint's first chunk came (ms), for a stream it
    /// answers 2xx in several chunks: how long the request held an engine
    /// slot is learnt from it (`scheduling.slot_wait`).
    first_chunk_at: Option<u64>,
    /// Bytes of request body buffered so far (read again when trailers end
    /// the body).
    body_bytes: usize,
    /// `route` ran (the request is routed, or was answered locally).
    decided: bool,
    /// False once Envoy reported that the chosen endpoint did not answer.
    chosen_answered: bool,
    /// The chosen endpoint's 2xx answer reached its end (`cache_trust`
    /// learns from it in `on_log`).
    answered_in_full: bool,
    /// The client asked for a stream (`"stream": true`).
    stream: bool,
    /// The response status is 2xx: the engine prefilled the prompt (an
    /// error answer, a 429 or a 400 as much as a 5xx, comes at once and
    /// says nothing of its prefill rate).
    answer_ok: bool,
    /// A `POST` kvroute does not hash (`/v1/embeddings`, ...) whose body is
    /// buffered only for its `model` (with `models` configured).
    read_model: bool,
    /// The request's objective (priority), from its header.
    objective: Objective,
    /// A stream the chosen endpoint answers 2xx, timed for the decode-speed
    /// model (`scheduling.decode_speed`): when its first chunk came (ms),
    /// and the bytes of the chunks since.
    streaming: Option<(u64, u64)>,
}

impl RequestFilter {
    /// A context sharing its VM's state.
    pub fn new(state: Rc<RefCell<VmState>>) -> RequestFilter {
        RequestFilter {
            state,
            api: None,
            routed: None,
            tokens_released: false,
            answered_at: None,
            first_chunk_at: None,
            body_bytes: 0,
            decided: false,
            chosen_answered: true,
            answered_in_full: false,
            stream: false,
            answer_ok: false,
            read_model: false,
            objective: Objective::DEFAULT,
            streaming: None,
        }
    }

    /// Whether the response's first chunk is a first token: a stream the
    /// engine answered with 2xx (what the TTFT model learns from).
    fn first_token(&self) -> bool {
        self.stream && self.answer_ok
    }

    /// Answers the request locally with a JSON error.
    fn reply(&self, error: ErrorReply) {
        let retry_after = error.retry_after().map(|s| s.to_string());
        let mut headers = vec![("content-type", "application/json")];
        if let Some(s) = &retry_after {
            headers.push(("retry-after", s.as_str()));
        }
        self.send_http_response(error.status(), headers, Some(error.body().as_bytes()));
    }

    /// Routes among the endpoints serving `model` (`None`: not readable)
    /// and hands the choice to Envoy; `false` when the request was answered
    /// locally (model not served, shed, empty pool).
    fn route(&mut self, request: Option<&InferenceRequest>, model: Option<&str>) -> bool {
        self.decided = true;
        let now = now_ms(self);
        let scope = self.state.borrow().router.scope(model);
        let Ok(scope) = scope else {
            self.state.borrow().stats.inc(Counter::ModelNotFound);
            self.reply(ErrorReply::ModelNotFound);
            return false;
        };
        // A configured model no answering endpoint lists (yet): 503.
        let unserved = {
            let s = self.state.borrow();
            let threshold = s.config().metrics.unhealthy_after_failures;
            s.router
                .models()
                .unserved(scope, s.router.pool(), &s.states, threshold)
        };
        if unserved {
            self.state.borrow().stats.inc(Counter::ModelUnavailable);
            self.reply(ErrorReply::ModelUnavailable);
            return false;
        }
        let objective = self.objective;
        let shed = {
            let state = self.state.borrow();
            if state.config().objectives.is_some() {
                state
                    .stats
                    .objective_inc(objective.index, ObjectiveCounter::Requests);
            }
            let shed = state.shed(objective, scope, now);
            if shed {
                state.stats.inc(Counter::Shed);
                state
                    .stats
                    .objective_inc(objective.index, ObjectiveCounter::Shed);
            }
            shed.then_some(state.config().saturation.retry_after_secs)
        };
        if let Some(retry_after_secs) = shed {
            self.reply(ErrorReply::Shed { retry_after_secs });
            return false;
        }
        let routed = self.state.borrow_mut().route(request, scope, now);
        match routed {
            Some(r) => {
                // In shadow mode Envoy's own balancer chooses.
                if r.shadow.is_none() {
                    let header = self.state.borrow().config().destination_header.clone();
                    self.set_http_request_header(&header, Some(&r.header_value()));
                }
                self.stream = request.is_some_and(|q| q.stream);
                if self.stream {
                    self.set_http_request_header(STREAM_HEADER, Some("1"));
                    // llama-server closes the connection after a stream
                    // without saying so: Envoy would pool it and could send
                    // the next request on it as it closes (reset unanswered,
                    // retried on another pod, away from its prefix). Asked
                    // for here, Envoy never reuses it.
                    let closes = r.shadow.is_none() && {
                        let state = self.state.borrow();
                        state.config().failover.close_after_stream
                            && state.states.closes_after_stream(r.endpoint)
                    };
                    if closes {
                        self.state.borrow().stats.inc(Counter::ConnectionClose);
                        self.set_http_request_header("connection", Some("close"));
                    }
                }
                self.routed = Some(r);
                true
            }
            // A cluster with members picks by its fallback policy.
            None if self.state.borrow().config().handoff == Handoff::OverrideHost => {
                self.state.borrow().stats.inc(Counter::NoEndpoint);
                true
            }
            None => {
                self.state.borrow().stats.inc(Counter::NoEndpoint);
                self.reply(ErrorReply::NoEndpoint);
                false
            }
        }
    }

    /// `shadow` mode: the response names the endpoint Envoy's balancer
    /// chose; from here the request is that endpoint's, as if kvroute had
    /// routed it there (`VmState::shadow_answered`). A response from no
    /// pool endpoint (Envoy's own reply: no upstream answered) leaves
    /// nothing to learn or settle: only the debug header is written.
    fn shadow_answered(&mut self, status: Option<u16>, upstream: Option<&str>) {
        let Some(mut r) = self.routed.take() else {
            return;
        };
        let ok = status.is_some_and(|s| (200..300).contains(&s));
        let upstream = upstream.and_then(|a| a.parse::<Endpoint>().ok());
        let now = now_ms(self);
        let ours =
            upstream.is_some_and(|u| self.state.borrow_mut().shadow_answered(&mut r, u, ok, now));
        if ours {
            self.routed = Some(r);
            return;
        }
        let name = self.state.borrow().config().debug_header.clone();
        if let (Some(name), Some(value)) = (name, r.debug) {
            self.set_http_response_header(&name, Some(&value));
        }
    }

    /// Whether `models` is configured (requests are scoped by model).
    fn has_models(&self) -> bool {
        !self.state.borrow().config().models.is_empty()
    }

    /// The `model` of a body kvroute did not parse, when models matter.
    fn model_only(&self, body: &[u8]) -> Option<String> {
        self.has_models().then(|| read_model(body)).flatten()
    }

    /// The whole body is buffered: parse it and route.
    fn body_complete(&mut self) -> Action {
        let prefix = self.state.borrow().config().prefix.clone();
        let body = self
            .get_http_request_body(0, self.body_bytes)
            .unwrap_or_default();
        let request = match self.api.map(|api| parse(api, &body, &prefix)) {
            Some(Ok(r)) => {
                self.state.borrow().stats.inc(Counter::Parsed);
                Some(r)
            }
            Some(Err(e)) => {
                debug!("kvroute: body not understood ({e:?}); routing by load");
                self.state.borrow().stats.inc(Counter::Unparsed);
                None
            }
            None => None,
        };
        let model = match &request {
            Some(r) => Some(r.model.clone()),
            None => self.model_only(&body),
        };
        if self.route(request.as_ref(), model.as_deref()) {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    /// With `models` configured, `GET /v1/models` and `/v1/models/{id}` are
    /// answered from the config (`models::listing`): `Some(Pause)` then.
    fn answer_models_path(&mut self, path: &str) -> Option<Action> {
        let canonical = path_policy::canonical(path)?;
        let reply = listing::answer(self.state.borrow().router.models(), &canonical)?;
        self.decided = true;
        self.state.borrow().stats.inc(Counter::ModelsListed);
        match reply {
            ModelsReply::Found(body) => self.send_http_response(
                200,
                vec![("content-type", "application/json")],
                Some(body.as_bytes()),
            ),
            ModelsReply::NotFound => {
                self.state.borrow().stats.inc(Counter::ModelNotFound);
                self.reply(ErrorReply::ModelNotFound);
            }
        }
        Some(Action::Pause)
    }

    /// A string property of the stream (`None` when absent or not UTF-8).
    fn property_text(&self, path: &[&str]) -> Option<String> {
        self.get_property(path.to_vec())
            .and_then(|v| String::from_utf8(v).ok())
    }
}

impl Context for RequestFilter {}

impl HttpContext for RequestFilter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // One host call for every header (values as bytes: a client's
        // non-UTF-8 value must not panic), instead of one per header read.
        let headers = self.get_http_request_headers_bytes();
        let find = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_slice())
        };
        let text = |name: &str| {
            find(name)
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default()
        };
        let (steering, stream_mark) = {
            let state = self.state.borrow();
            state.stats.inc(Counter::Requests);
            let header = &state.config().destination_header;
            (find(header).is_some(), find(STREAM_HEADER).is_some())
        };
        if steering {
            let state = self.state.borrow();
            state.stats.inc(Counter::SteeringHeaderRemoved);
            // Removes every value of the header, whatever its case on the wire.
            self.set_http_request_header(&state.config().destination_header, None);
        }
        // Only kvroute marks a request as streaming (it picks the route's
        // first-byte bound).
        if stream_mark {
            self.set_http_request_header(STREAM_HEADER, None);
        }

        let path = text(":path");
        let allowed = path_policy::is_allowed(&self.state.borrow().config().allowed_paths, &path);
        if !allowed {
            self.decided = true;
            self.state.borrow().stats.inc(Counter::PathBlocked);
            self.reply(ErrorReply::PathNotAllowed);
            return Action::Pause;
        }
        let method = find(":method").map(<[u8]>::to_vec);
        let method = method
            .as_deref()
            .map(|m| std::str::from_utf8(m).unwrap_or(""));
        if method == Some("GET") {
            if let Some(action) = self.answer_models_path(&path) {
                return action;
            }
        }
        self.objective = {
            let state = self.state.borrow();
            match &state.config().objectives {
                Some(o) => o.resolve(find(&o.header).and_then(|v| std::str::from_utf8(v).ok())),
                None => Objective::DEFAULT,
            }
        };
        let is_post = method == Some("POST");
        self.api = ApiKind::from_path(&path).filter(|_| is_post);
        self.read_model = is_post && self.api.is_none() && self.has_models();
        if (self.api.is_some() || self.read_model) && !end_of_stream {
            return Action::Pause; // wait for the body
        }
        if self.api.is_some() {
            self.state.borrow().stats.inc(Counter::Unparsed);
        } else {
            self.state.borrow().stats.inc(Counter::Passthrough);
        }
        if self.route(None, None) {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.decided {
            return Action::Continue;
        }
        self.body_bytes = body_size;
        let max = self.state.borrow().config().max_body_bytes;
        if body_size > max {
            self.state.borrow().stats.inc(Counter::BodyTooLarge);
            // The model usually leads the body: read it from the first part.
            let model = if self.has_models() {
                let head = self.get_http_request_body(0, max).unwrap_or_default();
                self.model_only(&head)
            } else {
                None
            };
            return if self.route(None, model.as_deref()) {
                Action::Continue
            } else {
                Action::Pause
            };
        }
        if !end_of_stream {
            return Action::Pause; // keep buffering (or wait for trailers)
        }
        self.body_complete()
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // Trailers end the request (HTTP/2, gRPC-style clients): the body
        // buffered so far is all there is.
        if self.decided {
            return Action::Continue;
        }
        self.body_complete()
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // Read once for a routed request (a shadow one's step needs them too).
        let answer = self.routed.is_some().then(|| {
            let status = self
                .get_http_response_header(":status")
                .and_then(|s| s.parse::<u16>().ok());
            (status, self.property_text(&["upstream", "address"]))
        });
        if let Some((status, upstream)) = &answer {
            if self.routed.as_ref().is_some_and(|r| r.shadow.is_some()) {
                self.shadow_answered(*status, upstream.as_deref());
            }
        }
        if let (Some(r), Some((status, upstream))) = (&self.routed, answer) {
            let endpoint = r.endpoint;
            self.answer_ok = status.is_some_and(|s| (200..300).contains(&s));
            let said = if needs_code_details(status, upstream.as_deref(), endpoint) {
                let details = self.property_text(&["response", "code_details"]);
                verdict(
                    details.as_deref().unwrap_or(""),
                    upstream.as_deref(),
                    endpoint,
                )
            } else {
                Verdict::Answered
            };
            if let Some(status) = status {
                // Passive health hears the status from the endpoint that
                // sent it: a fallback's answer says nothing of the chosen
                // one (which refused, failed or never answered). The clock
                // is read only when passive health has news.
                let sender = said.sender(endpoint);
                let mut state = self.state.borrow_mut();
                state.observe_response(sender, status, || now_ms(self));
                // An engine's refusal, not Envoy's own reply (no upstream
                // address, or a try that got no answer: its 503 or 504).
                let from_engine = upstream.is_some() && said != Verdict::NotAnswered;
                if from_engine && state.config().failover.retry_statuses.contains(&status) {
                    state.refused_work(sender);
                }
            }
            if let Verdict::NotAnswered | Verdict::Fallback(_) = said {
                self.chosen_answered = false;
                self.state.borrow_mut().not_answered(endpoint);
            }
            // Only a 2xx from the chosen endpoint means it cached the prompt.
            if !self.answer_ok || matches!(said, Verdict::NotAnswered | Verdict::Fallback(_)) {
                self.state.borrow_mut().refused(r, now_ms(self));
            }
            // The fallback that answered now caches the prompt.
            if let (Verdict::Fallback(served_by), true) = (said, self.answer_ok) {
                self.state
                    .borrow_mut()
                    .served_by(r, served_by, now_ms(self));
            }
        }
        let name = self.state.borrow().config().debug_header.clone();
        if let Some(name) = name {
            if let Some(value) = self.routed.as_ref().and_then(|r| r.debug.as_deref()) {
                self.set_http_response_header(&name, Some(value));
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.answered_in_full |= end_of_stream && self.answer_ok && self.chosen_answered;
        // Only a chunk the chosen endpoint sent is its progress; otherwise
        // on_log settles the request as unanswered.
        if !self.tokens_released && self.chosen_answered {
            self.tokens_released = true;
            if let Some(r) = &self.routed {
                let now = now_ms(self);
                if end_of_stream {
                    // The whole answer in one chunk: on_log comes next.
                    self.answered_at = Some(now);
                } else {
                    // A stream's first chunk is its first token; another
                    // answer's is only part of the answer.
                    if self.first_token() {
                        self.first_chunk_at = Some(now);
                    }
                    let mut state = self.state.borrow_mut();
                    state.first_chunk(r, self.objective, self.first_token(), now);
                    if self.first_token() && state.config().scheduling.decode_speed {
                        self.streaming = Some((now, 0));
                    }
                }
            }
        } else if let Some((first_ms, bytes)) = &mut self.streaming {
            *bytes += body_size as u64;
            // Short answers teach nothing: no clock read for them.
            if end_of_stream && *bytes >= decode_speed::MIN_BYTES {
                let (first_ms, bytes) = (*first_ms, *bytes);
                if let Some(r) = &self.routed {
                    let ms = now_ms(self).saturating_sub(first_ms);
                    self.state.borrow_mut().streamed(r.endpoint, bytes, ms);
                }
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if let (true, Some(r)) = (self.answered_in_full, &self.routed) {
            // Streamed: from routing to the first chunk and from it to the
            // end (the clock is read for nothing else).
            let times = self.first_chunk_at.map(|first| (first, now_ms(self)));
            self.state.borrow_mut().completed(r, times);
        }
        if let Some(at) = self.answered_at {
            if let Some(r) = self.routed.take() {
                self.state.borrow_mut().answered_and_finished(
                    &r,
                    self.objective,
                    self.first_token(),
                    at,
                );
            }
        }
        // A shadow request no response named an upstream for was never in
        // flight anywhere.
        if let Some(r) = self.routed.take().filter(|r| r.shadow.is_none()) {
            let unanswered = (!self.tokens_released).then_some(r.tokens);
            self.state.borrow_mut().finish(r.endpoint, unanswered);
        }
    }
}
