//! The trace a workload generates: sessions of steps, fixed by the seed before the run.
//!
//! A session is one user's conversation (or agent loop, or question on a document):
//! a shared prefix (system prompt, document) and steps, each appending text to the
//! history. The server's answers are appended between steps at run time, so the prompt
//! of step k is `prefix + append[0] + answer[0] + ... + append[k]`. Everything except the
//! answers is decided here, deterministically from the seed.

use std::sync::Arc;

/// One request of a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Text appended to the history before this request (question, tool output).
    pub append: String,
    /// `max_tokens` of the request (the sim always generates exactly this many).
    pub max_tokens: u32,
    /// Think time before this step, in simulated milliseconds (scaled at run time).
    pub think_ms: u64,
}

/// A sequence of dependent requests sharing a growing prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// Index in the trace.
    pub id: usize,
    /// The prefix group (system prompt or document) this session shares.
    pub group: usize,
    /// Shared leading text (several sessions hold the same `Arc`).
    pub prefix: Arc<str>,
    /// The requests, in order.
    pub steps: Vec<Step>,
}

/// A whole workload: the sessions, in the order users pick them up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    /// Workload name.
    pub name: String,
    /// Sessions in start order.
    pub sessions: Vec<Session>,
}

impl Trace {
    /// The same trace with every prompt beginning with `salt`: nothing of it matches
    /// what a trace with another salt left in an engine's cache (rows that share
    /// existing endpoints).
    pub fn salted(&self, salt: &str) -> Trace {
        let mut t = self.clone();
        for s in &mut t.sessions {
            s.prefix = format!("[{salt}] {}", s.prefix).into();
        }
        t
    }

    /// Number of requests in the trace.
    pub fn requests(&self) -> usize {
        self.sessions.iter().map(|s| s.steps.len()).sum()
    }

    /// Total prompt bytes sent if answers were empty (a size estimate for logs).
    pub fn approx_prompt_tokens(&self) -> usize {
        let mut total = 0;
        for s in &self.sessions {
            let mut len = s.prefix.len();
            for st in &s.steps {
                len += st.append.len() + st.max_tokens as usize * 4;
                total += len / 4;
            }
        }
        total
    }

    /// KV blocks the whole trace occupies once (each group's prefix once, then every
    /// session's appended text and answers), at `block_size` tokens per block.
    pub fn footprint_blocks(&self, block_size: usize) -> usize {
        let mut groups = std::collections::HashSet::new();
        let mut tokens = 0usize;
        for s in &self.sessions {
            if groups.insert(s.group) {
                tokens += s.prefix.len() / 4 + 1;
            }
            for st in &s.steps {
                tokens += st.append.len() / 4 + st.max_tokens as usize;
            }
        }
        tokens.div_ceil(block_size.max(1))
    }

    /// KV blocks the largest request of the trace reserves (prompt + answer).
    pub fn max_request_blocks(&self, block_size: usize) -> usize {
        let mut max = 0usize;
        for s in &self.sessions {
            let mut tokens = s.prefix.len() / 4 + 1;
            for st in &s.steps {
                tokens += st.append.len() / 4 + st.max_tokens as usize;
                max = max.max(tokens);
            }
        }
        max.div_ceil(block_size.max(1))
    }

    /// Interleaves sessions deterministically (Fisher-Yates with the given seed),
    /// so that groups mix in the arrival order as they would in production.
    pub fn shuffle(&mut self, seed: u64) {
        let mut rng = fastrand::Rng::with_seed(seed);
        rng.shuffle(&mut self.sessions);
        for (i, s) in self.sessions.iter_mut().enumerate() {
            s.id = i;
        }
    }
}
