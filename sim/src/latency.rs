//! The latency model: how long one engine step (one forward pass of a continuous batch)
//! takes on the simulated GPU.
//!
//! Routing quality shows up as latency, so the simulator needs a step time that reacts to
//! what routing changes: uncached prompt tokens (prefill is compute-bound) and the size of
//! the running batch and its context (decode is memory-bound). The defaults approximate
//! Llama-3.1-8B-Instruct in BF16 on one H100 SXM (80 GB) under vLLM; `sim/README.md`
//! derives each number. All durations are simulated seconds; `--time-scale` maps them to
//! wall time elsewhere.

/// Parameters of the step-time model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyModel {
    /// Fixed cost of one forward pass: reading the weights once (16 GB at ~3.35 TB/s,
    /// ~75% of peak bandwidth) plus scheduling/launch overhead. Default 6.5 ms.
    pub step_overhead_s: f64,
    /// Compute cost of one token in the batch, prefill or decode: ~16 GFLOP per token
    /// (2 x 8B parameters) at ~400 TFLOP/s effective (40% of the H100's 989 dense BF16
    /// TFLOP/s). Default 40 us.
    pub per_token_s: f64,
    /// Cost of reading one token of KV context per decoding sequence per step:
    /// 128 KiB per token (32 layers x 8 KV heads x 128 dims x 2 (K,V) x 2 bytes) at
    /// ~3.35 TB/s. Default 40 ns.
    pub kv_read_per_token_s: f64,
}

impl Default for LatencyModel {
    fn default() -> Self {
        Self {
            step_overhead_s: 0.0065,
            per_token_s: 40e-6,
            kv_read_per_token_s: 40e-9,
        }
    }
}

/// What one engine step computes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepWork {
    /// Uncached prompt tokens prefilled in this step (all sequences).
    pub prefill_tokens: usize,
    /// Sequences that decode one token in this step.
    pub decode_seqs: usize,
    /// Total context tokens (prompt + generated so far) of the decoding sequences.
    pub decode_context_tokens: usize,
}

impl LatencyModel {
    /// Duration of one step in simulated seconds (0 for an empty step).
    pub fn step_time(&self, work: StepWork) -> f64 {
        if work.prefill_tokens == 0 && work.decode_seqs == 0 {
            return 0.0;
        }
        self.step_overhead_s
            + (work.prefill_tokens + work.decode_seqs) as f64 * self.per_token_s
            + work.decode_context_tokens as f64 * self.kv_read_per_token_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_grows_with_uncached_tokens_and_decode_with_batch() {
        let m = LatencyModel::default();
        let small = m.step_time(StepWork {
            prefill_tokens: 100,
            ..Default::default()
        });
        let big = m.step_time(StepWork {
            prefill_tokens: 2000,
            ..Default::default()
        });
        assert!(big > small);
        let b1 = m.step_time(StepWork {
            decode_seqs: 1,
            decode_context_tokens: 500,
            ..Default::default()
        });
        let b64 = m.step_time(StepWork {
            decode_seqs: 64,
            decode_context_tokens: 64 * 500,
            ..Default::default()
        });
        assert!(b64 > b1);
        // Batch-1 decode of an 8B model on an H100: ~6.5 ms a token.
        assert!((0.006..0.008).contains(&b1));
        assert_eq!(m.step_time(StepWork::default()), 0.0);
    }
}
