//! The routers compared: plain Envoy (round robin, least request), kvroute in Envoy
//! (defaults, two ablations, `predicted_ttft`, and `shadow` on request) and SGLang's
//! router (cache_aware, round_robin).
//!
//! Each is started against the given pods on free loopback ports and exposes one
//! OpenAI-compatible URL; the returned value owns the process (killed on drop).

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::procs::{free_port, wait_ok, ChildGuard, Tools};

/// Pinned sglang-router version installed into the project venv.
pub const SGLANG_ROUTER_VERSION: &str = "0.3.2";

/// A router configuration under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouterKind {
    /// Envoy's ROUND_ROBIN, no filter.
    EnvoyRoundRobin,
    /// Envoy's LEAST_REQUEST, no filter.
    EnvoyLeastRequest,
    /// kvroute with its default configuration.
    Kvroute,
    /// kvroute ablation: prefix scorer only, no load gate.
    KvroutePrefixOnly,
    /// kvroute ablation: load scorers only (prefix weight 0).
    KvrouteLoadOnly,
    /// kvroute with `scheduling.profile: predicted_ttft` (issue 12).
    KvrouteTtft,
    /// kvroute with `shadow: true`: it decides and reports, Envoy's
    /// least-request routes (only when named in `--routers`).
    KvrouteShadow,
    /// sglang-router `--policy cache_aware`.
    SglangCacheAware,
    /// sglang-router `--policy round_robin`.
    SglangRoundRobin,
}

impl RouterKind {
    /// Every router of a default run, in report order (`kvroute-shadow`
    /// only runs when named: its traffic is least-request's).
    pub const ALL: [RouterKind; 8] = [
        RouterKind::EnvoyRoundRobin,
        RouterKind::EnvoyLeastRequest,
        RouterKind::Kvroute,
        RouterKind::KvrouteTtft,
        RouterKind::KvroutePrefixOnly,
        RouterKind::KvrouteLoadOnly,
        RouterKind::SglangCacheAware,
        RouterKind::SglangRoundRobin,
    ];

    /// Name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            RouterKind::EnvoyRoundRobin => "envoy-round-robin",
            RouterKind::EnvoyLeastRequest => "envoy-least-request",
            RouterKind::Kvroute => "kvroute",
            RouterKind::KvroutePrefixOnly => "kvroute-prefix-only",
            RouterKind::KvrouteLoadOnly => "kvroute-load-only",
            RouterKind::KvrouteTtft => "kvroute-ttft",
            RouterKind::KvrouteShadow => "kvroute-shadow",
            RouterKind::SglangCacheAware => "sglang-cache-aware",
            RouterKind::SglangRoundRobin => "sglang-round-robin",
        }
    }

    /// Whether this router is SGLang's (needs the `sglang-router` package).
    pub fn is_sglang(self) -> bool {
        matches!(
            self,
            RouterKind::SglangCacheAware | RouterKind::SglangRoundRobin
        )
    }

    /// The kvroute plugin configuration (without endpoints), for kvroute variants.
    pub fn kvroute_config(self) -> Option<serde_json::Value> {
        use serde_json::json;
        match self {
            RouterKind::Kvroute => Some(json!({})),
            // The ablations leave out the cost checks too: they weigh a
            // prefix against load, and each ablation keeps only one side.
            RouterKind::KvroutePrefixOnly => Some(json!({"scheduling": {
                "weights": {"prefix": 3, "queue": 0, "kv_cache": 0, "inflight_requests": 0, "inflight_tokens": 0},
                "gate_max_queue_excess": 1e9, "keep_cheaper_holder": false,
                "leave_costlier_holder": false, "slot_wait": false}})),
            RouterKind::KvrouteLoadOnly => Some(json!({"scheduling": {
                "weights": {"prefix": 0}, "keep_cheaper_holder": false,
                "leave_costlier_holder": false, "slot_wait": false}})),
            RouterKind::KvrouteTtft => Some(json!({"scheduling": {"profile": "predicted_ttft"}})),
            RouterKind::KvrouteShadow => Some(json!({"shadow": true})),
            _ => None,
        }
    }
}

/// A started router: where to send requests, and the process behind it.
#[derive(Debug)]
pub struct RunningRouter {
    /// Base URL (`http://127.0.0.1:PORT`).
    pub url: String,
    /// Listener port (the port of `url`).
    pub port: u16,
    /// Envoy admin URL, for Envoy-based routers.
    pub admin: Option<String>,
    /// Process id of the router (Envoy itself: `render.py --run` execs it).
    pub pid: u32,
    _guard: ChildGuard,
}

/// Which copy of a router this is, when several run side by side (replicas).
#[derive(Debug, Clone, Default)]
pub struct Instance {
    /// Appended to the router's log and config file names (`-r0`, ...); empty alone.
    pub suffix: String,
    /// Extra `envoy/render.py` arguments (kvroute's peer sync: `--peer-listen`,
    /// `--peers`); Envoy-based routers only.
    pub render_args: Vec<String>,
}

/// Starts `instance` of `kind` in front of `pods` ([`Instance::default`]: the
/// router alone; otherwise one replica of a gateway, see `crate::gateway`).
pub async fn start(
    kind: RouterKind,
    pods: &[SocketAddr],
    tools: &Tools,
    envoy_workers: usize,
    kvroute_overrides: Option<&serde_json::Value>,
    instance: &Instance,
) -> Result<RunningRouter> {
    let port = free_port()?;
    let url = format!("http://127.0.0.1:{port}");
    let file_stem = format!("{}{}", kind.name(), instance.suffix);
    let log = tools.logs.join(format!("{file_stem}.log"));
    let _ = std::fs::remove_file(&log);
    if kind.is_sglang() {
        if !instance.render_args.is_empty() {
            anyhow::bail!("{} takes no Envoy render arguments", kind.name());
        }
        let policy = if kind == RouterKind::SglangCacheAware {
            "cache_aware"
        } else {
            "round_robin"
        };
        let mut cmd = Command::new(&tools.python);
        cmd.args([
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
        ])
        .args(["--policy", policy, "--prometheus-host", "127.0.0.1"])
        .args([
            "--prometheus-port",
            &free_port()?.to_string(),
            "--log-level",
            "warn",
        ])
        .arg("--worker-urls")
        .args(pods.iter().map(|p| format!("http://{p}")));
        let mut guard = ChildGuard::spawn(kind.name(), cmd, &log)?;
        wait_ok(
            &format!("{url}/health"),
            &mut guard,
            Duration::from_secs(60),
        )
        .await
        .with_context(|| format!("sglang-router did not come up; see {}", log.display()))?;
        // Workers are activated asynchronously after /health answers.
        wait_ok(
            &format!("{url}/v1/models"),
            &mut guard,
            Duration::from_secs(30),
        )
        .await?;
        return Ok(RunningRouter {
            url,
            port,
            admin: None,
            pid: guard.id(),
            _guard: guard,
        });
    }
    let admin_port = free_port()?;
    let admin = format!("http://127.0.0.1:{admin_port}");
    let endpoints = pods
        .iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let lb = match kind {
        RouterKind::EnvoyRoundRobin => "round_robin",
        RouterKind::EnvoyLeastRequest => "least_request",
        _ => "kvroute",
    };
    let mut cmd = Command::new(&tools.python);
    cmd.arg(tools.root.join("envoy/render.py"))
        .args(["--run", "--lb", lb, "--endpoints", &endpoints])
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--admin",
            &format!("127.0.0.1:{admin_port}"),
        ])
        .args([
            "--concurrency",
            &envoy_workers.to_string(),
            "--log-level",
            "warn",
        ])
        .arg("--wasm")
        .arg(&tools.wasm)
        // The rendered config beside the run's log, one per router (a temp
        // file per Envoy start, never removed, piled up in /tmp).
        .arg("--out")
        .arg(tools.logs.join(format!("{file_stem}.yaml")))
        .args(&instance.render_args);
    if let Some(mut cfg) = kind.kvroute_config() {
        if let Some(o) = kvroute_overrides {
            merge_json(&mut cfg, o);
        }
        let path = tools.logs.join(format!("{file_stem}.json"));
        std::fs::write(&path, serde_json::to_vec_pretty(&cfg)?)?;
        cmd.arg("--config").arg(&path);
    }
    let mut guard = ChildGuard::spawn(kind.name(), cmd, &log)?;
    wait_ok(
        &format!("{admin}/ready"),
        &mut guard,
        Duration::from_secs(30),
    )
    .await
    .with_context(|| format!("Envoy ({}) not ready; see {}", kind.name(), log.display()))?;
    if kind.kvroute_config().is_some() {
        // Let kvroute's scraper take a few snapshots (50 ms period) before traffic.
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    Ok(RunningRouter {
        url,
        port,
        admin: Some(admin),
        pid: guard.id(),
        _guard: guard,
    })
}

/// Merges `over` into `base`: objects key by key (recursively), anything else replaced.
pub fn merge_json(base: &mut serde_json::Value, over: &serde_json::Value) {
    match (base, over) {
        (serde_json::Value::Object(b), serde_json::Value::Object(o)) => {
            for (k, v) in o {
                merge_json(b.entry(k.clone()).or_insert(serde_json::Value::Null), v);
            }
        }
        (b, o) => *b = o.clone(),
    }
}

/// Makes sure `sglang-router` is importable from the project venv, installing the
/// pinned version with the venv's pip when missing. Returns why it is unavailable.
pub fn ensure_sglang(tools: &Tools) -> std::result::Result<(), String> {
    let importable = |t: &Tools| {
        Command::new(&t.python)
            .args(["-c", "import sglang_router.launch_router"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };
    if importable(tools) {
        return Ok(());
    }
    eprintln!("kvroute-bench: installing sglang-router=={SGLANG_ROUTER_VERSION} into .venv ...");
    let out = Command::new(&tools.python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            &format!("sglang-router=={SGLANG_ROUTER_VERSION}"),
        ])
        .output()
        .map_err(|e| format!("pip could not run: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "pip install sglang-router failed: {}",
            err.lines().last().unwrap_or("")
        ));
    }
    if importable(tools) {
        Ok(())
    } else {
        Err("sglang-router installed but `import sglang_router.launch_router` fails".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn overrides_merge_into_a_variant_config() {
        let mut cfg = RouterKind::KvroutePrefixOnly.kvroute_config().unwrap();
        merge_json(
            &mut cfg,
            &json!({"scheduling": {"cold_margin": 0, "weights": {"queue": 1}}, "debug_header": "x-d"}),
        );
        assert_eq!(cfg["scheduling"]["cold_margin"], 0);
        assert_eq!(cfg["scheduling"]["weights"]["queue"], 1);
        assert_eq!(
            cfg["scheduling"]["weights"]["prefix"], 3,
            "untouched keys stay"
        );
        assert_eq!(cfg["scheduling"]["gate_max_queue_excess"], 1e9);
        assert_eq!(cfg["debug_header"], "x-d");
    }
}
