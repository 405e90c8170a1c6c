//! `GET /health` (200 once the model is loaded, 503 `model_loading` before) and `GET /metrics`
//! (Prometheus text). Both are open: no API key, for orchestrators.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::{AppState, Loaded};
use crate::api::response::Health;

pub(super) async fn health(_: Loaded) -> Response {
    axum::Json(Health { status: "ok" }).into_response()
}

pub(super) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}
