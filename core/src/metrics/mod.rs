//! Load awareness: Prometheus text from an endpoint's `/metrics` becomes a
//! [`MetricsSnapshot`]. STUB: contract only.

pub mod exposition;
pub mod profile;
pub mod snapshot;

pub use snapshot::MetricsSnapshot;

use crate::config::MetricsConfig;

/// Why a scrape could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricsError(pub String);

/// Reads a scrape into a snapshot with the configured engine profile.
pub fn read_snapshot(_text: &str, _cfg: &MetricsConfig) -> Result<MetricsSnapshot, MetricsError> {
    Err(MetricsError("stub".into()))
}
