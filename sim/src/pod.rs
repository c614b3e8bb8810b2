//! One simulated model server: its scheduler and cache behind a lock, the async engine
//! loop that advances simulated time, its fault switches and its up/down state.
//!
//! The HTTP layer (`server.rs`) and the control server only talk to a [`Pod`]; the
//! engine loop is the only place that sleeps on the latency model.

use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::http::HeaderValue;
use fnv::FnvHashMap;
use serde::Serialize;
use tokio::sync::{mpsc, watch, Notify};

use crate::cli::{EngineFlavor, SimConfig};
use crate::faults::{metrics_padding, FaultUpdate, Faults, METRICS_GARBAGE, PHANTOM_REQUEST_SECS};
use crate::kv_cache::block_hashes;
use crate::lora::{LoraConfig, LoraLease, LoraSlots};
use crate::metrics::{render_llamacpp, render_sglang, render_vllm, MetricsSnapshot};
use crate::openai::InferenceRequest;
use crate::scheduler::{Progress, Scheduler, SchedulerConfig, SeqId, SeqRequest, SubmitError};
use crate::sim_clock::SimClock;
use crate::synthetic_output::{pick_pieces, piece_tokens};

/// Why an inference request was not run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InferError {
    /// The `error_rate` fault fired: answer this status (`error_status`).
    Injected(u16),
    /// The request can never fit (too long) or is empty.
    Rejected(SubmitError),
    /// With `--lora-adapters`: the model is neither the pod's nor one of its adapters.
    UnknownModel(String),
}

struct EngineState {
    sched: Scheduler,
    senders: FnvHashMap<SeqId, mpsc::UnboundedSender<Progress>>,
    /// Simulated start time of the step in flight, while the engine is busy. Arrivals are
    /// stamped no later than this, so when the engine runs behind the wall clock (CPU
    /// saturated) simulated latencies stay consistent instead of going negative.
    busy_since: Option<f64>,
}

struct FaultState {
    faults: Faults,
    rng: fastrand::Rng,
}

/// One simulated model server.
pub struct Pod {
    index: usize,
    cfg: Arc<SimConfig>,
    sched_cfg: SchedulerConfig,
    clock: SimClock,
    engine: Mutex<EngineState>,
    wake: Notify,
    faults: Mutex<FaultState>,
    next_id: AtomicU64,
    delayed: AtomicUsize,
    served: AtomicU64,
    failed: AtomicU64,
    metrics_requests: AtomicU64,
    down: watch::Sender<bool>,
    down_generation: AtomicU64,
    port: AtomicU16,
    header: HeaderValue,
    created_unix: f64,
    lora: LoraSlots,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock would be a bug; keep serving with the state as is.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Decrements a counter when dropped (a request leaving a fault delay).
struct CountGuard<'a>(&'a AtomicUsize);

impl Drop for CountGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Aborts a scheduled request if its consumer goes away before it finishes.
struct AbortGuard {
    pod: Arc<Pod>,
    id: SeqId,
    done: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.done {
            self.pod.abort(self.id);
        }
    }
}

enum Source {
    Ready(Option<Progress>),
    Live {
        rx: mpsc::UnboundedReceiver<Progress>,
        guard: AbortGuard,
    },
}

/// A request being generated: yields [`Progress`] as tokens are produced.
pub struct Generation {
    /// Prompt tokens.
    pub prompt_len: usize,
    /// The synthetic output, one piece per token (see `synthetic_output`).
    pub pieces: Vec<u8>,
    /// The request id within the pod.
    pub id: SeqId,
    source: Source,
    /// The adapter slot the request runs with (released when it is dropped).
    lora: Option<LoraLease>,
}

impl Generation {
    /// The LoRA adapter the request runs with, if any.
    pub fn adapter(&self) -> Option<&str> {
        self.lora.as_ref().map(LoraLease::name)
    }

    /// The next progress report; `None` once finished (or if the pod dropped it).
    pub async fn next(&mut self) -> Option<Progress> {
        let p = match &mut self.source {
            Source::Ready(p) => p.take(),
            Source::Live { rx, guard } => {
                if guard.done {
                    None
                } else {
                    let p = rx.recv().await;
                    if let Some(p) = &p {
                        if p.finished {
                            guard.done = true;
                            guard.pod.served.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    p
                }
            }
        };
        p
    }
}

/// The JSON of `GET /sim/state` (and one entry of the control server's `GET /pods`).
#[derive(Debug, Clone, Serialize)]
pub struct PodState {
    /// Pod index.
    pub pod: usize,
    /// Listening port.
    pub port: u16,
    /// `vllm` or `sglang`.
    pub engine: &'static str,
    /// Served model name.
    pub model: String,
    /// Whether the pod accepts connections.
    pub up: bool,
    /// Inference requests answered successfully.
    pub requests_served: u64,
    /// Inference requests answered `error_status` by the `error_rate` fault.
    pub requests_failed: u64,
    /// `GET /metrics` requests received (garbage or delayed ones included).
    pub metrics_requests: u64,
    /// Requests in the running batch.
    pub running: usize,
    /// Waiting requests as reported in `/metrics` (queue + fault-delayed + phantom).
    pub waiting: usize,
    /// Of `waiting`, phantom requests from `queue_inflate`.
    pub phantom_waiting: usize,
    /// KV blocks held by running requests.
    pub kv_blocks_used: usize,
    /// KV blocks holding cached prefixes (pinned or not).
    pub kv_blocks_cached: usize,
    /// KV capacity in blocks.
    pub kv_blocks_capacity: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Prefix-cache queries, in tokens.
    pub prefix_cache_query_tokens: u64,
    /// Prefix-cache hits, in tokens.
    pub prefix_cache_hit_tokens: u64,
    /// The fault switches.
    pub faults: Faults,
}

impl Pod {
    /// A pod with an empty cache. Call [`Pod::start_engine`] inside a runtime.
    pub fn new(index: usize, cfg: Arc<SimConfig>) -> Arc<Self> {
        let sched_cfg = SchedulerConfig {
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            block_size: cfg.block_size,
            kv_blocks: cfg.kv_blocks,
        };
        let seed = cfg.seed;
        Arc::new(Self {
            index,
            sched_cfg,
            clock: SimClock::new(cfg.time_scale),
            engine: Mutex::new(EngineState {
                sched: Scheduler::new(sched_cfg, cfg.latency_of(index)),
                senders: FnvHashMap::default(),
                busy_since: None,
            }),
            wake: Notify::new(),
            faults: Mutex::new(FaultState {
                faults: Faults::default(),
                rng: fastrand::Rng::with_seed(
                    seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                ),
            }),
            next_id: AtomicU64::new(0),
            delayed: AtomicUsize::new(0),
            served: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            metrics_requests: AtomicU64::new(0),
            down: watch::Sender::new(false),
            down_generation: AtomicU64::new(0),
            port: AtomicU16::new(0),
            header: HeaderValue::from(index),
            created_unix: unix_now(),
            lora: LoraSlots::new(LoraConfig {
                adapters: cfg.lora_adapters.clone(),
                max_loras: cfg.max_loras,
                load: SimClock::new(cfg.time_scale).wall(cfg.lora_load_s),
            }),
            cfg,
        })
    }

    /// Pod index.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The configuration.
    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    /// The value of the `x-kvroute-sim-pod` header.
    pub fn header_value(&self) -> HeaderValue {
        self.header.clone()
    }

    /// Records the port the pod listens on.
    pub fn set_port(&self, port: u16) {
        self.port.store(port, Ordering::Relaxed);
    }

    /// The port the pod listens on.
    pub fn port(&self) -> u16 {
        self.port.load(Ordering::Relaxed)
    }

    /// Starts the engine loop (not needed with `--no-latency`).
    pub fn start_engine(self: &Arc<Self>) {
        if !self.cfg.no_latency {
            tokio::spawn(run_engine(Arc::clone(self)));
        }
    }

    /// A fresh request id.
    pub fn next_request_id(&self) -> SeqId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Runs an inference request: applies faults, then queues it (or, with
    /// `--no-latency`, runs it at once).
    pub async fn infer(self: &Arc<Self>, req: InferenceRequest) -> Result<Generation, InferError> {
        let (fail, extra_ms, phantoms, caching) = {
            let mut f = lock(&self.faults);
            let rate = f.faults.error_rate;
            let fail = (rate > 0.0 && f.rng.f64() < rate).then_some(f.faults.error_status);
            let caching = !(self.cfg.no_prefix_caching || f.faults.no_prefix_caching);
            (
                fail,
                f.faults.extra_latency_ms,
                f.faults.queue_inflate,
                caching,
            )
        };
        if let Some(status) = fail {
            self.failed.fetch_add(1, Ordering::Relaxed);
            return Err(InferError::Injected(status));
        }
        let prompt_len = req.prompt_tokens.len();
        self.sched_cfg
            .check(prompt_len, req.max_tokens)
            .map_err(InferError::Rejected)?;
        // An adapter request waits for its adapter (loaded, a slot free).
        let lora = match req.model.as_deref() {
            Some(m) if self.lora.enabled() && m != self.cfg.model => {
                if !self.lora.serves(m) {
                    return Err(InferError::UnknownModel(m.to_owned()));
                }
                Some(self.lora.acquire(m).await)
            }
            _ => None,
        };
        let delay = Duration::from_millis(extra_ms)
            + self.clock.wall(phantoms as f64 * PHANTOM_REQUEST_SECS);
        if !delay.is_zero() {
            self.delayed.fetch_add(1, Ordering::Relaxed);
            let _g = CountGuard(&self.delayed);
            tokio::time::sleep(delay).await;
        }
        let pieces = pick_pieces(self.cfg.seed, &req.prompt_tokens, req.max_tokens);
        let mut all = req.prompt_tokens;
        all.extend(piece_tokens(&pieces));
        let mut hashes = block_hashes(&all, self.sched_cfg.block_size);
        let id = self.next_request_id();
        if !caching {
            // Blocks of this request alone: no other request can hit them.
            let salt = fastrand::Rng::with_seed(id ^ self.cfg.seed.rotate_left(32)).u64(..);
            for h in &mut hashes {
                *h ^= salt;
            }
        }
        let seq = SeqRequest {
            id,
            prompt_len,
            output_len: pieces.len(),
            block_hashes: hashes,
            arrival: self.clock.now(),
        };
        if self.cfg.no_latency {
            let p = lock(&self.engine)
                .sched
                .run_instant(seq)
                .map_err(InferError::Rejected)?;
            self.served.fetch_add(1, Ordering::Relaxed);
            return Ok(Generation {
                prompt_len,
                pieces,
                id,
                source: Source::Ready(Some(p)),
                lora,
            });
        }
        let (tx, rx) = mpsc::unbounded_channel();
        {
            let mut e = lock(&self.engine);
            let mut seq = seq;
            if let Some(t) = e.busy_since {
                seq.arrival = seq.arrival.min(t);
            }
            e.sched.submit(seq).map_err(InferError::Rejected)?;
            e.senders.insert(id, tx);
        }
        self.wake.notify_one();
        Ok(Generation {
            prompt_len,
            pieces,
            id,
            source: Source::Live {
                rx,
                guard: AbortGuard {
                    pod: Arc::clone(self),
                    id,
                    done: false,
                },
            },
            lora,
        })
    }

    /// Drops a request (its client went away).
    pub fn abort(&self, id: SeqId) {
        {
            let mut e = lock(&self.engine);
            e.sched.abort(id);
            e.senders.remove(&id);
        }
        self.wake.notify_one();
    }

    /// Drops the unpinned cached blocks (`POST /reset_prefix_cache`).
    pub fn reset_prefix_cache(&self) {
        lock(&self.engine).sched.reset_prefix_cache();
    }

    fn snapshot(&self) -> (MetricsSnapshot, usize) {
        let phantoms = lock(&self.faults).faults.queue_inflate as usize;
        let delayed = self.delayed.load(Ordering::Relaxed);
        let e = lock(&self.engine);
        let s = &e.sched;
        (
            MetricsSnapshot {
                running: s.running(),
                waiting: s.waiting() + delayed + phantoms,
                kv_blocks_used: s.cache().used_blocks(),
                kv_blocks_capacity: s.cache().capacity(),
                block_size: s.cache().block_size(),
                stats: s.stats().clone(),
            },
            s.cache().cached_blocks(),
        )
    }

    /// Whether `/metrics` must answer 500 (the `metrics_error` fault).
    pub fn metrics_failing(&self) -> bool {
        lock(&self.faults).faults.metrics_error
    }

    /// The `/metrics` body, honouring the `metrics_delay_ms`, `metrics_garbage` and
    /// `metrics_pad_bytes` faults.
    pub async fn metrics_text(&self) -> String {
        self.metrics_requests.fetch_add(1, Ordering::Relaxed);
        let (delay, garbage, pad) = {
            let f = &lock(&self.faults).faults;
            (f.metrics_delay_ms, f.metrics_garbage, f.metrics_pad_bytes)
        };
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if garbage {
            return METRICS_GARBAGE.to_owned();
        }
        let (snap, _) = self.snapshot();
        let mut text = match self.cfg.engine {
            EngineFlavor::Vllm => {
                let mut text = render_vllm(&snap, &self.cfg.model, self.created_unix);
                text.push_str(&self.lora.render(unix_now()));
                text
            }
            EngineFlavor::Sglang => render_sglang(&snap, &self.cfg.model),
            EngineFlavor::Llamacpp => render_llamacpp(&snap),
        };
        if pad > 0 {
            text.push_str(&metrics_padding(pad));
        }
        text
    }

    /// The pod's state for `/sim/state` and `/pods`.
    pub fn state(&self) -> PodState {
        let (snap, cached) = self.snapshot();
        let faults = lock(&self.faults).faults.clone();
        PodState {
            pod: self.index,
            port: self.port(),
            engine: self.cfg.engine.as_str(),
            model: self.cfg.model.clone(),
            up: !*self.down.borrow(),
            requests_served: self.served.load(Ordering::Relaxed),
            requests_failed: self.failed.load(Ordering::Relaxed),
            metrics_requests: self.metrics_requests.load(Ordering::Relaxed),
            running: snap.running,
            waiting: snap.waiting,
            phantom_waiting: faults.queue_inflate as usize,
            kv_blocks_used: snap.kv_blocks_used,
            kv_blocks_cached: cached,
            kv_blocks_capacity: snap.kv_blocks_capacity,
            block_size: snap.block_size,
            prefix_cache_query_tokens: snap.stats.prefix_queries,
            prefix_cache_hit_tokens: snap.stats.prefix_hits,
            faults,
        }
    }

    /// Applies a fault update: switches, then `down` / `down_ms`.
    pub fn apply_faults(self: &Arc<Self>, u: &FaultUpdate) {
        u.apply(&mut lock(&self.faults).faults);
        if let Some(ms) = u.down_ms {
            self.down_for(Duration::from_millis(ms));
        } else if let Some(down) = u.down {
            self.set_down(down);
        }
    }

    /// Clears all fault switches and brings the pod up.
    pub fn reset_faults(&self) {
        lock(&self.faults).faults = Faults::default();
        self.set_down(false);
    }

    /// Takes the pod down (refusing connections) or brings it up, cancelling a pending
    /// `down_ms` timer.
    pub fn set_down(&self, down: bool) {
        self.down_generation.fetch_add(1, Ordering::SeqCst);
        self.down.send_replace(down);
    }

    /// Takes the pod down for `d`, then brings it back.
    pub fn down_for(self: &Arc<Self>, d: Duration) {
        let generation = self.down_generation.fetch_add(1, Ordering::SeqCst) + 1;
        self.down.send_replace(true);
        let pod = Arc::clone(self);
        tokio::spawn(async move {
            tokio::time::sleep(d).await;
            if pod.down_generation.load(Ordering::SeqCst) == generation {
                pod.down.send_replace(false);
            }
        });
    }

    /// Whether the pod is down.
    pub fn is_down(&self) -> bool {
        *self.down.borrow()
    }

    /// Watches the up/down state (`true` = down).
    pub fn subscribe_down(&self) -> watch::Receiver<bool> {
        self.down.subscribe()
    }
}

/// The engine loop: plans a step, sleeps until its simulated end, applies it, repeats;
/// waits for work when idle. Simulated time advances step by step while busy (so coarse
/// timers only make delivery bursty, not slower) and jumps to the wall clock when idle.
async fn run_engine(pod: Arc<Pod>) {
    let mut cursor = 0.0f64;
    let mut idle = true;
    loop {
        let planned = {
            let mut e = lock(&pod.engine);
            if idle {
                cursor = cursor.max(pod.clock.now());
            }
            let planned = e.sched.schedule(cursor);
            e.busy_since = planned.map(|_| cursor);
            planned
        };
        let Some(duration) = planned else {
            idle = true;
            pod.wake.notified().await;
            continue;
        };
        idle = false;
        let end = cursor + duration;
        let target = pod.clock.instant_at(end);
        if target > Instant::now() {
            tokio::time::sleep_until(target.into()).await;
        } else {
            tokio::task::yield_now().await;
        }
        {
            let mut e = lock(&pod.engine);
            let events = e.sched.complete(end);
            for p in events {
                if let Some(tx) = e.senders.get(&p.id) {
                    let _ = tx.send(p);
                }
                if p.finished {
                    e.senders.remove(&p.id);
                }
            }
        }
        cursor = end;
    }
}
