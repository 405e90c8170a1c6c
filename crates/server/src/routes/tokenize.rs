//! `POST /tokenize` and `POST /detokenize`, with llama.cpp's and vLLM's field names. Both are
//! bounded by the model's context: a text that cannot be that many tokens is refused before
//! it is tokenized, and no more ids than that are decoded.

use axum::response::{IntoResponse, Response};
use kiln_core::TokenId;

use super::{ModelBody, blocking};
use crate::api::response::{Text, Tokens};
use crate::api::{DetokenizeRequest, TokenizeRequest};
use crate::error::ApiError;

pub(super) async fn tokenize(
    ModelBody { lease, body }: ModelBody<TokenizeRequest>,
) -> Result<Response, ApiError> {
    let ready = lease.ready().clone();
    let tokens = blocking(move || {
        let (param, text) = match (body.content, body.prompt) {
            (Some(text), _) => ("content", text),
            (None, Some(text)) => ("prompt", text),
            (None, None) => {
                return Err(ApiError::invalid_field(
                    "content",
                    "give the text as `content`",
                ));
            }
        };
        let context = ready.shape.max_positions;
        ready.check_text_fits(text.len(), context, param, "the model's context")?;
        let add_special = body.add_special.or(body.add_special_tokens).unwrap_or(true);
        let tokens = ready.codec.encode(&text, add_special)?;
        Ok(Tokens {
            count: tokens.len(),
            tokens,
            max_model_len: context,
        })
    })
    .await?;
    Ok(axum::Json(tokens).into_response())
}

pub(super) async fn detokenize(
    ModelBody { lease, body }: ModelBody<DetokenizeRequest>,
) -> Result<Response, ApiError> {
    let ready = lease.ready().clone();
    let context = ready.shape.max_positions;
    // No sequence of the model is longer than its context; the cap bounds the answer at
    // `context × longest token` bytes.
    if body.tokens.len() > context {
        return Err(ApiError::invalid_field(
            "tokens",
            format!(
                "{} ids given; at most the model's context, {context}",
                body.tokens.len()
            ),
        ));
    }
    let text = blocking(move || {
        let ids: Vec<TokenId> = body.tokens.into_iter().map(TokenId).collect();
        ready.codec.decode_all(&ids)
    })
    .await?;
    Ok(axum::Json(Text {
        content: &text,
        prompt: &text,
    })
    .into_response())
}
