//! LoRA adapters of one pod, after vLLM's `--enable-lora`: a request whose
//! `model` names one of the pod's adapters (`--lora-adapters`) runs with it;
//! at most `--max-loras` adapters are loaded at once (vLLM's GPU slots);
//! a request for an adapter that is not loaded waits while it loads
//! (`--lora-load-ms`, simulated), evicting the least recently used adapter
//! that has no request running; when every slot runs requests, it waits for
//! one to free.
//!
//! `/metrics` reports vLLM's `vllm:lora_requests_info` gauge: labels
//! `max_lora`, `running_lora_adapters` and `waiting_lora_adapters` (names
//! comma-joined, as vLLM's `",".join(...)`), value the time the label set
//! was last current (vLLM's `set_to_current_time()`). Like a real
//! Prometheus gauge, label sets of the past stay in the scrape (the last
//! [`HISTORY`] here): the current one is the sample with the largest value.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Past label sets kept in the scrape.
pub const HISTORY: usize = 8;

/// The adapter configuration of a pod.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Adapter names the pod serves (empty: LoRA off).
    pub adapters: Vec<String>,
    /// Adapters loaded at once.
    pub max_loras: usize,
    /// Wall time to load an adapter.
    pub load: Duration,
}

#[derive(Debug, Default)]
struct State {
    /// Loaded adapters with the tick of their last use (LRU).
    loaded: Vec<(String, u64)>,
    /// Adapters being loaded (they hold a slot).
    loading: Vec<String>,
    running: BTreeMap<String, usize>,
    waiting: BTreeMap<String, usize>,
    tick: u64,
    /// Label sets rendered, with the time each was last current.
    history: VecDeque<(String, f64)>,
}

fn add(m: &mut BTreeMap<String, usize>, name: &str, delta: isize) {
    let n = m.get(name).copied().unwrap_or(0) as isize + delta;
    if n <= 0 {
        m.remove(name);
    } else {
        m.insert(name.to_owned(), n as usize);
    }
}

/// The adapter slots of one pod.
#[derive(Debug)]
pub struct LoraSlots {
    cfg: LoraConfig,
    state: Arc<Mutex<State>>,
}

/// A request running with an adapter: releases it when dropped.
#[derive(Debug)]
pub struct LoraLease {
    name: String,
    state: Arc<Mutex<State>>,
}

impl LoraLease {
    /// The adapter's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for LoraLease {
    fn drop(&mut self) {
        add(&mut lock(&self.state).running, &self.name, -1);
    }
}

/// One step of [`LoraSlots::acquire`].
enum Step {
    Run,
    Load,
    Wait,
}

/// Undoes a mark on the state when dropped.
struct Undo<'a>(&'a Mutex<State>, &'a str, fn(&mut State, &str));

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        (self.2)(&mut lock(self.0), self.1);
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl LoraSlots {
    /// Slots for `cfg`.
    pub fn new(cfg: LoraConfig) -> LoraSlots {
        LoraSlots {
            cfg,
            state: Arc::new(Mutex::new(State::default())),
        }
    }

    /// Whether the pod serves adapters at all.
    pub fn enabled(&self) -> bool {
        !self.cfg.adapters.is_empty()
    }

    /// Whether `model` is one of the pod's adapters.
    pub fn serves(&self, model: &str) -> bool {
        self.cfg.adapters.iter().any(|a| a == model)
    }

    /// Waits until `adapter` is loaded with a slot for it (loading it if
    /// need be), then holds it for one request. A request dropped while it
    /// waits or loads leaves no trace (the guards undo its marks).
    pub async fn acquire(&self, adapter: &str) -> LoraLease {
        add(&mut lock(&self.state).waiting, adapter, 1);
        let _waiting = Undo(&self.state, adapter, |s, a| add(&mut s.waiting, a, -1));
        loop {
            let step = {
                let mut s = lock(&self.state);
                s.tick += 1;
                let tick = s.tick;
                if let Some(e) = s.loaded.iter_mut().find(|(n, _)| n == adapter) {
                    e.1 = tick;
                    add(&mut s.running, adapter, 1);
                    Step::Run
                } else if !s.loading.iter().any(|n| n == adapter) && self.take_slot(&mut s, adapter)
                {
                    Step::Load
                } else {
                    // Loading for another request, or every slot busy.
                    Step::Wait
                }
            };
            match step {
                Step::Run => {
                    return LoraLease {
                        name: adapter.to_owned(),
                        state: Arc::clone(&self.state),
                    }
                }
                Step::Load => {
                    let _loading = Undo(&self.state, adapter, |s, a| s.loading.retain(|n| n != a));
                    tokio::time::sleep(self.cfg.load).await;
                    let mut s = lock(&self.state);
                    let tick = s.tick;
                    s.loaded.push((adapter.to_owned(), tick));
                }
                Step::Wait => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        }
    }

    /// Reserves a slot for loading `adapter`: a free one, or the least
    /// recently used loaded adapter with nothing running (evicted).
    fn take_slot(&self, s: &mut State, adapter: &str) -> bool {
        if s.loaded.len() + s.loading.len() >= self.cfg.max_loras.max(1) {
            let idle = s
                .loaded
                .iter()
                .enumerate()
                .filter(|(_, (n, _))| !s.running.contains_key(n))
                .min_by_key(|(_, (_, t))| *t)
                .map(|(i, _)| i);
            match idle {
                Some(i) => {
                    s.loaded.remove(i);
                }
                None => return false,
            }
        }
        s.loading.push(adapter.to_owned());
        true
    }

    /// The `vllm:lora_requests_info` family at unix time `now` (empty when
    /// LoRA is off).
    pub fn render(&self, now: f64) -> String {
        if !self.enabled() {
            return String::new();
        }
        let mut s = lock(&self.state);
        let join = |m: &BTreeMap<String, usize>| m.keys().cloned().collect::<Vec<_>>().join(",");
        let labels = format!(
            "max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"",
            self.cfg.max_loras,
            join(&s.running),
            join(&s.waiting)
        );
        s.history.retain(|(l, _)| *l != labels);
        s.history.push_back((labels, now));
        while s.history.len() > HISTORY {
            s.history.pop_front();
        }
        let mut out = String::from(
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\n",
        );
        for (l, t) in &s.history {
            let _ = writeln!(out, "vllm:lora_requests_info{{{l}}} {t:e}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(max_loras: usize) -> LoraSlots {
        LoraSlots::new(LoraConfig {
            adapters: vec!["a".into(), "b".into(), "c".into()],
            max_loras,
            load: Duration::from_millis(1),
        })
    }

    #[tokio::test]
    async fn loads_runs_and_evicts_the_least_recently_used_idle_adapter() {
        let s = slots(2);
        let a = s.acquire("a").await;
        let b = s.acquire("b").await;
        let text = s.render(10.0);
        assert!(text.contains("running_lora_adapters=\"a,b\""), "{text}");
        drop(a);
        // c takes a's slot (idle, least recently used); b keeps running.
        let c = s.acquire("c").await;
        let text = s.render(11.0);
        assert!(
            text.contains(
                "max_lora=\"2\",running_lora_adapters=\"b,c\",waiting_lora_adapters=\"\"} 1.1e1"
            ),
            "{text}"
        );
        assert!(
            text.contains("running_lora_adapters=\"a,b\",waiting_lora_adapters=\"\"} 1e1"),
            "history kept: {text}"
        );
        // Every slot busy: a waits until one frees.
        let s = Arc::new(s);
        let s2 = Arc::clone(&s);
        let waiter = tokio::spawn(async move { s2.acquire("a").await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(s.render(12.0).contains("waiting_lora_adapters=\"a\""));
        assert!(!waiter.is_finished());
        drop(b);
        let a = waiter.await.unwrap();
        assert!(s.render(13.0).contains("running_lora_adapters=\"a,c\""));
        drop((a, c));
        assert!(s.serves("b") && !s.serves("d") && s.enabled());
    }
}
