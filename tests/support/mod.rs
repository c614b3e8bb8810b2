//! Test harness: real processes on loopback. `Sim` runs `kvroute-sim` pods,
//! `Envoy` runs the real Envoy with the built `kvroute.wasm` through
//! `./build.sh serve --no-build` (the same path users take). Both are killed
//! when dropped. Nothing here mocks Envoy.
#![allow(dead_code)]

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A port nobody listens on right now, outside the kernel's ephemeral
/// range (see [`free_port_block`]).
pub fn free_port() -> u16 {
    free_port_block(1)
}

/// A base port with `n` consecutive free ports, all below the kernel's
/// ephemeral range (`net.ipv4.ip_local_port_range`). Ports are picked here
/// and bound later by another process (Envoy, the sim); an ephemeral one
/// could meanwhile become the source port of some outgoing connection (a
/// test's Envoy scraping its pods), and the bind would fail with "Address
/// already in use". The kernel never hands out these on its own.
pub fn free_port_block(n: u16) -> u16 {
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let (low, high) = (10_000u16, ephemeral.max(12_000));
    for _ in 0..1000 {
        let base = low + fastrand::u16(..high - low - n);
        let ok = (0..n).all(|i| TcpListener::bind(("127.0.0.1", base + i)).is_ok());
        if ok {
            return base;
        }
    }
    panic!("no block of {n} free ports");
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out after {timeout:?} waiting for {what}");
}

/// A plain HTTP response.
#[derive(Debug)]
pub struct Reply {
    /// Status code.
    pub status: u16,
    /// Headers, names lowercased.
    pub headers: Vec<(String, String)>,
    /// Body text.
    pub body: String,
}

impl Reply {
    /// First value of a header.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    /// The simulator pod that answered (its `x-kvroute-sim-pod` header).
    pub fn pod(&self) -> Option<usize> {
        self.header("x-kvroute-sim-pod")
            .and_then(|v| v.parse().ok())
    }
    /// Body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
}

/// The tests' HTTP client: statuses are not errors, 60 s timeout.
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into()
}

fn reply(r: ureq::http::Response<ureq::Body>) -> Reply {
    let status = r.status().as_u16();
    let headers = r
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    let body = r
        .into_body()
        .with_config()
        .limit(64 << 20)
        .read_to_string()
        .unwrap_or_default();
    Reply {
        status,
        headers,
        body,
    }
}

/// GET `url`.
pub fn get(url: &str) -> Reply {
    reply(
        agent()
            .get(url)
            .call()
            .unwrap_or_else(|e| panic!("GET {url}: {e}")),
    )
}

/// Tries GET `url`; `None` on a connection error.
pub fn try_get(url: &str) -> Option<Reply> {
    agent().get(url).call().ok().map(reply)
}

/// POST a JSON body; `None` on a transport error (connection refused,
/// reset, timeout).
pub fn try_post_json(url: &str, body: &Value) -> Option<Reply> {
    agent()
        .post(url)
        .header("content-type", "application/json")
        .send(&serde_json::to_vec(body).unwrap()[..])
        .ok()
        .map(reply)
}

/// Turn `turn` (0-based) of conversation `tag`: a ~3 KB system prompt of
/// its own, then the user/assistant turns so far (each turn's body extends
/// the previous one's).
pub fn conversation_turn(model: &str, tag: &str, turn: usize) -> Value {
    let mut system = format!("Assistant {tag}. ");
    while system.len() < 3_000 {
        system.push_str(&format!("{tag} has long and specific instructions. "));
    }
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    for t in 0..=turn {
        messages.push(serde_json::json!({"role": "user", "content": format!("question {t}")}));
        if t < turn {
            messages
                .push(serde_json::json!({"role": "assistant", "content": format!("answer {t}")}));
        }
    }
    serde_json::json!({"model": model, "max_tokens": 4, "messages": messages})
}

/// POST a JSON body.
pub fn post_json(url: &str, body: &Value) -> Reply {
    post_raw(
        url,
        "application/json",
        serde_json::to_vec(body).unwrap(),
        &[],
    )
}

/// POST raw bytes with extra headers.
pub fn post_raw(url: &str, content_type: &str, body: Vec<u8>, headers: &[(&str, &str)]) -> Reply {
    let mut req = agent().post(url).header("content-type", content_type);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    reply(
        req.send(&body[..])
            .unwrap_or_else(|e| panic!("POST {url}: {e}")),
    )
}

/// Sends raw bytes on a fresh connection and reads the whole response
/// (`Connection: close` requests). For header case and repetition tests.
pub fn raw_http(port: u16, request: &[u8]) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(request).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// `kvroute-sim` pods in one child process.
pub struct Sim {
    child: Child,
    /// Port of pod 0; pod i listens on `base_port + i`.
    pub base_port: u16,
    /// Number of pods.
    pub pods: usize,
}

impl Sim {
    /// Starts `pods` pods with extra CLI arguments and waits until all answer.
    /// The ports are picked free and bound by the sim a moment later; a
    /// test running beside this one may take one meanwhile (the race that
    /// failed a CI run of Envoy's start: "Address already in use"), so a sim
    /// that exits before its pods answer is started again on new ports.
    pub fn start(pods: usize, extra: &[&str]) -> Sim {
        let mut attempt = 1;
        loop {
            match Sim::try_start_at(free_port_block(pods as u16), pods, extra) {
                Err(why) if attempt < 3 => {
                    eprintln!("kvroute-sim did not start ({why}): again on new ports");
                    attempt += 1;
                }
                started => return started.unwrap_or_else(|why| panic!("{why}")),
            }
        }
    }

    /// [`Sim::start`] with pod 0 on `base_port` (e.g. to restart a killed
    /// pod on the same port).
    pub fn start_at(base_port: u16, pods: usize, extra: &[&str]) -> Sim {
        Sim::try_start_at(base_port, pods, extra).unwrap_or_else(|why| panic!("{why}"))
    }

    /// Starts the sim and waits until every pod answers; `Err` when the
    /// process exits first (it exits when a port cannot be bound). Its
    /// "listening" lines are awaited before any pod is asked: a port that
    /// answers could be someone else's server.
    pub fn try_start_at(base_port: u16, pods: usize, extra: &[&str]) -> Result<Sim, String> {
        let bin = std::env::var("KVROUTE_SIM")
            .map(PathBuf::from)
            .unwrap_or_else(|_| root().join("target/release/kvroute-sim"));
        assert!(
            bin.exists(),
            "{} missing: run ./build.sh build",
            bin.display()
        );
        let mut child = Command::new(&bin)
            .args([
                "--pods",
                &pods.to_string(),
                "--base-port",
                &base_port.to_string(),
                "--seed",
                "7",
            ])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        // The sim prints one line per pod once all are bound; the pipe closes
        // when it exits. Read on a thread, so a hang is a timeout.
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let sim = Sim {
            child,
            base_port,
            pods,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut listening = 0;
        while listening < pods {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => listening += usize::from(line.contains(" listening on ")),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    panic!("kvroute-sim on {base_port}.. not listening after 20 s")
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(format!(
                        "kvroute-sim on {base_port}.. exited before listening"
                    ));
                }
            }
        }
        for i in 0..pods {
            let url = sim.url(i, "/health");
            wait_until(&url, Duration::from_secs(20), || {
                try_get(&url).is_some_and(|r| r.status == 200)
            });
        }
        Ok(sim)
    }

    /// SIGKILLs the process (all its pods) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends `signal` (`"STOP"`, `"CONT"`) to the process: a frozen pod
    /// still accepts connections (the kernel does) but answers nothing.
    pub fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args([format!("-{signal}"), self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{signal} {}", self.child.id());
        if signal == "STOP" {
            // kill(2) returns once the signal is queued; wait until every
            // thread has stopped, so nothing sent after this returns can be
            // answered by a thread still finishing its time slice.
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let states = self.thread_states();
                if !states.is_empty() && states.iter().all(|s| *s == 'T' || *s == 't') {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "pod process {} not stopped 5 s after SIGSTOP: thread states {states:?}",
                    self.child.id()
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// The scheduler state (`R`, `S`, `T`, ...) of each of the process's
    /// threads, from `/proc/<pid>/task/*/stat`.
    fn thread_states(&self) -> Vec<char> {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.child.id())) else {
            return Vec::new();
        };
        tasks
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("stat")).ok())
            .filter_map(|stat| stat.rsplit_once(") ")?.1.chars().next())
            .collect()
    }

    /// `127.0.0.1:<port of pod i>`.
    pub fn endpoint(&self, i: usize) -> String {
        format!("127.0.0.1:{}", self.base_port as usize + i)
    }

    /// All pods' endpoints.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.pods).map(|i| self.endpoint(i)).collect()
    }

    /// URL of `path` on pod i, directly.
    pub fn url(&self, i: usize, path: &str) -> String {
        format!("http://{}{}", self.endpoint(i), path)
    }

    /// Sets a fault on pod i (`POST /sim/fault`).
    pub fn fault(&self, i: usize, fault: Value) {
        let r = post_json(&self.url(i, "/sim/fault"), &fault);
        assert!(r.status < 300, "fault {fault}: {} {}", r.status, r.body);
    }

    /// `GET /sim/state` of pod i.
    pub fn state(&self, i: usize) -> Value {
        get(&self.url(i, "/sim/state")).json()
    }

    /// How many times pod i's `/metrics` was requested (`/sim/state`).
    pub fn metrics_scrapes(&self, i: usize) -> f64 {
        self.state(i)["metrics_requests"]
            .as_f64()
            .expect("metrics_requests in /sim/state")
    }

    /// Value of an unlabelled-or-first sample of `metric` in pod i's `/metrics`.
    pub fn metric(&self, i: usize, metric: &str) -> f64 {
        metric_value(&get(&self.url(i, "/metrics")).body, metric).unwrap_or(0.0)
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        // A stopped process dies of SIGKILL too.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// First sample of `name` in Prometheus text (name followed by `{` or space).
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let rest = l.strip_prefix(name)?;
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            return None;
        }
        rest.rsplit(' ').next()?.trim().parse().ok()
    })
}

/// Sum of every sample of `name` (all label sets) in Prometheus text.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            if !(rest.starts_with('{') || rest.starts_with(' ')) {
                return None;
            }
            rest.rsplit(' ').next()?.trim().parse::<f64>().ok()
        })
        .sum()
}

/// A child's stdout or stderr appended to `log` (created if missing), so both
/// streams interleave in one file.
pub fn log_file(log: &Path) -> Stdio {
    Stdio::from(
        std::fs::File::options()
            .create(true)
            .append(true)
            .open(log)
            .unwrap(),
    )
}

/// The real Envoy with kvroute, started through `./build.sh serve --no-build`.
pub struct Envoy {
    child: Child,
    /// Listener port.
    pub port: u16,
    /// Admin port.
    pub admin: u16,
    log: PathBuf,
    _dir: TempDir,
}

/// A temporary directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A fresh directory under the system temp dir.
    pub fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "kvroute-{tag}-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Envoy {
    /// Starts Envoy in front of `endpoints` (passed as `--endpoints`) with
    /// the plugin `config`; panics if it does not become ready.
    pub fn start(endpoints: &[String], config: Value, concurrency: usize) -> Envoy {
        match Envoy::try_start(endpoints, config, concurrency) {
            Ok(e) => e,
            Err(log) => panic!("Envoy did not start:\n{log}"),
        }
    }

    /// Like [`Envoy::start`], but returns Envoy's log if it exits or does not
    /// become ready within 20 s.
    pub fn try_start(
        endpoints: &[String],
        config: Value,
        concurrency: usize,
    ) -> Result<Envoy, String> {
        Envoy::try_start_with(endpoints, config, concurrency, &[])
    }

    /// [`Envoy::start`] with extra `serve` arguments (e.g. `--eds-file`).
    pub fn start_with(
        endpoints: &[String],
        config: Value,
        concurrency: usize,
        extra: &[&str],
    ) -> Envoy {
        match Envoy::try_start_with(endpoints, config, concurrency, extra) {
            Ok(e) => e,
            Err(log) => panic!("Envoy did not start:\n{log}"),
        }
    }

    /// [`Envoy::try_start`] with extra `serve` arguments. Ports are picked
    /// free and bound by Envoy about a second later; a test running beside
    /// this one may pick the same port meanwhile (it failed a CI run:
    /// "cannot bind '127.0.0.1:19942': Address already in use"), so a start
    /// that loses that race is made again on new ports.
    pub fn try_start_with(
        endpoints: &[String],
        config: Value,
        concurrency: usize,
        extra: &[&str],
    ) -> Result<Envoy, String> {
        let mut attempt = 1;
        loop {
            match Envoy::start_once(
                endpoints,
                &config,
                concurrency,
                extra,
                (free_port(), free_port()),
            ) {
                Err(log) if attempt < 3 && log.contains("Address already in use") => attempt += 1,
                started => return started,
            }
        }
    }

    /// One start on the given listener and admin ports: `Err` with the log
    /// when Envoy exits or is not ready in 20 s.
    pub fn start_once(
        endpoints: &[String],
        config: &Value,
        concurrency: usize,
        extra: &[&str],
        (port, admin): (u16, u16),
    ) -> Result<Envoy, String> {
        let dir = TempDir::new("envoy");
        let config_path = dir.0.join("kvroute.json");
        std::fs::write(&config_path, serde_json::to_vec_pretty(config).unwrap()).unwrap();
        let log = dir.0.join("envoy.log");
        let yaml = dir.0.join("envoy.yaml");
        let mut child = Command::new(root().join("build.sh"))
            .args(["serve", "--no-build"])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin", &format!("127.0.0.1:{admin}")])
            .args(["--concurrency", &concurrency.to_string()])
            .args(["--config", config_path.to_str().unwrap()])
            .args(["--out", yaml.to_str().unwrap()])
            // The pool goes in as users give it: `serve --endpoints A,B`.
            .args(if endpoints.is_empty() {
                vec![]
            } else {
                vec!["--endpoints".to_string(), endpoints.join(",")]
            })
            .args(extra)
            .stdout(log_file(&log))
            .stderr(log_file(&log))
            .spawn()
            .unwrap();
        let start = Instant::now();
        let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("Envoy exited ({status}); its log:\n{}", log_text()));
            }
            // Ready, and this Envoy: an admin port that answers could be
            // another test's Envoy (this one then fails to bind it and exits).
            let ready = try_get(&format!("http://127.0.0.1:{admin}/ready"))
                .is_some_and(|r| r.status == 200)
                && TcpStream::connect(("127.0.0.1", port)).is_ok()
                && try_get(&format!("http://127.0.0.1:{admin}/server_info"))
                    .is_some_and(|r| r.body.contains(yaml.to_str().unwrap()));
            if ready {
                break;
            }
            if start.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "Envoy not ready after 20 s (admin 127.0.0.1:{admin}, listener {port}); its log:\n{}",
                    log_text()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Envoy {
            child,
            port,
            admin,
            log,
            _dir: dir,
        })
    }

    /// URL of `path` through kvroute.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    /// Envoy's `/stats/prometheus` text.
    pub fn prometheus(&self) -> String {
        get(&format!("http://127.0.0.1:{}/stats/prometheus", self.admin)).body
    }

    /// Value of a stat from `/stats?format=json` (exact name), 0 when absent.
    pub fn stat(&self, name: &str) -> f64 {
        let v = get(&format!(
            "http://127.0.0.1:{}/stats?format=json&filter=^{}$",
            self.admin,
            name.replace('.', "\\.")
        ))
        .json();
        v["stats"]
            .as_array()
            .and_then(|a| a.iter().find(|s| s["name"] == name))
            .and_then(|s| s["value"].as_f64())
            .unwrap_or(0.0)
    }

    /// Envoy's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Path of the log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// CPU time Envoy has used so far (user + system), from `/proc`.
    pub fn cpu_time(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()))
            .expect("Envoy's /proc stat");
        // Fields after the command name (which may hold spaces): utime and
        // stime are fields 14 and 15, in clock ticks (100 per second here).
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let f: Vec<u64> = rest
            .split_whitespace()
            .skip(11)
            .take(2)
            .map(|v| v.parse().unwrap_or(0))
            .collect();
        Duration::from_millis((f.iter().sum::<u64>()) * 10)
    }

    /// Envoy's resident memory in bytes (`build.sh serve` execs into Envoy,
    /// so the child's pid is Envoy's).
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("Envoy's /proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("VmRSS")
            * 1024
    }
}

impl Drop for Envoy {
    /// Stops Envoy, and fails the test if kvroute panicked in it: a panic
    /// kills a VM and every request behind it, whatever the test asserted.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            return;
        }
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        if let Some(at) = log.find("panicked at") {
            let from = log[..at].rfind('\n').map_or(0, |i| i + 1);
            let to = log[at..].find("\n[").map_or(log.len(), |i| at + i);
            panic!("kvroute panicked in Envoy:\n{}", &log[from..to]);
        }
    }
}

/// Reads an SSE response incrementally over a raw connection: returns
/// (elapsed time at each `data:` event, the events).
pub fn sse_events(port: u16, path: &str, body: &Value) -> (Vec<Duration>, Vec<String>) {
    let payload = serde_json::to_vec(body).unwrap();
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        payload.len()
    );
    let start = Instant::now();
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(&payload).unwrap();
    let mut reader = BufReader::new(s);
    let (mut times, mut events) = (Vec::new(), Vec::new());
    let mut line = String::new();
    while reader.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
        if let Some(ev) = line.trim_end().strip_prefix("data: ") {
            times.push(start.elapsed());
            events.push(ev.to_string());
        }
        line.clear();
    }
    (times, events)
}

/// Writes an EDS file for `endpoints` the way a control plane would: a new
/// file moved over the old one (Envoy watches the directory).
pub fn write_eds(path: &Path, endpoints: &[String]) {
    let lb: Vec<Value> = endpoints
        .iter()
        .map(|e| {
            let (host, port) = e.rsplit_once(':').unwrap();
            serde_json::json!({"endpoint": {"address": {"socket_address": {"address": host, "port_value": port.parse::<u16>().unwrap()}}}})
        })
        .collect();
    let doc = serde_json::json!({"resources": [{
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        "cluster_name": "kvroute_upstream",
        "endpoints": [{"lb_endpoints": lb}]
    }]});
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(&doc).unwrap()).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The error object of a reply kvroute wrote itself, after checking the
/// OpenAI shape: JSON, exactly `message` (starting `kvroute: `), `type`,
/// `param` and `code`.
pub fn kvroute_error(r: &Reply) -> serde_json::Map<String, Value> {
    assert_eq!(r.header("content-type"), Some("application/json"), "{r:?}");
    let v = r.json();
    let e = v["error"]
        .as_object()
        .unwrap_or_else(|| panic!("{}", r.body))
        .clone();
    assert_eq!(e.len(), 4, "{}", r.body);
    assert!(e["message"].as_str().unwrap().starts_with("kvroute: "));
    e
}
