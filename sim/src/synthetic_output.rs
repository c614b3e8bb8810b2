//! Synthetic generated text: deterministic, exactly one token per emitted piece.
//!
//! Clients need real-looking text and token counts that agree with `usage`, and
//! benchmarks need runs to repeat, so the output is drawn from a small table of 4-byte
//! pieces by an RNG seeded from `--seed` and the prompt's tokens: the same prompt on the
//! same seed always gives the same answer, and re-tokenizing the answer gives exactly as
//! many tokens as were generated.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::tokenizer::{token_id, TokenId};

/// The pieces output is made of; each is exactly 4 bytes, so each is one token.
pub const PIECES: [&str; 32] = [
    "the ", "and ", "for ", "are ", "but ", "not ", "you ", "all ", "any ", "can ", "her ", "was ",
    "one ", "our ", "out ", "day ", "get ", "has ", "him ", "his ", "how ", "man ", "new ", "now ",
    "old ", "see ", "two ", "way ", "who ", "key ", "did ", "its ",
];

/// Picks `n` piece indices for a request.
pub fn pick_pieces(seed: u64, prompt: &[TokenId], n: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(prompt.len() * 4);
    for t in prompt {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    let mut rng = fastrand::Rng::with_seed(xxh3_64_with_seed(&bytes, seed));
    (0..n).map(|_| rng.u8(..PIECES.len() as u8)).collect()
}

/// The token ids of the given pieces.
pub fn piece_tokens(pieces: &[u8]) -> impl Iterator<Item = TokenId> + '_ {
    pieces
        .iter()
        .map(|p| token_id(PIECES[*p as usize % PIECES.len()].as_bytes()))
}

/// The text of one piece.
pub fn piece_text(piece: u8) -> &'static str {
    PIECES[piece as usize % PIECES.len()]
}

/// The text of the given pieces.
pub fn text(pieces: &[u8]) -> String {
    let mut s = String::with_capacity(pieces.len() * 4);
    for p in pieces {
        s.push_str(piece_text(*p));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tokenize;

    #[test]
    fn deterministic_and_one_token_per_piece() {
        let a = pick_pieces(7, &[1, 2, 3], 20);
        assert_eq!(a, pick_pieces(7, &[1, 2, 3], 20));
        assert_ne!(a, pick_pieces(8, &[1, 2, 3], 20));
        let t = text(&a);
        assert_eq!(tokenize(&t), piece_tokens(&a).collect::<Vec<_>>());
        assert!(PIECES.iter().all(|p| p.len() == 4));
    }
}
