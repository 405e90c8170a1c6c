//! The runner: one forward for a step's plan. It asks each planned sequence's decoder for its
//! inputs, packs them into one [`Batch`], runs the model (with any work the decoders can do
//! meanwhile on a second thread), and hands back the logits rows of each planned sequence.
//! It knows nothing of decoding modes: a decoder says what it feeds and how many rows it
//! wants.

use kiln_core::kv_cache::KvCache;
use kiln_core::{BackendKind, Batch, CausalLm, InferenceBackend, LogitsFor, TokenId};

use crate::decode::Rows;
use crate::error::EngineError;
use crate::scheduler::StepPlan;
use crate::sequence::Sequence;

/// The logits a step's forward produced.
pub(crate) struct StepOutput {
    /// Every wanted row, `[rows, vocab]` row-major, in plan order; empty when the device
    /// picked the argmaxes (`argmax`).
    logits: Vec<f32>,
    /// One id per row, when every row of the step was a plain argmax the device picked.
    argmax: Option<Vec<u32>>,
    /// Rows of each planned sequence, in plan order.
    rows_of: Vec<usize>,
    vocab: usize,
}

impl StepOutput {
    /// Each planned sequence's rows, in plan order.
    pub fn rows(&self) -> impl Iterator<Item = Rows<'_>> {
        let mut first = 0;
        self.rows_of.iter().map(move |&n| {
            let logits = self
                .logits
                .get(first * self.vocab..(first + n) * self.vocab)
                .unwrap_or_default();
            let argmax = self.argmax.as_ref().map(|ids| TokenId(ids[first]));
            first += n;
            Rows {
                logits,
                argmax,
                vocab: self.vocab,
            }
        })
    }
}

/// Runs the forward of `plan` over `running` on `cache`. The cache space of the step must be
/// reserved already.
///
/// # Errors
/// A batch the decoders' inputs do not make, or a failed forward (the caller then clears
/// what the cache holds: the step's K/V may be half written).
pub(crate) fn run<B: InferenceBackend>(
    model: &dyn CausalLm<B>,
    cache: &mut dyn KvCache<B>,
    running: &[Sequence],
    plan: &StepPlan,
) -> Result<StepOutput, EngineError> {
    let mut batch = Batch::new();
    // Logits rows per planned sequence, and per sequence of the batch.
    let mut rows_of = Vec::with_capacity(plan.len());
    let mut batch_rows = Vec::with_capacity(plan.len());
    for &(i, n) in plan {
        let seq = &running[i];
        let rows = seq.decoder.feed(&seq.state, n, &mut batch)?;
        rows_of.push(rows.iter().sum());
        batch_rows.extend(rows);
    }
    let wanted = if batch_rows.iter().all(|&n| n == 1) {
        LogitsFor::LastOfEachSequence
    } else {
        LogitsFor::LastOfEach(batch_rows)
    };
    // Work that does not depend on the logits (grammar masks) can run on another thread while
    // the forward runs. That pays where the forward runs on a device (the host waits
    // meanwhile), or on the host when there are several pieces; a single one is cheaper
    // inline (the sampler does it then), because the forward already keeps every core busy
    // (docs/benchmarks.md, "Structured output").
    let on_host = matches!(B::KIND, BackendKind::Cpu | BackendKind::Ndarray);
    let work: Vec<Box<dyn FnOnce() + Send>> = plan
        .iter()
        .filter_map(|&(i, n)| running[i].decoder.overlap(&running[i].state, n))
        .collect();
    let work = if !on_host || work.len() > 1 {
        work
    } else {
        Vec::new()
    };
    let logits = std::thread::scope(|scope| {
        let overlapped = (!work.is_empty()).then(|| {
            scope.spawn(|| {
                for piece in work {
                    piece();
                }
            })
        });
        let logits = model.forward(&batch, cache, wanted);
        // A panic there only leaves the work to do again when it is needed.
        let _ = overlapped.map(std::thread::ScopedJoinHandle::join);
        logits
    })?;
    let vocab = model.shape().vocab;
    // Where every row's token is a plain argmax, a device picks them itself and only the ids
    // come back (one id a row instead of a vocabulary of logits).
    let argmax = (!on_host
        && rows_of.iter().all(|&n| n == 1)
        && plan
            .iter()
            .all(|&(i, _)| running[i].decoder.picks_argmax(&running[i].state)))
    .then(|| B::argmax_rows(logits.clone()));
    let logits = match argmax {
        Some(_) => Vec::new(),
        None => kiln_core::tensor::host_f32(logits),
    };
    Ok(StepOutput {
        logits,
        argmax,
        rows_of,
        vocab,
    })
}
