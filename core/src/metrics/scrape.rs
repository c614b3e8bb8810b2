//! What one `/metrics` scrape says about an endpoint. Health is about
//! reachability, load is about the text: an endpoint that answers but whose
//! metrics cannot be read (a 404 from a wrong `metrics.path`, an exporter
//! returning junk) is still up and keeps serving; it only loses its load
//! figures (its snapshot goes stale and the load scorers treat it as
//! unknown). Only no answer, a timeout, or a 5xx (which is also what Envoy
//! answers itself when it cannot connect) counts toward
//! `metrics.unhealthy_after_failures`.

use super::{read_scrape, Reading};
use crate::config::MetricsConfig;

/// The meaning of one scrape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScrapeOutcome {
    /// Load figures read, with the rest of the scrape ([`Reading`]).
    Snapshot(Reading),
    /// The endpoint answered, but not with readable metrics.
    Unreadable,
    /// No answer, a timeout, or a server error.
    Unreachable,
}

/// Classifies a scrape from its HTTP status (`None`: no response at all)
/// and body (`None`: larger than `metrics.max_body_bytes`, not read: the
/// endpoint answered, but nothing it says can be used).
pub fn classify(status: Option<u16>, body: Option<&[u8]>, cfg: &MetricsConfig) -> ScrapeOutcome {
    match status {
        Some(200) => match body.map(std::str::from_utf8) {
            Some(Ok(text)) => read_scrape(text, cfg)
                .map(ScrapeOutcome::Snapshot)
                .unwrap_or(ScrapeOutcome::Unreadable),
            _ => ScrapeOutcome::Unreadable,
        },
        Some(s) if (100..500).contains(&s) => ScrapeOutcome::Unreadable,
        _ => ScrapeOutcome::Unreachable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn classify_table() {
        let cfg = MetricsConfig::default();
        let good = b"vllm:num_requests_waiting{model_name=\"m\"} 2.0\nvllm:num_requests_running{model_name=\"m\"} 1.0\n";
        type Case<'a> = (Option<u16>, Option<&'a [u8]>, &'a str);
        let cases: [Case; 11] = [
            (Some(200), Some(good), "snapshot"),
            (Some(200), None, "unreadable"),
            (Some(404), None, "unreadable"),
            (Some(200), Some(b"<html>oops</html>"), "unreadable"),
            (Some(200), Some(&[0xff, 0xfe]), "unreadable"),
            (Some(200), Some(b""), "unreadable"),
            (Some(404), Some(b"not found"), "unreadable"),
            (Some(301), Some(b""), "unreadable"),
            (Some(503), Some(b"upstream connect error"), "unreachable"),
            (Some(0), Some(b""), "unreachable"),
            (None, Some(b""), "unreachable"),
        ];
        for (status, body, want) in cases {
            let got = match classify(status, body, &cfg) {
                ScrapeOutcome::Snapshot(r) => {
                    assert_eq!((r.snapshot.waiting, r.snapshot.running), (2.0, 1.0));
                    "snapshot"
                }
                ScrapeOutcome::Unreadable => "unreadable",
                ScrapeOutcome::Unreachable => "unreachable",
            };
            assert_eq!(got, want, "{status:?}");
        }
    }
}
