//! Model-aware pools: which endpoints serve which model.
//!
//! A gateway in front of several models must send a request only to the
//! endpoints that serve its `model`. The `models` section of the config
//! lists entries; each names a base model (exactly, or a family by a
//! trailing `*`: `"qwen-*"`), the endpoints serving it (a subset of
//! `endpoints`), and the LoRA adapters those endpoints serve on top of it.
//! An entry may leave its endpoints out: then they are the pool members
//! (static or discovered) whose own `GET /v1/models` lists the requested
//! name ([`served`]; the scraper reads it), the only form `discovery`
//! allows. A request's `model` resolves to one entry:
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
pub mod served;

use crate::config::{err, ConfigError};
use crate::endpoint::Endpoint;
use crate::metrics::lora::adapter_id;
use crate::shared::endpoint_state::{EndpointStates, ScrapeState};
use crate::sorted_lookup::SortedLookup;
use serde::Deserialize;
use served::{model_id, ModelId};
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
    /// The endpoints serving it; each must be in `endpoints`. Empty (left
    /// out): the pool members whose `GET /v1/models` lists the request's
    /// model ([`served`]).
    #[serde(default)]
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
        /// When the entry's endpoints are the ones listing the model (no
        /// `endpoints` in the config): the requested name's id
        /// ([`served::model_id`]); an endpoint serves the request when its
        /// `/v1/models` lists that id.
        listed: Option<ModelId>,
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

    /// Whether some entry leaves its endpoints to `/v1/models` (the scraper
    /// then reads every endpoint's list).
    pub fn lists(&self) -> bool {
        self.entries.iter().any(|e| e.endpoints.is_empty())
    }

    /// Whether `endpoint`, whose scrape state is `state`, may serve a
    /// request of `scope`. An endpoint whose list is not known yet serves
    /// no listed model.
    pub fn serves(&self, scope: Scope, endpoint: Endpoint, state: &ScrapeState) -> bool {
        match scope {
            Scope::All => true,
            Scope::Model {
                listed: Some(id), ..
            } => state.served.as_ref().is_some_and(|s| s.serves(id)),
            Scope::Model { pool, .. } => self.endpoints(pool).binary_search(&endpoint).is_ok(),
        }
    }

    /// [`Self::serves`] for a walk over endpoints in ascending order (a
    /// decision's walk over the pool): a static entry's endpoints (sorted)
    /// are read with a cursor (`sorted_lookup`) instead of a binary search
    /// per endpoint, which made a request for one of two models over 1024
    /// endpoints cost twice a decision over all of them. Any order is still
    /// answered right.
    pub fn serves_in_order(&self, scope: Scope) -> impl Fn(&Endpoint, &ScrapeState) -> bool + '_ {
        let members = match scope {
            Scope::Model {
                pool, listed: None, ..
            } => Some(SortedLookup::new(self.endpoints(pool), itself)),
            _ => None,
        };
        move |endpoint, state| match &members {
            Some(members) => members.get(endpoint).is_some(),
            None => self.serves(scope, *endpoint, state),
        }
    }

    /// Whether a request of `scope` has nowhere to go yet: its entry's
    /// endpoints are the listing ones, and no member of `pool` (sorted) whose scrapes
    /// answer (fewer than `unhealthy_after` failures in a row) lists it.
    /// The gateway answers 503 then (the model is configured; a pod serving
    /// it may come, or come back). Static entries are never unserved: their
    /// endpoints are fixed, and the health filter falls back among them.
    pub fn unserved(
        &self,
        scope: Scope,
        pool: &[Endpoint],
        states: &EndpointStates,
        unhealthy_after: u32,
    ) -> bool {
        if !matches!(
            scope,
            Scope::Model {
                listed: Some(_),
                ..
            }
        ) {
            return false;
        }
        // An endpoint without an entry has listed nothing: only the entries
        // can serve (no copy of any state: this runs per request).
        !states.entries.iter().any(|(e, s)| {
            s.healthy(unhealthy_after) && self.serves(scope, *e, s) && pool.binary_search(e).is_ok()
        })
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
                listed: self.listed(pool, model),
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
                listed: self.listed(pool, model),
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
                        let listed = self.listed(pool, model);
                        let scope = Scope::Model {
                            pool,
                            adapter,
                            listed,
                        };
                        best = Some((p.len(), scope));
                    }
                }
            }
        }
        best.map(|(_, s)| s)
    }

    /// `Scope::Model::listed` of a request for `model` resolved to `pool`.
    fn listed(&self, pool: usize, model: &str) -> Option<ModelId> {
        self.endpoints(pool).is_empty().then(|| model_id(model))
    }
}

/// Checks `models` against the rest of the config: an entry's endpoints,
/// when listed, are all in `endpoints`; no name or pattern is declared
/// twice; with every entry's endpoints listed, every endpoint serves some
/// model; with `discovery`, no entry lists endpoints (the pool is not
/// known at load: the endpoints' own `/v1/models` decide).
pub fn validate(
    models: &[ModelPool],
    endpoints: &[Endpoint],
    discovery: bool,
) -> Result<(), ConfigError> {
    if models.is_empty() {
        return Ok(());
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
        if discovery && !m.endpoints.is_empty() {
            return Err(err(
                &format!("models[{i}].endpoints"),
                m.endpoints.len(),
                "cannot be listed with discovery (the pool is discovered): leave it out, and the endpoints whose GET /v1/models lists the model serve it",
            ));
        }
        if m.endpoints.len() > 1024 {
            return Err(err(
                &format!("models[{i}].endpoints"),
                m.endpoints.len(),
                "at most 1024 endpoints (or none: the endpoints listing the model)",
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
    // With an entry left to `/v1/models`, any endpoint may serve it.
    let listed = models.iter().any(|m| m.endpoints.is_empty());
    for (i, e) in endpoints.iter().enumerate() {
        if !listed && !models.iter().any(|m| m.endpoints.contains(e)) {
            return Err(err(
                &format!("endpoints[{i}]"),
                e,
                "in no `models` entry: it would never get a request",
            ));
        }
    }
    Ok(())
}

/// The key of a sorted list of endpoints.
fn itself(e: &Endpoint) -> &Endpoint {
    e
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
                listed: None,
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
    fn serving_in_order_is_serving() {
        let mut rng = fastrand::Rng::with_seed(4);
        let listed = ModelPools::new(&pools(r#"[{"name":"listed"}]"#));
        for round in 0..300 {
            // Distinct, in no order (`validate` rejects an endpoint listed twice).
            let members = |rng: &mut fastrand::Rng| -> Vec<String> {
                let mut v: Vec<String> = (0..rng.usize(1..12))
                    .map(|_| ep(rng.u8(1..30)).to_string())
                    .collect();
                v.sort_unstable();
                v.dedup();
                rng.shuffle(&mut v);
                v
            };
            let json = serde_json::json!([
                {"name": "a", "endpoints": members(&mut rng)},
                {"name": "b", "endpoints": members(&mut rng)},
            ]);
            let entries: Vec<ModelPool> = serde_json::from_value(json).unwrap();
            let t = ModelPools::new(&entries);
            let mut walk: Vec<Endpoint> =
                (0..rng.usize(0..40)).map(|_| ep(rng.u8(1..32))).collect();
            // Mostly ascending walks (a decision's), sometimes any order.
            if rng.u8(0..4) != 0 {
                walk.sort_unstable();
                walk.dedup();
            }
            let state = ScrapeState::default();
            for (t, model) in [
                (&t, Some("a")),
                (&t, Some("b")),
                (&t, None),
                (&listed, Some("listed")),
            ] {
                let scope = t.scope(model).unwrap();
                let in_order = t.serves_in_order(scope);
                for e in &walk {
                    assert_eq!(
                        in_order(e, &state),
                        t.serves(scope, *e, &state),
                        "round {round}: {e} for {model:?} in {walk:?}"
                    );
                }
            }
        }
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
        // Explicit endpoints and discovery: the first entry listing them is named.
        let e = validate(&pools(TABLE), &eps, true).unwrap_err();
        assert_eq!(e.field, "models[0].endpoints");
        assert!(e.reason.contains("discovery"), "{e}");
        let listed = r#"[{"name":"a","adapters":["a-*"]},{"name":"b-*"}]"#;
        assert!(validate(&pools(listed), &[], true).is_ok(), "discovery");
        assert!(validate(&pools(listed), &eps, false).is_ok(), "static pool");
        // An entry left to /v1/models may serve any endpoint: no endpoint
        // is idle by construction.
        let mixed = r#"[{"name":"a","endpoints":["10.0.0.1:8000"]},{"name":"b"}]"#;
        assert!(validate(&pools(mixed), &eps, false).is_ok());
        assert_eq!(
            validate(&pools(mixed), &[], true).unwrap_err().field,
            "models[0].endpoints"
        );
        for (json, field) in [
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

#[cfg(test)]
mod listed_tests {
    use super::served::{model_id, ServedModels};
    use super::*;
    use crate::metrics::MetricsSnapshot;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn ep(i: u8) -> Endpoint {
        format!("10.0.0.{i}:8000").parse().unwrap()
    }

    /// Entries 0 and 1 are left to `/v1/models`; entry 2 lists endpoint 9.
    fn table() -> ModelPools {
        let p: Vec<ModelPool> = serde_json::from_str(
            r#"[{"name":"llama-8b","adapters":["sql-*"]},
                {"name":"qwen-*"},
                {"name":"static","endpoints":["10.0.0.9:8000"]}]"#,
        )
        .unwrap();
        ModelPools::new(&p)
    }

    /// Endpoint 1 lists llama-8b and its adapter sql-lora, endpoint 2
    /// qwen-7b, endpoint 3 answered an empty list, endpoint 4 never listed.
    fn states() -> EndpointStates {
        let mut t = EndpointStates::default();
        for (e, names) in [
            (ep(1), &["llama-8b", "sql-lora"][..]),
            (ep(2), &["qwen-7b"][..]),
            (ep(3), &[][..]),
        ] {
            let ids = names.iter().map(|n| model_id(n)).collect();
            t.listed(e, ServedModels::new(ids, 10));
        }
        for e in [ep(1), ep(2), ep(3), ep(4), ep(9)] {
            t.succeed(e, MetricsSnapshot::default(), 10);
        }
        t
    }

    fn serving(t: &ModelPools, states: &EndpointStates, model: &str) -> Vec<Endpoint> {
        let scope = t.scope(Some(model)).unwrap();
        [ep(1), ep(2), ep(3), ep(4), ep(9)]
            .into_iter()
            .filter(|e| t.serves(scope, *e, &states.get(*e)))
            .collect()
    }

    #[test]
    fn a_listed_entry_is_served_by_the_endpoints_listing_the_requested_name() {
        let t = table();
        assert!(t.lists());
        let s = states();
        assert_eq!(serving(&t, &s, "llama-8b"), [ep(1)]);
        assert_eq!(serving(&t, &s, "sql-lora"), [ep(1)], "adapter it lists");
        assert_eq!(serving(&t, &s, "sql-other"), [], "adapter nobody lists");
        assert_eq!(serving(&t, &s, "qwen-7b"), [ep(2)]);
        // A family admits the name; the pods decide who serves it exactly.
        assert_eq!(serving(&t, &s, "qwen-72b"), []);
        // Static entries are unchanged: their list, never /v1/models.
        assert_eq!(serving(&t, &s, "static"), [ep(9)]);
        assert_eq!(
            t.scope(Some("qwen-7b")),
            Ok(Scope::Model {
                pool: 1,
                adapter: None,
                listed: Some(model_id("qwen-7b"))
            })
        );
        assert_eq!(t.scope(Some("mistral")), Err(ModelNotFound));
        assert!(!ModelPools::new(&[]).lists());
    }

    #[test]
    fn a_listed_model_with_no_healthy_listing_endpoint_is_unserved() {
        let t = table();
        let mut s = states();
        let pool = [ep(1), ep(2), ep(3), ep(4), ep(9)];
        let unserved =
            |s: &EndpointStates, m: &str| t.unserved(t.scope(Some(m)).unwrap(), &pool, s, 3);
        assert!(!unserved(&s, "llama-8b"));
        assert!(unserved(&s, "qwen-72b"), "configured, listed by nobody");
        assert!(!unserved(&s, "static"), "static entries never are");
        assert!(!t.unserved(Scope::All, &pool, &s, 3));
        // Endpoint 1 stops answering scrapes: llama-8b has nowhere to go.
        for _ in 0..3 {
            s.fail(ep(1));
        }
        assert!(unserved(&s, "llama-8b"));
        // Out of the pool (discovery removed it): the same.
        let s = states();
        assert!(t.unserved(t.scope(Some("llama-8b")).unwrap(), &pool[1..], &s, 3));
    }

    #[test]
    fn the_router_decides_a_listed_model_only_among_the_endpoints_listing_it() {
        use crate::config::Config;
        use crate::inflight::InFlight;
        use crate::outlier::OutlierTable;
        use crate::router::Router;
        let c = Config::from_json(
            br#"{"endpoints":["10.0.0.1:8000","10.0.0.2:8000","10.0.0.3:8000","10.0.0.4:8000"],
                "models":[{"name":"a"},{"name":"b"}],"scheduling":{"seed":1}}"#,
        )
        .unwrap();
        let r = Router::new(c);
        let mut t = EndpointStates::default();
        for (e, names) in [
            (ep(1), &["a"][..]),
            (ep(2), &["b"][..]),
            (ep(3), &["a", "b"][..]),
        ] {
            t.listed(
                e,
                ServedModels::new(names.iter().map(|n| model_id(n)).collect(), 1),
            );
        }
        for i in 1..=4 {
            t.succeed(ep(i), MetricsSnapshot::default(), 1_000);
        }
        let mut rng = fastrand::Rng::with_seed(3);
        let none = OutlierTable::default();
        for (model, allowed) in [("a", [ep(1), ep(3)]), ("b", [ep(2), ep(3)])] {
            let scope = r.scope(Some(model)).unwrap();
            let mut seen = Vec::new();
            for k in 0..40u64 {
                let blocks = [k * 7919 + 1];
                let d = r
                    .decide_in(
                        scope,
                        &blocks[..],
                        16,
                        &t,
                        &none,
                        |_| InFlight::default(),
                        1_010,
                        &mut rng,
                    )
                    .unwrap();
                assert!(allowed.contains(&d.endpoint), "{model} on {}", d.endpoint);
                assert!(
                    d.scores.iter().all(|(e, _)| allowed.contains(e)),
                    "{model}: {:?}",
                    d.scores
                );
                seen.push(d.endpoint);
            }
            seen.sort();
            seen.dedup();
            assert_eq!(seen, allowed, "{model}: both listing endpoints take work");
        }
        // Nobody listing it: no decision at all (the gateway answered 503 first).
        let mut t2 = t.clone();
        t2.forget_served(ep(1));
        t2.forget_served(ep(3));
        let a = r.scope(Some("a")).unwrap();
        assert!(r.models().unserved(a, r.pool(), &t2, 3));
        assert!(r
            .decide_in(
                a,
                &[1u64][..],
                16,
                &t2,
                &none,
                |_| InFlight::default(),
                1_010,
                &mut rng
            )
            .is_none());
    }
}
