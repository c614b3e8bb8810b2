//! Engine profiles: which metric names of a scrape become which
//! [`MetricsSnapshot`] field, for vLLM, SGLang, TensorRT-LLM serve, names
//! given in the config (`custom`), and `auto` (detect the engine from the
//! names present).
//!
//! | field | vLLM | SGLang | TensorRT-LLM serve | llama.cpp `llama-server --metrics` |
//! |---|---|---|---|---|
//! | `waiting` | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` | `trtllm_num_requests_waiting` | `llamacpp:requests_deferred` |
//! | `running` | `vllm:num_requests_running` | `sglang:num_running_reqs` | `trtllm_num_requests_running` | `llamacpp:requests_processing` |
//! | `kv_usage` | `vllm:kv_cache_usage_perc`, else `vllm:gpu_cache_usage_perc` (V0 / early V1) | `sglang:token_usage` | `trtllm_kv_cache_utilization` | `llamacpp:kv_cache_usage_ratio` (servers before mid-2025; current ones have none) |
//! | `kv_capacity_tokens` | `vllm:cache_config_info` labels `block_size` x `num_gpu_blocks` | - | - | - |
//! | `lora` | `vllm:lora_requests_info` labels (the sample with the largest value: `metrics/lora.rs`) | - | - | - |
//! | `prompt_tokens_total` | `vllm:prompt_tokens_total` | `sglang:prompt_tokens_total` | - | `llamacpp:prompt_tokens_total` |
//! | `prefix_hits_total` | `vllm:prefix_cache_hits_total`, else `vllm:gpu_prefix_cache_hits_total`; plus `vllm:external_prefix_cache_hits_total` | `sglang:cached_tokens_total` | - | `llamacpp:prompt_tokens_cached_total` (current servers; older ones have none) |
//!
//! `prompt_tokens_total` is not load: a counter that only a restart of the
//! engine (which empties its prefix cache) takes down (`Reading`).
//! `prefix_hits_total` is the engine's count of prompt tokens it served
//! from its prefix cache (an external one, vLLM's KV connectors, included):
//! `cache_trust.rs` compares it with what kvroute believed cached.
//!
//! llama.cpp: `requests_deferred` are requests waiting for a free slot (the
//! queue), `requests_processing` the busy slots. A current `llama-server`
//! reports no KV usage: the kv-cache scorer then scores it neutral, and its
//! load is read from the queue, the busy slots and kvroute's own in-flight
//! requests and uncached prompt tokens.
//!
//! All kv-usage gauges above are fractions 0..1 (vLLM's `_perc` name
//! notwithstanding: its HELP says "1 means 100 percent"). `metrics.names`
//! overrides any of these names (and `kv_usage_scale` rescales, 0.01 for a
//! percentage); with `engine: custom` only those names are read.
//!
//! **Several series of one family** (SGLang `dp_rank`/`tp_rank`, vLLM
//! data-parallel `engine="0"`, `"1"`, or several `model_name`s) are
//! aggregated as one endpoint: `waiting` and `running` are **summed** (the
//! endpoint's whole queue), `kv_usage` is the **mean** (the fraction of the
//! endpoint's total KV in use when the engines have equal caches, which is
//! how data parallelism is deployed), and `kv_capacity_tokens` is the
//! **sum**. `NaN` samples are ignored; negative counts clamp to 0, kv usage
//! clamps to 0..1.
//!
//! **Auto-detection** reads the union of the known names in one pass and
//! takes the engine with the most load names present (ties: vLLM, SGLang,
//! TensorRT-LLM, llama.cpp). A scrape with none of the chosen profile's load names
//! (`waiting`, `running`, `kv_usage`) is an error: the endpoint is not a
//! model server kvroute understands, or it was misconfigured.

use super::exposition::parse_filtered;
use super::lora::LoraSnapshot;
use super::{MetricsError, MetricsSnapshot, Reading};
use crate::config::{Engine, MetricsConfig};

/// The metric names one engine exposes (borrowed: built-ins are `'static`,
/// overrides borrow from the config).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NameProfile<'a> {
    /// The engine these names belong to.
    pub engine: Engine,
    /// Gauge of waiting requests.
    pub waiting: Option<&'a str>,
    /// Gauge of running requests.
    pub running: Option<&'a str>,
    /// KV-usage gauges, in order of preference (the first present wins).
    pub kv_usage: [Option<&'a str>; 2],
    /// Multiplier bringing `kv_usage` to 0..1.
    pub kv_usage_scale: f64,
    /// Info gauge with `block_size` and `num_gpu_blocks` labels.
    pub cache_config: Option<&'a str>,
    /// Gauge with `running_lora_adapters`, `waiting_lora_adapters` and
    /// `max_lora` labels (`lora.rs`).
    pub lora_info: Option<&'a str>,
    /// Counter of prompt tokens processed since the engine started.
    pub prompt_tokens: Option<&'a str>,
    /// Counters of prompt tokens served from the prefix cache: the first
    /// present of the first two, plus the third (an external cache).
    pub prefix_hits: [Option<&'a str>; 3],
    /// Where the engine answers its slot count (`engine_slots.rs`), if it
    /// does.
    pub slots_path: Option<&'static str>,
    /// Whether the engine's server closes its connection after every
    /// streamed answer without saying so (no `Connection: close`):
    /// llama.cpp's `llama-server` does. Envoy would put that connection
    /// back in its pool and could send the next request on it as it closes
    /// (the request is reset unanswered); streamed requests to such an
    /// engine ask for the close themselves (`src/filter.rs`).
    pub closes_after_stream: bool,
}

/// vLLM (V0 and V1 engines).
pub const VLLM: NameProfile<'static> = NameProfile {
    engine: Engine::Vllm,
    waiting: Some("vllm:num_requests_waiting"),
    running: Some("vllm:num_requests_running"),
    kv_usage: [
        Some("vllm:kv_cache_usage_perc"),
        Some("vllm:gpu_cache_usage_perc"),
    ],
    kv_usage_scale: 1.0,
    cache_config: Some("vllm:cache_config_info"),
    lora_info: Some("vllm:lora_requests_info"),
    prompt_tokens: Some("vllm:prompt_tokens_total"),
    prefix_hits: [
        Some("vllm:prefix_cache_hits_total"),
        Some("vllm:gpu_prefix_cache_hits_total"),
        Some("vllm:external_prefix_cache_hits_total"),
    ],
    slots_path: None,
    closes_after_stream: false,
};

/// SGLang.
pub const SGLANG: NameProfile<'static> = NameProfile {
    engine: Engine::Sglang,
    waiting: Some("sglang:num_queue_reqs"),
    running: Some("sglang:num_running_reqs"),
    kv_usage: [Some("sglang:token_usage"), None],
    kv_usage_scale: 1.0,
    cache_config: None,
    lora_info: None,
    prompt_tokens: Some("sglang:prompt_tokens_total"),
    prefix_hits: [Some("sglang:cached_tokens_total"), None, None],
    slots_path: None,
    closes_after_stream: false,
};

/// TensorRT-LLM's `trtllm-serve`.
pub const TRTLLM: NameProfile<'static> = NameProfile {
    engine: Engine::Trtllm,
    waiting: Some("trtllm_num_requests_waiting"),
    running: Some("trtllm_num_requests_running"),
    kv_usage: [Some("trtllm_kv_cache_utilization"), None],
    kv_usage_scale: 1.0,
    cache_config: None,
    lora_info: None,
    prompt_tokens: None,
    prefix_hits: [None; 3],
    slots_path: None,
    closes_after_stream: false,
};

/// llama.cpp's `llama-server --metrics`.
pub const LLAMACPP: NameProfile<'static> = NameProfile {
    engine: Engine::Llamacpp,
    waiting: Some("llamacpp:requests_deferred"),
    running: Some("llamacpp:requests_processing"),
    kv_usage: [Some("llamacpp:kv_cache_usage_ratio"), None],
    kv_usage_scale: 1.0,
    cache_config: None,
    lora_info: None,
    prompt_tokens: Some("llamacpp:prompt_tokens_total"),
    prefix_hits: [Some("llamacpp:prompt_tokens_cached_total"), None, None],
    slots_path: Some(crate::engine_slots::LLAMACPP_PATH),
    closes_after_stream: true,
};

impl<'a> NameProfile<'a> {
    /// The built-in profile of a known engine (`None` for auto/custom).
    pub fn builtin(engine: Engine) -> Option<NameProfile<'static>> {
        match engine {
            Engine::Vllm => Some(VLLM),
            Engine::Sglang => Some(SGLANG),
            Engine::Trtllm => Some(TRTLLM),
            Engine::Llamacpp => Some(LLAMACPP),
            Engine::Auto | Engine::Custom => None,
        }
    }

    /// This profile with the config's `metrics.names` overrides applied.
    pub fn with_overrides(self, cfg: &'a MetricsConfig) -> NameProfile<'a> {
        let n = &cfg.names;
        NameProfile {
            engine: self.engine,
            waiting: n.waiting.as_deref().or(self.waiting),
            running: n.running.as_deref().or(self.running),
            kv_usage: match n.kv_usage.as_deref() {
                Some(k) => [Some(k), None],
                None => self.kv_usage,
            },
            kv_usage_scale: n.kv_usage_scale.unwrap_or(self.kv_usage_scale),
            cache_config: self.cache_config,
            lora_info: self.lora_info,
            prompt_tokens: self.prompt_tokens,
            prefix_hits: self.prefix_hits,
            slots_path: self.slots_path,
            closes_after_stream: self.closes_after_stream,
        }
    }

    /// The profiles a config reads with (several for `auto`, in tie order).
    pub fn for_config(cfg: &'a MetricsConfig) -> Vec<NameProfile<'a>> {
        match cfg.engine {
            Engine::Auto => [VLLM, SGLANG, TRTLLM, LLAMACPP]
                .into_iter()
                .map(|p| p.with_overrides(cfg))
                .collect(),
            Engine::Custom => vec![NameProfile {
                engine: Engine::Custom,
                waiting: None,
                running: None,
                kv_usage: [None, None],
                kv_usage_scale: 1.0,
                cache_config: None,
                lora_info: None,
                prompt_tokens: None,
                prefix_hits: [None; 3],
                slots_path: None,
                closes_after_stream: false,
            }
            .with_overrides(cfg)],
            e => vec![NameProfile::builtin(e).unwrap_or(VLLM).with_overrides(cfg)],
        }
    }

    fn load_names(&self) -> impl Iterator<Item = &'a str> {
        [
            self.waiting,
            self.running,
            self.kv_usage[0],
            self.kv_usage[1],
        ]
        .into_iter()
        .flatten()
    }
}

/// Running aggregate of one metric family.
#[derive(Clone, Copy, Debug, Default)]
struct Acc {
    sum: f64,
    n: u32,
}

impl Acc {
    fn mean(self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / f64::from(self.n))
    }
    fn total(self) -> Option<f64> {
        (self.n > 0).then_some(self.sum)
    }
}

/// Reads a scrape with the configured profile(s); see the module comment.
/// Returns the snapshot and the engine whose names were used.
pub fn read(text: &str, cfg: &MetricsConfig) -> Result<(MetricsSnapshot, Engine), MetricsError> {
    read_all(text, cfg).map(|(r, e)| (r.snapshot, e))
}

/// [`read`], with what else the scrape says (`Reading`: the LoRA adapters
/// and the prompt-token counter, when the engine's profile reads them and
/// the scrape has them).
pub fn read_all(text: &str, cfg: &MetricsConfig) -> Result<(Reading, Engine), MetricsError> {
    let profiles = NameProfile::for_config(cfg);
    // Distinct wanted names; a slot per name.
    let mut names: Vec<&str> = Vec::with_capacity(16);
    for p in &profiles {
        for n in p
            .load_names()
            .chain(p.cache_config)
            .chain(p.lora_info)
            .chain(p.prompt_tokens)
            .chain(p.prefix_hits.into_iter().flatten())
        {
            if !names.contains(&n) {
                names.push(n);
            }
        }
    }
    let mut accs = vec![Acc::default(); names.len()];
    let mut capacity = Acc::default();
    let cache_names: Vec<&str> = profiles.iter().filter_map(|p| p.cache_config).collect();
    let lora_names: Vec<&str> = profiles.iter().filter_map(|p| p.lora_info).collect();
    // The current LoRA state: the sample with the largest value (time).
    let mut lora: Option<(f64, LoraSnapshot)> = None;
    let mut parser = parse_filtered(text, |n| names.contains(&n));
    for s in parser.by_ref() {
        if lora_names.contains(&s.name) {
            let newer = lora.is_none_or(|(t, _)| s.value > t);
            if s.value.is_finite() && newer {
                let label = |l: &str| s.label(l).unwrap_or_default();
                let snapshot = LoraSnapshot::from_labels(
                    &label("running_lora_adapters"),
                    &label("waiting_lora_adapters"),
                    &label("max_lora"),
                );
                lora = Some((s.value, snapshot));
            }
            continue;
        }
        if cache_names.contains(&s.name) {
            let num = |l: &str| s.label(l).and_then(|v| v.trim().parse::<u64>().ok());
            if let (Some(bs), Some(blocks)) = (num("block_size"), num("num_gpu_blocks")) {
                capacity.sum += bs.saturating_mul(blocks) as f64;
                capacity.n += 1;
            }
            continue;
        }
        if s.value.is_nan() {
            continue;
        }
        if let Some(i) = names.iter().position(|n| *n == s.name) {
            accs[i].sum += s.value;
            accs[i].n += 1;
        }
    }
    let acc = |name: Option<&str>| -> Acc {
        name.and_then(|n| names.iter().position(|x| *x == n))
            .map(|i| accs[i])
            .unwrap_or_default()
    };
    let present = |p: &NameProfile| p.load_names().filter(|n| acc(Some(n)).n > 0).count();
    let mut best: Option<(&NameProfile, usize)> = None;
    for p in &profiles {
        let k = present(p);
        if k > 0 && best.is_none_or(|(_, b)| k > b) {
            best = Some((p, k));
        }
    }
    let Some((p, _)) = best else {
        let wanted: Vec<&str> = profiles.iter().flat_map(|p| p.load_names()).collect();
        return Err(MetricsError(format!(
            "none of {wanted:?} in the scrape ({} lines, {} unparsable)",
            parser.lines(),
            parser.garbage()
        )));
    };
    let count = |name| acc(name).total().map_or(0.0, |v: f64| v.max(0.0));
    let kv_usage = p
        .kv_usage
        .iter()
        .find_map(|n| acc(*n).mean())
        .map(|v| (v * p.kv_usage_scale).clamp(0.0, 1.0));
    let kv_capacity_tokens = if p.cache_config.is_some() {
        capacity.total().map(|v| v as u64).filter(|&v| v > 0)
    } else {
        None
    };
    Ok((
        Reading {
            snapshot: MetricsSnapshot {
                waiting: count(p.waiting),
                running: count(p.running),
                kv_usage,
                kv_capacity_tokens,
            },
            lora: lora.filter(|_| p.lora_info.is_some()).map(|(_, l)| l),
            prompt_tokens_total: acc(p.prompt_tokens).total().filter(|v| v.is_finite()),
            prefix_hits_total: {
                let [first, second, external] = p.prefix_hits.map(|n| acc(n).total());
                first
                    .or(second)
                    .map(|v| v + external.unwrap_or(0.0))
                    .filter(|v| v.is_finite())
            },
            slots_path: p.slots_path,
            closes_after_stream: p.closes_after_stream,
        },
        p.engine,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MetricNames;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    macro_rules! fixture {
        ($f:literal) => {
            include_str!(concat!("../../../tests/fixtures/metrics/", $f))
        };
    }

    fn cfg(engine: Engine) -> MetricsConfig {
        MetricsConfig {
            engine,
            ..MetricsConfig::default()
        }
    }

    fn snap(w: f64, r: f64, kv: Option<f64>, cap: Option<u64>) -> MetricsSnapshot {
        MetricsSnapshot {
            waiting: w,
            running: r,
            kv_usage: kv,
            kv_capacity_tokens: cap,
        }
    }

    #[test]
    fn the_prompt_token_counter_of_each_engine() {
        let total =
            |text: &str, engine| read_all(text, &cfg(engine)).unwrap().0.prompt_tokens_total;
        let vllm = fixture!("vllm-0.29.0-v1-qwen2.5-1.5b-inferstack.txt");
        assert_eq!(total(vllm, Engine::Auto), Some(530.0));
        let sglang = fixture!("sglang-docs-production-metrics-llama3.1-8b.txt");
        assert_eq!(total(sglang, Engine::Sglang), Some(8.128902e6));
        let llamacpp = fixture!("llamacpp-11434-smollm2-after-3-requests.txt");
        assert_eq!(total(llamacpp, Engine::Auto), Some(1249.0));
        // Summed over series (data-parallel ranks); NaN samples skipped.
        let text = "sglang:num_queue_reqs 0\n\
                    sglang:prompt_tokens_total{dp_rank=\"0\"} 3\n\
                    sglang:prompt_tokens_total{dp_rank=\"1\"} NaN\n\
                    sglang:prompt_tokens_total{dp_rank=\"2\"} 4\n";
        assert_eq!(total(text, Engine::Auto), Some(7.0));
        // Not reported (TensorRT-LLM, or a scrape without it), or not the
        // chosen engine's: none.
        assert_eq!(total("trtllm_num_requests_waiting 1\n", Engine::Auto), None);
        assert_eq!(total("vllm:num_requests_waiting 1\n", Engine::Auto), None);
        let text = "vllm:num_requests_waiting 1\nsglang:prompt_tokens_total 9\n";
        assert_eq!(total(text, Engine::Auto), None);
    }

    #[test]
    fn the_prefix_hit_counter_of_each_engine() {
        let hits = |text: &str, engine| read_all(text, &cfg(engine)).unwrap().0.prefix_hits_total;
        let vllm = fixture!("vllm-0.29.0-v1-qwen2.5-1.5b-inferstack.txt");
        assert_eq!(hits(vllm, Engine::Auto), Some(432.0));
        // vLLM 0.10 named it `gpu_prefix_cache_hits_total`.
        let glm = fixture!("vllm-0.10.0-v1-glm4.5-fragment.txt");
        assert_eq!(hits(glm, Engine::Vllm), Some(0.0));
        let sglang = fixture!("sglang-pr7944-deepseek-r1-fragment.txt");
        assert_eq!(hits(sglang, Engine::Sglang), Some(2688.0));
        // The current name wins over the old one; an external cache's hits
        // (a KV connector) add; data-parallel series are summed.
        let text = "vllm:num_requests_waiting 0\n\
                    vllm:prefix_cache_hits_total{engine=\"0\"} 100\n\
                    vllm:prefix_cache_hits_total{engine=\"1\"} 20\n\
                    vllm:gpu_prefix_cache_hits_total{engine=\"0\"} 7\n\
                    vllm:external_prefix_cache_hits_total{engine=\"0\"} 3\n";
        assert_eq!(hits(text, Engine::Auto), Some(123.0));
        // External hits alone are not the counter; engines without one
        // (TensorRT-LLM, llama.cpp servers older than the counter) report
        // none.
        let text = "vllm:num_requests_waiting 0\nvllm:external_prefix_cache_hits_total 3\n";
        assert_eq!(hits(text, Engine::Auto), None);
        assert_eq!(hits("trtllm_num_requests_waiting 1\n", Engine::Auto), None);
        let old_llamacpp = "llamacpp:requests_processing 1\nllamacpp:prompt_tokens_total 9\n";
        assert_eq!(hits(old_llamacpp, Engine::Llamacpp), None);
        // llama.cpp counts the prompt tokens it reused from a slot or its
        // prompt cache (a real scrape: one request reused the system prompt).
        let llamacpp = fixture!("llamacpp-11434-smollm2-after-3-requests.txt");
        assert_eq!(hits(llamacpp, Engine::Auto), Some(611.0));
        assert_eq!(hits(llamacpp, Engine::Llamacpp), Some(611.0));
    }

    #[test]
    fn real_fixtures_with_auto_and_their_engine() {
        let cases: &[(&str, &str, Engine, MetricsSnapshot)] = &[
            (
                "vllm 0.29 full",
                fixture!("vllm-0.29.0-v1-qwen2.5-1.5b-inferstack.txt"),
                Engine::Vllm,
                snap(0.0, 0.0, Some(0.0), Some(16 * 20184)),
            ),
            (
                "vllm 0.10 fragment",
                fixture!("vllm-0.10.0-v1-glm4.5-fragment.txt"),
                Engine::Vllm,
                snap(0.0, 0.0, Some(9.75010481363281e-06), None),
            ),
            (
                "vllm 0.8 gpu_cache_usage_perc",
                fixture!("vllm-v1-0.8-era-qwen2.5-coder-32b-fragment.txt"),
                Engine::Vllm,
                snap(0.0, 0.0, Some(0.0), None),
            ),
            (
                "llm-d inference sim",
                fixture!("vllm-llm-d-inference-sim-kthena1129-fragment.txt"),
                Engine::Vllm,
                snap(0.0, 0.0, None, None),
            ),
            (
                "sglang docs",
                fixture!("sglang-docs-production-metrics-llama3.1-8b.txt"),
                Engine::Sglang,
                snap(2826.0, 162.0, Some(0.28), None),
            ),
            (
                "sglang 4412",
                fixture!("sglang-pr4412-llama3-8b-fragment.txt"),
                Engine::Sglang,
                snap(0.0, 0.0, Some(0.0), None),
            ),
            (
                "sglang 7944",
                fixture!("sglang-pr7944-deepseek-r1-fragment.txt"),
                Engine::Sglang,
                snap(0.0, 0.0, Some(0.0), None),
            ),
            (
                "sglang dp ranks",
                fixture!("sglang-aibrix1614-deepseek-r1-dp-ranks-fragment.txt"),
                Engine::Sglang,
                snap(0.0, 0.0, None, None),
            ),
        ];
        for (what, text, engine, want) in cases {
            let (got, detected) = read(text, &cfg(Engine::Auto)).unwrap();
            assert_eq!(detected, *engine, "{what}");
            assert_eq!(got, *want, "{what} (auto)");
            let (got, _) = read(text, &cfg(*engine)).unwrap();
            assert_eq!(got, *want, "{what} (explicit)");
        }
    }

    #[test]
    fn wrong_engine_or_foreign_scrape_is_an_error() {
        let vllm = fixture!("vllm-0.29.0-v1-qwen2.5-1.5b-inferstack.txt");
        assert!(read(vllm, &cfg(Engine::Sglang)).is_err());
        assert!(read(vllm, &cfg(Engine::Trtllm)).is_err());
        for text in [
            fixture!("triton-base-metrics-readme.txt"),
            fixture!("triton-trtllm-backend-readme-inflight-batcher.txt"),
            "",
            "garbage\n\0\n",
        ] {
            let e = read(text, &cfg(Engine::Auto)).unwrap_err();
            assert!(e.0.contains("vllm:num_requests_waiting"), "{e:?}");
        }
    }

    #[test]
    fn custom_names_read_a_triton_scrape() {
        let mut c = cfg(Engine::Custom);
        c.names = MetricNames {
            waiting: Some("nv_inference_pending_request_count".into()),
            ..MetricNames::default()
        };
        let (s, e) = read(fixture!("triton-base-metrics-readme.txt"), &c).unwrap();
        assert_eq!(e, Engine::Custom);
        assert_eq!(s, snap(0.0, 0.0, None, None));
    }

    #[test]
    fn llamacpp_real_scrapes_are_auto_detected() {
        // Real llama-server scrapes (tests/fixtures/metrics/SOURCES.md):
        // no KV gauge, the busy slots are `running`, the deferred queue
        // `waiting`.
        for (text, running) in [
            (
                fixture!("llamacpp-11434-smollm2-np2-one-processing.txt"),
                1.0,
            ),
            (fixture!("llamacpp-11434-smollm2-after-3-requests.txt"), 0.0),
        ] {
            let (s, e) = read(text, &cfg(Engine::Auto)).unwrap();
            assert_eq!(e, Engine::Llamacpp);
            assert_eq!(s, snap(0.0, running, None, None));
            assert_eq!(read(text, &cfg(Engine::Llamacpp)).unwrap().0, s);
            assert!(read(text, &cfg(Engine::Vllm)).is_err());
            // llama-server closes its connection after every stream.
            assert!(
                read_all(text, &cfg(Engine::Auto))
                    .unwrap()
                    .0
                    .closes_after_stream
            );
        }
        let vllm = fixture!("vllm-0.29.0-v1-qwen2.5-1.5b-inferstack.txt");
        let (r, e) = read_all(vllm, &cfg(Engine::Auto)).unwrap();
        assert_eq!(e, Engine::Vllm);
        assert!(!r.closes_after_stream, "vLLM keeps its connections");
        // An older server's KV gauge is read when present.
        let old = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 3\n\
                   llamacpp:kv_cache_usage_ratio 0.25\n";
        let (s, e) = read(old, &cfg(Engine::Auto)).unwrap();
        assert_eq!((e, s), (Engine::Llamacpp, snap(3.0, 2.0, Some(0.25), None)));
    }

    #[test]
    fn trtllm_and_overrides_and_scale() {
        let text = "# TYPE trtllm_num_requests_waiting gauge\n\
                    trtllm_num_requests_waiting{model_name=\"m\"} 3\n\
                    trtllm_num_requests_running{model_name=\"m\"} 7\n\
                    trtllm_kv_cache_utilization{model_name=\"m\"} 0.5\n\
                    my_kv_pct 40\n";
        let (s, e) = read(text, &cfg(Engine::Auto)).unwrap();
        assert_eq!(e, Engine::Trtllm);
        assert_eq!(s, snap(3.0, 7.0, Some(0.5), None));
        let mut c = cfg(Engine::Trtllm);
        c.names.kv_usage = Some("my_kv_pct".into());
        c.names.kv_usage_scale = Some(0.01);
        assert_eq!(read(text, &c).unwrap().0, snap(3.0, 7.0, Some(0.4), None));
    }

    #[test]
    fn multi_series_sum_counts_and_average_kv() {
        let cases: &[(&str, MetricsSnapshot)] = &[
            (
                "vllm:num_requests_waiting{engine=\"0\"} 2\n\
                 vllm:num_requests_waiting{engine=\"1\"} 3\n\
                 vllm:num_requests_running{engine=\"0\"} 4\n\
                 vllm:num_requests_running{engine=\"1\"} 1\n\
                 vllm:kv_cache_usage_perc{engine=\"0\"} 0.2\n\
                 vllm:kv_cache_usage_perc{engine=\"1\"} 0.6\n\
                 vllm:gpu_cache_usage_perc{engine=\"1\"} 0.9\n\
                 vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"100\"} 1\n\
                 vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"None\"} 1\n\
                 vllm:cache_config_info{block_size=\"16\",engine=\"2\",num_gpu_blocks=\"50\"} 1\n",
                snap(5.0, 5.0, Some(0.4), Some(2400)),
            ),
            (
                "sglang:num_queue_reqs{dp_rank=\"0\"} 1.0\n\
                 sglang:num_queue_reqs{dp_rank=\"1\"} NaN\n\
                 sglang:num_queue_reqs{dp_rank=\"2\"} 4.0\n\
                 sglang:num_running_reqs{dp_rank=\"0\"} -1\n\
                 sglang:token_usage{dp_rank=\"0\"} 0.5\n\
                 sglang:token_usage{dp_rank=\"1\"} 1.7\n",
                snap(5.0, 0.0, Some(1.0), None),
            ),
        ];
        for (text, want) in cases {
            assert_eq!(read(text, &cfg(Engine::Auto)).unwrap().0, *want, "{text}");
        }
    }

    #[test]
    fn vllm_lora_info_takes_the_newest_sample() {
        use crate::metrics::lora::adapter_id;
        // vLLM keeps one series per past label set; the value is the time
        // it was set (`set_to_current_time`).
        let text = "# HELP vllm:lora_requests_info Running stats on lora requests.\n\
                    # TYPE vllm:lora_requests_info gauge\n\
                    vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1.7898284e+09\n\
                    vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"alpaca\",waiting_lora_adapters=\"underdog\"} 1.789828498802105e+09\n\
                    vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"underdog\",waiting_lora_adapters=\"\"} 1.7898284e+09\n\
                    vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1.0\n";
        let (Reading { lora, .. }, engine) = read_all(text, &cfg(Engine::Auto)).unwrap();
        assert_eq!(engine, Engine::Vllm);
        let lora = lora.expect("lora state");
        assert!(lora.running(adapter_id("alpaca")));
        assert!(lora.waiting(adapter_id("underdog")));
        assert!(!lora.running(adapter_id("underdog")), "an older sample");
        assert_eq!(lora.max_lora, 2);
        // Engines without the gauge, or vLLM without LoRA: none.
        let (Reading { lora, .. }, _) =
            read_all("vllm:num_requests_waiting 1\n", &cfg(Engine::Auto)).unwrap();
        assert_eq!(lora, None);
        let text =
            "sglang:num_queue_reqs 1\nvllm:lora_requests_info{running_lora_adapters=\"a\"} 1\n";
        let (Reading { lora, .. }, engine) = read_all(text, &cfg(Engine::Auto)).unwrap();
        assert_eq!((engine, lora), (Engine::Sglang, None));
    }

    #[test]
    fn a_real_vllm_lora_line_after_a_real_vllm_scrape() {
        use crate::metrics::lora::adapter_id;
        // Two real vLLM 0.29.0 sources (tests/fixtures/metrics/SOURCES.md):
        // a scrape without LoRA, and the LoRA line of a run with adapters.
        let text = [
            include_str!("../../../tests/fixtures/metrics/vllm-0.29.0-v1-qwen2.5-1.5b-inferstack.txt"),
            include_str!("../../../tests/fixtures/metrics/vllm-0.29.0-cpu-smollm2-lora-requests-info-line.txt"),
        ]
        .concat();
        let (Reading { lora, .. }, engine) = read_all(&text, &cfg(Engine::Auto)).unwrap();
        assert_eq!(engine, Engine::Vllm);
        let lora = lora.expect("lora state");
        assert_eq!(
            (lora.running_count, lora.waiting_count, lora.max_lora),
            (1, 1, 2)
        );
        assert_eq!(lora.affinity(adapter_id("alpaca")), 1.0);
        assert_eq!(
            lora.affinity(adapter_id("underdog")),
            0.0,
            "both slots taken"
        );
    }

    #[test]
    fn auto_picks_the_engine_with_most_names() {
        let text =
            "sglang:num_queue_reqs 1\nvllm:num_requests_waiting 2\nvllm:num_requests_running 3\n";
        let (s, e) = read(text, &cfg(Engine::Auto)).unwrap();
        assert_eq!(e, Engine::Vllm);
        assert_eq!(s.waiting, 2.0);
        let text = "sglang:num_queue_reqs 1\nvllm:num_requests_waiting 2\n";
        assert_eq!(read(text, &cfg(Engine::Auto)).unwrap().1, Engine::Vllm);
    }
}
