//! kvroute-bench (stub; being written).
fn main() {}
