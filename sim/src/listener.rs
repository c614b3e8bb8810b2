//! Accepting and serving connections for a pod, with the ability to go down (close the
//! listening socket, so connections are refused, and close open connections) and come
//! back on the same port.
//!
//! `axum::serve` cannot stop listening and resume, which the `down_ms` fault needs, so
//! this small accept loop drives hyper directly.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;

use crate::pod::Pod;

/// How long open connections may finish their current response when a pod goes down.
const DOWN_GRACE: Duration = Duration::from_millis(100);

/// Binds a listening socket with `SO_REUSEADDR`, so a pod can come back on its port.
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

async fn serve_connection(stream: TcpStream, app: Router, down: Option<watch::Receiver<bool>>) {
    let _ = stream.set_nodelay(true);
    let builder = auto::Builder::new(TokioExecutor::new());
    let conn = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
    tokio::pin!(conn);
    match down {
        None => {
            let _ = conn.await;
        }
        Some(mut down) => {
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = async { down.wait_for(|d| *d).await.is_ok() } => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(DOWN_GRACE, conn).await;
                }
            }
        }
    }
}

/// Serves `app` on `listener` until the process ends (the control server).
pub fn spawn_plain(listener: TcpListener, app: Router) {
    tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    tokio::spawn(serve_connection(stream, app.clone(), None));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    });
}

/// Serves a pod's `app` on `listener`, following the pod's up/down state.
pub fn spawn_pod(pod: Arc<Pod>, listener: TcpListener, app: Router) -> io::Result<()> {
    let addr = listener.local_addr()?;
    pod.set_port(addr.port());
    let mut down = pod.subscribe_down();
    tokio::spawn(async move {
        let mut listener = Some(listener);
        loop {
            match &listener {
                Some(l) => {
                    tokio::select! {
                        res = l.accept() => match res {
                            Ok((stream, _)) => {
                                tokio::spawn(serve_connection(stream, app.clone(), Some(pod.subscribe_down())));
                            }
                            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                        },
                        changed = down.changed() => {
                            if changed.is_err() {
                                return;
                            }
                            if *down.borrow_and_update() {
                                listener = None;
                            }
                        }
                    }
                }
                None => {
                    if down.wait_for(|d| !*d).await.is_err() {
                        return;
                    }
                    // Come back on the same port; retry while the port is busy.
                    loop {
                        if pod.is_down() {
                            break;
                        }
                        match bind(addr) {
                            Ok(l) => {
                                listener = Some(l);
                                break;
                            }
                            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                        }
                    }
                }
            }
        }
    });
    Ok(())
}
