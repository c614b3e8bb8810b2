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

impl MetricsSnapshot {
    /// The snapshot less `finished` requests that have left the engine since
    /// it was read: taken from its queue first (each one that finishes lets
    /// a queued one start: a full engine's running count holds), then from
    /// its running requests; neither goes below 0.
    pub fn less_finished(self, finished: u32) -> Self {
        let finished = f64::from(finished);
        let waiting = (self.waiting - finished).max(0.0);
        let from_running = finished - (self.waiting - waiting);
        Self {
            waiting,
            running: (self.running - from_running).max(0.0),
            ..self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn finished_requests_leave_the_queue_first_then_the_running() {
        let s = MetricsSnapshot {
            waiting: 2.0,
            running: 3.0,
            kv_usage: Some(0.5),
            kv_capacity_tokens: Some(1_000),
        };
        assert_eq!(s.less_finished(0), s);
        let one = s.less_finished(1);
        assert_eq!((one.waiting, one.running), (1.0, 3.0));
        let four = s.less_finished(4);
        assert_eq!((four.waiting, four.running), (0.0, 1.0));
        let all = s.less_finished(9);
        assert_eq!((all.waiting, all.running), (0.0, 0.0));
        assert_eq!(all.kv_usage, Some(0.5), "the cache is not a request count");
        let odd = MetricsSnapshot {
            waiting: f64::NAN,
            running: 1.0,
            ..s
        };
        assert!(odd.less_finished(1).running.is_finite());
    }
}
