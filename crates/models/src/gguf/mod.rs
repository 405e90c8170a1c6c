//! llama.cpp's GGUF files: the container ([`parse`]), metadata values ([`MetaValue`]) and
//! dequantization of the ggml tensor types ([`quant`]). [`GgufFile`] maps a file and serves its
//! tensors as f32 through [`TensorSource`].

pub mod parse;
pub mod quant;
mod value;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

pub use parse::{HEADER_MEMORY_FACTOR, HEADER_MEMORY_SLACK, Header, ParseError, TensorInfo};
pub use quant::{GgmlType, dequantize, has_kernel};
pub use value::{Items, MetaArray, MetaItem, MetaValue, Strings};

use crate::error::{ModelError, Result};
use crate::host::HostTensor;
use crate::weights::{QuantizedTensor, StackPart, TensorSource};
use kiln_kernels::QuantMatrix;

/// A memory-mapped GGUF file with its parsed header.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    header: Header,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.header.version)
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses `path`.
    ///
    /// # Errors
    /// [`ModelError::MissingFile`], [`ModelError::Io`], or [`ModelError::Corrupt`] with the
    /// byte offset of the first bad field.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                ModelError::MissingFile {
                    path: path.to_path_buf(),
                    what: "GGUF model",
                }
            } else {
                ModelError::Io {
                    path: path.to_path_buf(),
                    source,
                }
            }
        })?;
        // SAFETY: read-only mapping of a file kiln does not modify; every tensor range was
        // checked against the mapping's length when the header was parsed.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let header = parse::parse(&mmap)
            .map_err(|e| ModelError::corrupt(path, format!("invalid GGUF {e}")))?;
        let mut by_name = HashMap::with_capacity(header.tensors.len());
        for (i, t) in header.tensors.iter().enumerate() {
            if by_name.insert(t.name.clone(), i).is_some() {
                return Err(ModelError::corrupt(
                    path,
                    format!("invalid GGUF: tensor `{}` appears twice", t.name),
                ));
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            header,
            by_name,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// Every metadata key and value.
    pub fn metadata(&self) -> &BTreeMap<String, MetaValue> {
        &self.header.metadata
    }

    /// Tensor descriptions in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    /// One tensor's description.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.header.tensors[i])
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.header.metadata.get(key)
    }

    /// `key` as a string, failing when absent or of another type.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the key.
    pub fn string(&self, key: &str) -> Result<&str> {
        self.required(key)?
            .as_str()
            .ok_or_else(|| self.wrong_type(key, "a string"))
    }

    /// `key` as an unsigned integer, failing when absent or of another type.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the key.
    pub fn unsigned(&self, key: &str) -> Result<u64> {
        self.required(key)?
            .as_u64()
            .ok_or_else(|| self.wrong_type(key, "a non-negative integer"))
    }

    /// `key` as an unsigned integer when present.
    ///
    /// # Errors
    /// [`ModelError::Config`] when present with another type.
    pub fn unsigned_opt(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.wrong_type(key, "a non-negative integer"))
            })
            .transpose()
    }

    /// `key` as a float when present.
    ///
    /// # Errors
    /// [`ModelError::Config`] when present with another type.
    pub fn float_opt(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.wrong_type(key, "a number")))
            .transpose()
    }

    /// `key` as a boolean when present.
    ///
    /// # Errors
    /// [`ModelError::Config`] when present with another type.
    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.wrong_type(key, "a boolean")))
            .transpose()
    }

    /// `key` as an array, failing when absent or of another type.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the key.
    pub fn array(&self, key: &str) -> Result<&MetaArray> {
        self.required(key)?
            .as_array()
            .ok_or_else(|| self.wrong_type(key, "an array"))
    }

    fn required(&self, key: &str) -> Result<&MetaValue> {
        self.get(key)
            .ok_or_else(|| ModelError::config(&self.path, format!("metadata lacks `{key}`")))
    }

    fn wrong_type(&self, key: &str, expected: &str) -> ModelError {
        let found = self.get(key).map_or("nothing", MetaValue::type_name);
        ModelError::config(
            &self.path,
            format!("metadata `{key}` is a {found}, expected {expected}"),
        )
    }

    /// One tensor's description, failing with [`ModelError::MissingTensor`] when absent.
    fn required_tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor_info(name)
            .ok_or_else(|| ModelError::MissingTensor {
                file: self.describe(),
                tensor: name.to_string(),
            })
    }

    /// The raw bytes of a tensor.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.mmap[info.data.clone()]
    }

    /// Drops this process's mapping of the pages of `span` (bytes of a tensor, relative to
    /// its start) once they have been copied out (`MADV_DONTNEED`): the page cache keeps them,
    /// and a later read faults them back in, but the resident set no longer counts the file's
    /// pages next to the repacked copy, so a load peaks at about the file's size instead of
    /// twice it. A hint: failure is ignored.
    fn release_pages(&self, info: &TensorInfo, span: std::ops::Range<usize>) {
        #[cfg(unix)]
        {
            let range = info.data.start + span.start..info.data.start + span.end;
            debug_assert!(range.end <= info.data.end);
            // SAFETY: the range lies in the mapping (checked when the header was parsed); the
            // mapping is shared and read-only, so dropping its pages loses nothing (the next
            // access reads the same file bytes back), and every caller has finished with the
            // tensor's bytes: no borrow of them is alive.
            let _ = unsafe {
                self.mmap.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    range.start,
                    range.len(),
                )
            };
        }
        #[cfg(not(unix))]
        let _ = (info, span);
    }
}

impl TensorSource for GgufFile {
    fn describe(&self) -> String {
        self.path.display().to_string()
    }

    fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// Dequantizes one tensor to f32.
    fn read(&self, name: &str) -> Result<HostTensor> {
        let info = self.required_tensor(name)?;
        let mut data = vec![0f32; info.len()];
        dequantize(info.ggml_type, self.tensor_bytes(info), &mut data);
        self.release_pages(info, 0..info.data.len());
        Ok(HostTensor {
            name: name.to_string(),
            file: self.describe(),
            shape: info.shape.clone(),
            data,
        })
    }

    fn stored_type(&self, name: &str) -> Option<GgmlType> {
        self.tensor_info(name).map(|info| info.ggml_type)
    }

    /// The tensor's blocks as they are in the file, for 2-D tensors of a type kiln's kernels
    /// multiply as stored.
    fn read_quantized(&self, name: &str) -> Result<Option<QuantizedTensor>> {
        let info = self.required_tensor(name)?;
        if !QuantMatrix::takes(info.ggml_type) || info.shape.len() != 2 {
            return Ok(None);
        }
        let (rows, cols) = (info.shape[0], info.shape[1]);
        let matrix = QuantMatrix::from_slice(
            info.ggml_type,
            rows,
            cols,
            self.tensor_bytes(info),
            &mut |span| self.release_pages(info, span),
        )
        .map_err(|e| ModelError::corrupt(&self.path, format!("tensor `{name}`: {e}")))?;
        Ok(Some(QuantizedTensor {
            file: self.describe(),
            shape: info.shape.clone(),
            matrix,
        }))
    }

    fn read_quantized_stack(&self, parts: &[StackPart<'_>]) -> Result<Option<QuantizedTensor>> {
        let mut infos: Vec<&TensorInfo> = Vec::with_capacity(parts.len());
        for part in parts {
            let Some(info) = self.tensor_info(part.name) else {
                return Ok(None);
            };
            let [rows, cols] = part.shape;
            let first_type = infos.first().map_or(info.ggml_type, |i| i.ggml_type);
            let fits = info.shape == part.shape
                && info.ggml_type == first_type
                && cols == parts[0].shape[1]
                && rows.is_multiple_of(kiln_kernels::interleaved::GROUP)
                && kiln_kernels::quant::has_kernel(info.ggml_type)
                && kiln_kernels::interleaved::group_block_bytes(info.ggml_type).is_some()
                && part.order.as_ref().is_none_or(|o| o.len() == rows);
            if !fits {
                return Ok(None);
            }
            infos.push(info);
        }
        let (Some(first), Some(part)) = (infos.first(), parts.first()) else {
            return Ok(None);
        };
        let (ty, cols) = (first.ggml_type, part.shape[1]);
        let row_bytes = ty.bytes_for(cols).unwrap_or(0);
        // Each part's blocks: borrowed from the mapping, or its rows reordered into a copy,
        // after which its mapped pages can go.
        let blocks: Vec<std::borrow::Cow<'_, [u8]>> = parts
            .iter()
            .zip(&infos)
            .map(|(part, info)| {
                let bytes = self.tensor_bytes(info);
                match &part.order {
                    None => std::borrow::Cow::Borrowed(bytes),
                    Some(order) => {
                        let mut rows = Vec::with_capacity(bytes.len());
                        for &r in order {
                            rows.extend_from_slice(&bytes[r * row_bytes..][..row_bytes]);
                        }
                        self.release_pages(info, 0..bytes.len());
                        std::borrow::Cow::Owned(rows)
                    }
                }
            })
            .collect();
        let slices: Vec<&[u8]> = blocks.iter().map(|b| b.as_ref()).collect();
        let matrix = QuantMatrix::from_slices(ty, cols, &slices, &mut |i, span| {
            if parts[i].order.is_none() {
                self.release_pages(infos[i], span);
            }
        })
        .map_err(|e| {
            let names: Vec<&str> = parts.iter().map(|p| p.name).collect();
            ModelError::corrupt(&self.path, format!("tensors {}: {e}", names.join(", ")))
        })?;
        Ok(Some(QuantizedTensor {
            file: self.describe(),
            shape: vec![matrix.rows(), cols],
            matrix,
        }))
    }

    fn names(&self) -> Vec<String> {
        self.header.tensors.iter().map(|t| t.name.clone()).collect()
    }

    fn stored_types(&self) -> Vec<(String, usize)> {
        crate::weights::tally(
            self.header
                .tensors
                .iter()
                .map(|t| (t.ggml_type.name().to_string(), t.len())),
        )
    }
}
