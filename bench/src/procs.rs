//! Child processes the bench starts (simulator, Envoy, sglang-router), always killed.
//!
//! Each child runs in its own process group and is owned by a [`ChildGuard`] whose
//! `Drop` kills the group and reaps it, so an error, a panic or Ctrl-C (handled by
//! the caller, which then unwinds normally) never leaves a pod or a proxy behind.

use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// A started child process; dropping it kills its process group and waits for it.
#[derive(Debug)]
pub struct ChildGuard {
    name: String,
    child: Child,
    log: PathBuf,
}

impl ChildGuard {
    /// Spawns `cmd` in a new process group, stdout/stderr appended to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> Result<Self> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        cmd.stdout(out.try_clone()?)
            .stderr(out)
            .stdin(Stdio::null())
            .process_group(0);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name}: {cmd:?}"))?;
        Ok(ChildGuard {
            name: name.to_string(),
            child,
            log: log.to_path_buf(),
        })
    }

    /// Process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Fails if the child has already exited, with the end of its log: the
    /// log is removed when the same router starts again (the next workload
    /// or seed), and a skipped row should say why on its own.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited early ({status}); its log ends: {}",
                self.name,
                log_tail(&self.log, 5)
            );
        }
        Ok(())
    }
}

/// The last `lines` non-empty lines of the log at `path`, from its last
/// 4 KiB at most, joined with " | " (`(empty)` or `(unreadable)` otherwise).
fn log_tail(path: &Path, lines: usize) -> String {
    const WINDOW: u64 = 4096;
    let read = || -> std::io::Result<String> {
        let mut f = std::fs::File::open(path)?;
        let len = f.metadata()?.len();
        f.seek(SeekFrom::Start(len.saturating_sub(WINDOW)))?;
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    let Ok(text) = read() else {
        return "(unreadable)".into();
    };
    let tail: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if tail.is_empty() {
        return "(empty)".into();
    }
    tail[tail.len().saturating_sub(lines)..].join(" | ")
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        // The group id is the child's pid (process_group(0)); it holds only what we started.
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free loopback TCP port below the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`). The port is bound later by another
/// process (a sim, an Envoy, a replica's peer listener, all picked before
/// any starts); an ephemeral one could meanwhile become the source port of
/// an outgoing connection (an Envoy scraping its pods) and that bind would
/// fail. The kernel never hands out these on its own.
pub fn free_port() -> Result<u16> {
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768)
        .max(12_000);
    for _ in 0..1000 {
        let port = 10_000 + fastrand::u16(..ephemeral - 10_000);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Settings of the simulated fleet.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SimSettings {
    /// Number of pods.
    pub pods: usize,
    /// KV capacity per pod in blocks.
    pub kv_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Max running requests per pod.
    pub max_num_seqs: usize,
    /// Wall seconds per simulated second.
    pub time_scale: f64,
    /// Seed of the answers.
    pub seed: u64,
    /// Further `kvroute-sim` arguments (`--model`, `--lora-adapters`, ...).
    pub extra_args: Vec<String>,
}

/// A running simulator process and its pods' addresses.
#[derive(Debug)]
pub struct Sim {
    /// Pod addresses, index = pod number.
    pub pods: Vec<SocketAddr>,
    _guard: ChildGuard,
}

/// Starts `kvroute-sim` with free ports and waits until every pod listens.
pub fn start_sim(binary: &Path, s: &SimSettings, logs: &Path) -> Result<Sim> {
    let stderr_log = logs.join("sim.stderr.log");
    let mut cmd = Command::new(binary);
    cmd.args([
        "--pods",
        &s.pods.to_string(),
        "--base-port",
        "0",
        "--host",
        "127.0.0.1",
    ])
    .args([
        "--kv-blocks",
        &s.kv_blocks.to_string(),
        "--block-size",
        &s.block_size.to_string(),
    ])
    .args([
        "--max-num-seqs",
        &s.max_num_seqs.to_string(),
        "--time-scale",
        &s.time_scale.to_string(),
    ])
    .args(["--seed", &s.seed.to_string()])
    .args(&s.extra_args)
    .stdout(Stdio::piped())
    .stderr(Stdio::from(std::fs::File::create(&stderr_log)?))
    .stdin(Stdio::null())
    .process_group(0);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let stdout = child.stdout.take().context("sim stdout")?;
    let guard = ChildGuard {
        name: "kvroute-sim".into(),
        child,
        log: stderr_log,
    };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // Forwards "pod i listening on ADDR" lines, then drains stdout until EOF.
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut pods = vec![None; s.pods];
    let deadline = Instant::now() + Duration::from_secs(20);
    while pods.iter().any(Option::is_none) {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .context("kvroute-sim did not report its pods within 20 s")?;
        if let Some((i, addr)) = parse_pod_line(&line) {
            if i < pods.len() {
                pods[i] = Some(addr);
            }
        }
    }
    Ok(Sim {
        pods: pods.into_iter().map(|p| p.expect("all set")).collect(),
        _guard: guard,
    })
}

/// Parses `kvroute-sim: pod 3 listening on 127.0.0.1:8004`.
pub fn parse_pod_line(line: &str) -> Option<(usize, SocketAddr)> {
    let rest = line.strip_prefix("kvroute-sim: pod ")?;
    let (idx, rest) = rest.split_once(' ')?;
    let addr = rest.strip_prefix("listening on ")?;
    Some((idx.parse().ok()?, addr.trim().parse().ok()?))
}

/// Polls `url` until it answers 200 (or the child dies, or `timeout`).
pub async fn wait_ok(url: &str, child: &mut ChildGuard, timeout: Duration) -> Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()?;
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        child.check_alive()?;
        if let Ok(r) = client.get(url).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("{url} not ready within {timeout:?}")
}

/// Locations of the programs the bench drives.
#[derive(Debug, Clone)]
pub struct Tools {
    /// Repository root.
    pub root: PathBuf,
    /// `target/release/kvroute-sim`.
    pub sim: PathBuf,
    /// `target/wasm32-wasip1/release/kvroute.wasm`.
    pub wasm: PathBuf,
    /// The project virtualenv's python (Envoy renderer, sglang-router).
    pub python: PathBuf,
    /// Envoy (`$KVROUTE_ENVOY`, else the venv's, as `envoy/render.py` picks it): the
    /// front Envoy of a replicated gateway.
    pub envoy: PathBuf,
    /// Directory for this run's logs and rendered configs.
    pub logs: PathBuf,
}

impl Tools {
    /// Default locations under `root`; logs under `root/target/kvroute-bench-logs`.
    pub fn new(root: &Path) -> Result<Self> {
        let logs = root.join("target").join("kvroute-bench-logs");
        std::fs::create_dir_all(&logs)?;
        let t = Tools {
            root: root.to_path_buf(),
            sim: root.join("target/release/kvroute-sim"),
            wasm: root.join("target/wasm32-wasip1/release/kvroute.wasm"),
            python: root.join(".venv/bin/python"),
            envoy: std::env::var_os("KVROUTE_ENVOY")
                .map(PathBuf::from)
                .unwrap_or_else(|| root.join(".venv/bin/envoy")),
            logs,
        };
        for (p, what) in [
            (&t.sim, "kvroute-sim"),
            (&t.wasm, "kvroute.wasm"),
            (&t.python, "the project venv"),
        ] {
            if !p.exists() {
                bail!(
                    "{what} not found at {}: run ./build.sh build first",
                    p.display()
                );
            }
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_that_exits_early_says_why() {
        let dir = std::env::temp_dir().join(format!("kvroute-procs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("early.log");
        let _ = std::fs::remove_file(&log);
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            "for i in 1 2 3 4 5 6 7; do echo line $i; done; echo 'cannot bind 127.0.0.1:1' >&2; exit 3",
        ]);
        let mut child = ChildGuard::spawn("early", cmd, &log).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let err = loop {
            match child.check_alive() {
                Err(e) => break e.to_string(),
                Ok(()) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Ok(()) => panic!("sh did not exit"),
            }
        };
        assert!(
            err.starts_with("early exited early (exit status: 3); "),
            "{err}"
        );
        // The last five lines, the cause last.
        assert!(
            err.ends_with(
                "its log ends: line 4 | line 5 | line 6 | line 7 | cannot bind 127.0.0.1:1"
            ),
            "{err}"
        );
        assert_eq!(log_tail(&dir.join("absent.log"), 5), "(unreadable)");
        std::fs::write(&log, "\n\n").unwrap();
        assert_eq!(log_tail(&log, 5), "(empty)");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn parses_pod_lines() {
        assert_eq!(
            parse_pod_line("kvroute-sim: pod 3 listening on 127.0.0.1:8004"),
            Some((3, "127.0.0.1:8004".parse().unwrap()))
        );
        assert_eq!(
            parse_pod_line("kvroute-sim: control listening on 127.0.0.1:8100"),
            None
        );
    }
}
