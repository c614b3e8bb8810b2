//! Did the endpoint kvroute chose answer the request? Read from what Envoy
//! reports when the response starts: `response.code_details` (why Envoy
//! sent this response) and `upstream.address` (the host of the last try).
//!
//! ```text
//! details "via_upstream", upstream = chosen      answered
//! details "via_upstream", upstream = other       not answered: a retry
//!                                                 on that fallback answered
//! details upstream_reset_before_response_started{...}  not answered
//!         (connect refused or timed out, reset before any byte)
//! details upstream_per_try_timeout               not answered (no first
//!         byte within failover.first_byte_timeout_ms)
//! anything else (no upstream tried, e.g. a local reply)  no verdict
//! ```
//!
//! A "not answered" makes the shell take the endpoint out of the candidate
//! set at once, for every worker, until a scrape of it answers (see
//! `EndpointStates::unreachable`): a dead pod costs one failed try, not one
//! per worker and scrape period. When a fallback answered, the prompt is
//! now cached there, not on the chosen endpoint: the shell teaches the
//! prefix index so (`VmState::served_by`), and the conversation's next turn
//! follows it. Any answer but a 2xx sent by the chosen endpoint (a refusal
//! such as 400 or 429, an error, a fallback's answer, none) means the chosen
//! endpoint did not cache the prompt: the shell unlearns what the decision
//! taught it (`VmState::refused`).

use crate::endpoint::Endpoint;

/// What a response says about the chosen endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The chosen endpoint sent the response.
    Answered,
    /// Envoy could not get a response byte from the chosen endpoint.
    NotAnswered,
    /// The chosen endpoint did not answer; a retry on this other endpoint
    /// (a fallback of the destination header) did.
    Fallback(Endpoint),
    /// The response says nothing about the endpoint.
    Unknown,
}

impl Verdict {
    /// The endpoint whose answer (or Envoy's reply for it) the client got:
    /// the fallback that answered, else the chosen endpoint.
    pub fn sender(self, chosen: Endpoint) -> Endpoint {
        match self {
            Verdict::Fallback(e) => e,
            Verdict::Answered | Verdict::NotAnswered | Verdict::Unknown => chosen,
        }
    }
}

/// Whether `response.code_details` can change anything for a response of
/// HTTP `status` whose last try went to `upstream_address` (each property
/// read costs the host several microseconds, so the common case reads only
/// the address). Envoy's own replies for a reset before the response and
/// for a per-try timeout are 503 and 504; below 500 only a response another
/// endpoint sent (a retry answered by a fallback) can say the chosen one
/// did not answer ([`Verdict::Fallback`]), and then only if it came via the
/// upstream.
pub fn needs_code_details(
    status: Option<u16>,
    upstream_address: Option<&str>,
    chosen: Endpoint,
) -> bool {
    match status {
        Some(s) if s < 500 => upstream_address
            .and_then(|a| a.parse::<Endpoint>().ok())
            .is_some_and(|e| e != chosen),
        _ => true,
    }
}

/// Classifies a response of a request routed to `chosen`.
pub fn verdict(code_details: &str, upstream_address: Option<&str>, chosen: Endpoint) -> Verdict {
    if code_details == "via_upstream" {
        return match upstream_address.and_then(|a| a.parse::<Endpoint>().ok()) {
            Some(e) if e != chosen => Verdict::Fallback(e),
            _ => Verdict::Answered,
        };
    }
    if code_details.starts_with("upstream_reset_before_response_started")
        || code_details == "upstream_per_try_timeout"
    {
        // With retries the last try may have gone elsewhere; every try
        // failed, the first (the chosen endpoint) included.
        return Verdict::NotAnswered;
    }
    Verdict::Unknown
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn code_details_are_skipped_only_where_they_cannot_say_not_answered() {
        let chosen: Endpoint = "127.0.0.1:8001".parse().unwrap();
        // (status, upstream, code_details Envoy gives such a response)
        let cases = [
            (200, Some("127.0.0.1:8001"), "via_upstream", false),
            (200, None, "via_upstream", false),
            (404, Some("127.0.0.1:8001"), "via_upstream", false),
            (200, Some("garbage"), "via_upstream", false),
            (200, Some("127.0.0.1:8002"), "via_upstream", true),
            (
                503,
                Some("127.0.0.1:8001"),
                "upstream_reset_before_response_started{connection_termination}",
                true,
            ),
            (
                503,
                None,
                "upstream_reset_before_response_started{remote_connection_failure}",
                true,
            ),
            (
                504,
                Some("127.0.0.1:8001"),
                "upstream_per_try_timeout",
                true,
            ),
            (500, Some("127.0.0.1:8001"), "via_upstream", true),
            (413, None, "request_payload_too_large", false),
        ];
        for (status, upstream, details, needed) in cases {
            let got = needs_code_details(Some(status), upstream, chosen);
            assert_eq!(got, needed, "{status} {upstream:?}");
            if !got {
                // Skipping them never hides a not-answered verdict.
                assert!(matches!(
                    verdict(details, upstream, chosen),
                    Verdict::Answered | Verdict::Unknown
                ));
            }
        }
        assert!(needs_code_details(None, Some("127.0.0.1:8001"), chosen));
    }

    #[test]
    fn verdict_table() {
        let chosen: Endpoint = "127.0.0.1:8001".parse().unwrap();
        let cases = [
            ("via_upstream", Some("127.0.0.1:8001"), Verdict::Answered),
            ("via_upstream", None, Verdict::Answered),
            ("via_upstream", Some("garbage"), Verdict::Answered),
            (
                "via_upstream",
                Some("127.0.0.1:8002"),
                Verdict::Fallback("127.0.0.1:8002".parse().unwrap()),
            ),
            (
                "upstream_reset_before_response_started{remote_connection_failure,delayed_connect_error:_Connection_refused}",
                Some("127.0.0.1:8001"),
                Verdict::NotAnswered,
            ),
            (
                "upstream_reset_before_response_started{connection_termination}",
                None,
                Verdict::NotAnswered,
            ),
            ("upstream_per_try_timeout", None, Verdict::NotAnswered),
            ("response_payload_too_large", None, Verdict::Unknown),
            ("", None, Verdict::Unknown),
        ];
        for (details, upstream, want) in cases {
            let got = verdict(details, upstream, chosen);
            assert_eq!(got, want, "{details} {upstream:?}");
            // Passive health blames the endpoint that sent the answer.
            let sender = match want {
                Verdict::Fallback(e) => e,
                _ => chosen,
            };
            assert_eq!(got.sender(chosen), sender);
        }
    }
}
