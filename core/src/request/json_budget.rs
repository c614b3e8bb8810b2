//! `tools` and `tool_calls` are the only parts of a body kvroute builds as
//! JSON values: their canonical text sorts object keys, so that a client
//! that reorders keys between turns keeps its prefix. A value tree costs
//! far more memory than its text (`[[],[],...]` is 3 bytes of body per
//! element, tens of bytes of tree), so it is built under a budget of JSON
//! values per request; a body over the budget is not read further.

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use std::cell::Cell;
use std::fmt;

/// Upper bound of the heap one budgeted JSON value (or object key) costs,
/// its text excluded, on 64-bit targets (wasm32 pointers are half as wide):
/// the value itself, its slot in the parent vector or map (doubling growth
/// included), and B-tree node overhead. Measured by `tests/hostile_bodies.rs`.
pub(super) const BYTES_PER_NODE: usize = 128;

/// JSON values (and object keys) still allowed for one request.
pub(super) struct Budget {
    left: Cell<usize>,
    exceeded: Cell<bool>,
}

impl Budget {
    /// A budget of `nodes` JSON values.
    pub(super) fn new(nodes: usize) -> Budget {
        Budget {
            left: Cell::new(nodes),
            exceeded: Cell::new(false),
        }
    }

    /// Whether a value was refused for lack of budget.
    pub(super) fn exceeded(&self) -> bool {
        self.exceeded.get()
    }

    fn take<E: de::Error>(&self) -> Result<(), E> {
        match self.left.get().checked_sub(1) {
            Some(left) => {
                self.left.set(left);
                Ok(())
            }
            None => {
                self.exceeded.set(true);
                Err(E::custom("JSON value budget exceeded"))
            }
        }
    }
}

/// Deserializes a [`Value`], charging every value and key to the budget.
pub(super) struct Bounded<'b>(pub(super) &'b Budget);

impl<'de> DeserializeSeed<'de> for Bounded<'_> {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Bounded<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        self.0.take()?;
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        self.0.take()?;
        Ok(Value::from(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        self.0.take()?;
        Ok(Value::from(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        self.0.take()?;
        Ok(Value::from(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        self.0.take()?;
        Ok(Value::String(v.to_owned()))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        self.0.take()?;
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.0.take()?;
        let mut items = Vec::new();
        while let Some(v) = seq.next_element_seed(Bounded(self.0))? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.0.take()?;
        let mut m = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            self.0.take()?;
            let v = map.next_value_seed(Bounded(self.0))?;
            m.insert(k, v);
        }
        Ok(Value::Object(m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn read(text: &str, nodes: usize) -> (Result<Value, serde_json::Error>, bool) {
        let b = Budget::new(nodes);
        let mut de = serde_json::Deserializer::from_str(text);
        (Bounded(&b).deserialize(&mut de), b.exceeded())
    }

    #[test]
    fn counts_every_value_and_key() {
        let text = r#"{"a":[1,2.5,-3,"s",null,true],"b":{}}"#;
        // object, a, array, 6 scalars, b, {} = 11
        let (v, over) = read(text, 11);
        assert!(!over);
        assert_eq!(v.unwrap(), serde_json::from_str::<Value>(text).unwrap());
        let (v, over) = read(text, 10);
        assert!(over && v.is_err());
    }
}
