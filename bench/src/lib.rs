//! kvroute-bench: routing quality (hit rate, TTFT, throughput, balance) of kvroute
//! against other routers on simulated pods, and the in-proxy cost of the filter.
//!
//! The binary (`main.rs`) is a thin CLI over these modules so the pure parts
//! (trace generation, theoretical maximum, percentile math) are unit-testable.

pub mod overhead;
