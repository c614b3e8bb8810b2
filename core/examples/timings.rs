//! The core's per-request work timed in the runtime the filter runs in:
//! built for wasm32-wasip1 and run under V8, the engine of Envoy's wasm
//! filters (`--no-liftoff`: optimized code up front, as Envoy's V8
//! compiles it). Envoy 1.40 carries V8 14.6; Deno 2.9 (a PyPI wheel:
//! `pip install deno`) carries V8 15.0 and is the closer stand-in; Node 20
//! carries V8 11.3, which can mislead (bench/README.md, "Core
//! microbenchmarks": a hash change 14 % faster there was 3 % faster in
//! Deno and a tie in Envoy). Built natively, the same program gives the
//! host's times of the same work, for the ratio.
//!
//! ```sh
//! cargo build --release --target wasm32-wasip1 -p kvroute-core --example timings
//! deno run -A --v8-flags=--no-liftoff bench/wasm/run-wasi.mjs target/wasm32-wasip1/release/examples/timings.wasm [FILTER]
//! node --no-liftoff --single-threaded-gc bench/wasm/run-wasi.mjs target/wasm32-wasip1/release/examples/timings.wasm [FILTER]
//! cargo run --release -p kvroute-core --example timings [FILTER]     # natively
//! ```
//!
//! Each line: the median and the lowest of 15 samples of about 20 ms each,
//! per operation. `FILTER` keeps the lines whose name contains it. Inputs
//! are those of the criterion benchmarks (`benches/fixtures`).

#[path = "../benches/fixtures/mod.rs"]
mod fixtures;

use fixtures::{chat_body, completions_body, DecideFixture};
use kvroute_core::config::PrefixConfig;
use kvroute_core::request::{parse, ApiKind};
use std::hint::black_box;
use std::time::{Duration, Instant};

const SAMPLES: usize = 15;
const SAMPLE_TIME: Duration = Duration::from_millis(20);

/// Prints the median and lowest time per call of `f`, in microseconds.
fn time(name: &str, mut f: impl FnMut()) {
    // Calls per sample: enough to fill the sample time.
    let mut calls = 1u32;
    loop {
        let t = Instant::now();
        for _ in 0..calls {
            f();
        }
        if t.elapsed() >= SAMPLE_TIME / 4 || calls >= 1 << 20 {
            calls = calls.saturating_mul(4);
            break;
        }
        calls *= 2;
    }
    let mut us: Vec<f64> = (0..SAMPLES)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..calls {
                f();
            }
            t.elapsed().as_secs_f64() * 1e6 / f64::from(calls)
        })
        .collect();
    us.sort_by(f64::total_cmp);
    println!(
        "{name:<28} {:>9.2} us  (lowest {:.2})",
        us[SAMPLES / 2],
        us[0]
    );
}

fn main() {
    let filter = std::env::args().nth(1).unwrap_or_default();
    let wanted = |name: &str| name.contains(&filter);
    let cfg = PrefixConfig::default();
    for (label, size) in [
        ("1KiB", 1 << 10),
        ("16KiB", 16 << 10),
        ("512KiB", 512 << 10),
    ] {
        for (api, kind, body) in [
            (ApiKind::ChatCompletions, "chat", chat_body(size)),
            (ApiKind::Completions, "completions", completions_body(size)),
        ] {
            let name = format!("parse/{kind}/{label}");
            if wanted(&name) {
                time(&name, || {
                    black_box(parse(api, black_box(&body), &cfg).map(|r| r.blocks.len())).ok();
                });
            }
        }
    }
    type Build = fn(usize) -> DecideFixture;
    let pools = [2, 8, 64, 256, 1024].map(|n| ("endpoints", n, DecideFixture::new as Build));
    let variants = [64, 1024].into_iter().flat_map(|n| {
        [
            ("two_models", n, DecideFixture::with_two_models as Build),
            ("some_failing", n, DecideFixture::with_some_failing as Build),
        ]
    });
    for (label, n, build) in pools.into_iter().chain(variants) {
        let name = format!("decide/{label}/{n}");
        if !wanted(&name) {
            continue;
        }
        let fixture = build(n);
        let mut rng = fastrand::Rng::with_seed(23);
        time(&name, || {
            black_box(fixture.decide(black_box(fixture.request()), &mut rng));
        });
    }
}
