//! The canonical prompt of `/v1/chat/completions` (format in the parent
//! module's doc): the tools as a digest that seeds the prompt, then one
//! record per message, each message and content part written into the
//! hasher as soon as it is read. Once the
//! hasher is full, the remaining messages and parts are skipped as spans and
//! only their length is counted.

use super::json_budget::{Bounded, Budget};
use super::{read_span, RequestError, Text};
use crate::prefix::block::BlockHasher;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use std::cell::Cell;
use std::fmt;
use std::io::Write;
use xxhash_rust::xxh3::Xxh3;

pub(super) const END: &[u8] = b"<|end|>\n";

/// The tool definitions of a request, as the prompt's seed sees them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tools {
    /// xxh3 of their canonical text (`<|tools|>\n{compact JSON, keys
    /// sorted}\n<|end|>\n`).
    pub(super) digest: u64,
    /// Length of that text: the prompt bytes they stand for.
    pub(super) bytes: usize,
}

/// The `tools` field: `None` when absent, `null` or `[]`. Built as a
/// budgeted value (its keys are sorted for the canonical text), then only
/// its digest and length are kept.
pub(super) struct ToolsSeed<'b>(pub(super) &'b Budget);

impl<'de> DeserializeSeed<'de> for ToolsSeed<'_> {
    type Value = Option<Tools>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<Tools>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ToolsSeed<'_> {
    type Value = Option<Tools>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of tools")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<Tools>, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Option<Tools>, A::Error> {
        let tools = Bounded(self.0).visit_seq(seq)?;
        if tools.as_array().is_none_or(|a| a.is_empty()) {
            return Ok(None);
        }
        let mut d = Digest::default();
        d.write_all(b"<|tools|>\n").ok();
        write_json(&mut d, &tools);
        d.write_all(b"\n").ok();
        d.write_all(END).ok();
        Ok(Some(Tools {
            digest: d.hash.digest(),
            bytes: d.bytes,
        }))
    }
}

/// An `io::Write` that hashes and counts what is written.
#[derive(Default)]
struct Digest {
    hash: Xxh3,
    bytes: usize,
}

impl Write for Digest {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.hash.update(buf);
        self.bytes += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Reads a `tools` / `tool_calls` span as a budgeted value: `None` when it
/// is an empty array, or when the hasher is full (then only its length
/// counts).
fn read_value(
    h: &mut BlockHasher,
    span: &RawValue,
    field: &'static str,
    budget: &Budget,
) -> Result<Option<Value>, RequestError> {
    if h.is_full() {
        h.count_unhashed(span.get().len());
        return Ok(None);
    }
    let failure = Cell::new(None);
    let v = read_span(span, Bounded(budget), field, &failure).map_err(|e| {
        if budget.exceeded() {
            RequestError::TooComplex
        } else {
            e
        }
    })?;
    Ok(match v {
        Value::Array(a) if a.is_empty() => None,
        v => Some(v),
    })
}

fn write_json(h: &mut impl Write, v: &Value) {
    // Value maps are sorted (BTreeMap), so the text is stable whatever the
    // client's key order. Writing into the hasher cannot fail.
    let _ = serde_json::to_writer(h, v);
}

/// The `messages` field, hashed as it is read: `true` when it holds at
/// least one message (`null` and `[]` do not).
pub(super) struct MessagesSeed<'h, 'c> {
    pub(super) h: &'h mut BlockHasher,
    pub(super) budget: &'c Budget,
    pub(super) failure: &'c Cell<Option<RequestError>>,
}

impl<'de> DeserializeSeed<'de> for MessagesSeed<'_, '_> {
    type Value = bool;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MessagesSeed<'_, '_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of messages")
    }

    fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        let mut count = 0usize;
        loop {
            if self.h.is_full() {
                match seq.next_element::<&RawValue>()? {
                    Some(m) => self.h.count_unhashed(m.get().len()),
                    None => break,
                }
            } else {
                let seed = MessageSeed {
                    h: &mut *self.h,
                    budget: self.budget,
                    failure: self.failure,
                };
                if seq.next_element_seed(seed)?.is_none() {
                    break;
                }
            }
            count += 1;
        }
        Ok(count > 0)
    }
}

/// Keeps `e` as the parse's outcome and unwinds serde_json with a stand-in.
fn fail<E: de::Error>(failure: &Cell<Option<RequestError>>, e: RequestError) -> E {
    let unwind = E::custom(&e);
    failure.set(Some(e));
    unwind
}

/// One chat message, written as it is read: its content is hashed
/// straight from the body wherever it stands among the message's keys;
/// role, name, tool call id and tool calls (small) are kept and written
/// after it.
struct MessageSeed<'h, 'c> {
    h: &'h mut BlockHasher,
    budget: &'c Budget,
    failure: &'c Cell<Option<RequestError>>,
}

enum MessageField {
    Role,
    Content,
    Name,
    ToolCallId,
    ToolCalls,
    Other,
}

impl<'de> Deserialize<'de> for MessageField {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = MessageField;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a message field name")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<MessageField, E> {
                Ok(match s {
                    "role" => MessageField::Role,
                    "content" => MessageField::Content,
                    "name" => MessageField::Name,
                    "tool_call_id" => MessageField::ToolCallId,
                    "tool_calls" => MessageField::ToolCalls,
                    _ => MessageField::Other,
                })
            }
        }
        d.deserialize_identifier(V)
    }
}

impl<'de> DeserializeSeed<'de> for MessageSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

/// Fails with serde's duplicate-field error when `seen` is already set.
fn once<E: de::Error>(seen: &mut bool, field: &'static str) -> Result<(), E> {
    if std::mem::replace(seen, true) {
        return Err(E::duplicate_field(field));
    }
    Ok(())
}

impl<'de> Visitor<'de> for MessageSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a message object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let h = self.h;
        let (mut content, mut has_name, mut has_id, mut has_calls) = (false, false, false, false);
        let mut role: Option<Text<'de>> = None;
        let (mut name, mut id): (Option<Text<'de>>, Option<Text<'de>>) = (None, None);
        let mut calls: Option<&'de RawValue> = None;
        while let Some(key) = map.next_key::<MessageField>()? {
            match key {
                MessageField::Role => {
                    if role.is_some() {
                        return Err(de::Error::duplicate_field("role"));
                    }
                    role = Some(map.next_value()?);
                }
                MessageField::Content => {
                    once(&mut content, "content")?;
                    map.next_value_seed(ContentSeed { h: &mut *h })?;
                }
                MessageField::Name => {
                    once(&mut has_name, "name")?;
                    name = map.next_value()?;
                }
                MessageField::ToolCallId => {
                    once(&mut has_id, "tool_call_id")?;
                    id = map.next_value()?;
                }
                MessageField::ToolCalls => {
                    once(&mut has_calls, "tool_calls")?;
                    calls = map.next_value()?;
                }
                MessageField::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let Some(Text(role)) = role else {
            return Err(de::Error::missing_field("role"));
        };
        h.write(b"<|");
        h.write(role.as_bytes());
        if let Some(Text(name)) = name {
            h.write(b" name=");
            h.write(name.as_bytes());
        }
        if let Some(Text(id)) = id {
            h.write(b" tool_call_id=");
            h.write(id.as_bytes());
        }
        h.write(b"|>");
        if let Some(calls) = calls {
            let v =
                read_value(h, calls, "messages", self.budget).map_err(|e| fail(self.failure, e))?;
            if let Some(v) = v {
                h.write(b"<|tool_calls|>");
                write_json(h, &v);
            }
        }
        h.write(END);
        Ok(())
    }
}

/// Message content: a string or a list of content parts.
struct ContentSeed<'h> {
    h: &'h mut BlockHasher,
}

impl<'de> DeserializeSeed<'de> for ContentSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ContentSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string or a list of content parts")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<(), E> {
        self.h.write(s.as_bytes());
        Ok(())
    }

    /// `"content": null` (an assistant message with tool calls only).
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut first = true;
        loop {
            let sep = usize::from(!first);
            if self.h.is_full() {
                match seq.next_element::<&RawValue>()? {
                    Some(p) => self.h.count_unhashed(sep + p.get().len()),
                    None => break,
                }
            } else {
                match seq.next_element::<Part<'de>>()? {
                    Some(p) => {
                        if !first {
                            self.h.write(b"\n");
                        }
                        write_part(self.h, &p);
                    }
                    None => break,
                }
            }
            first = false;
        }
        Ok(())
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
            // Formats straight into the hasher: no allocation per part.
            let _ = write!(h, ":{:016x}|>", d.digest());
        }
    }
}
