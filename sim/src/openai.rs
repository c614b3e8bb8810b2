//! The OpenAI-compatible wire format: parsing completion and chat requests into prompt
//! tokens, and writing responses, SSE chunks and errors the way vLLM does.
//!
//! Clients (the OpenAI SDKs, benchmark tools, the router under test) only see this
//! surface, so field names and shapes follow vLLM's OpenAI server. Nothing here panics on
//! client input: every problem becomes an error message for a 400.

use serde::{Deserialize, Serialize};

use crate::chat_template::{render_chat, render_completion, TemplateMessage};
use crate::tokenizer::TokenId;

/// Tokens generated when a request sets neither `max_tokens` nor `max_completion_tokens`.
/// (vLLM would generate up to the context length; a small fixed default keeps the
/// simulator's answers short and predictable.)
pub const DEFAULT_MAX_TOKENS: usize = 16;

/// Which OpenAI endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    Chat,
}

/// A validated inference request.
#[derive(Debug, Clone, PartialEq)]
pub struct InferenceRequest {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// Prompt tokens after the chat template.
    pub prompt_tokens: Vec<TokenId>,
    /// Tokens to generate.
    pub max_tokens: usize,
    /// `stream: true`.
    pub stream: bool,
    /// `stream_options.include_usage: true`.
    pub include_usage: bool,
    /// The `model` field, if any (a LoRA adapter's name selects it).
    pub model: Option<String>,
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    prompt: Option<PromptInput>,
    max_tokens: Option<i64>,
    n: Option<i64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    content: Option<MessageContent>,
}

#[derive(Deserialize)]
struct ChatRequest {
    model: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    n: Option<i64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    add_generation_prompt: Option<bool>,
}

fn max_tokens(v: Option<i64>) -> Result<usize, String> {
    match v {
        None => Ok(DEFAULT_MAX_TOKENS),
        Some(n) if n >= 1 => usize::try_from(n).map_err(|_| "max_tokens is too large".to_owned()),
        Some(n) => Err(format!("max_tokens must be at least 1, got {n}.")),
    }
}

fn check_n(n: Option<i64>) -> Result<(), String> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => Err(format!("kvroute-sim supports only n=1, got n={n}.")),
    }
}

fn parse_json<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, String> {
    serde_json::from_slice(body).map_err(|e| format!("Invalid JSON body: {e}"))
}

/// Parses a `POST /v1/completions` body.
pub fn parse_completion(body: &[u8]) -> Result<InferenceRequest, String> {
    let r: CompletionRequest = parse_json(body)?;
    check_n(r.n)?;
    let prompt_tokens = match r.prompt {
        None => return Err("Field 'prompt' is required.".to_owned()),
        Some(PromptInput::Text(t)) => render_completion(&t),
        Some(PromptInput::Texts(v)) => match v.as_slice() {
            [one] => render_completion(one),
            _ => return Err("kvroute-sim supports exactly one prompt per request.".to_owned()),
        },
        Some(PromptInput::Tokens(t)) => t,
        Some(PromptInput::TokenLists(v)) => match <[Vec<u32>; 1]>::try_from(v) {
            Ok([one]) => one,
            Err(_) => return Err("kvroute-sim supports exactly one prompt per request.".to_owned()),
        },
    };
    if prompt_tokens.is_empty() {
        return Err("The prompt must not be empty.".to_owned());
    }
    Ok(InferenceRequest {
        model: r.model,
        endpoint: Endpoint::Completions,
        prompt_tokens,
        max_tokens: max_tokens(r.max_tokens)?,
        stream: r.stream.unwrap_or(false),
        include_usage: r
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
    })
}

/// Parses a `POST /v1/chat/completions` body.
pub fn parse_chat(body: &[u8]) -> Result<InferenceRequest, String> {
    let r: ChatRequest = parse_json(body)?;
    check_n(r.n)?;
    let messages = r
        .messages
        .ok_or_else(|| "Field 'messages' is required.".to_owned())?;
    if messages.is_empty() {
        return Err("Field 'messages' must not be empty.".to_owned());
    }
    // Flatten content parts: text parts are concatenated, other parts are ignored.
    let texts: Vec<String> = messages
        .iter()
        .map(|m| match &m.content {
            None => String::new(),
            Some(MessageContent::Text(t)) => t.clone(),
            Some(MessageContent::Parts(parts)) => parts
                .iter()
                .filter(|p| p.kind == "text")
                .filter_map(|p| p.text.as_deref())
                .collect(),
        })
        .collect();
    let template: Vec<TemplateMessage<'_>> = messages
        .iter()
        .zip(&texts)
        .map(|(m, t)| TemplateMessage {
            role: &m.role,
            content: t,
        })
        .collect();
    let prompt_tokens = render_chat(&template, r.add_generation_prompt.unwrap_or(true));
    Ok(InferenceRequest {
        model: r.model,
        endpoint: Endpoint::Chat,
        prompt_tokens,
        max_tokens: max_tokens(r.max_completion_tokens.or(r.max_tokens))?,
        stream: r.stream.unwrap_or(false),
        include_usage: r
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
    })
}

/// Identity fields shared by a response and all its chunks.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// `cmpl-...` or `chatcmpl-...`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
}

/// Token accounting of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsageNumbers {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

#[derive(Serialize)]
struct PromptTokensDetails {
    cached_tokens: usize,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: usize,
    total_tokens: usize,
    completion_tokens: usize,
    prompt_tokens_details: PromptTokensDetails,
}

impl From<UsageNumbers> for Usage {
    fn from(u: UsageNumbers) -> Self {
        Usage {
            prompt_tokens: u.prompt_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            completion_tokens: u.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_tokens,
            },
        }
    }
}

#[derive(Serialize)]
struct CompletionChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: Option<&'a str>,
    stop_reason: Option<()>,
}

#[derive(Serialize)]
struct AssistantMessage<'a> {
    role: &'a str,
    content: &'a str,
    refusal: Option<()>,
    tool_calls: [(); 0],
    reasoning_content: Option<()>,
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: AssistantMessage<'a>,
    logprobs: Option<()>,
    finish_reason: &'a str,
    stop_reason: Option<()>,
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'a str>,
    content: &'a str,
}

#[derive(Serialize)]
struct ChatChunkChoice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: Option<()>,
    finish_reason: Option<&'a str>,
}

#[derive(Serialize)]
struct Envelope<'a, C> {
    id: &'a str,
    object: &'a str,
    created: u64,
    model: &'a str,
    choices: C,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

fn to_vec<T: Serialize>(v: &T) -> Vec<u8> {
    // Serializing these plain structs cannot fail.
    serde_json::to_vec(v).unwrap_or_default()
}

/// The finish reason the simulator reports: generation always runs to `max_tokens`.
pub const FINISH_REASON: &str = "length";

/// A non-streaming response body.
pub fn response_body(
    endpoint: Endpoint,
    meta: &ResponseMeta,
    text: &str,
    usage: UsageNumbers,
) -> Vec<u8> {
    match endpoint {
        Endpoint::Completions => to_vec(&Envelope {
            id: &meta.id,
            object: "text_completion",
            created: meta.created,
            model: &meta.model,
            choices: [CompletionChoice {
                index: 0,
                text,
                logprobs: None,
                finish_reason: Some(FINISH_REASON),
                stop_reason: None,
            }],
            usage: Some(usage.into()),
        }),
        Endpoint::Chat => to_vec(&Envelope {
            id: &meta.id,
            object: "chat.completion",
            created: meta.created,
            model: &meta.model,
            choices: [ChatChoice {
                index: 0,
                message: AssistantMessage {
                    role: "assistant",
                    content: text,
                    refusal: None,
                    tool_calls: [],
                    reasoning_content: None,
                },
                logprobs: None,
                finish_reason: FINISH_REASON,
                stop_reason: None,
            }],
            usage: Some(usage.into()),
        }),
    }
}

fn sse(json: Vec<u8>, out: &mut Vec<u8>) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(&json);
    out.extend_from_slice(b"\n\n");
}

/// Appends the SSE event that opens a chat stream (`delta.role = assistant`). Completion
/// streams have no opening event.
pub fn open_chunk(endpoint: Endpoint, meta: &ResponseMeta, out: &mut Vec<u8>) {
    if endpoint == Endpoint::Chat {
        sse(
            to_vec(&Envelope {
                id: &meta.id,
                object: "chat.completion.chunk",
                created: meta.created,
                model: &meta.model,
                choices: [ChatChunkChoice {
                    index: 0,
                    delta: Delta {
                        role: Some("assistant"),
                        content: "",
                    },
                    logprobs: None,
                    finish_reason: None,
                }],
                usage: None,
            }),
            out,
        );
    }
}

/// Appends the SSE event carrying one generated token's text; `last` sets
/// `finish_reason`.
pub fn token_chunk(
    endpoint: Endpoint,
    meta: &ResponseMeta,
    text: &str,
    last: bool,
    out: &mut Vec<u8>,
) {
    let finish_reason = last.then_some(FINISH_REASON);
    let json = match endpoint {
        Endpoint::Completions => to_vec(&Envelope {
            id: &meta.id,
            object: "text_completion",
            created: meta.created,
            model: &meta.model,
            choices: [CompletionChoice {
                index: 0,
                text,
                logprobs: None,
                finish_reason,
                stop_reason: None,
            }],
            usage: None,
        }),
        Endpoint::Chat => to_vec(&Envelope {
            id: &meta.id,
            object: "chat.completion.chunk",
            created: meta.created,
            model: &meta.model,
            choices: [ChatChunkChoice {
                index: 0,
                delta: Delta {
                    role: None,
                    content: text,
                },
                logprobs: None,
                finish_reason,
            }],
            usage: None,
        }),
    };
    sse(json, out);
}

/// Appends the closing events: the usage chunk (with `include_usage`) and `[DONE]`.
pub fn close_chunks(
    endpoint: Endpoint,
    meta: &ResponseMeta,
    usage: Option<UsageNumbers>,
    out: &mut Vec<u8>,
) {
    if let Some(u) = usage {
        let object = match endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        sse(
            to_vec(&Envelope::<[(); 0]> {
                id: &meta.id,
                object,
                created: meta.created,
                model: &meta.model,
                choices: [],
                usage: Some(u.into()),
            }),
            out,
        );
    }
    out.extend_from_slice(b"data: [DONE]\n\n");
}

/// An OpenAI-style error body: `{"error":{"message","type","param","code"}}`.
pub fn error_body(message: &str, kind: &str, code: u16) -> Vec<u8> {
    to_vec(&serde_json::json!({
        "error": {"message": message, "type": kind, "param": null, "code": code}
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_chat_with_parts_and_defaults() {
        let r = parse_chat(
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
        )
        .unwrap();
        assert_eq!(r.max_tokens, DEFAULT_MAX_TOKENS);
        assert!(!r.stream);
        let s = parse_chat(br#"{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":3,"max_tokens":9,"stream":true,"stream_options":{"include_usage":true}}"#).unwrap();
        assert_eq!(r.prompt_tokens, s.prompt_tokens);
        assert_eq!(s.max_tokens, 3);
        assert!(s.stream && s.include_usage);
    }

    #[test]
    fn parses_completion_prompt_forms() {
        let a = parse_completion(br#"{"prompt":"hello world"}"#).unwrap();
        let b = parse_completion(br#"{"prompt":["hello world"],"max_tokens":2}"#).unwrap();
        assert_eq!(a.prompt_tokens, b.prompt_tokens);
        assert_eq!(b.max_tokens, 2);
        let t = parse_completion(br#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!(t.prompt_tokens, vec![1, 2, 3]);
        let t = parse_completion(br#"{"prompt":[[4,5]]}"#).unwrap();
        assert_eq!(t.prompt_tokens, vec![4, 5]);
    }

    #[test]
    fn bad_requests_are_errors_not_panics() {
        for body in [
            &b"{"[..],
            b"[]",
            b"null",
            br#"{"prompt":"x","max_tokens":0}"#,
            br#"{"prompt":"x","max_tokens":-5}"#,
            br#"{"prompt":"x","n":2}"#,
            br#"{"prompt":["a","b"]}"#,
            br#"{"prompt":[]}"#,
            br#"{"prompt":42}"#,
            br#"{}"#,
        ] {
            assert!(
                parse_completion(body).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        for body in [
            &br#"{"messages":[]}"#[..],
            br#"{"messages":"hi"}"#,
            br#"{"messages":[{"content":"no role"}]}"#,
            br#"{"messages":[{"role":"user","content":5}]}"#,
        ] {
            assert!(
                parse_chat(body).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn sse_framing() {
        let meta = ResponseMeta {
            id: "chatcmpl-1".into(),
            created: 1,
            model: "m".into(),
        };
        let mut out = Vec::new();
        open_chunk(Endpoint::Chat, &meta, &mut out);
        token_chunk(Endpoint::Chat, &meta, "the ", true, &mut out);
        close_chunks(
            Endpoint::Chat,
            &meta,
            Some(UsageNumbers {
                prompt_tokens: 5,
                completion_tokens: 1,
                cached_tokens: 0,
            }),
            &mut out,
        );
        let s = String::from_utf8(out).unwrap();
        let events: Vec<&str> = s.split_terminator("\n\n").collect();
        assert_eq!(events.len(), 4);
        assert!(events.iter().all(|e| e.starts_with("data: ")));
        assert_eq!(events[3], "data: [DONE]");
        let last: serde_json::Value = serde_json::from_str(&events[2][6..]).unwrap();
        assert_eq!(last["usage"]["total_tokens"], 6);
        assert_eq!(last["choices"].as_array().map(Vec::len), Some(0));
    }
}
