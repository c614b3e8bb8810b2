//! Saturation: when an endpoint should take no more sheddable work, after
//! the Gateway API Inference Extension's saturation detector. An endpoint
//! is saturated when its latest scrape is older than `stale_after_ms`
//! (unknown load counts as full), or its waiting queue is at least
//! `queue_threshold`, or its KV-cache usage at least `kv_usage_threshold`
//! (defaults 5, 0.8 and 200 ms: GIE's; the staleness default follows the
//! scrape period, 4 x `metrics.scrape_interval_ms` and at least 200 ms, as
//! GIE's 200 ms is 4 x its 50 ms refresh, so a slower scrape configured for
//! a large fleet does not make every endpoint look saturated). An endpoint out of the candidate
//! set (failed scrapes, passive-health ejection) is saturated too.
//!
//! The pool is saturated *for a request* when every endpoint that could
//! serve it (its model's, see `models/`) is; then a request whose objective
//! has a negative priority is shed with 429 and `Retry-After`
//! (`objectives.rs`), and the rest are routed as usual (they queue on the
//! servers). Only scraped figures count, as in GIE: kvroute's own
//! in-flight requests already steer the choice between endpoints.

use crate::config::{err, ConfigError};
use crate::shared::endpoint_state::ScrapeState;
use serde::Deserialize;

/// `saturation.*`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SaturationConfig {
    /// Waiting requests at which an endpoint is saturated.
    pub queue_threshold: f64,
    /// KV-cache usage (0..1) at which an endpoint is saturated.
    pub kv_usage_threshold: f64,
    /// A scrape older than this leaves the endpoint's load unknown:
    /// saturated. Absent: [`SaturationConfig::stale_after`].
    pub stale_after_ms: Option<u64>,
    /// `Retry-After` of a shed request, in seconds.
    pub retry_after_secs: u32,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        SaturationConfig {
            queue_threshold: 5.0,
            kv_usage_threshold: 0.8,
            stale_after_ms: None,
            retry_after_secs: 1,
        }
    }
}

impl SaturationConfig {
    /// The staleness bound in force with scrapes every `scrape_interval_ms`:
    /// `stale_after_ms`, else 4 scrape periods and at least 200 ms.
    pub fn stale_after(&self, scrape_interval_ms: u64) -> u64 {
        self.stale_after_ms
            .unwrap_or_else(|| scrape_interval_ms.saturating_mul(4).max(200))
    }

    /// Whether an endpoint in `state`, a candidate or not (`healthy`), is
    /// saturated at `now_ms`, scrapes older than `stale_after_ms` counting
    /// as unknown load ([`SaturationConfig::stale_after`]).
    pub fn saturated(
        &self,
        state: &ScrapeState,
        healthy: bool,
        now_ms: u64,
        stale_after_ms: u64,
    ) -> bool {
        let Some(s) = state.fresh(now_ms, stale_after_ms).filter(|_| healthy) else {
            return true;
        };
        s.waiting >= self.queue_threshold
            || s.kv_usage.is_some_and(|kv| kv >= self.kv_usage_threshold)
    }

    /// Checks the bounds (`scrape_interval_ms`: `metrics.scrape_interval_ms`).
    pub fn validate(&self, scrape_interval_ms: u64) -> Result<(), ConfigError> {
        if !(self.queue_threshold.is_finite() && (0.0..=1e6).contains(&self.queue_threshold)) {
            return Err(err(
                "saturation.queue_threshold",
                self.queue_threshold,
                "must be a number in 0..=1000000",
            ));
        }
        if !(self.kv_usage_threshold.is_finite() && (0.0..=1.0).contains(&self.kv_usage_threshold))
        {
            return Err(err(
                "saturation.kv_usage_threshold",
                self.kv_usage_threshold,
                "must be a number in 0..=1",
            ));
        }
        if let Some(v) = self.stale_after_ms {
            if !(10..=600_000).contains(&v) || v < scrape_interval_ms {
                return Err(err(
                    "saturation.stale_after_ms",
                    v,
                    "must be 10..=600000 and at least metrics.scrape_interval_ms (else every endpoint looks saturated between scrapes)",
                ));
            }
        }
        if !(1..=3600).contains(&self.retry_after_secs) {
            return Err(err(
                "saturation.retry_after_secs",
                self.retry_after_secs,
                "must be 1..=3600",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Endpoint;
    use crate::metrics::MetricsSnapshot;
    use crate::shared::endpoint_state::EndpointStates;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn state(waiting: f64, kv: Option<f64>, at: u64) -> ScrapeState {
        let e: Endpoint = "10.0.0.1:80".parse().unwrap();
        let mut s = EndpointStates::default();
        let snap = MetricsSnapshot {
            waiting,
            kv_usage: kv,
            ..MetricsSnapshot::default()
        };
        s.succeed(e, snap, at);
        s.get(e)
    }

    #[test]
    fn thresholds_staleness_and_health() {
        let c = SaturationConfig::default();
        let now = 1_000;
        for (waiting, kv, at, healthy, want) in [
            (0.0, Some(0.1), 1_000, true, false),
            (4.0, Some(0.79), 900, true, false),
            (5.0, Some(0.1), 1_000, true, true),
            (0.0, Some(0.8), 1_000, true, true),
            (0.0, None, 1_000, true, false),
            (0.0, Some(0.1), 799, true, true),
            (0.0, Some(0.1), 1_000, false, true),
        ] {
            assert_eq!(
                c.saturated(&state(waiting, kv, at), healthy, now, c.stale_after(50)),
                want,
                "{waiting} {kv:?} {at} {healthy}"
            );
        }
        assert!(
            c.saturated(&ScrapeState::default(), true, now, 200),
            "never scraped"
        );
        assert_eq!(c.stale_after(50), 200, "GIE's 200 ms at the default scrape");
        assert_eq!(c.stale_after(1000), 4000, "follows a slower scrape");
    }

    #[test]
    fn bounds_are_checked() {
        for (json, field) in [
            (r#"{"queue_threshold":-1}"#, "saturation.queue_threshold"),
            (
                r#"{"kv_usage_threshold":1.5}"#,
                "saturation.kv_usage_threshold",
            ),
            (r#"{"stale_after_ms":1}"#, "saturation.stale_after_ms"),
            (r#"{"retry_after_secs":0}"#, "saturation.retry_after_secs"),
        ] {
            let c: SaturationConfig = serde_json::from_str(json).unwrap();
            assert_eq!(c.validate(50).unwrap_err().field, field);
        }
        assert!(SaturationConfig::default().validate(50).is_ok());
        let c: SaturationConfig = serde_json::from_str(r#"{"stale_after_ms":200}"#).unwrap();
        assert!(c.validate(50).is_ok());
        assert!(c.validate(500).is_err(), "shorter than the scrape period");
    }
}
