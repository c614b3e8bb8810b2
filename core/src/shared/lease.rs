//! The scraper lease: exactly one VM (of all Envoy workers, the main thread
//! and any short-lived canary) scrapes `/metrics` per interval. The lease is
//! one shared-data value `{owner, expires_ms}` that VMs renew or take over
//! with compare-and-swap on every tick; if its owner goes away, another VM
//! takes over once it expires.

/// Who holds the scraper role, and until when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// Id of the owning VM.
    pub owner: u64,
    /// Wall-clock ms after which anyone may take the lease.
    pub expires_ms: u64,
}

impl Lease {
    /// 16 bytes, little-endian.
    pub fn encode(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&self.owner.to_le_bytes());
        out[8..].copy_from_slice(&self.expires_ms.to_le_bytes());
        out
    }

    /// Decodes [`Lease::encode`]'s output; anything else is `None`.
    pub fn decode(bytes: &[u8]) -> Option<Lease> {
        let owner = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        let expires_ms = u64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?);
        (bytes.len() == 16).then_some(Lease { owner, expires_ms })
    }

    /// The lease `me` should write at `now_ms` to hold the role for `ttl_ms`,
    /// given the `current` one; `None` when another live owner holds it.
    /// An unreadable current value counts as expired.
    pub fn claim(current: Option<&[u8]>, me: u64, now_ms: u64, ttl_ms: u64) -> Option<Lease> {
        let free = match current.and_then(Lease::decode) {
            None => true,
            Some(l) => l.owner == me || l.expires_ms <= now_ms,
        };
        free.then_some(Lease {
            owner: me,
            expires_ms: now_ms.saturating_add(ttl_ms),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn claim_rules() {
        let held = Lease {
            owner: 7,
            expires_ms: 1_000,
        }
        .encode();
        // (current, me, now, expect owner)
        type Case<'a> = (Option<&'a [u8]>, u64, u64, Option<u64>);
        let cases: [Case; 6] = [
            (None, 1, 0, Some(1)),
            (Some(&held), 7, 500, Some(7)),
            (Some(&held), 8, 500, None),
            (Some(&held), 8, 1_000, Some(8)),
            (Some(b"junk"), 8, 0, Some(8)),
            (Some(&[]), 8, 0, Some(8)),
        ];
        for (cur, me, now, want) in cases {
            let got = Lease::claim(cur, me, now, 150);
            assert_eq!(got.map(|l| l.owner), want, "{cur:?} {me} {now}");
            if let Some(l) = got {
                assert_eq!(l.expires_ms, now + 150);
            }
        }
    }

    #[test]
    fn roundtrip() {
        let l = Lease {
            owner: u64::MAX,
            expires_ms: 42,
        };
        assert_eq!(Lease::decode(&l.encode()), Some(l));
        assert_eq!(Lease::decode(&l.encode()[..15]), None);
    }
}
