//! kvroute: the proxy-wasm shell. STUB.
