//! Engine metric-name profiles. STUB.
