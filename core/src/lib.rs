//! # kvroute-core
//!
//! Everything kvroute decides, with no proxy-wasm import: the Envoy filter
//! (the root `kvroute` crate) only moves bytes between the host and this
//! crate. Keeping the core host-free means every rule below is unit tested
//! natively and, unchanged, on wasm32 under Node (`wasm-bindgen-test`).
//!
//! Data flow of one request (see `docs/ARCHITECTURE.md`):
//!
//! ```text
//! body bytes --request--> InferenceRequest (model, salt, block hashes)
//!            --prefix::PrefixIndex--> matched blocks per endpoint
//! /metrics text --metrics--> MetricsSnapshot per endpoint
//! candidates (endpoint + snapshot + prefix match + in-flight)
//!            --scheduler (filters -> weighted scorers -> picker)--> Decision
//! Decision --> PrefixIndex::record (learning is an explicit step after the pick)
//! ```
//!
//! Time (`now_ms`) and randomness (a seeded [`fastrand::Rng`]) are always
//! passed in, so tests, the simulator and the filter control them.

pub mod answer;
pub mod cache_trust;
pub mod config;
pub mod decode_speed;
pub mod discovery;
pub mod endpoint;
pub mod engine_slots;
pub mod error_reply;
pub mod float;
pub mod inflight;
mod log_mean;
pub mod metrics;
pub mod models;
pub mod objectives;
pub mod outlier;
pub mod path_policy;
pub mod peer;
pub mod prefix;
pub mod request;
pub mod router;
pub mod saturation;
pub mod scheduler;
pub mod shared;
pub mod slots;
pub mod sorted_lookup;
pub mod stall;
pub mod ttft;
