//! Objectives: how important a request is, named by the client in a header
//! (`x-gateway-inference-objective: NAME`, the Gateway API Inference
//! Extension's convention) and mapped by the config to an integer priority.
//! Priority decides only one thing here: when every endpoint that could
//! serve a request is saturated (`saturation.rs`), a request with a
//! negative priority is shed (429) and the others are routed.
//!
//! The header is only a lookup key. A name the config does not list, no
//! header, or a value too long to be a name gets the default priority (0,
//! as GIE's InferenceObjective), so no client raises its priority by
//! inventing a name; the value is never stored.

use crate::config::{err, ConfigError};
use serde::Deserialize;
use std::collections::BTreeMap;

/// Longest objective name, in bytes (a Kubernetes object name).
pub const MAX_NAME_BYTES: usize = 63;
/// Most objectives.
pub const MAX_OBJECTIVES: usize = 64;

/// `objectives.*`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ObjectivesConfig {
    /// Request header naming the objective.
    pub header: String,
    /// Priority of each objective name (negative: sheddable).
    pub priorities: BTreeMap<String, i32>,
    /// Priority of requests naming no listed objective.
    pub default_priority: i32,
}

impl Default for ObjectivesConfig {
    fn default() -> Self {
        ObjectivesConfig {
            header: "x-gateway-inference-objective".into(),
            priorities: BTreeMap::new(),
            default_priority: 0,
        }
    }
}

/// A request's objective: which listed one (index into the names in
/// sorted order, for per-objective stats), and its priority.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Objective {
    /// Index of the listed objective; `None` for the default.
    pub index: Option<usize>,
    /// Priority; negative is sheddable.
    pub priority: i32,
}

impl Objective {
    /// The objective of a request without objectives configured.
    pub const DEFAULT: Objective = Objective {
        index: None,
        priority: 0,
    };

    /// Whether the request may be shed when its endpoints are saturated.
    pub fn sheddable(&self) -> bool {
        self.priority < 0
    }
}

impl ObjectivesConfig {
    /// The objective a header value names (`None`: no header).
    pub fn resolve(&self, value: Option<&str>) -> Objective {
        let listed = value
            .map(str::trim)
            .filter(|v| v.len() <= MAX_NAME_BYTES)
            .and_then(|v| {
                self.priorities
                    .iter()
                    .enumerate()
                    .find(|(_, (name, _))| name.as_str() == v)
            });
        match listed {
            Some((i, (_, &priority))) => Objective {
                index: Some(i),
                priority,
            },
            None => Objective {
                index: None,
                priority: self.default_priority,
            },
        }
    }

    /// The listed names, in index order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.priorities.keys().map(String::as_str)
    }

    /// Checks names (lowercase `[a-z0-9-]`, 1..=63 bytes: they become stat
    /// names) and bounds.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.priorities.len() > MAX_OBJECTIVES {
            return Err(err(
                "objectives.priorities",
                self.priorities.len(),
                &format!("at most {MAX_OBJECTIVES} objectives"),
            ));
        }
        for name in self.priorities.keys() {
            let ok = (1..=MAX_NAME_BYTES).contains(&name.len())
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
            if !ok {
                return Err(err(
                    &format!("objectives.priorities.{name}"),
                    name,
                    "objective names must be 1..=63 bytes of [a-z0-9-]",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn cfg() -> ObjectivesConfig {
        serde_json::from_str(r#"{"priorities":{"batch":-1,"chat":10,"bulk":-5}}"#).unwrap()
    }

    #[test]
    fn listed_names_get_their_priority_everything_else_the_default() {
        let c = cfg();
        assert_eq!(c.header, "x-gateway-inference-objective");
        let p = |v: Option<&str>| c.resolve(v).priority;
        assert_eq!(p(Some("batch")), -1);
        assert_eq!(p(Some(" chat ")), 10);
        assert_eq!(p(Some("bulk")), -5);
        for v in [
            None,
            Some(""),
            Some("Chat"),
            Some("chat,batch"),
            Some("admin"),
        ] {
            assert_eq!(p(v), 0, "{v:?}");
            assert_eq!(c.resolve(v).index, None);
        }
        let long = "chat".repeat(10_000);
        assert_eq!(p(Some(&long)), 0);
        // Indices follow the sorted names (stats).
        let names: Vec<&str> = c.names().collect();
        assert_eq!(names, ["batch", "bulk", "chat"]);
        assert_eq!(c.resolve(Some("chat")).index, Some(2));
        assert!(c.resolve(Some("batch")).sheddable());
        assert!(!c.resolve(None).sheddable());
        assert!(!Objective::DEFAULT.sheddable());
    }

    #[test]
    fn names_become_stat_names_so_they_are_checked() {
        for bad in [
            r#"{"priorities":{"a.b":1}}"#,
            r#"{"priorities":{"":1}}"#,
            r#"{"priorities":{"A":1}}"#,
        ] {
            let c: ObjectivesConfig = serde_json::from_str(bad).unwrap();
            assert!(c.validate().is_err(), "{bad}");
        }
        assert!(cfg().validate().is_ok());
    }
}
