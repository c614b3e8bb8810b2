//! Chained block hashing: the canonical prompt bytes are cut into fixed-size
//! blocks (`block_tokens * bytes_per_token` bytes, the filter does not
//! tokenize) and every *full* block gets a 64-bit hash that depends on the
//! whole prefix before it, like an engine's prefix-cache block keys:
//!
//! ```text
//! c_0 = xxh3_64_with_seed(block_0, 0)
//! c_i = xxh3_64_with_seed(block_i, c_{i-1})                    (i >= 1)
//! h_i = xxh3_64_with_seed(c_i as 8 little-endian bytes, seed)  (sealed)
//! ```
//!
//! So equal hashes at position `i` mean (up to 64-bit collisions) an equal
//! prompt prefix of `(i + 1) * block_bytes` bytes under the same seed
//! (model, cache salt and tools, see [`seed`] and `request`), and the index
//! can match prefixes block by block.
//!
//! Why the seed is applied last: a body may name its model, salt and tools
//! after its prompt; sealing each chain value at the end lets the request
//! parser hash the prompt in the one pass that reads it, and costs one small
//! hash per block.
//!
//! Leading blocks: a request may begin with `lead` blocks that stand for
//! content already captured by the seed (the tool definitions): they are
//! sealed from their position alone, so every request with the same seed
//! shares them, as the engine shares the KV of the same tools.
//!
//! Why xxh3 with the previous hash as its seed: it is the fastest good
//! 64-bit hash available in pure Rust (no SIMD needed, so it is also fast on
//! wasm32), and passing the chain value as the seed mixes it in without
//! copying the block next to it into a scratch buffer: one pass over the
//! bytes, no allocation. It is not a cryptographic hash: a client could
//! craft collisions, but a collision only misleads a routing guess (the
//! engine's own cache keys decide what is actually reused), never what a
//! response contains. Expected accidental collisions among 32 M indexed
//! blocks (1024 endpoints x 31250) are ~3e-5.
//!
//! [`BlockHasher`] is the streaming form that the request parser feeds
//! piece by piece, so a multi-MiB prompt is never concatenated into a second
//! buffer; [`block_hashes`] is the one-shot form.

use std::io;
use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

/// Domain tag of the seed derivation; bump it when the canonical prompt
/// format changes so that old and new hashes never mix (in the shared
/// decision log during a rolling upgrade, for instance).
const SEED_DOMAIN: &[u8] = b"kvroute/prefix/v2\0";

/// Seed of block 0: distinct per model and cache salt.
///
/// The model and the salt are length-framed, so `("ab", Some("c"))` and
/// `("a", Some("bc"))` differ. `None` and `Some("")` give the **same**
/// seed: an empty salt isolates nothing (vLLM only mixes a salt into its
/// block keys when it is non-empty, and rejects an empty one at the API), so
/// treating it as "no salt" keeps affinity with unsalted requests.
pub fn seed(model: &str, cache_salt: Option<&str>) -> u64 {
    let salt = cache_salt.unwrap_or("");
    // Streaming: the same hash as one-shot xxh3 of the concatenation,
    // without copying a client's (possibly huge) model name.
    let mut h = Xxh3::new();
    h.update(SEED_DOMAIN);
    h.update(&(model.len() as u64).to_le_bytes());
    h.update(model.as_bytes());
    h.update(&(salt.len() as u64).to_le_bytes());
    h.update(salt.as_bytes());
    h.digest()
}

/// The seed of a request whose prompt starts with tool definitions: the
/// model/salt seed with the tools' digest mixed in, so that the same
/// conversation with other tools shares nothing (as in the engine, where
/// the tools are rendered at the start of the prompt).
pub fn seed_with_tools(seed: u64, tools_digest: u64) -> u64 {
    xxh3_64_with_seed(&tools_digest.to_le_bytes(), seed ^ 0x0074_6f6f_6c73)
}

/// Sealed chained hashes of the full `block_bytes`-sized blocks of
/// `prompt`, at most `max_blocks`. A trailing partial block is not hashed;
/// `block_bytes` of 0 yields no blocks.
pub fn block_hashes(seed: u64, prompt: &[u8], block_bytes: usize, max_blocks: usize) -> Vec<u64> {
    let mut h = BlockHasher::new(block_bytes, max_blocks);
    h.write(prompt);
    h.finish(seed, 0)
}

/// Seals one chain value (or leading-block position) with the seed.
fn seal(value: u64, seed: u64) -> u64 {
    xxh3_64_with_seed(&value.to_le_bytes(), seed)
}

/// Chain value of leading block `j`: distinct from any content chain value
/// (up to 64-bit collisions) by its domain tag.
fn lead_value(j: usize) -> u64 {
    xxh3_64_with_seed(b"kvroute/lead", j as u64)
}

/// Streaming chained block hasher: feed the canonical prompt in pieces of
/// any size with [`BlockHasher::write`]; [`BlockHasher::finish`] seals the
/// result, which equals [`block_hashes`] of the concatenation. Full blocks
/// that lie inside one piece are hashed in place; only a block straddling
/// two pieces is copied, into a buffer of at most `block_bytes`.
#[derive(Clone, Debug)]
pub struct BlockHasher {
    prev: u64,
    block_bytes: usize,
    max_blocks: usize,
    buf: Vec<u8>,
    hashes: Vec<u64>,
    total: usize,
}

impl BlockHasher {
    /// A hasher for blocks of `block_bytes` bytes (0: hash nothing), keeping
    /// at most `max_blocks` hashes. The seed comes at [`BlockHasher::finish`].
    pub fn new(block_bytes: usize, max_blocks: usize) -> Self {
        BlockHasher {
            prev: 0,
            block_bytes,
            max_blocks: if block_bytes == 0 { 0 } else { max_blocks },
            buf: Vec::new(),
            hashes: Vec::new(),
            total: 0,
        }
    }

    /// Reserves room for about `bytes` more prompt bytes worth of hashes
    /// (never more than the cap), to avoid regrowing the hash vector.
    pub fn reserve_for(&mut self, bytes: usize) {
        if let Some(blocks) = bytes.checked_div(self.block_bytes) {
            let room = self.max_blocks.saturating_sub(self.hashes.len());
            self.hashes.reserve(blocks.min(room));
        }
    }

    /// Appends canonical prompt bytes.
    pub fn write(&mut self, mut bytes: &[u8]) {
        self.total = self.total.saturating_add(bytes.len());
        if self.is_full() {
            return;
        }
        if !self.buf.is_empty() {
            let take = (self.block_bytes - self.buf.len()).min(bytes.len());
            let (head, rest) = bytes.split_at(take);
            self.buf.extend_from_slice(head);
            bytes = rest;
            if self.buf.len() < self.block_bytes {
                return;
            }
            let h = xxh3_64_with_seed(&self.buf, self.prev);
            self.push(h);
            self.buf.clear();
        }
        while !self.is_full() && bytes.len() >= self.block_bytes {
            let (block, rest) = bytes.split_at(self.block_bytes);
            let h = xxh3_64_with_seed(block, self.prev);
            self.push(h);
            bytes = rest;
        }
        if !self.is_full() {
            self.buf.extend_from_slice(bytes);
        }
    }

    fn push(&mut self, h: u64) {
        self.prev = h;
        self.hashes.push(h);
        if self.is_full() {
            // Nothing more will be hashed: drop the partial-block buffer.
            self.buf = Vec::new();
        }
    }

    /// True once `max_blocks` hashes exist: further bytes are only counted.
    pub fn is_full(&self) -> bool {
        self.hashes.len() >= self.max_blocks
    }

    /// Counts `bytes` more prompt bytes without hashing or reading them:
    /// once the hasher is full, the request parser skips the rest of a
    /// prompt unread and only counts its length (see `request`).
    pub fn count_unhashed(&mut self, bytes: usize) {
        debug_assert!(self.is_full(), "only bytes past the cap go unhashed");
        self.total = self.total.saturating_add(bytes);
    }

    /// Bytes written so far (all of them, including any beyond the cap).
    pub fn bytes_written(&self) -> usize {
        self.total
    }

    /// The sealed hashes: `lead` leading blocks (see the module doc), then
    /// the chained hashes of all full blocks written (trailing partial block
    /// dropped), at most `max_blocks` in all.
    pub fn finish(self, seed: u64, lead: usize) -> Vec<u64> {
        let lead = lead.min(self.max_blocks);
        let content = self.max_blocks - lead;
        (0..lead)
            .map(lead_value)
            .chain(self.hashes.into_iter().take(content))
            .map(|v| seal(v, seed))
            .collect()
    }
}

/// Lets `serde_json::to_writer` (and `write!`) stream canonical text
/// straight into the hasher. Never fails.
impl io::Write for BlockHasher {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        BlockHasher::write(self, buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// Reference: the formula, written naively.
    fn naive(seed: u64, prompt: &[u8], bb: usize, max: usize) -> Vec<u64> {
        let mut out = Vec::new();
        let mut prev = 0;
        if bb == 0 {
            return out;
        }
        for chunk in prompt.chunks_exact(bb).take(max) {
            prev = xxh3_64_with_seed(chunk, prev);
            out.push(xxh3_64_with_seed(&prev.to_le_bytes(), seed));
        }
        out
    }

    fn text(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn block_counts_at_exact_boundaries_and_cap() {
        // (prompt bytes, block bytes, max blocks, expected blocks)
        let cases = [
            (0, 4, 100, 0),
            (3, 4, 100, 0),
            (4, 4, 100, 1),
            (7, 4, 100, 1),
            (8, 4, 100, 2),
            (255, 256, 100, 0),
            (256, 256, 100, 1),
            (257, 256, 100, 1),
            (256 * 10, 256, 100, 10),
            (256 * 10, 256, 10, 10),
            (256 * 10, 256, 9, 9),
            (256 * 10 + 255, 256, 3, 3),
            (100, 0, 100, 0),
            (100, 1, 0, 0),
            (100, 1, 1000, 100),
        ];
        for (n, bb, max, want) in cases {
            let p = text(n);
            let got = block_hashes(7, &p, bb, max);
            assert_eq!(got.len(), want, "n={n} bb={bb} max={max}");
            assert_eq!(got, naive(7, &p, bb, max), "n={n} bb={bb} max={max}");
        }
    }

    #[test]
    fn streaming_equals_one_shot_for_any_split() {
        let p = text(1000);
        let want = block_hashes(42, &p, 64, 100);
        for piece in [1, 3, 63, 64, 65, 128, 500, 1000] {
            let mut h = BlockHasher::new(64, 100);
            for chunk in p.chunks(piece) {
                h.write(chunk);
            }
            assert_eq!(h.bytes_written(), 1000);
            assert_eq!(h.finish(42, 0), want, "piece {piece}");
        }
        // Capped streaming still counts every byte.
        let mut h = BlockHasher::new(64, 2);
        for chunk in p.chunks(10) {
            h.write(chunk);
        }
        assert_eq!(h.bytes_written(), 1000);
        assert_eq!(h.finish(42, 0), want[..2].to_vec());
    }

    #[test]
    fn chain_means_prefix() {
        let a = text(64 * 8);
        let mut b = a.clone();
        b[64 * 5 + 3] ^= 1; // differs inside block 5
        let ha = block_hashes(1, &a, 64, 100);
        let hb = block_hashes(1, &b, 64, 100);
        assert_eq!(ha[..5], hb[..5]);
        for i in 5..8 {
            assert_ne!(ha[i], hb[i], "block {i} must differ after a change");
        }
        // Same block content at another position hashes differently.
        let same = vec![b'x'; 128];
        let h = block_hashes(1, &same, 64, 10);
        assert_ne!(h[0], h[1]);
    }

    #[test]
    fn seeds_separate_models_and_salts() {
        let cases: [(&str, Option<&str>); 7] = [
            ("m", None),
            ("m2", None),
            ("m", Some("s")),
            ("m", Some("t")),
            ("ab", Some("c")),
            ("a", Some("bc")),
            ("", Some("mc")),
        ];
        for (i, a) in cases.iter().enumerate() {
            for b in &cases[..i] {
                assert_ne!(seed(a.0, a.1), seed(b.0, b.1), "{a:?} vs {b:?}");
            }
        }
        assert_eq!(seed("m", None), seed("m", Some("")), "documented choice");
        assert_eq!(seed("m", Some("s")), seed("m", Some("s")));
        let p = text(256);
        assert_ne!(
            block_hashes(seed("m", None), &p, 64, 4),
            block_hashes(seed("n", None), &p, 64, 4)
        );
    }

    #[test]
    fn io_write_feeds_the_hasher() {
        use std::io::Write;
        let mut h = BlockHasher::new(4, 10);
        write!(h, "abcdefgh{}", 12).unwrap();
        assert_eq!(h.bytes_written(), 10);
        assert_eq!(h.finish(3, 0), block_hashes(3, b"abcdefgh12", 4, 10));
    }

    #[test]
    fn leading_blocks_depend_on_the_seed_and_position_only() {
        let p = text(64 * 6);
        let hash = |seed, lead, max| {
            let mut h = BlockHasher::new(64, max);
            h.write(&p);
            h.finish(seed, lead)
        };
        let plain = hash(1, 0, 100);
        let led = hash(1, 2, 100);
        assert_eq!(led.len(), 8);
        assert_eq!(led[2..], plain[..], "content follows the leading blocks");
        assert_ne!(led[0], led[1]);
        assert!(!plain.contains(&led[0]) && !plain.contains(&led[1]));
        // Shared by every request with the same seed, whatever its content.
        let mut other = BlockHasher::new(64, 100);
        other.write(&text(64));
        assert_eq!(other.finish(1, 2)[..2], led[..2]);
        assert_ne!(hash(2, 2, 100)[..2], led[..2]);
        // The cap counts leading blocks; content is cut first.
        assert_eq!(hash(1, 2, 5), led[..5].to_vec());
        assert_eq!(hash(1, 7, 5), hash(1, 5, 5));
        assert_eq!(hash(1, 5, 5)[..2], led[..2]);
    }
}
