//! The continuous-batching scheduler of one pod: FIFO waiting queue, a running batch of at
//! most `max_num_seqs`, a per-step token budget with chunked prefill, and KV blocks that
//! must fit before a request may start.
//!
//! This is where queueing and cache hits turn into latency, which is what a router is
//! judged on. It is a pure state machine with time passed in: [`Scheduler::schedule`] plans
//! one engine step at a given simulated time and returns its duration from the
//! [`LatencyModel`]; [`Scheduler::complete`] applies the step at its end time and reports
//! which requests produced tokens. The async engine loop (`pod.rs`) sleeps in between.

use std::collections::VecDeque;

use crate::kv_cache::{Allocation, BlockHash, KvCache};
use crate::latency::{LatencyModel, StepWork};
use crate::metrics::{EngineStats, FinishReason};

/// Identifies a request within one pod.
pub type SeqId = u64;

/// Static limits of the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Maximum requests in the running batch (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Token budget of one step: one per decoding request plus prefill chunks.
    pub max_num_batched_tokens: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV capacity in blocks.
    pub kv_blocks: usize,
}

impl SchedulerConfig {
    /// Checks that a request of this size could ever run: a non-empty prompt, at least
    /// one output token, and prompt + output within the KV capacity.
    pub fn check(&self, prompt_len: usize, output_len: usize) -> Result<(), SubmitError> {
        if prompt_len == 0 || output_len == 0 {
            return Err(SubmitError::Empty);
        }
        let block_size = self.block_size.max(1);
        let requested = prompt_len.saturating_add(output_len);
        if requested.div_ceil(block_size) > self.kv_blocks {
            return Err(SubmitError::TooLong {
                requested,
                capacity: self.kv_blocks * block_size,
            });
        }
        Ok(())
    }
}

/// A request handed to the scheduler.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqRequest {
    /// Its id (unique within the pod).
    pub id: SeqId,
    /// Prompt length in tokens (at least 1).
    pub prompt_len: usize,
    /// Tokens to generate (at least 1).
    pub output_len: usize,
    /// Chained hashes of the full blocks of prompt + output tokens.
    pub block_hashes: Vec<BlockHash>,
    /// Arrival time (simulated seconds).
    pub arrival: f64,
}

/// Why a request is refused outright.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    /// Prompt + output can never fit in the KV capacity.
    TooLong {
        /// Tokens requested (prompt + output).
        requested: usize,
        /// KV capacity in tokens.
        capacity: usize,
    },
    /// Empty prompt or zero output tokens.
    Empty,
}

/// What a request got from one step (or from an instant run).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// The request.
    pub id: SeqId,
    /// Tokens generated so far.
    pub generated: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// Whether the request is done.
    pub finished: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StepRole {
    Idle,
    Prefill(usize),
    Decode,
}

#[derive(Debug)]
struct RunningSeq {
    req: SeqRequest,
    alloc: Allocation,
    cached_tokens: usize,
    /// Prompt tokens whose KV exists (cached + prefilled).
    computed: usize,
    generated: usize,
    role: StepRole,
}

impl RunningSeq {
    fn prompt_blocks(&self, block_size: usize) -> usize {
        (self.req.prompt_len / block_size).min(self.req.block_hashes.len())
    }
}

/// A pod's scheduler, KV-cache and statistics.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    latency: LatencyModel,
    cache: KvCache,
    waiting: VecDeque<SeqRequest>,
    running: Vec<RunningSeq>,
    stats: EngineStats,
    step: Option<f64>,
}

impl Scheduler {
    /// An idle scheduler with an empty cache.
    pub fn new(cfg: SchedulerConfig, latency: LatencyModel) -> Self {
        let cfg = SchedulerConfig {
            max_num_seqs: cfg.max_num_seqs.max(1),
            max_num_batched_tokens: cfg.max_num_batched_tokens.max(1),
            block_size: cfg.block_size.max(1),
            kv_blocks: cfg.kv_blocks,
        };
        Self {
            cfg,
            latency,
            cache: KvCache::new(cfg.kv_blocks, cfg.block_size),
            waiting: VecDeque::new(),
            running: Vec::new(),
            stats: EngineStats::default(),
            step: None,
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> SchedulerConfig {
        self.cfg
    }

    /// The KV-cache.
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Drops unpinned cached blocks.
    pub fn reset_prefix_cache(&mut self) {
        self.cache.reset_unpinned();
    }

    /// Cumulative statistics.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Requests in the running batch.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting for admission.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether nothing is running or waiting.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    fn blocks_needed(&self, req: &SeqRequest) -> usize {
        (req.prompt_len + req.output_len).div_ceil(self.cfg.block_size)
    }

    /// Checks that a request could ever run on this pod.
    pub fn check(&self, prompt_len: usize, output_len: usize) -> Result<(), SubmitError> {
        self.cfg.check(prompt_len, output_len)
    }

    /// Queues a request (FIFO).
    pub fn submit(&mut self, req: SeqRequest) -> Result<(), SubmitError> {
        self.check(req.prompt_len, req.output_len)?;
        self.waiting.push_back(req);
        Ok(())
    }

    /// Tries to allocate the blocks of `req`: returns the allocation and the prompt tokens
    /// served from the cache, or `None` when its blocks do not fit now.
    fn admit(&mut self, req: &SeqRequest) -> Option<(Allocation, usize)> {
        let bs = self.cfg.block_size;
        let prompt_blocks = (req.prompt_len / bs).min(req.block_hashes.len());
        let hashed = &req.block_hashes[..prompt_blocks];
        // Like vLLM, at least one prompt token is always computed.
        let max_hit = (req.prompt_len - 1) / bs;
        let hits = self.cache.leading_hits(hashed, max_hit);
        let alloc = self.cache.allocate(hashed, self.blocks_needed(req)).ok()?;
        Some((alloc, hits * bs))
    }

    /// Plans the next step at simulated time `now`: admits waiting requests that fit
    /// (FIFO, stopping at the first that does not), assigns prefill chunks and decodes
    /// within the token budget. Returns the step's duration, or `None` when there is
    /// nothing to do (or a step is already planned).
    pub fn schedule(&mut self, now: f64) -> Option<f64> {
        if self.step.is_some() {
            return None;
        }
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut work = StepWork::default();
        for r in &mut self.running {
            if r.computed >= r.req.prompt_len {
                if budget == 0 {
                    r.role = StepRole::Idle;
                    continue;
                }
                r.role = StepRole::Decode;
                budget -= 1;
                work.decode_seqs += 1;
                work.decode_context_tokens += r.req.prompt_len + r.generated;
            }
        }
        for r in &mut self.running {
            if r.computed < r.req.prompt_len {
                let chunk = (r.req.prompt_len - r.computed).min(budget);
                budget -= chunk;
                work.prefill_tokens += chunk;
                r.role = if chunk > 0 {
                    StepRole::Prefill(chunk)
                } else {
                    StepRole::Idle
                };
            }
        }
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(head) = self.waiting.pop_front() else {
                break;
            };
            let Some((alloc, cached_tokens)) = self.admit(&head) else {
                // Head-of-line blocking, as in vLLM: nothing behind it may start either.
                self.waiting.push_front(head);
                break;
            };
            self.stats.prefix_queries += head.prompt_len as u64;
            self.stats.prefix_hits += cached_tokens as u64;
            self.stats.queue_time.observe((now - head.arrival).max(0.0));
            let chunk = (head.prompt_len - cached_tokens).min(budget);
            budget -= chunk;
            work.prefill_tokens += chunk;
            self.running.push(RunningSeq {
                req: head,
                alloc,
                cached_tokens,
                computed: cached_tokens,
                generated: 0,
                role: StepRole::Prefill(chunk),
            });
        }
        if work.prefill_tokens == 0 && work.decode_seqs == 0 {
            return None;
        }
        let duration = self.latency.step_time(work);
        self.step = Some(duration);
        Some(duration)
    }

    /// Applies the planned step at its end time `end`: prefill chunks complete (a request
    /// whose prefill completes gets its first token), decoding requests get one token,
    /// finished requests release their blocks (full blocks stay cached). Returns one
    /// [`Progress`] per request that produced a token.
    pub fn complete(&mut self, end: f64) -> Vec<Progress> {
        let Some(step_duration) = self.step.take() else {
            return Vec::new();
        };
        let bs = self.cfg.block_size;
        let mut out = Vec::new();
        let mut any_finished = false;
        for r in &mut self.running {
            let produced = match r.role {
                StepRole::Idle => false,
                StepRole::Prefill(chunk) => {
                    r.computed += chunk;
                    let done = r.prompt_blocks(bs).min(r.computed / bs);
                    self.cache.mark_computed(&r.req.block_hashes[..done]);
                    if r.computed >= r.req.prompt_len {
                        r.generated = 1;
                        self.stats.record_ttft((end - r.req.arrival).max(0.0));
                        self.stats.prompt_tokens += r.req.prompt_len as u64;
                        self.stats.prompt_tokens_cached += r.cached_tokens as u64;
                        true
                    } else {
                        false
                    }
                }
                StepRole::Decode => {
                    r.generated += 1;
                    self.stats.itl.observe(step_duration);
                    true
                }
            };
            r.role = StepRole::Idle;
            if produced {
                self.stats.generation_tokens += 1;
                let finished = r.generated >= r.req.output_len;
                any_finished |= finished;
                out.push(Progress {
                    id: r.req.id,
                    generated: r.generated,
                    cached_tokens: r.cached_tokens,
                    finished,
                });
            }
        }
        if any_finished {
            let mut i = 0;
            while i < self.running.len() {
                if self.running[i].generated >= self.running[i].req.output_len {
                    let r = self.running.remove(i);
                    self.stats
                        .record_finish(FinishReason::Length, Some((end - r.req.arrival).max(0.0)));
                    self.stats.finished_cached_tokens += r.cached_tokens as u64;
                    let pb = r.prompt_blocks(bs);
                    let generated = &r.req.block_hashes[pb..];
                    self.cache.release(r.alloc, generated);
                } else {
                    i += 1;
                }
            }
        }
        out
    }

    /// Removes a request (the client went away). Its computed blocks stay cached.
    /// Returns whether it was known.
    pub fn abort(&mut self, id: SeqId) -> bool {
        if let Some(pos) = self.waiting.iter().position(|r| r.id == id) {
            self.waiting.remove(pos);
            self.stats.record_finish(FinishReason::Abort, None);
            return true;
        }
        if let Some(pos) = self.running.iter().position(|r| r.req.id == id) {
            let r = self.running.remove(pos);
            self.stats.record_finish(FinishReason::Abort, None);
            self.cache.release(r.alloc, &[]);
            return true;
        }
        false
    }

    /// Runs a request to completion at once, bypassing queue and latency (`--no-latency`):
    /// the cache lookup, pinning, caching and statistics are the same as a scheduled run
    /// with zero durations.
    pub fn run_instant(&mut self, req: SeqRequest) -> Result<Progress, SubmitError> {
        self.check(req.prompt_len, req.output_len)?;
        let bs = self.cfg.block_size;
        let Some((alloc, cached_tokens)) = self.admit(&req) else {
            // Blocks are pinned only by scheduled requests; none fit now.
            let requested = req.prompt_len + req.output_len;
            return Err(SubmitError::TooLong {
                requested,
                capacity: self.cfg.kv_blocks * bs,
            });
        };
        let prompt_blocks = (req.prompt_len / bs).min(req.block_hashes.len());
        self.cache.mark_computed(&req.block_hashes[..prompt_blocks]);
        let st = &mut self.stats;
        st.prefix_queries += req.prompt_len as u64;
        st.prefix_hits += cached_tokens as u64;
        st.prompt_tokens += req.prompt_len as u64;
        st.prompt_tokens_cached += cached_tokens as u64;
        st.generation_tokens += req.output_len as u64;
        st.queue_time.observe(0.0);
        st.record_ttft(0.0);
        st.itl
            .observe_n(0.0, req.output_len.saturating_sub(1) as u64);
        st.record_finish(FinishReason::Length, Some(0.0));
        st.finished_cached_tokens += cached_tokens as u64;
        self.cache
            .release(alloc, &req.block_hashes[prompt_blocks..]);
        Ok(Progress {
            id: req.id,
            generated: req.output_len,
            cached_tokens,
            finished: true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::block_hashes;
    use crate::tokenizer::TokenId;

    fn cfg(max_num_seqs: usize, kv_blocks: usize) -> SchedulerConfig {
        SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens: 8192,
            block_size: 16,
            kv_blocks,
        }
    }

    fn req(id: SeqId, prompt: &[TokenId], output_len: usize, arrival: f64) -> SeqRequest {
        let mut all = prompt.to_vec();
        all.extend((0..output_len as u32).map(|i| 0xdead_0000 + i + id as u32 * 1000));
        SeqRequest {
            id,
            prompt_len: prompt.len(),
            output_len,
            block_hashes: block_hashes(&all, 16),
            arrival,
        }
    }

    fn prompt(n: usize, salt: u32) -> Vec<TokenId> {
        (0..n as u32).map(|i| i.wrapping_mul(7919) ^ salt).collect()
    }

    /// Runs steps until idle; returns (end time, progress events).
    fn drain(s: &mut Scheduler, mut now: f64) -> (f64, Vec<(f64, Progress)>) {
        let mut events = Vec::new();
        while let Some(d) = s.schedule(now) {
            now += d;
            events.extend(s.complete(now).into_iter().map(|p| (now, p)));
        }
        (now, events)
    }

    fn ttft(events: &[(f64, Progress)], id: SeqId, arrival: f64) -> f64 {
        events
            .iter()
            .find(|(_, p)| p.id == id && p.generated == 1)
            .map(|(t, _)| t - arrival)
            .expect("first token")
    }

    #[test]
    fn repeated_prompt_hits_and_is_faster() {
        let mut s = Scheduler::new(cfg(8, 1000), LatencyModel::default());
        let p = prompt(1000, 1);
        s.submit(req(1, &p, 4, 0.0)).unwrap();
        let (t, ev) = drain(&mut s, 0.0);
        let cold = ttft(&ev, 1, 0.0);
        assert_eq!(ev.last().map(|(_, p)| p.finished), Some(true));
        s.submit(req(2, &p, 4, t)).unwrap();
        let (_, ev2) = drain(&mut s, t);
        let warm = ttft(&ev2, 2, t);
        assert_eq!(ev2[0].1.cached_tokens, 992); // 62 full blocks; the last token is recomputed
        assert!(warm < cold / 5.0, "warm {warm} cold {cold}");
        assert_eq!(s.stats().prefix_queries, 2000);
        assert_eq!(s.stats().prefix_hits, 992);
        assert_eq!(s.stats().finished(FinishReason::Length), 2);
        assert_eq!(s.stats().generation_tokens, 8);
    }

    #[test]
    fn queueing_under_max_num_seqs() {
        let mut s = Scheduler::new(cfg(2, 1000), LatencyModel::default());
        for id in 0..5 {
            s.submit(req(id, &prompt(64, id as u32 + 10), 10, 0.0))
                .unwrap();
        }
        let d = s.schedule(0.0).unwrap();
        assert_eq!(s.running(), 2);
        assert_eq!(s.waiting(), 3);
        let mut ev: Vec<(f64, Progress)> = s.complete(d).into_iter().map(|p| (d, p)).collect();
        ev.extend(drain(&mut s, d).1);
        assert_eq!((s.running(), s.waiting()), (0, 0));
        // FIFO: later requests get their first token later.
        let t: Vec<f64> = (0..5).map(|id| ttft(&ev, id, 0.0)).collect();
        assert_eq!(t[0], t[1]);
        assert!(t[2] > t[1] && t[4] > t[3] && t[3] >= t[2]);
    }

    #[test]
    fn a_request_waits_until_its_blocks_fit() {
        // 10 blocks: the first request pins 8 (100 prompt + 28 output = 128 tokens).
        let mut s = Scheduler::new(cfg(8, 10), LatencyModel::default());
        s.submit(req(1, &prompt(100, 1), 28, 0.0)).unwrap();
        s.submit(req(2, &prompt(100, 2), 28, 0.0)).unwrap();
        let d = s.schedule(0.0).unwrap();
        assert_eq!((s.running(), s.waiting()), (1, 1));
        assert_eq!(s.cache().used_blocks(), 8);
        s.complete(d);
        let (_, ev) = drain(&mut s, d);
        assert!(ev.iter().any(|(_, p)| p.id == 2 && p.finished));
        // Request 1's cached blocks were evicted (LRU) to make room for request 2.
        assert!(s.cache().evictions() > 0);
    }

    #[test]
    fn longer_queue_means_longer_ttft() {
        let model = LatencyModel::default();
        let mut s = Scheduler::new(cfg(1, 1000), model);
        for id in 0..3 {
            s.submit(req(id, &prompt(200, id as u32), 20, 0.0)).unwrap();
        }
        let (_, ev) = drain(&mut s, 0.0);
        let t0 = ev
            .iter()
            .find(|(_, p)| p.id == 0 && p.generated == 1)
            .unwrap()
            .0;
        let t2 = ev
            .iter()
            .find(|(_, p)| p.id == 2 && p.generated == 1)
            .unwrap()
            .0;
        assert!(t2 > t0 + 2.0 * 19.0 * model.step_overhead_s);
        assert!(s.stats().queue_time.sum() > 0.0);
    }

    #[test]
    fn abort_releases_blocks() {
        let mut s = Scheduler::new(cfg(4, 100), LatencyModel::default());
        s.submit(req(1, &prompt(64, 1), 100, 0.0)).unwrap();
        s.submit(req(2, &prompt(64, 2), 100, 0.0)).unwrap();
        let d = s.schedule(0.0).unwrap();
        s.complete(d);
        let used = s.cache().used_blocks();
        assert!(s.abort(1));
        assert!(!s.abort(1));
        assert!(s.cache().used_blocks() < used);
        assert_eq!(s.stats().finished(FinishReason::Abort), 1);
    }

    #[test]
    fn too_long_is_refused() {
        let mut s = Scheduler::new(cfg(4, 2), LatencyModel::default());
        assert!(matches!(
            s.submit(req(1, &prompt(40, 1), 1, 0.0)),
            Err(SubmitError::TooLong { .. })
        ));
        assert_eq!(s.check(0, 1), Err(SubmitError::Empty));
    }

    #[test]
    fn instant_run_uses_the_cache() {
        let mut s = Scheduler::new(cfg(4, 100), LatencyModel::default());
        let p = prompt(100, 1);
        assert_eq!(s.run_instant(req(1, &p, 16, 0.0)).unwrap().cached_tokens, 0);
        assert_eq!(
            s.run_instant(req(2, &p, 16, 0.0)).unwrap().cached_tokens,
            96
        );
        assert_eq!(s.cache().used_blocks(), 0);
        assert_eq!(s.stats().prefix_hits, 96);
    }

    #[test]
    fn chunked_prefill_spreads_long_prompts() {
        let mut c = cfg(4, 10_000);
        c.max_num_batched_tokens = 512;
        let mut s = Scheduler::new(c, LatencyModel::default());
        s.submit(req(1, &prompt(2000, 1), 2, 0.0)).unwrap();
        let mut steps = 0;
        let mut now = 0.0;
        loop {
            let d = s.schedule(now).unwrap();
            now += d;
            steps += 1;
            if s.complete(now).iter().any(|p| p.generated == 1) {
                break;
            }
        }
        assert_eq!(steps, 4); // 2000 tokens / 512 per step
    }
}
