//! The prefix KV-cache of one pod, modelled on vLLM's automatic prefix caching.
//!
//! The routing layer exists to exploit this structure, so the simulator reproduces its
//! semantics rather than a statistic: the KV-cache is `capacity` blocks of `block_size`
//! tokens; a full block of a sequence is identified by a chained hash (hash of the parent
//! block's hash and the block's token ids), so a block can only be reused after the same
//! whole prefix. Blocks held by running requests are pinned by a reference count;
//! unreferenced blocks stay cached and are evicted least-recently-used first when space is
//! needed. A request's hit is the longest run of leading blocks that are present.
//!
//! Blocks that are not full (the tail of a prompt, the generated tokens) are held as
//! anonymous blocks while the request runs; when it finishes its full blocks (prompt and
//! generated) are kept as cached, unpinned blocks, tail blocks evicted first.
//! Nothing here reads a clock: recency is an access counter.

use std::collections::BTreeMap;

use fnv::FnvHashMap;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::tokenizer::TokenId;

/// The identity of one full block: a hash chained over all blocks before it.
pub type BlockHash = u64;

/// Seed of the chained block hash (the hash of "no parent").
const ROOT_HASH: BlockHash = 0x6b76_726f_7574_6521;

/// The chained hashes of the full blocks of `tokens` (a trailing partial block has none).
pub fn block_hashes(tokens: &[TokenId], block_size: usize) -> Vec<BlockHash> {
    let block_size = block_size.max(1);
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = ROOT_HASH;
    let mut buf: Vec<u8> = Vec::with_capacity(block_size * 4);
    for block in tokens.chunks_exact(block_size) {
        buf.clear();
        for t in block {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        parent = xxh3_64_with_seed(&buf, parent);
        out.push(parent);
    }
    out
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    refs: u32,
    /// Position in the LRU list while `refs == 0`.
    stamp: u64,
    /// Whether the block's KV has been computed (only computed blocks can be hits).
    computed: bool,
}

/// The blocks one running request holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allocation {
    /// Hashed (full prompt) blocks, pinned, in sequence order.
    pub hashed: Vec<BlockHash>,
    /// Anonymous blocks (partial prompt tail and room for generated tokens).
    pub anonymous: usize,
}

impl Allocation {
    /// Total blocks held.
    pub fn blocks(&self) -> usize {
        self.hashed.len() + self.anonymous
    }
}

/// Why an allocation could not be made right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoSpace {
    /// New blocks that were needed.
    pub needed: usize,
    /// Blocks that were free or evictable.
    pub available: usize,
}

/// A prefix KV-cache of fixed capacity with LRU eviction of unpinned blocks.
#[derive(Debug)]
pub struct KvCache {
    block_size: usize,
    capacity: usize,
    entries: FnvHashMap<BlockHash, Entry>,
    /// Unpinned cached blocks by stamp; the smallest stamp is evicted first.
    lru: BTreeMap<u64, BlockHash>,
    next_stamp: u64,
    anonymous: usize,
    pinned: usize,
    evictions: u64,
}

impl KvCache {
    /// An empty cache of `capacity` blocks of `block_size` tokens.
    pub fn new(capacity: usize, block_size: usize) -> Self {
        Self {
            block_size: block_size.max(1),
            capacity,
            entries: FnvHashMap::default(),
            lru: BTreeMap::new(),
            next_stamp: 0,
            anonymous: 0,
            pinned: 0,
            evictions: 0,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks held by running requests (pinned hashed blocks + anonymous blocks).
    /// This is what vLLM reports as KV-cache usage: cached but unreferenced blocks count
    /// as free there, since they can be evicted at any time.
    pub fn used_blocks(&self) -> usize {
        self.pinned + self.anonymous
    }

    /// Hashed blocks resident in the cache, pinned or not.
    pub fn cached_blocks(&self) -> usize {
        self.entries.len()
    }

    /// Blocks neither cached nor held.
    pub fn free_blocks(&self) -> usize {
        self.capacity
            .saturating_sub(self.entries.len() + self.anonymous)
    }

    /// Unpinned cached blocks that can be evicted.
    pub fn evictable_blocks(&self) -> usize {
        self.lru.len()
    }

    /// Blocks evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// `used_blocks / capacity`, in 0..=1.
    pub fn usage(&self) -> f64 {
        if self.capacity == 0 {
            0.0
        } else {
            self.used_blocks() as f64 / self.capacity as f64
        }
    }

    /// Whether a block is resident.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.entries.contains_key(&hash)
    }

    /// The number of leading blocks of `hashes` present, looking at most at `max_blocks`.
    pub fn leading_hits(&self, hashes: &[BlockHash], max_blocks: usize) -> usize {
        hashes
            .iter()
            .take(max_blocks)
            .take_while(|h| self.entries.get(*h).is_some_and(|e| e.computed))
            .count()
    }

    /// Marks blocks whose KV has now been computed, so later requests can hit them.
    pub fn mark_computed(&mut self, hashes: &[BlockHash]) {
        for h in hashes {
            if let Some(e) = self.entries.get_mut(h) {
                e.computed = true;
            }
        }
    }

    /// Pins the blocks of a request that needs `total_blocks` blocks in all, of which
    /// `hashed` are its full prompt blocks. Present hashed blocks are reused (pinned),
    /// missing ones are inserted as not yet computed (see [`KvCache::mark_computed`]),
    /// the rest are anonymous. Evicts LRU unpinned blocks when
    /// needed. Fails without changing anything when the blocks do not fit.
    pub fn allocate(
        &mut self,
        hashed: &[BlockHash],
        total_blocks: usize,
    ) -> Result<Allocation, NoSpace> {
        let total_blocks = total_blocks.max(hashed.len());
        let mut present = 0usize;
        let mut present_unpinned = 0usize;
        for h in hashed {
            if let Some(e) = self.entries.get(h) {
                present += 1;
                if e.refs == 0 {
                    present_unpinned += 1;
                }
            }
        }
        let needed = total_blocks - present;
        let available = self.free_blocks() + self.lru.len() - present_unpinned;
        if needed > available {
            return Err(NoSpace { needed, available });
        }
        // Pin what is present first, so eviction cannot take it.
        for h in hashed {
            if let Some(e) = self.entries.get_mut(h) {
                if e.refs == 0 {
                    self.lru.remove(&e.stamp);
                    self.pinned += 1;
                }
                e.refs += 1;
            }
        }
        while self.free_blocks() < needed {
            if !self.evict_one() {
                break;
            }
        }
        for h in hashed {
            if !self.entries.contains_key(h) {
                self.entries.insert(
                    *h,
                    Entry {
                        refs: 1,
                        stamp: 0,
                        computed: false,
                    },
                );
                self.pinned += 1;
            }
        }
        let anonymous = total_blocks - hashed.len();
        self.anonymous += anonymous;
        Ok(Allocation {
            hashed: hashed.to_vec(),
            anonymous,
        })
    }

    fn evict_one(&mut self) -> bool {
        match self.lru.pop_first() {
            Some((_, hash)) => {
                self.entries.remove(&hash);
                self.evictions += 1;
                true
            }
            None => false,
        }
    }

    /// Releases a finished request's blocks. `generated` are the hashes of the full
    /// blocks that came after its prompt blocks (from generated tokens); up to
    /// `alloc.anonymous` of them are kept as cached blocks. All the request's blocks end
    /// unpinned, the last block the first to be evicted; blocks never computed are freed.
    pub fn release(&mut self, alloc: Allocation, generated: &[BlockHash]) {
        let Allocation { hashed, anonymous } = alloc;
        let keep = generated.len().min(anonymous);
        self.anonymous -= anonymous.min(self.anonymous);
        // Stamp in reverse order: the tail gets the oldest stamp.
        for h in generated[..keep].iter().rev() {
            if self.entries.contains_key(h) {
                continue;
            }
            if self.free_blocks() == 0 {
                break;
            }
            let stamp = self.bump();
            self.entries.insert(
                *h,
                Entry {
                    refs: 0,
                    stamp,
                    computed: true,
                },
            );
            self.lru.insert(stamp, *h);
        }
        for h in hashed.iter().rev() {
            self.unpin(*h);
        }
    }

    fn bump(&mut self) -> u64 {
        self.next_stamp += 1;
        self.next_stamp
    }

    fn unpin(&mut self, hash: BlockHash) {
        let stamp = self.next_stamp + 1;
        let Some(e) = self.entries.get_mut(&hash) else {
            return;
        };
        if e.refs == 0 {
            return;
        }
        e.refs -= 1;
        if e.refs == 0 && !e.computed {
            // Never computed (aborted mid-prefill): nothing worth keeping.
            self.entries.remove(&hash);
            self.pinned -= 1;
        } else if e.refs == 0 {
            e.stamp = stamp;
            self.next_stamp = stamp;
            self.pinned -= 1;
            self.lru.insert(stamp, hash);
        }
    }

    /// Drops every unpinned cached block (vLLM's `/reset_prefix_cache`).
    pub fn reset_unpinned(&mut self) {
        while self.evict_one() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: usize, salt: u32) -> Vec<TokenId> {
        (0..n as u32)
            .map(|i| i.wrapping_mul(2654435761) ^ salt)
            .collect()
    }

    #[test]
    fn chained_hashes_depend_on_the_whole_prefix() {
        let a = toks(48, 1);
        let mut b = a.clone();
        b[0] ^= 0xffff; // change the first block only
        let ha = block_hashes(&a, 16);
        let hb = block_hashes(&b, 16);
        assert_eq!(ha.len(), 3);
        // Same tokens in blocks 1 and 2, but different parents: all hashes differ.
        assert!(ha.iter().zip(&hb).all(|(x, y)| x != y));
        // A partial trailing block has no hash.
        assert_eq!(block_hashes(&a[..47], 16).len(), 2);
        assert_eq!(block_hashes(&a[..32], 16), ha[..2]);
    }

    #[test]
    fn hit_then_lru_eviction() {
        let mut c = KvCache::new(4, 16);
        let a = block_hashes(&toks(32, 1), 16);
        let b = block_hashes(&toks(32, 2), 16);
        let x = c.allocate(&a, 2).unwrap();
        c.mark_computed(&a);
        assert_eq!(c.used_blocks(), 2);
        c.release(x, &[]);
        assert_eq!(c.used_blocks(), 0);
        assert_eq!(c.cached_blocks(), 2);
        assert_eq!(c.leading_hits(&a, 2), 2);
        let y = c.allocate(&b, 2).unwrap();
        c.mark_computed(&b);
        c.release(y, &[]);
        assert_eq!(c.cached_blocks(), 4);
        // A third prefix needs 2 blocks: a (least recently used) is evicted, tail first.
        let z = c.allocate(&block_hashes(&toks(16, 3), 16), 2).unwrap();
        assert_eq!(c.evictions(), 2);
        assert_eq!(c.leading_hits(&a, 2), 0);
        assert_eq!(c.leading_hits(&b, 2), 2);
        c.release(z, &[]);
    }

    #[test]
    fn tail_block_evicted_first() {
        let mut c = KvCache::new(3, 16);
        let a = block_hashes(&toks(48, 1), 16);
        let x = c.allocate(&a, 3).unwrap();
        c.mark_computed(&a);
        c.release(x, &[]);
        let other = block_hashes(&toks(16, 9), 16);
        let y = c.allocate(&other, 1).unwrap();
        // The last block of `a` went; its first two blocks still hit.
        assert_eq!(c.leading_hits(&a, 3), 2);
        c.release(y, &[]);
    }

    #[test]
    fn pinned_blocks_are_never_evicted() {
        let mut c = KvCache::new(2, 16);
        let a = block_hashes(&toks(32, 1), 16);
        let held = c.allocate(&a, 2).unwrap();
        c.mark_computed(&a);
        let b = block_hashes(&toks(16, 2), 16);
        let err = c.allocate(&b, 1).unwrap_err();
        assert_eq!(
            err,
            NoSpace {
                needed: 1,
                available: 0
            }
        );
        assert_eq!(c.leading_hits(&a, 2), 2);
        // A second request sharing the prefix pins the same blocks without new space.
        let shared = c.allocate(&a, 2).unwrap();
        assert_eq!(c.used_blocks(), 2);
        c.release(held, &[]);
        assert_eq!(
            c.evictable_blocks(),
            0,
            "still pinned by the second request"
        );
        c.release(shared, &[]);
        assert_eq!(c.evictable_blocks(), 2);
        assert!(c.allocate(&b, 1).is_ok());
    }

    #[test]
    fn generated_blocks_are_cached_on_release() {
        let mut c = KvCache::new(8, 4);
        let all = block_hashes(&toks(16, 5), 4);
        // Prompt = 2 full blocks, plus 2 blocks of generated tokens.
        let x = c.allocate(&all[..2], 4).unwrap();
        c.mark_computed(&all[..2]);
        assert_eq!(x.anonymous, 2);
        c.release(x, &all[2..]);
        assert_eq!(c.leading_hits(&all, 4), 4);
        assert_eq!(c.used_blocks(), 0);
    }

    #[test]
    fn uncomputed_blocks_never_hit_and_are_freed_on_abort() {
        let mut c = KvCache::new(4, 16);
        let a = block_hashes(&toks(32, 1), 16);
        let x = c.allocate(&a, 2).unwrap();
        assert_eq!(c.leading_hits(&a, 2), 0, "prefill still running");
        c.mark_computed(&a[..1]);
        assert_eq!(c.leading_hits(&a, 2), 1);
        c.release(x, &[]);
        assert_eq!(c.cached_blocks(), 1);
        assert_eq!(c.free_blocks(), 3);
    }

    #[test]
    fn failed_allocation_changes_nothing() {
        let mut c = KvCache::new(3, 16);
        let a = block_hashes(&toks(32, 1), 16);
        let x = c.allocate(&a, 2).unwrap();
        c.mark_computed(&a);
        c.release(x, &[]);
        assert!(c.allocate(&a, 10).is_err());
        assert_eq!(c.used_blocks(), 0);
        assert_eq!(c.evictable_blocks(), 2);
        assert_eq!(c.cached_blocks(), 2);
    }
}
