//! `POST /v1/embeddings`: validates and tokenizes the inputs on the blocking pool, hands them
//! to the engine thread as one embedding job ([`crate::worker::EmbedJob`]), and writes its
//! vectors in OpenAI's shape (numbers, or base64 of their little-endian f32 bytes), cut to
//! `dimensions` and normalised again where asked.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::extract::State;
use axum::response::Response;
use kiln_core::TokenId;

use super::{AppState, ModelBody, Ready, blocking, json_bytes, json_response};
use crate::api::response::{EmbeddingData, EmbeddingList, EmbeddingUsage, EmbeddingVector};
use crate::api::{EmbeddingInput, EmbeddingRequest, EncodingFormat};
use crate::error::ApiError;
use crate::worker::{Command, EmbedJob};

pub(super) async fn embeddings(
    State(state): State<Arc<AppState>>,
    ModelBody { lease, body }: ModelBody<EmbeddingRequest>,
) -> Result<Response, ApiError> {
    let ready = lease.ready().clone();
    let d_model = hidden_size(&ready)?;
    let format = body.encoding_format()?;
    let dimensions = body.dimensions(d_model)?;
    let (vectors, tokens) = embed(&state, &ready, body.input).await?;
    let name = ready.model.clone();
    let bytes = blocking(move || {
        let data = vectors
            .into_iter()
            .enumerate()
            .map(|(index, v)| {
                let v = match dimensions {
                    Some(n) => kiln_engine::embed::truncate(&v, n),
                    None => v,
                };
                EmbeddingData {
                    object: "embedding",
                    index,
                    embedding: match format {
                        EncodingFormat::Float => EmbeddingVector::Float(v),
                        EncodingFormat::Base64 => EmbeddingVector::Base64(base64_f32(&v)),
                    },
                }
            })
            .collect();
        json_bytes(&EmbeddingList {
            object: "list",
            data,
            model: &name,
            usage: EmbeddingUsage {
                prompt_tokens: tokens,
                total_tokens: tokens,
            },
        })
    })
    .await?;
    Ok(json_response(bytes))
}

/// The width of `ready`'s vectors.
///
/// # Errors
/// A 400 when the model gives no hidden states.
pub(super) fn hidden_size(ready: &Ready) -> Result<usize, ApiError> {
    ready.hidden_size.ok_or_else(|| {
        ApiError::invalid_field("model", "this model gives no hidden states to embed")
    })
}

/// The vectors of `input` (one per entry, pooled as the model says) and the tokens they took,
/// computed on the model's engine thread within the embedding queue's limit.
///
/// # Errors
/// A 400 naming `input`; 503 when the queue is full or the server stops.
pub(super) async fn embed(
    state: &AppState,
    ready: &Arc<Ready>,
    input: Option<EmbeddingInput>,
) -> Result<(Vec<Vec<f32>>, usize), ApiError> {
    let tokenizing = ready.clone();
    let inputs = blocking(move || tokenize(&tokenizing, input)).await?;
    if state.fleet.stopping() {
        return Err(ApiError::shutting_down());
    }
    let _place = QueuePlace::take(&ready.embeddings_waiting, state.options.max_queue)?;
    let tokens: usize = inputs.iter().map(Vec::len).sum();
    let tag = state.response_id("embd-");
    let (reply, answer) = tokio::sync::oneshot::channel();
    let job = EmbedJob {
        inputs,
        pooling: ready.pooling,
        reply,
        tag,
    };
    if ready.commands.send(Command::Embed(job)).is_err() {
        return Err(ApiError::shutting_down());
    }
    let vectors = answer.await.map_err(|_| ApiError::shutting_down())??;
    Ok((vectors, tokens))
}

/// Each input's tokens (text tokenized with the tokenizer's special tokens, as the model's
/// own tokenizer would for an embedding model), each checked: not empty, ids within the
/// vocabulary, no longer than the model's context.
///
/// # Errors
/// A 400 naming `input`.
fn tokenize(ready: &Ready, input: Option<EmbeddingInput>) -> Result<Vec<Vec<TokenId>>, ApiError> {
    let context = ready.shape.max_positions;
    let vocab = ready.shape.vocab;
    let bad = |message: String| ApiError::invalid_field("input", message);
    let text = |i: usize, text: &str| -> Result<Vec<TokenId>, ApiError> {
        if text.is_empty() {
            return Err(bad(format!("input {i} is an empty string")));
        }
        ready.check_text_fits(text.len(), context, "input", "the model's context")?;
        ready
            .codec
            .encode(text, true)
            .map_err(|e| bad(format!("input {i}: {}", e.message)))
    };
    let ids = |i: usize, ids: Vec<u32>| -> Result<Vec<TokenId>, ApiError> {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(bad(format!(
                "input {i}: token id {id} is outside the vocabulary of {vocab}"
            )));
        }
        Ok(ids.into_iter().map(TokenId).collect())
    };
    let inputs = match input {
        None => return Err(bad("give the text or token ids to embed as `input`".into())),
        Some(EmbeddingInput::Text(t)) => vec![text(0, &t)?],
        Some(EmbeddingInput::Texts(texts)) => texts
            .iter()
            .enumerate()
            .map(|(i, t)| text(i, t))
            .collect::<Result<_, _>>()?,
        Some(EmbeddingInput::Tokens(list)) => vec![ids(0, list)?],
        Some(EmbeddingInput::TokenLists(lists)) => lists
            .into_iter()
            .enumerate()
            .map(|(i, list)| ids(i, list))
            .collect::<Result<_, _>>()?,
    };
    if inputs.is_empty() {
        return Err(bad("input is an empty list".into()));
    }
    for (i, input) in inputs.iter().enumerate() {
        if input.is_empty() {
            return Err(bad(format!("input {i} has no tokens")));
        }
        if input.len() > context {
            return Err(bad(format!(
                "input {i} is {} tokens; the model's context holds {context}",
                input.len()
            )));
        }
    }
    Ok(inputs)
}

/// `values`' little-endian f32 bytes in standard base64 with padding (what OpenAI's
/// `encoding_format: "base64"` sends and its SDKs decode).
fn base64_f32(values: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for (k, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if k <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> shift & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A place in the engine thread's embedding queue, given back when the request is answered
/// or its client goes away (the worker drops a job whose reply channel has closed).
#[derive(Debug)]
struct QueuePlace<'a>(&'a AtomicUsize);

impl<'a> QueuePlace<'a> {
    /// One of the `limit` places of `waiting`.
    ///
    /// # Errors
    /// 503 `queue_full` when all are taken.
    fn take(waiting: &'a AtomicUsize, limit: usize) -> Result<Self, ApiError> {
        if waiting.fetch_add(1, Ordering::SeqCst) >= limit.max(1) {
            waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::embedding_queue_full(limit));
        }
        Ok(Self(waiting))
    }
}

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::{QueuePlace, base64_f32};

    #[test]
    fn base64_is_the_little_endian_bytes() {
        // 1.0f32 = 00 00 80 3f; -2.5f32 = 00 00 20 c0 (Python: base64.b64encode(struct.pack("<f", x))).
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, -2.5]), "AACAPwAAIMA=");
        assert_eq!(base64_f32(&[1.0, -2.5, 0.0]), "AACAPwAAIMAAAAAA");
        assert_eq!(base64_f32(&[]), "");
    }

    #[test]
    fn the_queue_gives_its_places_back() {
        let waiting = AtomicUsize::new(0);
        let first = QueuePlace::take(&waiting, 2).unwrap();
        let second = QueuePlace::take(&waiting, 2).unwrap();
        let refused = QueuePlace::take(&waiting, 2).unwrap_err();
        assert_eq!(refused.status.as_u16(), 503);
        assert_eq!(waiting.load(Ordering::SeqCst), 2);
        drop(first);
        assert!(QueuePlace::take(&waiting, 2).is_ok());
        drop(second);
        assert_eq!(waiting.load(Ordering::SeqCst), 0);
    }
}
