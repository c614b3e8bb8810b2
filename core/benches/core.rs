//! Criterion microbenchmarks of the pure routing core, on the host.
//!
//! Issue 5 asks what kvroute costs per request *before* Envoy and wasm are in
//! the picture: how fast a body is parsed and hashed (MB/s), how fast a
//! Prometheus scrape is read, what the prefix index costs per lookup and per
//! insert, and how a decision scales with the pool (8, 64, 256, 1024 endpoints).
//! The in-proxy numbers (`kvroute-bench overhead`) include V8, copies and
//! shared data on top of these.
//!
//! Run: `cargo bench -p kvroute-core --bench core` (about a minute; results
//! are recorded in `bench/README.md`, section "Core microbenchmarks").
//! Measurement windows are short on purpose: the box has 2 cores and is
//! shared.

mod fixtures;

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fixtures::{
    chat_body, completions_body, conversation, endpoint, prose, DecideFixture, REQUEST_BLOCKS,
};
use kvroute_core::config::{Config, MetricsConfig, PrefixConfig};
use kvroute_core::metrics::{read_snapshot, MetricsSnapshot};
use kvroute_core::models::Scope;
use kvroute_core::outlier::OutlierTable;
use kvroute_core::prefix::{block_hashes, seed, PrefixIndex};
use kvroute_core::request::{parse, ApiKind};
use kvroute_core::router::Router;
use kvroute_core::shared::endpoint_state::EndpointStates;
use std::time::Duration;

/// The scrape fixture a real vLLM 0.29 server produced (see its SOURCES.md).
const VLLM_SCRAPE: &str =
    include_str!("../../tests/fixtures/metrics/vllm-0.29.0-v1-qwen2.5-1.5b-inferstack.txt");

/// Body sizes the issue names for parsing and hashing.
const BODY_SIZES: [(&str, usize); 3] = [
    ("16KiB", 16 << 10),
    ("512KiB", 512 << 10),
    ("4MiB", 4 << 20),
];

/// Pool sizes the issue names for decision time.
const POOL_SIZES: [usize; 4] = [8, 64, 256, 1024];

/// Parsing + canonicalization + chained block hashing of whole bodies.
fn bench_parse(c: &mut Criterion) {
    let cfg = PrefixConfig::default();
    let mut g = c.benchmark_group("parse");
    for (label, size) in BODY_SIZES {
        for (api, name, body) in [
            (ApiKind::ChatCompletions, "chat", chat_body(size)),
            (ApiKind::Completions, "completions", completions_body(size)),
        ] {
            parse(api, &body, &cfg).expect("the generated body parses");
            g.throughput(Throughput::Bytes(body.len() as u64));
            g.bench_with_input(BenchmarkId::new(name, label), &body, |b, body| {
                b.iter(|| parse(api, black_box(body), &cfg).map(|r| r.blocks.len()))
            });
        }
    }
    g.finish();
}

/// Block hashing alone (no JSON), for comparison with `parse`.
fn bench_hash(c: &mut Criterion) {
    let cfg = PrefixConfig::default();
    let mut g = c.benchmark_group("hash");
    let text = prose(4 << 20, &mut fastrand::Rng::with_seed(3));
    let s = seed("meta-llama/Llama-3.1-8B-Instruct", None);
    g.throughput(Throughput::Bytes(text.len() as u64));
    g.bench_function("block_hashes/4MiB", |b| {
        b.iter(|| block_hashes(s, black_box(text.as_bytes()), cfg.block_bytes(), usize::MAX).len())
    });
    g.finish();
}

/// Reading one real vLLM scrape into a snapshot.
fn bench_metrics(c: &mut Criterion) {
    let cfg = MetricsConfig::default();
    read_snapshot(VLLM_SCRAPE, &cfg).expect("the fixture reads");
    let mut g = c.benchmark_group("metrics");
    g.throughput(Throughput::Bytes(VLLM_SCRAPE.len() as u64));
    g.bench_function("read_snapshot/vllm-0.29.0", |b| {
        b.iter(|| read_snapshot(black_box(VLLM_SCRAPE), &cfg))
    });
    g.finish();
}

/// An index of `endpoints` endpoints, each filled to `capacity` blocks with
/// conversations of `REQUEST_BLOCKS` blocks; returns one conversation per
/// endpoint (the last recorded, so fully resident).
fn populated_index(endpoints: usize, capacity: usize) -> (PrefixIndex, Vec<Vec<u64>>) {
    let mut rng = fastrand::Rng::with_seed(11);
    let mut index = PrefixIndex::new(capacity);
    let mut last = Vec::new();
    for e in 0..endpoints {
        let mut conv = Vec::new();
        for _ in 0..capacity / REQUEST_BLOCKS {
            conv = conversation(&mut rng, REQUEST_BLOCKS);
            index.record(endpoint(e), &conv);
        }
        last.push(conv);
    }
    (index, last)
}

/// `PrefixIndex::longest_prefix` (hit and miss) and `record` on a full index.
fn bench_index(c: &mut Criterion) {
    let capacity = PrefixConfig::default().capacity_blocks;
    let (mut index, resident) = populated_index(8, capacity);
    let miss = conversation(&mut fastrand::Rng::with_seed(99), REQUEST_BLOCKS);
    let hit = &resident[3];
    assert_eq!(index.longest_prefix(hit)[0].1, REQUEST_BLOCKS);
    let mut g = c.benchmark_group("prefix_index");
    g.throughput(Throughput::Elements(REQUEST_BLOCKS as u64));
    g.bench_function("longest_prefix/hit_64_blocks", |b| {
        b.iter(|| index.longest_prefix(black_box(hit)))
    });
    g.bench_function("longest_prefix/miss", |b| {
        b.iter(|| index.longest_prefix(black_box(&miss)))
    });
    // New blocks into a full endpoint: every insert evicts (the steady state).
    let mut rng = fastrand::Rng::with_seed(5);
    g.bench_function("record/64_new_blocks_full_endpoint", |b| {
        b.iter_batched(
            || conversation(&mut rng, REQUEST_BLOCKS),
            |blocks| index.record(endpoint(0), &blocks),
            criterion::BatchSize::SmallInput,
        )
    });
    // Re-recording a resident conversation: LRU touches only.
    let touch = resident[5].clone();
    g.bench_function("record/64_resident_blocks", |b| {
        b.iter(|| index.record(endpoint(5), black_box(&touch)))
    });
    // A 512 KiB prompt (2048 blocks) into a proxy-sized index: 2 endpoints
    // at the capacity kvroute follows for a default kvroute-sim pod (6500).
    let mut small = PrefixIndex::new(6500);
    for e in 0..2 {
        small.record(endpoint(e), &conversation(&mut rng, 6500));
    }
    g.throughput(Throughput::Elements(2048));
    g.bench_function("record/2048_new_blocks_capacity_6500", |b| {
        b.iter_batched(
            || conversation(&mut rng, 2048),
            |blocks| small.record(endpoint(1), &blocks),
            criterion::BatchSize::SmallInput,
        )
    });
    g.finish();
}

/// `Router::decide` over pools of 8, 64, 256 and 1024 endpoints with a populated
/// index (each endpoint holds 4096 blocks) and fresh scrape states; the
/// request shares its first half with one endpoint's resident conversation.
fn bench_decide(c: &mut Criterion) {
    let mut g = c.benchmark_group("decide");
    for n in POOL_SIZES {
        let fixture = DecideFixture::new(n);
        let mut rng = fastrand::Rng::with_seed(23);
        fixture
            .decide(fixture.request(), &mut rng)
            .expect("a non-empty pool decides");
        g.bench_with_input(
            BenchmarkId::new("endpoints", n),
            fixture.request(),
            |b, request| b.iter(|| fixture.decide(black_box(request), &mut rng)),
        );
    }
    // A request for one of two models, each on half the pool (`models`),
    // and passive health tracking a failure of every 16th endpoint.
    for n in [64, 1024] {
        for (label, fixture) in [
            ("two_models", DecideFixture::with_two_models(n)),
            ("some_failing", DecideFixture::with_some_failing(n)),
        ] {
            let mut rng = fastrand::Rng::with_seed(23);
            g.bench_with_input(
                BenchmarkId::new(label, n),
                fixture.request(),
                |b, request| b.iter(|| fixture.decide(black_box(request), &mut rng)),
            );
        }
    }
    g.finish();
}

/// `Router::saturated` (whether a sheddable request is shed) over 1024
/// endpoints whose engines all queue past the threshold: the case that
/// sheds, where every endpoint's state is read.
fn bench_saturated(c: &mut Criterion) {
    let n = 1024;
    let router = Router::new(Config {
        endpoints: (0..n).map(endpoint).collect(),
        ..Config::default()
    });
    let now = 10_000;
    let mut states = EndpointStates::default();
    for e in 0..n {
        let busy = MetricsSnapshot {
            waiting: 50.0,
            running: 8.0,
            kv_usage: Some(0.99),
            kv_capacity_tokens: None,
        };
        states.succeed(endpoint(e), busy, now - 10);
    }
    let outliers = OutlierTable::default();
    assert!(router.saturated(Scope::All, &states, &outliers, now));
    c.bench_function("saturated/endpoints/1024", |b| {
        b.iter(|| router.saturated(Scope::All, black_box(&states), &outliers, now))
    });
}

/// Short windows: the whole suite runs in about a minute on 2 cores.
fn quick() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = core;
    config = quick();
    targets = bench_parse, bench_hash, bench_metrics, bench_index, bench_decide, bench_saturated
}
criterion_main!(core);
