//! The canonical prompt of `/v1/chat/completions` (format in the parent
//! module's doc): tools first, then one record per message, each message
//! and content part written into the hasher as soon as it is read. Once the
//! hasher is full, the remaining messages and parts are skipped as spans and
//! only their length is counted.

use super::json_budget::{Bounded, Budget};
use super::{read_span, RequestError, Text};
use crate::prefix::block::BlockHasher;
use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use std::cell::Cell;
use std::fmt;
use std::io::Write;
use xxhash_rust::xxh3::Xxh3;

pub(super) const END: &[u8] = b"<|end|>\n";

/// Writes the canonical bytes of a chat body's `tools` and `messages` spans.
pub(super) fn write_chat(
    h: &mut BlockHasher,
    tools: Option<&RawValue>,
    messages: &RawValue,
    budget: &Budget,
) -> Result<(), RequestError> {
    if let Some(tools) = tools {
        if !tools.get().starts_with('[') {
            return Err(RequestError::WrongType("tools"));
        }
        if let Some(v) = read_value(h, tools, "tools", budget)? {
            h.write(b"<|tools|>\n");
            write_json(h, &v);
            h.write(b"\n");
            h.write(END);
        }
    }
    let failure = Cell::new(None);
    let seed = MessagesSeed {
        h,
        budget,
        failure: &failure,
    };
    read_span(messages, seed, "messages", &failure)
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

fn write_json(h: &mut BlockHasher, v: &Value) {
    // Value maps are sorted (BTreeMap), so the text is stable whatever the
    // client's key order. Writing into the hasher cannot fail.
    let _ = serde_json::to_writer(h, v);
}

/// The `messages` array.
struct MessagesSeed<'h, 'c> {
    h: &'h mut BlockHasher,
    budget: &'c Budget,
    failure: &'c Cell<Option<RequestError>>,
}

impl<'de> DeserializeSeed<'de> for MessagesSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for MessagesSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of messages")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut count = 0usize;
        loop {
            if self.h.is_full() {
                match seq.next_element::<&RawValue>()? {
                    Some(m) => self.h.count_unhashed(m.get().len()),
                    None => break,
                }
            } else {
                match seq.next_element::<Message<'de>>()? {
                    Some(m) => write_message(self.h, &m, self.budget, self.failure)
                        .map_err(|e| fail(self.failure, e))?,
                    None => break,
                }
            }
            count += 1;
        }
        if count == 0 {
            return Err(fail(self.failure, RequestError::MissingPrompt));
        }
        Ok(())
    }
}

/// Keeps `e` as the parse's outcome and unwinds serde_json with a stand-in.
fn fail<E: de::Error>(failure: &Cell<Option<RequestError>>, e: RequestError) -> E {
    let unwind = E::custom(&e);
    failure.set(Some(e));
    unwind
}

/// One chat message: only the fields that reach the prompt. Content and
/// tool calls stay spans until the role, name and id are written.
#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Text<'a>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    name: Option<Text<'a>>,
    #[serde(borrow, default)]
    tool_call_id: Option<Text<'a>>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
}

fn write_message(
    h: &mut BlockHasher,
    m: &Message<'_>,
    budget: &Budget,
    failure: &Cell<Option<RequestError>>,
) -> Result<(), RequestError> {
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
    if let Some(content) = m.content {
        read_span(content, ContentSeed { h: &mut *h }, "messages", failure)?;
    }
    if let Some(calls) = m.tool_calls {
        if let Some(v) = read_value(h, calls, "messages", budget)? {
            h.write(b"<|tool_calls|>");
            write_json(h, &v);
        }
    }
    h.write(END);
    Ok(())
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
