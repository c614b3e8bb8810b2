//! Checking a parsed configuration: what the schema cannot say (ranges,
//! combinations, header names), each error naming the field, the value and
//! the reason ([`ConfigError`]).

use super::*;
use std::fmt;

/// A configuration error naming the field, the value and the reason.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigError {
    /// Dotted path of the bad field (`metrics.scrape_interval_ms`).
    pub field: String,
    /// The offending value, as written or as understood.
    pub value: String,
    /// Why it was refused.
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid kvroute config: field `{}` = {}: {}",
            self.field, self.value, self.reason
        )
    }
}

impl std::error::Error for ConfigError {}

pub(crate) fn err(field: &str, value: impl fmt::Display, reason: &str) -> ConfigError {
    ConfigError {
        field: field.to_string(),
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

impl Config {
    /// Parses and validates the plugin configuration. Empty input means all
    /// defaults (which then fails validation: `endpoints` is required).
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let text = std::str::from_utf8(bytes)
            .map_err(|_| err("(config)", "<bytes>", "configuration is not UTF-8"))?;
        let config = if text.trim().is_empty() {
            Config::default()
        } else {
            let de = &mut serde_json::Deserializer::from_str(text);
            serde_path_to_error::deserialize(de).map_err(|e| {
                let path = e.path().to_string();
                let field = if path == "." { "(config)".into() } else { path };
                ConfigError {
                    field,
                    value: "(see reason)".into(),
                    reason: e.into_inner().to_string(),
                }
            })?
        };
        config.validate()?;
        Ok(config)
    }

    /// Semantic checks that the schema cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.endpoints.is_empty() && self.discovery.is_none() {
            return Err(err(
                "endpoints",
                "[]",
                "at least one ip:port endpoint is required (or set discovery)",
            ));
        }
        if self.shadow && self.handoff != Handoff::OverrideHost {
            return Err(err(
                "shadow",
                true,
                "needs handoff `override_host` (an ORIGINAL_DST cluster has no balancer of its own to choose with)",
            ));
        }
        if let Some(d) = &self.discovery {
            if self.handoff != Handoff::OverrideHost {
                return Err(err(
                    "discovery",
                    "set",
                    "needs handoff `override_host` (an ORIGINAL_DST cluster has no members to discover)",
                ));
            }
            if d.admin_cluster.trim().is_empty() {
                return Err(err(
                    "discovery.admin_cluster",
                    "\"\"",
                    "must name an Envoy cluster",
                ));
            }
            if !(50..=60_000).contains(&d.interval_ms) {
                return Err(err(
                    "discovery.interval_ms",
                    d.interval_ms,
                    "must be 50..=60000",
                ));
            }
        }
        if let Some(p) = &self.peers {
            for (field, name) in [
                ("peers.cluster", &p.cluster),
                ("peers.admin_cluster", &p.admin_cluster),
            ] {
                if name.trim().is_empty() {
                    return Err(err(field, "\"\"", "must name an Envoy cluster"));
                }
            }
            if p.cluster == self.upstream_cluster {
                return Err(err(
                    "peers.cluster",
                    &p.cluster,
                    "must not be the upstream cluster (model servers are not peers)",
                ));
            }
            for (field, v, lo, hi) in [
                ("peers.sync_interval_ms", p.sync_interval_ms, 10, 60_000),
                ("peers.timeout_ms", p.timeout_ms, 10, 60_000),
                (
                    "peers.members_interval_ms",
                    p.members_interval_ms,
                    50,
                    600_000,
                ),
                ("peers.stale_after_ms", p.stale_after_ms, 100, 600_000),
                ("peers.max_peers", p.max_peers as u64, 1, 256),
                (
                    "peers.max_entries_per_sync",
                    p.max_entries_per_sync as u64,
                    1,
                    65_536,
                ),
                (
                    "peers.max_response_bytes",
                    p.max_response_bytes as u64,
                    4096,
                    64 * 1024 * 1024,
                ),
            ] {
                if !(lo..=hi).contains(&v) {
                    return Err(err(field, v, &format!("must be {lo}..={hi}")));
                }
            }
            if p.stale_after_ms < p.sync_interval_ms {
                return Err(err(
                    "peers.stale_after_ms",
                    p.stale_after_ms,
                    "must be at least peers.sync_interval_ms",
                ));
            }
        }
        if self.endpoints.len() > MAX_ENDPOINTS {
            return Err(err(
                "endpoints",
                self.endpoints.len(),
                "at most 1024 endpoints",
            ));
        }
        for (i, a) in self.endpoints.iter().enumerate() {
            if self.endpoints[..i].contains(a) {
                return Err(err(&format!("endpoints[{i}]"), a, "listed twice"));
            }
        }
        models::validate(&self.models, &self.endpoints, self.discovery.is_some())?;
        check_header_name("destination_header", &self.destination_header)?;
        if let Some(o) = &self.objectives {
            check_header_name("objectives.header", &o.header)?;
            let internal = [
                Some(self.destination_header.as_str()),
                self.debug_header.as_deref(),
                Some(STREAM_HEADER),
            ];
            if internal.contains(&Some(o.header.as_str())) {
                return Err(err(
                    "objectives.header",
                    &o.header,
                    "must differ from the headers kvroute sets (destination_header, debug_header, x-kvroute-stream)",
                ));
            }
            o.validate()?;
        }
        self.saturation.validate(self.metrics.scrape_interval_ms)?;
        if self.per_endpoint_stats > 65_536 {
            return Err(err(
                "per_endpoint_stats",
                self.per_endpoint_stats,
                "must be 0..=65536 (0 turns per-endpoint stats off)",
            ));
        }
        if let Some(h) = &self.debug_header {
            check_header_name("debug_header", h)?;
            if h.eq_ignore_ascii_case(&self.destination_header) {
                return Err(err(
                    "debug_header",
                    h,
                    "must differ from destination_header",
                ));
            }
        }
        if self.allowed_paths.is_empty() || self.allowed_paths.len() > 64 {
            return Err(err(
                "allowed_paths",
                self.allowed_paths.len(),
                "must list 1..=64 paths (an empty list would refuse every request)",
            ));
        }
        for (i, p) in self.allowed_paths.iter().enumerate() {
            if self.allowed_paths[..i].contains(p) {
                return Err(err(&format!("allowed_paths[{i}]"), p, "listed twice"));
            }
        }
        if self.max_body_bytes < 1024 || self.max_body_bytes > 256 << 20 {
            return Err(err(
                "max_body_bytes",
                self.max_body_bytes,
                "must be 1024..=268435456",
            ));
        }
        if self.upstream_cluster.trim().is_empty() {
            return Err(err(
                "upstream_cluster",
                "\"\"",
                "must name an Envoy cluster",
            ));
        }
        let m = &self.metrics;
        if !m.path.starts_with('/') || m.path.chars().any(|c| c.is_control() || c == ' ') {
            return Err(err(
                "metrics.path",
                &m.path,
                "must be an absolute path without spaces",
            ));
        }
        if !(10..=60_000).contains(&m.scrape_interval_ms) {
            return Err(err(
                "metrics.scrape_interval_ms",
                m.scrape_interval_ms,
                "must be 10..=60000",
            ));
        }
        if !(1..=1_000_000).contains(&m.max_scrapes_per_s) {
            return Err(err(
                "metrics.max_scrapes_per_s",
                m.max_scrapes_per_s,
                "must be 1..=1000000",
            ));
        }
        if !(1..=60_000).contains(&m.scrape_timeout_ms) {
            return Err(err(
                "metrics.scrape_timeout_ms",
                m.scrape_timeout_ms,
                "must be 1..=60000",
            ));
        }
        if !(MIN_METRICS_BODY_BYTES..=MAX_METRICS_BODY_BYTES).contains(&m.max_body_bytes) {
            return Err(err(
                "metrics.max_body_bytes",
                m.max_body_bytes,
                "must be 65536..=33554432 (Envoy drops a larger answer itself)",
            ));
        }
        if !(1000..=600_000).contains(&m.models_refresh_ms) {
            return Err(err(
                "metrics.models_refresh_ms",
                m.models_refresh_ms,
                "must be 1000..=600000",
            ));
        }
        if m.stale_after_ms < m.scrape_interval_ms {
            return Err(err(
                "metrics.stale_after_ms",
                m.stale_after_ms,
                "must be at least metrics.scrape_interval_ms",
            ));
        }
        if m.unhealthy_after_failures == 0 {
            return Err(err(
                "metrics.unhealthy_after_failures",
                0,
                "must be at least 1",
            ));
        }
        if m.engine == Engine::Custom
            && (m.names.waiting.is_none()
                && m.names.running.is_none()
                && m.names.kv_usage.is_none())
        {
            return Err(err(
                "metrics.names",
                "{}",
                "engine `custom` needs at least one metric name",
            ));
        }
        if let Some(s) = m.names.kv_usage_scale {
            if !(s.is_finite() && s > 0.0) {
                return Err(err(
                    "metrics.names.kv_usage_scale",
                    s,
                    "must be a positive number",
                ));
            }
        }
        let p = &self.prefix;
        if !(1..=4096).contains(&p.block_tokens) {
            return Err(err(
                "prefix.block_tokens",
                p.block_tokens,
                "must be 1..=4096",
            ));
        }
        if !(1..=16).contains(&p.bytes_per_token) {
            return Err(err(
                "prefix.bytes_per_token",
                p.bytes_per_token,
                "must be 1..=16",
            ));
        }
        if p.max_prompt_tokens < p.block_tokens {
            return Err(err(
                "prefix.max_prompt_tokens",
                p.max_prompt_tokens,
                "must be at least prefix.block_tokens",
            ));
        }
        if !(1..=10_000_000).contains(&p.capacity_blocks) {
            return Err(err(
                "prefix.capacity_blocks",
                p.capacity_blocks,
                "must be 1..=10000000",
            ));
        }
        if !(1..=1_048_576).contains(&p.max_json_nodes) {
            return Err(err(
                "prefix.max_json_nodes",
                p.max_json_nodes,
                "must be 1..=1048576",
            ));
        }
        let s = &self.scheduling;
        let w = &s.weights;
        for (name, v) in [
            ("scheduling.weights.prefix", w.prefix),
            ("scheduling.weights.queue", w.queue),
            ("scheduling.weights.kv_cache", w.kv_cache),
            ("scheduling.weights.inflight_requests", w.inflight_requests),
            ("scheduling.weights.inflight_tokens", w.inflight_tokens),
            ("scheduling.weights.lora_affinity", w.lora_affinity),
        ] {
            if !(v.is_finite() && (0.0..=1000.0).contains(&v)) {
                return Err(err(name, v, "must be a number in 0..=1000"));
            }
        }
        if w.prefix + w.queue + w.kv_cache + w.inflight_requests + w.inflight_tokens <= 0.0 {
            return Err(err(
                "scheduling.weights",
                "all 0",
                "at least one weight must be positive",
            ));
        }
        if !(s.affinity_threshold.is_finite() && (0.0..=1.0).contains(&s.affinity_threshold)) {
            return Err(err(
                "scheduling.affinity_threshold",
                s.affinity_threshold,
                "must be 0..=1",
            ));
        }
        if !(s.gate_max_queue_excess.is_finite() && s.gate_max_queue_excess >= 0.0) {
            return Err(err(
                "scheduling.gate_max_queue_excess",
                s.gate_max_queue_excess,
                "must be >= 0",
            ));
        }
        if let Some(t) = s.gate_max_tokens_excess {
            if !(t.is_finite() && t >= 0.0) {
                return Err(err(
                    "scheduling.gate_max_tokens_excess",
                    t,
                    "must be >= 0 (or null to disable)",
                ));
            }
        }
        for (name, v, max) in [
            ("scheduling.min_range_requests", s.min_range_requests, 1e6),
            ("scheduling.min_range_inflight", s.min_range_inflight, 1e6),
            ("scheduling.min_range_tokens", s.min_range_tokens, 1e9),
            ("scheduling.cold_margin", s.cold_margin, 1.0),
            (
                "scheduling.keep_cheaper_holder_min_saved",
                s.keep_cheaper_holder_min_saved,
                1.0,
            ),
            (
                "scheduling.ttft.prior_ms_per_token",
                s.ttft.prior_ms_per_token,
                1e3,
            ),
            (
                "scheduling.ttft.prior_overhead_ms",
                s.ttft.prior_overhead_ms,
                6e4,
            ),
            ("scheduling.ttft.learning_rate", s.ttft.learning_rate, 1.0),
        ] {
            if !(v.is_finite() && (0.0..=max).contains(&v)) {
                return Err(err(name, v, &format!("must be a number in 0..={max}")));
            }
        }
        if let Some(n) = s.engine_slots {
            if !(1..=MAX_ENGINE_SLOTS).contains(&n) {
                return Err(err(
                    "scheduling.engine_slots",
                    n,
                    &format!("must be 1..={MAX_ENGINE_SLOTS} (or left out to learn it)"),
                ));
            }
            if !s.slot_wait {
                return Err(err(
                    "scheduling.engine_slots",
                    n,
                    "prices the wait for a slot: needs scheduling.slot_wait",
                ));
            }
        }
        if s.ttft.prior_ms_per_token <= 0.0 || s.ttft.learning_rate <= 0.0 {
            return Err(err(
                "scheduling.ttft",
                format!("{:?}", s.ttft),
                "prior_ms_per_token and learning_rate must be > 0",
            ));
        }
        let o = &self.outlier_detection;
        if o.consecutive_errors > 1000 {
            return Err(err(
                "outlier_detection.consecutive_errors",
                o.consecutive_errors,
                "must be 0..=1000 (0 disables)",
            ));
        }
        if !(100..=3_600_000).contains(&o.base_ejection_ms) {
            return Err(err(
                "outlier_detection.base_ejection_ms",
                o.base_ejection_ms,
                "must be 100..=3600000",
            ));
        }
        if o.max_ejection_ms < o.base_ejection_ms || o.max_ejection_ms > 86_400_000 {
            return Err(err(
                "outlier_detection.max_ejection_ms",
                o.max_ejection_ms,
                "must be at least outlier_detection.base_ejection_ms and at most 86400000",
            ));
        }
        if o.max_ejection_percent > 100 {
            return Err(err(
                "outlier_detection.max_ejection_percent",
                o.max_ejection_percent,
                "must be 0..=100",
            ));
        }
        if self.shared.key_prefix.is_empty() || self.shared.key_prefix.len() > 64 {
            return Err(err(
                "shared.key_prefix",
                &self.shared.key_prefix,
                "must be 1..=64 bytes",
            ));
        }
        if !(16..=65_536).contains(&self.shared.log_slots) {
            return Err(err(
                "shared.log_slots",
                self.shared.log_slots,
                "must be 16..=65536",
            ));
        }
        let f = &self.failover;
        if f.stall_after_ms != 0 && !(100..=600_000).contains(&f.stall_after_ms) {
            return Err(err(
                "failover.stall_after_ms",
                f.stall_after_ms,
                "must be 0 (off) or 100..=600000",
            ));
        }
        for (field, v) in [
            ("failover.first_byte_timeout_ms", f.first_byte_timeout_ms),
            ("failover.response_timeout_ms", f.response_timeout_ms),
        ] {
            if v != 0 && !(100..=3_600_000).contains(&v) {
                return Err(err(field, v, "must be 0 (none) or 100..=3600000"));
            }
        }
        if f.retry_statuses.len() > MAX_RETRY_STATUSES {
            return Err(err(
                "failover.retry_statuses",
                format!("{:?}", f.retry_statuses),
                &format!("must list at most {MAX_RETRY_STATUSES} statuses"),
            ));
        }
        if let Some((i, s)) = f
            .retry_statuses
            .iter()
            .enumerate()
            .find(|(_, s)| !(400..=599).contains(*s))
        {
            return Err(err(
                &format!("failover.retry_statuses[{i}]"),
                s,
                "must be a 4xx or 5xx status (400..=599)",
            ));
        }
        Ok(())
    }
}

/// Header names must be lowercase HTTP tokens and not pseudo or hop-by-hop.
fn check_header_name(field: &str, name: &str) -> Result<(), ConfigError> {
    let token = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if !token {
        return Err(err(
            field,
            name,
            "must be a non-empty lowercase header name ([a-z0-9_-])",
        ));
    }
    const RESERVED: [&str; 8] = [
        "host",
        "connection",
        "content-length",
        "content-type",
        "transfer-encoding",
        "te",
        "upgrade",
        "keep-alive",
    ];
    if RESERVED.contains(&name) {
        return Err(err(field, name, "must not be a standard HTTP header"));
    }
    Ok(())
}
