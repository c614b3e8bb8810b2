//! What an endpoint says it serves: its own `GET /v1/models` answer.
//!
//! A `models` entry without `endpoints` is served by the pool members
//! (static or discovered) whose list names the requested model. vLLM,
//! SGLang and llama.cpp all answer the OpenAI list shape
//! `{"object":"list","data":[{"id":...,...},...]}`; vLLM lists every
//! `--served-model-name` and every loaded LoRA adapter (with `parent`: its
//! base model), so an adapter an endpoint lists is an adapter it serves.
//! Only `data[].id` is read; every other field (and the `models` array
//! llama.cpp adds beside `data`) is skipped.
//!
//! Bounded whatever the endpoint sends: a body over [`MAX_BODY_BYTES`] is
//! never copied into the VM, at most [`MAX_IDS`] ids are kept per endpoint
//! (the first ones listed; a model beyond the cap is not served there as
//! far as kvroute knows), and ids are kept as 32-bit hashes
//! ([`crate::metrics::lora::adapter_id`], the hash adapters already use):
//! the scrape state every worker decodes on every tick stays small. A
//! collision could only send a request for a configured model to an
//! endpoint listing another name with the same hash (about 64 in 4 billion
//! per endpoint).

use crate::metrics::lora::{adapter_id, AdapterId};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::borrow::Cow;
use std::sync::Arc;

/// The path asked on every endpoint (the OpenAI list of models).
pub const LIST_PATH: &str = "/v1/models";
/// Largest `/v1/models` answer read (a vLLM card is ~400 bytes with its
/// permission object: 64 adapters fit 10 times over).
pub const MAX_BODY_BYTES: usize = 256 * 1024;
/// Most model ids kept per endpoint.
pub const MAX_IDS: usize = 64;

/// A served model name's id: the same hash as an adapter's.
pub type ModelId = AdapterId;

/// The id of a model name as an endpoint lists it.
pub fn model_id(name: &str) -> ModelId {
    adapter_id(name)
}

/// The ids one endpoint listed, sorted and distinct, and when.
///
/// Shared behind an `Arc`: a scrape state is copied whole where one is
/// looked up (`EndpointStates::get`), and a list is one pointer to copy,
/// not up to 64 ids.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServedModels {
    /// When the list was read (wall-clock ms).
    pub listed_at_ms: u64,
    /// Sorted, distinct, at most [`MAX_IDS`].
    #[serde(serialize_with = "ser_ids", deserialize_with = "de_ids")]
    pub ids: Arc<[ModelId]>,
}

fn ser_ids<S: Serializer>(ids: &Arc<[ModelId]>, s: S) -> Result<S::Ok, S::Error> {
    ids.as_ref().serialize(s)
}

fn de_ids<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<[ModelId]>, D::Error> {
    Ok(normalized(Vec::<ModelId>::deserialize(d)?).into())
}

/// Sorted, distinct, capped.
pub(crate) fn normalized(mut ids: Vec<ModelId>) -> Vec<ModelId> {
    ids.truncate(MAX_IDS);
    ids.sort_unstable();
    ids.dedup();
    ids
}

impl ServedModels {
    /// A list read at `now_ms`.
    pub fn new(ids: Vec<ModelId>, now_ms: u64) -> ServedModels {
        ServedModels {
            listed_at_ms: now_ms,
            ids: normalized(ids).into(),
        }
    }

    /// Whether the endpoint listed the model of id `id`.
    pub fn serves(&self, id: ModelId) -> bool {
        self.ids.binary_search(&id).is_ok()
    }
}

/// A `/v1/models` answer, read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListingOutcome {
    /// The ids listed (distinct, at most [`MAX_IDS`]) and whether more were
    /// listed than kept.
    Listed {
        /// Ids, in listing order.
        ids: Vec<ModelId>,
        /// More than [`MAX_IDS`] distinct ids were listed.
        truncated: bool,
    },
    /// The endpoint answered, but not with a readable list (a 4xx, a body
    /// that is not the OpenAI list, or one over [`MAX_BODY_BYTES`]): the
    /// previous list is kept.
    Unreadable,
    /// No answer, a timeout or a server error: the previous list is kept.
    Unreachable,
}

#[derive(Deserialize)]
struct List<'a> {
    #[serde(borrow)]
    data: Vec<Card<'a>>,
}

#[derive(Deserialize)]
struct Card<'a> {
    #[serde(borrow)]
    id: Cow<'a, str>,
}

/// Reads a `/v1/models` answer from its HTTP status (`None`: no response)
/// and body (`None`: over [`MAX_BODY_BYTES`], not copied).
pub fn classify(status: Option<u16>, body: Option<&[u8]>) -> ListingOutcome {
    match (status, body) {
        (Some(200), Some(body)) => parse(body).unwrap_or(ListingOutcome::Unreadable),
        (Some(s), _) if (100..500).contains(&s) => ListingOutcome::Unreadable,
        _ => ListingOutcome::Unreachable,
    }
}

/// The ids of an OpenAI model list; `None` when the body is not one.
pub fn parse(body: &[u8]) -> Option<ListingOutcome> {
    if body.len() > MAX_BODY_BYTES {
        return None;
    }
    let list: List = serde_json::from_slice(body).ok()?;
    let mut ids: Vec<ModelId> = Vec::new();
    let mut truncated = false;
    for card in list.data.iter().filter(|c| !c.id.is_empty()) {
        let id = model_id(&card.id);
        if ids.contains(&id) {
            continue;
        }
        if ids.len() == MAX_IDS {
            truncated = true;
            break;
        }
        ids.push(id);
    }
    Some(ListingOutcome::Listed { ids, truncated })
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn listed(body: &str) -> Vec<ModelId> {
        match parse(body.as_bytes()) {
            Some(ListingOutcome::Listed { ids, truncated }) => {
                assert!(!truncated);
                ids
            }
            other => panic!("{other:?}"),
        }
    }

    fn hashes(names: &[&str]) -> Vec<ModelId> {
        names.iter().map(|n| model_id(n)).collect()
    }

    #[test]
    fn real_engine_lists() {
        // tests/fixtures/models/SOURCES.md says where each comes from.
        let vllm = include_str!("../../../tests/fixtures/models/vllm-lora-adapters.json");
        assert_eq!(
            listed(vllm),
            hashes(&["meta-llama/Llama-3.1-8B-Instruct", "sql-lora", "sql-lora-2"])
        );
        let vllm2 = include_str!("../../../tests/fixtures/models/vllm-served-model-names.json");
        assert_eq!(listed(vllm2), hashes(&["opt-125m", "gpt-125m"]));
        let sglang = include_str!("../../../tests/fixtures/models/sglang.json");
        assert_eq!(
            listed(sglang),
            hashes(&["meta-llama/Llama-3.1-8B-Instruct"])
        );
        // llama-server without `--alias`: the id is the model file's path.
        let llama = include_str!("../../../tests/fixtures/models/llamacpp-11434-smollm2.json");
        assert_eq!(
            listed(llama),
            hashes(&["/root/.cache/kvroute/models/smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf"])
        );
    }

    #[test]
    fn garbage_is_unreadable_and_errors_keep_the_previous_list() {
        for bad in [
            &b""[..],
            b"{}",
            b"[]",
            b"{\"data\":{}}",
            b"{\"data\":[{\"name\":\"x\"}]}",
            b"{\"data\":[{\"id\":7}]}",
            b"\xff\xfe",
            b"<html>",
        ] {
            assert_eq!(
                classify(Some(200), Some(bad)),
                ListingOutcome::Unreadable,
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let ok = br#"{"data":[{"id":"a"}]}"#;
        assert_eq!(
            classify(Some(200), Some(ok)),
            ListingOutcome::Listed {
                ids: hashes(&["a"]),
                truncated: false
            }
        );
        assert_eq!(classify(Some(404), Some(ok)), ListingOutcome::Unreadable);
        assert_eq!(classify(Some(200), None), ListingOutcome::Unreadable);
        assert_eq!(classify(Some(503), Some(ok)), ListingOutcome::Unreachable);
        assert_eq!(classify(None, None), ListingOutcome::Unreachable);
        // An empty list is a list: the endpoint serves nothing.
        assert!(listed(r#"{"object":"list","data":[]}"#).is_empty());
    }

    #[test]
    fn ids_are_bounded_and_distinct() {
        let cards: Vec<String> = (0..200)
            .map(|i| format!(r#"{{"id":"m{}"}}"#, i % 100))
            .collect();
        let body = format!(r#"{{"data":[{}]}}"#, cards.join(","));
        let Some(ListingOutcome::Listed { ids, truncated }) = parse(body.as_bytes()) else {
            panic!();
        };
        assert!(truncated);
        assert_eq!(ids.len(), MAX_IDS);
        assert_eq!(ids[0], model_id("m0"));
        let big = format!(r#"{{"data":[{{"id":"{}"}}]}}"#, "x".repeat(MAX_BODY_BYTES));
        assert_eq!(parse(big.as_bytes()), None);
        let s = ServedModels::new(ids.clone(), 5);
        assert!(s.ids.windows(2).all(|w| w[0] < w[1]));
        assert!(s.serves(model_id("m63")));
        assert!(!s.serves(model_id("m64")));
        // Escaped ids are read as the string they encode.
        assert_eq!(listed(r#"{"data":[{"id":"a\/b"}]}"#), hashes(&["a/b"]));
    }
}
