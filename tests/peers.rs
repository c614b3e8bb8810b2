//! Active-active gateways (issue 11) through real Envoys and real
//! kvroute-sim pods: three kvroute replicas (each `./build.sh serve` with
//! `--peer-listen` / `--peers`) in front of the same pods.
//!
//! - a conversation whose turns alternate between replicas stays on one pod,
//!   each later turn decided by the prefix its first replica taught the others;
//! - a burst of new conversations split across replicas lands on one pod per
//!   shared prefix (rendezvous choice, no sync needed);
//! - a replica killed mid-run leaves the others routing with affinity, and it
//!   rejoins (learns and teaches again) when restarted;
//! - a refusal is unlearnt by the replica that saw it and never served to a
//!   peer (older builds would drop the whole answer);
//! - a peer answering junk, huge answers, foreign hosts or impossible entries
//!   changes nothing: counted, ignored, never an upstream outside the pool;
//! - the sync endpoint is not served on the public listener.

mod support;

use kvroute_core::config::PrefixConfig;
use kvroute_core::inflight::InFlightTable;
use kvroute_core::peer::wire::SyncAnswer;
use kvroute_core::request::{parse, ApiKind};
use kvroute_core::shared::decision_log::LogEntry;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::*;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const DEBUG: &str = "x-kvroute-debug";

fn config() -> Value {
    json!({"debug_header": DEBUG})
}

/// Starts replica `i` of a group whose peer listeners are `peer_ports`
/// (every replica lists all of them, itself included, as a Kubernetes
/// headless Service would).
fn replica(i: usize, pods: &[String], peer_ports: &[u16], config: Value) -> Envoy {
    let listen = format!("127.0.0.1:{}", peer_ports[i]);
    let peers: Vec<String> = peer_ports
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    Envoy::start_with(
        pods,
        config,
        2,
        &["--peer-listen", &listen, "--peers", &peers.join(",")],
    )
}

fn group(n: usize, pods: &[String]) -> (Vec<Envoy>, Vec<u16>) {
    let peer_ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
    let envoys = (0..n)
        .map(|i| replica(i, pods, &peer_ports, config()))
        .collect();
    (envoys, peer_ports)
}

/// Waits until every replica has heard from `n` peers.
fn wait_synced(replicas: &[&Envoy], n: usize) {
    let start = Instant::now();
    while !replicas
        .iter()
        .all(|r| r.stat("wasmcustom.kvroute.peer.replicas") >= n as f64)
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "replicas did not sync: {:?}",
            replicas
                .iter()
                .map(|r| r.stat("wasmcustom.kvroute.peer.replicas"))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The decision's reason and matched blocks from the debug header.
fn reason(r: &Reply) -> (String, usize) {
    let d = r.header(DEBUG).expect("debug header");
    let field = |k: &str| {
        d.split("; ")
            .find_map(|kv| kv.strip_prefix(k))
            .unwrap_or_default()
            .to_string()
    };
    let matched = field("matched=");
    let n = matched.split('/').next().unwrap().parse().unwrap_or(0);
    (field("reason=").to_lowercase(), n)
}

fn turn(envoy: &Envoy, tag: &str, t: usize) -> Reply {
    let r = post_json(
        &envoy.url("/v1/chat/completions"),
        &conversation_turn(MODEL, tag, t),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    r
}

#[test]
fn turns_alternating_between_replicas_stay_on_one_pod() {
    let sim = Sim::start(4, &[]);
    let (replicas, _) = group(3, &sim.endpoints());
    wait_synced(&replicas.iter().collect::<Vec<_>>(), 2);
    // Not on the public listener, whatever the path policy.
    let r = get(&replicas[0].url("/kvroute/peer/v1/log?since=0&max_bytes=4096"));
    assert_eq!(r.status, 404, "{}", r.body);

    let mut later_turns = 0;
    for c in 0..8 {
        let tag = format!("alternating-{c}");
        let mut pods = Vec::new();
        for t in 0..4 {
            let r = turn(&replicas[(c + t) % 3], &tag, t);
            pods.push(r.pod().unwrap());
            if t > 0 {
                // Taught by another replica: a prefix decision, not a
                // cold one that happens to agree.
                let (why, matched) = reason(&r);
                assert_eq!(why, "prefix", "{tag} turn {t}: {:?}", r.header(DEBUG));
                assert!(matched > 0);
                later_turns += 1;
            }
            // Think time longer than the sync lag (sync every 50 ms).
            std::thread::sleep(Duration::from_millis(250));
        }
        assert!(pods.iter().all(|&p| p == pods[0]), "{tag}: {pods:?}");
    }
    let learned: f64 = replicas
        .iter()
        .map(|r| r.stat("wasmcustom.kvroute.peer.learned"))
        .sum();
    assert!(learned >= later_turns as f64, "learned {learned}");
    for r in &replicas {
        assert_eq!(r.stat("wasmcustom.kvroute.peer.malformed"), 0.0);
        assert_eq!(r.stat("wasmcustom.kvroute.peer.dropped"), 0.0);
    }
}

/// A refusal stays with the replica that saw it: its `forget` entry is not
/// served to peers (a build from before such entries drops a whole sync
/// answer with one it cannot decode), while the decisions themselves are.
#[test]
fn a_refusal_on_one_replica_is_unlearnt_by_its_peers() {
    // Pod 0 answers 500: replica 0 sends it two new conversations, which
    // teach their prefixes there, and then un-teaches them (a forget entry).
    // Replica 1 learnt both decisions by sync; it must unlearn them too, or
    // a client's retry through replica 1 goes back to pod 0 by prefix.
    let sim = Sim::start(2, &[]);
    let (replicas, peer_ports) = group(2, &sim.endpoints());
    wait_synced(&replicas.iter().collect::<Vec<_>>(), 1);
    sim.fault(0, json!({"error_rate": 1.0}));
    let refusing = format!("endpoint={};", sim.endpoint(0));
    let mut refused = Vec::new();
    for c in 0..12 {
        let tag = format!("refused-{c}");
        let body = conversation_turn(MODEL, &tag, 0);
        let r = post_json(&replicas[0].url("/v1/chat/completions"), &body);
        let dbg = r.header(DEBUG).unwrap_or_default().to_string();
        if dbg.starts_with(&refusing) {
            assert_eq!(r.status, 500, "{dbg}");
            refused.push(tag);
            if refused.len() == 2 {
                break;
            }
        }
    }
    assert_eq!(refused.len(), 2, "pod 0 was not chosen twice");
    // A few sync rounds (every 50 ms) for the peer to read past them.
    std::thread::sleep(Duration::from_millis(400));
    assert!(replicas[0].stat("wasmcustom.kvroute.prefix.forgotten") >= 2.0);
    assert!(replicas[1].stat("wasmcustom.kvroute.peer.learned") >= 2.0);
    assert!(replicas[1].stat("wasmcustom.kvroute.peer.refusals") >= 2.0);
    assert_eq!(replicas[1].stat("wasmcustom.kvroute.peer.dropped"), 0.0);
    assert_eq!(replicas[1].stat("wasmcustom.kvroute.peer.malformed"), 0.0);
    sim.fault(0, json!({"error_rate": 0.0}));
    for tag in &refused {
        // The retry, through the other replica: placed like a new prompt.
        let r = post_json(
            &replicas[1].url("/v1/chat/completions"),
            &conversation_turn(MODEL, tag, 0),
        );
        assert_eq!(reason(&r).1, 0, "{tag}: {:?}", r.header(DEBUG));
    }
    // An asker from before refusals (no refusals=1) is never sent one: it
    // would drop the whole answer. One that asks gets them, and every
    // answer offers them.
    let ask = |query: &str| {
        let url = format!(
            "http://127.0.0.1:{}/kvroute/peer/v1/log?since=0&max_bytes=1000000{query}",
            peer_ports[0]
        );
        let r = agent().get(&url).call().expect("peer listener");
        let offered = r
            .headers()
            .get("x-kvroute-peer-refusals")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = r
            .into_body()
            .with_config()
            .limit(1 << 20)
            .read_to_vec()
            .expect("sync answer");
        let answer = SyncAnswer::decode(&body).expect("a sync answer");
        let forgets = answer.entries.iter().filter(|e| e.forget).count();
        (forgets, answer.entries.len(), offered)
    };
    let (old_forgets, old_entries, offered) = ask("");
    assert_eq!(old_forgets, 0);
    assert!(old_entries >= 2, "{old_entries} decisions served");
    assert_eq!(offered.as_deref(), Some("1"));
    let (forgets, _, _) = ask("&refusals=1");
    assert_eq!(forgets, 2);
}

/// Sends one new conversation per (prefix, replica) of `wave` at once;
/// returns (prefix, pod) per request, and each decision's debug header
/// (for the failure messages: why a replica went elsewhere).
fn burst(replicas: &[Envoy], wave: &[usize]) -> (Vec<(usize, usize)>, Vec<String>) {
    std::thread::scope(|s| {
        let handles: Vec<_> = wave
            .iter()
            .flat_map(|&p| (0..replicas.len()).map(move |i| (p, i)))
            .map(|(p, i)| {
                let envoy = &replicas[i];
                s.spawn(move || {
                    let mut body = conversation_turn(MODEL, &format!("shared-{p}"), 0);
                    body["messages"][1]["content"] = json!(format!("user {i} of prefix {p}"));
                    let r = post_json(&envoy.url("/v1/chat/completions"), &body);
                    assert_eq!(r.status, 200, "{}", r.body);
                    let why = format!("prefix {p} replica {i}: {}", r.header(DEBUG).unwrap_or(""));
                    ((p, r.pod().unwrap()), why)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).unzip()
    })
}

/// Prefixes of `results` whose requests all landed on one pod.
fn agreeing(results: &[(usize, usize)]) -> usize {
    let mut by_prefix: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
    for &(p, pod) in results {
        by_prefix.entry(p).or_default().push(pod);
    }
    by_prefix
        .values()
        .filter(|pods| pods.iter().all(|&x| x == pods[0]))
        .count()
}

#[test]
fn burst_split_across_replicas_lands_on_one_pod_per_prefix() {
    let sim = Sim::start(4, &[]);
    let (replicas, _) = group(3, &sim.endpoints());
    wait_synced(&replicas.iter().collect::<Vec<_>>(), 2);
    // A shared system prompt reaches all three replicas at the same moment,
    // well inside the sync lag: every replica picks the same pod. Eight
    // such prefixes one after another (a random or least-recently-picked
    // tie-break per replica would agree on 1 in 16).
    let (mut results, mut why) = (Vec::new(), Vec::new());
    for p in 0..8 {
        let (landed, decided) = burst(&replicas, &[p]);
        results.extend(landed);
        why.extend(decided);
        // Let the views settle: peers' in-flight counts are one sync old,
        // and two of them left over would move the choice (the load bound).
        // 500 ms is ten syncs; 200 ms (four) once left one replica of three
        // on another pod in a full CI run on a loaded box.
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(agreeing(&results), 8, "{results:?}\n{}", why.join("\n"));
    // Distinct prefixes spread: not all on one pod. (Their pods are a hash
    // of the prefix and the pods' addresses, new ports every run: 8
    // prefixes land on only 2 of 4 pods in 2.3 % of runs, which this once
    // asserted against and failed a CI run with; on 1 pod in 0.006 %.)
    let used: std::collections::HashSet<usize> = results.iter().map(|(_, pod)| *pod).collect();
    assert!(used.len() >= 2, "distinct prefixes spread: {results:?}");
    // Eight new prefixes at once (24 requests on 4 pods, each replica
    // deciding its eight in its own order): the load bound moves a request
    // off a pod that already has about two more in flight than the least
    // loaded, so agreement is partial (random choices: 1 prefix in 2), and
    // no pod takes the wave.
    let (results, why) = burst(&replicas, &(8..16).collect::<Vec<_>>());
    let mut per_pod = [0usize; 4];
    for &(_, pod) in &results {
        per_pod[pod] += 1;
    }
    assert!(agreeing(&results) >= 2, "{results:?}\n{}", why.join("\n"));
    assert!(per_pod.iter().all(|&n| n <= 10), "{per_pod:?}");
}

#[test]
fn killed_replica_leaves_others_with_affinity_and_rejoins() {
    let sim = Sim::start(4, &[]);
    let pods = sim.endpoints();
    let (mut replicas, peer_ports) = group(3, &pods);
    wait_synced(&replicas.iter().collect::<Vec<_>>(), 2);
    drop(replicas.pop()); // replica 2 dies

    // Replicas 0 and 1 keep routing with affinity, at full speed.
    for c in 0..4 {
        let tag = format!("survivors-{c}");
        let first = turn(&replicas[c % 2], &tag, 0).pod();
        std::thread::sleep(Duration::from_millis(250));
        let start = Instant::now();
        let r = turn(&replicas[(c + 1) % 2], &tag, 1);
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "a dead peer delayed a request"
        );
        assert_eq!(r.pod(), first, "{tag}");
        assert_eq!(reason(&r).0, "prefix", "{:?}", r.header(DEBUG));
    }
    assert!(replicas[0].stat("wasmcustom.kvroute.peer.sync_failed") > 0.0);

    // It comes back (a new process, a new replica id) on the same address.
    replicas.push(replica(2, &pods, &peer_ports, config()));
    wait_synced(&replicas.iter().collect::<Vec<_>>(), 2);
    for c in 0..4 {
        let tag = format!("rejoined-{c}");
        let (a, b) = if c % 2 == 0 { (0, 2) } else { (2, 1) };
        let first = turn(&replicas[a], &tag, 0).pod();
        std::thread::sleep(Duration::from_millis(250));
        let r = turn(&replicas[b], &tag, 1);
        assert_eq!(r.pod(), first, "{tag}");
        assert_eq!(reason(&r).0, "prefix", "{tag}: {:?}", r.header(DEBUG));
    }
}

/// A fake peer: answers every sync request with the next of `answers`
/// (status, body), cycling.
fn fake_peer(answers: Vec<(u16, Vec<u8>)>) -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let served = Arc::new(AtomicUsize::new(0));
    let count = served.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let mut req = Vec::new();
            let mut buf = [0u8; 4096];
            while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => req.extend_from_slice(&buf[..n]),
                }
            }
            let i = count.fetch_add(1, Ordering::SeqCst);
            let (status, body) = &answers[i % answers.len()];
            let head = format!(
                "HTTP/1.1 {status} X\r\ncontent-type: application/octet-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = s.write_all(head.as_bytes());
            let _ = s.write_all(body);
        }
    });
    (port, served)
}

/// A kvroute replica whose only peer is a fake one answering `answers`;
/// the count of sync requests the fake peer served.
fn replica_of_fake_peer(
    pods: &[String],
    answers: Vec<(u16, Vec<u8>)>,
) -> (Envoy, Arc<AtomicUsize>) {
    let (fake, served) = fake_peer(answers);
    let listen = format!("127.0.0.1:{}", free_port());
    let peers = format!("127.0.0.1:{fake}");
    let envoy = Envoy::start_with(
        pods,
        config(),
        2,
        &["--peer-listen", &listen, "--peers", &peers],
    );
    (envoy, served)
}

#[test]
fn a_hostile_peer_changes_nothing() {
    let sim = Sim::start(4, &[]);
    let pods = sim.endpoints();
    let pod = |i: usize| pods[i].parse().unwrap();
    // The blocks of a conversation's first turn, as kvroute hashes them.
    let body = conversation_turn(MODEL, "steered", 0);
    let blocks = parse(
        ApiKind::ChatCompletions,
        &serde_json::to_vec(&body).unwrap(),
        &PrefixConfig::default(),
    )
    .unwrap()
    .blocks;
    let entry = |endpoint, blocks: Vec<u64>, from_peer| LogEntry {
        seq: 0,
        endpoint,
        at_ms: 0,
        blocks,
        from_peer,
        forget: false,
    };
    let answer = |entries: Vec<LogEntry>, inflight: InFlightTable| {
        SyncAnswer {
            replica: 0x5eed,
            next: 1,
            skipped: 0,
            inflight,
            entries,
        }
        .encode()
    };
    // Claims of a host outside the pool: as decisions and as load.
    let mut foreign_load = InFlightTable::new();
    foreign_load.add("10.9.9.9:80".parse().unwrap(), 1_000_000, 1);
    let hostile = vec![
        (200, b"not a sync answer at all".to_vec()),
        (200, vec![0u8; 5 * 1024 * 1024]), // past peers.max_response_bytes
        (500, b"oops".to_vec()),
        // 48 MiB: past what Envoy buffers for a call (32 MiB), so Envoy
        // resets the call and kvroute's callback gets no answer at all (the
        // build before 59e8372 read its status anyway, and the SDK panicked).
        (200, vec![0u8; 48 << 20]),
        (
            200,
            answer(
                vec![
                    entry("10.9.9.9:80".parse().unwrap(), blocks.clone(), false),
                    entry(pod(2), (0..100_000).collect(), false),
                    entry(pod(2), blocks.clone(), true),
                    entry(pod(2), vec![], false),
                ],
                foreign_load,
            ),
        ),
    ];
    let (envoy, served) = replica_of_fake_peer(&pods, hostile);
    let start = Instant::now();
    while served.load(Ordering::SeqCst) < 40 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "asked {} times; Envoy's log:\n{}",
            served.load(Ordering::SeqCst),
            envoy.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Junk is malformed; the huge answer is refused unread (malformed) or
    // cut by Envoy (failed); the 500 failed.
    let malformed = envoy.stat("wasmcustom.kvroute.peer.malformed");
    let failed = envoy.stat("wasmcustom.kvroute.peer.sync_failed");
    assert!(
        malformed >= 1.0 && failed >= 1.0 && malformed + failed >= 3.0,
        "{malformed} {failed}"
    );
    assert!(envoy.stat("wasmcustom.kvroute.peer.dropped") >= 4.0);
    assert_eq!(envoy.stat("wasmcustom.kvroute.peer.learned"), 0.0);
    // The steered conversation is still new to this replica, every request
    // reaches a pool pod, and the VM is alive.
    let r = turn(&envoy, "steered", 0);
    assert_eq!(reason(&r).0, "cold", "{:?}", r.header(DEBUG));
    for t in 0..20 {
        let r = turn(&envoy, &format!("after-junk-{t}"), 0);
        assert!(r.pod().is_some());
    }
    assert!(!envoy.log().contains("panicked"), "{}", envoy.log());
    drop(envoy);

    // The control: the same harness with one honest entry does steer, so the
    // assertions above could fail.
    let honest = vec![(
        200,
        answer(vec![entry(pod(2), blocks, false)], InFlightTable::new()),
    )];
    let (envoy, served) = replica_of_fake_peer(&pods, honest);
    let start = Instant::now();
    while served.load(Ordering::SeqCst) < 2 || envoy.stat("wasmcustom.kvroute.peer.learned") < 1.0 {
        assert!(start.elapsed() < Duration::from_secs(10), "never learned");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(100));
    let r = turn(&envoy, "steered", 0);
    assert_eq!(r.pod(), Some(2), "{:?}", r.header(DEBUG));
    assert_eq!(reason(&r).0, "prefix");
}

/// A rolling upgrade: a replica of this build beside one of an older build
/// that knows no refusals (`KVROUTE_OLD_WASM`, e.g. `66a5da5`'s
/// kvroute.wasm), both refusing requests. They keep syncing decisions; the
/// new one never asks the old one for refusals (the old one would refuse
/// the query), and never sends it one (the old one would drop the whole
/// answer). A manual check: CI does not build the older tree.
#[test]
#[ignore]
fn a_replica_of_an_older_build_keeps_syncing_with_refusals_about() {
    let old_wasm = std::env::var("KVROUTE_OLD_WASM").expect("set KVROUTE_OLD_WASM");
    let sim = Sim::start(2, &[]);
    let peer_ports = [free_port(), free_port()];
    let peers = format!("127.0.0.1:{},127.0.0.1:{}", peer_ports[0], peer_ports[1]);
    let start = |i: usize, wasm: Option<&str>| {
        let listen = format!("127.0.0.1:{}", peer_ports[i]);
        let mut extra = vec!["--peer-listen", &listen, "--peers", &peers];
        if let Some(w) = wasm {
            extra.extend(["--wasm", w]);
        }
        Envoy::start_with(&sim.endpoints(), config(), 2, &extra)
    };
    let new = start(0, None);
    let old = start(1, Some(&old_wasm));
    wait_synced(&[&new, &old], 1);
    let failed = |r: &Envoy| r.stat("wasmcustom.kvroute.peer.sync_failed");
    let failed_before = (failed(&new), failed(&old));
    sim.fault(0, json!({"error_rate": 1.0}));
    for c in 0..16 {
        for (who, r) in [("new", &new), ("old", &old)] {
            let body = conversation_turn(MODEL, &format!("{who}-{c}"), 0);
            post_json(&r.url("/v1/chat/completions"), &body);
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let stat = |r: &Envoy, s: &str| r.stat(&format!("wasmcustom.kvroute.{s}"));
    for (who, r) in [("new", &new), ("old", &old)] {
        println!(
            "{who}: forgotten {} learned {} refusals {} dropped {} malformed {} sync_ok {} sync_failed {}",
            stat(r, "prefix.forgotten"),
            stat(r, "peer.learned"),
            stat(r, "peer.refusals"),
            stat(r, "peer.dropped"),
            stat(r, "peer.malformed"),
            stat(r, "peer.sync_ok"),
            failed(r)
        );
        assert!(stat(r, "prefix.forgotten") >= 1.0, "{who} refused nothing");
        assert!(stat(r, "peer.learned") >= 4.0, "{who} learnt too little");
        assert_eq!(stat(r, "peer.dropped"), 0.0, "{who} was sent a refusal");
        assert_eq!(stat(r, "peer.malformed"), 0.0, "{who}");
    }
    assert_eq!((failed(&new), failed(&old)), failed_before, "a sync failed");
    assert_eq!(
        stat(&new, "peer.refusals"),
        0.0,
        "the old build sent a refusal"
    );
}
