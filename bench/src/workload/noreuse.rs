//! No reuse (control): every prompt is unique from its first block, so no router can
//! hit the cache and only load balancing matters.

use serde::Serialize;

use crate::text::{derive_seed, pad4, section, words};
use crate::trace::{Session, Step, Trace};

/// Parameters of the no-reuse workload.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct NoReuseArgs {
    /// No reuse: requests (each its own session).
    #[arg(long, default_value_t = 160)]
    pub noreuse_requests: usize,
    /// No reuse: prompt length, tokens.
    #[arg(long, default_value_t = 1500)]
    pub noreuse_prompt_tokens: usize,
    /// No reuse: answer length, tokens.
    #[arg(long, default_value_t = 100)]
    pub noreuse_answer_tokens: u32,
}

/// Generates the no-reuse trace.
pub fn generate(a: &NoReuseArgs, seed: u64) -> Trace {
    let sessions = (0..a.noreuse_requests)
        .map(|i| Session {
            id: 0,
            group: i,
            // The unique words come first so the very first block already differs.
            prefix: pad4(words(
                derive_seed(seed, 0x40E, i as u64),
                a.noreuse_prompt_tokens,
            ))
            .into(),
            steps: vec![Step {
                append: section("ANSWER", ""),
                max_tokens: a.noreuse_answer_tokens,
                think_ms: 0,
            }],
        })
        .collect();
    Trace {
        name: "no-reuse".into(),
        sessions,
    }
}
