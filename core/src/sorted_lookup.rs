//! Lookups by endpoint in a table sorted by endpoint, for a caller that
//! walks the sorted pool.
//!
//! A decision reads every endpoint's in-flight work (and the peers' load)
//! in pool order. A binary search per endpoint costs about ten unpredictable
//! comparisons of two socket addresses: at 1024 endpoints, with a third of
//! them busy, 76 us of a 104 us decision (`cargo bench -p kvroute-core
//! --bench core -- decide/`). [`SortedLookup`] resumes each lookup where
//! the last one stopped, so a walk in ascending order is one merge pass over
//! the table: one comparison per endpoint, plus one per table entry that is
//! not in the pool. A key behind the cursor (a second walk,
//! or any other order) is found by binary search, so every order is
//! answered correctly.

use crate::endpoint::Endpoint;
use std::cell::Cell;
use std::cmp::Ordering;

/// A cursor over `entries`, sorted by `key` without duplicates.
///
/// `key` is a type parameter, not a function pointer, so that it is
/// inlined: an indirect call per step cost the walk more than the
/// comparisons did.
#[derive(Clone, Debug)]
pub struct SortedLookup<'a, T, K> {
    entries: &'a [T],
    key: K,
    /// Where the next lookup starts: every entry before it is ordered
    /// before the last endpoint looked up, or is that endpoint.
    next: Cell<usize>,
}

impl<'a, T, K: Fn(&T) -> &Endpoint> SortedLookup<'a, T, K> {
    /// A cursor at the start of `entries`, which must be sorted by `key`.
    pub fn new(entries: &'a [T], key: K) -> Self {
        SortedLookup {
            entries,
            key,
            next: Cell::new(0),
        }
    }

    /// The entry for `endpoint`, if there is one.
    #[inline]
    pub fn get(&self, endpoint: &Endpoint) -> Option<&'a T> {
        let (entries, key) = (self.entries, &self.key);
        let start = self.next.get();
        let mut i = start;
        // One three-way comparison per step of the walk.
        while let Some(x) = entries.get(i) {
            match key(x).cmp(endpoint) {
                Ordering::Equal => {
                    self.next.set(i + 1);
                    return Some(x);
                }
                Ordering::Greater => break,
                Ordering::Less => i += 1,
            }
        }
        if i == start && i > 0 && key(&entries[i - 1]) >= endpoint {
            return self.behind(endpoint, i);
        }
        self.next.set(i);
        None
    }

    /// A key behind the cursor at `i` (not a walk in ascending order):
    /// binary search.
    #[cold]
    fn behind(&self, endpoint: &Endpoint, i: usize) -> Option<&'a T> {
        let entries = self.entries;
        match entries[..i].binary_search_by(|x| (self.key)(x).cmp(endpoint)) {
            Ok(found) => {
                self.next.set(found + 1);
                Some(&entries[found])
            }
            Err(at) => {
                self.next.set(at);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn ep(i: u8) -> Endpoint {
        format!("10.0.{}.{}:8000", i % 3, i).parse().unwrap()
    }

    #[test]
    fn answers_what_a_binary_search_answers_in_any_order() {
        let mut rng = fastrand::Rng::with_seed(2);
        for _ in 0..2000 {
            let mut entries: Vec<(Endpoint, u32)> = (0..rng.usize(0..12))
                .map(|_| {
                    let i = rng.u8(0..40);
                    (ep(i), u32::from(i))
                })
                .collect();
            entries.sort_unstable();
            entries.dedup_by_key(|(e, _)| *e);
            let lookup = SortedLookup::new(&entries, |(e, _)| e);
            let mut keys: Vec<Endpoint> =
                (0..rng.usize(0..30)).map(|_| ep(rng.u8(0..40))).collect();
            // Mostly walks in ascending order (what decisions do), repeated;
            // sometimes any order.
            if rng.u8(0..4) != 0 {
                keys.sort_unstable();
                let again = keys.clone();
                keys.extend(again);
            }
            for k in &keys {
                let want = entries
                    .binary_search_by(|(e, _)| e.cmp(k))
                    .ok()
                    .map(|i| &entries[i]);
                assert_eq!(lookup.get(k), want, "{k} in {entries:?}, keys {keys:?}");
            }
        }
    }

    #[test]
    fn an_empty_table_answers_none() {
        let entries: Vec<(Endpoint, u32)> = Vec::new();
        let lookup = SortedLookup::new(&entries, |(e, _)| e);
        assert_eq!(lookup.get(&ep(1)), None);
        assert_eq!(lookup.get(&ep(0)), None);
    }
}
