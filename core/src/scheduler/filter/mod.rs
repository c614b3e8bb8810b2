//! Filters: each narrows the candidate set before scoring (one per file).

pub mod affinity;
pub mod health;

pub use affinity::AffinityGateFilter;
pub use health::HealthFilter;
