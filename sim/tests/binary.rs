//! The `kvroute-sim` binary itself: flags, the "listening" lines on stdout, serving.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

#[test]
fn prints_one_line_per_pod_and_serves() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
        .args([
            "--pods",
            "3",
            "--base-port",
            "0",
            "--no-latency",
            "--threads",
            "1",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut addrs = Vec::new();
    for i in 0..3 {
        let line = lines.next().expect("a line").expect("utf-8");
        let prefix = format!("kvroute-sim: pod {i} listening on ");
        assert!(line.starts_with(&prefix), "{line}");
        addrs.push(line[prefix.len()..].to_owned());
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    for (i, addr) in addrs.iter().enumerate() {
        let r = agent
            .get(&format!("http://{addr}/health"))
            .call()
            .expect("health");
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.headers()
                .get("x-kvroute-sim-pod")
                .and_then(|v| v.to_str().ok()),
            Some(i.to_string().as_str())
        );
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn bad_flags_exit_with_an_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
        .args(["--time-scale=0"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("time-scale"));
}
