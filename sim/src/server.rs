//! The HTTP routes of one pod: the OpenAI API, `/health`, `/metrics`, `/v1/models`, and
//! the `/sim/*` fault and state endpoints.
//!
//! Every response, including errors and 404s, carries `x-kvroute-sim-pod: <index>` so a
//! test behind a router can see which pod answered.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderName, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;

use crate::cli::EngineFlavor;
use crate::faults::FaultUpdate;
use crate::openai::{
    close_chunks, error_body, open_chunk, parse_chat, parse_completion, response_body, token_chunk,
    Endpoint, InferenceRequest, ResponseMeta, UsageNumbers,
};
use crate::pod::{Generation, InferError, Pod};
use crate::scheduler::SubmitError;
use crate::synthetic_output::{piece_text, text};

/// The header naming the pod that served a response.
pub const POD_HEADER: &str = "x-kvroute-sim-pod";

/// Largest request body accepted (64 MiB).
const BODY_LIMIT: usize = 64 << 20;

fn respond(status: StatusCode, content_type: &'static str, body: impl Into<Body>) -> Response {
    let mut r = Response::new(body.into());
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    r
}

/// A JSON response.
pub fn json(status: StatusCode, body: Vec<u8>) -> Response {
    respond(status, "application/json", body)
}

/// An OpenAI-style error response.
pub fn error(status: StatusCode, message: &str, kind: &str) -> Response {
    json(status, error_body(message, kind, status.as_u16()))
}

/// A 400 `invalid_request_error`.
pub fn bad_request(message: &str) -> Response {
    error(StatusCode::BAD_REQUEST, message, "invalid_request_error")
}

/// The router of one pod.
pub fn pod_router(pod: Arc<Pod>) -> Router {
    let header_value = pod.header_value();
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/props", get(props))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/sim/fault", post(sim_fault))
        .route("/sim/reset", post(sim_reset))
        .route("/sim/state", get(sim_state))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::middleware::map_response(move |mut r: Response| {
            let v = header_value.clone();
            async move {
                r.headers_mut()
                    .insert(HeaderName::from_static(POD_HEADER), v);
                r
            }
        }))
        .with_state(pod)
}

async fn not_found() -> Response {
    json(StatusCode::NOT_FOUND, br#"{"detail":"Not Found"}"#.to_vec())
}

async fn health() -> Response {
    respond(StatusCode::OK, "application/json", Body::empty())
}

async fn models(State(pod): State<Arc<Pod>>) -> Response {
    let cfg = pod.config();
    let owner = cfg.engine.as_str();
    let base = serde_json::json!({
        "id": cfg.model,
        "object": "model",
        "created": unix_secs(),
        "owned_by": owner,
        "root": cfg.model,
        "parent": null,
        "max_model_len": cfg.kv_blocks * cfg.block_size,
        "permission": [],
    });
    // LoRA adapters are listed as vLLM lists them: their parent is the base model.
    let adapters = cfg.lora_adapters.iter().map(|a| {
        serde_json::json!({
            "id": a, "object": "model", "created": unix_secs(), "owned_by": owner,
            "root": a, "parent": cfg.model, "permission": [],
        })
    });
    let data: Vec<_> = std::iter::once(base).chain(adapters).collect();
    let body = serde_json::json!({"object": "list", "data": data});
    json(StatusCode::OK, body.to_string().into_bytes())
}

/// llama.cpp's server properties (`--engine llamacpp` only; the others
/// have no such path): its slot count is `--max-num-seqs`.
async fn props(State(pod): State<Arc<Pod>>) -> Response {
    let cfg = pod.config();
    if cfg.engine != EngineFlavor::Llamacpp {
        return not_found().await;
    }
    let body = serde_json::json!({
        "default_generation_settings": {"n_ctx": cfg.kv_blocks * cfg.block_size},
        "total_slots": cfg.max_num_seqs,
        "model_path": cfg.model,
    });
    json(StatusCode::OK, body.to_string().into_bytes())
}

async fn metrics(State(pod): State<Arc<Pod>>) -> Response {
    let text = pod.metrics_text().await;
    if pod.metrics_failing() {
        return respond(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain; charset=utf-8",
            "kvroute-sim: injected /metrics failure (metrics_error fault)\n",
        );
    }
    respond(
        StatusCode::OK,
        "text/plain; version=0.0.4; charset=utf-8",
        text,
    )
}

async fn reset_prefix_cache(State(pod): State<Arc<Pod>>) -> Response {
    pod.reset_prefix_cache();
    respond(StatusCode::OK, "application/json", Body::empty())
}

fn state_response(pod: &Pod) -> Response {
    json(
        StatusCode::OK,
        serde_json::to_vec(&pod.state()).unwrap_or_default(),
    )
}

async fn sim_state(State(pod): State<Arc<Pod>>) -> Response {
    state_response(&pod)
}

async fn sim_fault(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    match FaultUpdate::parse(&body) {
        Ok(u) => {
            pod.apply_faults(&u);
            state_response(&pod)
        }
        Err(e) => bad_request(&e),
    }
}

async fn sim_reset(State(pod): State<Arc<Pod>>) -> Response {
    pod.reset_faults();
    state_response(&pod)
}

async fn completions(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    match parse_completion(&body) {
        Ok(req) => infer(pod, req).await,
        Err(e) => bad_request(&e),
    }
}

async fn chat_completions(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    match parse_chat(&body) {
        Ok(req) => infer(pod, req).await,
        Err(e) => bad_request(&e),
    }
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn infer(pod: Arc<Pod>, req: InferenceRequest) -> Response {
    let endpoint = req.endpoint;
    let stream = req.stream;
    let include_usage = req.include_usage;
    let max_tokens = req.max_tokens;
    let gen = match pod.infer(req).await {
        Ok(g) => g,
        Err(InferError::Injected(status)) => {
            let status =
                StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let kind = if status == StatusCode::TOO_MANY_REQUESTS {
                "rate_limit_exceeded"
            } else {
                "server_error"
            };
            return error(
                status,
                "kvroute-sim: injected failure (error_rate fault)",
                kind,
            );
        }
        Err(InferError::UnknownModel(m)) => {
            // vLLM's answer for a model it does not serve.
            return error(
                StatusCode::NOT_FOUND,
                &format!("The model `{m}` does not exist."),
                "NotFoundError",
            );
        }
        Err(InferError::Rejected(SubmitError::Empty)) => {
            return bad_request("The prompt must not be empty.")
        }
        Err(InferError::Rejected(SubmitError::TooLong {
            requested,
            capacity,
        })) => {
            return bad_request(&format!(
                "This model's maximum context length is {capacity} tokens. However, you requested {requested} tokens ({} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion.",
                requested.saturating_sub(max_tokens)
            ))
        }
    };
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    let meta = ResponseMeta {
        id: format!("{prefix}-{}-{:x}", pod.index(), gen.id),
        created: unix_secs(),
        // vLLM answers with the requested model: the adapter's name for one.
        model: gen
            .adapter()
            .map_or_else(|| pod.config().model.clone(), str::to_owned),
    };
    if stream {
        stream_response(endpoint, meta, gen, include_usage)
    } else {
        full_response(endpoint, meta, gen).await
    }
}

async fn full_response(endpoint: Endpoint, meta: ResponseMeta, mut gen: Generation) -> Response {
    let mut last = None;
    while let Some(p) = gen.next().await {
        let finished = p.finished;
        last = Some(p);
        if finished {
            break;
        }
    }
    match last {
        Some(p) if p.finished => {
            let usage = UsageNumbers {
                prompt_tokens: gen.prompt_len,
                completion_tokens: p.generated,
                cached_tokens: p.cached_tokens,
            };
            let body = response_body(endpoint, &meta, &text(&gen.pieces[..p.generated]), usage);
            json(StatusCode::OK, body)
        }
        _ => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "kvroute-sim: request dropped by the engine",
            "server_error",
        ),
    }
}

struct StreamState {
    endpoint: Endpoint,
    meta: ResponseMeta,
    gen: Generation,
    include_usage: bool,
    emitted: usize,
    opened: bool,
    done: bool,
}

impl StreamState {
    /// The bytes for one progress report (all tokens since the last one).
    fn frame(&mut self, generated: usize, cached_tokens: usize, finished: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(256 * (generated - self.emitted.min(generated) + 1));
        if !self.opened {
            open_chunk(self.endpoint, &self.meta, &mut out);
            self.opened = true;
        }
        let upto = generated.min(self.gen.pieces.len());
        for i in self.emitted..upto {
            let last = finished && i + 1 == upto;
            token_chunk(
                self.endpoint,
                &self.meta,
                piece_text(self.gen.pieces[i]),
                last,
                &mut out,
            );
        }
        self.emitted = self.emitted.max(upto);
        if finished {
            let usage = self.include_usage.then_some(UsageNumbers {
                prompt_tokens: self.gen.prompt_len,
                completion_tokens: generated,
                cached_tokens,
            });
            close_chunks(self.endpoint, &self.meta, usage, &mut out);
            self.done = true;
        }
        out
    }
}

fn stream_response(
    endpoint: Endpoint,
    meta: ResponseMeta,
    gen: Generation,
    include_usage: bool,
) -> Response {
    let state = StreamState {
        endpoint,
        meta,
        gen,
        include_usage,
        emitted: 0,
        opened: false,
        done: false,
    };
    let body_stream = futures_util::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        // The opening event (chat: `delta.role`) goes out with the first token, as
        // in vLLM, whose stream generator writes it on the engine's first output
        // (after the prefill): a router may take the first body bytes as "prefill
        // done".
        match st.gen.next().await {
            Some(p) => {
                let frame = st.frame(p.generated, p.cached_tokens, p.finished);
                Some((Ok::<Bytes, std::io::Error>(Bytes::from(frame)), st))
            }
            None => None,
        }
    });
    let mut r = respond(
        StatusCode::OK,
        "text/event-stream",
        Body::from_stream(body_stream),
    );
    r.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    r
}
