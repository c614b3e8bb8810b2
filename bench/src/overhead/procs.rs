//! The processes the overhead benchmark drives (the simulator and Envoy) and
//! what it reads about them from `/proc`.
//!
//! Every child is held by a [`Child`] guard that kills and reaps it when
//! dropped, so an error (or a panic) anywhere in the run leaves nothing
//! behind. Envoy is started exactly as `./build.sh serve --no-build` starts
//! it (`envoy/render.py --run`, which `exec`s Envoy, so the child's pid *is*
//! Envoy's).

use anyhow::{bail, Context as _, Result};
use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A running child process, killed and reaped on drop.
#[derive(Debug)]
pub struct Child {
    name: String,
    inner: std::process::Child,
    log: PathBuf,
}

impl Child {
    /// Spawns `cmd` with stdout and stderr appended to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> Result<Child> {
        let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let inner = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {name}: {cmd:?}"))?;
        Ok(Child {
            name: name.to_owned(),
            inner,
            log: log.to_owned(),
        })
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.inner.id()
    }

    /// Fails (with the tail of its log) if the child has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.inner.try_wait()? {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "{} exited ({status}); log {}:\n{}",
                self.name,
                self.log.display(),
                tail.join("\n")
            );
        }
        Ok(())
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if let Ok(None) = self.inner.try_wait() {
            let _ = self.inner.kill();
        }
        let _ = self.inner.wait();
    }
}

/// Where the binaries and scripts the benchmark runs live.
#[derive(Debug, Clone)]
pub struct Tools {
    /// `kvroute-sim` (release).
    pub sim: PathBuf,
    /// `kvroute.wasm` (release, wasm32-wasip1).
    pub wasm: PathBuf,
    /// The project virtualenv's Python (runs `envoy/render.py`).
    pub python: PathBuf,
    /// `envoy/render.py`.
    pub render: PathBuf,
    /// Directory for logs and rendered plugin configs.
    pub work: PathBuf,
}

impl Tools {
    /// The tree's release binaries, script and venv under `root`, with a
    /// fresh work directory `<tmp>/kvroute-<tag>-<pid>`; fails when one is missing.
    pub fn in_tree(root: &Path, tag: &str) -> Result<Tools> {
        let work = std::env::temp_dir().join(format!("kvroute-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&work)?;
        let tools = Tools {
            sim: root.join("target/release/kvroute-sim"),
            wasm: root.join("target/wasm32-wasip1/release/kvroute.wasm"),
            python: root.join(".venv/bin/python"),
            render: root.join("envoy/render.py"),
            work,
        };
        for p in [&tools.sim, &tools.wasm, &tools.python, &tools.render] {
            if !p.exists() {
                bail!("{} not found: run ./build.sh build first", p.display());
            }
        }
        Ok(tools)
    }
}

/// Starts `kvroute-sim --pods N --no-latency --base-port P` and waits until
/// every pod answers `/health`.
pub fn start_sim(tools: &Tools, pods: u16, base_port: u16) -> Result<Child> {
    let mut cmd = Command::new(&tools.sim);
    cmd.args(["--pods", &pods.to_string(), "--no-latency"])
        .args(["--base-port", &base_port.to_string()]);
    let mut child = Child::spawn("kvroute-sim", cmd, &tools.work.join("sim.log"))?;
    for i in 0..pods {
        let addr = SocketAddr::from(([127, 0, 0, 1], base_port + i));
        wait_http_ok(&mut child, addr, "/health", Duration::from_secs(15))?;
    }
    Ok(child)
}

/// One Envoy to start: the load-balancing mode and, for kvroute, an
/// optional plugin configuration (JSON object; endpoints are added).
#[derive(Debug, Clone)]
pub struct EnvoySpec {
    /// Short name for logs and results (`round_robin`, `kvroute`, ...).
    pub name: String,
    /// `--lb` of `render.py`: `kvroute` or `round_robin`.
    pub lb: &'static str,
    /// Plugin configuration (kvroute only).
    pub plugin: Option<serde_json::Value>,
    /// Listener port on 127.0.0.1.
    pub listen: u16,
    /// Admin port on 127.0.0.1.
    pub admin: u16,
    /// Envoy worker threads (`--concurrency`).
    pub workers: u16,
    /// Take the cluster's members from this EDS file (`--eds-file`) instead
    /// of `--endpoints` (kvroute then needs `discovery` in its config).
    pub eds_file: Option<PathBuf>,
}

/// Starts Envoy the way `./build.sh serve --no-build` does and waits until
/// its admin `/ready` answers 200.
pub fn start_envoy(tools: &Tools, spec: &EnvoySpec, endpoints: &[SocketAddr]) -> Result<Child> {
    let eps: Vec<String> = endpoints.iter().map(ToString::to_string).collect();
    let mut cmd = Command::new(&tools.python);
    cmd.arg(&tools.render).arg("--run").args(["--lb", spec.lb]);
    match &spec.eds_file {
        Some(eds) => cmd.arg("--eds-file").arg(eds),
        None => cmd.args(["--endpoints", &eps.join(",")]),
    };
    cmd.args(["--listen", &format!("127.0.0.1:{}", spec.listen)])
        .args(["--admin", &format!("127.0.0.1:{}", spec.admin)])
        .args(["--concurrency", &spec.workers.to_string()])
        .arg("--wasm")
        .arg(&tools.wasm)
        .args(["--log-level", "warn"]);
    if let Some(plugin) = &spec.plugin {
        let path = tools.work.join(format!("plugin-{}.json", spec.name));
        std::fs::write(&path, serde_json::to_vec_pretty(plugin)?)?;
        cmd.arg("--config").arg(path);
    }
    let log = tools.work.join(format!("envoy-{}.log", spec.name));
    let mut child = Child::spawn(&format!("envoy ({})", spec.name), cmd, &log)?;
    let admin = SocketAddr::from(([127, 0, 0, 1], spec.admin));
    wait_http_ok(&mut child, admin, "/ready", Duration::from_secs(30))?;
    Ok(child)
}

/// Fails early, with a clear message, if a port the run needs is taken.
pub fn ensure_free(port: u16) -> Result<()> {
    std::net::TcpListener::bind(("127.0.0.1", port))
        .map(drop)
        .with_context(|| format!("127.0.0.1:{port} is in use (pick another --base-port)"))
}

/// Polls `GET path` on `addr` until it answers 200 (bounded by `limit`).
fn wait_http_ok(child: &mut Child, addr: SocketAddr, path: &str, limit: Duration) -> Result<()> {
    let start = Instant::now();
    while start.elapsed() < limit {
        child.check_alive()?;
        if http_get(addr, path).is_ok_and(|(status, _)| status == 200) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!(
        "{}: http://{addr}{path} not 200 within {limit:?}",
        child.name
    )
}

/// A minimal blocking HTTP/1.1 GET (admin and health endpoints only):
/// returns the status and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no HTTP status line")?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    Ok((status, body))
}

/// CPU time (user + system) a process has used, in seconds, from
/// `/proc/<pid>/stat`.
pub fn cpu_seconds(pid: u32, clock_ticks: f64) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_cpu_ticks(&stat)
        .map(|t| t as f64 / clock_ticks)
        .context("unreadable /proc/<pid>/stat")
}

/// utime + stime (fields 14 and 15) of a `/proc/<pid>/stat` line; the
/// command name in parentheses may contain spaces, so fields are counted
/// after its closing parenthesis.
pub fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): utime is field 14, stime field 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// Resident set size of a process in bytes (`VmRSS` of `/proc/<pid>/status`).
pub fn rss_bytes(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    parse_vm_rss(&status).context("no VmRSS in /proc/<pid>/status")
}

/// The `VmRSS:   1234 kB` line of a `/proc/<pid>/status`, in bytes.
pub fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The kernel's clock ticks per second (`getconf CLK_TCK`, 100 if unknown).
pub fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// kvroute's own counters from Envoy's admin (`wasmcustom.kvroute.*`
/// without the per-endpoint ones), e.g. to show every request was parsed.
pub fn kvroute_counters(admin: u16) -> Result<Vec<(String, u64)>> {
    let addr = SocketAddr::from(([127, 0, 0, 1], admin));
    let (_, body) = http_get(addr, "/stats?filter=^wasmcustom%5C.kvroute%5C.[a-z_.]+$")?;
    Ok(body
        .lines()
        .filter_map(|l| {
            let (name, value) = l.split_once(": ")?;
            let name = name.strip_prefix("wasmcustom.kvroute.")?;
            (!name.starts_with("endpoint.")).then_some(())?;
            Some((name.to_owned(), value.trim().parse().ok()?))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_skip_a_command_name_with_spaces() {
        let stat = "4242 (envoy worker 0) S 1 4242 4242 0 -1 4194560 100 0 0 0 \
                    1234 567 0 0 20 0 9 0 100 1000 200";
        assert_eq!(parse_cpu_ticks(stat), Some(1234 + 567));
        assert_eq!(parse_cpu_ticks("garbage"), None);
    }

    #[test]
    fn vm_rss_is_read_in_bytes() {
        let status = "Name:\tenvoy\nVmPeak:\t  999 kB\nVmRSS:\t   51200 kB\nThreads:\t9\n";
        assert_eq!(parse_vm_rss(status), Some(51200 * 1024));
        assert_eq!(parse_vm_rss("Name: x\n"), None);
    }
}
