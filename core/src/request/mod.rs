//! Request understanding: an OpenAI-style JSON body becomes the facts routing
//! needs (model, cache salt, stream flag, prompt size and the chained block
//! hashes of the *canonical prompt*). It runs on every request inside Envoy,
//! on client bodies of several MiB, so its cost must follow what routing
//! needs, never the body's shape: wasm linear memory never shrinks, and one
//! crafted body must not grow a VM for good.
//!
//! # How a body is read: one streaming pass, nothing materialized
//!
//! The body is read once, and the prompt is hashed as it is read: each
//! message, content part and prompt item goes into the streaming
//! [`BlockHasher`] and is dropped, so there is no vector of messages or
//! parts and no [`serde_json::Value`] of the body. What the block hashes
//! depend on but may come after the prompt in the body (`model`,
//! `cache_salt`, `tools`) goes into the seed, which seals the hashes at the
//! end (see [`crate::prefix::block`]). Within a message, the content is
//! hashed straight from the body wherever it stands among the message's
//! keys: the role, name, tool call id and tool calls, small, follow it in
//! the canonical prompt, so they never hold it back.
//!
//! Only `tools` and `tool_calls` are built as values (their keys are sorted
//! for the canonical text), under a budget of `prefix.max_json_nodes` JSON
//! values per request; a body over it is [`RequestError::TooComplex`] and
//! is routed by load. Once `max_prompt_tokens` worth of blocks is hashed,
//! the remaining messages and parts are skipped as spans and only their raw
//! length is counted (so `prompt_bytes` is an estimate past the cap).
//!
//! Cost per body: each byte is scanned once (tool calls and what lies past
//! the cap twice), and the heap peak is at
//! most [`parse_cost_bound`]: three times the body (a JSON-escaped string is
//! unescaped into serde_json's growing scratch buffer and may be copied
//! once), the hash vector and its sub-block checkpoints, and the value budget.
//!
//! # Canonical prompt
//!
//! The canonical bytes are an approximation of what the engine's chat
//! template renders, built so that **turn N+1 of a conversation starts with
//! exactly the bytes of turn N**: everything is a concatenation of
//! per-message records, with nothing that depends on which message is last
//! (no length prefix of the whole, no generation prompt), and the tool
//! definitions, which stay the same across turns, come first (where real
//! templates put them: the system area).
//!
//! Chat (`/v1/chat/completions`):
//!
//! ```text
//! [<|tools|>\n{tools as compact JSON, keys sorted}\n<|end|>\n]   only if tools is a non-empty array:
//!                                 not hashed as bytes but as the seed (its xxh3 mixed into
//!                                 the model/salt seed) and as len / block_bytes leading
//!                                 blocks shared by all requests with the same tools
//! per message:
//! {content}                       string, or the parts joined by "\n":
//!                                 text / input_text / output_text -> text,
//!                                 refusal -> refusal text,
//!                                 anything else -> <|{type}:{16 hex xxh3 of its payload}|>
//! <|{role}[ name={name}][ tool_call_id={id}]|>
//! [<|tool_calls|>{tool_calls as compact JSON, keys sorted}]
//! <|end|>\n
//! ```
//!
//! A string content and a single text part give the same bytes. Images and
//! other media contribute a fixed-size digest of their URL or data, so a
//! multi-MiB base64 image neither inflates the token estimate nor gets
//! copied. Markers are plain text: content that contains them can alias
//! another layout, which at worst misleads a routing guess (as in real
//! templates, where such text is not special either).
//!
//! Completions (`/v1/completions`): a string prompt is its raw bytes (so a
//! continuation `prompt + more` extends the prefix); token ids are
//! `<|token_ids|>` followed by each id as 4 little-endian bytes (about the
//! default 4 bytes per token); a list of prompts (a batch, routed as one
//! request) is its items joined by `\n<|next_prompt|>\n`, so a one-item list
//! equals the item.
//!
//! The hashes are sealed with the model and `cache_salt`
//! ([`crate::prefix::seed`]) and the tools' digest. Only the first
//! `max_prompt_tokens` worth of blocks is hashed; `prompt_bytes` counts the
//! whole canonical prompt, tools included.
//!
//! # Bad input
//!
//! Non-UTF-8 (anywhere in the body), invalid JSON, trailing garbage and
//! nesting deeper than serde_json's limit (128) inside the values kvroute
//! builds are [`RequestError::InvalidJson`] (everything else is skipped by
//! serde_json without recursion, whatever its depth); a known field of the
//! wrong type is [`RequestError::WrongType`] naming the top-level field; no
//! prompt is [`RequestError::MissingPrompt`]. A request without `model` is
//! hashed under the empty model name (the server's default model).
//! Duplicate top-level keys: the last one wins, as in the Python servers
//! behind kvroute. Nothing here panics on client data.

mod chat;
mod completions;
mod json_budget;
mod model_field;
#[cfg(test)]
mod tests;

use crate::config::PrefixConfig;
use crate::prefix::block::{seed, seed_with_tools, BlockHasher, Leaves, PromptHashes};
use crate::prefix::Prompt;
use json_budget::Budget;
pub use model_field::read_model;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;

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
    /// The `model` field (never empty).
    pub model: String,
    /// The `cache_salt` field, if any (as sent; `Some("")` hashes like `None`).
    pub cache_salt: Option<String>,
    /// `stream: true`.
    pub stream: bool,
    /// Length of the canonical prompt in bytes (before any cap; past the
    /// hashed cap, skipped elements count their raw JSON length).
    pub prompt_bytes: usize,
    /// Chained hashes of the full blocks of the canonical prompt (capped at
    /// `PrefixConfig::max_blocks`). Block 0 is seeded with model and salt.
    pub blocks: Vec<u64>,
    /// Sub-block checkpoints of the canonical prompt: its leaf (where it
    /// ends mid-block) and what the next turn matches against it (see
    /// [`Leaves`]).
    pub leaves: Leaves,
}

impl InferenceRequest {
    /// The request as the router sees it: blocks and checkpoints.
    pub fn prompt(&self) -> Prompt<'_> {
        Prompt {
            blocks: &self.blocks,
            leaves: Some(&self.leaves),
        }
    }

    /// What routing this request teaches the prefix index (and what the
    /// decision log carries): its block hashes, then its leaf if it has one.
    pub fn learned(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.blocks.len() + 1);
        out.extend_from_slice(&self.blocks);
        out.extend(self.leaves.leaf());
        out
    }

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
    /// A field has the wrong type (the top-level field it is in; `body` when
    /// the body is not a JSON object).
    WrongType(&'static str),
    /// `tools` and `tool_calls` hold more JSON values than
    /// `prefix.max_json_nodes`: not worth reading to route.
    TooComplex,
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestError::InvalidJson(e) => write!(f, "invalid JSON body: {e}"),
            RequestError::MissingPrompt => write!(f, "no prompt (`prompt` / `messages`)"),
            RequestError::WrongType(field) => write!(f, "field `{field}` has the wrong type"),
            RequestError::TooComplex => {
                write!(
                    f,
                    "`tools` / `tool_calls` hold more JSON values than the budget"
                )
            }
        }
    }
}

impl std::error::Error for RequestError {}

/// The most heap [`parse`] allocates for a body of `body_len` bytes (the
/// body itself not included): three times the body (a string with escapes
/// is unescaped into serde_json's scratch buffer, which may grow to twice
/// its length, and may be copied out once), the block hashes and their
/// checkpoints (8 + 24 bytes per block, twice for a growing vector), the
/// `tools`/`tool_calls` value budget and a fixed allowance. The
/// bound `tests/hostile_bodies.rs` holds every hostile shape to, and the
/// per-request term of the VM memory bound in docs/ARCHITECTURE.md.
pub fn parse_cost_bound(body_len: usize, cfg: &PrefixConfig) -> usize {
    3 * body_len
        + 64 * cfg.max_blocks()
        + cfg.block_bytes()
        + json_budget::BYTES_PER_NODE * cfg.max_json_nodes
        + (64 << 10)
}

/// Parses a body of the given API into an [`InferenceRequest`].
pub fn parse(
    kind: ApiKind,
    body: &[u8],
    cfg: &PrefixConfig,
) -> Result<InferenceRequest, RequestError> {
    let text = std::str::from_utf8(body)
        .map_err(|_| RequestError::InvalidJson("body is not UTF-8".into()))?;
    let field = Cell::new("body");
    let failure = Cell::new(None);
    let budget = Budget::new(cfg.max_json_nodes);
    let mut h = BlockHasher::new(cfg.block_bytes(), cfg.max_blocks());
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = BodySeed {
        kind,
        cfg,
        text_len: text.len(),
        field: &field,
        failure: &failure,
        budget: &budget,
        h: &mut h,
    }
    .deserialize(&mut de)
    .and_then(|b| de.end().map(|()| b));
    let body = parsed.map_err(|e| {
        failure.take().unwrap_or_else(|| {
            if budget.exceeded() {
                RequestError::TooComplex
            } else {
                classify(e, field.get())
            }
        })
    })?;
    if !body.prompt {
        return Err(RequestError::MissingPrompt);
    }

    // vLLM and SGLang serve a request without `model` with their default
    // model: such requests share the namespace of the empty model name
    // rather than losing prefix affinity.
    let model = body.model.map_or(Cow::Borrowed(""), |Text(m)| m);
    let salt = body.cache_salt.map(|Text(s)| s);
    let mut seed = seed(&model, salt.as_deref());
    let mut prompt_bytes = h.bytes_written();
    let mut lead = 0;
    if let Some(tools) = body.tools {
        seed = seed_with_tools(seed, tools.digest);
        prompt_bytes += tools.bytes;
        lead = tools.bytes.checked_div(cfg.block_bytes()).unwrap_or(0);
    }
    let PromptHashes { blocks, leaves } = h.finish_prompt(seed, lead);
    Ok(InferenceRequest {
        model: model.into_owned(),
        cache_salt: salt.map(Cow::into_owned),
        stream: body.stream.unwrap_or(false),
        prompt_bytes,
        blocks,
        leaves,
    })
}

/// A serde_json error as a [`RequestError`] about `field`: a wrong type or
/// shape is the client's field, anything else is broken JSON.
fn classify(e: serde_json::Error, field: &'static str) -> RequestError {
    match e.classify() {
        serde_json::error::Category::Data => RequestError::WrongType(field),
        _ => RequestError::InvalidJson(e.to_string()),
    }
}

/// Runs `seed` over one span of the body (a message's tool calls, kept
/// until its content is written) and maps its errors to `field`. A seed that fails for a reason of its
/// own (budget, missing prompt) leaves it in `failure`, which wins over
/// serde_json's error used to unwind.
fn read_span<'de, S: DeserializeSeed<'de>>(
    span: &'de RawValue,
    seed: S,
    field: &'static str,
    failure: &Cell<Option<RequestError>>,
) -> Result<S::Value, RequestError> {
    let mut de = serde_json::Deserializer::from_str(span.get());
    seed.deserialize(&mut de)
        .map_err(|e| failure.take().unwrap_or_else(|| classify(e, field)))
}

// ---------------------------------------------------------------------------
// The top-level object

/// A JSON string, borrowed from the body unless it had escapes.
#[derive(Debug)]
struct Text<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Borrowed(s)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Owned(s.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

/// The top-level fields kvroute reads; everything else is skipped unread.
/// The prompt itself goes straight into the hasher.
#[derive(Default)]
struct Body<'a> {
    model: Option<Text<'a>>,
    cache_salt: Option<Text<'a>>,
    stream: Option<bool>,
    /// A non-empty `prompt` / `messages` was read.
    prompt: bool,
    tools: Option<chat::Tools>,
}

/// Parses the top-level object, hashing the prompt as it is read and
/// recording in `field` which top-level field is being read so a type error
/// can name it.
struct BodySeed<'c, 'h> {
    kind: ApiKind,
    cfg: &'c PrefixConfig,
    text_len: usize,
    field: &'c Cell<&'static str>,
    failure: &'c Cell<Option<RequestError>>,
    budget: &'c Budget,
    h: &'h mut BlockHasher,
}

impl BodySeed<'_, '_> {
    /// A fresh hasher for a prompt field (a duplicate key replaces the
    /// earlier one: the last one wins).
    fn start_prompt(&mut self) {
        *self.h = BlockHasher::new(self.cfg.block_bytes(), self.cfg.max_blocks());
        // The canonical prompt is about as long as the body, never much longer.
        self.h.reserve_for(self.text_len);
    }
}

enum Field {
    Model,
    CacheSalt,
    Stream,
    Prompt,
    Messages,
    Tools,
    Other,
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Field;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Field, E> {
                Ok(match s {
                    "model" => Field::Model,
                    "cache_salt" => Field::CacheSalt,
                    "stream" => Field::Stream,
                    "prompt" => Field::Prompt,
                    "messages" => Field::Messages,
                    "tools" => Field::Tools,
                    _ => Field::Other,
                })
            }
        }
        d.deserialize_identifier(V)
    }
}

impl<'de> DeserializeSeed<'de> for BodySeed<'_, '_> {
    type Value = Body<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Body<'de>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BodySeed<'_, '_> {
    type Value = Body<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<Body<'de>, A::Error> {
        let chat = self.kind == ApiKind::ChatCompletions;
        let mut b = Body::default();
        while let Some(key) = map.next_key::<Field>()? {
            match key {
                Field::Model => {
                    self.field.set("model");
                    b.model = map.next_value()?;
                }
                Field::CacheSalt => {
                    self.field.set("cache_salt");
                    b.cache_salt = map.next_value()?;
                }
                Field::Stream => {
                    self.field.set("stream");
                    b.stream = map.next_value()?;
                }
                Field::Prompt if !chat => {
                    self.field.set("prompt");
                    self.start_prompt();
                    b.prompt = map.next_value_seed(completions::PromptSeed { h: &mut *self.h })?;
                }
                Field::Messages if chat => {
                    self.field.set("messages");
                    self.start_prompt();
                    b.prompt = map.next_value_seed(chat::MessagesSeed {
                        h: &mut *self.h,
                        budget: self.budget,
                        failure: self.failure,
                    })?;
                }
                Field::Tools if chat => {
                    self.field.set("tools");
                    b.tools = map.next_value_seed(chat::ToolsSeed(self.budget))?;
                }
                _ => {
                    self.field.set("body");
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        self.field.set("body");
        Ok(b)
    }
}
