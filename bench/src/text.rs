//! Seeded synthetic text, aligned to the simulator's 4-byte tokens.
//!
//! The simulator tokenizes 4 bytes to a token, and its answers are 4-byte pieces.
//! Keeping every piece of a prompt a multiple of 4 bytes long makes "prompt +
//! answer" re-tokenize to exactly the tokens the pod cached, so the next turn of a
//! conversation can hit the generated blocks too, as with a real tokenizer.

/// Bytes per simulator token.
pub const BYTES_PER_TOKEN: usize = 4;

/// A seed derived from a base seed, a domain tag and an index (splitmix64 mixing),
/// so that every piece of a workload has its own independent, reproducible stream.
pub fn derive_seed(seed: u64, tag: u64, index: u64) -> u64 {
    let mut z = seed
        .wrapping_add(tag.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(index.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(0x94D0_49BB_1331_11EB);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `tokens` tokens of random 3-letter words ("abc "), one token each.
pub fn words(seed: u64, tokens: usize) -> String {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut s = String::with_capacity(tokens * BYTES_PER_TOKEN);
    for _ in 0..tokens {
        for _ in 0..3 {
            s.push(rng.lowercase());
        }
        s.push(' ');
    }
    s
}

/// Appends spaces until the length is a multiple of [`BYTES_PER_TOKEN`].
pub fn pad4(mut s: String) -> String {
    while s.len() % BYTES_PER_TOKEN != 0 {
        s.push(' ');
    }
    s
}

/// A labelled section ("\n\nUSER: ...") padded to whole tokens.
pub fn section(label: &str, body: &str) -> String {
    pad4(format!("\n\n{label}: {body}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_seeded_and_token_sized() {
        assert_eq!(words(1, 50), words(1, 50));
        assert_ne!(words(1, 50), words(2, 50));
        assert_eq!(words(3, 50).len(), 200);
        assert_ne!(derive_seed(1, 2, 3), derive_seed(1, 2, 4));
        assert_eq!(section("USER", "ab").len() % 4, 0);
    }
}
