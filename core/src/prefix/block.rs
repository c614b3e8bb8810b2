//! Chained block hashing: the canonical prompt bytes are cut into fixed-size
//! blocks (`block_tokens * bytes_per_token` bytes, the filter does not
//! tokenize) and every *full* block gets a 64-bit hash that depends on the
//! whole prefix before it, like an engine's prefix-cache block keys:
//!
//! ```text
//! p_0     = 0
//! p_{k+1} = xxh3_64_with_seed(piece_k, p_k)      piece_k = bytes [k q, (k+1) q), q = block_bytes / 4
//! c_i     = p_{4(i+1)}                           (the chain value at the end of block i)
//! h_i     = xxh3_64_with_seed(c_i as 8 little-endian bytes, seed)  (sealed)
//! ```
//!
//! The chain runs over quarter blocks so that the three values inside each
//! block are sub-block checkpoints for free ([`Leaves`]: what lets a prompt
//! that ends mid-block, however short, teach affinity). When `block_bytes`
//! is not a multiple of 4 a block is one piece (`c_i = xxh3(block_i,
//! c_{i-1})`) and there are no checkpoints.
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
//! A trailing partial block has no block hash, but its checkpoints (and the
//! request's leaf, the last of them) are kept: see [`Leaves`].
//!
//! [`BlockHasher`] is the streaming form that the request parser feeds
//! piece by piece, so a multi-MiB prompt is never concatenated into a second
//! buffer; [`block_hashes`] is the one-shot form.

use std::io;
use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

/// Pieces a block's chain runs over: a block hash is every fourth chain
/// value, the three in between are its checkpoints (see [`Leaves`]).
pub const QUARTERS: usize = 4;

/// Finer pieces for the checkpoints of the first content block only (a
/// short opening turn ends there): 1/16 block (4 tokens at the defaults).
pub const SIXTEENTHS: usize = 16;

/// Domain tag of the seed derivation; bump it when the canonical prompt
/// format changes so that old and new hashes never mix (in the shared
/// decision log during a rolling upgrade, for instance).
const SEED_DOMAIN: &[u8] = b"kvroute/prefix/v3\0";

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
    /// Raw checkpoint values of the first content block (see [`Leaves`]).
    first_row: FirstRow,
    /// Raw checkpoint values of the later hashed blocks; empty when
    /// `block_bytes` is not a multiple of 4.
    rows: Vec<[u64; 3]>,
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
            first_row: FirstRow::default(),
            rows: Vec::new(),
            total: 0,
        }
    }

    /// Reserves room for about `bytes` more prompt bytes worth of hashes
    /// (never more than the cap), to avoid regrowing the hash vector.
    pub fn reserve_for(&mut self, bytes: usize) {
        if let Some(blocks) = bytes.checked_div(self.block_bytes) {
            let room = self.max_blocks.saturating_sub(self.hashes.len());
            self.hashes.reserve(blocks.min(room));
            if self.quarter() > 0 {
                self.rows.reserve(blocks.min(room));
            }
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
            let mut buf = std::mem::take(&mut self.buf);
            self.hash_block(&buf);
            if !self.is_full() {
                buf.clear();
                self.buf = buf; // reuse the allocation
            }
        }
        while !self.is_full() && bytes.len() >= self.block_bytes {
            let (block, rest) = bytes.split_at(self.block_bytes);
            self.hash_block(block);
            bytes = rest;
        }
        if !self.is_full() {
            self.buf.extend_from_slice(bytes);
        }
    }

    /// Bytes per checkpoint (a quarter block), 0 when blocks do not split
    /// into quarters.
    fn quarter(&self) -> usize {
        if self.block_bytes % QUARTERS == 0 {
            self.block_bytes / QUARTERS
        } else {
            0
        }
    }

    /// Bytes per checkpoint in the first content block.
    fn sixteenth(&self) -> usize {
        if self.block_bytes % SIXTEENTHS == 0 {
            self.block_bytes / SIXTEENTHS
        } else {
            self.quarter()
        }
    }

    /// Hashes one full block: the chain over its quarters (the last value
    /// is the block's hash, the others its checkpoints).
    fn hash_block(&mut self, block: &[u8]) {
        let q = self.quarter();
        if q == 0 {
            let h = xxh3_64_with_seed(block, self.prev);
            return self.push(h);
        }
        let mut p = self.prev;
        let mut row = [0; 3];
        for (j, piece) in block.chunks_exact(q).enumerate() {
            p = xxh3_64_with_seed(piece, p);
            if let Some(slot) = row.get_mut(j) {
                *slot = p;
            }
        }
        if self.hashes.is_empty() {
            let fine = self.sixteenth();
            let row = &mut self.first_row;
            row.len = chain_pieces(&block[..block.len() - 1], fine, 0, &mut row.values) as u8;
        } else {
            self.rows.push(row);
        }
        self.push(p);
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
        self.finish_prompt(seed, lead).blocks
    }

    /// [`BlockHasher::finish`] plus the prompt's [`Leaves`]: the
    /// checkpoints inside each hashed content block and inside the trailing
    /// partial block (when it lies within the cap).
    pub fn finish_prompt(self, seed: u64, lead: usize) -> PromptHashes {
        let lead = lead.min(self.max_blocks);
        let content = self.max_blocks - lead;
        let (q, fine_piece) = (self.quarter(), self.sixteenth());
        let mut first_row = self.first_row;
        let mut rows = self.rows;
        if content == 0 {
            first_row = FirstRow::default();
        }
        rows.truncate(content.saturating_sub(1));
        // The trailing partial block has checkpoints only if it lies within
        // the cap (so a learned leaf never makes a request longer than
        // `max_blocks` hashes) and holds at least one piece.
        let mut tail = 0;
        if q > 0 && self.hashes.len() < content {
            if self.hashes.is_empty() {
                tail = chain_pieces(&self.buf, fine_piece, 0, &mut first_row.values);
                first_row.len = tail as u8;
            } else if self.buf.len() >= q {
                let mut row = [0; 3];
                tail = chain_pieces(&self.buf, q, self.prev, &mut row);
                rows.push(row);
            }
        }
        let fine = if self.block_bytes % SIXTEENTHS == 0 {
            SIXTEENTHS
        } else {
            QUARTERS
        };
        let blocks = (0..lead)
            .map(lead_value)
            .chain(self.hashes.into_iter().take(content))
            .map(|v| seal(v, seed))
            .collect();
        PromptHashes {
            blocks,
            leaves: Leaves {
                seed,
                first: lead,
                fine: fine as u8,
                first_row,
                rows,
                tail: tail as u8,
            },
        }
    }
}

/// Chain values over the whole `piece`-byte pieces of `bytes` (as many as
/// `out` holds), from `prev`: `p_1 = xxh3(piece_1, prev)`, `p_j =
/// xxh3(piece_j, p_{j-1})`. Returns how many were written.
fn chain_pieces(bytes: &[u8], piece: usize, prev: u64, out: &mut [u64]) -> usize {
    if piece == 0 {
        return 0;
    }
    let mut p = prev;
    let mut n = 0;
    for (slot, chunk) in out.iter_mut().zip(bytes.chunks_exact(piece)) {
        p = xxh3_64_with_seed(chunk, p);
        *slot = p;
        n += 1;
    }
    n
}

/// Checkpoints of the first content block, inline (no allocation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct FirstRow {
    values: [u64; SIXTEENTHS - 1],
    len: u8,
}

/// Seals a checkpoint value; the tag keeps leaves apart from block hashes.
fn seal_leaf(value: u64, seed: u64) -> u64 {
    xxh3_64_with_seed(&value.to_le_bytes(), seed ^ LEAF_TAG)
}

const LEAF_TAG: u64 = 0x6c65_6166_2f76_3100; // "leaf/v1\0"

/// The hashed prompt: its full blocks and its [`Leaves`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PromptHashes {
    /// Sealed chained hashes of the full blocks (see the module doc).
    pub blocks: Vec<u64>,
    /// Sub-block checkpoints: what lets a short prompt, or the mid-block
    /// end of any prompt, teach affinity.
    pub leaves: Leaves,
}

/// Sub-block checkpoints of a prompt: every quarter block (16 tokens at
/// the default 64-token blocks: vLLM's default KV block), and every 1/16
/// block in the first content block (where a short opening turn ends).
///
/// A block's chain runs over its four quarters, `p_j = xxh3(quarter_j,
/// p_{j-1})` from the previous block's hash `p_0`, and `p_4` is the block's
/// hash: its checkpoints `p_1..p_3` cost no extra hashing. The first content
/// block also gets a finer chain over its sixteenths from 0 (one extra pass
/// over at most one block per request). Equal sealed checkpoints mean (up to
/// collisions) an equal prompt prefix up to that point. A request's
/// **leaf** is the last checkpoint of its trailing partial block: where it
/// ended, mid-block. Recorded like a block (see [`crate::prefix::index`]),
/// it lets the next turn of the conversation, which extends this prompt,
/// find the endpoint even when the prompt was shorter than one block, by
/// looking up its own checkpoints in the block after its matched full
/// blocks.
///
/// Values are kept raw and sealed on lookup, so a request pays the sealing
/// only for the rows it looks at. Memory: 24 bytes per hashed block (plus
/// 120 for the first).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leaves {
    seed: u64,
    /// Block index of the first content block (after the tools' leading
    /// blocks, which have none).
    first: usize,
    /// Pieces per block in the first content block (16, or 4 when the
    /// block does not split into sixteenths).
    fine: u8,
    /// Raw checkpoints of the first content block (all of them if it is
    /// full, else the trailing partial block's).
    first_row: FirstRow,
    /// Raw checkpoints of the later content blocks, then the trailing
    /// partial block's (its first `tail` values) if it is one of them.
    rows: Vec<[u64; 3]>,
    /// Checkpoints of the trailing partial block (0 when there is none).
    tail: u8,
}

impl Leaves {
    /// The sealed checkpoints inside block `block` (0-based, as in the
    /// request's block list; `block == blocks.len()` is the trailing
    /// partial block) as `(sixteenths of the block, hash)`, longest first.
    /// Empty when the block has none.
    pub fn at(&self, block: usize) -> impl Iterator<Item = (u8, u64)> + '_ {
        let (values, unit): (&[u64], u8) = match block.checked_sub(self.first) {
            None => (&[], 0),
            Some(0) => (
                &self.first_row.values[..self.first_row.len as usize],
                (SIXTEENTHS / self.fine.max(1) as usize) as u8,
            ),
            Some(r) => match self.rows.get(r - 1) {
                None => (&[], 0),
                Some(row) if r == self.rows.len() && self.tail > 0 => {
                    (&row[..self.tail as usize], 4)
                }
                Some(row) => (&row[..], 4),
            },
        };
        let seed = self.seed;
        values
            .iter()
            .enumerate()
            .rev()
            .map(move |(j, &v)| ((j as u8 + 1) * unit, seal_leaf(v, seed)))
    }

    /// The request's leaf: the sealed last checkpoint of its trailing
    /// partial block, if the prompt ends at least one checkpoint past its
    /// last full block (and within the hashing cap).
    pub fn leaf(&self) -> Option<u64> {
        if self.tail == 0 {
            return None;
        }
        self.at(self.tail_block()).next().map(|(_, h)| h)
    }

    /// How far the leaf reaches into its block, in sixteenths (0 without one).
    pub fn leaf_sixteenths(&self) -> u8 {
        if self.tail == 0 {
            return 0;
        }
        self.at(self.tail_block()).next().map_or(0, |(n, _)| n)
    }

    /// Block index of the trailing partial block (meaningful when `tail > 0`).
    fn tail_block(&self) -> usize {
        self.first + self.rows.len()
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
            if bb % 4 == 0 {
                for quarter in chunk.chunks_exact(bb / 4) {
                    prev = xxh3_64_with_seed(quarter, prev);
                }
            } else {
                prev = xxh3_64_with_seed(chunk, prev);
            }
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

    /// Reference checkpoints: the sealed hash of block `i`'s first `j`
    /// quarters, chained the naive way.
    /// `s` sixteenths into block `i` (a multiple of 4 unless `i == 0`).
    fn naive_leaf(seed: u64, prompt: &[u8], bb: usize, i: usize, s: usize) -> u64 {
        let mut prev = 0;
        for quarter in prompt.chunks_exact(bb / 4).take(4 * i) {
            prev = xxh3_64_with_seed(quarter, prev);
        }
        let piece = if i == 0 { bb / 16 } else { bb / 4 };
        let n = if i == 0 { s } else { s / 4 };
        for chunk in prompt[i * bb..].chunks_exact(piece).take(n) {
            prev = xxh3_64_with_seed(chunk, prev);
        }
        xxh3_64_with_seed(&prev.to_le_bytes(), seed ^ LEAF_TAG)
    }

    fn prompt_hashes(p: &[u8], bb: usize, max: usize, lead: usize, piece: usize) -> PromptHashes {
        let mut h = BlockHasher::new(bb, max);
        for chunk in p.chunks(piece.max(1)) {
            h.write(chunk);
        }
        h.finish_prompt(9, lead)
    }

    #[test]
    fn leaf_is_the_last_quarter_of_the_trailing_partial_block() {
        // (prompt bytes, expected leaf in sixteenths) at 64-byte blocks:
        // 4-byte sixteenths in block 0, 16-byte quarters after it.
        let cases = [
            (0, 0),
            (3, 0),
            (4, 1),
            (15, 3),
            (16, 4),
            (47, 11),
            (63, 15),
            (64, 0), // ends on a block boundary: the full block covers it
            (64 + 15, 0),
            (64 + 16, 4),
            (64 * 3 + 32, 8),
            (64 * 3 + 63, 12),
        ];
        for (n, want) in cases {
            let p = text(n);
            let ph = prompt_hashes(&p, 64, 100, 0, 7);
            assert_eq!(ph.blocks, block_hashes(9, &p, 64, 100), "n={n}");
            assert_eq!(ph.leaves.leaf_sixteenths(), want, "n={n}");
            let k = n / 64;
            let leaf = ph.leaves.leaf();
            assert_eq!(leaf.is_some(), want > 0, "n={n}");
            if let Some(leaf) = leaf {
                assert_eq!(leaf, naive_leaf(9, &p, 64, k, want as usize), "n={n}");
                // Its own checkpoints of the trailing block end with it.
                assert_eq!(ph.leaves.at(k).next(), Some((want, leaf)), "n={n}");
                assert!(!ph.blocks.contains(&leaf), "a leaf is never a block");
            }
        }
    }

    #[test]
    fn an_extension_finds_the_leaf_among_its_checkpoints() {
        // Turn N ends mid-block; turn N+1 extends it: its checkpoints in
        // that block contain turn N's leaf, whatever the split.
        for n in [16, 40, 100, 64 * 5 + 20, 64 * 5 + 50] {
            let turn = text(n);
            let leaf = prompt_hashes(&turn, 64, 100, 0, 13).leaves.leaf().unwrap();
            let mut next = turn.clone();
            next.extend(b"assistant answer and the next user message, long enough".repeat(5));
            for piece in [1, 16, 64, 1000] {
                let ph = prompt_hashes(&next, 64, 100, 0, piece);
                let k = n / 64;
                let unit = if k == 0 { 4 } else { 16 };
                let s = ((n % 64) / unit * (unit / 4)) as u8;
                assert_eq!(ph.blocks[..k], block_hashes(9, &turn, 64, 100)[..]);
                let got: Vec<(u8, u64)> = ph.leaves.at(k).collect();
                assert_eq!(got.len(), if k == 0 { 15 } else { 3 }, "block {k} is full");
                assert!(got.contains(&(s, leaf)), "n={n} piece={piece} s={s}");
                for (ss, h) in got {
                    assert_eq!(h, naive_leaf(9, &next, 64, k, ss as usize));
                }
            }
        }
        // A different continuation inside the leaf's quarter does not match.
        let turn = text(40);
        let leaf = prompt_hashes(&turn, 64, 100, 0, 64).leaves.leaf().unwrap();
        let mut other = turn.clone();
        other[20] ^= 1;
        other.extend(text(100));
        let ph = prompt_hashes(&other, 64, 100, 0, 64);
        assert!(ph.leaves.at(0).all(|(_, h)| h != leaf));
        // Another seed (model, salt, tools) shares no leaf.
        let mut h = BlockHasher::new(64, 100);
        h.write(&turn);
        assert_ne!(h.finish_prompt(10, 0).leaves.leaf(), Some(leaf));
    }

    #[test]
    fn leaves_respect_the_cap_and_the_leading_blocks() {
        let p = text(64 * 4 + 40);
        // Cap reached: no trailing checkpoints, no leaf (the trailing block
        // is past what is hashed).
        let capped = prompt_hashes(&p, 64, 4, 0, 64);
        assert_eq!(capped.blocks.len(), 4);
        assert_eq!(capped.leaves.leaf(), None);
        assert_eq!(capped.leaves.at(4).count(), 0);
        assert_eq!(capped.leaves.at(3).count(), 3);
        // Leading blocks shift the rows: block `lead + i` is content block i.
        let plain = prompt_hashes(&p, 64, 100, 0, 64);
        let led = prompt_hashes(&p, 64, 100, 2, 64);
        assert_eq!(led.leaves.at(0).count() + led.leaves.at(1).count(), 0);
        for i in 0..5 {
            assert!(led.leaves.at(i + 2).eq(plain.leaves.at(i)), "row {i}");
        }
        assert_eq!(led.leaves.leaf(), plain.leaves.leaf());
        // Leading blocks that fill the cap with the content leave no leaf
        // (a learned list never exceeds `max_blocks` hashes).
        let full = prompt_hashes(&p, 64, 6, 2, 64);
        assert_eq!(full.blocks.len(), 6);
        assert_eq!(full.leaves.leaf(), None);
        // Blocks that do not split into quarters have no checkpoints.
        let odd = prompt_hashes(&text(100), 6, 100, 0, 64);
        assert_eq!(odd.leaves.leaf(), None);
        assert_eq!(odd.leaves.at(0).count(), 0);
    }
}
