//! The slot count an engine reports about itself: how many requests it
//! runs at once, the limit past which a request waits for one to finish
//! (`slots.rs`).
//!
//! | engine | where | field |
//! |---|---|---|
//! | llama.cpp `llama-server` | `GET /props` | `total_slots` (its `--parallel`) |
//!
//! vLLM, SGLang and TensorRT-LLM publish no such number where kvroute can
//! read it (their `/metrics` have none): for them the limit is learnt from
//! scrapes, or configured (`scheduling.engine_slots`). The metrics profile
//! of the engine a scrape was read as names the path (`metrics::Reading`).
//!
//! **When an endpoint is asked** ([`SlotAsks`]): once its scrapes read as
//! an engine that reports one, until an answer gives the count; again once
//! its engine restarted (its prompt-token counter went down: it may run
//! with another `--parallel`; the shared scrape state drops the count).
//! A failed ask is retried [`RETRY_MS`] later. Only the scraping VM asks;
//! the count reaches every worker through the shared scrape state.
//!
//! **Bounds.** An answer over [`MAX_BODY_BYTES`] is not read (a `/props`
//! carries the chat template: 2.3 KB for SmolLM2's, tens of KB for some);
//! a count of 0 or over `config::MAX_ENGINE_SLOTS` is no count. The asks
//! keep one timestamp per endpoint asked, pool members only.

use crate::config::MAX_ENGINE_SLOTS;
use crate::endpoint::Endpoint;
use hashbrown::HashMap;
use serde::Deserialize;

/// llama.cpp's properties endpoint.
pub const LLAMACPP_PATH: &str = "/props";

/// Largest answer read.
pub const MAX_BODY_BYTES: usize = 256 << 10;

/// How long after an ask without a count the endpoint is asked again.
pub const RETRY_MS: u64 = 10_000;

/// Why an answer gave no slot count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotsError {
    /// No answer (a timeout, a reset), or one over [`MAX_BODY_BYTES`].
    NoAnswer,
    /// An answer with another status than 200.
    Status(u16),
    /// Not a JSON object with a `total_slots` count in range.
    NoCount,
}

#[derive(Deserialize)]
struct Props {
    total_slots: Option<u64>,
}

/// The slot count in an answer to [`LLAMACPP_PATH`]: its `status`
/// (`None`: no answer) and `body` (`None`: not read).
pub fn read_total_slots(status: Option<u16>, body: Option<&[u8]>) -> Result<u32, SlotsError> {
    match status {
        None => return Err(SlotsError::NoAnswer),
        Some(200) => {}
        Some(s) => return Err(SlotsError::Status(s)),
    }
    let body = body.ok_or(SlotsError::NoAnswer)?;
    // An object only (serde would read a struct from an array too).
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(SlotsError::NoCount);
    }
    let props: Props = serde_json::from_slice(body).map_err(|_| SlotsError::NoCount)?;
    props
        .total_slots
        .filter(|n| (1..=u64::from(MAX_ENGINE_SLOTS)).contains(n))
        .map(|n| n as u32)
        .ok_or(SlotsError::NoCount)
}

/// When each endpoint was last asked for its slot count (no clock read:
/// the caller passes the time).
#[derive(Clone, Debug, Default)]
pub struct SlotAsks {
    asked_at_ms: HashMap<Endpoint, u64>,
}

impl SlotAsks {
    /// Whether to ask `endpoint` now: its count is not `known`, and it was
    /// not asked within [`RETRY_MS`] (an ask in flight counts as asked).
    pub fn due(&self, endpoint: &Endpoint, known: bool, now_ms: u64) -> bool {
        !known
            && self
                .asked_at_ms
                .get(endpoint)
                .is_none_or(|&at| now_ms.saturating_sub(at) >= RETRY_MS)
    }

    /// `endpoint` was asked at `now_ms`.
    pub fn asked(&mut self, endpoint: Endpoint, now_ms: u64) {
        self.asked_at_ms.insert(endpoint, now_ms);
    }

    /// Its engine restarted: ask it again as soon as its count is unknown.
    pub fn forget(&mut self, endpoint: &Endpoint) {
        self.asked_at_ms.remove(endpoint);
    }

    /// Forgets endpoints that left the pool (`pool` sorted).
    pub fn retain(&mut self, pool: &[Endpoint]) {
        self.asked_at_ms
            .retain(|e, _| pool.binary_search(e).is_ok());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const PROPS: &[u8] =
        include_bytes!("../../tests/fixtures/engine/llamacpp-11434-smollm2-np2-props.json");

    #[test]
    fn a_real_llama_server_reports_its_parallel_slots() {
        assert_eq!(read_total_slots(Some(200), Some(PROPS)), Ok(2));
    }

    #[test]
    fn answers_without_a_count_in_range_give_none() {
        type Case<'a> = (Option<u16>, Option<&'a [u8]>, SlotsError);
        let cases: &[Case] = &[
            (None, None, SlotsError::NoAnswer),
            (Some(200), None, SlotsError::NoAnswer),
            (Some(404), Some(b"not found"), SlotsError::Status(404)),
            (Some(503), Some(PROPS), SlotsError::Status(503)),
            (Some(200), Some(b""), SlotsError::NoCount),
            (Some(200), Some(b"<html>"), SlotsError::NoCount),
            (Some(200), Some(b"[2]"), SlotsError::NoCount),
            (Some(200), Some(b"{}"), SlotsError::NoCount),
            (
                Some(200),
                Some(br#"{"total_slots":0}"#),
                SlotsError::NoCount,
            ),
            (
                Some(200),
                Some(br#"{"total_slots":-1}"#),
                SlotsError::NoCount,
            ),
            (
                Some(200),
                Some(br#"{"total_slots":2.5}"#),
                SlotsError::NoCount,
            ),
            (
                Some(200),
                Some(br#"{"total_slots":"2"}"#),
                SlotsError::NoCount,
            ),
            (
                Some(200),
                Some(br#"{"total_slots":65537}"#),
                SlotsError::NoCount,
            ),
            (
                Some(200),
                Some(br#"{"total_slots":99999999999999999999999}"#),
                SlotsError::NoCount,
            ),
            (
                Some(200),
                Some(br#"{"total_slots":null}"#),
                SlotsError::NoCount,
            ),
        ];
        for (status, body, want) in cases {
            assert_eq!(
                read_total_slots(*status, *body),
                Err(*want),
                "{status:?} {:?}",
                body.map(String::from_utf8_lossy)
            );
        }
        assert_eq!(
            read_total_slots(Some(200), Some(br#"{"total_slots":65536,"x":[1]}"#)),
            Ok(65_536)
        );
    }

    #[test]
    fn an_endpoint_is_asked_until_it_answers_and_again_after_a_restart() {
        let e: Endpoint = "10.0.0.1:8080".parse().unwrap();
        let other: Endpoint = "10.0.0.2:8080".parse().unwrap();
        let mut asks = SlotAsks::default();
        assert!(asks.due(&e, false, 0));
        assert!(!asks.due(&e, true, 0), "a known count is not asked for");
        asks.asked(e, 100);
        // In flight or unanswered: asked again only after the retry time.
        assert!(!asks.due(&e, false, 100 + RETRY_MS - 1));
        assert!(asks.due(&e, false, 100 + RETRY_MS));
        // A restart: at once.
        asks.forget(&e);
        assert!(asks.due(&e, false, 200));
        asks.asked(e, 200);
        asks.asked(other, 200);
        asks.retain(&[e]);
        assert!(asks.due(&other, false, 201), "left the pool: forgotten");
        assert_eq!(asks.asked_at_ms.len(), 1);
    }
}
