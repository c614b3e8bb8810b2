//! Which request paths the gateway lets through to the pool.
//!
//! A model server serves more than the inference API: vLLM also answers
//! `/reset_prefix_cache`, `/sleep`, `/pause`, profiling and LoRA-loading
//! endpoints, the simulator answers `/sim/fault`. None of those belongs to
//! the clients of a shared gateway, so only an allow-list reaches the pool;
//! everything else is answered by the gateway itself (404, see
//! `docs/ARCHITECTURE.md#errors`).
//!
//! The default list is the OpenAI API every engine kvroute supports serves
//! (vLLM, SGLang, TensorRT-LLM): `/v1/chat/completions`, `/v1/completions`,
//! `/v1/embeddings`, `/v1/models` and `/v1/models/<id>`. Rerank, score,
//! tokenize and the Responses API are inference too, but not served by every
//! engine, not OpenAI's (rerank, score, tokenize) or stateful per pod (a
//! stored response lives on the pod that made it): a deployment that needs
//! them lists them.
//!
//! The matcher does not trust Envoy to have normalized the path (Istio
//! gateways may not): a path is first made canonical here, and a path that
//! a server could read as something else is refused rather than guessed at.
//! Canonical means: the query and fragment are dropped; percent-escapes are
//! decoded once; the path must start with `/` (before decoding too), hold only ASCII letters,
//! digits and `-._~/!$&'()*+,=:@`, contain no empty segment except a
//! trailing one (`//` refused), no `.` or `..` segment, and nothing left to
//! decode (`%` after decoding: double encoding refused). Matching is then
//! exact and case-sensitive on the decoded path: a rule `"/v1/models"`
//! matches only that path, a rule ending in `/*` (`"/v1/models/*"`) matches
//! every path below that directory.

use serde::Deserialize;
use std::fmt;

/// One allow-list entry: an exact path, or every path under a directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathRule {
    /// `"/v1/models"`: exactly this path.
    Exact(String),
    /// `"/v1/models/*"`: every path starting with `/v1/models/` (held
    /// without the `*`). `"/*"` allows every canonical path.
    Prefix(String),
}

impl PathRule {
    /// Whether the canonical `path` is allowed by this rule.
    pub fn matches(&self, path: &str) -> bool {
        match self {
            PathRule::Exact(p) => path == p,
            PathRule::Prefix(p) => path.starts_with(p.as_str()),
        }
    }

    /// Parses and checks one rule as written in the configuration.
    pub fn parse(text: &str) -> Result<PathRule, String> {
        if text.len() > 256 {
            return Err("longer than 256 bytes".into());
        }
        let (body, prefix) = match text.strip_suffix('*') {
            Some(dir) if dir.ends_with('/') => (dir, true),
            Some(_) => return Err("`*` is only allowed as a final `/*`".into()),
            None => (text, false),
        };
        if body.contains('*') {
            return Err("`*` is only allowed as a final `/*`".into());
        }
        if body.contains('%') {
            return Err("write the path decoded (no `%` escapes)".into());
        }
        // The rule must itself be canonical, or it could never match.
        match canonical(body) {
            Some(c) if c == body => {}
            _ => {
                return Err(
                    "must be an absolute path of [A-Za-z0-9-._~/!$&'()+,=:@] without query, `//`, `.` or `..` segments".into(),
                )
            }
        }
        Ok(if prefix {
            PathRule::Prefix(body.to_string())
        } else {
            PathRule::Exact(body.to_string())
        })
    }
}

impl fmt::Display for PathRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathRule::Exact(p) => write!(f, "{p}"),
            PathRule::Prefix(p) => write!(f, "{p}*"),
        }
    }
}

impl<'de> Deserialize<'de> for PathRule {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        PathRule::parse(&s).map_err(|reason| serde::de::Error::custom(format!("{s:?}: {reason}")))
    }
}

/// The default allow-list (see the module comment for why these).
pub fn default_allowed_paths() -> Vec<PathRule> {
    [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/models",
        "/v1/models/*",
    ]
    .iter()
    .filter_map(|p| PathRule::parse(p).ok())
    .collect()
}

/// Whether a request's `:path` (as received: query, escapes and all) may
/// reach the pool under `rules`. A path that is not canonical never does.
pub fn is_allowed(rules: &[PathRule], raw_path: &str) -> bool {
    match canonical(raw_path) {
        Some(path) => rules.iter().any(|r| r.matches(&path)),
        None => false,
    }
}

/// The canonical form of a request path (see the module comment), or `None`
/// when the path is malformed or ambiguous.
pub fn canonical(raw_path: &str) -> Option<String> {
    let path = raw_path.split(['?', '#']).next().unwrap_or("");
    if !path.starts_with('/') {
        return None;
    }
    let bytes = path.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hi = hex(*bytes.get(i + 1)?)?;
            let lo = hex(*bytes.get(i + 2)?)?;
            decoded.push(hi << 4 | lo);
            i += 3;
        } else {
            decoded.push(bytes[i]);
            i += 1;
        }
    }
    if decoded.first() != Some(&b'/') || !decoded.iter().all(|b| allowed_byte(*b)) {
        return None;
    }
    // Every byte is ASCII now, so this cannot fail.
    let decoded = String::from_utf8(decoded).ok()?;
    let segments: Vec<&str> = decoded[1..].split('/').collect();
    let last = segments.len() - 1;
    for (i, s) in segments.iter().enumerate() {
        if *s == "." || *s == ".." || (s.is_empty() && i != last) {
            return None;
        }
    }
    Some(decoded)
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// RFC 3986 unreserved characters, `/` and the sub-delimiters a path segment
/// may hold, except `;` (path parameters: `..;/` tricks on some servers) and
/// `%` (after decoding: double encoding).
fn allowed_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~/!$&'()*+,=:@".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn default_list_allows_the_inference_api_only() {
        let rules = default_allowed_paths();
        assert_eq!(rules.len(), 5);
        for (path, allowed) in [
            ("/v1/chat/completions", true),
            ("/v1/completions", true),
            ("/v1/completions?stream=true", true),
            ("/v1/chat/completions#frag", true),
            ("/v1/embeddings", true),
            ("/v1/models", true),
            ("/v1/models?x=1", true),
            ("/v1/models/meta-llama/Llama-3.1-8B-Instruct", true),
            ("/v1/models/llama3:8b", true),
            ("/v1/models/", true),
            // Not listed.
            ("/sim/fault", false),
            ("/sim/state", false),
            ("/reset_prefix_cache", false),
            ("/sleep", false),
            ("/metrics", false),
            ("/health", false),
            ("/tokenize", false),
            ("/v1/responses", false),
            ("/v1/modelsX", false),
            ("/v1/chat/completions/", false),
            ("/v1/chat/completions/x", false),
            ("/", false),
            ("", false),
            ("*", false),
            ("?/v1/models", false),
            // Case: servers route case-sensitively; so does the list.
            ("/V1/chat/completions", false),
            ("/v1/Models", false),
        ] {
            assert_eq!(is_allowed(&rules, path), allowed, "{path:?}");
        }
    }

    #[test]
    fn path_tricks_are_refused() {
        let rules = default_allowed_paths();
        for path in [
            "/v1/models/../../sim/fault",
            "/v1/models/../models",
            "/v1/models/./x",
            "/v1/models/%2e%2e/%2e%2e/sim/fault",
            "/v1/models/%2E%2E/%2E%2E/sim/fault",
            "/v1/models/.%2e/.%2e/sim/fault",
            "/v1/models/..%2F..%2Fsim%2Ffault",
            "/v1/models/..%2f..%2fsim%2ffault",
            "/v1/models/x%2F..%2F..%2F..%2Fsim%2Ffault",
            "/v1/models/%252e%252e/%252e%252e/sim/fault",
            "/v1/models/..%5C..%5Csim%5Cfault",
            "/v1/models/..\\..\\sim\\fault",
            "/v1/models/..;/..;/sim/fault",
            "/v1/models/x;/../../sim/fault",
            "//sim/fault",
            "/v1//models",
            "/v1/models//x",
            "/v1/models/x%00",
            "/v1/models/x%0a",
            "/v1/models/x y",
            "/v1/models/%",
            "/v1/models/%2",
            "/v1/models/%zz",
            "/v1/models/\u{e9}",
            "/v1/models/%c3%a9",
            "%2Fv1/models",
        ] {
            assert!(!is_allowed(&rules, path), "{path:?} allowed");
        }
    }

    #[test]
    fn canonical_decodes_once() {
        assert_eq!(
            canonical("/v1/%63hat/completions?a=%2e").as_deref(),
            Some("/v1/chat/completions")
        );
        assert_eq!(canonical("/a/b/").as_deref(), Some("/a/b/"));
        assert_eq!(canonical("/").as_deref(), Some("/"));
        assert_eq!(canonical("/a/%2e%2e"), None);
        assert_eq!(canonical("/a/%25"), None);
    }

    #[test]
    fn rules_parse_and_match() {
        let r = PathRule::parse("/v1/models/*").unwrap();
        assert_eq!(r, PathRule::Prefix("/v1/models/".into()));
        assert!(r.matches("/v1/models/x") && !r.matches("/v1/models"));
        assert_eq!(r.to_string(), "/v1/models/*");
        let all = PathRule::parse("/*").unwrap();
        assert!(is_allowed(std::slice::from_ref(&all), "/health"));
        assert!(!is_allowed(&[all], "/a/../health"));
        let exact = PathRule::parse("/health").unwrap();
        assert!(exact.matches("/health") && !exact.matches("/health/x"));
        for bad in [
            "",
            "health",
            "/v1/models*",
            "/v1/*/x",
            "/a//b",
            "/a/../b",
            "/a/./b",
            "/a?x=1",
            "/a%2Fb",
            "/a b",
            "/a;b",
            "*",
            "/**",
        ] {
            assert!(PathRule::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert!(PathRule::parse(&format!("/{}", "a".repeat(300))).is_err());
    }

    #[test]
    fn rules_deserialize_with_a_reason() {
        let r: Vec<PathRule> = serde_json::from_str(r#"["/v1/models", "/v1/x/*"]"#).unwrap();
        assert_eq!(r[1], PathRule::Prefix("/v1/x/".into()));
        let e = serde_json::from_str::<Vec<PathRule>>(r#"["/v1/../x"]"#).unwrap_err();
        assert!(e.to_string().contains("/v1/../x"), "{e}");
    }
}
