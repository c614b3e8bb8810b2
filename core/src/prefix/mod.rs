//! Prefix-cache affinity: prompts hashed into chained blocks (and sub-block
//! checkpoints, so that a prompt ending mid-block, however short, teaches
//! affinity too), and the index of which endpoint was sent which blocks.

pub mod block;
pub mod index;

pub use block::{block_hashes, seed, Leaves, PromptHashes};
pub use index::{PrefixIndex, PrefixMatch};

/// A request as the prefix index sees it: its full block hashes and, when
/// the caller has them, its sub-block checkpoints ([`Leaves`]). Built from
/// a bare block list (no checkpoints: full blocks only, as before leaves
/// existed, or a decision-log entry, whose list may end with a leaf) or
/// from [`crate::request::InferenceRequest::prompt`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Prompt<'a> {
    /// Sealed full-block hashes.
    pub blocks: &'a [u64],
    /// Checkpoints, if known.
    pub leaves: Option<&'a Leaves>,
}

impl<'a> From<&'a [u64]> for Prompt<'a> {
    fn from(blocks: &'a [u64]) -> Self {
        Prompt {
            blocks,
            leaves: None,
        }
    }
}

impl<'a> From<&'a Vec<u64>> for Prompt<'a> {
    fn from(blocks: &'a Vec<u64>) -> Self {
        Prompt::from(&blocks[..])
    }
}

impl<'a, const N: usize> From<&'a [u64; N]> for Prompt<'a> {
    fn from(blocks: &'a [u64; N]) -> Self {
        Prompt::from(&blocks[..])
    }
}

impl<'a> From<&'a PromptHashes> for Prompt<'a> {
    fn from(p: &'a PromptHashes) -> Self {
        Prompt {
            blocks: &p.blocks,
            leaves: Some(&p.leaves),
        }
    }
}

impl Prompt<'_> {
    /// The request's leaf, if it has one (see [`Leaves::leaf`]).
    pub fn leaf(&self) -> Option<u64> {
        self.leaves.and_then(Leaves::leaf)
    }
}
