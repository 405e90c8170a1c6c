//! Where tensors come from: [`TensorSource`] over safetensors files (single or sharded),
//! PyTorch `.pth` zips and `torch.distributed.checkpoint` folders ([`DcpSource`]). Every read
//! converts to f32 on the host and names its file in errors.

mod dcp;
mod pickle;
mod torch_save;

pub use dcp::{DcpSource, METADATA_FILE};

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::Metadata;
use safetensors::{Dtype as StDtype, SafeTensors};

use crate::error::{ModelError, Result};
use crate::host::HostTensor;

/// A set of named tensors in one or more files.
pub trait TensorSource {
    /// The file or files, for error messages.
    fn describe(&self) -> String;

    /// Whether a tensor of this name exists.
    fn contains(&self, name: &str) -> bool;

    /// Reads one tensor as f32.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`], or a corrupt or unsupported tensor.
    fn read(&self, name: &str) -> Result<HostTensor>;

    /// Reads one 2-D tensor in its stored blocks, `[rows, cols]` row-major, when it is stored
    /// in a type kiln's kernels multiply as stored ([`kiln_kernels::QuantMatrix::takes`]: the
    /// quantized types with kernels, and F16 and BF16); `None` for any other tensor (the
    /// default: formats whose tensors are read as f32).
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`], or a corrupt tensor.
    fn read_quantized(&self, name: &str) -> Result<Option<QuantizedTensor>> {
        let _ = name;
        Ok(None)
    }

    /// The ggml type `name` is stored in, where the format names one (GGUF's types;
    /// safetensors' F32, F16 and BF16); `None` for other tensors and formats (the default).
    fn stored_type(&self, name: &str) -> Option<kiln_kernels::GgmlType> {
        let _ = name;
        None
    }

    /// Several 2-D tensors stored in one quantized type with an interleaved layout
    /// ([`kiln_kernels::interleaved::group_block_bytes`]), each of the `[rows, cols]` its part
    /// names (one width, heights multiples of eight), as one `[Σ rows, cols]` matrix of their
    /// rows one after the other, each part's in its `order`: projections of one input run as
    /// one product (Q, K and V; gate and up), repacked once from the file rather than repacked,
    /// reordered and stacked. `None` when they are not all such tensors (the default: formats
    /// without quantized types); the caller then reads them one by one, which also names what
    /// is wrong with any of them.
    ///
    /// # Errors
    /// A corrupt tensor.
    fn read_quantized_stack(&self, parts: &[StackPart<'_>]) -> Result<Option<QuantizedTensor>> {
        let _ = parts;
        Ok(None)
    }

    /// All tensor names.
    fn names(&self) -> Vec<String>;

    /// How many elements are stored in each storage type (`F32`, `BF16`, `Q4_1`…), most
    /// first.
    fn stored_types(&self) -> Vec<(String, usize)>;
}

/// One tensor of a [`TensorSource::read_quantized_stack`].
#[derive(Debug, Clone)]
pub struct StackPart<'a> {
    /// Its name.
    pub name: &'a str,
    /// The `[rows, cols]` the model expects of it.
    pub shape: [usize; 2],
    /// Row `i` of the part is the tensor's row `order[i]` (Q and K from Meta's interleaved
    /// RoPE order); `None`: the tensor's rows in order.
    pub order: Option<Vec<usize>>,
}

/// A tensor read in its quantized blocks.
#[derive(Debug, Clone)]
pub struct QuantizedTensor {
    /// The file it came from (for error messages).
    pub file: String,
    /// `[rows, cols]`.
    pub shape: Vec<usize>,
    /// The blocks.
    pub matrix: kiln_kernels::QuantMatrix,
}

/// Adds up `(type, elements)` pairs into [`TensorSource::stored_types`]'s order.
pub(crate) fn tally(items: impl IntoIterator<Item = (String, usize)>) -> Vec<(String, usize)> {
    let mut totals: HashMap<String, usize> = HashMap::new();
    for (ty, n) in items {
        // Saturating: `kiln info` must never print a wrapped count, whatever a file claims.
        let total = totals.entry(ty).or_default();
        *total = total.saturating_add(n);
    }
    let mut totals: Vec<(String, usize)> = totals.into_iter().collect();
    totals.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    totals
}

/// The number of elements of `shape`, saturating: counts shown to people (`kiln info`) must
/// never be wrapped, whatever a file's header claims.
pub(crate) fn elements(shape: &[usize]) -> usize {
    shape.iter().fold(1usize, |n, &d| n.saturating_mul(d))
}

/// A multimodal checkpoint's language model under the text model's names
/// (`model.layers.0...`, `lm_head.weight`), where the file keeps it under a wrapper's prefix:
/// `language_model.model.` (what transformers writes for Gemma 3, Llava, Mistral 3) or
/// `model.language_model.` (transformers 5's module paths). The vision tower's tensors stay
/// in the file, unread.
pub struct LanguageModelSource<'a> {
    inner: &'a dyn TensorSource,
    body: &'static str,
    head: &'static str,
}

impl<'a> LanguageModelSource<'a> {
    /// The adapter when `inner` holds its language model under one of the wrapper prefixes and
    /// not under the text model's own names; `None` otherwise.
    pub fn detect(inner: &'a dyn TensorSource) -> Option<Self> {
        const LAYOUTS: [(&str, &str); 2] = [
            ("language_model.model.", "language_model.lm_head.weight"),
            ("model.language_model.", "lm_head.weight"),
        ];
        if inner.contains("model.embed_tokens.weight") {
            return None;
        }
        LAYOUTS
            .into_iter()
            .find(|(body, _)| inner.contains(&format!("{body}embed_tokens.weight")))
            .map(|(body, head)| Self { inner, body, head })
    }

    fn stored_name(&self, name: &str) -> String {
        match name.strip_prefix("model.") {
            Some(rest) => format!("{}{rest}", self.body),
            None if name == "lm_head.weight" => self.head.to_string(),
            None => name.to_string(),
        }
    }
}

impl TensorSource for LanguageModelSource<'_> {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(&self.stored_name(name))
    }

    fn read(&self, name: &str) -> Result<HostTensor> {
        let mut tensor = self.inner.read(&self.stored_name(name))?;
        tensor.name = name.to_string();
        Ok(tensor)
    }

    fn read_quantized(&self, name: &str) -> Result<Option<QuantizedTensor>> {
        self.inner.read_quantized(&self.stored_name(name))
    }

    fn stored_type(&self, name: &str) -> Option<kiln_kernels::GgmlType> {
        self.inner.stored_type(&self.stored_name(name))
    }

    fn read_quantized_stack(&self, parts: &[StackPart<'_>]) -> Result<Option<QuantizedTensor>> {
        let names: Vec<String> = parts.iter().map(|p| self.stored_name(p.name)).collect();
        let stored: Vec<StackPart<'_>> = parts
            .iter()
            .zip(&names)
            .map(|(p, name)| StackPart { name, ..p.clone() })
            .collect();
        self.inner.read_quantized_stack(&stored)
    }

    fn names(&self) -> Vec<String> {
        self.inner.names()
    }

    fn stored_types(&self) -> Vec<(String, usize)> {
        self.inner.stored_types()
    }
}

/// How far loading has come: tensors read (and uploaded) so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadProgress {
    /// Tensors read so far.
    pub tensors_done: usize,
    /// Tensors in the files (a few, such as rotary tables, may never be read).
    pub tensors_total: usize,
}

/// A [`TensorSource`] that reports each read, for progress bars.
pub(crate) struct Reporting<'a> {
    inner: &'a dyn TensorSource,
    total: usize,
    done: std::cell::Cell<usize>,
    report: std::cell::RefCell<&'a mut dyn FnMut(LoadProgress)>,
}

impl<'a> Reporting<'a> {
    pub fn new(inner: &'a dyn TensorSource, report: &'a mut dyn FnMut(LoadProgress)) -> Self {
        let total = inner.names().len();
        report(LoadProgress {
            tensors_done: 0,
            tensors_total: total,
        });
        Self {
            inner,
            total,
            done: std::cell::Cell::new(0),
            report: std::cell::RefCell::new(report),
        }
    }

    /// Counts one tensor read.
    fn tick(&self) {
        let done = (self.done.get() + 1).min(self.total);
        self.done.set(done);
        (self.report.borrow_mut())(LoadProgress {
            tensors_done: done,
            tensors_total: self.total,
        });
    }

    /// Reports the end, whether or not every tensor in the files was read.
    pub fn finish(&self) {
        (self.report.borrow_mut())(LoadProgress {
            tensors_done: self.total,
            tensors_total: self.total,
        });
    }
}

impl TensorSource for Reporting<'_> {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn read(&self, name: &str) -> Result<HostTensor> {
        let tensor = self.inner.read(name)?;
        self.tick();
        Ok(tensor)
    }

    fn read_quantized(&self, name: &str) -> Result<Option<QuantizedTensor>> {
        let tensor = self.inner.read_quantized(name)?;
        if tensor.is_some() {
            self.tick();
        }
        Ok(tensor)
    }

    fn stored_type(&self, name: &str) -> Option<kiln_kernels::GgmlType> {
        self.inner.stored_type(name)
    }

    fn read_quantized_stack(&self, parts: &[StackPart<'_>]) -> Result<Option<QuantizedTensor>> {
        let tensor = self.inner.read_quantized_stack(parts)?;
        if tensor.is_some() {
            parts.iter().for_each(|_| self.tick());
        }
        Ok(tensor)
    }

    fn names(&self) -> Vec<String> {
        self.inner.names()
    }

    fn stored_types(&self) -> Vec<(String, usize)> {
        self.inner.stored_types()
    }
}

/// One memory-mapped safetensors file with its header, parsed once when opened.
///
/// The header was once parsed again for every tensor read: a 54 MiB header took 7 s to load.
/// The safetensors crate checks what the header claims before anything is read: its length
/// (at most 100 MB, and inside the file), each tensor's byte count against its shape and
/// dtype (checked arithmetic), and that the tensors' ranges tile the data exactly, so no two
/// share bytes and none lies past the end.
struct SafetensorsFile {
    path: PathBuf,
    mmap: Mmap,
    header: Metadata,
    /// Where the data section starts: after the 8-byte length and the header.
    data_start: usize,
}

impl SafetensorsFile {
    fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        // SAFETY: the mapping is read-only; kiln does not modify checkpoint files while
        // loading, and a file truncated underneath would be a user error caught by the header
        // checks below for every read.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let (header_len, header) = SafeTensors::read_metadata(&mmap)
            .map_err(|e| ModelError::corrupt(path, format!("not a valid safetensors file: {e}")))?;
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            header,
            data_start: 8 + header_len,
        })
    }

    /// A tensor's dtype, shape and bytes, or `None` when the file has no tensor of that name.
    fn tensor(&self, name: &str) -> Option<(StDtype, &[usize], &[u8])> {
        let info = self.header.info(name)?;
        let (start, end) = info.data_offsets;
        // Inside the file (checked when the header was read); `get` keeps it so regardless.
        let data = self
            .mmap
            .get(self.data_start.checked_add(start)?..self.data_start.checked_add(end)?)?;
        Some((info.dtype, &info.shape, data))
    }
}

/// Safetensors weights: `model.safetensors`, or the shards listed in
/// `model.safetensors.index.json`.
pub struct SafetensorsSource {
    files: Vec<SafetensorsFile>,
    /// Tensor name to index in `files`.
    index: HashMap<String, usize>,
}

impl SafetensorsSource {
    /// Opens a single file.
    ///
    /// # Errors
    /// Missing or corrupt file.
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_files(&[path.to_path_buf()])
    }

    /// Opens every shard named by a `model.safetensors.index.json`.
    ///
    /// # Errors
    /// Missing or corrupt index or shard, or a tensor the index lists but its shard lacks.
    pub fn open_index(index_path: &Path) -> Result<Self> {
        let text = read_text(index_path)?;
        let index: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::config(index_path, format!("invalid JSON: {e}")))?;
        let map = index
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::config(index_path, "no `weight_map` object"))?;
        let dir = index_path.parent().unwrap_or(Path::new("."));
        let mut shards: Vec<PathBuf> = map
            .values()
            .filter_map(|v| v.as_str())
            .map(|f| dir.join(f))
            .collect();
        shards.sort();
        shards.dedup();
        let source = Self::open_files(&shards)?;
        for (tensor, shard) in map {
            if !source.index.contains_key(tensor) {
                return Err(ModelError::MissingTensor {
                    file: shard.as_str().unwrap_or("?").to_string(),
                    tensor: tensor.clone(),
                });
            }
        }
        Ok(source)
    }

    /// The files read.
    pub fn files(&self) -> Vec<PathBuf> {
        self.files.iter().map(|f| f.path.clone()).collect()
    }

    /// `name`'s file, dtype, shape and bytes.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`], or a file whose header names bytes it lacks.
    fn tensor(&self, name: &str) -> Result<(&SafetensorsFile, StDtype, &[usize], &[u8])> {
        let file = self
            .index
            .get(name)
            .map(|&i| &self.files[i])
            .ok_or_else(|| ModelError::MissingTensor {
                file: self.describe(),
                tensor: name.to_string(),
            })?;
        let (dtype, shape, bytes) = file.tensor(name).ok_or_else(|| {
            ModelError::corrupt(
                &file.path,
                format!("tensor `{name}`: its bytes are missing"),
            )
        })?;
        Ok((file, dtype, shape, bytes))
    }

    fn open_files(paths: &[PathBuf]) -> Result<Self> {
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for path in paths {
            if !path.exists() {
                return Err(ModelError::MissingFile {
                    path: path.clone(),
                    what: "model weights",
                });
            }
            let file = SafetensorsFile::open(path)?;
            for name in file.header.offset_keys() {
                index.insert(name, files.len());
            }
            files.push(file);
        }
        Ok(Self { files, index })
    }
}

impl TensorSource for SafetensorsSource {
    fn describe(&self) -> String {
        let names: Vec<String> = self
            .files
            .iter()
            .map(|f| f.path.display().to_string())
            .collect();
        names.join(", ")
    }

    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn read(&self, name: &str) -> Result<HostTensor> {
        let (file, dtype, shape, bytes) = self.tensor(name)?;
        let file_name = file.path.display().to_string();
        let data = to_f32(dtype, bytes).ok_or_else(|| ModelError::UnsupportedTensorDtype {
            file: file_name.clone(),
            tensor: name.to_string(),
            dtype: format!("{dtype:?}"),
        })?;
        Ok(HostTensor {
            name: name.to_string(),
            file: file_name,
            shape: shape.to_vec(),
            data,
        })
    }

    fn stored_type(&self, name: &str) -> Option<kiln_kernels::GgmlType> {
        match self.tensor(name).ok()?.1 {
            StDtype::F32 => Some(kiln_kernels::GgmlType::F32),
            StDtype::F16 => Some(kiln_kernels::GgmlType::F16),
            StDtype::BF16 => Some(kiln_kernels::GgmlType::Bf16),
            _ => None,
        }
    }

    /// F16 and BF16 matrices as stored (`[rows, cols]`: PyTorch's `[d_out, d_in]`), for the
    /// cpu backend's 16-bit products; `None` for every other tensor.
    fn read_quantized(&self, name: &str) -> Result<Option<QuantizedTensor>> {
        let (file, dtype, shape, bytes) = self.tensor(name)?;
        let ty = match (dtype, shape) {
            (StDtype::F16, [_, _]) => kiln_kernels::GgmlType::F16,
            (StDtype::BF16, [_, _]) => kiln_kernels::GgmlType::Bf16,
            _ => return Ok(None),
        };
        let matrix =
            kiln_kernels::QuantMatrix::from_slice(ty, shape[0], shape[1], bytes, &mut |_| {})
                .map_err(|e| ModelError::corrupt(&file.path, format!("tensor `{name}`: {e}")))?;
        Ok(Some(QuantizedTensor {
            file: file.path.display().to_string(),
            shape: shape.to_vec(),
            matrix,
        }))
    }

    fn names(&self) -> Vec<String> {
        self.index.keys().cloned().collect()
    }

    fn stored_types(&self) -> Vec<(String, usize)> {
        tally(self.files.iter().flat_map(|file| {
            file.header
                .tensors()
                .into_values()
                .map(|info| (format!("{:?}", info.dtype), elements(&info.shape)))
        }))
    }
}

fn to_f32(dtype: StDtype, bytes: &[u8]) -> Option<Vec<f32>> {
    let chunks = |n: usize| bytes.chunks_exact(n);
    Some(match dtype {
        StDtype::F32 => chunks(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        StDtype::F16 => chunks(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        StDtype::BF16 => chunks(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        StDtype::F64 => chunks(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
            .collect(),
        _ => return None,
    })
}

/// A PyTorch `torch.save` zip (Meta's `consolidated.00.pth`), read with burn-store's pickle
/// reader; tensors are materialised on demand.
pub struct PthSource {
    path: PathBuf,
    tensors: HashMap<String, burn_store::TensorSnapshot>,
}

impl PthSource {
    /// Reads the archive's index (not its data).
    ///
    /// # Errors
    /// Missing file, or not a PyTorch archive.
    pub fn open(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(ModelError::MissingFile {
                path: path.to_path_buf(),
                what: "model weights",
            });
        }
        let reader = burn_store::pytorch::PytorchReader::new(path)
            .map_err(|e| ModelError::corrupt(path, format!("not a readable PyTorch file: {e}")))?;
        Ok(Self {
            path: path.to_path_buf(),
            tensors: reader.into_tensors(),
        })
    }
}

impl TensorSource for PthSource {
    fn describe(&self) -> String {
        self.path.display().to_string()
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn read(&self, name: &str) -> Result<HostTensor> {
        let snapshot = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                file: self.describe(),
                tensor: name.to_string(),
            })?;
        let data = snapshot
            .to_data()
            .map_err(|e| ModelError::corrupt(&self.path, format!("tensor `{name}`: {e:?}")))?;
        let shape = data.shape.to_vec();
        let values: Vec<f32> = data
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| ModelError::corrupt(&self.path, format!("tensor `{name}`: {e:?}")))?;
        Ok(HostTensor {
            name: name.to_string(),
            file: self.describe(),
            shape,
            data: values,
        })
    }

    fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    fn stored_types(&self) -> Vec<(String, usize)> {
        tally(
            self.tensors
                .values()
                .map(|t| (format!("{:?}", t.dtype).to_uppercase(), elements(&t.shape))),
        )
    }
}

/// A file's size in bytes, mapping errors to [`ModelError::Io`].
pub(crate) fn file_size(path: &Path) -> Result<u64> {
    std::fs::metadata(path)
        .map(|m| m.len())
        .map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })
}

/// Reads a text file, mapping errors to [`ModelError::Io`] / [`ModelError::MissingFile`].
pub(crate) fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            ModelError::MissingFile {
                path: path.to_path_buf(),
                what: "required file",
            }
        } else {
            ModelError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })
}
