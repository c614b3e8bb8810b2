//! The `model` field alone, for bodies the full parse did not understand
//! (too many tool values, a wrong type elsewhere, cut at `max_body_bytes`)
//! and for the inference APIs kvroute does not hash (`/v1/embeddings`, ...).
//! With `models` configured the model still picks the endpoints, so such a
//! request reaches a pod that serves it rather than any pod.
//!
//! One pass over the top-level object, everything but `model` skipped
//! unread ([`IgnoredAny`]); the last `model` seen before the end or the
//! first error wins (the last one is what the Python servers use when the
//! body is whole). Heap: the model string, plus serde_json's scratch for
//! a skipped string with escapes (at most the body).

use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use std::cell::RefCell;
use std::fmt;

/// The top-level `model` string of a JSON object body (whole, or its first
/// part), if one could be read.
pub fn read_model(body: &[u8]) -> Option<String> {
    let found = RefCell::new(None);
    let mut de = serde_json::Deserializer::from_slice(body);
    // An error (truncation, bad JSON, not an object) only ends the scan.
    let _ = (&mut de).deserialize_map(ModelVisitor(&found));
    found.into_inner()
}

struct ModelVisitor<'a>(&'a RefCell<Option<String>>);

impl<'de> Visitor<'de> for ModelVisitor<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if key == "model" {
                // `"model": 3` names no model; a cut body keeps the last one read.
                *self.0.borrow_mut() = map.next_value::<ModelValue>()?.0;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// A `model` value: a string, or anything else (skipped unread) naming none.
struct ModelValue(Option<String>);

impl<'de> serde::Deserialize<'de> for ModelValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ModelValueVisitor)
    }
}

struct ModelValueVisitor;

impl<'de> Visitor<'de> for ModelValueVisitor {
    type Value = ModelValue;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_str<E>(self, s: &str) -> Result<ModelValue, E> {
        Ok(ModelValue(Some(s.to_owned())))
    }
    fn visit_bool<E>(self, _: bool) -> Result<ModelValue, E> {
        Ok(ModelValue(None))
    }
    fn visit_i64<E>(self, _: i64) -> Result<ModelValue, E> {
        Ok(ModelValue(None))
    }
    fn visit_u64<E>(self, _: u64) -> Result<ModelValue, E> {
        Ok(ModelValue(None))
    }
    fn visit_f64<E>(self, _: f64) -> Result<ModelValue, E> {
        Ok(ModelValue(None))
    }
    fn visit_unit<E>(self) -> Result<ModelValue, E> {
        Ok(ModelValue(None))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<ModelValue, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(ModelValue(None))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ModelValue, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(ModelValue(None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn reads_the_model_of_whole_cut_and_odd_bodies() {
        for (body, want) in [
            (&br#"{"model":"a","input":"x"}"#[..], Some("a")),
            (br#"{"input":[1,2,{"x":[]}],"model":"b"}"#, Some("b")),
            (br#"{"model":"a","model":"c"}"#, Some("c")),
            (br#"{"model":"a","input":"cut here"#, Some("a")),
            (br#"{"model":"m\u00e9"}"#, Some("m\u{e9}")),
            (br#"{"input":"x"}"#, None),
            (br#"{"model":3}"#, None),
            (br#"{"model":"a","model":{"x":[1]}}"#, None),
            (br#"{"model":"a","model":"cu"#, Some("a")),
            (br#"["model","a"]"#, None),
            (b"\xff\xfe", None),
            (b"", None),
        ] {
            assert_eq!(
                read_model(body).as_deref(),
                want,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn deep_nesting_elsewhere_is_an_error_not_a_crash() {
        let mut body = String::from(r#"{"model":"a","x":"#);
        body.push_str(&"[".repeat(100_000));
        assert_eq!(read_model(body.as_bytes()).as_deref(), Some("a"));
    }
}
