//! The process-level control server (`--control-port`): lists pods and sets their faults,
//! including bringing a pod that is down back up, which its own port cannot do.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;

use crate::faults::FaultUpdate;
use crate::pod::Pod;
use crate::server::{bad_request, error, json};

type Pods = Arc<Vec<Arc<Pod>>>;

/// The control router: `GET /pods`, `POST /pods/{i}/fault`, `POST /pods/{i}/reset`.
pub fn control_router(pods: Pods) -> Router {
    Router::new()
        .route("/pods", get(list))
        .route("/pods/{i}/fault", post(fault))
        .route("/pods/{i}/reset", post(reset))
        .route("/pods/{i}", get(one))
        .with_state(pods)
}

async fn list(State(pods): State<Pods>) -> Response {
    let states: Vec<_> = pods.iter().map(|p| p.state()).collect();
    json(
        StatusCode::OK,
        serde_json::to_vec(&states).unwrap_or_default(),
    )
}

fn no_pod(i: &str) -> Response {
    error(
        StatusCode::NOT_FOUND,
        &format!("no pod {i}"),
        "not_found_error",
    )
}

fn pod(pods: &Pods, i: &str) -> Option<Arc<Pod>> {
    i.parse::<usize>().ok().and_then(|i| pods.get(i).cloned())
}

async fn one(State(pods): State<Pods>, Path(i): Path<String>) -> Response {
    match pod(&pods, &i) {
        Some(p) => json(
            StatusCode::OK,
            serde_json::to_vec(&p.state()).unwrap_or_default(),
        ),
        None => no_pod(&i),
    }
}

async fn fault(State(pods): State<Pods>, Path(i): Path<String>, body: Bytes) -> Response {
    let p = match pod(&pods, &i) {
        Some(p) => p,
        None => return no_pod(&i),
    };
    match FaultUpdate::parse(&body) {
        Ok(u) => {
            p.apply_faults(&u);
            json(
                StatusCode::OK,
                serde_json::to_vec(&p.state()).unwrap_or_default(),
            )
        }
        Err(e) => bad_request(&e),
    }
}

async fn reset(State(pods): State<Pods>, Path(i): Path<String>) -> Response {
    match pod(&pods, &i) {
        Some(p) => {
            p.reset_faults();
            json(
                StatusCode::OK,
                serde_json::to_vec(&p.state()).unwrap_or_default(),
            )
        }
        None => no_pod(&i),
    }
}
