//! # kvroute: LLM-aware load balancing inside Envoy
//!
//! This crate is the proxy-wasm *shell*: it moves bytes between Envoy and
//! [`kvroute_core`], which holds every rule. One file a concern:
//!
//! - [`root`]: one root context per VM: configuration, the timer tick
//!   (scraper lease, `/metrics` scrapes, syncing the shared view);
//! - [`filter`]: one HTTP context per request: holds the headers, reads the
//!   body, asks the router, hands the chosen endpoint to Envoy;
//! - [`vm_state`]: what a VM knows (router, cached shared view, RNG) and the
//!   routing step that ties the core and the shared store together;
//! - [`peer_sync`], [`peer_server`]: the two sides of sync between gateway
//!   replicas (asking on the tick; answering on the peer listener);
//! - [`shared_store`]: typed, CAS-safe access to proxy-wasm shared data;
//! - [`stats`]: every Envoy stat kvroute exports, defined once.
//!
//! The fail-open choice is made once, in [`filter`]: a request the core cannot
//! understand is still routed, by load alone, and counted.

pub mod filter;
pub mod peer_server;
pub mod peer_sync;
pub mod root;
pub mod shared_store;
pub mod stats;
pub mod vm_state;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| Box::new(root::KvRouteRoot::default()));
}}
