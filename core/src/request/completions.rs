//! The canonical prompt of `/v1/completions`: a string, a list of strings
//! (a batch), a list of token ids, or a list of token-id lists, written
//! into the hasher item by item as it is read (no vector of items or ids).

use crate::prefix::block::BlockHasher;
use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};
use std::fmt;

/// Separates the prompts of a batch.
pub(super) const NEXT_PROMPT: &[u8] = b"\n<|next_prompt|>\n";
/// Opens a token-id prompt (each id follows as 4 little-endian bytes).
pub(super) const TOKEN_IDS: &[u8] = b"<|token_ids|>";

/// The kind of a prompt list's items (a list must not mix them).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Items {
    Texts,
    Ids,
    IdLists,
}

/// The `prompt` field, hashed as it is read: `true` when it holds a
/// prompt (`null` and `[]` do not).
pub(super) struct PromptSeed<'h> {
    pub(super) h: &'h mut BlockHasher,
}

impl<'de> DeserializeSeed<'de> for PromptSeed<'_> {
    type Value = bool;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptSeed<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string, a list of strings or token ids")
    }

    fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<bool, E> {
        self.h.write(s.as_bytes());
        Ok(true)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        let mut kind = None;
        while seq
            .next_element_seed(ItemSeed {
                h: &mut *self.h,
                kind: &mut kind,
            })?
            .is_some()
        {}
        Ok(kind.is_some())
    }
}

/// One item of a prompt list; `kind` is the kind of the items so far.
struct ItemSeed<'h, 'k> {
    h: &'h mut BlockHasher,
    kind: &'k mut Option<Items>,
}

impl ItemSeed<'_, '_> {
    /// Checks the item's kind against the list's, writing the separator
    /// that goes before an item of that kind.
    fn start<E: de::Error>(&mut self, item: Items) -> Result<(), E> {
        match *self.kind {
            None => *self.kind = Some(item),
            Some(k) if k != item => return Err(E::custom("prompt list mixes kinds of items")),
            Some(_) if item != Items::Ids => self.h.write(NEXT_PROMPT),
            Some(_) => return Ok(()),
        }
        if item != Items::Texts {
            self.h.write(TOKEN_IDS);
        }
        Ok(())
    }
}

impl<'de> DeserializeSeed<'de> for ItemSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ItemSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string, a token id or a list of token ids")
    }

    fn visit_str<E: de::Error>(mut self, s: &str) -> Result<(), E> {
        self.start(Items::Texts)?;
        self.h.write(s.as_bytes());
        Ok(())
    }

    fn visit_u64<E: de::Error>(mut self, v: u64) -> Result<(), E> {
        let id = u32::try_from(v).map_err(|_| E::custom("token id out of range"))?;
        self.start(Items::Ids)?;
        self.h.write(&id.to_le_bytes());
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        self.start(Items::IdLists)?;
        while let Some(id) = seq.next_element::<u32>()? {
            self.h.write(&id.to_le_bytes());
        }
        Ok(())
    }
}
