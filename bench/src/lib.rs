//! kvroute-bench: routing quality (hit rate, TTFT, throughput, balance) of kvroute
//! against other routers on simulated pods, and the in-proxy cost of the filter.
//!
//! The binary (`main.rs`) is a thin CLI over these modules so the pure parts
//! (trace generation, theoretical maximum, percentile math) are unit-testable.

pub mod admin_stats;
pub mod commands;
pub mod engine;
pub mod experiment;
pub mod gateway;
pub mod gateway_cost;
pub mod measure;
pub mod mixed;
pub mod overhead;
pub mod plot;
pub mod pod_metrics;
pub mod procs;
pub mod report;
pub mod router_under_test;
pub mod runner;
pub mod scrape_scale;
pub mod text;
pub mod theory;
pub mod trace;
pub mod workload;
