//! Cache pressure, the headline: the shape of llm-d's published prefix-cache benchmark
//! (many groups, each a ~6000-token system prompt; ~1200-token questions; long outputs),
//! sized with the pods' `--kv-blocks` so that all groups' prefixes overflow one pod's
//! KV-cache but fit in the fleet's. Round robin makes every pod cycle through every
//! group and thrash; a router that keeps each group on one pod keeps them all resident.

use std::sync::Arc;

use serde::Serialize;

use crate::text::{derive_seed, pad4, section, words};
use crate::trace::{Session, Step, Trace};

/// Parameters of the cache-pressure workload.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct PressureArgs {
    /// Pressure: groups (distinct system prompts).
    #[arg(long, default_value_t = 150)]
    pub pressure_groups: usize,
    /// Pressure: system prompt length, tokens.
    #[arg(long, default_value_t = 6000)]
    pub pressure_system_tokens: usize,
    /// Pressure: question length, tokens.
    #[arg(long, default_value_t = 1200)]
    pub pressure_question_tokens: usize,
    /// Pressure: answer length, tokens.
    #[arg(long, default_value_t = 250)]
    pub pressure_answer_tokens: u32,
    /// Pressure: questions per group (each a one-request session).
    #[arg(long, default_value_t = 5)]
    pub pressure_questions_per_group: usize,
}

impl PressureArgs {
    /// KV blocks all groups' system prompts occupy (to size `--kv-blocks` against).
    pub fn prefix_blocks(&self, block_size: usize) -> usize {
        self.pressure_groups * (self.pressure_system_tokens + 2).div_ceil(block_size)
    }
}

/// Generates the cache-pressure trace.
pub fn generate(a: &PressureArgs, seed: u64) -> Trace {
    let mut sessions = Vec::new();
    for g in 0..a.pressure_groups {
        let system: Arc<str> = pad4(format!(
            "SYSTEM: {}",
            words(
                derive_seed(seed, 0x9E55, g as u64),
                a.pressure_system_tokens
            )
        ))
        .into();
        for q in 0..a.pressure_questions_per_group {
            let question = words(
                derive_seed(seed, 0x9E56, (g * 10_000 + q) as u64),
                a.pressure_question_tokens,
            );
            sessions.push(Session {
                id: 0,
                group: g,
                prefix: system.clone(),
                steps: vec![Step {
                    append: section("USER", &question) + &section("ASSISTANT", ""),
                    max_tokens: a.pressure_answer_tokens,
                    think_ms: 0,
                }],
            });
        }
    }
    Trace {
        name: "pressure".into(),
        sessions,
    }
}
