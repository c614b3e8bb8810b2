//! The router under test as a gateway: one router alone (every single-gateway run),
//! or N replicas of it behind a front Envoy that round-robins requests over them, as
//! a Kubernetes Service spreads clients over the pods of a multi-replica gateway.
//!
//! Every replica is started exactly like a lone router (`envoy/render.py --run`, same
//! pods, same plugin configuration, its own listener and admin ports). With kvroute's
//! peer sync (issue 11) the only difference is two more `render.py` flags per replica:
//! `--peer-listen 127.0.0.1:P_i --peers <the other replicas' P_j>`. The front Envoy is
//! `envoy/front.yaml.tmpl`: no filter, ROUND_ROBIN over a STATIC list of the replicas.

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::admin_stats::counters;
use crate::procs::{free_port, wait_ok, ChildGuard, Tools};
use crate::router_under_test::{start, Instance, RouterKind, RunningRouter};

/// How the router under test is deployed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Topology {
    /// Replicas of the router (separate processes, same pods, same configuration).
    pub replicas: usize,
    /// kvroute's peer sync between the replicas (`--peer-listen`/`--peers`).
    pub sync: bool,
    /// Clients talk to a front Envoy that round-robins over the replicas (always with
    /// more than one replica; `kvroute-bench replicas` also puts it in front of a
    /// single router so that every row pays the same extra hop).
    pub front: bool,
}

impl Topology {
    /// The router alone, clients talk to it directly (as every run before issue 11).
    pub const SINGLE: Topology = Topology {
        replicas: 1,
        sync: false,
        front: false,
    };

    /// `n` replicas behind a front Envoy; peer sync only means something for `n > 1`.
    pub fn replicated(n: usize, sync: bool) -> Self {
        let replicas = n.max(1);
        Topology {
            replicas,
            sync: sync && replicas > 1,
            front: true,
        }
    }
}

/// One row of a comparison: a router and how it is deployed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Arm {
    /// The router.
    pub router: RouterKind,
    /// Its deployment.
    pub topology: Topology,
}

impl Arm {
    /// `router` deployed as `topology`; peer sync is dropped for routers without it
    /// (everything but kvroute).
    pub fn new(router: RouterKind, mut topology: Topology) -> Self {
        topology.sync &= router.kvroute_config().is_some();
        Arm { router, topology }
    }

    /// The router alone.
    pub fn single(router: RouterKind) -> Self {
        Arm::new(router, Topology::SINGLE)
    }

    /// Name in tables and JSON: the router's name alone (`kvroute`); behind a front
    /// Envoy with the replica count and, for kvroute with several replicas, the sync
    /// (`kvroute x1`, `kvroute x3 no-sync`, `kvroute x3 sync`, `envoy-round-robin x1`).
    pub fn name(&self) -> String {
        let t = self.topology;
        let mut name = self.router.name().to_string();
        if t.front || t.replicas > 1 {
            name.push_str(&format!(" x{}", t.replicas));
        }
        if t.replicas > 1 && self.router.kvroute_config().is_some() {
            name.push_str(if t.sync { " sync" } else { " no-sync" });
        }
        name
    }
}

/// The front Envoy of a replicated gateway.
#[derive(Debug)]
pub struct Front {
    /// Envoy's process id.
    pub pid: u32,
    /// Admin URL.
    pub admin: String,
    _guard: ChildGuard,
}

/// A started gateway: where clients send requests, and every process behind it
/// (all killed on drop).
#[derive(Debug)]
pub struct Gateway {
    /// What clients call: the front Envoy, or the lone router.
    pub url: String,
    /// How it is deployed.
    pub topology: Topology,
    /// The router replicas (one for a lone router), in start order.
    pub replicas: Vec<RunningRouter>,
    /// The front Envoy, when there is one.
    pub front: Option<Front>,
}

/// The `render.py` flags of replica `i` given every replica's peer port (none: no sync).
pub fn peer_args(peer_ports: &[u16], i: usize) -> Vec<String> {
    if peer_ports.is_empty() {
        return Vec::new();
    }
    let others: Vec<String> = peer_ports
        .iter()
        .enumerate()
        .filter(|&(j, _)| j != i)
        .map(|(_, p)| format!("127.0.0.1:{p}"))
        .collect();
    vec![
        "--peer-listen".into(),
        format!("127.0.0.1:{}", peer_ports[i]),
        "--peers".into(),
        others.join(","),
    ]
}

/// Starts `arm` in front of `pods`: its replicas one after another (a replica whose
/// peers are not up yet is what a rolling start looks like), then the front Envoy;
/// with sync, waits (up to 5 s) until every replica hears from all its peers.
pub async fn start_gateway(
    arm: &Arm,
    pods: &[SocketAddr],
    tools: &Tools,
    envoy_workers: usize,
    kvroute_overrides: Option<&serde_json::Value>,
) -> Result<Gateway> {
    let t = arm.topology;
    let peer_ports = if t.sync {
        (0..t.replicas)
            .map(|_| free_port())
            .collect::<Result<Vec<_>>>()?
    } else {
        Vec::new()
    };
    let mut replicas = Vec::with_capacity(t.replicas);
    for i in 0..t.replicas {
        let instance = Instance {
            suffix: if t == Topology::SINGLE {
                String::new()
            } else {
                format!("-r{i}")
            },
            render_args: peer_args(&peer_ports, i),
        };
        let r = start(
            arm.router,
            pods,
            tools,
            envoy_workers,
            kvroute_overrides,
            &instance,
        )
        .await
        .with_context(|| format!("replica {i} of {}", arm.name()))?;
        replicas.push(r);
    }
    if !t.front {
        return Ok(Gateway {
            url: replicas[0].url.clone(),
            topology: t,
            replicas,
            front: None,
        });
    }
    let ports: Vec<u16> = replicas.iter().map(|r| r.port).collect();
    let (url, front) = start_front(&ports, tools, envoy_workers).await?;
    let gateway = Gateway {
        url,
        topology: t,
        replicas,
        front: Some(front),
    };
    if t.sync {
        gateway.wait_for_peers(Duration::from_secs(5)).await;
    }
    Ok(gateway)
}

impl Gateway {
    /// Admin URLs of the replicas (Envoy-based routers).
    pub fn replica_admins(&self) -> Vec<&str> {
        self.replicas
            .iter()
            .filter_map(|r| r.admin.as_deref())
            .collect()
    }

    /// Polls each replica's `kvroute.peer.replicas` gauge until it counts all the
    /// other replicas; after `timeout` it warns and lets the run go on (the rows
    /// then show what a fresh gateway does).
    async fn wait_for_peers(&self, timeout: Duration) {
        let want = (self.replicas.len() - 1) as u64;
        let deadline = Instant::now() + timeout;
        let mut heard = Vec::new();
        while Instant::now() < deadline {
            heard.clear();
            for admin in self.replica_admins() {
                let c = counters(admin, r"peer\.replicas").await;
                heard.push(
                    c.iter()
                        .find(|(k, _)| k.ends_with("kvroute.peer.replicas"))
                        .map(|(_, v)| *v)
                        .unwrap_or(0),
                );
            }
            if heard.iter().all(|&h| h >= want) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        eprintln!(
            "kvroute-bench: after {timeout:?} the replicas hear from {heard:?} peers (want {want} each); running anyway"
        );
    }
}

/// Fills in `envoy/front.yaml.tmpl`: listener and admin ports, one STATIC member per
/// replica port.
pub fn render_front(
    template: &str,
    listen_port: u16,
    admin_port: u16,
    replica_ports: &[u16],
) -> Result<String> {
    let endpoints: Vec<String> = replica_ports
        .iter()
        .map(|p| {
            format!(
                "              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {p} }} }} }}"
            )
        })
        .collect();
    let text = template
        .replace("${listen_port}", &listen_port.to_string())
        .replace("${admin_port}", &admin_port.to_string())
        .replace("${endpoints}", &endpoints.join("\n"));
    if let Some(at) = text.find("${") {
        bail!(
            "envoy/front.yaml.tmpl: unknown placeholder {}",
            &text[at..text[at..].find('}').map_or(text.len(), |e| at + e + 1)]
        );
    }
    Ok(text)
}

/// Starts the front Envoy over `replica_ports`; returns its URL and guard.
async fn start_front(
    replica_ports: &[u16],
    tools: &Tools,
    envoy_workers: usize,
) -> Result<(String, Front)> {
    let (listen, admin_port) = (free_port()?, free_port()?);
    let template_path = tools.root.join("envoy/front.yaml.tmpl");
    let template = std::fs::read_to_string(&template_path)
        .with_context(|| format!("reading {}", template_path.display()))?;
    let config = tools.logs.join("front.yaml");
    std::fs::write(
        &config,
        render_front(&template, listen, admin_port, replica_ports)?,
    )?;
    let log = tools.logs.join("front.log");
    let _ = std::fs::remove_file(&log);
    let mut cmd = Command::new(&tools.envoy);
    cmd.arg("-c")
        .arg(&config)
        .args(["--concurrency", &envoy_workers.to_string()])
        .args(["--log-level", "warn", "--disable-hot-restart"])
        .args(["--base-id", &listen.to_string()]);
    let mut guard = ChildGuard::spawn("front Envoy", cmd, &log)?;
    let admin = format!("http://127.0.0.1:{admin_port}");
    wait_ok(
        &format!("{admin}/ready"),
        &mut guard,
        Duration::from_secs(30),
    )
    .await
    .with_context(|| format!("front Envoy not ready; see {}", log.display()))?;
    Ok((
        format!("http://127.0.0.1:{listen}"),
        Front {
            pid: guard.id(),
            admin,
            _guard: guard,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_replica_lists_the_others_as_peers() {
        assert!(peer_args(&[], 0).is_empty());
        assert_eq!(
            peer_args(&[7001, 7002, 7003], 1),
            [
                "--peer-listen",
                "127.0.0.1:7002",
                "--peers",
                "127.0.0.1:7001,127.0.0.1:7003"
            ]
        );
    }

    #[test]
    fn names_say_replicas_and_sync() {
        let kv = RouterKind::Kvroute;
        assert_eq!(Arm::single(kv).name(), "kvroute");
        assert_eq!(
            Arm::new(kv, Topology::replicated(1, true)).name(),
            "kvroute x1"
        );
        assert_eq!(
            Arm::new(kv, Topology::replicated(3, false)).name(),
            "kvroute x3 no-sync"
        );
        assert_eq!(
            Arm::new(kv, Topology::replicated(3, true)).name(),
            "kvroute x3 sync"
        );
        let rr = Arm::new(RouterKind::EnvoyRoundRobin, Topology::replicated(3, true));
        assert!(!rr.topology.sync, "no sync without kvroute");
        assert_eq!(rr.name(), "envoy-round-robin x3");
    }

    #[test]
    fn front_config_lists_every_replica() {
        let template = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../envoy/front.yaml.tmpl"),
        )
        .unwrap();
        let yaml = render_front(&template, 10000, 9901, &[10001, 10002, 10003]).unwrap();
        assert!(yaml.contains("port_value: 10000 }"));
        assert!(yaml.contains("port_value: 9901 }"));
        for p in [10001, 10002, 10003] {
            assert!(yaml.contains(&format!(
                "- endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {p} }} }} }}"
            )));
        }
        assert!(yaml.contains("lb_policy: ROUND_ROBIN"));
        assert!(!yaml.contains("${"));
        assert!(render_front("x ${nope} y", 1, 2, &[3]).is_err());
    }
}
