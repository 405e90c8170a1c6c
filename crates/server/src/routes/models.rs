//! `GET /v1/models`: the one model, with its context as `max_model_len` (vLLM's field).

use axum::response::{IntoResponse, Response};

use super::Loaded;
use crate::api::response::{Model, ModelList};

pub(super) async fn models(Loaded(ready): Loaded) -> Response {
    axum::Json(ModelList {
        object: "list",
        data: [Model {
            id: &ready.model,
            object: "model",
            created: ready.created,
            owned_by: "kiln",
            max_model_len: ready.shape.max_positions,
        }],
    })
    .into_response()
}
