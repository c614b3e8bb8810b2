//! Saturation: an **open-loop** Poisson arrival of multi-turn chat sessions over a
//! modest number of shared system prompts, offered at a rate *above round robin's
//! capacity* and below a cache-aware router's, so the prefill a router saves turns
//! into goodput (or, if it does not save it, into a queue that grows all run long).
//!
//! # Shape (defaults)
//!
//! 300 sessions, each picks one of 12 system prompts of 2000 tokens (session `i` gets
//! group `i mod 12`; sessions are then shuffled with the seed); 5 turns of 2000-token
//! user messages (a pasted file, a log, a document section) with 40-token answers; a
//! think time of 1 s (uniform 0.5-1.5 s) between turns. Every turn resends the whole
//! history, the server's answers included. Sessions start as a Poisson process (the
//! runner's open loop, seeded with `--seed`); the turns of one session follow each
//! other (a turn is sent when the previous answer is in, plus the think time).
//!
//! # Where the arrival rate comes from
//!
//! Not a constant: [`Capacity::of`] derives two fleet capacities (requests per
//! simulated second) from the trace itself, the pods' sizes and the simulator's latency
//! model (`kvroute_sim::latency::LatencyModel::default()`: `t_step` = 6.5 ms a step,
//! `t_tok` = 40 us per batched token, `t_kv` = 40 ns per context token read per
//! decoding sequence; `max_num_batched_tokens` 8192). A saturated pod is busy all the
//! time and its steps are shared by prefills and decodes, so one request of prompt
//! `P`, `u` uncached prompt tokens and `a` output tokens costs it
//!
//! ```text
//! cost = t_tok * u  +  (a - 1) * (t_tok + t_kv * (P + a/2) + t_step / B)
//! ```
//!
//! (prefill of the uncached tokens; then `a - 1` decode steps, each one token of
//! compute, a read of the context, and a `1/B` share of the step's fixed cost). `B`,
//! the decode batch of a saturated pod, is what fits in its KV-cache:
//! `min(max_num_seqs, kv_blocks / mean blocks of a request, max_num_batched_tokens)`,
//! counting every request's blocks as its own (a lower bound on `B`, so an upper bound
//! on the step share; both routers get the same decode cost). The fleet's capacity is
//! `pods / mean cost` over the trace's requests. The two routers differ only in `u`:
//!
//! - **round robin** (its best case): every pod holds every system prompt and keeps
//!   every block it ever computed (unlimited cache); a turn lands on a uniformly random
//!   pod (round robin over interleaved sessions), so turn `k` hits the history as of the
//!   last earlier turn of its session on that pod (`m` turns back with probability
//!   `(1/n)(1-1/n)^(m-1)`), or only the system prompt (probability `(1-1/n)^k`);
//! - **cache-aware** (ideal): a session stays on its pod, so every turn hits all of its
//!   history (prompt + answer of the previous turn) and prefills only the new message;
//!   the fleet's load is balanced.
//!
//! Only full 16-token blocks count, and the last prompt token is always recomputed
//! (vLLM's rule, the sim's too). The session arrival rate is then
//! `--sat-load x round-robin capacity / turns per session` (default 1.3, i.e. 30 % more
//! than round robin can serve even in its best case). With the defaults (4 pods x
//! 26 000 KV blocks, `B` = 51): mean uncached prompt 4404 tokens for round robin and
//! 2015 for cache-aware, decode 19.2 ms a request, so round robin serves at most
//! 20.5 requests/s and cache-aware 40.1 (1.96x); the offered load is 26.6
//! requests/s (5.32 sessions/s), 0.66 of the cache-aware capacity. `--rate` overrides
//! the derived rate. A run prints its own numbers and stores them in the results JSON
//! (`saturation_model`).

use std::sync::Arc;

use kvroute_sim::latency::LatencyModel;
use serde::Serialize;

use crate::text::{derive_seed, pad4, section, words, BYTES_PER_TOKEN};
use crate::trace::{Session, Step, Trace};

/// Parameters of the saturation workload.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct SaturationArgs {
    /// Saturation: sessions (conversations) in the trace.
    #[arg(long, default_value_t = 300)]
    pub sat_sessions: usize,
    /// Saturation: distinct system prompts the sessions share.
    #[arg(long, default_value_t = 12)]
    pub sat_groups: usize,
    /// Saturation: system prompt length, tokens.
    #[arg(long, default_value_t = 2000)]
    pub sat_system_tokens: usize,
    /// Saturation: turns per session.
    #[arg(long, default_value_t = 5)]
    pub sat_turns: usize,
    /// Saturation: user message length, tokens.
    #[arg(long, default_value_t = 2000)]
    pub sat_question_tokens: usize,
    /// Saturation: answer length (max_tokens).
    #[arg(long, default_value_t = 40)]
    pub sat_answer_tokens: u32,
    /// Saturation: mean think time between turns, simulated ms.
    #[arg(long, default_value_t = 1000)]
    pub sat_think_ms: u64,
    /// Saturation: offered load as a multiple of round robin's (best-case) capacity
    /// derived from the sim's latency model; sets the session arrival rate unless
    /// `--rate` is given.
    #[arg(long, default_value_t = 1.3)]
    pub sat_load: f64,
}

/// Generates the saturation trace (the arrival process is the runner's open loop).
pub fn generate(a: &SaturationArgs, seed: u64) -> Trace {
    let groups = a.sat_groups.max(1);
    let systems: Vec<Arc<str>> = (0..groups)
        .map(|g| {
            pad4(format!(
                "SYSTEM: {}",
                words(derive_seed(seed, 0x5A75, g as u64), a.sat_system_tokens)
            ))
            .into()
        })
        .collect();
    let mut rng = fastrand::Rng::with_seed(derive_seed(seed, 0x5A76, 0));
    let sessions = (0..a.sat_sessions)
        .map(|i| {
            let steps = (0..a.sat_turns)
                .map(|t| Step {
                    append: section(
                        "USER",
                        &words(
                            derive_seed(seed, 0x5A77, (i * 1000 + t) as u64),
                            a.sat_question_tokens,
                        ),
                    ) + &section("ASSISTANT", ""),
                    max_tokens: a.sat_answer_tokens,
                    think_ms: if t == 0 {
                        0
                    } else {
                        super::think(&mut rng, a.sat_think_ms)
                    },
                })
                .collect();
            Session {
                id: 0,
                group: i % groups,
                prefix: systems[i % groups].clone(),
                steps,
            }
        })
        .collect();
    Trace {
        name: "saturation".into(),
        sessions,
    }
}

/// What the capacity model needs to know about the fleet.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Fleet {
    /// Pods.
    pub pods: usize,
    /// KV blocks per pod.
    pub kv_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Max running requests per pod.
    pub max_num_seqs: usize,
    /// Token budget of one engine step (the sim's default; the bench does not set it).
    pub max_num_batched_tokens: usize,
    /// Fixed cost of a step, simulated seconds.
    pub step_overhead_s: f64,
    /// Compute per batched token, simulated seconds.
    pub per_token_s: f64,
    /// KV read per context token per decoding sequence, simulated seconds.
    pub kv_read_per_token_s: f64,
}

impl Fleet {
    /// The fleet the bench starts: `kvroute-sim` with its default latency model and
    /// step budget, and these sizes.
    pub fn sim_defaults(
        pods: usize,
        kv_blocks: usize,
        block_size: usize,
        max_num_seqs: usize,
    ) -> Self {
        let m = LatencyModel::default();
        Fleet {
            pods: pods.max(1),
            kv_blocks,
            block_size: block_size.max(1),
            max_num_seqs: max_num_seqs.max(1),
            max_num_batched_tokens: kvroute_sim::SimConfig::default().max_num_batched_tokens,
            step_overhead_s: m.step_overhead_s,
            per_token_s: m.per_token_s,
            kv_read_per_token_s: m.kv_read_per_token_s,
        }
    }
}

/// The derived capacities of a fleet on a trace, and the arrival rate they set.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Capacity {
    /// The fleet the model was computed for.
    pub fleet: Fleet,
    /// Decode batch of a saturated pod (what fits in its KV-cache).
    pub decode_batch: f64,
    /// Mean uncached prompt tokens per request, round robin (best case).
    pub round_robin_uncached: f64,
    /// Mean uncached prompt tokens per request, cache-aware (ideal).
    pub cache_aware_uncached: f64,
    /// Mean decode cost per request, simulated seconds.
    pub decode_s: f64,
    /// Requests per simulated second the fleet serves under round robin (best case).
    pub round_robin_rps: f64,
    /// Requests per simulated second under an ideal cache-aware router.
    pub cache_aware_rps: f64,
    /// Offered load: requests per simulated second (`--sat-load` x round robin's).
    pub offered_rps: f64,
    /// Session arrivals per simulated second (offered load / turns per session).
    pub session_rate: f64,
}

impl Capacity {
    /// The capacity model of the module documentation, over `trace`'s requests
    /// (answers of `max_tokens` tokens each), and the session rate for `load`.
    pub fn of(trace: &Trace, fleet: Fleet, load: f64) -> Self {
        let bs = fleet.block_size;
        let n = fleet.pods as f64;
        let miss = 1.0 - 1.0 / n;
        // Only whole blocks are cached; the last prompt token is always computed.
        let cached = |held: usize, prompt: usize| (held / bs).min((prompt - 1) / bs) * bs;
        struct Req {
            prompt: usize,
            answer: usize,
            rr: f64,
            ca: f64,
        }
        let mut reqs = Vec::new();
        for s in &trace.sessions {
            // The sim's tokens: BOS + one per 4 bytes.
            let system = 1 + s.prefix.len() / BYTES_PER_TOKEN;
            let mut prompt = system;
            // Tokens held after turn j (prompt + answer), most recent last.
            let mut held: Vec<usize> = Vec::new();
            for step in &s.steps {
                prompt += step.append.len() / BYTES_PER_TOKEN;
                let answer = step.max_tokens.max(1) as usize;
                let k = held.len();
                let unc = |h: usize| (prompt - cached(h, prompt)) as f64;
                let mut rr = miss.powi(k as i32) * unc(system);
                for m in 1..=k {
                    rr += (1.0 / n) * miss.powi(m as i32 - 1) * unc(held[k - m]);
                }
                let ca = unc(held.last().copied().unwrap_or(system));
                reqs.push(Req {
                    prompt,
                    answer,
                    rr,
                    ca,
                });
                held.push(prompt + answer);
                prompt += answer;
            }
        }
        let count = reqs.len().max(1) as f64;
        let mean_blocks = reqs
            .iter()
            .map(|r| (r.prompt + r.answer).div_ceil(bs) as f64)
            .sum::<f64>()
            / count;
        let decode_batch = (fleet.kv_blocks as f64 / mean_blocks.max(1.0))
            .min(fleet.max_num_seqs as f64)
            .min(fleet.max_num_batched_tokens as f64)
            .max(1.0);
        let decode = |r: &Req| {
            (r.answer - 1) as f64
                * (fleet.per_token_s
                    + fleet.kv_read_per_token_s * (r.prompt as f64 + r.answer as f64 / 2.0)
                    + fleet.step_overhead_s / decode_batch)
        };
        let mean = |f: &dyn Fn(&Req) -> f64| reqs.iter().map(f).sum::<f64>() / count;
        let decode_s = mean(&decode);
        let rr_cost = mean(&|r: &Req| fleet.per_token_s * r.rr + decode(r));
        let ca_cost = mean(&|r: &Req| fleet.per_token_s * r.ca + decode(r));
        let round_robin_rps = n / rr_cost.max(1e-12);
        let offered_rps = load * round_robin_rps;
        let per_session = count / trace.sessions.len().max(1) as f64;
        Capacity {
            fleet,
            decode_batch,
            round_robin_uncached: mean(&|r: &Req| r.rr),
            cache_aware_uncached: mean(&|r: &Req| r.ca),
            decode_s,
            round_robin_rps,
            cache_aware_rps: n / ca_cost.max(1e-12),
            offered_rps,
            session_rate: offered_rps / per_session,
        }
    }

    /// One line for the terminal.
    pub fn summary(&self) -> String {
        format!(
            "capacity model ({} pods x {} KV blocks, decode batch {:.0}): uncached prompt {:.0} tokens/request \
             round robin (best case) vs {:.0} cache-aware, decode {:.1} ms/request -> round robin <= {:.1} req/s, \
             cache-aware ~{:.1} req/s; offered {:.1} req/s ({:.2} sessions/s, {:.2}x cache-aware capacity)",
            self.fleet.pods,
            self.fleet.kv_blocks,
            self.decode_batch,
            self.round_robin_uncached,
            self.cache_aware_uncached,
            self.decode_s * 1000.0,
            self.round_robin_rps,
            self.cache_aware_rps,
            self.offered_rps,
            self.session_rate,
            self.offered_rps / self.cache_aware_rps.max(1e-12)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: SaturationArgs,
    }

    fn args(extra: &[&str]) -> SaturationArgs {
        let mut argv = vec!["t"];
        argv.extend_from_slice(extra);
        Cli::parse_from(argv).a
    }

    #[test]
    fn sessions_share_a_few_system_prompts() {
        let a = args(&[]);
        let t = generate(&a, 1);
        assert_eq!(t.sessions.len(), 300);
        assert_eq!(t.requests(), 300 * 5);
        let g3: Vec<_> = t.sessions.iter().filter(|s| s.group == 3).collect();
        assert_eq!(g3.len(), 25);
        assert!(g3.iter().all(|s| s.prefix == g3[0].prefix));
        assert_ne!(t.sessions[0].prefix, t.sessions[1].prefix);
        assert!(t
            .sessions
            .iter()
            .all(|s| s.prefix.len() % 4 == 0 && s.steps.iter().all(|x| x.append.len() % 4 == 0)));
        assert_eq!(generate(&a, 1), t);
        assert_ne!(generate(&a, 2), t);
    }

    #[test]
    fn round_robin_saturates_where_cache_aware_keeps_up() {
        let a = args(&[]);
        let t = generate(&a, 42);
        let c = Capacity::of(&t, Fleet::sim_defaults(4, 26_000, 16, 256), a.sat_load);
        // The numbers quoted in the module documentation and bench/README.md.
        assert!((c.round_robin_rps - 20.5).abs() < 0.1, "{}", c.summary());
        assert!((c.cache_aware_rps - 40.1).abs() < 0.1, "{}", c.summary());
        assert!((c.decode_batch - 51.0).abs() < 0.5, "{}", c.summary());
        assert!(c.offered_rps > c.round_robin_rps && c.offered_rps < 0.8 * c.cache_aware_rps);
        assert!((c.session_rate * 5.0 - c.offered_rps).abs() < 1e-9);
        // One pod: nothing to choose, round robin is cache-aware.
        let one = Capacity::of(&t, Fleet::sim_defaults(1, 26_000, 16, 256), 1.0);
        assert!((one.round_robin_rps - one.cache_aware_rps).abs() < 1e-9);
    }

    #[test]
    fn uncached_tokens_follow_the_history() {
        // One session, 2 turns, 2 pods: turn 2 hits its history with probability 1/2.
        let a = args(&[
            "--sat-sessions",
            "1",
            "--sat-turns",
            "2",
            "--sat-system-tokens",
            "159",
            "--sat-question-tokens",
            "154",
            "--sat-answer-tokens",
            "32",
        ]);
        let t = generate(&a, 0);
        let p1 = 1 + (t.sessions[0].prefix.len() + t.sessions[0].steps[0].append.len()) / 4;
        let system = 1 + t.sessions[0].prefix.len() / 4;
        assert_eq!(system, 1 + 2 + 159); // BOS, "SYSTEM: ", 159 words
        let c = Capacity::of(&t, Fleet::sim_defaults(2, 1000, 16, 256), 1.0);
        let p2 = p1 + 32 + t.sessions[0].steps[1].append.len() / 4;
        let sys_hit = (system / 16) * 16;
        let hist_hit = ((p1 + 32) / 16) * 16;
        let ca = ((p1 - sys_hit) + (p2 - hist_hit)) as f64 / 2.0;
        let rr =
            ((p1 - sys_hit) as f64 + 0.5 * (p2 - hist_hit) as f64 + 0.5 * (p2 - sys_hit) as f64)
                / 2.0;
        assert!((c.cache_aware_uncached - ca).abs() < 1e-9);
        assert!((c.round_robin_uncached - rr).abs() < 1e-9);
    }
}
