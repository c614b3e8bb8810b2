//! One endpoint's load at one scrape: the few figures routing uses, already
//! aggregated over the engine's series (see `metrics::profile` for how).
//! A routing decision copies it per candidate, so it holds only the load
//! figures: the LoRA adapters a scrape lists (`lora.rs`) are kept beside
//! it in the scrape state.

use serde::{Deserialize, Serialize};

/// The load figures routing uses, read from one scrape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MetricsSnapshot {
    /// Requests waiting in the engine's queue (sum over series; 0 when the
    /// engine does not report it).
    pub waiting: f64,
    /// Requests running (sum over series; 0 when not reported).
    pub running: f64,
    /// KV-cache utilization 0..1 (mean over series), when reported.
    pub kv_usage: Option<f64>,
    /// KV-cache capacity in tokens (`block_size x num_gpu_blocks`, summed
    /// over series), when reported.
    pub kv_capacity_tokens: Option<u64>,
}
