//! The theoretical maximum prefix-cache hit rate of an executed trace.
//!
//! With an unlimited cache, a prompt token is a hit when its whole block (at the sim's
//! block granularity, chained over the full prefix) was already computed by an earlier
//! request: as part of its prompt or of its generated answer. Like vLLM (and the sim),
//! at most `(prompt_tokens - 1) / block_size` leading blocks are looked up, so at least
//! one token is always recomputed. The tokens are the sim's: `<|begin_of_text|>` then
//! one token per 4 bytes of the completion prompt.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};

use crate::text::BYTES_PER_TOKEN;

/// Chained keys of the full blocks of one token sequence.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockKeys {
    /// Tokens in the sequence (BOS included).
    pub tokens: usize,
    /// One key per full block, in order; key i depends on blocks 0..=i.
    pub keys: Vec<u64>,
}

impl BlockKeys {
    /// Keys of the completion prompt `text` as the sim tokenizes it.
    pub fn of(text: &[u8], block_size: usize) -> Self {
        let tokens = 1 + text.len().div_ceil(BYTES_PER_TOKEN);
        let full = tokens / block_size;
        let mut keys = Vec::with_capacity(full);
        let mut parent = 0u64;
        for b in 0..full {
            // Token 0 is BOS; token t >= 1 is bytes [4(t-1), 4t).
            let first_tok = b * block_size;
            let last_tok = first_tok + block_size; // exclusive
            let start = first_tok.saturating_sub(1) * BYTES_PER_TOKEN;
            let end = ((last_tok - 1) * BYTES_PER_TOKEN).min(text.len());
            let mut h = DefaultHasher::new();
            parent.hash(&mut h);
            (b == 0).hash(&mut h);
            text[start..end].hash(&mut h);
            parent = h.finish();
            keys.push(parent);
        }
        BlockKeys { tokens, keys }
    }
}

/// What the cache saw of one request: its prompt, and prompt + answer.
#[derive(Debug, Clone, Default)]
pub struct RequestBlocks {
    /// Blocks of the prompt.
    pub prompt: BlockKeys,
    /// Blocks of prompt + generated answer (cached after the request).
    pub sequence: BlockKeys,
}

impl RequestBlocks {
    /// Blocks of a request whose completion prompt was `prompt` and answer `answer`.
    pub fn new(prompt: &str, answer: &str, block_size: usize) -> Self {
        let mut seq = Vec::with_capacity(prompt.len() + answer.len());
        seq.extend_from_slice(prompt.as_bytes());
        seq.extend_from_slice(answer.as_bytes());
        RequestBlocks {
            prompt: BlockKeys::of(prompt.as_bytes(), block_size),
            sequence: BlockKeys::of(&seq, block_size),
        }
    }
}

/// Totals of the theoretical maximum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TheoreticalMax {
    /// Prompt tokens of all requests.
    pub prompt_tokens: u64,
    /// Prompt tokens an unlimited cache would serve.
    pub hit_tokens: u64,
}

impl TheoreticalMax {
    /// `hit_tokens / prompt_tokens` (0 when empty).
    pub fn rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

/// The theoretical maximum over requests given in the order they started.
pub fn theoretical_max(requests: &[RequestBlocks], block_size: usize) -> TheoreticalMax {
    let mut seen: HashSet<u64> = HashSet::new();
    let mut out = TheoreticalMax::default();
    for r in requests {
        out.prompt_tokens += r.prompt.tokens as u64;
        let lookable = r.prompt.tokens.saturating_sub(1) / block_size;
        let hits = r
            .prompt
            .keys
            .iter()
            .take(lookable)
            .take_while(|k| seen.contains(k))
            .count();
        out.hit_tokens += (hits * block_size) as u64;
        seen.extend(r.prompt.keys.iter().copied());
        seen.extend(r.sequence.keys.iter().copied());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(p: &str, a: &str) -> RequestBlocks {
        RequestBlocks::new(p, a, 16)
    }

    #[test]
    fn block_count_matches_sim_tokenizer() {
        // 60 bytes = 15 tokens + BOS = 16 tokens = one full block.
        assert_eq!(BlockKeys::of(&[b'a'; 60], 16).keys.len(), 1);
        assert_eq!(BlockKeys::of(&[b'a'; 59], 16).keys.len(), 1);
        assert_eq!(BlockKeys::of(&[b'a'; 56], 16).keys.len(), 0);
        assert_eq!(BlockKeys::of(&[b'a'; 124], 16).tokens, 32);
    }

    #[test]
    fn identical_prompts_hit_all_but_the_last_block() {
        let p = "x".repeat(124); // 32 tokens: looks up 1 block
        let t = theoretical_max(&[req(&p, ""), req(&p, "")], 16);
        assert_eq!(
            t,
            TheoreticalMax {
                prompt_tokens: 64,
                hit_tokens: 16
            }
        );
    }

    #[test]
    fn shared_prefix_chains_and_divergence_stops_it() {
        let base = "abcd".repeat(100); // 101 tokens
        let a = format!("{base}{}", "q".repeat(400));
        let b = format!("{base}{}", "r".repeat(400));
        let t = theoretical_max(&[req(&a, ""), req(&b, "")], 16);
        // The first 6 blocks (96 tokens: BOS + 95) are inside the shared 101 tokens.
        assert_eq!(t.hit_tokens, 96);
        // A different first block kills the whole chain.
        let c = format!("Z{}", &a[1..]);
        assert_eq!(
            theoretical_max(&[req(&a, ""), req(&c, "")], 16).hit_tokens,
            0
        );
    }

    #[test]
    fn next_turn_hits_the_generated_answer() {
        let p1 = "abcd".repeat(124); // 125 tokens with BOS
        let ans = "the ".repeat(40);
        let p2 = format!("{p1}{ans}{}", "next".repeat(30));
        let t = theoretical_max(&[req(&p1, &ans), req(&p2, "")], 16);
        // p1 + answer = 165 tokens = 10 full blocks, all prefixes of p2 (195 tokens).
        assert_eq!(t.hit_tokens, 160);
        assert!((t.rate() - 0.5).abs() < 1e-9); // 160 of 125 + 195
    }
}
