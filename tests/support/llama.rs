//! Real llama.cpp `llama-server` pods (issue 13): the binary and model that
//! `./build.sh engine` builds and caches (`KVROUTE_LLAMA_SERVER`,
//! `KVROUTE_LLAMA_MODEL`). `./build.sh test` sets both and
//! `KVROUTE_REQUIRE_ENGINE=1`, so there a missing engine fails the test
//! instead of skipping it.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::support::{free_port, get, log_file, metric_value, try_get, TempDir};

/// The engine's binary and model, or `None` (with a note on stderr) when
/// they are not configured and the engine is not required.
pub fn engine() -> Option<(PathBuf, PathBuf)> {
    let bin = std::env::var_os("KVROUTE_LLAMA_SERVER").map(PathBuf::from);
    let model = std::env::var_os("KVROUTE_LLAMA_MODEL").map(PathBuf::from);
    let required = std::env::var("KVROUTE_REQUIRE_ENGINE").is_ok_and(|v| v == "1");
    match (bin, model) {
        (Some(b), Some(m)) if b.exists() && m.exists() => Some((b, m)),
        other => {
            let why = format!(
                "real engine not available ({other:?}): run `./build.sh engine` and export the \
                 two variables it prints, or run `./build.sh test`"
            );
            assert!(!required, "{why}");
            eprintln!("skipping: {why}");
            None
        }
    }
}

/// One `llama-server` process serving the model with `--metrics`.
pub struct LlamaServer {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
    log: PathBuf,
    _dir: TempDir,
}

impl LlamaServer {
    /// Starts a server with `slots` parallel slots (`-np`), `ctx` tokens of
    /// context in all and one thread; waits for `/health` (model loaded).
    /// The port is picked free and bound by the server a moment later; a
    /// server that loses it to a test running beside this one exits
    /// ("couldn't bind") and is started again on a new port.
    pub fn start(engine: &(PathBuf, PathBuf), slots: usize, ctx: usize) -> Self {
        let mut attempt = 1;
        loop {
            match LlamaServer::try_start(engine, slots, ctx, free_port()) {
                Err(log) if attempt < 3 && log.contains("couldn't bind") => attempt += 1,
                started => return started.unwrap_or_else(|log| panic!("{log}")),
            }
        }
    }

    /// [`LlamaServer::start`] on `port`, once: `Err` with its log when it
    /// exits before it is ready.
    pub fn try_start(
        engine: &(PathBuf, PathBuf),
        slots: usize,
        ctx: usize,
        port: u16,
    ) -> Result<Self, String> {
        let dir = TempDir::new("llama");
        let log = dir.0.join("llama-server.log");
        let child = Command::new(&engine.0)
            .args(["-m", engine.1.to_str().unwrap(), "--metrics", "-t", "1"])
            .args(["-np", &slots.to_string(), "-c", &ctx.to_string()])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .stdout(log_file(&log))
            .stderr(log_file(&log))
            .spawn()
            .unwrap();
        let mut s = LlamaServer {
            child,
            port,
            log,
            _dir: dir,
        };
        // Its own "listening" line first: before it, a port that answers is
        // someone else's server.
        let listening = format!("listening on http://{}", s.endpoint());
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = s.child.try_wait() {
                return Err(format!("llama-server exited ({status}):\n{}", s.log()));
            }
            if s.log().contains(&listening)
                && try_get(&s.url("/health")).is_some_and(|r| r.status == 200)
            {
                return Ok(s);
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "llama-server not ready in 60 s:\n{}",
                s.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// URL of `path` on this server, directly.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.endpoint(), path)
    }

    /// The engine's own prompt counters: (tokens computed, tokens reused
    /// from its prompt cache).
    pub fn prompt_tokens(&self) -> (f64, f64) {
        let m = get(&self.url("/metrics")).body;
        (
            metric_value(&m, "llamacpp:prompt_tokens_total").unwrap_or(0.0),
            metric_value(&m, "llamacpp:prompt_tokens_cached_total").unwrap_or(0.0),
        )
    }

    /// SIGKILLs the server and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        self.kill();
    }
}
