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
//! Non-UTF-8, invalid JSON, trailing garbage and nesting deeper than
//! serde_json's limit (128) are [`RequestError::InvalidJson`]; a known field
//! of the wrong type is [`RequestError::WrongType`] naming the top-level
//! field; no prompt is [`RequestError::MissingPrompt`]; no or empty `model`
//! is [`RequestError::MissingModel`]. Duplicate top-level keys: the last one
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
    /// `model` is absent, null or empty.
    MissingModel,
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestError::InvalidJson(e) => write!(f, "invalid JSON body: {e}"),
            RequestError::MissingPrompt => write!(f, "no prompt (`prompt` / `messages`)"),
            RequestError::WrongType(field) => write!(f, "field `{field}` has the wrong type"),
            RequestError::MissingModel => write!(f, "`model` is missing or empty"),
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

    let model = match body.model {
        Some(Text(m)) if !m.is_empty() => m,
        _ => return Err(RequestError::MissingModel),
    };
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
            for m in [&p.image_url, &p.video_url, &p.audio_url, &p.input_audio, &p.file]
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
                        PromptItem::Text(t) if flat.is_empty() && lists.is_empty() => {
                            texts.push(t)
                        }
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
