//! Multi-turn chat: G groups share a long system prompt, each with several users whose
//! conversations resend the whole history (previous answers included) every turn.

use std::sync::Arc;

use serde::Serialize;

use crate::text::{derive_seed, pad4, section, words};
use crate::trace::{Session, Step, Trace};

/// Parameters of the multi-turn chat workload.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct ChatArgs {
    /// Chat: groups, each with its own system prompt.
    #[arg(long, default_value_t = 16)]
    pub chat_groups: usize,
    /// Chat: conversations (users) per group.
    #[arg(long, default_value_t = 6)]
    pub chat_users_per_group: usize,
    /// Chat: turns per conversation.
    #[arg(long, default_value_t = 4)]
    pub chat_turns: usize,
    /// Chat: system prompt length in tokens.
    #[arg(long, default_value_t = 3000)]
    pub chat_system_tokens: usize,
    /// Chat: user message length in tokens.
    #[arg(long, default_value_t = 200)]
    pub chat_question_tokens: usize,
    /// Chat: answer length (max_tokens).
    #[arg(long, default_value_t = 100)]
    pub chat_answer_tokens: u32,
    /// Chat: mean think time between turns, simulated ms.
    #[arg(long, default_value_t = 2000)]
    pub chat_think_ms: u64,
}

/// Builds conversations for `groups` with `per_group[g]` users each (shared by hotspot).
pub(crate) fn conversations(a: &ChatArgs, seed: u64, per_group: &[usize], name: &str) -> Trace {
    let mut sessions = Vec::new();
    let mut rng = fastrand::Rng::with_seed(derive_seed(seed, 0xC4A7, 0));
    for (g, &users) in per_group.iter().enumerate() {
        let system: Arc<str> = pad4(format!(
            "SYSTEM: {}",
            words(derive_seed(seed, 0x5157, g as u64), a.chat_system_tokens)
        ))
        .into();
        for u in 0..users {
            let steps = (0..a.chat_turns)
                .map(|t| Step {
                    append: section(
                        "USER",
                        &words(
                            derive_seed(seed, 0x0_05E2, (g * 1_000_000 + u * 1000 + t) as u64),
                            a.chat_question_tokens,
                        ),
                    ) + &section("ASSISTANT", ""),
                    max_tokens: a.chat_answer_tokens,
                    think_ms: if t == 0 {
                        0
                    } else {
                        super::think(&mut rng, a.chat_think_ms)
                    },
                })
                .collect();
            sessions.push(Session {
                id: 0,
                group: g,
                prefix: system.clone(),
                steps,
            });
        }
    }
    Trace {
        name: name.into(),
        sessions,
    }
}

/// Generates the chat trace.
pub fn generate(a: &ChatArgs, seed: u64) -> Trace {
    conversations(
        a,
        seed,
        &vec![a.chat_users_per_group; a.chat_groups],
        "chat",
    )
}
