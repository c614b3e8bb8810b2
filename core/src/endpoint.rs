//! The one word for "a model server kvroute can route to": an *endpoint*,
//! always a literal `ip:port` (what Envoy's ORIGINAL_DST cluster and the
//! `override_host` policy accept). Parsing is strict so that nothing a client
//! or a config could write ever becomes an upstream that is not a socket
//! address.

use std::cmp::Ordering;
use std::fmt;
use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::str::FromStr;

/// A model-server endpoint: a socket address, printed as `ip:port`
/// (`[v6]:port` for IPv6). Ordered as its socket address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint(SocketAddr);

/// The socket address's own order, with two IPv4 addresses compared as one
/// integer each (address, then port) rather than the address byte by byte
/// then the port: the tables a decision walks are sorted by endpoint, and
/// one over 1024 endpoints compares a few thousand pairs.
impl Ord for Endpoint {
    #[inline]
    fn cmp(&self, other: &Self) -> Ordering {
        fn key(a: &SocketAddrV4) -> u64 {
            u64::from(a.ip().to_bits()) << 16 | u64::from(a.port())
        }
        #[cold]
        #[inline(never)]
        fn other_families(a: &SocketAddr, b: &SocketAddr) -> Ordering {
            a.cmp(b)
        }
        match (&self.0, &other.0) {
            (SocketAddr::V4(a), SocketAddr::V4(b)) => key(a).cmp(&key(b)),
            (a, b) => other_families(a, b),
        }
    }
}

impl PartialOrd for Endpoint {
    #[inline]
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Endpoint {
    /// Wraps a socket address.
    pub fn new(addr: SocketAddr) -> Self {
        Endpoint(addr)
    }

    /// The socket address.
    pub fn addr(&self) -> SocketAddr {
        self.0
    }

    /// Appends the binary form the shared-data tables use: `4` and 4 bytes
    /// or `6` and 16 bytes of address, then the port (little endian).
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        match self.0.ip() {
            IpAddr::V4(ip) => {
                out.push(4);
                out.extend_from_slice(&ip.octets());
            }
            IpAddr::V6(ip) => {
                out.push(6);
                out.extend_from_slice(&ip.octets());
            }
        }
        out.extend_from_slice(&self.0.port().to_le_bytes());
    }

    /// Reads [`encode_into`](Self::encode_into)'s form from the front of
    /// `r`, advancing it; `None` for an unknown family, a short input or
    /// port 0.
    pub fn decode_from(r: &mut &[u8]) -> Option<Endpoint> {
        fn next<const N: usize>(r: &mut &[u8]) -> Option<[u8; N]> {
            let (head, rest) = r.split_first_chunk::<N>()?;
            *r = rest;
            Some(*head)
        }
        let ip = match next::<1>(r)?[0] {
            4 => IpAddr::from(next::<4>(r)?),
            6 => IpAddr::from(next::<16>(r)?),
            _ => return None,
        };
        let port = u16::from_le_bytes(next(r)?);
        (port != 0).then(|| Endpoint(SocketAddr::new(ip, port)))
    }
}

/// Why a string is not an endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointParseError(pub String);

impl fmt::Display for EndpointParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} is not an ip:port endpoint", self.0)
    }
}

impl std::error::Error for EndpointParseError {}

impl FromStr for Endpoint {
    type Err = EndpointParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let addr: SocketAddr = s
            .trim()
            .parse()
            .map_err(|_| EndpointParseError(s.to_string()))?;
        if addr.port() == 0 {
            return Err(EndpointParseError(s.to_string()));
        }
        Ok(Endpoint(addr))
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl serde::Serialize for Endpoint {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Endpoint {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn order_is_the_socket_address_order() {
        let mut rng = fastrand::Rng::with_seed(7);
        // Few distinct values per part, so that ties on each part occur.
        let mut any = || -> SocketAddr {
            let port = [1, 80, 8000, 65535][rng.usize(..4)];
            if rng.bool() {
                let ip = [
                    [10, 0, 0, 1],
                    [10, 0, 0, 2],
                    [10, 0, 1, 0],
                    [192, 168, 0, 1],
                ];
                SocketAddr::from((ip[rng.usize(..4)], port))
            } else {
                let ip = [[0u16, 0, 0, 0, 0, 0, 0, 1], [0xfe80, 0, 0, 0, 0, 0, 0, 1]];
                SocketAddr::from((ip[rng.usize(..2)], port))
            }
        };
        for _ in 0..5000 {
            let (a, b) = (any(), any());
            let (x, y) = (Endpoint::new(a), Endpoint::new(b));
            assert_eq!(x.cmp(&y), a.cmp(&b), "{a} vs {b}");
            assert_eq!(x.partial_cmp(&y), a.partial_cmp(&b), "{a} vs {b}");
        }
    }

    #[test]
    fn parses_v4_and_v6() {
        let e: Endpoint = "127.0.0.1:8000".parse().unwrap();
        assert_eq!(e.to_string(), "127.0.0.1:8000");
        let e: Endpoint = "[::1]:9000".parse().unwrap();
        assert_eq!(e.to_string(), "[::1]:9000");
    }

    #[test]
    fn rejects_names_ports_and_junk() {
        for bad in [
            "localhost:8000",
            "evil.example.com:80",
            "127.0.0.1",
            "127.0.0.1:0",
            "127.0.0.1:99999",
            "",
            "127.0.0.1:80,10.0.0.1:80",
            "127.0.0.1:80/x",
        ] {
            assert!(bad.parse::<Endpoint>().is_err(), "{bad} accepted");
        }
    }
}
