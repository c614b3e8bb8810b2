//! Model-aware pools: which endpoints serve which model.
//!
//! A gateway in front of several models must send a request only to the
//! endpoints that serve its `model`. The `models` section of the config
//! lists entries; each names a base model (exactly, or a family by a
//! trailing `*`: `"qwen-*"`), the endpoints serving it (a subset of
//! `endpoints`), and the LoRA adapters those endpoints serve on top of it.
//! A request's `model` resolves to one entry:
//!
//! 1. an exact base-model name, else an exact adapter name;
//! 2. else the longest matching `*` pattern (base names and adapters alike).
//!
//! No match: the gateway answers 404 `model_not_found` itself. Without a
//! `models` section nothing changes: every endpoint serves every model
//! ([`Scope::All`]).
//!
//! Client input here is only ever compared, never stored: a model name of
//! any length that matches nothing costs one pass over the table.

pub mod listing;

use crate::config::{err, ConfigError};
use crate::endpoint::Endpoint;
use crate::metrics::lora::adapter_id;
use serde::Deserialize;
use std::fmt;

/// Longest model or adapter name (or pattern) in the config, in bytes.
pub const MAX_NAME_BYTES: usize = 256;
/// Most `models` entries.
pub const MAX_ENTRIES: usize = 256;
/// Most adapters one entry declares.
pub const MAX_ADAPTERS: usize = 1024;

/// A model or adapter name as written in the config: exact, or a prefix
/// ending in `*` (`"qwen-*"` matches `qwen-7b`, `qwen-72b-instruct`, ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelName {
    /// Exactly this name.
    Exact(String),
    /// Every name starting with this (held without the `*`).
    Prefix(String),
}

impl ModelName {
    /// Whether `model` (a request's `model` field) is this name.
    pub fn matches(&self, model: &str) -> bool {
        match self {
            ModelName::Exact(n) => n == model,
            ModelName::Prefix(p) => model.starts_with(p.as_str()),
        }
    }

    /// Parses and checks one name as written in the config.
    pub fn parse(text: &str) -> Result<ModelName, String> {
        if text.is_empty() || text.len() > MAX_NAME_BYTES {
            return Err(format!("must be 1..={MAX_NAME_BYTES} bytes"));
        }
        if text.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err("must not hold whitespace or control characters".into());
        }
        match text.strip_suffix('*') {
            Some(p) if p.contains('*') => Err("`*` is only allowed at the end".into()),
            Some("") => Err("`*` alone would match every model: list the models".into()),
            Some(p) => Ok(ModelName::Prefix(p.to_string())),
            None if text.contains('*') => Err("`*` is only allowed at the end".into()),
            None => Ok(ModelName::Exact(text.to_string())),
        }
    }

    /// The exact name, if this is not a pattern.
    pub fn exact(&self) -> Option<&str> {
        match self {
            ModelName::Exact(n) => Some(n),
            ModelName::Prefix(_) => None,
        }
    }
}

impl fmt::Display for ModelName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelName::Exact(n) => write!(f, "{n}"),
            ModelName::Prefix(p) => write!(f, "{p}*"),
        }
    }
}

impl<'de> Deserialize<'de> for ModelName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        ModelName::parse(&s).map_err(|reason| serde::de::Error::custom(format!("{s:?}: {reason}")))
    }
}

/// One `models` entry: a base model, its endpoints, its adapters.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelPool {
    /// The base model's served name (or a `*` family).
    pub name: ModelName,
    /// The endpoints serving it; each must be in `endpoints`.
    pub endpoints: Vec<Endpoint>,
    /// LoRA adapters served on top of it (names or `*` families); a request
    /// whose `model` is one of them goes to these endpoints.
    #[serde(default)]
    pub adapters: Vec<ModelName>,
}

/// Where a request may go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Anywhere in the pool: no `models` section, or a request whose model
    /// could not be read (routed by load, as any unreadable body).
    All,
    /// Only the endpoints of `models[pool]`.
    Model {
        /// Index into the `models` entries.
        pool: usize,
        /// When the request names one of its adapters, not the base model:
        /// the adapter's id (`metrics::lora::adapter_id`), for LoRA affinity.
        adapter: Option<crate::metrics::lora::AdapterId>,
    },
}

/// No `models` entry serves the requested model (404 `model_not_found`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelNotFound;

/// The `models` entries, ready to resolve requests.
#[derive(Clone, Debug, Default)]
pub struct ModelPools {
    entries: Vec<ModelPool>,
}

impl ModelPools {
    /// The table of a validated config's `models` (endpoint lists sorted).
    pub fn new(entries: &[ModelPool]) -> ModelPools {
        let mut entries = entries.to_vec();
        for e in &mut entries {
            e.endpoints.sort();
        }
        ModelPools { entries }
    }

    /// No `models` section: every endpoint serves every model.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries, in config order.
    pub fn entries(&self) -> &[ModelPool] {
        &self.entries
    }

    /// Sorted endpoints of entry `pool` (empty for an index out of range).
    pub fn endpoints(&self, pool: usize) -> &[Endpoint] {
        self.entries.get(pool).map_or(&[], |e| &e.endpoints)
    }

    /// Where a request for `model` may go; `None` when its model could not
    /// be read (the body was not understood).
    pub fn scope(&self, model: Option<&str>) -> Result<Scope, ModelNotFound> {
        match model {
            _ if self.entries.is_empty() => Ok(Scope::All),
            None => Ok(Scope::All),
            Some(m) => self.resolve(m).ok_or(ModelNotFound),
        }
    }

    /// The entry serving `model` (see the module comment for the order).
    pub fn resolve(&self, model: &str) -> Option<Scope> {
        let base = self
            .entries
            .iter()
            .position(|e| e.name.exact() == Some(model));
        if let Some(pool) = base {
            return Some(Scope::Model {
                pool,
                adapter: None,
            });
        }
        let adapter = self
            .entries
            .iter()
            .position(|e| e.adapters.iter().any(|a| a.exact() == Some(model)));
        if let Some(pool) = adapter {
            return Some(Scope::Model {
                pool,
                adapter: Some(adapter_id(model)),
            });
        }
        let mut best: Option<(usize, Scope)> = None;
        for (pool, e) in self.entries.iter().enumerate() {
            let names =
                std::iter::once((&e.name, false)).chain(e.adapters.iter().map(|a| (a, true)));
            for (name, adapter) in names {
                if let ModelName::Prefix(p) = name {
                    if model.starts_with(p.as_str()) && best.is_none_or(|(len, _)| p.len() > len) {
                        let adapter = adapter.then(|| adapter_id(model));
                        best = Some((p.len(), Scope::Model { pool, adapter }));
                    }
                }
            }
        }
        best.map(|(_, s)| s)
    }
}

/// Checks `models` against the rest of the config: every entry has
/// endpoints, all in `endpoints`; no name or pattern is declared twice;
/// every endpoint serves some model; no `discovery` (a model's endpoints are
/// a static list).
pub fn validate(
    models: &[ModelPool],
    endpoints: &[Endpoint],
    discovery: bool,
) -> Result<(), ConfigError> {
    if models.is_empty() {
        return Ok(());
    }
    if discovery {
        return Err(err(
            "models",
            "set",
            "cannot be combined with discovery: a model's endpoints are a static list (use `endpoints`)",
        ));
    }
    if models.len() > MAX_ENTRIES {
        return Err(err(
            "models",
            models.len(),
            &format!("at most {MAX_ENTRIES} entries"),
        ));
    }
    let mut seen: Vec<(&ModelName, String)> = Vec::new();
    for (i, m) in models.iter().enumerate() {
        if m.endpoints.is_empty() || m.endpoints.len() > 1024 {
            return Err(err(
                &format!("models[{i}].endpoints"),
                m.endpoints.len(),
                "must list 1..=1024 endpoints",
            ));
        }
        for (j, e) in m.endpoints.iter().enumerate() {
            let field = format!("models[{i}].endpoints[{j}]");
            if m.endpoints[..j].contains(e) {
                return Err(err(&field, e, "listed twice"));
            }
            if !endpoints.contains(e) {
                return Err(err(&field, e, "not in `endpoints` (the pool)"));
            }
        }
        if m.adapters.len() > MAX_ADAPTERS {
            return Err(err(
                &format!("models[{i}].adapters"),
                m.adapters.len(),
                &format!("at most {MAX_ADAPTERS} adapters"),
            ));
        }
        let names = std::iter::once((&m.name, format!("models[{i}].name"))).chain(
            m.adapters
                .iter()
                .enumerate()
                .map(|(j, a)| (a, format!("models[{i}].adapters[{j}]"))),
        );
        for (name, field) in names {
            if let Some((_, first)) = seen.iter().find(|(n, _)| *n == name) {
                return Err(err(
                    &field,
                    name,
                    &format!("already declared at {first}: a model resolves to one entry"),
                ));
            }
            seen.push((name, field));
        }
    }
    for (i, e) in endpoints.iter().enumerate() {
        if !models.iter().any(|m| m.endpoints.contains(e)) {
            return Err(err(
                &format!("endpoints[{i}]"),
                e,
                "in no `models` entry: it would never get a request",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn ep(i: u8) -> Endpoint {
        format!("10.0.0.{i}:8000").parse().unwrap()
    }

    fn pools(json: &str) -> Vec<ModelPool> {
        serde_json::from_str(json).unwrap()
    }

    const TABLE: &str = r#"[
        {"name":"llama-8b","endpoints":["10.0.0.2:8000","10.0.0.1:8000"],"adapters":["sql-lora","fin-*"]},
        {"name":"qwen-*","endpoints":["10.0.0.3:8000"]},
        {"name":"qwen-72b-*","endpoints":["10.0.0.4:8000"],"adapters":["qwen-72b-chat"]}
    ]"#;

    #[test]
    fn names_resolve_exact_first_then_longest_pattern() {
        let t = ModelPools::new(&pools(TABLE));
        let m = |pool, adapter: Option<&str>| {
            Ok(Scope::Model {
                pool,
                adapter: adapter.map(adapter_id),
            })
        };
        for (model, want) in [
            ("llama-8b", m(0, None)),
            ("sql-lora", m(0, Some("sql-lora"))),
            ("fin-q3", m(0, Some("fin-q3"))),
            ("qwen-7b", m(1, None)),
            ("qwen-72b-instruct", m(2, None)),
            ("qwen-72b-chat", m(2, Some("qwen-72b-chat"))),
            ("llama-8", Err(ModelNotFound)),
            ("llama-8b ", Err(ModelNotFound)),
            ("", Err(ModelNotFound)),
            ("LLAMA-8B", Err(ModelNotFound)),
        ] {
            assert_eq!(t.scope(Some(model)), want, "{model}");
        }
        assert_eq!(t.scope(None), Ok(Scope::All), "unreadable body");
        assert_eq!(t.endpoints(0), &[ep(1), ep(2)], "sorted");
        assert!(t.endpoints(9).is_empty());
        let long = "q".repeat(1 << 20);
        assert_eq!(t.scope(Some(&long)), Err(ModelNotFound));
        assert_eq!(ModelPools::default().scope(Some("x")), Ok(Scope::All));
    }

    #[test]
    fn names_are_checked() {
        for bad in ["", "*", "a*b", "a**", "a b", "a\nb", &"x".repeat(257)] {
            assert!(ModelName::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            ModelName::parse("qwen-*").unwrap(),
            ModelName::Prefix("qwen-".into())
        );
        assert_eq!(
            ModelName::parse("meta-llama/Llama-3.1-8B-Instruct").unwrap(),
            ModelName::Exact("meta-llama/Llama-3.1-8B-Instruct".into())
        );
    }

    #[test]
    fn validation_names_the_field() {
        let eps = [ep(1), ep(2), ep(3), ep(4)];
        assert!(validate(&pools(TABLE), &eps, false).is_ok());
        assert_eq!(
            validate(&pools(TABLE), &eps, true).unwrap_err().field,
            "models"
        );
        for (json, field) in [
            (r#"[{"name":"a","endpoints":[]}]"#, "models[0].endpoints"),
            (
                r#"[{"name":"a","endpoints":["10.0.0.9:8000"]}]"#,
                "models[0].endpoints[0]",
            ),
            (
                r#"[{"name":"a","endpoints":["10.0.0.1:8000","10.0.0.1:8000"]}]"#,
                "models[0].endpoints[1]",
            ),
            (
                r#"[{"name":"a","endpoints":["10.0.0.1:8000","10.0.0.2:8000","10.0.0.3:8000","10.0.0.4:8000"]},
                   {"name":"a","endpoints":["10.0.0.1:8000"]}]"#,
                "models[1].name",
            ),
            (
                r#"[{"name":"a","endpoints":["10.0.0.1:8000","10.0.0.2:8000","10.0.0.3:8000","10.0.0.4:8000"],"adapters":["x","x"]}]"#,
                "models[0].adapters[1]",
            ),
            (
                r#"[{"name":"a","endpoints":["10.0.0.1:8000","10.0.0.2:8000","10.0.0.3:8000"]}]"#,
                "endpoints[3]",
            ),
        ] {
            assert_eq!(
                validate(&pools(json), &eps, false).unwrap_err().field,
                field,
                "{json}"
            );
        }
    }
}
