//! The `kvroute-sim` binary: parses the command line, starts the pods on a tokio runtime
//! of the requested size, prints one line per listening pod, and runs until killed.

use std::io::Write as _;
use std::process::ExitCode;

use clap::Parser as _;
use kvroute_sim::{start, Cli};

fn main() -> ExitCode {
    let cfg = match Cli::parse().into_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvroute-sim: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match cfg.threads {
        Some(1) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        Some(n) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build(),
        None => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build(),
    };
    let runtime = match runtime {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvroute-sim: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let sim = match start(cfg).await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("kvroute-sim: {e}");
                return ExitCode::FAILURE;
            }
        };
        {
            let mut out = std::io::stdout().lock();
            for (i, addr) in sim.addrs.iter().enumerate() {
                let _ = writeln!(out, "kvroute-sim: pod {i} listening on {addr}");
            }
            if let Some(addr) = sim.control_addr {
                let _ = writeln!(out, "kvroute-sim: control listening on {addr}");
            }
            let _ = out.flush();
        }
        std::future::pending::<()>().await;
        ExitCode::SUCCESS
    })
}
