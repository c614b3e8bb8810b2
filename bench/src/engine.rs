//! The model servers a comparison runs against (issue 13): simulated pods
//! (`kvroute-sim`, the default), real llama.cpp `llama-server` pods started by the
//! bench, or endpoints that already run anywhere (`--endpoints`, any engine).
//!
//! Started pods are fresh for every row (cold caches, same settings), so rows differ
//! only by the router. Existing endpoints cannot be restarted: every row's prompts
//! then begin with a salt of their own, so no row hits what an earlier row left in
//! the engines' caches, and each row's counters are read as a difference.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::procs::{free_port, start_sim, wait_ok, ChildGuard, SimSettings, Tools};

/// The engine behind the routers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EngineKind {
    /// `kvroute-sim` pods (vLLM metrics, simulated time).
    Sim,
    /// llama.cpp `llama-server` on CPU (`./build.sh engine` builds it).
    Llama,
}

/// Where the pods come from: `--engine`, or `--endpoints` for a fleet that runs
/// already.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct EngineArgs {
    /// Engine of the pods the bench starts.
    #[arg(long, value_enum, default_value_t = EngineKind::Sim)]
    pub engine: EngineKind,
    /// Measure an existing fleet instead of starting pods: its endpoints,
    /// `HOST:PORT,...` (any OpenAI-compatible engine with a Prometheus /metrics:
    /// vLLM, SGLang, llama.cpp, kvroute-sim). Not restarted between rows.
    #[arg(long, value_delimiter = ',')]
    pub endpoints: Vec<SocketAddr>,
    /// Model name sent in requests (default: the engine's; for `--endpoints`, what
    /// the fleet serves).
    #[arg(long)]
    pub model: Option<String>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub llama: LlamaArgs,
}

/// How `--engine llama` pods run.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct LlamaArgs {
    /// llama-server binary (default `$KVROUTE_LLAMA_SERVER`, set by `./build.sh`).
    #[arg(long, env = "KVROUTE_LLAMA_SERVER")]
    pub llama_server: Option<PathBuf>,
    /// GGUF model (default `$KVROUTE_LLAMA_MODEL`, set by `./build.sh`).
    #[arg(long, env = "KVROUTE_LLAMA_MODEL")]
    pub llama_model: Option<PathBuf>,
    /// Parallel slots per pod (`-np`): requests decoded together.
    #[arg(long, default_value_t = 2)]
    pub llama_slots: usize,
    /// Context tokens per pod, shared by its slots (`-c`).
    #[arg(long, default_value_t = 8192)]
    pub llama_ctx: usize,
    /// Host-memory prompt cache per pod in MiB (`--cache-ram`): with the slots' own
    /// KV, what one pod can keep. SmolLM2-135M's KV takes 22.5 KiB per token (30
    /// layers x 3 KV heads x 64 x 2 x f16), so 24 MiB holds about two ~500-token
    /// prompts; llama-server's own default (8 GiB) would hold every prompt of a demo.
    #[arg(long, default_value_t = 24)]
    pub llama_cache_ram_mib: usize,
    /// CPU threads per pod (`-t`).
    #[arg(long, default_value_t = 1)]
    pub llama_threads: usize,
}

impl EngineArgs {
    /// The engine's model name for requests.
    pub fn model(&self) -> String {
        if let Some(m) = &self.model {
            return m.clone();
        }
        match self.engine {
            EngineKind::Sim => crate::runner::MODEL.into(),
            // llama-server serves its one model under any name.
            EngineKind::Llama => "SmolLM2-135M-Instruct".into(),
        }
    }

    /// Whether latencies are real wall time (anything but the sim).
    pub fn real_time(&self) -> bool {
        !self.endpoints.is_empty() || self.engine != EngineKind::Sim
    }

    /// Number of pods: `--endpoints`' count, else `pods`.
    pub fn pod_count(&self, pods: usize) -> usize {
        if self.endpoints.is_empty() {
            pods
        } else {
            self.endpoints.len()
        }
    }

    /// Whether rows share pods (existing endpoints): prompts are salted per row.
    pub fn shared_pods(&self) -> bool {
        !self.endpoints.is_empty()
    }

    /// What the pods are, for reports.
    pub fn describe(&self, pods: usize) -> String {
        if !self.endpoints.is_empty() {
            return format!("{} existing endpoints", self.endpoints.len());
        }
        match self.engine {
            EngineKind::Sim => format!("{pods} simulated pods"),
            EngineKind::Llama => format!(
                "{pods} llama-server pods (-np {} -c {} --cache-ram {} -t {})",
                self.llama.llama_slots,
                self.llama.llama_ctx,
                self.llama.llama_cache_ram_mib,
                self.llama.llama_threads
            ),
        }
    }
}

/// The pods of one row.
#[derive(Debug)]
pub struct Pods {
    /// Their addresses, index = pod number.
    pub addrs: Vec<SocketAddr>,
    /// Kept alive for the row (empty for existing endpoints).
    _guards: Vec<ChildGuard>,
    _sim: Option<crate::procs::Sim>,
}

impl Pods {
    /// Starts the row's pods (or takes the existing endpoints).
    pub async fn start(engine: &EngineArgs, sim: &SimSettings, tools: &Tools) -> Result<Pods> {
        if !engine.endpoints.is_empty() {
            return Ok(Pods {
                addrs: engine.endpoints.clone(),
                _guards: Vec::new(),
                _sim: None,
            });
        }
        match engine.engine {
            EngineKind::Sim => {
                let s = start_sim(&tools.sim, sim, &tools.logs)?;
                Ok(Pods {
                    addrs: s.pods.clone(),
                    _guards: Vec::new(),
                    _sim: Some(s),
                })
            }
            EngineKind::Llama => start_llama(&engine.llama, sim.pods, tools).await,
        }
    }
}

async fn start_llama(a: &LlamaArgs, pods: usize, tools: &Tools) -> Result<Pods> {
    let (Some(bin), Some(model)) = (&a.llama_server, &a.llama_model) else {
        bail!("--engine llama needs llama-server and a model: run `./build.sh engine` (it prints KVROUTE_LLAMA_SERVER and KVROUTE_LLAMA_MODEL)");
    };
    let mut guards = Vec::new();
    let mut addrs = Vec::new();
    for i in 0..pods {
        let port = free_port()?;
        let mut cmd = Command::new(bin);
        cmd.arg("-m")
            .arg(model)
            .args([
                "--metrics",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
            ])
            .args([
                "-np",
                &a.llama_slots.to_string(),
                "-c",
                &a.llama_ctx.to_string(),
            ])
            .args(["-t", &a.llama_threads.to_string()])
            .args(["--cache-ram", &a.llama_cache_ram_mib.to_string()])
            .stdin(Stdio::null());
        let log = tools.logs.join(format!("llama-server-{i}.log"));
        let mut g = ChildGuard::spawn(&format!("llama-server {i}"), cmd, &log)?;
        wait_ok(
            &format!("http://127.0.0.1:{port}/health"),
            &mut g,
            Duration::from_secs(120),
        )
        .await
        .with_context(|| format!("llama-server {i}: see {}", log.display()))?;
        guards.push(g);
        addrs.push(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    Ok(Pods {
        addrs,
        _guards: guards,
        _sim: None,
    })
}
