//! The HTTP endpoint: `/metrics` (Prometheus text), `/healthz` (the process is up), `/readyz` (the source
//! is making progress: 503 when it said nothing for three heartbeat intervals).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// Binds `listen` now (so a taken port is a startup error) and serves until the process ends.
pub async fn serve(listen: &str, metrics: Arc<Metrics>) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
        Error::config(format!("cannot listen on http.listen = {listen:?}: {e}"))
            .remedy("pick a free port, or set http.listen = \"\" to disable the endpoint")
    })?;
    tracing::info!(listen, "serving /metrics, /healthz, /readyz");
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(metrics);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the HTTP endpoint stopped");
        }
    });
    Ok(())
}

async fn metrics_text(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        metrics.render(),
    )
}

/// A standby is ready (it is doing its job: waiting to take over; a rolling update must not stall
/// on it); the role is in the body.
async fn ready(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    use crate::metrics::Role;
    match metrics.role() {
        Role::Standby => {
            return (
                StatusCode::OK,
                "ready: standby (another instance leads this pipeline)\n",
            )
        }
        Role::Leader if metrics.ready() => return (StatusCode::OK, "ready: leader\n"),
        _ => {}
    }
    if metrics.ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: no event or heartbeat from the source within 3 heartbeat intervals\n",
        )
    }
}
