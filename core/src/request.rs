//! Request understanding: an OpenAI-style JSON body becomes the facts routing
//! needs (model, cache salt, stream flag, prompt size and the chained block
//! hashes of the *canonical prompt*). It runs on every request inside Envoy,
//! on bodies of several MiB, so it parses once with serde_json into borrowed
//! structures (strings are only copied when JSON escapes force it) and feeds
//! the canonical bytes piece by piece into a streaming
//! [`BlockHasher`]: the canonical prompt is never
//! materialized as one buffer.
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
//! [<|tools|>\n{tools as compact JSON, keys sorted}\n<|end|>\n]   only if tools is a non-empty array
//! per message:
//! <|{role}[ name={name}][ tool_call_id={id}]|>\n
//! {content}                       string, or the parts joined by "\n":
//!                                 text / input_text / output_text -> text,
//!                                 refusal -> refusal text,
//!                                 anything else -> <|{type}:{16 hex xxh3 of its payload}|>
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
//! Block 0 is seeded with the model and `cache_salt`
//! ([`crate::prefix::seed`]). Only the first `max_prompt_tokens` worth of
//! blocks is hashed; `prompt_bytes` counts the whole canonical prompt.
//!
//! # Bad input
//!
//! Non-UTF-8 (anywhere in the body), invalid JSON, trailing garbage and
//! nesting deeper than serde_json's limit (128) inside the fields kvroute
//! reads are [`RequestError::InvalidJson`] (fields it does not read are
//! skipped by serde_json without recursion, whatever their depth); a known field
//! of the wrong type is [`RequestError::WrongType`] naming the top-level
//! field; no prompt is [`RequestError::MissingPrompt`]. A request without `model`
//! is hashed under the empty model name (the server's default model). Duplicate top-level keys: the last one
//! wins, as in the Python servers behind kvroute. Nothing here panics on
//! client data.

use crate::config::PrefixConfig;
use crate::prefix::block::{seed, BlockHasher};
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;
use xxhash_rust::xxh3::Xxh3;

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
    /// A field has the wrong type (the top-level field it is in; `body` when
    /// the body is not a JSON object).
    WrongType(&'static str),
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestError::InvalidJson(e) => write!(f, "invalid JSON body: {e}"),
            RequestError::MissingPrompt => write!(f, "no prompt (`prompt` / `messages`)"),
            RequestError::WrongType(field) => write!(f, "field `{field}` has the wrong type"),
        }
    }
}

impl std::error::Error for RequestError {}

/// Parses a body of the given API into an [`InferenceRequest`].
pub fn parse(
    kind: ApiKind,
    body: &[u8],
    cfg: &PrefixConfig,
) -> Result<InferenceRequest, RequestError> {
    let text = std::str::from_utf8(body)
        .map_err(|_| RequestError::InvalidJson("body is not UTF-8".into()))?;
    let field = Cell::new("body");
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = BodySeed {
        kind,
        field: &field,
    }
    .deserialize(&mut de)
    .and_then(|b| de.end().map(|()| b));
    let body = parsed.map_err(|e| match e.classify() {
        serde_json::error::Category::Data => RequestError::WrongType(field.get()),
        _ => RequestError::InvalidJson(e.to_string()),
    })?;

    // vLLM and SGLang serve a request without `model` with their default
    // model: such requests share the namespace of the empty model name
    // rather than losing prefix affinity.
    let model = body.model.map_or(Cow::Borrowed(""), |Text(m)| m);
    let salt = body.cache_salt.map(|Text(s)| s);
    let mut h = BlockHasher::new(
        seed(&model, salt.as_deref()),
        cfg.block_bytes(),
        cfg.max_blocks(),
    );
    // The canonical prompt is about as long as the body, never much longer.
    h.reserve_for(text.len());
    match kind {
        ApiKind::Completions => match body.prompt {
            Some(prompt) if !prompt.is_empty() => write_prompt(&mut h, &prompt),
            _ => return Err(RequestError::MissingPrompt),
        },
        ApiKind::ChatCompletions => {
            let messages = body.messages.unwrap_or_default();
            if messages.is_empty() {
                return Err(RequestError::MissingPrompt);
            }
            write_chat(&mut h, body.tools.as_ref(), &messages)?;
        }
    }
    Ok(InferenceRequest {
        model: model.into_owned(),
        cache_salt: salt.map(Cow::into_owned),
        stream: body.stream.unwrap_or(false),
        prompt_bytes: h.bytes_written(),
        blocks: h.finish(),
    })
}

// ---------------------------------------------------------------------------
// Canonical writers

const END: &[u8] = b"<|end|>\n";
const NEXT_PROMPT: &[u8] = b"\n<|next_prompt|>\n";
const TOKEN_IDS: &[u8] = b"<|token_ids|>";

fn write_prompt(h: &mut BlockHasher, prompt: &Prompt<'_>) {
    match prompt {
        Prompt::Texts(items) => {
            for (i, t) in items.iter().enumerate() {
                if i > 0 {
                    h.write(NEXT_PROMPT);
                }
                h.write(t.as_bytes());
            }
        }
        Prompt::TokenLists(lists) => {
            for (i, ids) in lists.iter().enumerate() {
                if i > 0 {
                    h.write(NEXT_PROMPT);
                }
                h.write(TOKEN_IDS);
                for id in ids {
                    h.write(&id.to_le_bytes());
                }
            }
        }
    }
}

fn write_json(h: &mut BlockHasher, v: &serde_json::Value) -> Result<(), RequestError> {
    // Value maps are sorted (BTreeMap), so the text is stable whatever the
    // client's key order. Writing into the hasher cannot fail.
    serde_json::to_writer(h, v).map_err(|e| RequestError::InvalidJson(e.to_string()))
}

fn write_chat(
    h: &mut BlockHasher,
    tools: Option<&serde_json::Value>,
    messages: &[Message<'_>],
) -> Result<(), RequestError> {
    match tools {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Array(a)) if a.is_empty() => {}
        Some(t @ serde_json::Value::Array(_)) => {
            h.write(b"<|tools|>\n");
            write_json(h, t)?;
            h.write(b"\n");
            h.write(END);
        }
        Some(_) => return Err(RequestError::WrongType("tools")),
    }
    for m in messages {
        h.write(b"<|");
        h.write(m.role.0.as_bytes());
        if let Some(Text(name)) = &m.name {
            h.write(b" name=");
            h.write(name.as_bytes());
        }
        if let Some(Text(id)) = &m.tool_call_id {
            h.write(b" tool_call_id=");
            h.write(id.as_bytes());
        }
        h.write(b"|>\n");
        match &m.content {
            None => {}
            Some(Content::Text(t)) => h.write(t.as_bytes()),
            Some(Content::Parts(parts)) => {
                for (i, p) in parts.iter().enumerate() {
                    if i > 0 {
                        h.write(b"\n");
                    }
                    write_part(h, p);
                }
            }
        }
        match &m.tool_calls {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::Array(a)) if a.is_empty() => {}
            Some(calls) => {
                h.write(b"<|tool_calls|>");
                write_json(h, calls)?;
            }
        }
        h.write(END);
    }
    Ok(())
}

fn write_part(h: &mut BlockHasher, p: &Part<'_>) {
    let kind = p.kind.0.as_ref();
    match kind {
        "text" | "input_text" | "output_text" => {
            if let Some(Text(t)) = &p.text {
                h.write(t.as_bytes());
            }
        }
        "refusal" => {
            if let Some(Text(t)) = &p.refusal {
                h.write(t.as_bytes());
            }
        }
        _ => {
            // A stable, fixed-size stand-in for media: a digest of whatever
            // payload fields the part has (URL, data, file id, ...).
            let mut d = Xxh3::new();
            for m in [
                &p.image_url,
                &p.video_url,
                &p.audio_url,
                &p.input_audio,
                &p.file,
            ]
            .into_iter()
            .flatten()
            {
                for f in [
                    &m.url,
                    &m.data,
                    &m.format,
                    &m.file_id,
                    &m.file_data,
                    &m.filename,
                ] {
                    match f {
                        Some(Text(s)) => {
                            d.update(&(s.len() as u64).to_le_bytes());
                            d.update(s.as_bytes());
                        }
                        None => d.update(&[0xff]),
                    }
                }
            }
            if let Some(Text(t)) = &p.text {
                d.update(t.as_bytes());
            }
            h.write(b"<|");
            h.write(kind.as_bytes());
            h.write(format!(":{:016x}|>", d.digest()).as_bytes());
        }
    }
}

// ---------------------------------------------------------------------------
// Borrowed body structures

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
            fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
                Ok(Text(Cow::Owned(s)))
            }
        }
        d.deserialize_str(V)
    }
}

/// The top-level fields kvroute reads; everything else is skipped unread.
#[derive(Default)]
struct Body<'a> {
    model: Option<Text<'a>>,
    cache_salt: Option<Text<'a>>,
    stream: Option<bool>,
    prompt: Option<Prompt<'a>>,
    messages: Option<Vec<Message<'a>>>,
    tools: Option<serde_json::Value>,
}

/// Parses the top-level object, recording in `field` which top-level field
/// is being read so a type error can name it.
struct BodySeed<'c> {
    kind: ApiKind,
    field: &'c Cell<&'static str>,
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

impl<'de> DeserializeSeed<'de> for BodySeed<'_> {
    type Value = Body<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Body<'de>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BodySeed<'_> {
    type Value = Body<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Body<'de>, A::Error> {
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
                    b.prompt = map.next_value()?;
                }
                Field::Messages if chat => {
                    self.field.set("messages");
                    b.messages = map.next_value()?;
                }
                Field::Tools if chat => {
                    self.field.set("tools");
                    b.tools = map.next_value()?;
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

/// A completions `prompt`: strings or token-id lists (a single one is a
/// list of one).
#[derive(Debug)]
enum Prompt<'a> {
    Texts(Vec<Cow<'a, str>>),
    TokenLists(Vec<Vec<u32>>),
}

/// One element of a `prompt` array.
enum PromptItem<'a> {
    Text(Cow<'a, str>),
    Token(u32),
    Tokens(Vec<u32>),
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptItem<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptItem<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, a token id or a list of token ids")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(PromptItem::Text(Cow::Borrowed(s)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(PromptItem::Text(Cow::Owned(s.to_owned())))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                u32::try_from(v)
                    .map(PromptItem::Token)
                    .map_err(|_| E::custom("token id out of range"))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(PromptItem::Tokens(ids))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Prompt<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Prompt<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, a list of strings or token ids")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(Prompt::Texts(vec![Cow::Borrowed(s)]))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(Prompt::Texts(vec![Cow::Owned(s.to_owned())]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mixed = || de::Error::custom("prompt list mixes kinds of items");
                let mut texts = Vec::new();
                let mut flat = Vec::new();
                let mut lists = Vec::new();
                while let Some(item) = seq.next_element::<PromptItem<'de>>()? {
                    match item {
                        PromptItem::Text(t) if flat.is_empty() && lists.is_empty() => texts.push(t),
                        PromptItem::Token(id) if texts.is_empty() && lists.is_empty() => {
                            flat.push(id)
                        }
                        PromptItem::Tokens(ids) if texts.is_empty() && flat.is_empty() => {
                            lists.push(ids)
                        }
                        _ => return Err(mixed()),
                    }
                }
                Ok(if !texts.is_empty() {
                    Prompt::Texts(texts)
                } else if !flat.is_empty() {
                    Prompt::TokenLists(vec![flat])
                } else {
                    // Empty `[]` is a list of no lists: no prompt at all.
                    Prompt::TokenLists(lists)
                })
            }
        }
        d.deserialize_any(V)
    }
}

impl Prompt<'_> {
    fn is_empty(&self) -> bool {
        match self {
            Prompt::Texts(t) => t.is_empty(),
            Prompt::TokenLists(l) => l.is_empty(),
        }
    }
}

/// One chat message: only the fields that reach the prompt.
#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Text<'a>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    #[serde(borrow, default)]
    name: Option<Text<'a>>,
    #[serde(borrow, default)]
    tool_call_id: Option<Text<'a>>,
    #[serde(default)]
    tool_calls: Option<serde_json::Value>,
}

/// Message content: a string or content parts.
enum Content<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<Part<'a>>),
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Content<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or a list of content parts")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Borrowed(s)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Owned(s.to_owned())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::new();
                while let Some(p) = seq.next_element::<Part<'de>>()? {
                    parts.push(p);
                }
                Ok(Content::Parts(parts))
            }
        }
        d.deserialize_any(V)
    }
}

/// One content part (`{"type": "text", "text": ...}`, `image_url`, ...).
#[derive(Deserialize)]
struct Part<'a> {
    #[serde(rename = "type", borrow)]
    kind: Text<'a>,
    #[serde(borrow, default)]
    text: Option<Text<'a>>,
    #[serde(borrow, default)]
    refusal: Option<Text<'a>>,
    #[serde(borrow, default)]
    image_url: Option<Media<'a>>,
    #[serde(borrow, default)]
    video_url: Option<Media<'a>>,
    #[serde(borrow, default)]
    audio_url: Option<Media<'a>>,
    #[serde(borrow, default)]
    input_audio: Option<Media<'a>>,
    #[serde(borrow, default)]
    file: Option<Media<'a>>,
}

/// The payload object of a media part; its fields feed the part's digest.
#[derive(Deserialize)]
struct Media<'a> {
    #[serde(borrow, default)]
    url: Option<Text<'a>>,
    #[serde(borrow, default)]
    data: Option<Text<'a>>,
    #[serde(borrow, default)]
    format: Option<Text<'a>>,
    #[serde(borrow, default)]
    file_id: Option<Text<'a>>,
    #[serde(borrow, default)]
    file_data: Option<Text<'a>>,
    #[serde(borrow, default)]
    filename: Option<Text<'a>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::block::block_hashes;
    use serde_json::{json, Value};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const CHAT: ApiKind = ApiKind::ChatCompletions;
    const COMP: ApiKind = ApiKind::Completions;

    /// One byte per block: the blocks then pin the canonical bytes exactly.
    fn bytewise() -> PrefixConfig {
        PrefixConfig {
            block_tokens: 1,
            bytes_per_token: 1,
            max_prompt_tokens: 1 << 30,
            ..PrefixConfig::default()
        }
    }

    fn p(kind: ApiKind, body: &str) -> Result<InferenceRequest, RequestError> {
        parse(kind, body.as_bytes(), &bytewise())
    }

    /// Asserts that `body` canonicalizes to exactly `want`.
    fn assert_canonical(kind: ApiKind, body: &str, want: &[u8]) {
        let r = p(kind, body).unwrap_or_else(|e| panic!("{body}: {e}"));
        let expect = block_hashes(seed(&r.model, r.cache_salt.as_deref()), want, 1, usize::MAX);
        let same = r
            .blocks
            .iter()
            .zip(&expect)
            .take_while(|(a, b)| a == b)
            .count();
        assert!(
            r.blocks == expect && r.prompt_bytes == want.len(),
            "{body}\n first differing byte {same} of want {:?}",
            String::from_utf8_lossy(want)
        );
    }

    fn tokens(ids: &[u32]) -> Vec<u8> {
        let mut v = TOKEN_IDS.to_vec();
        for id in ids {
            v.extend_from_slice(&id.to_le_bytes());
        }
        v
    }

    fn is_prefix(a: &[u64], b: &[u64]) -> bool {
        b.len() >= a.len() && b[..a.len()] == *a
    }

    #[test]
    fn api_kind_from_path() {
        for (path, want) in [
            ("/v1/completions", Some(COMP)),
            ("/v1/chat/completions", Some(CHAT)),
            ("/v1/chat/completions?x=1", Some(CHAT)),
            ("/v1/completions#f", Some(COMP)),
            ("/v1/models", None),
            ("/v1/chat/completions/", None),
            ("", None),
        ] {
            assert_eq!(ApiKind::from_path(path), want, "{path}");
        }
    }

    #[test]
    fn completions_prompt_shapes() {
        let mut batch = b"a".to_vec();
        batch.extend_from_slice(NEXT_PROMPT);
        batch.extend_from_slice(b"b\nc");
        let mut tok_batch = tokens(&[1, 2]);
        tok_batch.extend_from_slice(NEXT_PROMPT);
        tok_batch.extend_from_slice(&tokens(&[3]));
        let cases: Vec<(&str, Vec<u8>)> = vec![
            (r#"{"model":"m","prompt":"hello"}"#, b"hello".to_vec()),
            (r#"{"model":"m","prompt":["hello"]}"#, b"hello".to_vec()),
            (
                r#"{"model":"m","prompt":"a\nb\u00e9"}"#,
                "a\nbé".as_bytes().to_vec(),
            ),
            (r#"{"model":"m","prompt":""}"#, vec![]),
            (r#"{"model":"m","prompt":["a","b\nc"]}"#, batch),
            (
                r#"{"model":"m","prompt":[1,2,4294967295]}"#,
                tokens(&[1, 2, u32::MAX]),
            ),
            (r#"{"model":"m","prompt":[[1,2,3]]}"#, tokens(&[1, 2, 3])),
            (r#"{"model":"m","prompt":[[1,2],[3]]}"#, tok_batch),
            (r#"{"model":"m","prompt":[[]]}"#, tokens(&[])),
            (
                r#"{"prompt":"x","messages":[{"role":"user","content":"ignored"}],"model":"m"}"#,
                b"x".to_vec(),
            ),
        ];
        for (body, want) in cases {
            assert_canonical(COMP, body, &want);
        }
    }

    #[test]
    fn chat_message_shapes() {
        let cases: Vec<(&str, &str)> = vec![
            (
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
                "<|user|>\nhi<|end|>\n",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
                "<|user|>\nhi<|end|>\n",
            ),
            (
                r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"developer","content":"d"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"input_text","text":"b"}]}]}"#,
                "<|system|>\ns<|end|>\n<|developer|>\nd<|end|>\n<|user|>\na\nb<|end|>\n",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","name":"bob","content":"x"},{"role":"assistant","content":[{"type":"refusal","refusal":"no"}]}]}"#,
                "<|user name=bob|>\nx<|end|>\n<|assistant|>\nno<|end|>\n",
            ),
            (
                r#"{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"type":"function","id":"c1","function":{"name":"f","arguments":"{\"a\":1}"}}]},{"role":"tool","tool_call_id":"c1","content":"42"}]}"#,
                concat!(
                    "<|assistant|>\n<|tool_calls|>",
                    r#"[{"function":{"arguments":"{\"a\":1}","name":"f"},"id":"c1","type":"function"}]"#,
                    "<|end|>\n<|tool tool_call_id=c1|>\n42<|end|>\n"
                ),
            ),
            (
                r#"{"model":"m","tools":[{"type":"function","function":{"name":"f"}}],"messages":[{"role":"user","content":"q"}]}"#,
                concat!(
                    "<|tools|>\n",
                    r#"[{"function":{"name":"f"},"type":"function"}]"#,
                    "\n<|end|>\n<|user|>\nq<|end|>\n"
                ),
            ),
            // Empty / null tools and tool_calls are like absent ones.
            (
                r#"{"model":"m","tools":[],"messages":[{"role":"assistant","content":"a","tool_calls":[]}]}"#,
                "<|assistant|>\na<|end|>\n",
            ),
            (
                r#"{"model":"m","tools":null,"messages":[{"role":"assistant","tool_calls":null}]}"#,
                "<|assistant|>\n<|end|>\n",
            ),
            // Fields of the other API and unknown fields are ignored.
            (
                r#"{"model":"m","prompt":"nope","x":{"y":[1,2]},"messages":[{"role":"user","content":"hi","extra":1}]}"#,
                "<|user|>\nhi<|end|>\n",
            ),
        ];
        for (body, want) in cases {
            assert_canonical(CHAT, body, want.as_bytes());
        }
    }

    #[test]
    fn fixture_turn1_pins_the_format() {
        let body = include_str!("../../tests/fixtures/requests/chat-tools-turn1.json");
        let want = concat!(
            "<|tools|>\n",
            r#"[{"function":{"description":"Current weather for a city","name":"get_weather","parameters":{"properties":{"city":{"type":"string"},"unit":{"enum":["celsius","fahrenheit"],"type":"string"}},"required":["city"],"type":"object"}},"type":"function"}]"#,
            "\n<|end|>\n",
            "<|system|>\nYou are a helpful assistant. Use the tools when they help.\nAnswer in one sentence.<|end|>\n",
            "<|user|>\nWhat's the weather in Paris right now, in °C?<|end|>\n",
        );
        assert_canonical(CHAT, body, want.as_bytes());
        let r = p(CHAT, body).unwrap();
        assert_eq!(r.model, "Qwen/Qwen2.5-7B-Instruct");
        assert!(r.stream);
        assert_eq!(r.cache_salt, None);
    }

    #[test]
    fn fixture_turn2_extends_turn1() {
        // Turn 2 is pretty-printed with every key order changed.
        let t1 = include_str!("../../tests/fixtures/requests/chat-tools-turn1.json");
        let t2 = include_str!("../../tests/fixtures/requests/chat-tools-turn2.json");
        for cfg in [bytewise(), PrefixConfig::default()] {
            let a = parse(CHAT, t1.as_bytes(), &cfg).unwrap();
            let b = parse(CHAT, t2.as_bytes(), &cfg).unwrap();
            assert!(b.prompt_bytes > a.prompt_bytes);
            assert!(
                is_prefix(&a.blocks, &b.blocks),
                "turn 2 does not extend turn 1"
            );
            assert!(b.blocks.len() > a.blocks.len());
        }
    }

    #[test]
    fn fixtures_parse() {
        let vision = include_str!("../../tests/fixtures/requests/chat-vision.json");
        let r = p(CHAT, vision).unwrap();
        assert_eq!(r.cache_salt.as_deref(), Some("tenant-42"));
        assert!(!r.stream);
        let d = "<|developer|>\nDescribe images precisely.<|end|>\n".len();
        let u = "<|user|>\nWhat is in this image?\n<|image_url:0123456789abcdef|>\n<|image_url:0123456789abcdef|><|end|>\n".len();
        assert_eq!(r.prompt_bytes, d + u, "media parts are fixed-size digests");

        let toks = include_str!("../../tests/fixtures/requests/completions-tokens.json");
        let r = p(COMP, toks).unwrap();
        assert_eq!(
            r.prompt_bytes,
            2 * (TOKEN_IDS.len() + 6 * 4) + NEXT_PROMPT.len()
        );

        let text = include_str!("../../tests/fixtures/requests/completions-text.json");
        let r = p(COMP, text).unwrap();
        let want = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n".len();
        assert_eq!(r.prompt_bytes, want);
        assert_eq!(r.prompt_tokens(&PrefixConfig::default()), (want / 4) as u64);
        let empty = p(COMP, r#"{"model":"m","prompt":""}"#).unwrap();
        assert_eq!(
            empty.prompt_tokens(&PrefixConfig::default()),
            1,
            "at least 1"
        );
    }

    #[test]
    fn media_digest_is_stable_and_distinct() {
        let body = |url: &str, detail: &str| {
            json!({"model":"m","messages":[{"role":"user","content":[
                {"type":"image_url","image_url":{"url":url,"detail":detail}}]}]})
            .to_string()
        };
        let a = p(CHAT, &body("https://x/a.png", "low")).unwrap();
        let a2 = p(CHAT, &body("https://x/a.png", "high")).unwrap();
        let b = p(CHAT, &body("https://x/b.png", "low")).unwrap();
        assert_eq!(a.blocks, a2.blocks, "detail is not part of the image");
        assert_ne!(a.blocks, b.blocks);
        let big = format!("data:image/png;base64,{}", "A".repeat(3 << 20));
        let c = p(CHAT, &body(&big, "auto")).unwrap();
        assert_eq!(c.prompt_bytes, a.prompt_bytes, "a 3 MiB image is a digest");
        // Other media and unknown part types are digests too.
        let other = json!({"model":"m","messages":[{"role":"user","content":[
            {"type":"input_audio","input_audio":{"data":"UklGRg==","format":"wav"}},
            {"type":"video_url","video_url":{"url":"https://x/v.mp4"}},
            {"type":"file","file":{"file_id":"file-1"}},
            {"type":"something_new","whatever":[1,2]}]}]});
        assert!(p(CHAT, &other.to_string()).is_ok());
    }

    /// A conversation: tools, system, then turns of user / assistant (with a
    /// tool round trip on turn 2).
    fn conversation_turns(tools: bool) -> Vec<String> {
        let mut msgs = vec![
            json!({"role":"system","content":"Be brief."}),
            json!({"role":"user","content":"Plan a trip to Rome."}),
        ];
        let mut turns = Vec::new();
        let push = |msgs: &Vec<Value>, turns: &mut Vec<String>| {
            let mut b = json!({"model":"m","cache_salt":"s","messages":msgs});
            if tools {
                b["tools"] = json!([{"type":"function","function":{"name":"search","parameters":{"type":"object"}}}]);
            }
            turns.push(b.to_string());
        };
        push(&msgs, &mut turns);
        msgs.push(json!({"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"search","arguments":"{\"q\":\"Rome\"}"}}]}));
        msgs.push(
            json!({"role":"tool","tool_call_id":"c1","content":"Colosseum, Vatican, Trastevere"}),
        );
        push(&msgs, &mut turns);
        msgs.push(json!({"role":"assistant","content":"Day 1: Colosseum. Day 2: Vatican."}));
        msgs.push(json!({"role":"user","content":[{"type":"text","text":"Add food tips."},{"type":"image_url","image_url":{"url":"https://x/menu.jpg"}}]}));
        push(&msgs, &mut turns);
        msgs.push(json!({"role":"assistant","content":"Try cacio e pepe.\n".repeat(40)}));
        msgs.push(json!({"role":"user","content":"Thanks!"}));
        push(&msgs, &mut turns);
        turns
    }

    #[test]
    fn chat_turn_n_plus_one_extends_turn_n() {
        for tools in [false, true] {
            for cfg in [
                bytewise(),
                PrefixConfig::default(),
                PrefixConfig {
                    block_tokens: 3,
                    bytes_per_token: 1,
                    ..PrefixConfig::default()
                },
            ] {
                let turns = conversation_turns(tools);
                let reqs: Vec<_> = turns
                    .iter()
                    .map(|t| parse(CHAT, t.as_bytes(), &cfg).unwrap())
                    .collect();
                for w in reqs.windows(2) {
                    assert!(
                        is_prefix(&w[0].blocks, &w[1].blocks),
                        "tools={tools} {cfg:?}"
                    );
                    assert!(w[1].prompt_bytes > w[0].prompt_bytes);
                }
            }
        }
        // Tools change everything after them: they come first.
        let with = p(CHAT, &conversation_turns(true)[0]).unwrap();
        let without = p(CHAT, &conversation_turns(false)[0]).unwrap();
        assert_eq!(with.blocks[..2], without.blocks[..2]); // "<|"
        assert_ne!(with.blocks[2], without.blocks[2]); // "t" (tools) vs "s" (system)
    }

    #[test]
    fn completions_continuation_extends_prefix() {
        let mut prompt = String::from("User: hello\nAssistant:");
        let mut ids: Vec<u32> = vec![128000, 1, 2, 3];
        let mut prev: Option<(InferenceRequest, InferenceRequest)> = None;
        for turn in 0..4 {
            let text = p(COMP, &json!({"model":"m","prompt":prompt}).to_string()).unwrap();
            let toks = p(COMP, &json!({"model":"m","prompt":ids}).to_string()).unwrap();
            if let Some((pt, pk)) = &prev {
                assert!(is_prefix(&pt.blocks, &text.blocks), "turn {turn}");
                assert!(is_prefix(&pk.blocks, &toks.blocks), "turn {turn}");
            }
            prompt.push_str(&format!(
                " answer {turn}\nUser: more \"{turn}\"\nAssistant:"
            ));
            ids.extend([10 + turn, 20, 30]);
            prev = Some((text, toks));
        }
    }

    #[test]
    fn missing_model_is_the_default_models_namespace() {
        let cfg = PrefixConfig::default();
        let prompt = "x".repeat(600);
        let get = |b: Value| parse(COMP, b.to_string().as_bytes(), &cfg).unwrap();
        let none = get(json!({"prompt": prompt}));
        assert_eq!(none.model, "");
        assert_eq!(none.blocks.len(), 2);
        assert_eq!(
            get(json!({"model": null, "prompt": prompt})).blocks,
            none.blocks
        );
        assert_eq!(
            get(json!({"model": "", "prompt": prompt})).blocks,
            none.blocks
        );
        assert_ne!(
            get(json!({"model": "m", "prompt": prompt})).blocks,
            none.blocks
        );
        assert_eq!(
            parse(COMP, br#"{"model":5,"prompt":"x"}"#, &cfg),
            Err(RequestError::WrongType("model"))
        );
    }

    #[test]
    fn model_and_salt_separate_blocks() {
        let body = |model: &str, salt: Value| {
            json!({"model":model,"cache_salt":salt,"prompt":"x".repeat(600)}).to_string()
        };
        let cfg = PrefixConfig::default();
        let get = |b: String| parse(COMP, b.as_bytes(), &cfg).unwrap().blocks;
        let base = get(body("a", Value::Null));
        assert_eq!(base.len(), 2);
        for other in [
            get(body("b", Value::Null)),
            get(body("a", json!("s1"))),
            get(body("A", Value::Null)),
        ] {
            assert_eq!(other.len(), 2);
            assert!(base.iter().all(|h| !other.contains(h)), "shared block hash");
        }
        assert_ne!(get(body("a", json!("s1"))), get(body("a", json!("s2"))));
        assert_eq!(get(body("a", json!(""))), base, "empty salt = no salt");
        let r = parse(COMP, body("a", json!("")).as_bytes(), &cfg).unwrap();
        assert_eq!(r.cache_salt.as_deref(), Some(""));
    }

    #[test]
    fn bad_input_is_an_error() {
        use RequestError::*;
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        let cases: Vec<(ApiKind, String, RequestError)> = vec![
            (COMP, "".into(), InvalidJson(String::new())),
            (COMP, "not json".into(), InvalidJson(String::new())),
            (COMP, r#"{"model":"m","prompt":"x""#.into(), InvalidJson(String::new())),
            (COMP, r#"{"model":"m","prompt":"x"} trailing"#.into(), InvalidJson(String::new())),
            (COMP, r#"{"model":"m","prompt":"x",}"#.into(), InvalidJson(String::new())),
            (CHAT, format!(r#"{{"model":"m","messages":[{{"role":"a","tool_calls":{}}}]}}"#, deep(200)), InvalidJson(String::new())),
            (CHAT, format!(r#"{{"model":"m","tools":{},"messages":[{{"role":"user","content":"x"}}]}}"#, deep(200)), InvalidJson(String::new())),
            // The prompt's own shape stops at depth 3: a type error, no recursion.
            (COMP, format!(r#"{{"model":"m","prompt":{}}}"#, deep(100_000)), WrongType("prompt")),
            (COMP, "[]".into(), WrongType("body")),
            (COMP, "\"str\"".into(), WrongType("body")),
            (COMP, "null".into(), WrongType("body")),
            (COMP, r#"{"model":5,"prompt":"x"}"#.into(), WrongType("model")),
            (COMP, r#"{"model":"m","stream":"yes","prompt":"x"}"#.into(), WrongType("stream")),
            (COMP, r#"{"model":"m","cache_salt":1,"prompt":"x"}"#.into(), WrongType("cache_salt")),
            (COMP, r#"{"model":"m","prompt":5}"#.into(), WrongType("prompt")),
            (COMP, r#"{"model":"m","prompt":{"a":1}}"#.into(), WrongType("prompt")),
            (COMP, r#"{"model":"m","prompt":[1,"a"]}"#.into(), WrongType("prompt")),
            (COMP, r#"{"model":"m","prompt":["a",[1]]}"#.into(), WrongType("prompt")),
            (COMP, r#"{"model":"m","prompt":[-1]}"#.into(), WrongType("prompt")),
            (COMP, r#"{"model":"m","prompt":[1.5]}"#.into(), WrongType("prompt")),
            (COMP, r#"{"model":"m","prompt":[4294967296]}"#.into(), WrongType("prompt")),
            (COMP, r#"{"model":"m","prompt":[[1,"a"]]}"#.into(), WrongType("prompt")),
            (COMP, r#"{"model":"m","prompt":[[[1]]]}"#.into(), WrongType("prompt")),
            (CHAT, r#"{"model":"m","messages":"hi"}"#.into(), WrongType("messages")),
            (CHAT, r#"{"model":"m","messages":[{"content":"no role"}]}"#.into(), WrongType("messages")),
            (CHAT, r#"{"model":"m","messages":[{"role":7,"content":"x"}]}"#.into(), WrongType("messages")),
            (CHAT, r#"{"model":"m","messages":[{"role":"user","content":5}]}"#.into(), WrongType("messages")),
            (CHAT, r#"{"model":"m","messages":[{"role":"user","content":[{"text":"no type"}]}]}"#.into(), WrongType("messages")),
            (CHAT, r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":5}]}]}"#.into(), WrongType("messages")),
            (CHAT, r#"{"model":"m","messages":[{"role":"user","content":"x","content":"y"}]}"#.into(), WrongType("messages")),
            (CHAT, r#"{"model":"m","tools":{"a":1},"messages":[{"role":"user","content":"x"}]}"#.into(), WrongType("tools")),
            (COMP, r#"{"model":"m"}"#.into(), MissingPrompt),
            (COMP, r#"{"model":"m","prompt":null}"#.into(), MissingPrompt),
            (COMP, r#"{"model":"m","prompt":[]}"#.into(), MissingPrompt),
            (COMP, r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#.into(), MissingPrompt),
            (CHAT, r#"{"model":"m","messages":[]}"#.into(), MissingPrompt),
            (CHAT, r#"{"model":"m","prompt":"x"}"#.into(), MissingPrompt),
        ];
        for (kind, body, want) in cases {
            let got = p(kind, &body).expect_err(&body);
            match (&got, &want) {
                (InvalidJson(_), InvalidJson(_)) => {}
                _ => assert_eq!(got, want, "{}", &body[..body.len().min(120)]),
            }
            assert!(!got.to_string().is_empty());
        }
    }

    #[test]
    fn non_utf8_is_an_error() {
        let bodies: [&[u8]; 4] = [
            b"{\"model\":\"m\",\"prompt\":\"a\xff\"}",
            b"{\"model\":\"m\",\"ignored\":\"\xc3\x28\",\"prompt\":\"a\"}",
            b"\xef\xbb\xbf\xff{}",
            b"{\"model\":\"m\xed\xa0\x80\",\"prompt\":\"a\"}",
        ];
        for b in bodies {
            assert!(
                matches!(
                    parse(COMP, b, &bytewise()),
                    Err(RequestError::InvalidJson(_))
                ),
                "{b:?}"
            );
        }
    }

    #[test]
    fn last_duplicate_key_wins() {
        assert_canonical(
            COMP,
            r#"{"model":"x","prompt":"first","model":"m","prompt":"second"}"#,
            b"second",
        );
        assert_eq!(
            p(COMP, r#"{"model":"x","model":"m","prompt":""}"#)
                .unwrap()
                .model,
            "m"
        );
    }

    #[test]
    fn huge_prompts_are_capped_not_refused() {
        let cfg = PrefixConfig::default(); // 256-byte blocks, 16384 max
        let big = "a".repeat(8 << 20);
        let r = parse(
            COMP,
            json!({"model":"m","prompt":big}).to_string().as_bytes(),
            &cfg,
        )
        .unwrap();
        assert_eq!(r.prompt_bytes, 8 << 20);
        assert_eq!(r.blocks.len(), cfg.max_blocks());
        // Escapes force an owned copy of the string; same result shape.
        let escaped = "line\n\"q\"\t".repeat(200_000);
        let r = parse(
            COMP,
            json!({"model":"m","prompt":escaped}).to_string().as_bytes(),
            &cfg,
        )
        .unwrap();
        assert_eq!(r.prompt_bytes, escaped.len());
        assert_eq!(r.blocks.len(), (escaped.len() / 256).min(cfg.max_blocks()));
        // A small cap.
        let capped = PrefixConfig {
            max_prompt_tokens: 640,
            ..cfg.clone()
        };
        let r = parse(
            COMP,
            json!({"model":"m","prompt":escaped}).to_string().as_bytes(),
            &capped,
        )
        .unwrap();
        assert_eq!(r.blocks.len(), 10);
        // Many messages.
        let msgs: Vec<Value> = (0..100_000)
            .map(|i| json!({"role":"user","content":i.to_string()}))
            .collect();
        let r = parse(
            CHAT,
            json!({"model":"m","messages":msgs}).to_string().as_bytes(),
            &cfg,
        )
        .unwrap();
        assert!(r.prompt_bytes > 100_000 * 20);
        // Many tokens.
        let ids: Vec<u32> = (0..1_000_000).collect();
        let r = parse(
            COMP,
            json!({"model":"m","prompt":ids}).to_string().as_bytes(),
            &cfg,
        )
        .unwrap();
        assert_eq!(r.prompt_bytes, TOKEN_IDS.len() + 4_000_000);
        assert_eq!(r.prompt_tokens(&cfg), 1_000_003);
    }

    #[test]
    fn deep_nesting_in_ignored_fields_does_not_overflow() {
        // serde_json skips ignored values without recursion: accepted, no panic.
        let deep = format!("{}{}", "[".repeat(200_000), "]".repeat(200_000));
        let body = format!(r#"{{"model":"m","extra":{deep},"prompt":"x"}}"#);
        assert_canonical(COMP, &body, b"x");
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"x","meta":{deep}}}]}}"#
        );
        assert!(p(CHAT, &body).is_ok());
    }

    #[test]
    fn mutated_fixtures_never_panic() {
        let fixtures: [&str; 5] = [
            include_str!("../../tests/fixtures/requests/chat-tools-turn1.json"),
            include_str!("../../tests/fixtures/requests/chat-tools-turn2.json"),
            include_str!("../../tests/fixtures/requests/chat-vision.json"),
            include_str!("../../tests/fixtures/requests/completions-tokens.json"),
            include_str!("../../tests/fixtures/requests/completions-text.json"),
        ];
        let noise = b"[]{}\",:\\0-e9.nulltruefalse\xff\x00\xc3";
        let mut rng = fastrand::Rng::with_seed(11);
        let cfg = PrefixConfig {
            block_tokens: 2,
            bytes_per_token: 1,
            ..PrefixConfig::default()
        };
        for i in 0..3000 {
            let mut b = fixtures[i % fixtures.len()].as_bytes().to_vec();
            for _ in 0..rng.usize(1..4) {
                let at = rng.usize(0..b.len());
                match rng.u8(0..4) {
                    0 => b.truncate(at),
                    1 => b[at] = noise[rng.usize(0..noise.len())],
                    2 => b.insert(at, noise[rng.usize(0..noise.len())]),
                    _ => {
                        b.remove(at);
                    }
                }
                if b.is_empty() {
                    break;
                }
            }
            for kind in [CHAT, COMP] {
                let _ = parse(kind, &b, &cfg);
            }
        }
    }
}
