//! Which endpoint was sent which blocks: kvroute's model of every engine's
//! prefix cache, learned from its own decisions (and replayed from other
//! workers' decision logs), bounded per endpoint with LRU.
//!
//! # Layout
//!
//! One slab of nodes, one node per (endpoint, block) held. Each node is on
//! two intrusive lists:
//!
//! - its endpoint's **LRU list** (doubly linked: touch and evict are O(1));
//! - its block's **holder chain** (singly linked from `heads[block]`): the
//!   endpoints holding that block.
//!
//! ```text
//! heads: block hash -> first node of its holder chain   (one map entry per distinct block)
//! node:  { block, endpoint slot, lru prev/next, next holder }   24 bytes
//! ```
//!
//! # Semantics and cost
//!
//! `longest_prefix(b)` gives, for every endpoint holding `b[0]`, the number
//! `k` of *consecutive leading* blocks it holds (`b[0..k]`; an engine cannot
//! reuse block `i` without blocks `0..i`). It walks the holder chains of
//! `b[0]`, `b[1]`, ... and stops at the first block that no still-matching
//! endpoint holds, so the cost is O(matched blocks x endpoints holding them),
//! never O(all endpoints x all blocks).
//!
//! `record(e, b)` touches `b` from last to first, so the head of a prompt is
//! more recent than its tail and eviction (from the LRU end) drops the
//! *tails* of old prefixes before their heads: a cache that keeps blocks
//! `0..k` still matches, one that keeps `k..n` does not. Only the first
//! `capacity` blocks of a request are recorded (the rest would evict its own
//! head). Holder checks walk a chain (O(holders) per block), which is what
//! keeps the memory at one map for all endpoints.
//!
//! # Leaves
//!
//! A request's leaf ([`crate::prefix::Leaves`]: the checkpoint where its
//! prompt ends mid-block) is a node like a block, recorded after the
//! request's blocks ([`PrefixIndex::record_with_leaf`], or the last hash of
//! a decision-log entry), so it is the request's least recent node and the
//! first to go. [`PrefixIndex::longest_prefix_with_leaves`] answers
//! `longest_prefix` unchanged, plus, for each endpoint with `k` leading
//! blocks (`k = 0` included), the longest of the request's checkpoints in
//! block `k` that it holds: a partial block, reported in sixteenths.
//! Checkpoint hashes are sealed apart from block hashes, so a leaf never
//! matches a full block.
//!
//! # Memory
//!
//! At most `capacity` nodes per endpoint (clamped to [`MAX_CAPACITY`]) and
//! at most [`MAX_ENDPOINTS`] endpoints: 24 bytes per node plus one `heads`
//! entry (16 bytes + 1 control byte, at hashbrown's 44-87% load) per
//! distinct block, so about 43-63 bytes per indexed block when blocks are
//! not shared (default 31250 blocks: ~1.3-2 MB per endpoint). The slab keeps
//! its high-water mark; freed nodes are reused.
//!
//! Keys are already xxh3 outputs, uniformly distributed, so the block map
//! uses an identity hasher (`write_u64` returns the key): hashing them again
//! would cost time and add nothing. (A client that brute-forces block hashes
//! with equal low bits could lengthen probe sequences; that costs it about
//! 2^(table bits) hashes per block and only slows lookups, and any unkeyed
//! hasher such as FNV would be exactly as exposed.)

use crate::endpoint::Endpoint;
use crate::prefix::Prompt;
use hashbrown::{HashMap, HashSet};
use std::cmp::Reverse;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};

/// Most endpoints the index tracks; `record`/`set_capacity` for a new
/// endpoint beyond it are ignored (the pool is at most 1024).
pub const MAX_ENDPOINTS: usize = 4096;

/// Largest per-endpoint capacity honoured (the config's own upper bound);
/// larger values, e.g. from an engine's reported cache size, are clamped.
pub const MAX_CAPACITY: usize = 10_000_000;

const NIL: u32 = u32::MAX;

/// Identity hasher for keys that are already good 64-bit hashes.
#[derive(Default, Clone, Copy)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Not used for u64 keys; a correct (FNV-1a) fallback for others.
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type BlockMap = HashMap<u64, u32, BuildHasherDefault<IdentityHasher>>;

#[derive(Clone, Copy)]
struct Node {
    block: u64,
    slot: u32,
    lru_prev: u32,
    /// Next node towards the LRU end; links the free list for free nodes.
    lru_next: u32,
    chain_next: u32,
}

struct Slot {
    endpoint: Endpoint,
    /// Most recently used node.
    head: u32,
    /// Least recently used node (evicted first).
    tail: u32,
    len: usize,
    capacity: usize,
    live: bool,
}

/// One endpoint's match for a request ([`PrefixIndex::longest_prefix_with_leaves`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixMatch {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// Leading full blocks of the request it holds.
    pub blocks: usize,
    /// Sixteenths (0..=15) of the next block it holds: a leaf, left there
    /// by an earlier request that ended inside that block, which this
    /// request continues (in quarters past the first block, see
    /// [`crate::prefix::Leaves`]).
    pub sixteenths: u8,
}

impl PrefixMatch {
    /// `sixteenths` as a fraction of a block (0 to 15/16): always less than
    /// one full block.
    pub fn partial(&self) -> f64 {
        f64::from(self.sixteenths) / crate::prefix::block::SIXTEENTHS as f64
    }
}

/// Per-endpoint LRU record of the block hashes each endpoint was sent.
pub struct PrefixIndex {
    default_capacity: usize,
    nodes: Vec<Node>,
    free_node: u32,
    heads: BlockMap,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    by_endpoint: HashMap<Endpoint, u32, fnv::FnvBuildHasher>,
}

impl Default for PrefixIndex {
    /// An index with the default capacity (`prefix.capacity_blocks`).
    fn default() -> Self {
        PrefixIndex::new(crate::config::PrefixConfig::default().capacity_blocks)
    }
}

impl fmt::Debug for PrefixIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefixIndex")
            .field("default_capacity", &self.default_capacity)
            .field("endpoints", &self.endpoint_count())
            .field("blocks", &self.total_len())
            .field("distinct_blocks", &self.heads.len())
            .finish()
    }
}

impl PrefixIndex {
    /// An empty index; every endpoint holds at most `default_capacity` blocks.
    pub fn new(default_capacity: usize) -> Self {
        PrefixIndex {
            default_capacity: default_capacity.min(MAX_CAPACITY),
            nodes: Vec::new(),
            free_node: NIL,
            heads: BlockMap::default(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            by_endpoint: HashMap::default(),
        }
    }

    /// Sets one endpoint's capacity in blocks (evicting LRU blocks beyond
    /// it). Clamped to [`MAX_CAPACITY`]; O(1) when nothing is evicted.
    pub fn set_capacity(&mut self, endpoint: Endpoint, blocks: usize) {
        let Some(s) = self.slot_or_insert(endpoint) else {
            return;
        };
        let cap = blocks.min(MAX_CAPACITY);
        self.slots[s as usize].capacity = cap;
        while self.slots[s as usize].len > cap {
            self.evict_lru(s);
        }
    }

    /// Forgets every block (and leaf) `endpoint` holds, keeping its
    /// capacity: its engine restarted with an empty prefix cache.
    pub fn clear(&mut self, endpoint: Endpoint) {
        let Some(s) = self.slot(endpoint) else {
            return;
        };
        while self.slots[s as usize].len > 0 {
            self.evict_lru(s);
        }
    }

    /// For each endpoint holding block 0, the number of leading blocks of
    /// `blocks` it holds. Endpoints with no match are absent. Sorted by
    /// matched blocks (most first), then endpoint.
    pub fn longest_prefix(&self, blocks: &[u64]) -> Vec<(Endpoint, usize)> {
        let Some(first) = blocks.first().and_then(|b| self.heads.get(b)) else {
            return Vec::new();
        };
        // matched[slot] = leading blocks matched so far.
        let mut matched = vec![0usize; self.slots.len()];
        let mut n = *first;
        while n != NIL {
            let node = &self.nodes[n as usize];
            matched[node.slot as usize] = 1;
            n = node.chain_next;
        }
        for (i, b) in blocks.iter().enumerate().skip(1) {
            let mut advanced = false;
            let mut n = self.heads.get(b).copied().unwrap_or(NIL);
            while n != NIL {
                let node = &self.nodes[n as usize];
                let m = &mut matched[node.slot as usize];
                if *m == i {
                    *m = i + 1;
                    advanced = true;
                }
                n = node.chain_next;
            }
            if !advanced {
                break;
            }
        }
        let mut out = Vec::new();
        let mut n = *first;
        while n != NIL {
            let node = &self.nodes[n as usize];
            out.push((
                self.slots[node.slot as usize].endpoint,
                matched[node.slot as usize],
            ));
            n = node.chain_next;
        }
        out.sort_unstable_by_key(|&(e, k)| (Reverse(k), e));
        out
    }

    /// [`PrefixIndex::longest_prefix`] plus leaves: every endpoint's full
    /// leading blocks `k` (exactly as `longest_prefix` counts them), and
    /// the sixteenths `j` of block `k` it also holds as a leaf (the longest of
    /// the request's checkpoints in block `k` it holds). An endpoint
    /// holding no leading block but a leaf in block 0 matches `(0, j)`: a
    /// conversation whose first turn was shorter than a block. Sorted by
    /// `(k, j)` (most first), then endpoint.
    ///
    /// Cost: `longest_prefix`, plus at most 3 holder-chain walks per
    /// distinct `k` among the matches (and for `k = 0`).
    pub fn longest_prefix_with_leaves(&self, prompt: Prompt<'_>) -> Vec<PrefixMatch> {
        let mut out: Vec<PrefixMatch> = self
            .longest_prefix(prompt.blocks)
            .into_iter()
            .map(|(endpoint, blocks)| PrefixMatch {
                endpoint,
                blocks,
                sixteenths: 0,
            })
            .collect();
        let Some(leaves) = prompt.leaves else {
            return out;
        };
        // at[slot] = index in `out`, if any.
        let mut at = vec![NIL; self.slots.len()];
        for (i, m) in out.iter().enumerate() {
            if let Some(s) = self.slot(m.endpoint) {
                at[s as usize] = i as u32;
            }
        }
        // `out` is sorted by blocks, most first: distinct counts, then 0.
        let mut ks: Vec<usize> = out.iter().map(|m| m.blocks).collect();
        ks.push(0);
        ks.dedup();
        for k in ks {
            for (j, leaf) in leaves.at(k) {
                let mut n = self.heads.get(&leaf).copied().unwrap_or(NIL);
                while n != NIL {
                    let node = &self.nodes[n as usize];
                    let s = node.slot as usize;
                    match at[s] {
                        NIL if k == 0 => {
                            at[s] = out.len() as u32;
                            out.push(PrefixMatch {
                                endpoint: self.slots[s].endpoint,
                                blocks: 0,
                                sixteenths: j,
                            });
                        }
                        NIL => {}
                        i => {
                            let m = &mut out[i as usize];
                            if m.blocks == k && m.sixteenths == 0 {
                                m.sixteenths = j;
                            }
                        }
                    }
                    n = node.chain_next;
                }
            }
        }
        out.sort_unstable_by_key(|m| (Reverse((m.blocks, m.sixteenths)), m.endpoint));
        out
    }

    /// Learns that `endpoint` was sent `blocks` (most recent use). Block 0
    /// ends up most recent, the last block least recent; only the first
    /// `capacity` blocks are kept. A list may end with a leaf (a
    /// decision-log entry's does): it is a node like any block.
    pub fn record(&mut self, endpoint: Endpoint, blocks: &[u64]) {
        self.record_with_leaf(endpoint, blocks, None);
    }

    /// [`PrefixIndex::record`] of `blocks` followed by `leaf`: the leaf is
    /// one more node, the least recent of the request (evicted before its
    /// blocks), and counts against the capacity like a block.
    pub fn record_with_leaf(&mut self, endpoint: Endpoint, blocks: &[u64], leaf: Option<u64>) {
        let Some(s) = self.slot_or_insert(endpoint) else {
            return;
        };
        let cap = self.slots[s as usize].capacity;
        let keep = blocks.get(..cap.min(blocks.len())).unwrap_or(&[]);
        let leaf = leaf.filter(|_| keep.len() < cap);
        for b in leaf.into_iter().chain(keep.iter().rev().copied()) {
            if let Some(n) = self.find(b, s) {
                self.lru_unlink(n);
                self.lru_push_front(n);
                continue;
            }
            while self.slots[s as usize].len >= cap {
                self.evict_lru(s);
            }
            if !self.insert(b, s) {
                return; // slab exhausted (more than 4 G nodes): learn nothing more
            }
        }
    }

    /// Unlearns that `endpoint` holds `blocks` (any order; a leaf is a
    /// block like any other): for a request the endpoint refused, so never
    /// cached. Blocks it does not hold are skipped; other endpoints'
    /// holdings of the same blocks stay. O(blocks x holders per block).
    pub fn forget(&mut self, endpoint: Endpoint, blocks: &[u64]) {
        let Some(s) = self.slot(endpoint) else {
            return;
        };
        for &b in blocks {
            if let Some(n) = self.find(b, s) {
                self.remove(n);
            }
        }
    }

    /// Forgets every endpoint not in `pool`.
    pub fn retain(&mut self, pool: &[Endpoint]) {
        let keep: HashSet<Endpoint, fnv::FnvBuildHasher> = pool.iter().copied().collect();
        let gone: Vec<(Endpoint, u32)> = self
            .by_endpoint
            .iter()
            .filter(|(e, _)| !keep.contains(*e))
            .map(|(e, s)| (*e, *s))
            .collect();
        for (e, s) in gone {
            while self.slots[s as usize].tail != NIL {
                self.evict_lru(s);
            }
            let slot = &mut self.slots[s as usize];
            slot.live = false;
            slot.head = NIL;
            slot.len = 0;
            self.by_endpoint.remove(&e);
            self.free_slots.push(s);
        }
    }

    /// Blocks currently held for `endpoint`.
    pub fn len(&self, endpoint: Endpoint) -> usize {
        self.slot(endpoint)
            .map_or(0, |s| self.slots[s as usize].len)
    }

    /// True when no endpoint holds any block.
    pub fn is_empty(&self) -> bool {
        self.heads.is_empty()
    }

    /// Blocks held over all endpoints (a block held by two counts twice).
    pub fn total_len(&self) -> usize {
        self.live_slots().map(|s| s.len).sum()
    }

    /// Distinct block hashes held by at least one endpoint.
    pub fn distinct_blocks(&self) -> usize {
        self.heads.len()
    }

    /// Endpoints the index tracks (recorded or given a capacity).
    pub fn endpoint_count(&self) -> usize {
        self.by_endpoint.len()
    }

    /// The capacity that applies to `endpoint` (the default if unknown).
    pub fn capacity(&self, endpoint: Endpoint) -> usize {
        self.slot(endpoint)
            .map_or(self.default_capacity, |s| self.slots[s as usize].capacity)
    }

    /// Whether `endpoint` holds `block`.
    pub fn contains(&self, endpoint: Endpoint, block: u64) -> bool {
        self.slot(endpoint)
            .is_some_and(|s| self.find(block, s).is_some())
    }

    // --- internals (indices below are the index's own, never client data)

    fn live_slots(&self) -> impl Iterator<Item = &Slot> {
        self.slots.iter().filter(|s| s.live)
    }

    fn slot(&self, endpoint: Endpoint) -> Option<u32> {
        self.by_endpoint.get(&endpoint).copied()
    }

    fn slot_or_insert(&mut self, endpoint: Endpoint) -> Option<u32> {
        if let Some(s) = self.slot(endpoint) {
            return Some(s);
        }
        if self.by_endpoint.len() >= MAX_ENDPOINTS {
            return None;
        }
        let fresh = Slot {
            endpoint,
            head: NIL,
            tail: NIL,
            len: 0,
            capacity: self.default_capacity,
            live: true,
        };
        let s = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = fresh;
                s
            }
            None => {
                self.slots.push(fresh);
                (self.slots.len() - 1) as u32
            }
        };
        self.by_endpoint.insert(endpoint, s);
        Some(s)
    }

    /// The node of `block` held by slot `s`, walking the holder chain.
    fn find(&self, block: u64, s: u32) -> Option<u32> {
        let mut n = self.heads.get(&block).copied().unwrap_or(NIL);
        while n != NIL {
            let node = &self.nodes[n as usize];
            if node.slot == s {
                return Some(n);
            }
            n = node.chain_next;
        }
        None
    }

    /// Adds `block` to slot `s` as most recent (caller checked absence and
    /// room). False when no node index is left.
    fn insert(&mut self, block: u64, s: u32) -> bool {
        let chain_next = self.heads.get(&block).copied().unwrap_or(NIL);
        let node = Node {
            block,
            slot: s,
            lru_prev: NIL,
            lru_next: NIL,
            chain_next,
        };
        let n = if self.free_node != NIL {
            let n = self.free_node;
            self.free_node = self.nodes[n as usize].lru_next;
            self.nodes[n as usize] = node;
            n
        } else if self.nodes.len() < NIL as usize {
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        } else {
            return false;
        };
        self.heads.insert(block, n);
        self.lru_push_front(n);
        self.slots[s as usize].len += 1;
        true
    }

    fn evict_lru(&mut self, s: u32) {
        let t = self.slots[s as usize].tail;
        if t != NIL {
            self.remove(t);
        }
    }

    /// Unlinks node `n` from both lists and frees it.
    fn remove(&mut self, n: u32) {
        self.lru_unlink(n);
        let Node {
            block,
            slot,
            chain_next,
            ..
        } = self.nodes[n as usize];
        let head = self.heads.get(&block).copied().unwrap_or(NIL);
        if head == n {
            if chain_next == NIL {
                self.heads.remove(&block);
            } else {
                self.heads.insert(block, chain_next);
            }
        } else {
            let mut p = head;
            while p != NIL {
                let next = self.nodes[p as usize].chain_next;
                if next == n {
                    self.nodes[p as usize].chain_next = chain_next;
                    break;
                }
                p = next;
            }
        }
        self.slots[slot as usize].len -= 1;
        let node = &mut self.nodes[n as usize];
        node.slot = NIL;
        node.chain_next = NIL;
        node.lru_prev = NIL;
        node.lru_next = self.free_node;
        self.free_node = n;
    }

    fn lru_unlink(&mut self, n: u32) {
        let Node {
            slot,
            lru_prev,
            lru_next,
            ..
        } = self.nodes[n as usize];
        if lru_prev != NIL {
            self.nodes[lru_prev as usize].lru_next = lru_next;
        } else {
            self.slots[slot as usize].head = lru_next;
        }
        if lru_next != NIL {
            self.nodes[lru_next as usize].lru_prev = lru_prev;
        } else {
            self.slots[slot as usize].tail = lru_prev;
        }
    }

    fn lru_push_front(&mut self, n: u32) {
        let s = self.nodes[n as usize].slot as usize;
        let old = self.slots[s].head;
        {
            let node = &mut self.nodes[n as usize];
            node.lru_prev = NIL;
            node.lru_next = old;
        }
        if old != NIL {
            self.nodes[old as usize].lru_prev = n;
        } else {
            self.slots[s].tail = n;
        }
        self.slots[s].head = n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn ep(i: u32) -> Endpoint {
        format!("10.0.{}.{}:8000", i / 256, i % 256)
            .parse()
            .unwrap()
    }

    #[test]
    fn longest_prefix_counts_consecutive_leading_blocks() {
        let mut ix = PrefixIndex::new(100);
        ix.record(ep(1), &[1, 2, 3, 4]);
        ix.record(ep(2), &[1, 2, 9]);
        ix.record(ep(3), &[5, 6]);
        ix.record(ep(4), &[1, 3]); // holds 1 and 3 but not 2
        type Case = (&'static [u64], Vec<(Endpoint, usize)>);
        let cases: [Case; 8] = [
            (&[1, 2, 3, 4, 5], vec![(ep(1), 4), (ep(2), 2), (ep(4), 1)]),
            (&[1, 2, 9], vec![(ep(2), 3), (ep(1), 2), (ep(4), 1)]),
            (&[1], vec![(ep(1), 1), (ep(2), 1), (ep(4), 1)]),
            (&[5, 6, 7], vec![(ep(3), 2)]),
            (&[2, 3], vec![(ep(1), 2), (ep(2), 1)]), // any block may start a query
            (&[9, 5], vec![(ep(2), 1)]),
            (&[], vec![]),
            (&[7, 1, 2], vec![]), // block 0 held by nobody
        ];
        for (q, want) in cases {
            assert_eq!(ix.longest_prefix(q), want, "query {q:?}");
        }
        assert_eq!(ix.len(ep(1)), 4);
        assert_eq!(ix.len(ep(9)), 0);
        assert_eq!(ix.distinct_blocks(), 7);
        assert_eq!(ix.total_len(), 11);
        assert!(ix.contains(ep(4), 3) && !ix.contains(ep(4), 2));
    }

    #[test]
    fn lru_bound_holds_per_endpoint() {
        let mut ix = PrefixIndex::new(10);
        for r in 0..200u64 {
            let e = ep((r % 3) as u32);
            let blocks: Vec<u64> = (0..(r % 7 + 1)).map(|i| r * 1000 + i).collect();
            ix.record(e, &blocks);
            for i in 0..3 {
                assert!(ix.len(ep(i)) <= 10);
            }
        }
        assert_eq!(ix.total_len(), 30);
        assert_eq!(ix.distinct_blocks(), 30);
    }

    #[test]
    fn eviction_drops_tails_before_heads() {
        let mut ix = PrefixIndex::new(6);
        let a = [10, 11, 12, 13];
        let b = [20, 21, 22, 23];
        ix.record(ep(1), &a);
        ix.record(ep(1), &b);
        // a's tail (13, 12) went first; a's head survives.
        assert_eq!(ix.longest_prefix(&a), vec![(ep(1), 2)]);
        assert_eq!(ix.longest_prefix(&b), vec![(ep(1), 4)]);
        assert!(!ix.contains(ep(1), 13) && !ix.contains(ep(1), 12));
    }

    #[test]
    fn record_longer_than_capacity_keeps_the_head() {
        let mut ix = PrefixIndex::new(3);
        let blocks: Vec<u64> = (1..=10).collect();
        ix.record(ep(1), &blocks);
        assert_eq!(ix.len(ep(1)), 3);
        assert_eq!(ix.longest_prefix(&blocks), vec![(ep(1), 3)]);
    }

    #[test]
    fn re_recording_touches() {
        let mut ix = PrefixIndex::new(4);
        ix.record(ep(1), &[1, 2]);
        ix.record(ep(1), &[3, 4]);
        ix.record(ep(1), &[1, 2]); // now [3,4] is older
        ix.record(ep(1), &[5]);
        assert!(ix.contains(ep(1), 2), "touched block evicted");
        assert!(!ix.contains(ep(1), 4), "tail of the older prefix kept");
        assert!(ix.contains(ep(1), 3));
    }

    #[test]
    fn set_capacity_shrinks_tail_first_and_grows() {
        let mut ix = PrefixIndex::new(100);
        let blocks: Vec<u64> = (1..=8).collect();
        ix.record(ep(1), &blocks);
        ix.set_capacity(ep(1), 5);
        assert_eq!(ix.capacity(ep(1)), 5);
        assert_eq!(ix.longest_prefix(&blocks), vec![(ep(1), 5)]);
        ix.set_capacity(ep(1), 0);
        assert_eq!(ix.len(ep(1)), 0);
        assert!(ix.is_empty());
        ix.record(ep(1), &blocks);
        assert_eq!(ix.len(ep(1)), 0, "capacity 0 holds nothing");
        ix.set_capacity(ep(1), 8);
        ix.record(ep(1), &blocks);
        assert_eq!(ix.longest_prefix(&blocks), vec![(ep(1), 8)]);
        // A capacity set before any record applies to the first record.
        ix.set_capacity(ep(2), 2);
        ix.record(ep(2), &blocks);
        assert_eq!(ix.len(ep(2)), 2);
        // Unknown endpoints report the default; huge values are clamped.
        assert_eq!(ix.capacity(ep(3)), 100);
        ix.set_capacity(ep(3), usize::MAX);
        assert_eq!(ix.capacity(ep(3)), MAX_CAPACITY);
    }

    #[test]
    fn shared_blocks_survive_one_holders_eviction() {
        let mut ix = PrefixIndex::new(3);
        for i in 0..5 {
            ix.record(ep(i), &[1, 2, 3]);
        }
        // Evict from the middle of the holder chains.
        ix.record(ep(2), &[7, 8, 9]);
        let got = ix.longest_prefix(&[1, 2, 3]);
        assert_eq!(got, vec![(ep(0), 3), (ep(1), 3), (ep(3), 3), (ep(4), 3)]);
        assert_eq!(ix.longest_prefix(&[7, 8]), vec![(ep(2), 2)]);
    }

    #[test]
    fn retain_forgets_endpoints_and_reuses_slots() {
        let mut ix = PrefixIndex::new(10);
        ix.record(ep(1), &[1, 2]);
        ix.record(ep(2), &[1, 2, 3]);
        ix.record(ep(3), &[4]);
        ix.retain(&[ep(2), ep(9)]);
        assert_eq!(ix.endpoint_count(), 1);
        assert_eq!(ix.longest_prefix(&[1, 2, 3]), vec![(ep(2), 3)]);
        assert!(ix.longest_prefix(&[4]).is_empty());
        assert_eq!(ix.len(ep(1)), 0);
        assert_eq!(ix.distinct_blocks(), 3);
        ix.record(ep(5), &[4, 5]);
        ix.record(ep(1), &[1]);
        assert_eq!(ix.longest_prefix(&[4, 5]), vec![(ep(5), 2)]);
        assert_eq!(ix.longest_prefix(&[1, 2]), vec![(ep(2), 2), (ep(1), 1)]);
        ix.retain(&[]);
        assert!(ix.is_empty());
        assert_eq!(ix.endpoint_count(), 0);
        assert_eq!(ix.total_len(), 0);
    }

    #[test]
    fn forget_unlearns_one_holder_and_reuses_the_nodes() {
        let mut ix = PrefixIndex::new(100);
        ix.record(ep(1), &[1, 2, 3, 4]);
        ix.record(ep(2), &[1, 2, 3]);
        ix.forget(ep(1), &[3, 4, 99]);
        assert_eq!(
            ix.longest_prefix(&[1, 2, 3, 4]),
            vec![(ep(2), 3), (ep(1), 2)]
        );
        assert_eq!(ix.len(ep(1)), 2);
        // The other holder's block 3 stays; block 4 had one holder.
        assert_eq!(ix.distinct_blocks(), 3);
        ix.forget(ep(2), &[1, 2, 3]);
        ix.forget(ep(3), &[1]); // unknown endpoint: nothing
        assert_eq!(ix.longest_prefix(&[1, 2]), vec![(ep(1), 2)]);
        // The LRU list survives removals from its middle: 2 goes first.
        ix.record(ep(1), &[5]);
        ix.set_capacity(ep(1), 2);
        assert!(ix.contains(ep(1), 5) && ix.contains(ep(1), 1) && !ix.contains(ep(1), 2));
        let nodes = ix.nodes.len();
        ix.record(ep(2), &[7, 8, 9]);
        assert_eq!(ix.nodes.len(), nodes, "freed nodes are reused");
    }

    #[test]
    fn node_is_24_bytes() {
        // The memory figure in the module doc depends on it.
        assert_eq!(std::mem::size_of::<Node>(), 24);
    }

    #[test]
    fn endpoint_count_is_bounded() {
        let mut ix = PrefixIndex::new(1);
        for i in 0..(MAX_ENDPOINTS as u32 + 10) {
            ix.record(ep(i), &[u64::from(i)]);
        }
        assert_eq!(ix.endpoint_count(), MAX_ENDPOINTS);
        assert_eq!(ix.len(ep(MAX_ENDPOINTS as u32 + 1)), 0);
        assert!(format!("{ix:?}").contains("endpoints: 4096"));
    }

    fn leaves_of(p: &[u8]) -> crate::prefix::PromptHashes {
        let mut h = crate::prefix::block::BlockHasher::new(64, 100);
        h.write(p);
        h.finish_prompt(1, 0)
    }

    fn conv(n: usize, salt: u8) -> Vec<u8> {
        (0..n).map(|i| (i * 7 % 251) as u8 ^ salt).collect()
    }

    #[test]
    fn a_leaf_matches_the_next_turn_as_a_partial_block() {
        let mut ix = PrefixIndex::new(100);
        // Turn 1, shorter than a block (40 bytes: 10 sixteenths), sent to ep 1.
        let turn1 = conv(40, 0);
        let t1 = leaves_of(&turn1);
        assert!(t1.blocks.is_empty());
        ix.record_with_leaf(ep(1), &t1.blocks, t1.leaves.leaf());
        // Another conversation's short turn on ep 2.
        let other = leaves_of(&conv(40, 1));
        ix.record_with_leaf(ep(2), &other.blocks, other.leaves.leaf());
        let mut turn2 = turn1.clone();
        turn2.extend(conv(300, 2));
        let t2 = leaves_of(&turn2);
        assert_eq!(t2.blocks.len(), 5);
        let got = ix.longest_prefix_with_leaves((&t2).into());
        let want = PrefixMatch {
            endpoint: ep(1),
            blocks: 0,
            sixteenths: 10,
        };
        assert_eq!(got, vec![want]);
        assert_eq!(want.partial(), 0.625);
        // Without checkpoints only full blocks count: nothing.
        assert!(ix
            .longest_prefix_with_leaves((&t2.blocks).into())
            .is_empty());
        // The same short prompt again matches its own leaf.
        let again = ix.longest_prefix_with_leaves((&t1).into());
        assert_eq!(again, vec![want]);
    }

    #[test]
    fn a_leaf_after_full_blocks_ranks_holders_of_the_same_blocks() {
        let mut ix = PrefixIndex::new(100);
        // A shared head of 3 blocks on eps 1, 2, 3; the conversation's turn
        // (3 blocks + 50 bytes) went to ep 2; ep 3 holds a longer prefix of
        // another conversation; ep 4 holds only the conversation's leaf
        // (its full blocks were evicted: no match, the leaf does not count
        // without the blocks before it).
        let head = conv(64 * 3, 0);
        let mut turn = head.clone();
        turn.extend(conv(50, 3));
        let t = leaves_of(&turn);
        for e in [1, 2, 3] {
            ix.record(ep(e), &leaves_of(&head).blocks);
        }
        ix.record_with_leaf(ep(2), &t.blocks, t.leaves.leaf());
        let mut longer = head.clone();
        longer.extend(conv(64, 9));
        ix.record(ep(3), &leaves_of(&longer).blocks);
        ix.record_with_leaf(ep(4), &[], t.leaves.leaf());
        let mut next = turn.clone();
        next.extend(conv(500, 4));
        let n = leaves_of(&next);
        let got: Vec<(Endpoint, usize, u8)> = ix
            .longest_prefix_with_leaves((&n).into())
            .iter()
            .map(|m| (m.endpoint, m.blocks, m.sixteenths))
            .collect();
        assert_eq!(got, vec![(ep(2), 3, 12), (ep(1), 3, 0), (ep(3), 3, 0)]);
        // Full-block counts are exactly longest_prefix's.
        let full: Vec<(Endpoint, usize)> = got.iter().map(|&(e, k, _)| (e, k)).collect();
        let mut plain = ix.longest_prefix(&n.blocks);
        plain.sort_unstable_by_key(|&(e, _)| full.iter().position(|&(f, _)| f == e));
        assert_eq!(full, plain);
    }

    #[test]
    fn a_leaf_is_the_first_node_of_its_request_to_go() {
        let mut ix = PrefixIndex::new(4);
        ix.record_with_leaf(ep(1), &[1, 2, 3], Some(99));
        assert_eq!(ix.len(ep(1)), 4);
        ix.record(ep(1), &[7]);
        assert!(!ix.contains(ep(1), 99), "the leaf is evicted first");
        assert!(ix.contains(ep(1), 3));
        // No room left after the blocks: the leaf is not recorded.
        ix.record_with_leaf(ep(2), &[1, 2, 3, 4, 5], Some(98));
        assert!(!ix.contains(ep(2), 98));
        assert_eq!(ix.len(ep(2)), 4);
        // A decision-log list that ends with the leaf records the same.
        let mut a = PrefixIndex::new(10);
        let mut b = PrefixIndex::new(10);
        a.record_with_leaf(ep(1), &[1, 2], Some(3));
        b.record(ep(1), &[1, 2, 3]);
        a.record(ep(1), &[5, 6, 7, 8, 9, 10, 11, 12]);
        b.record(ep(1), &[5, 6, 7, 8, 9, 10, 11, 12]);
        for x in [1, 2, 3, 5, 12] {
            assert_eq!(a.contains(ep(1), x), b.contains(ep(1), x), "{x}");
        }
    }

    /// Reference model: per endpoint a Vec of blocks, most recent first.
    #[derive(Default)]
    struct Naive {
        lists: std::collections::BTreeMap<Endpoint, (usize, Vec<u64>)>,
    }

    impl Naive {
        fn entry(&mut self, e: Endpoint, default: usize) -> &mut (usize, Vec<u64>) {
            self.lists.entry(e).or_insert((default, Vec::new()))
        }
        fn record(&mut self, e: Endpoint, blocks: &[u64], default: usize) {
            let (cap, list) = self.entry(e, default);
            let cap = *cap;
            for &b in blocks[..cap.min(blocks.len())].iter().rev() {
                if let Some(p) = list.iter().position(|&x| x == b) {
                    list.remove(p);
                } else if list.len() >= cap {
                    list.pop();
                }
                list.insert(0, b);
            }
        }
        fn forget(&mut self, e: Endpoint, blocks: &[u64]) {
            if let Some((_, list)) = self.lists.get_mut(&e) {
                list.retain(|b| !blocks.contains(b));
            }
        }
        fn set_capacity(&mut self, e: Endpoint, cap: usize, default: usize) {
            let entry = self.entry(e, default);
            entry.0 = cap;
            entry.1.truncate(cap);
        }
        fn longest_prefix(&self, q: &[u64]) -> Vec<(Endpoint, usize)> {
            let mut out: Vec<_> = self
                .lists
                .iter()
                .map(|(e, (_, l))| (*e, q.iter().take_while(|b| l.contains(b)).count()))
                .filter(|&(_, k)| k > 0)
                .collect();
            out.sort_unstable_by_key(|&(e, k)| (Reverse(k), e));
            out
        }
    }

    #[test]
    fn matches_a_naive_model_under_random_operations() {
        let mut rng = fastrand::Rng::with_seed(7);
        let default = 12;
        let mut ix = PrefixIndex::new(default);
        let mut naive = Naive::default();
        // Prompts share prefixes: conversation c, turn t -> blocks c*100 + 0..len.
        for step in 0..4000 {
            let e = ep(rng.u32(0..6));
            let conv = rng.u64(0..8);
            let len = rng.usize(0..10);
            let blocks: Vec<u64> = (0..len as u64).map(|i| conv * 100 + i).collect();
            match rng.u32(0..20) {
                0 => {
                    let cap = rng.usize(0..16);
                    ix.set_capacity(e, cap);
                    naive.set_capacity(e, cap, default);
                }
                1 if step % 50 == 0 => {
                    let pool: Vec<Endpoint> = (0..6).filter(|_| rng.bool()).map(ep).collect();
                    ix.retain(&pool);
                    naive.lists.retain(|e, _| pool.contains(e));
                }
                2..=9 => {
                    assert_eq!(ix.longest_prefix(&blocks), naive.longest_prefix(&blocks));
                }
                10 | 11 => {
                    // A refused request: its tail, from a random block on.
                    let from = rng.usize(0..=len);
                    ix.forget(e, &blocks[from..]);
                    naive.forget(e, &blocks[from..]);
                }
                _ => {
                    ix.record(e, &blocks);
                    naive.record(e, &blocks, default);
                }
            }
            for (e, (_, l)) in &naive.lists {
                assert_eq!(ix.len(*e), l.len(), "step {step}");
            }
        }
    }
}
