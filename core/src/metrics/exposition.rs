//! Prometheus text exposition parser. STUB.
