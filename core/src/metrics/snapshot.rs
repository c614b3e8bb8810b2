//! One endpoint's load at one scrape.

use serde::{Deserialize, Serialize};

/// The load figures routing uses, read from one scrape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MetricsSnapshot {
    /// Requests waiting in the engine's queue.
    pub waiting: f64,
    /// Requests running.
    pub running: f64,
    /// KV-cache utilization 0..1, when reported.
    pub kv_usage: Option<f64>,
    /// KV-cache capacity in tokens (`block_size x num_gpu_blocks`), when reported.
    pub kv_capacity_tokens: Option<u64>,
}
