//! Long-context QA: a few long documents (20k-100k tokens), many independent questions
//! on each. Every question resends its whole document, so routing decides whether a
//! pod prefills 20k+ tokens or a few dozen.

use std::sync::Arc;

use serde::Serialize;

use crate::text::{derive_seed, pad4, section, words};
use crate::trace::{Session, Step, Trace};

/// Parameters of the long-context QA workload.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct LongQaArgs {
    /// Long QA: documents.
    #[arg(long, default_value_t = 4)]
    pub qa_docs: usize,
    /// Long QA: length of the shortest document, tokens.
    #[arg(long, default_value_t = 20_000)]
    pub qa_doc_min_tokens: usize,
    /// Long QA: length of the longest document, tokens (others spread evenly between).
    #[arg(long, default_value_t = 60_000)]
    pub qa_doc_max_tokens: usize,
    /// Long QA: questions per document.
    #[arg(long, default_value_t = 16)]
    pub qa_questions: usize,
    /// Long QA: question length, tokens.
    #[arg(long, default_value_t = 60)]
    pub qa_question_tokens: usize,
    /// Long QA: answer length, tokens.
    #[arg(long, default_value_t = 80)]
    pub qa_answer_tokens: u32,
}

/// Length of document `d` of `a.qa_docs`, spread evenly from min to max.
pub fn doc_tokens(a: &LongQaArgs, d: usize) -> usize {
    if a.qa_docs <= 1 {
        return a.qa_doc_min_tokens;
    }
    let span = a.qa_doc_max_tokens.saturating_sub(a.qa_doc_min_tokens);
    a.qa_doc_min_tokens + span * d / (a.qa_docs - 1)
}

/// Generates the long-context QA trace.
pub fn generate(a: &LongQaArgs, seed: u64) -> Trace {
    let mut sessions = Vec::new();
    for d in 0..a.qa_docs {
        let doc: Arc<str> = pad4(format!(
            "DOCUMENT: {}",
            words(derive_seed(seed, 0xD0C, d as u64), doc_tokens(a, d))
        ))
        .into();
        for q in 0..a.qa_questions {
            let question = words(
                derive_seed(seed, 0xD0D, (d * 100_000 + q) as u64),
                a.qa_question_tokens,
            );
            sessions.push(Session {
                id: 0,
                group: d,
                prefix: doc.clone(),
                steps: vec![Step {
                    append: section("QUESTION", &question) + &section("ANSWER", ""),
                    max_tokens: a.qa_answer_tokens,
                    think_ms: 0,
                }],
            });
        }
    }
    Trace {
        name: "long-qa".into(),
        sessions,
    }
}
