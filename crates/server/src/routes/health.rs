//! `GET /health` (200 once the first model has loaded, 503 `model_loading` before) and `GET /metrics`
//! (Prometheus text). Both are open: no API key, for orchestrators.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::AppState;
use crate::api::response::Health;
use crate::error::ApiError;

pub(super) async fn health(State(state): State<Arc<AppState>>) -> Response {
    if !state.fleet.started() {
        return ApiError::loading().into_response();
    }
    axum::Json(Health { status: "ok" }).into_response()
}

pub(super) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        {
            let mut text = state.metrics.render();
            state.fleet.render_metrics(&mut text);
            text
        },
    )
        .into_response()
}
