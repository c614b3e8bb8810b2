//! Hot spot: multi-turn chat where one group is `factor` times more popular than each
//! other group, so pure affinity would pile that group onto one pod.

use serde::Serialize;

use super::chat::{conversations, ChatArgs};
use crate::trace::Trace;

/// Parameters of the hot-spot workload (turn shape taken from the chat parameters).
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct HotspotArgs {
    /// Hotspot: groups.
    #[arg(long, default_value_t = 8)]
    pub hot_groups: usize,
    /// Hotspot: popularity of group 0 relative to each other group.
    #[arg(long, default_value_t = 10)]
    pub hot_factor: usize,
    /// Hotspot: conversations per ordinary group.
    #[arg(long, default_value_t = 4)]
    pub hot_users_per_group: usize,
}

/// Generates the hot-spot trace (turns, prompt sizes and think time as in `chat`).
pub fn generate(h: &HotspotArgs, chat: &ChatArgs, seed: u64) -> Trace {
    let per_group: Vec<usize> = (0..h.hot_groups)
        .map(|g| {
            if g == 0 {
                h.hot_users_per_group * h.hot_factor
            } else {
                h.hot_users_per_group
            }
        })
        .collect();
    conversations(chat, seed ^ 0x4077, &per_group, "hotspot")
}
