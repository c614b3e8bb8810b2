//! The command line of `kvroute-sim` and the configuration it produces.
//!
//! Kept apart from `main.rs` so that tests (and other binaries) can build a
//! [`SimConfig`] without a process.

use clap::{Parser, ValueEnum};

use crate::latency::LatencyModel;

/// Which engine's `/metrics` names a pod exposes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineFlavor {
    /// vLLM (V1 engine) names: `vllm:num_requests_waiting`, ...
    Vllm,
    /// SGLang names: `sglang:num_queue_reqs`, ...
    Sglang,
    /// llama.cpp `llama-server --metrics` names: `llamacpp:requests_deferred`, ...
    Llamacpp,
}

impl EngineFlavor {
    /// The lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineFlavor::Vllm => "vllm",
            EngineFlavor::Sglang => "sglang",
            EngineFlavor::Llamacpp => "llamacpp",
        }
    }
}

/// `kvroute-sim`: N simulated vLLM/SGLang/llama.cpp model servers with a real prefix KV-cache.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvroute-sim", version, about)]
pub struct Cli {
    /// Number of pods (independent model servers) to run.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub pods: u16,
    /// Port of pod 0; pod i listens on base-port + i (0: each pod picks a free port).
    #[arg(long, default_value_t = 8001)]
    pub base_port: u16,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Metric names to expose.
    #[arg(long, value_enum, default_value_t = EngineFlavor::Vllm)]
    pub engine: EngineFlavor,
    /// Served model name (in /v1/models, responses and the model_name label).
    #[arg(long, default_value = "meta-llama/Llama-3.1-8B-Instruct")]
    pub model: String,
    /// LoRA adapters every pod serves (comma-separated names; requests name them in
    /// `model`). Set: a request for any other model than `--model` or these gets 404, and
    /// `/metrics` reports `vllm:lora_requests_info`.
    #[arg(long, value_delimiter = ',')]
    pub lora_adapters: Vec<String>,
    /// Adapters loaded at once per pod (vLLM's `--max-loras`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub max_loras: u16,
    /// Simulated milliseconds to load an adapter that is not loaded.
    #[arg(long, default_value_t = 100.0)]
    pub lora_load_ms: f64,
    /// KV-cache capacity per pod, in blocks (default: Llama-3.1-8B on an 80 GB H100).
    #[arg(long, default_value_t = 26_000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub kv_blocks: u64,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub block_size: u64,
    /// Maximum requests in the running batch per pod.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_num_seqs: u64,
    /// Token budget per engine step (decodes + prefill chunks).
    #[arg(long, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub max_num_batched_tokens: u64,
    /// Wall seconds per simulated second (1.0 real time, 0.1 ten times faster).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Turn the latency model off: answer as fast as possible (for throughput benchmarks).
    #[arg(long)]
    pub no_latency: bool,
    /// Seed for synthetic output and fault draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Tokio worker threads (1: a single-threaded runtime).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: Option<u16>,
    /// Port of the process-level control server (GET /pods, POST /pods/{i}/fault, ...).
    #[arg(long)]
    pub control_port: Option<u16>,
    /// Latency model: fixed cost of one engine step, in milliseconds.
    #[arg(long, default_value_t = 6.5)]
    pub step_overhead_ms: f64,
    /// Latency model: compute cost per batched token (prefill or decode), in microseconds.
    #[arg(long, default_value_t = 40.0)]
    pub per_token_us: f64,
    /// Latency model: KV read cost per context token per decoding sequence, in nanoseconds.
    #[arg(long, default_value_t = 40.0)]
    pub kv_read_per_token_ns: f64,
    /// Relative speed of each pod (comma-separated, pod 0 first; pods past the list run at
    /// 1): pod i's step times are the latency model's divided by its speed. A mixed fleet,
    /// e.g. `1,1,1,0.5`: the last pod is a GPU half as fast.
    #[arg(long, value_delimiter = ',')]
    pub pod_speeds: Vec<f64>,
    /// Every pod keeps no prompt for another request (vLLM's
    /// `--no-enable-prefix-caching`): its prefix-cache hit counter stays at 0.
    /// One pod at run time: the `no_prefix_caching` fault.
    #[arg(long)]
    pub no_prefix_caching: bool,
}

/// The simulator's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Number of pods.
    pub pods: usize,
    /// Port of pod 0 (0: any free port for every pod).
    pub base_port: u16,
    /// Listen address.
    pub host: String,
    /// Metric flavor.
    pub engine: EngineFlavor,
    /// Served model name.
    pub model: String,
    /// KV capacity per pod in blocks.
    pub kv_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Maximum running requests per pod.
    pub max_num_seqs: usize,
    /// Token budget per step.
    pub max_num_batched_tokens: usize,
    /// Wall seconds per simulated second.
    pub time_scale: f64,
    /// Latency model off.
    pub no_latency: bool,
    /// RNG seed.
    pub seed: u64,
    /// Runtime worker threads (`None`: one per core).
    pub threads: Option<usize>,
    /// Control server port.
    pub control_port: Option<u16>,
    /// The step-time model.
    pub latency: LatencyModel,
    /// LoRA adapters served (empty: none).
    pub lora_adapters: Vec<String>,
    /// Adapters loaded at once.
    pub max_loras: usize,
    /// Simulated seconds to load an adapter.
    pub lora_load_s: f64,
    /// Relative speed per pod (pods past the list: 1).
    pub pod_speeds: Vec<f64>,
    /// No pod keeps prompts for later requests.
    pub no_prefix_caching: bool,
}

impl SimConfig {
    /// Pod `index`'s step-time model: the fleet's, divided by its speed.
    pub fn latency_of(&self, index: usize) -> LatencyModel {
        let speed = self.pod_speeds.get(index).copied().unwrap_or(1.0);
        LatencyModel {
            step_overhead_s: self.latency.step_overhead_s / speed,
            per_token_s: self.latency.per_token_s / speed,
            kv_read_per_token_s: self.latency.kv_read_per_token_s / speed,
        }
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            pods: 1,
            base_port: 8001,
            host: "127.0.0.1".to_owned(),
            engine: EngineFlavor::Vllm,
            model: "meta-llama/Llama-3.1-8B-Instruct".to_owned(),
            kv_blocks: 26_000,
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            time_scale: 1.0,
            no_latency: false,
            seed: 0,
            threads: None,
            control_port: None,
            latency: LatencyModel::default(),
            lora_adapters: Vec::new(),
            max_loras: 1,
            lora_load_s: 0.1,
            pod_speeds: Vec::new(),
            no_prefix_caching: false,
        }
    }
}

impl Cli {
    /// Validates the flags and builds the configuration.
    pub fn into_config(self) -> Result<SimConfig, String> {
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(format!("--time-scale must be > 0, got {}", self.time_scale));
        }
        for (name, v) in [
            ("--step-overhead-ms", self.step_overhead_ms),
            ("--per-token-us", self.per_token_us),
            ("--kv-read-per-token-ns", self.kv_read_per_token_ns),
            ("--lora-load-ms", self.lora_load_ms),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name} must be >= 0, got {v}"));
            }
        }
        if let Some(v) = self
            .pod_speeds
            .iter()
            .find(|v| !(v.is_finite() && (0.01..=100.0).contains(*v)))
        {
            return Err(format!("--pod-speeds must be within 0.01..=100, got {v}"));
        }
        if self.pod_speeds.len() > usize::from(self.pods) {
            return Err(format!(
                "--pod-speeds lists {} pods, --pods is {}",
                self.pod_speeds.len(),
                self.pods
            ));
        }
        if self.base_port != 0 && u32::from(self.base_port) + u32::from(self.pods) - 1 > 65535 {
            return Err("--base-port + --pods exceeds 65535".to_owned());
        }
        Ok(SimConfig {
            pods: usize::from(self.pods),
            base_port: self.base_port,
            host: self.host,
            engine: self.engine,
            model: self.model,
            kv_blocks: self.kv_blocks as usize,
            block_size: self.block_size as usize,
            max_num_seqs: self.max_num_seqs as usize,
            max_num_batched_tokens: self.max_num_batched_tokens as usize,
            time_scale: self.time_scale,
            no_latency: self.no_latency,
            seed: self.seed,
            threads: self.threads.map(usize::from),
            control_port: self.control_port,
            latency: LatencyModel {
                step_overhead_s: self.step_overhead_ms / 1e3,
                per_token_s: self.per_token_us / 1e6,
                kv_read_per_token_s: self.kv_read_per_token_ns / 1e9,
            },
            lora_adapters: self
                .lora_adapters
                .into_iter()
                .map(|a| a.trim().to_owned())
                .filter(|a| !a.is_empty())
                .collect(),
            max_loras: usize::from(self.max_loras),
            lora_load_s: self.lora_load_ms / 1e3,
            pod_speeds: self.pod_speeds,
            no_prefix_caching: self.no_prefix_caching,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_sim_config_default() {
        let c = Cli::parse_from(["kvroute-sim"]).into_config().unwrap();
        assert_eq!(c, SimConfig::default());
    }

    #[test]
    fn flags() {
        let c = Cli::parse_from([
            "kvroute-sim",
            "--pods",
            "4",
            "--base-port",
            "9000",
            "--engine",
            "sglang",
            "--no-latency",
            "--time-scale",
            "0.1",
            "--threads",
            "1",
            "--control-port",
            "9100",
        ])
        .into_config()
        .unwrap();
        assert_eq!(c.pods, 4);
        assert_eq!(c.engine, EngineFlavor::Sglang);
        assert!(c.no_latency);
        assert_eq!(c.threads, Some(1));
        assert_eq!(c.control_port, Some(9100));
        assert!(Cli::parse_from(["kvroute-sim", "--time-scale", "0"])
            .into_config()
            .is_err());
        assert!(Cli::try_parse_from(["kvroute-sim", "--pods", "0"]).is_err());
        let c = Cli::parse_from([
            "kvroute-sim",
            "--lora-adapters",
            "sql, fin",
            "--max-loras",
            "2",
        ])
        .into_config()
        .unwrap();
        assert_eq!(c.lora_adapters, ["sql", "fin"]);
        assert_eq!(c.max_loras, 2);
    }

    #[test]
    fn pod_speeds_scale_each_pod_s_step_times() {
        let c = Cli::parse_from(["kvroute-sim", "--pods", "3", "--pod-speeds", "1,0.5"])
            .into_config()
            .unwrap();
        let (fast, slow, unlisted) = (c.latency_of(0), c.latency_of(1), c.latency_of(2));
        assert_eq!(fast, LatencyModel::default());
        assert_eq!(unlisted, LatencyModel::default());
        assert_eq!(slow.per_token_s, 2.0 * fast.per_token_s);
        assert_eq!(slow.step_overhead_s, 2.0 * fast.step_overhead_s);
        assert_eq!(slow.kv_read_per_token_s, 2.0 * fast.kv_read_per_token_s);
        for bad in [["--pod-speeds", "0"], ["--pod-speeds", "1,1,1,1,1"]] {
            let args = ["kvroute-sim", "--pods", "3", bad[0], bad[1]];
            assert!(Cli::parse_from(args).into_config().is_err(), "{args:?}");
        }
    }
}
