//! The formats kvroute keeps in proxy-wasm shared data, so that every Envoy
//! worker sees one view: pure encode/decode and merge rules. The filter's
//! shell does the actual get/set (with CAS) around them.

pub mod decision_log;
pub mod deferred;
pub mod endpoint_state;
pub mod lease;
