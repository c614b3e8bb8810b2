//! kvroute's own count of what it has sent each endpoint and not yet seen
//! finish: load between two scrapes, so a burst does not herd on one pod.

use serde::{Deserialize, Serialize};

/// Outstanding work kvroute sent to one endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InFlight {
    /// Requests sent and not finished.
    pub requests: u32,
    /// Uncached prompt tokens sent whose first response chunk has not arrived.
    pub tokens: u64,
}
