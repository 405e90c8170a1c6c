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
    /// # Errors
    /// [`EngineError::Snapshot`] for a missing, truncated or foreign file.
    pub fn load(path: &Path) -> Result<Self, EngineError> {
        let fail = |reason: String| EngineError::Snapshot {
            path: path.to_path_buf(),
            reason,
        };
        let bytes = std::fs::read(path).map_err(|e| fail(e.to_string()))?;
        let mut r = bytes.as_slice();
        let mut magic = [0u8; 8];
        r.read_exact(&mut magic)
            .map_err(|_| fail("too short to be a kiln snapshot".into()))?;
        if &magic == MAGIC_V1 {
            return Err(fail(
                "an older kiln snapshot format (KILNKV01); make it again with this version".into(),
            ));
        }
        if &magic != MAGIC {
            return Err(fail("not a kiln KV-cache snapshot".into()));
        }
        let mut len = [0u8; 8];
        r.read_exact(&mut len)
            .map_err(|_| fail("truncated header".into()))?;
        let len = u64::from_le_bytes(len) as usize;
        if len > r.len() {
            return Err(fail("truncated header".into()));
        }
        let header: Header =
            serde_json::from_slice(&r[..len]).map_err(|e| fail(format!("bad header: {e}")))?;
        let r = &r[len..];
        let dtype: Dtype = header
            .dtype
            .parse()
            .map_err(|_| fail(format!("unknown dtype {}", header.dtype)))?;
        let per_layer = header.tokens.len() * header.n_kv_heads * header.head_dim;
        let expected = 2 * header.n_layers * per_layer * 4;
        if r.len() != expected {
            return Err(fail(format!(
                "{} data bytes, the header implies {expected}",
                r.len()
            )));
        }
        let mut floats = r
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        let mut take = |n: usize| -> Vec<f32> { floats.by_ref().take(n).collect() };
        let layers = (0..header.n_layers)
            .map(|_| (take(per_layer), take(per_layer)))
            .collect();
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
