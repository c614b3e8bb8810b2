//! The fixed chat template that turns OpenAI messages (or a completion prompt) into tokens.
//!
//! It exists so that multi-turn conversations share token prefixes exactly as they do on a
//! real server: turn N+1 (previous messages + the assistant's answer + a new user message)
//! starts with exactly the tokens of turn N's prompt, followed by the answer's tokens.
//!
//! Layout (modelled on Llama 3.1's template, which always opens with a system block that
//! carries a knowledge-date preamble):
//!
//! ```text
//! <|begin_of_text|>                 (segment)
//! <|system|>\n                      (segment)
//! Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n{system content}\n   (segment)
//! <|{role}|>\n                      (segment, one per remaining message)
//! {content}\n                       (segment)
//! <|assistant|>\n                   (segment: the generation prompt)
//! ```
//!
//! Every segment is tokenized on its own ([`crate::tokenizer`]), so the generation prompt
//! `<|assistant|>\n` tokenizes exactly like the header of the assistant message that the
//! next turn carries, which keeps the prefix property independent of byte alignment.
//! A completion prompt is `<|begin_of_text|>` followed by the prompt text.

use crate::tokenizer::{tokenize_into, TokenId};

/// The beginning-of-text marker that starts every prompt.
pub const BEGIN_OF_TEXT: &str = "<|begin_of_text|>";

/// The preamble that opens the system block of every chat prompt.
pub const SYSTEM_PREAMBLE: &str =
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";

/// One chat message, reduced to what the template needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateMessage<'a> {
    /// The role (`system`, `user`, `assistant`, `tool`, ...).
    pub role: &'a str,
    /// The text content (text parts concatenated).
    pub content: &'a str,
}

fn push_header(role: &str, out: &mut Vec<TokenId>) {
    let mut header = String::with_capacity(role.len() + 5);
    header.push_str("<|");
    header.push_str(role);
    header.push_str("|>\n");
    tokenize_into(&header, out);
}

fn push_body(content: &str, out: &mut Vec<TokenId>) {
    let mut body = String::with_capacity(content.len() + 1);
    body.push_str(content);
    body.push('\n');
    tokenize_into(&body, out);
}

/// The prompt tokens of a chat request.
///
/// A leading `system` message is merged into the system block after the preamble; with
/// `add_generation_prompt` the assistant header is appended.
pub fn render_chat(messages: &[TemplateMessage<'_>], add_generation_prompt: bool) -> Vec<TokenId> {
    let mut out = Vec::with_capacity(64);
    tokenize_into(BEGIN_OF_TEXT, &mut out);
    let (system, rest) = match messages.split_first() {
        Some((first, rest)) if first.role == "system" => (first.content, rest),
        _ => ("", messages),
    };
    push_header("system", &mut out);
    let mut system_body = String::with_capacity(SYSTEM_PREAMBLE.len() + system.len());
    system_body.push_str(SYSTEM_PREAMBLE);
    system_body.push_str(system);
    push_body(&system_body, &mut out);
    for m in rest {
        push_header(m.role, &mut out);
        push_body(m.content, &mut out);
    }
    if add_generation_prompt {
        push_header("assistant", &mut out);
    }
    out
}

/// The prompt tokens of a completion request: `<|begin_of_text|>` then the prompt text.
pub fn render_completion(prompt: &str) -> Vec<TokenId> {
    let mut out = Vec::with_capacity(8 + prompt.len() / 4);
    tokenize_into(BEGIN_OF_TEXT, &mut out);
    tokenize_into(prompt, &mut out);
    out
}

/// The tokens an assistant answer adds to the conversation after the generation prompt
/// (its body segment `answer\n`).
pub fn answer_tokens(answer: &str) -> Vec<TokenId> {
    let mut out = Vec::new();
    push_body(answer, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg<'a>(role: &'a str, content: &'a str) -> TemplateMessage<'a> {
        TemplateMessage { role, content }
    }

    #[test]
    fn next_turn_starts_with_previous_prompt_plus_answer() {
        let turn1 = vec![msg("system", "You are terse."), msg("user", "Hi there!")];
        let p1 = render_chat(&turn1, true);
        let answer = "Hello! How can I help?";
        let mut turn2 = turn1.clone();
        turn2.push(msg("assistant", answer));
        turn2.push(msg("user", "Tell me a joke."));
        let p2 = render_chat(&turn2, true);
        assert!(p2.len() > p1.len());
        assert_eq!(&p2[..p1.len()], &p1[..]);
        let a = answer_tokens(answer);
        assert_eq!(&p2[p1.len()..p1.len() + a.len()], &a[..]);
    }

    #[test]
    fn every_chat_shares_the_preamble() {
        let a = render_chat(&[msg("user", "a")], true);
        let b = render_chat(&[msg("user", "something else entirely")], true);
        // BOS (5) + system header (3) + preamble body (>= 15 tokens) are shared.
        assert!(a.len() > 16 && b.len() > 16);
        assert_eq!(a[..20], b[..20]);
    }

    #[test]
    fn completion_prefix() {
        let a = render_completion("abcdefgh");
        let b = render_completion("abcdefghijkl");
        assert_eq!(a[..], b[..a.len()]);
    }
}
