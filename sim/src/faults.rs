//! Run-time fault switches of one pod, for the team's integration tests.
//!
//! A router must survive slow, failing, lying and vanishing backends; these switches make
//! a pod do each on demand. A fault update is a JSON object whose fields are all optional
//! and each present field replaces that switch's value (unknown fields are rejected so a
//! typo fails loudly). Durations in faults are wall-clock milliseconds, not scaled by
//! `--time-scale`, except the phantom queue of `queue_inflate` (see [`PHANTOM_REQUEST_SECS`]).

use serde::{Deserialize, Serialize};

/// Simulated seconds one phantom request of `queue_inflate` delays each new request:
/// about the time the default latency model needs for one step prefilling ~470 tokens.
pub const PHANTOM_REQUEST_SECS: f64 = 0.025;

/// The fault state of a pod. The default is healthy (every switch zero or
/// off; `error_status` only matters with an `error_rate`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Faults {
    /// Wall milliseconds added before each inference request is queued (so before its
    /// first token).
    pub extra_latency_ms: u64,
    /// Fraction (0..=1) of inference requests answered with HTTP
    /// `error_status` at once, unqueued.
    pub error_rate: f64,
    /// The status of those answers: 500 (the default, a broken engine), or
    /// e.g. 429 or 503 (an engine that refuses work while overloaded, as
    /// TGI does past `--max-concurrent-requests`).
    pub error_status: u16,
    /// Wall milliseconds each `/metrics` response is delayed.
    pub metrics_delay_ms: u64,
    /// Whether `/metrics` returns junk instead of Prometheus text.
    pub metrics_garbage: bool,
    /// Whether `/metrics` answers HTTP 500 (after `metrics_delay_ms`).
    pub metrics_error: bool,
    /// Bytes of Prometheus comment lines appended to each `/metrics` body (a
    /// broken or hostile server whose body is huge; 0: none).
    pub metrics_pad_bytes: u64,
    /// Phantom requests: reported as waiting in the metrics and delaying each new
    /// inference request by `queue_inflate x PHANTOM_REQUEST_SECS` simulated seconds.
    pub queue_inflate: u64,
    /// Whether the pod keeps no prompt for another request: an engine with
    /// prefix caching off (vLLM's `--no-enable-prefix-caching`), whose
    /// hit counter stays at 0.
    pub no_prefix_caching: bool,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            extra_latency_ms: 0,
            error_rate: 0.0,
            error_status: 500,
            metrics_delay_ms: 0,
            metrics_garbage: false,
            metrics_error: false,
            metrics_pad_bytes: 0,
            queue_inflate: 0,
            no_prefix_caching: false,
        }
    }
}

impl Faults {
    /// Whether any switch is on.
    pub fn any(&self) -> bool {
        let healthy = Faults::default();
        // The status of error_rate's answers is not a switch of its own.
        let switches = Faults {
            error_status: healthy.error_status,
            ..self.clone()
        };
        switches != healthy
    }
}

/// A partial update of [`Faults`] as posted to `/sim/fault` (and, with `down`, to the
/// control port's `/pods/{i}/fault`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultUpdate {
    /// See [`Faults::extra_latency_ms`].
    pub extra_latency_ms: Option<u64>,
    /// See [`Faults::error_rate`]; must be within 0..=1.
    pub error_rate: Option<f64>,
    /// See [`Faults::error_status`]; must be within 400..=599.
    pub error_status: Option<u16>,
    /// See [`Faults::metrics_delay_ms`].
    pub metrics_delay_ms: Option<u64>,
    /// See [`Faults::metrics_garbage`].
    pub metrics_garbage: Option<bool>,
    /// See [`Faults::metrics_error`].
    pub metrics_error: Option<bool>,
    /// See [`Faults::metrics_pad_bytes`]; at most [`MAX_METRICS_PAD_BYTES`].
    pub metrics_pad_bytes: Option<u64>,
    /// See [`Faults::queue_inflate`].
    pub queue_inflate: Option<u64>,
    /// See [`Faults::no_prefix_caching`].
    pub no_prefix_caching: Option<bool>,
    /// Take the pod down (refuse connections) for this many wall milliseconds, then
    /// bring it back by itself.
    pub down_ms: Option<u64>,
    /// Take the pod down (`true`) until told otherwise, or bring it back (`false`).
    pub down: Option<bool>,
}

impl FaultUpdate {
    /// Parses and validates an update.
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        let body = if body.iter().all(u8::is_ascii_whitespace) {
            b"{}".as_slice()
        } else {
            body
        };
        let u: FaultUpdate =
            serde_json::from_slice(body).map_err(|e| format!("invalid fault JSON: {e}"))?;
        if let Some(r) = u.error_rate {
            if !(0.0..=1.0).contains(&r) {
                return Err(format!("error_rate must be within 0..1, got {r}"));
            }
        }
        if let Some(s) = u.error_status {
            if !(400..=599).contains(&s) {
                return Err(format!("error_status must be within 400..=599, got {s}"));
            }
        }
        if let Some(n) = u.metrics_pad_bytes {
            if n > MAX_METRICS_PAD_BYTES {
                return Err(format!(
                    "metrics_pad_bytes must be at most {MAX_METRICS_PAD_BYTES}, got {n}"
                ));
            }
        }
        Ok(u)
    }

    /// Applies the switch fields (not `down`/`down_ms`, which the pod handles).
    pub fn apply(&self, f: &mut Faults) {
        if let Some(v) = self.extra_latency_ms {
            f.extra_latency_ms = v;
        }
        if let Some(v) = self.error_rate {
            f.error_rate = v;
        }
        if let Some(v) = self.error_status {
            f.error_status = v;
        }
        if let Some(v) = self.metrics_delay_ms {
            f.metrics_delay_ms = v;
        }
        if let Some(v) = self.metrics_garbage {
            f.metrics_garbage = v;
        }
        if let Some(v) = self.metrics_error {
            f.metrics_error = v;
        }
        if let Some(v) = self.metrics_pad_bytes {
            f.metrics_pad_bytes = v;
        }
        if let Some(v) = self.queue_inflate {
            f.queue_inflate = v;
        }
        if let Some(v) = self.no_prefix_caching {
            f.no_prefix_caching = v;
        }
    }
}

/// The largest `metrics_pad_bytes` (256 MiB).
pub const MAX_METRICS_PAD_BYTES: u64 = 256 << 20;

/// `bytes` of Prometheus comment lines (valid text a parser skips).
pub fn metrics_padding(bytes: u64) -> String {
    const LINE: &str = "# padding: a comment line a Prometheus parser skips ............\n";
    let n = usize::try_from(bytes).unwrap_or(usize::MAX);
    let mut pad = LINE.repeat(n / LINE.len() + 1);
    pad.truncate(n);
    if n > 0 {
        pad.pop();
        pad.push('\n');
    }
    pad
}

/// What `/metrics` returns while `metrics_garbage` is on: not Prometheus text.
pub const METRICS_GARBAGE: &str = "<html><body><h1>502 Bad Gateway</h1></body></html>\n\
vllm:num_requests_waiting{{{ not a number\n\
# TYPE\n\
\u{0}\u{1}garbage garbage garbage\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_updates() {
        let mut f = Faults::default();
        FaultUpdate::parse(br#"{"error_rate":0.5,"error_status":429,"queue_inflate":3}"#)
            .unwrap()
            .apply(&mut f);
        FaultUpdate::parse(br#"{"metrics_garbage":true,"metrics_error":true}"#)
            .unwrap()
            .apply(&mut f);
        FaultUpdate::parse(br#"{"no_prefix_caching":true}"#)
            .unwrap()
            .apply(&mut f);
        assert!(f.no_prefix_caching);
        assert!(f.metrics_error);
        assert_eq!(f.error_rate, 0.5);
        assert_eq!(f.error_status, 429);
        assert_eq!(f.queue_inflate, 3);
        assert!(f.metrics_garbage);
        assert!(f.any());
        let status_only = Faults {
            error_status: 429,
            ..Faults::default()
        };
        assert!(!status_only.any());
        assert!(FaultUpdate::parse(b"").unwrap() == FaultUpdate::default());
    }

    #[test]
    fn rejects_bad_input() {
        assert!(FaultUpdate::parse(br#"{"error_rate":2}"#).is_err());
        assert!(FaultUpdate::parse(br#"{"eror_rate":0.1}"#).is_err());
        assert!(FaultUpdate::parse(b"not json").is_err());
        assert!(FaultUpdate::parse(br#"{"down_ms":-1}"#).is_err());
        assert!(FaultUpdate::parse(br#"{"error_status":200}"#).is_err());
        assert!(FaultUpdate::parse(br#"{"error_status":600}"#).is_err());
    }
}
