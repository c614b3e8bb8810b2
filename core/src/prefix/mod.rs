//! Prefix-cache affinity: prompts hashed into chained blocks, and the index
//! of which endpoint was sent which blocks.

pub mod block;
pub mod index;

pub use block::{block_hashes, seed};
pub use index::PrefixIndex;
