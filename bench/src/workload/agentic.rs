//! Agentic loop: an agent's context grows by a tool output at every step (the model's
//! short tool call is appended too), over a system prompt shared by all agents.

use std::sync::Arc;

use serde::Serialize;

use crate::text::{derive_seed, pad4, section, words};
use crate::trace::{Session, Step, Trace};

/// Parameters of the agentic workload.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct AgenticArgs {
    /// Agentic: concurrent agent sessions.
    #[arg(long, default_value_t = 24)]
    pub agent_sessions: usize,
    /// Agentic: steps (requests) per session.
    #[arg(long, default_value_t = 8)]
    pub agent_steps: usize,
    /// Agentic: shared system prompt (tool definitions) in tokens.
    #[arg(long, default_value_t = 2000)]
    pub agent_system_tokens: usize,
    /// Agentic: tool output appended per step, tokens.
    #[arg(long, default_value_t = 500)]
    pub agent_tool_tokens: usize,
    /// Agentic: model output per step (tool call), tokens.
    #[arg(long, default_value_t = 40)]
    pub agent_answer_tokens: u32,
    /// Agentic: mean tool latency between steps, simulated ms.
    #[arg(long, default_value_t = 500)]
    pub agent_tool_ms: u64,
}

/// Generates the agentic trace.
pub fn generate(a: &AgenticArgs, seed: u64) -> Trace {
    let system: Arc<str> = pad4(format!(
        "TOOLS: {}",
        words(derive_seed(seed, 0xA6E1, 0), a.agent_system_tokens)
    ))
    .into();
    let mut rng = fastrand::Rng::with_seed(derive_seed(seed, 0xA6E2, 0));
    let sessions = (0..a.agent_sessions)
        .map(|s| {
            let task = section("TASK", &words(derive_seed(seed, 0xA6E3, s as u64), 100));
            let steps = (0..a.agent_steps)
                .map(|k| {
                    let body = if k == 0 {
                        task.clone()
                    } else {
                        section(
                            "TOOL",
                            &words(
                                derive_seed(seed, 0xA6E4, (s * 10_000 + k) as u64),
                                a.agent_tool_tokens,
                            ),
                        )
                    };
                    Step {
                        append: body + &section("AGENT", ""),
                        max_tokens: a.agent_answer_tokens,
                        think_ms: if k == 0 {
                            0
                        } else {
                            super::think(&mut rng, a.agent_tool_ms)
                        },
                    }
                })
                .collect();
            Session {
                id: 0,
                group: 0,
                prefix: system.clone(),
                steps,
            }
        })
        .collect();
    Trace {
        name: "agentic".into(),
        sessions,
    }
}
