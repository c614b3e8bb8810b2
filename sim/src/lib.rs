//! `kvroute-sim`: simulated vLLM/SGLang model servers for kvroute's tests, demo and
//! benchmarks, with a real prefix KV-cache, a continuous-batching scheduler, a latency
//! model, vLLM's `/metrics`, and run-time fault switches. See `sim/README.md`.
//!
//! The pure parts (tokenizer, chat template, KV-cache, scheduler, latency model, metrics
//! rendering) take time as an argument; the async parts (pod engine loop, HTTP) wrap them.

#![deny(missing_docs)]

pub mod chat_template;
pub mod cli;
pub mod control;
pub mod exposition;
pub mod faults;
pub mod kv_cache;
pub mod latency;
pub mod listener;
pub mod lora;
pub mod metrics;
pub mod openai;
pub mod pod;
pub mod scheduler;
pub mod server;
pub mod sim_clock;
pub mod synthetic_output;
pub mod tokenizer;

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;

pub use cli::{Cli, EngineFlavor, SimConfig};
pub use pod::Pod;

/// A running simulator: its pods and where they listen.
pub struct Sim {
    /// The pods, by index.
    pub pods: Vec<Arc<Pod>>,
    /// Listening address of each pod.
    pub addrs: Vec<SocketAddr>,
    /// Listening address of the control server, if any.
    pub control_addr: Option<SocketAddr>,
}

fn resolve(host: &str, port: u16) -> io::Result<SocketAddr> {
    (host, port).to_socket_addrs()?.next().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("cannot resolve host {host}"),
        )
    })
}

/// Binds and starts all pods (and the control server) on the current tokio runtime.
/// With `base_port == 0` every pod gets a free port (see [`Sim::addrs`]).
pub async fn start(cfg: SimConfig) -> io::Result<Sim> {
    let cfg = Arc::new(cfg);
    let mut pods = Vec::with_capacity(cfg.pods);
    let mut addrs = Vec::with_capacity(cfg.pods);
    for i in 0..cfg.pods {
        let port = if cfg.base_port == 0 {
            0
        } else {
            u16::try_from(usize::from(cfg.base_port) + i)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "port out of range"))?
        };
        let addr = resolve(&cfg.host, port)?;
        let listener = listener::bind(addr).map_err(|e| {
            io::Error::new(e.kind(), format!("pod {i}: cannot listen on {addr}: {e}"))
        })?;
        let bound = listener.local_addr()?;
        let pod = Pod::new(i, Arc::clone(&cfg));
        pod.start_engine();
        listener::spawn_pod(
            Arc::clone(&pod),
            listener,
            server::pod_router(Arc::clone(&pod)),
        )?;
        pods.push(pod);
        addrs.push(bound);
    }
    let control_addr = match cfg.control_port {
        None => None,
        Some(port) => {
            let addr = resolve(&cfg.host, port)?;
            let l = listener::bind(addr).map_err(|e| {
                io::Error::new(e.kind(), format!("control: cannot listen on {addr}: {e}"))
            })?;
            let bound = l.local_addr()?;
            listener::spawn_plain(l, control::control_router(Arc::new(pods.clone())));
            Some(bound)
        }
    };
    Ok(Sim {
        pods,
        addrs,
        control_addr,
    })
}
