//! Cache snapshots: prefill a prompt once, save its KV cache to a file, and resume decoding
//! from it any number of times, in this process or a later one. A resumed request computes
//! only the prompt's last token (whose logits pick the first new token), as a request that
//! finds the rest of its prompt in the prefix cache does.
//!
//! File layout (little-endian): the magic `KILNKV02`, a u64 header length, a JSON header
//! (model fingerprint, dtype, KV layout, prompt tokens), then for each layer K and V as
//! `[tokens, n_kv_heads, head_dim]` f32. A snapshot is refused by a model with another
//! fingerprint ([`kiln_core::CausalLm::fingerprint`]) or dtype. (`KILNKV01` files, which also
//! stored the last logits, are refused with a request to make them again.)

use std::io::{Read, Write};
use std::path::Path;

use burn::tensor::{Tensor, TensorData};
use kiln_core::kv_cache::{DynamicKvCache, KvLayout};
use kiln_core::sampling::SamplingParams;
use kiln_core::{Batch, CausalLm, Dtype, InferenceBackend, Position, TokenId};
use serde::{Deserialize, Serialize};

use crate::engine::{Engine, EngineConfig};
use crate::error::EngineError;
use crate::request::{Request, RequestId};

const MAGIC: &[u8; 8] = b"KILNKV02";
/// The first format, which also stored the prompt's last logits.
const MAGIC_V1: &[u8; 8] = b"KILNKV01";
/// The most layers, KV heads, or values per head a snapshot's header may claim: far beyond
/// any model (kiln-models refuses more than 4096 layers or heads), small enough that a lying
/// header is named before its sizes are multiplied.
pub const MAX_LAYOUT: usize = 1 << 16;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Header {
    model: String,
    dtype: String,
    n_layers: usize,
    n_kv_heads: usize,
    head_dim: usize,
    tokens: Vec<u32>,
}

/// A prefilled prompt's KV cache.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// The fingerprint of the model that made it.
    pub model: String,
    /// The cache's dtype.
    pub dtype: Dtype,
    /// Per-token K/V shape.
    pub layout: KvLayout,
    /// The prompt.
    pub tokens: Vec<TokenId>,
    /// Per layer, K and V as `[tokens, n_kv_heads, head_dim]`, row-major.
    pub layers: Vec<(Vec<f32>, Vec<f32>)>,
}

impl Snapshot {
    /// Prefills `prompt` on `model` alone (an engine request that keeps its cache) and
    /// captures the result.
    ///
    /// # Errors
    /// A prompt the engine refuses (empty, too long, ids outside the vocabulary), or a model
    /// failure.
    pub fn prefill<B: InferenceBackend>(
        model: &dyn CausalLm<B>,
        prompt: &[TokenId],
    ) -> Result<Self, EngineError> {
        let layout = model.shape().kv_layout();
        let cache = DynamicKvCache::<B>::new(layout, model.dtype(), &model.device());
        let config = EngineConfig {
            max_batch: 1,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(model, Box::new(cache), config)?;
        // One token is sampled (and not kept): the cache then holds the whole prompt.
        let id = engine.submit(Request {
            prompt: prompt.to_vec(),
            max_tokens: 1,
            sampling: SamplingParams::greedy(),
            keep_cache: true,
            ..Request::default()
        })?;
        engine.run(|_| {})?;
        let layers = engine.export_kept(id)?;
        Ok(Self {
            model: model.fingerprint(),
            dtype: model.dtype(),
            layout,
            tokens: prompt.to_vec(),
            layers,
        })
    }

    /// Writes the snapshot to `path`.
    ///
    /// # Errors
    /// [`EngineError::Snapshot`] on I/O failure.
    pub fn save(&self, path: &Path) -> Result<(), EngineError> {
        let fail = |e: std::io::Error| EngineError::Snapshot {
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        let header = Header {
            model: self.model.clone(),
            dtype: self.dtype.name().to_string(),
            n_layers: self.layout.n_layers,
            n_kv_heads: self.layout.n_kv_heads,
            head_dim: self.layout.head_dim,
            tokens: self.tokens.iter().map(|t| t.0).collect(),
        };
        let header = serde_json::to_vec(&header).expect("a header serializes");
        let mut out = std::io::BufWriter::new(std::fs::File::create(path).map_err(fail)?);
        out.write_all(MAGIC).map_err(fail)?;
        out.write_all(&(header.len() as u64).to_le_bytes())
            .map_err(fail)?;
        out.write_all(&header).map_err(fail)?;
        for values in self.layers.iter().flat_map(|(k, v)| [k, v]) {
            for x in values {
                out.write_all(&x.to_le_bytes()).map_err(fail)?;
            }
        }
        out.flush().map_err(fail)
    }

    /// Reads a snapshot written by [`Snapshot::save`].
    ///
    /// Every size the file claims is checked before anything is allocated: the header's
    /// length against the bytes after it; `n_layers`, `n_kv_heads` and `head_dim` against
    /// [`MAX_LAYOUT`] and zero; the prompt non-empty; and the data's length, computed with
    /// checked arithmetic, equal to what is left. So what a snapshot takes in memory is in
    /// proportion to its bytes (a 182-byte file claiming 10^12 layers of no tokens once
    /// passed the length check and aborted on a 48 TB allocation).
    ///
    /// # Errors
    /// [`EngineError::Snapshot`] for a missing, truncated or foreign file, naming the field
    /// at fault.
    pub fn load(path: &Path) -> Result<Self, EngineError> {
        let fail = |reason: String| EngineError::Snapshot {
            path: path.to_path_buf(),
            reason,
        };
        let bytes = std::fs::read(path).map_err(|e| fail(e.to_string()))?;
        Self::from_bytes(&bytes).map_err(fail)
    }

    /// [`Snapshot::load`] on the file's bytes; the error is the reason alone.
    fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        let mut r = bytes;
        let mut magic = [0u8; 8];
        r.read_exact(&mut magic)
            .map_err(|_| "too short to be a kiln snapshot".to_string())?;
        if &magic == MAGIC_V1 {
            return Err(
                "an older kiln snapshot format (KILNKV01); make it again with this version".into(),
            );
        }
        if &magic != MAGIC {
            return Err("not a kiln KV-cache snapshot".into());
        }
        let mut len = [0u8; 8];
        r.read_exact(&mut len)
            .map_err(|_| "truncated: the file ends before the header's length".to_string())?;
        let len = u64::from_le_bytes(len);
        let Some(json) = usize::try_from(len).ok().and_then(|n| r.get(..n)) else {
            return Err(format!(
                "truncated header: its length is {len} bytes, {} follow",
                r.len()
            ));
        };
        let header: Header =
            serde_json::from_slice(json).map_err(|e| format!("bad header: {e}"))?;
        let data = &r[json.len()..];
        let dtype: Dtype = header
            .dtype
            .parse()
            .map_err(|_| format!("unknown dtype {}", header.dtype))?;
        if header.tokens.is_empty() {
            return Err("the header's `tokens` is empty: a snapshot holds a prompt".into());
        }
        for (field, value) in [
            ("n_layers", header.n_layers),
            ("n_kv_heads", header.n_kv_heads),
            ("head_dim", header.head_dim),
        ] {
            if value == 0 || value > MAX_LAYOUT {
                return Err(format!(
                    "the header's `{field}` is {value}, not between 1 and {MAX_LAYOUT}"
                ));
            }
        }
        // Values per layer for K (and again for V), and the data's bytes, checked: the
        // factors come from the file.
        let per_layer = header
            .tokens
            .len()
            .checked_mul(header.n_kv_heads)
            .and_then(|n| n.checked_mul(header.head_dim));
        let expected = per_layer.and_then(|n| n.checked_mul(2 * 4)?.checked_mul(header.n_layers));
        let (Some(per_layer), Some(expected)) = (per_layer, expected) else {
            return Err(format!(
                "the header's sizes (n_layers {}, {} tokens, n_kv_heads {}, head_dim {}) imply \
                 more data than memory holds",
                header.n_layers,
                header.tokens.len(),
                header.n_kv_heads,
                header.head_dim
            ));
        };
        if data.len() != expected {
            return Err(format!(
                "{} data bytes, the header implies {expected} (n_layers {} x K and V x {} tokens \
                 x n_kv_heads {} x head_dim {} x 4 bytes)",
                data.len(),
                header.n_layers,
                header.tokens.len(),
                header.n_kv_heads,
                header.head_dim
            ));
        }
        let (floats, _) = data.as_chunks::<4>();
        let mut tensors = floats
            .chunks_exact(per_layer)
            .map(|values| values.iter().map(|&b| f32::from_le_bytes(b)).collect());
        let mut layers = Vec::with_capacity(header.n_layers);
        while let (Some(k), Some(v)) = (tensors.next(), tensors.next()) {
            layers.push((k, v));
        }
        Ok(Self {
            model: header.model,
            dtype,
            layout: KvLayout {
                n_layers: header.n_layers,
                n_kv_heads: header.n_kv_heads,
                head_dim: header.head_dim,
            },
            tokens: header.tokens.into_iter().map(TokenId).collect(),
            layers,
        })
    }

    /// Whether the layers hold what the layout and the prompt say (a snapshot built in
    /// memory has public fields; one read by [`Snapshot::load`] always does).
    fn check_consistent(&self) -> Result<(), String> {
        let per_layer = self.tokens.len() * self.layout.n_kv_heads * self.layout.head_dim;
        if self.layers.len() != self.layout.n_layers {
            return Err(format!(
                "{} layers of K/V for a layout of {}",
                self.layers.len(),
                self.layout.n_layers
            ));
        }
        for (layer, (k, v)) in self.layers.iter().enumerate() {
            if k.len() != per_layer || v.len() != per_layer {
                return Err(format!(
                    "layer {layer} holds {} K and {} V values, {} tokens need {per_layer}",
                    k.len(),
                    v.len(),
                    self.tokens.len()
                ));
            }
        }
        Ok(())
    }
}

impl<B: InferenceBackend> Engine<'_, B> {
    /// Queues `request` from `snapshot` instead of its prompt (which is replaced by the
    /// snapshot's): the K/V of every prompt token but the last are written into the engine's
    /// cache (on a paged cache with prefix caching, their full blocks become cached prefixes
    /// for any later request), and only the last is computed.
    ///
    /// # Errors
    /// [`EngineError::Snapshot`] if another model or dtype made it; a cache without room.
    pub fn submit_snapshot(
        &mut self,
        snapshot: &Snapshot,
        mut request: Request,
    ) -> Result<RequestId, EngineError> {
        let model = self.model();
        let refuse = |reason: String| EngineError::Snapshot {
            path: "snapshot".into(),
            reason,
        };
        if snapshot.dtype != model.dtype() {
            return Err(refuse(format!(
                "made with dtype {}, this model runs {}",
                snapshot.dtype.name(),
                model.dtype().name()
            )));
        }
        if snapshot.model != model.fingerprint() {
            return Err(refuse(format!(
                "made by another model ({}), not this one ({})",
                snapshot.model,
                model.fingerprint()
            )));
        }
        if snapshot.layout != model.shape().kv_layout() {
            return Err(refuse("its KV layout differs from this model's".into()));
        }
        snapshot.check_consistent().map_err(refuse)?;
        request.prompt = snapshot.tokens.clone();
        let device = model.device();
        let dtype = model.dtype().burn_float();
        let layout = snapshot.layout;
        let held = snapshot.tokens.len().saturating_sub(1);
        let shape = [held, layout.n_kv_heads, layout.head_dim];
        self.submit_prefilled(request, held, |cache, seq| {
            let batch = Batch::single(seq, &snapshot.tokens[..held], Position(0))?;
            let plan = cache.plan(&batch).map_err(kiln_core::CoreError::from)?;
            for (layer, (k, v)) in snapshot.layers.iter().enumerate() {
                let tensor = |x: &Vec<f32>| {
                    let values = x[..held * layout.n_kv_heads * layout.head_dim].to_vec();
                    Tensor::<B, 3>::from_data(TensorData::new(values, shape), &device).cast(dtype)
                };
                cache.write(layer, &plan, tensor(k), tensor(v));
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests;
