//! Prefix-index records put off until a decision could see them.
//!
//! A request matches a recorded prompt only through its first block: every
//! hash past the first block is chained from it, and a hash inside the
//! first block is the leaf of a prompt with no full block (a record of one
//! hash, never put off). So a record of two or more hashes is needed only by
//! a decision whose prompt starts with the same block. The shell keeps such
//! records here and makes them before such a decision, on its next tick, or
//! when too many wait, instead of on the path of every request: a 512 KiB
//! prompt is 2048 hashes, ~180 us of index work in V8, in every worker.
//!
//! Only long records wait ([`Deferred::MIN_HASHES`]): a short one is
//! cheaper to make than to keep. Memory is bounded by
//! [`Deferred::MAX_HASHES`] and [`Deferred::MAX_ENTRIES`]: past either, the
//! shell makes them all at once.

use crate::endpoint::Endpoint;

/// A decision whose prefix-index record is put off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    /// Where the prompt went.
    pub endpoint: Endpoint,
    /// Its block hashes, then its leaf (as the decision log carries them).
    pub hashes: Vec<u64>,
    /// When it was routed (ms).
    pub at_ms: u64,
}

/// Put-off records, in the order the decisions were learned.
#[derive(Debug, Default)]
pub struct Deferred {
    entries: Vec<Pending>,
    hashes: usize,
}

impl Deferred {
    /// Records shorter than this are made at once (16 KiB of prompt).
    pub const MIN_HASHES: usize = 64;
    /// Hashes held at most (512 KiB).
    pub const MAX_HASHES: usize = 1 << 16;
    /// Records held at most.
    pub const MAX_ENTRIES: usize = 1024;

    /// Whether a record of `hashes` may wait for the decisions that need it.
    pub fn can_wait(hashes: &[u64]) -> bool {
        // Two hashes at least (see the module doc), and long enough to pay.
        hashes.len() >= Self::MIN_HASHES.max(2)
    }

    /// Keeps a record (the caller checked [`Deferred::can_wait`]).
    pub fn push(&mut self, p: Pending) {
        self.hashes += p.hashes.len();
        self.entries.push(p);
    }

    /// Past the memory bound: every record should be made now.
    pub fn full(&self) -> bool {
        self.hashes > Self::MAX_HASHES || self.entries.len() > Self::MAX_ENTRIES
    }

    /// Nothing waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Records held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Takes the records a decision on a prompt whose first block is
    /// `first` could match (all of them for `None`), oldest first.
    pub fn take(&mut self, first: Option<u64>) -> Vec<Pending> {
        if let Some(f) = first {
            if !self.entries.iter().any(|p| p.hashes.first() == Some(&f)) {
                return Vec::new();
            }
        }
        let (take, keep): (Vec<Pending>, Vec<Pending>) = std::mem::take(&mut self.entries)
            .into_iter()
            .partition(|p| first.is_none_or(|f| p.hashes.first() == Some(&f)));
        self.entries = keep;
        self.hashes = self.entries.iter().map(|p| p.hashes.len()).sum();
        take
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::PrefixIndex;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn pending(ep: &str, first: u64, n: usize) -> Pending {
        Pending {
            endpoint: ep.parse().unwrap(),
            hashes: (0..n as u64).map(|i| first + i).collect(),
            at_ms: 1,
        }
    }

    #[test]
    fn only_long_records_wait() {
        assert!(!Deferred::can_wait(&[]));
        assert!(!Deferred::can_wait(&[1]));
        assert!(!Deferred::can_wait(&[7; Deferred::MIN_HASHES - 1]));
        assert!(Deferred::can_wait(&[7; Deferred::MIN_HASHES]));
    }

    #[test]
    fn a_decision_takes_the_records_of_its_first_block_in_order() {
        let mut d = Deferred::default();
        d.push(pending("10.0.0.1:8000", 100, 70));
        d.push(pending("10.0.0.2:8000", 500, 80));
        d.push(pending("10.0.0.3:8000", 100, 90));
        assert!(d.take(Some(999)).is_empty(), "no record starts there");
        assert_eq!(d.len(), 3);
        let got = d.take(Some(100));
        let eps: Vec<String> = got.iter().map(|p| p.endpoint.to_string()).collect();
        assert_eq!(eps, ["10.0.0.1:8000", "10.0.0.3:8000"]);
        assert_eq!(d.len(), 1);
        assert_eq!(d.take(None).len(), 1);
        assert!(d.is_empty());
    }

    #[test]
    fn the_bound_is_kept() {
        let mut d = Deferred::default();
        let big = Deferred::MAX_HASHES / 2;
        d.push(pending("10.0.0.1:8000", 1, big));
        d.push(pending("10.0.0.1:8000", 1, big));
        assert!(!d.full());
        d.push(pending("10.0.0.1:8000", 1, 64));
        assert!(d.full());
        d.take(Some(1));
        assert!(!d.full());
        for i in 0..=Deferred::MAX_ENTRIES as u64 {
            d.push(pending("10.0.0.1:8000", 1000 + i, 64));
        }
        assert!(d.full());
    }

    /// The rule the module rests on: a record whose first block differs
    /// from a prompt's gives that prompt no match, so making it after the
    /// decision cannot change what the decision sees.
    #[test]
    fn a_record_with_another_first_block_never_matches() {
        let (a, b): (Endpoint, Endpoint) = (
            "10.0.0.1:8000".parse().unwrap(),
            "10.0.0.2:8000".parse().unwrap(),
        );
        let prompt: Vec<u64> = (0..100).map(|i| 1_000 + i).collect();
        let mut index = PrefixIndex::new(10_000);
        index.record(a, &prompt);
        let before = index.longest_prefix(&prompt);
        // Another prompt sharing every hash but the first.
        let mut other = prompt.clone();
        other[0] = 42;
        index.record(b, &other);
        assert_eq!(index.longest_prefix(&prompt), before);
        assert_eq!(before, vec![(a, 100)]);
    }
}
