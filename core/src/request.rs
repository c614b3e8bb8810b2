//! Request understanding: an OpenAI-style JSON body becomes the facts routing
//! needs (model, cache salt, chained block hashes of the canonical prompt).
//! STUB: owned by the request/prefix work; the API below is the contract.

use crate::config::PrefixConfig;

/// Which OpenAI inference API a path is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiKind {
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/chat/completions`
    ChatCompletions,
}

impl ApiKind {
    /// The API of a request path (query string ignored), if it is one kvroute parses.
    pub fn from_path(path: &str) -> Option<ApiKind> {
        let path = path.split(['?', '#']).next().unwrap_or("");
        match path {
            "/v1/completions" => Some(ApiKind::Completions),
            "/v1/chat/completions" => Some(ApiKind::ChatCompletions),
            _ => None,
        }
    }
}

/// What routing needs to know about one inference request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InferenceRequest {
    /// The `model` field.
    pub model: String,
    /// The `cache_salt` field, if any.
    pub cache_salt: Option<String>,
    /// `stream: true`.
    pub stream: bool,
    /// Length of the canonical prompt in bytes (before any cap).
    pub prompt_bytes: usize,
    /// Chained hashes of the full blocks of the canonical prompt (capped at
    /// `PrefixConfig::max_blocks`). Block 0 is seeded with model and salt.
    pub blocks: Vec<u64>,
}

impl InferenceRequest {
    /// Approximate prompt tokens (`prompt_bytes / bytes_per_token`, at least 1).
    pub fn prompt_tokens(&self, cfg: &PrefixConfig) -> u64 {
        ((self.prompt_bytes / cfg.bytes_per_token.max(1)) as u64).max(1)
    }
}

/// Why a body could not be understood (the request is then routed by load).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestError {
    /// Not valid JSON (or not UTF-8, or nested too deep).
    InvalidJson(String),
    /// Valid JSON without a usable prompt (`prompt` / `messages`).
    MissingPrompt,
    /// A field has the wrong type.
    WrongType(&'static str),
}

/// Parses a body of the given API into an [`InferenceRequest`].
pub fn parse(
    _kind: ApiKind,
    _body: &[u8],
    _cfg: &PrefixConfig,
) -> Result<InferenceRequest, RequestError> {
    Err(RequestError::MissingPrompt)
}
