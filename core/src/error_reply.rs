//! The errors the gateway answers itself, in the OpenAI error shape that
//! clients of an inference API already parse:
//! `{"error":{"message":...,"type":...,"param":null,"code":...}}`.
//!
//! The filter sends [`ErrorReply::PathNotAllowed`],
//! [`ErrorReply::ModelNotFound`], [`ErrorReply::ModelUnavailable`],
//! [`ErrorReply::Shed`] and
//! [`ErrorReply::NoEndpoint`] itself; the errors Envoy generates (no healthy
//! upstream, connect failure, body too large, timeout) get the same shape
//! from the connection manager's `local_reply_config` in
//! `envoy/kvroute.yaml.tmpl`, with the same `type` and `code` values. The
//! table is in `docs/ARCHITECTURE.md#errors`.

/// Seconds a client should wait before retrying when no endpoint can serve
/// (the `Retry-After` header; Envoy's mappers send the same value).
pub const RETRY_AFTER_SECS: u32 = 1;

/// An error kvroute answers itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorReply {
    /// The path is not on the allow-list (`allowed_paths`).
    PathNotAllowed,
    /// The pool is empty: no endpoint can serve.
    NoEndpoint,
    /// No `models` entry serves the requested model (or the body names
    /// none): answered by the gateway, never sent to a pod.
    ModelNotFound,
    /// The model is configured (a `models` entry left to `/v1/models`), but
    /// no endpoint that answers lists it yet: 503, retry later (a pod
    /// serving it may be starting, or coming back).
    ModelUnavailable,
    /// Every endpoint that could serve the request is saturated and its
    /// objective's priority is negative (sheddable): 429, retry later.
    Shed {
        /// `Retry-After` seconds.
        retry_after_secs: u32,
    },
    /// On the peer listener: a sync request meant for another replica
    /// (Envoy's fallback picked this one): the asker must not take this
    /// replica's answer for that member's.
    MisdirectedSync,
}

impl ErrorReply {
    /// HTTP status.
    pub fn status(self) -> u32 {
        match self {
            ErrorReply::PathNotAllowed => 404,
            ErrorReply::NoEndpoint => 503,
            ErrorReply::MisdirectedSync => 421,
            ErrorReply::ModelNotFound => 404,
            ErrorReply::ModelUnavailable => 503,
            ErrorReply::Shed { .. } => 429,
        }
    }

    /// `error.type`.
    pub fn kind(self) -> &'static str {
        match self {
            ErrorReply::PathNotAllowed => "invalid_request_error",
            ErrorReply::NoEndpoint => "server_error",
            ErrorReply::MisdirectedSync => "invalid_request_error",
            ErrorReply::ModelNotFound => "invalid_request_error",
            ErrorReply::ModelUnavailable => "server_error",
            ErrorReply::Shed { .. } => "rate_limit_exceeded",
        }
    }

    /// `error.code`.
    pub fn code(self) -> &'static str {
        match self {
            ErrorReply::PathNotAllowed => "path_not_allowed",
            ErrorReply::NoEndpoint => "no_endpoint",
            ErrorReply::MisdirectedSync => "misdirected_request",
            ErrorReply::ModelNotFound => "model_not_found",
            ErrorReply::ModelUnavailable => "model_unavailable",
            ErrorReply::Shed { .. } => "pool_saturated",
        }
    }

    /// `error.message`.
    pub fn message(self) -> &'static str {
        match self {
            ErrorReply::PathNotAllowed => "kvroute: this path is not served by the gateway",
            ErrorReply::NoEndpoint => "kvroute: no endpoint available",
            ErrorReply::MisdirectedSync => "kvroute: this sync request names another replica",
            ErrorReply::ModelNotFound => {
                "kvroute: the model does not exist or is not served by this gateway (see GET /v1/models)"
            }
            ErrorReply::ModelUnavailable => {
                "kvroute: no endpoint serving this model is available yet; retry later"
            }
            ErrorReply::Shed { .. } => {
                "kvroute: every endpoint serving this model is saturated and the request's objective is sheddable; retry later"
            }
        }
    }

    /// `Retry-After` seconds, for errors a retry can cure.
    pub fn retry_after(self) -> Option<u32> {
        match self {
            ErrorReply::PathNotAllowed => None,
            ErrorReply::NoEndpoint => Some(RETRY_AFTER_SECS),
            ErrorReply::MisdirectedSync => None,
            ErrorReply::ModelNotFound => None,
            ErrorReply::ModelUnavailable => Some(RETRY_AFTER_SECS),
            ErrorReply::Shed { retry_after_secs } => Some(retry_after_secs),
        }
    }

    /// The JSON body.
    pub fn body(self) -> String {
        serde_json::json!({
            "error": {
                "message": self.message(),
                "type": self.kind(),
                "param": null,
                "code": self.code(),
            }
        })
        .to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn bodies_have_the_openai_shape() {
        for (e, status, retry) in [
            (ErrorReply::PathNotAllowed, 404, None),
            (ErrorReply::NoEndpoint, 503, Some(1)),
            (ErrorReply::MisdirectedSync, 421, None),
            (ErrorReply::ModelNotFound, 404, None),
            (ErrorReply::ModelUnavailable, 503, Some(1)),
            (
                ErrorReply::Shed {
                    retry_after_secs: 3,
                },
                429,
                Some(3),
            ),
        ] {
            let v: serde_json::Value = serde_json::from_str(&e.body()).unwrap();
            let err = v["error"].as_object().unwrap();
            assert_eq!(err.len(), 4, "{v}");
            assert!(err["message"].as_str().unwrap().starts_with("kvroute: "));
            assert_eq!(err["type"], e.kind());
            assert!(err["param"].is_null());
            assert_eq!(err["code"], e.code());
            assert_eq!(e.status(), status);
            assert_eq!(e.retry_after(), retry);
        }
    }
}
