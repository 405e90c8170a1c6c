//! [`QuantWeight`]: a linear layer's weight in its GGUF blocks, as a backend holds it for
//! [`InferenceBackend::linear_quantized`](super::InferenceBackend::linear_quantized).

use std::sync::Arc;

use kiln_kernels::QuantMatrix;

/// A quantized weight as one backend multiplies it. Every kind keeps the host blocks (the
/// loader fuses, permutes and describes them there); a GPU backend adds its device copy.
pub trait QuantWeight: Clone + std::fmt::Debug + Send + Sync + 'static {
    /// The weight for `host`'s blocks (a GPU backend copies them to the device when it first
    /// multiplies by them, on the device of that product's input).
    fn new(host: Arc<QuantMatrix>) -> Self;

    /// The blocks in host memory, `[d_out, d_in]`.
    fn host(&self) -> &Arc<QuantMatrix>;
}

/// The cpu backends multiply the host blocks themselves.
impl QuantWeight for Arc<QuantMatrix> {
    fn new(host: Arc<QuantMatrix>) -> Self {
        host
    }

    fn host(&self) -> &Arc<QuantMatrix> {
        self
    }
}
