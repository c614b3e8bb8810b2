//! A deterministic approximate tokenizer.
//!
//! The simulator needs token counts and token identities that behave like a real
//! tokenizer where routing is concerned (about 4 bytes a token for English text, the same
//! text always giving the same tokens, a shared text prefix giving shared leading tokens),
//! without shipping a vocabulary. The rule is simple enough to reproduce anywhere:
//! token `i` of a text segment is the UTF-8 bytes `[4i, 4i+4)` of that segment (the last
//! token may be shorter), and its id is the low 32 bits of the XXH3-64 hash of those bytes.

use xxhash_rust::xxh3::xxh3_64;

/// A token id of the approximate vocabulary.
pub type TokenId = u32;

/// Bytes of text per token.
pub const BYTES_PER_TOKEN: usize = 4;

/// The id of one token made of the given bytes (at most [`BYTES_PER_TOKEN`] of them).
pub fn token_id(chunk: &[u8]) -> TokenId {
    xxh3_64(chunk) as TokenId
}

/// Number of tokens `text` tokenizes to: `ceil(len_bytes / 4)`.
pub fn token_count(text: &str) -> usize {
    text.len().div_ceil(BYTES_PER_TOKEN)
}

/// Appends the tokens of one text segment to `out`.
pub fn tokenize_into(text: &str, out: &mut Vec<TokenId>) {
    out.reserve(token_count(text));
    out.extend(text.as_bytes().chunks(BYTES_PER_TOKEN).map(token_id));
}

/// The tokens of one text segment.
pub fn tokenize(text: &str) -> Vec<TokenId> {
    let mut out = Vec::new();
    tokenize_into(text, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_bytes_a_token() {
        assert_eq!(token_count(""), 0);
        assert_eq!(token_count("abc"), 1);
        assert_eq!(token_count("abcd"), 1);
        assert_eq!(token_count("abcde"), 2);
        assert_eq!(tokenize("abcdefgh").len(), 2);
    }

    #[test]
    fn deterministic_and_prefix_preserving() {
        let a = tokenize("hello world, this is a test");
        let b = tokenize("hello world, this is a test of prefixes");
        assert_eq!(a, tokenize("hello world, this is a test"));
        // Leading full 4-byte chunks are shared.
        assert_eq!(a[..6], b[..6]);
        assert_ne!(token_id(b"abcd"), token_id(b"abce"));
    }

    #[test]
    fn multibyte_text_does_not_panic() {
        let t = tokenize("héllo wörld ☃☃☃");
        assert_eq!(t.len(), token_count("héllo wörld ☃☃☃"));
    }
}
