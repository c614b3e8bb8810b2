//! Chained block hashing. STUB: contract only.

/// Seed of block 0: distinct per model and cache salt.
pub fn seed(_model: &str, _cache_salt: Option<&str>) -> u64 {
    0
}

/// Chained hashes of the full `block_bytes`-sized blocks of `prompt`, at most `max_blocks`.
pub fn block_hashes(
    _seed: u64,
    _prompt: &[u8],
    _block_bytes: usize,
    _max_blocks: usize,
) -> Vec<u64> {
    Vec::new()
}
