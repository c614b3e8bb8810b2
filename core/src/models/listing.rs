//! `GET /v1/models` and `GET /v1/models/{id}` answered by the gateway from
//! the `models` section, in the OpenAI list shape vLLM serves:
//! `{"object":"list","data":[{"id":...,"object":"model","created":0,
//! "owned_by":"kvroute","root":...,"parent":...}]}`. An adapter's `parent`
//! is its base model (as vLLM lists a LoRA adapter), a base model's is
//! `null`. Only exact names are listed: a `*` family names no model a
//! client could ask for by that string.
//!
//! Built from the config, not by asking the pods: the answer is what the
//! gateway routes, which is what a client needs (a pod may serve more).

use super::{ModelName, ModelPools};
use serde_json::{json, Value};

/// Path prefix of the retrieve-one-model API.
const ONE: &str = "/v1/models/";

/// What the gateway answers on a models path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelsReply {
    /// 200 with this JSON body.
    Found(String),
    /// The id is not served: 404 `model_not_found`.
    NotFound,
}

fn entry(id: &str, parent: Option<&str>) -> Value {
    json!({
        "id": id,
        "object": "model",
        "created": 0,
        "owned_by": "kvroute",
        "root": id,
        "parent": parent,
    })
}

/// Every listable model, base models then their adapters, in config order.
fn listed(pools: &ModelPools) -> Vec<Value> {
    let mut out = Vec::new();
    for p in pools.entries() {
        let base = p.name.exact();
        if let Some(b) = base {
            out.push(entry(b, None));
        }
        for a in p.adapters.iter().filter_map(ModelName::exact) {
            out.push(entry(a, base));
        }
    }
    out
}

/// The gateway's answer to `GET canonical_path`, when the path is a models
/// path and `models` is configured; `None` otherwise (the request goes on).
pub fn answer(pools: &ModelPools, canonical_path: &str) -> Option<ModelsReply> {
    if pools.is_empty() {
        return None;
    }
    if canonical_path == "/v1/models" {
        let body = json!({"object": "list", "data": listed(pools)});
        return Some(ModelsReply::Found(body.to_string()));
    }
    let id = canonical_path.strip_prefix(ONE)?;
    let found = listed(pools).into_iter().find(|m| m["id"] == id);
    Some(match found {
        Some(m) => ModelsReply::Found(m.to_string()),
        None => ModelsReply::NotFound,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::ModelPool;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn pools() -> ModelPools {
        let p: Vec<ModelPool> = serde_json::from_str(
            r#"[{"name":"meta-llama/Llama-3.1-8B-Instruct","endpoints":["10.0.0.1:80"],"adapters":["sql-lora","fin-*"]},
                {"name":"qwen-*","endpoints":["10.0.0.2:80"],"adapters":["qwen-helper"]}]"#,
        )
        .unwrap();
        ModelPools::new(&p)
    }

    #[test]
    fn lists_exact_names_with_adapters_under_their_base() {
        let Some(ModelsReply::Found(body)) = answer(&pools(), "/v1/models") else {
            panic!("no list");
        };
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["object"], "list");
        let ids: Vec<(&str, &Value)> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["id"].as_str().unwrap(), &m["parent"]))
            .collect();
        assert_eq!(
            ids,
            [
                ("meta-llama/Llama-3.1-8B-Instruct", &Value::Null),
                ("sql-lora", &json!("meta-llama/Llama-3.1-8B-Instruct")),
                ("qwen-helper", &Value::Null),
            ]
        );
    }

    #[test]
    fn retrieves_one_or_answers_not_found() {
        let p = pools();
        let Some(ModelsReply::Found(body)) =
            answer(&p, "/v1/models/meta-llama/Llama-3.1-8B-Instruct")
        else {
            panic!("not found");
        };
        assert!(body.contains("\"object\":\"model\""));
        assert_eq!(
            answer(&p, "/v1/models/qwen-7b"),
            Some(ModelsReply::NotFound)
        );
        assert_eq!(answer(&p, "/v1/chat/completions"), None);
        assert_eq!(answer(&ModelPools::default(), "/v1/models"), None);
    }
}
