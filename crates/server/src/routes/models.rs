//! `GET /v1/models`: every model the server serves, loaded or not, with its context as
//! `max_model_len` (vLLM's field) once it has loaded and its state as `status` (llama-server's
//! router lists the same).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};

use super::AppState;
use crate::api::response::{Model, ModelList};
use crate::error::ApiError;

pub(super) async fn models(State(state): State<Arc<AppState>>) -> Response {
    if !state.fleet.started() {
        return ApiError::loading().into_response();
    }
    let listed = state.fleet.list();
    axum::Json(ModelList {
        object: "list",
        data: listed
            .iter()
            .map(|m| Model {
                id: &m.alias,
                object: "model",
                created: m.created,
                owned_by: "kiln",
                max_model_len: m.max_model_len,
                status: m.state,
            })
            .collect(),
    })
    .into_response()
}
