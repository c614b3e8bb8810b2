//! LoRA adapters on one endpoint, from vLLM's `vllm:lora_requests_info`
//! gauge: labels `running_lora_adapters` and `waiting_lora_adapters` (the
//! adapter names with requests running / waiting, comma-joined) and
//! `max_lora` (adapter slots of the running batch, `--max-loras`).
//!
//! vLLM sets the gauge to the current time with `set_to_current_time()`
//! for the label set of that moment (`vllm/v1/metrics/loggers.py`), and a
//! Prometheus gauge keeps every label set it was ever given: a scrape
//! holds one sample per past state, and the **current one is the sample
//! with the largest value** (what GIE's metrics reader does too).
//!
//! Bounded whatever the scrape holds: names are kept as 64-bit hashes, at
//! most [`MAX_LISTED`] running and as many waiting (the counts are kept in
//! full); an adapter beyond the cap is not recognised (scored as absent).

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

/// An adapter name's id: 32 bits of its hash (a collision only misleads a
/// routing preference; it keeps the snapshot, copied into the shared scrape
/// state, small).
pub type AdapterId = u32;

/// Most adapter names kept per list (running, waiting) per endpoint.
pub const MAX_LISTED: usize = 8;

/// The adapters of one endpoint at one scrape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoraSnapshot {
    /// Hashes ([`adapter_id`]) of the adapters with running requests (the
    /// first `running_count` entries, at most [`MAX_LISTED`]; 0 after).
    pub running: [AdapterId; MAX_LISTED],
    /// Hashes of the adapters with waiting requests.
    pub waiting: [AdapterId; MAX_LISTED],
    /// Adapters running (all of them, not only those listed).
    pub running_count: u16,
    /// Adapters waiting.
    pub waiting_count: u16,
    /// Adapter slots (`max_lora`); 0 when not reported.
    pub max_lora: u16,
}

/// The id of an adapter name, as kept in a [`LoraSnapshot`].
pub fn adapter_id(name: &str) -> AdapterId {
    xxh3_64(name.as_bytes()) as AdapterId
}

/// Fills `ids` with the distinct non-empty names of a comma-joined label;
/// returns how many distinct names there were (listed or not).
fn read_list(label: &str, ids: &mut [AdapterId; MAX_LISTED]) -> u16 {
    let mut n = 0usize;
    for name in label.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let id = adapter_id(name);
        if ids[..n.min(MAX_LISTED)].contains(&id) {
            continue;
        }
        if n < MAX_LISTED {
            ids[n] = id;
        }
        n += 1;
    }
    n.min(u16::MAX as usize) as u16
}

impl LoraSnapshot {
    /// The snapshot of one sample's labels.
    pub fn from_labels(running: &str, waiting: &str, max_lora: &str) -> LoraSnapshot {
        let mut s = LoraSnapshot::default();
        s.running_count = read_list(running, &mut s.running);
        s.waiting_count = read_list(waiting, &mut s.waiting);
        s.max_lora = max_lora
            .trim()
            .parse::<u64>()
            .map_or(0, |v| v.min(u64::from(u16::MAX)) as u16);
        s
    }

    fn listed(ids: &[AdapterId; MAX_LISTED], count: u16, id: AdapterId) -> bool {
        ids[..usize::from(count).min(MAX_LISTED)].contains(&id)
    }

    /// Requests for the adapter are running here (it is loaded).
    pub fn running(&self, id: AdapterId) -> bool {
        Self::listed(&self.running, self.running_count, id)
    }

    /// Requests for the adapter wait here (it is being loaded, or waits
    /// for a slot).
    pub fn waiting(&self, id: AdapterId) -> bool {
        Self::listed(&self.waiting, self.waiting_count, id)
    }

    /// An adapter slot is free: fewer adapters running or waiting than
    /// `max_lora`.
    pub fn free_slot(&self) -> bool {
        u32::from(self.running_count) + u32::from(self.waiting_count) < u32::from(self.max_lora)
    }

    /// How well the endpoint suits a request for adapter `id`
    /// ([`AdapterFit`], best first).
    pub fn fit(&self, id: AdapterId) -> AdapterFit {
        if self.running(id) {
            AdapterFit::Running
        } else if self.free_slot() {
            AdapterFit::FreeSlot
        } else if self.waiting(id) {
            AdapterFit::Waiting
        } else {
            AdapterFit::Absent
        }
    }

    /// [`LoraSnapshot::fit`]'s score (llm-d's LoRA-affinity scorer):
    /// running 1.0, a free slot 0.8, waiting 0.6, else 0.
    pub fn affinity(&self, id: AdapterId) -> f64 {
        self.fit(id).score().unwrap_or(0.0)
    }
}

/// How an endpoint suits a request for one adapter: the one byte of its
/// [`LoraSnapshot`] a routing decision copies per candidate (the snapshot's
/// lists stay in the scrape state).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AdapterFit {
    /// Not known: no fresh snapshot, the engine does not report its
    /// adapters, or the request names none.
    #[default]
    Unknown,
    /// Requests for the adapter run here (it is loaded).
    Running,
    /// Not running, but an adapter slot is free.
    FreeSlot,
    /// Requests for it wait here (being loaded, or waiting for a slot).
    Waiting,
    /// Neither, and every slot is taken.
    Absent,
}

impl AdapterFit {
    /// The lora-affinity score: running 1.0, a free slot 0.8, waiting 0.6,
    /// absent 0; `None` when unknown.
    pub fn score(self) -> Option<f64> {
        match self {
            AdapterFit::Running => Some(1.0),
            AdapterFit::FreeSlot => Some(0.8),
            AdapterFit::Waiting => Some(0.6),
            AdapterFit::Absent => Some(0.0),
            AdapterFit::Unknown => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn running_free_slot_waiting_absent() {
        let (a, b, c, d) = (
            adapter_id("a"),
            adapter_id("b"),
            adapter_id("c"),
            adapter_id("d"),
        );
        let full = LoraSnapshot::from_labels("a,b", "c", "3");
        assert_eq!(
            (full.running_count, full.waiting_count, full.max_lora),
            (2, 1, 3)
        );
        assert_eq!(full.affinity(a), 1.0);
        assert_eq!(full.affinity(b), 1.0);
        assert_eq!(full.affinity(c), 0.6, "all 3 slots taken, c waits");
        assert_eq!(full.affinity(d), 0.0);
        let room = LoraSnapshot::from_labels("a", "", "2");
        assert_eq!(room.affinity(a), 1.0);
        assert_eq!(room.affinity(d), 0.8);
        let idle = LoraSnapshot::from_labels("", "", "1");
        assert_eq!(idle.affinity(a), 0.8);
        assert_eq!(LoraSnapshot::from_labels("a", "", "bogus").affinity(d), 0.0);
    }

    #[test]
    fn lists_are_bounded_and_deduplicated() {
        let many: Vec<String> = (0..1000).map(|i| format!("lora-{i}")).collect();
        let s = LoraSnapshot::from_labels(&many.join(","), " x , x ,, ", "4");
        assert_eq!(s.running_count, 1000);
        assert_eq!(s.waiting_count, 1);
        assert!(s.running(adapter_id("lora-7")));
        assert!(!s.running(adapter_id("lora-8")), "beyond the cap");
        assert!(s.waiting(adapter_id("x")));
        assert!(!s.free_slot());
        assert!(
            !LoraSnapshot::default().running(0),
            "empty slots match nothing"
        );
    }
}
