//! Live endpoint discovery: the pool as Envoy itself knows it. The scraper
//! reads Envoy's admin `GET /clusters?format=json` (through a loopback-only
//! admin cluster) and takes the members of the upstream cluster, so pods
//! added or removed by EDS (Kubernetes, Istio, a file) are followed without
//! restarting Envoy and without listing them in kvroute's config.
//!
//! Members whose EDS health status says the control plane is taking them out
//! (`UNHEALTHY`, `DRAINING`, `TIMEOUT`, or pending removal) are left out; Envoy's active health
//! check flags are not used here (kvroute's own scrapes are its health
//! signal, and keeping flapping members avoids forgetting their prefixes).

use crate::endpoint::Endpoint;
use serde::Deserialize;
use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};

#[derive(Deserialize)]
struct Clusters<'a> {
    #[serde(borrow, default)]
    cluster_statuses: Vec<ClusterStatus<'a>>,
}

#[derive(Deserialize)]
struct ClusterStatus<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
    #[serde(borrow, default)]
    host_statuses: Vec<HostStatus<'a>>,
}

#[derive(Deserialize)]
struct HostStatus<'a> {
    #[serde(borrow)]
    address: Option<Address<'a>>,
    #[serde(borrow)]
    health_status: Option<HealthStatus<'a>>,
}

#[derive(Deserialize)]
struct Address<'a> {
    #[serde(borrow)]
    socket_address: Option<SocketAddress<'a>>,
}

#[derive(Deserialize)]
struct SocketAddress<'a> {
    #[serde(borrow)]
    address: Cow<'a, str>,
    port_value: Option<u16>,
}

#[derive(Deserialize)]
struct HealthStatus<'a> {
    #[serde(borrow)]
    eds_health_status: Option<Cow<'a, str>>,
    #[serde(default)]
    pending_dynamic_removal: bool,
}

/// Why the admin output could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiscoveryError {
    /// Not the JSON Envoy's `/clusters?format=json` returns.
    Unreadable(String),
    /// The named cluster is not in the output.
    NoSuchCluster(String),
}

/// Members of `cluster` in Envoy's `/clusters?format=json` output, sorted.
pub fn cluster_members(json: &[u8], cluster: &str) -> Result<Vec<Endpoint>, DiscoveryError> {
    let parsed: Clusters =
        serde_json::from_slice(json).map_err(|e| DiscoveryError::Unreadable(e.to_string()))?;
    let status = parsed
        .cluster_statuses
        .into_iter()
        .find(|c| c.name == cluster)
        .ok_or_else(|| DiscoveryError::NoSuchCluster(cluster.to_string()))?;
    let mut members: Vec<Endpoint> = status
        .host_statuses
        .iter()
        .filter(|h| {
            let Some(s) = &h.health_status else {
                return true;
            };
            let eds = s.eds_health_status.as_deref();
            !s.pending_dynamic_removal && !matches!(eds, Some("UNHEALTHY" | "DRAINING" | "TIMEOUT"))
        })
        .filter_map(|h| {
            let sa = h.address.as_ref()?.socket_address.as_ref()?;
            let ip: IpAddr = sa.address.parse().ok()?;
            let port = sa.port_value.filter(|p| *p != 0)?;
            Some(Endpoint::new(SocketAddr::new(ip, port)))
        })
        .collect();
    members.sort();
    members.dedup();
    Ok(members)
}

/// The discovered pool as stored in shared data (JSON list of `ip:port`).
pub fn encode_pool(pool: &[Endpoint]) -> Vec<u8> {
    serde_json::to_vec(pool).unwrap_or_default()
}

/// Decodes [`encode_pool`]'s output; garbage gives `None`.
pub fn decode_pool(bytes: &[u8]) -> Option<Vec<Endpoint>> {
    serde_json::from_slice(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const REAL: &str = include_str!("../../tests/fixtures/envoy/clusters-static-2.json");

    #[test]
    fn pool_codec() {
        let pool: Vec<Endpoint> = vec!["10.0.0.1:80".parse().unwrap(), "[::1]:9".parse().unwrap()];
        assert_eq!(decode_pool(&encode_pool(&pool)), Some(pool));
        assert_eq!(decode_pool(b"[\"evil.example:80\"]"), None);
        assert_eq!(decode_pool(b"\xff"), None);
    }

    #[test]
    fn reads_real_envoy_output() {
        let m = cluster_members(REAL.as_bytes(), "kvroute_upstream").unwrap();
        let names: Vec<String> = m.iter().map(|e| e.to_string()).collect();
        assert_eq!(names, ["127.0.0.1:18001", "127.0.0.1:18002"]);
        assert_eq!(
            cluster_members(REAL.as_bytes(), "nope"),
            Err(DiscoveryError::NoSuchCluster("nope".into()))
        );
    }

    #[test]
    fn drops_draining_hostnames_and_junk() {
        let json = r#"{"cluster_statuses":[{"name":"c","host_statuses":[
            {"address":{"socket_address":{"address":"10.0.0.1","port_value":80}},"health_status":{"eds_health_status":"HEALTHY"}},
            {"address":{"socket_address":{"address":"10.0.0.2","port_value":80}},"health_status":{"eds_health_status":"DRAINING"}},
            {"address":{"socket_address":{"address":"10.0.0.5","port_value":80}},"health_status":{"eds_health_status":"HEALTHY","pending_dynamic_removal":true}},
            {"address":{"socket_address":{"address":"10.0.0.3","port_value":80}},"health_status":{"failed_active_health_check":true,"eds_health_status":"HEALTHY"}},
            {"address":{"socket_address":{"address":"vllm.svc","port_value":80}}},
            {"address":{"socket_address":{"address":"10.0.0.4"}}},
            {"address":{"pipe":{"path":"/x"}}},
            {}
        ]}]}"#;
        let m = cluster_members(json.as_bytes(), "c").unwrap();
        let names: Vec<String> = m.iter().map(|e| e.to_string()).collect();
        assert_eq!(names, ["10.0.0.1:80", "10.0.0.3:80"]);
        for bad in ["", "[]", "{", "\u{0}", r#"{"cluster_statuses":7}"#] {
            assert!(cluster_members(bad.as_bytes(), "c").is_err(), "{bad}");
        }
    }
}
