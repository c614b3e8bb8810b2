//! Load awareness: the Prometheus text of an endpoint's `/metrics` becomes
//! a [`MetricsSnapshot`].
//!
//! - [`exposition`]: a zero-copy, never-panicking text-format parser that
//!   skips unwanted families after reading only their name.
//! - [`profile`]: which names each engine (vLLM, SGLang, TensorRT-LLM,
//!   custom, auto-detected) uses, and how several series are aggregated.
//! - [`snapshot`]: the result.
//! - [`schedule`]: which endpoints are scraped on a tick (the pool's
//!   scrape budget) and how the age thresholds follow the period.
//! - [`lora`]: the LoRA adapters an endpoint runs (vLLM).
//! - [`scrape`]: what a scrape (status + body) means for health and load.

pub mod exposition;
pub mod lora;
pub mod profile;
pub mod schedule;
pub mod scrape;
pub mod snapshot;

pub use snapshot::MetricsSnapshot;

use crate::config::MetricsConfig;
use std::fmt;

/// Why a scrape could not be read (names the metrics that were looked for).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricsError(pub String);

impl fmt::Display for MetricsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unreadable metrics: {}", self.0)
    }
}

impl std::error::Error for MetricsError {}

/// Reads a scrape into a snapshot with the configured engine profile.
pub fn read_snapshot(text: &str, cfg: &MetricsConfig) -> Result<MetricsSnapshot, MetricsError> {
    profile::read(text, cfg).map(|(s, _)| s)
}

/// What one readable scrape says: the load figures, and beside them what
/// is not load.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Reading {
    /// The load figures.
    pub snapshot: MetricsSnapshot,
    /// The LoRA adapters the engine lists (`lora.rs`), when it reports them.
    pub lora: Option<lora::LoraSnapshot>,
    /// The engine's count of prompt tokens processed since it started
    /// (summed over series), when it reports one: a value below the last
    /// one read means the engine restarted, and its prefix cache with it
    /// (`shared::endpoint_state`).
    pub prompt_tokens_total: Option<f64>,
    /// The engine's count of prompt tokens served from its prefix cache
    /// (summed over series), when it reports one (`cache_trust`).
    pub prefix_hits_total: Option<f64>,
    /// Where the engine answers its slot count (llama.cpp's `/props`,
    /// `engine_slots.rs`), when its profile knows one.
    pub slots_path: Option<&'static str>,
    /// Whether the engine closes its connection after every streamed
    /// answer (`profile::NameProfile::closes_after_stream`).
    pub closes_after_stream: bool,
}

impl From<MetricsSnapshot> for Reading {
    fn from(snapshot: MetricsSnapshot) -> Self {
        Reading {
            snapshot,
            ..Reading::default()
        }
    }
}

/// [`read_snapshot`], with the rest of the scrape ([`Reading`]).
pub fn read_scrape(text: &str, cfg: &MetricsConfig) -> Result<Reading, MetricsError> {
    profile::read_all(text, cfg).map(|(r, _)| r)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn read_snapshot_uses_the_config() {
        let text = include_str!(
            "../../../tests/fixtures/metrics/sglang-docs-production-metrics-llama3.1-8b.txt"
        );
        let s = read_snapshot(text, &MetricsConfig::default()).unwrap();
        assert_eq!(
            (s.waiting, s.running, s.kv_usage),
            (2826.0, 162.0, Some(0.28))
        );
        let e = read_snapshot("nothing 1\n", &MetricsConfig::default()).unwrap_err();
        assert!(e.to_string().starts_with("unreadable metrics"));
    }
}
