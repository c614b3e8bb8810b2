//! Filters: each narrows the candidate set before scoring (one per file).

pub mod affinity;
pub mod health;
pub mod overload;

pub use affinity::AffinityGateFilter;
pub use health::HealthFilter;
pub use overload::OverloadFilter;
