//! Which endpoint was sent which blocks. STUB: contract only.

use crate::endpoint::Endpoint;

/// Per-endpoint LRU record of the block hashes each endpoint was sent.
#[derive(Debug, Default)]
pub struct PrefixIndex {}

impl PrefixIndex {
    /// An empty index; every endpoint holds at most `default_capacity` blocks.
    pub fn new(_default_capacity: usize) -> Self {
        PrefixIndex {}
    }
    /// Sets one endpoint's capacity in blocks (evicting LRU blocks beyond it).
    pub fn set_capacity(&mut self, _endpoint: Endpoint, _blocks: usize) {}
    /// For each endpoint holding block 0, the number of leading blocks of
    /// `blocks` it holds. Endpoints with no match are absent.
    pub fn longest_prefix(&self, _blocks: &[u64]) -> Vec<(Endpoint, usize)> {
        Vec::new()
    }
    /// Learns that `endpoint` was sent `blocks` (most recent use).
    pub fn record(&mut self, _endpoint: Endpoint, _blocks: &[u64]) {}
    /// Forgets every endpoint not in `pool`.
    pub fn retain(&mut self, _pool: &[Endpoint]) {}
    /// Blocks currently held for `endpoint`.
    pub fn len(&self, _endpoint: Endpoint) -> usize {
        0
    }
}
