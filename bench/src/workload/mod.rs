//! The workloads: each turns its command-line parameters and a seed into a [`Trace`].
//!
//! One file per workload shape; this module names them and holds their shared
//! parameters so that `matrix`, `run` and `demo` all build traces the same way.

pub mod agentic;
pub mod chat;
pub mod hotspot;
pub mod longqa;
pub mod noreuse;
pub mod pressure;
pub mod saturation;

use serde::Serialize;

use crate::trace::Trace;

/// The workload shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// Multi-turn chat: groups share a system prompt, each turn resends the history.
    Chat,
    /// Agent loop: the context grows by a tool output at each step.
    Agentic,
    /// Long-context QA: a few 20k-100k-token documents, many questions each.
    LongQa,
    /// Hot spot: multi-turn chat where one group is ten times more popular.
    Hotspot,
    /// No reuse: unique prompts (control; no router can hit).
    NoReuse,
    /// Cache pressure (headline): llm-d's benchmark shape, prefixes overflow one pod.
    Pressure,
    /// Saturation: open-loop chat sessions arriving faster than round robin can serve.
    Saturation,
}

impl Workload {
    /// Every workload, in report order.
    pub const ALL: [Workload; 7] = [
        Workload::Pressure,
        Workload::Chat,
        Workload::Agentic,
        Workload::LongQa,
        Workload::Hotspot,
        Workload::NoReuse,
        Workload::Saturation,
    ];

    /// The kebab-case name used on the command line and in results.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Chat => "chat",
            Workload::Agentic => "agentic",
            Workload::LongQa => "long-qa",
            Workload::Hotspot => "hotspot",
            Workload::NoReuse => "no-reuse",
            Workload::Pressure => "pressure",
            Workload::Saturation => "saturation",
        }
    }
}

/// Parameters of every workload (each workload reads its own group).
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct WorkloadArgs {
    /// Seed of the trace (system prompts, questions, order, think times).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub chat: chat::ChatArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub agentic: agentic::AgenticArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub long_qa: longqa::LongQaArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub hotspot: hotspot::HotspotArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub no_reuse: noreuse::NoReuseArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub pressure: pressure::PressureArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub saturation: saturation::SaturationArgs,
}

impl WorkloadArgs {
    /// Builds the trace of `workload` (deterministic in `self.seed` and the parameters).
    pub fn trace(&self, workload: Workload) -> Trace {
        let mut t = match workload {
            Workload::Chat => chat::generate(&self.chat, self.seed),
            Workload::Agentic => agentic::generate(&self.agentic, self.seed),
            Workload::LongQa => longqa::generate(&self.long_qa, self.seed),
            Workload::Hotspot => hotspot::generate(&self.hotspot, &self.chat, self.seed),
            Workload::NoReuse => noreuse::generate(&self.no_reuse, self.seed),
            Workload::Pressure => pressure::generate(&self.pressure, self.seed),
            Workload::Saturation => saturation::generate(&self.saturation, self.seed),
        };
        t.shuffle(crate::text::derive_seed(self.seed, 0x5_4FF1E, 0));
        t
    }
}

/// Think time in simulated ms drawn uniformly in `[mean/2, 3*mean/2]`.
pub(crate) fn think(rng: &mut fastrand::Rng, mean_ms: u64) -> u64 {
    if mean_ms == 0 {
        0
    } else {
        rng.u64(mean_ms / 2..=mean_ms + mean_ms / 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        w: WorkloadArgs,
    }

    fn args(extra: &[&str]) -> WorkloadArgs {
        let mut argv = vec![
            "t",
            "--qa-doc-min-tokens",
            "2000",
            "--qa-doc-max-tokens",
            "4000",
        ];
        argv.extend_from_slice(extra);
        Cli::parse_from(argv).w
    }

    #[test]
    fn traces_are_deterministic_in_the_seed() {
        let a = args(&[]);
        let b = args(&["--seed", "7"]);
        for w in Workload::ALL {
            assert_eq!(a.trace(w), a.trace(w), "{}", w.name());
            assert_ne!(a.trace(w), b.trace(w), "{}", w.name());
            assert_eq!(a.trace(w).name, w.name());
        }
    }

    #[test]
    fn pressure_has_the_llm_d_shape() {
        let t = args(&[]).trace(Workload::Pressure);
        assert_eq!(t.sessions.len(), 150 * 5);
        let groups: std::collections::HashSet<usize> = t.sessions.iter().map(|s| s.group).collect();
        assert_eq!(groups.len(), 150);
        let s = &t.sessions[0];
        assert!((6000..6010).contains(&(s.prefix.len() / 4)));
        assert!((1200..1215).contains(&(s.steps[0].append.len() / 4)));
        // Sessions of one group share the same prefix allocation; text is token-aligned.
        assert!(t
            .sessions
            .iter()
            .all(|x| x.prefix.len() % 4 == 0 && x.steps[0].append.len() % 4 == 0));
        // Groups are interleaved, not in blocks.
        assert_ne!(t.sessions[0].group, t.sessions[1].group);
    }

    #[test]
    fn chat_sessions_share_group_prefixes_and_hotspot_is_hot() {
        let a = args(&[]);
        let t = a.trace(Workload::Chat);
        assert_eq!(t.requests(), 16 * 6 * 4);
        let same: Vec<_> = t.sessions.iter().filter(|s| s.group == 3).collect();
        assert_eq!(same.len(), 6);
        assert!(same.iter().all(|s| s.prefix == same[0].prefix));
        assert!(same
            .iter()
            .all(|s| s.steps[0].think_ms == 0 && s.steps[1].think_ms >= 1000));
        let h = a.trace(Workload::Hotspot);
        let hot = h.sessions.iter().filter(|s| s.group == 0).count();
        assert_eq!(hot, 10 * h.sessions.iter().filter(|s| s.group == 1).count());
    }

    #[test]
    fn footprint_counts_each_prefix_once() {
        let t = args(&["--chat-groups", "2", "--chat-users-per-group", "3"]).trace(Workload::Chat);
        let per_session: usize = t.sessions[0]
            .steps
            .iter()
            .map(|s| s.append.len() / 4 + 100)
            .sum();
        let expect = (2 * (t.sessions[0].prefix.len() / 4 + 1) + 6 * per_session).div_ceil(16);
        assert_eq!(t.footprint_blocks(16), expect);
        assert!(t.max_request_blocks(16) < t.footprint_blocks(16));
    }
}
