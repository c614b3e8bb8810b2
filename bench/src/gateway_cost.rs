//! What a gateway costs to run, measured over the load phase of one run: Envoy CPU
//! per request (user + system time from `/proc/<pid>/stat`, the router replicas and
//! the front Envoy apart) and, with kvroute's peer sync, the bytes the replicas pull
//! from each other (counter `kvroute.peer.bytes`) and how old a routing decision is
//! when a peer learns it (histogram `kvroute.peer.lag_ms`, merged over the replicas).
//!
//! CPU and bytes are wall-clock quantities (the sync runs in real time), unlike the
//! run's latencies, which are in simulated time.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::admin_stats::{counters, flushed_histogram, quantile, total};
use crate::gateway::Gateway;

/// Clock ticks per second of `/proc/<pid>/stat` (USER_HZ, 100 on Linux).
const TICKS_PER_S: u64 = 100;

/// CPU time (user + system) process `pid` has used so far; `None` once it is gone.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_cpu_ticks(&stat).map(|t| Duration::from_millis(t * 1000 / TICKS_PER_S))
}

/// utime + stime (fields 14 and 15) of a `/proc/<pid>/stat` line, in ticks.
pub fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    // The command name (field 2) may hold spaces and parentheses: fields after the last ')'.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    (f.len() == 2).then(|| f[0] + f[1])
}

/// The cost of one run's gateway.
#[derive(Debug, Clone, Serialize)]
pub struct GatewayCost {
    /// CPU ms the router replicas used per completed request (all replicas together;
    /// wall-clock CPU time, not simulated).
    pub replicas_cpu_ms_per_request: f64,
    /// Each replica's CPU seconds over the load phase.
    pub replica_cpu_s: Vec<f64>,
    /// CPU ms the front Envoy used per completed request (the same hop in every row).
    pub front_cpu_ms_per_request: Option<f64>,
    /// Peer sync traffic and lag, when the sync is on.
    pub sync: Option<SyncCost>,
}

/// What kvroute's peer sync cost and how fresh it kept the replicas.
#[derive(Debug, Clone, Serialize)]
pub struct SyncCost {
    /// `kvroute.peer.bytes` per wall second per peer: each replica's increase over
    /// the load phase / (replicas - 1) / wall seconds, averaged over the replicas.
    pub bytes_per_s_per_peer: f64,
    /// Each replica's `kvroute.peer.bytes` increase over the load phase.
    pub bytes: Vec<u64>,
    /// Lag of learned decisions (`kvroute.peer.lag_ms`, all replicas merged), when
    /// any was learned.
    pub lag_ms: Option<Lag>,
}

/// Quantiles of the sync lag, wall-clock ms.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Lag {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Learned entries with a lag sample (all replicas).
    pub samples: u64,
}

/// Counter and histogram names (Envoy prefixes wasm stats with `wasmcustom.`).
const PEER_BYTES: &str = "kvroute.peer.bytes";
const PEER_LEARNED: &str = "kvroute.peer.learned";
const PEER_LAG: &str = "kvroute.peer.lag_ms";

/// Snapshot at the start of the load phase; [`CostProbe::finish`] takes the difference.
#[derive(Debug)]
pub struct CostProbe {
    t0: Instant,
    replica_cpu: Vec<Option<Duration>>,
    front_cpu: Option<Duration>,
    peer_bytes: Vec<u64>,
}

async fn peer_counter(admin: &str, name: &str) -> u64 {
    counters(admin, &name.replace('.', r"\."))
        .await
        .iter()
        .filter(|(k, _)| k.ends_with(name))
        .map(|(_, v)| *v)
        .sum()
}

impl CostProbe {
    /// Reads CPU times (and, with sync, the peer byte counters) now.
    pub async fn start(gw: &Gateway) -> Self {
        let mut peer_bytes = Vec::new();
        if gw.topology.sync {
            for admin in gw.replica_admins() {
                peer_bytes.push(peer_counter(admin, PEER_BYTES).await);
            }
        }
        CostProbe {
            t0: Instant::now(),
            replica_cpu: gw.replicas.iter().map(|r| cpu_time(r.pid)).collect(),
            front_cpu: gw.front.as_ref().and_then(|f| cpu_time(f.pid)),
            peer_bytes,
        }
    }

    /// The cost since [`CostProbe::start`] for `completed` requests. Call it right
    /// after the load phase: CPU and bytes are read first; with sync, it then waits
    /// (up to 6 s) for the replicas' stats flush so that the lag histogram holds
    /// every learned entry.
    pub async fn finish(self, gw: &Gateway, completed: usize) -> GatewayCost {
        let wall = self.t0.elapsed().as_secs_f64();
        let per_req = |d: Duration| d.as_secs_f64() * 1000.0 / completed.max(1) as f64;
        let used = |before: Option<Duration>, pid: u32| -> Duration {
            match (before, cpu_time(pid)) {
                (Some(b), Some(a)) => a.saturating_sub(b),
                _ => Duration::ZERO,
            }
        };
        let replica_cpu: Vec<Duration> = gw
            .replicas
            .iter()
            .zip(&self.replica_cpu)
            .map(|(r, &b)| used(b, r.pid))
            .collect();
        let front_cpu = gw.front.as_ref().map(|f| used(self.front_cpu, f.pid));
        let mut sync = None;
        if gw.topology.sync {
            let admins = gw.replica_admins();
            let mut bytes = Vec::new();
            for (admin, before) in admins.iter().zip(&self.peer_bytes) {
                bytes.push(
                    peer_counter(admin, PEER_BYTES)
                        .await
                        .saturating_sub(*before),
                );
            }
            let peers = (admins.len().max(2) - 1) as f64;
            let per_peer = bytes.iter().map(|&b| b as f64 / peers / wall.max(1e-9));
            sync = Some(SyncCost {
                bytes_per_s_per_peer: per_peer.sum::<f64>() / bytes.len().max(1) as f64,
                bytes,
                lag_ms: lag(&admins).await,
            });
        }
        GatewayCost {
            replicas_cpu_ms_per_request: per_req(replica_cpu.iter().sum()),
            replica_cpu_s: replica_cpu.iter().map(Duration::as_secs_f64).collect(),
            front_cpu_ms_per_request: front_cpu.map(per_req),
            sync,
        }
    }
}

/// The replicas' lag histograms merged, once a stats flush has caught up with the
/// `kvroute.peer.learned` counters (or after 6 s: Envoy flushes every 5 s).
async fn lag(admins: &[&str]) -> Option<Lag> {
    let mut learned = 0;
    for admin in admins {
        learned += peer_counter(admin, PEER_LEARNED).await;
    }
    let buckets = flushed_histogram(
        admins,
        r"peer\.lag_ms",
        PEER_LAG,
        learned,
        Duration::from_secs(6),
    )
    .await;
    Some(Lag {
        p50: quantile(&buckets, 0.50)?,
        p99: quantile(&buckets, 0.99)?,
        samples: total(&buckets),
    })
}

/// Sums, over `admins`, the kvroute counters a run reports (`kvroute.` prefix and
/// Envoy's `wasmcustom.` removed): decisions, request counts, refusals and
/// failovers, and the peer sync's.
pub async fn kvroute_counters(admins: &[&str]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for admin in admins {
        for (k, v) in counters(admin, "kvroute").await {
            let k = k
                .trim_start_matches("wasmcustom.")
                .trim_start_matches("kvroute.");
            if k.starts_with("decision.")
                || k.starts_with("shadow.")
                || (k.starts_with("peer.") && k != "peer.replicas")
                || [
                    "requests",
                    "routed",
                    "parsed",
                    "log_lost",
                    "body_too_large",
                    "prefix.forgotten",
                    "failover.unanswered",
                    "failover.fallback_answered",
                    "failover.refused",
                    "failover.connection_close",
                    "engine_cache_distrusted",
                ]
                .contains(&k)
            {
                *out.entry(k.to_string()).or_insert(0) += v;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_utime_and_stime() {
        let stat = "4242 (envoy (main) x) S 1 2 3 4 5 6 7 8 9 10 150 25 0 0 20 0 9 0 100";
        assert_eq!(parse_cpu_ticks(stat), Some(175));
        assert_eq!(parse_cpu_ticks("garbage"), None);
        let me = cpu_time(std::process::id());
        assert!(me.is_some(), "our own /proc stat reads");
    }
}
