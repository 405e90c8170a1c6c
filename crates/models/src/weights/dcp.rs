//! `torch.distributed.checkpoint` (DCP) folders, as torchtitan saves them, read without torch:
//! [`DcpSource`].
//!
//! A folder holds `.metadata`, a pickle of `torch.distributed.checkpoint.metadata.Metadata`
//! (`state_dict_metadata`: each name's dtype, size and chunks; `storage_data`: where each
//! chunk lies, as `(relative_path, offset, length)`), and data files (`__0_0.distcp`...) in
//! which `FileSystemWriter` stores each chunk as a `torch.save` archive of that chunk. A tensor
//! is the union of its chunks (one when saved by one process, one per shard otherwise), which
//! must tile it exactly. Names lose a leading `model.` (torchtitan saves `{"model": ...}`).
//! Non-tensor entries (`BytesStorageMetadata`: dataloader or train state) are skipped.
//!
//! It knows nothing of what the tensors mean; the Meta loader maps names to layers.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};

use super::pickle::{Id, Pickle, Value};
use super::torch_save::{element_bytes, read_torch_save};
use super::{TensorSource, tally};
use crate::error::{ModelError, Result};
use crate::host::HostTensor;

/// The metadata file's name in a DCP folder.
pub const METADATA_FILE: &str = ".metadata";

/// A `torch.distributed.checkpoint` folder's tensors, read chunk by chunk on demand.
pub struct DcpSource {
    dir: PathBuf,
    /// By kiln's name (the checkpoint's without a leading `model.`).
    tensors: HashMap<String, DcpTensor>,
    /// `.metadata` and every data file, in bytes.
    bytes_on_disk: u64,
}

/// One tensor's entry in `.metadata`.
#[derive(Debug)]
struct DcpTensor {
    /// Its name in the checkpoint.
    fqn: String,
    /// torch's name for its dtype (`float32`, `bfloat16`...).
    dtype: String,
    shape: Vec<usize>,
    chunks: Vec<Chunk>,
}

/// One chunk: where it sits in the tensor and where its `torch.save` archive lies.
#[derive(Debug)]
struct Chunk {
    offsets: Vec<usize>,
    sizes: Vec<usize>,
    file: PathBuf,
    offset: u64,
    length: u64,
}

impl DcpSource {
    /// Reads `dir/.metadata` and checks it against the data files: every chunk of every
    /// tensor has a storage entry, the chunks tile their tensor exactly, and every storage
    /// range lies inside its file.
    ///
    /// # Errors
    /// [`ModelError::MissingFile`] for `.metadata` or a data file it names, or
    /// [`ModelError::Corrupt`] naming the file and tensor for anything malformed.
    pub fn open(dir: &Path) -> Result<Self> {
        let meta_path = dir.join(METADATA_FILE);
        let bytes = std::fs::read(&meta_path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                ModelError::MissingFile {
                    path: meta_path.clone(),
                    what: "torch.distributed.checkpoint metadata",
                }
            } else {
                ModelError::Io {
                    path: meta_path.clone(),
                    source,
                }
            }
        })?;
        let bad = |reason: String| ModelError::corrupt(&meta_path, reason);
        let pickle =
            Pickle::parse(&bytes).map_err(|e| bad(format!("not a readable pickle: {e}")))?;
        let root = pickle.root();
        if pickle.class_of(root).map(|(_, name)| name) != Some("Metadata") {
            return Err(bad(
                "not a torch.distributed.checkpoint Metadata object".into()
            ));
        }
        let field = |name: &str| {
            pickle
                .attr(root, name)
                .ok_or_else(|| bad(format!("Metadata has no `{name}`")))
        };
        let storage = storage_entries(&pickle, field("storage_data")?).map_err(bad)?;
        let entries = pickle
            .entries(field("state_dict_metadata")?)
            .ok_or_else(|| bad("`state_dict_metadata` is not a dict".into()))?;

        let mut tensors = HashMap::new();
        let mut file_sizes: HashMap<PathBuf, u64> = HashMap::new();
        for &(key, entry) in entries {
            let fqn = pickle
                .str(key)
                .ok_or_else(|| bad("a `state_dict_metadata` key that is not a string".into()))?;
            let Some(tensor) = tensor_entry(&pickle, fqn, entry).map_err(&bad)? else {
                continue; // bytes, not a tensor
            };
            let chunks = tensor
                .chunks
                .into_iter()
                .map(|(offsets, sizes)| {
                    let place = storage.get(&(fqn.to_string(), offsets.clone())).ok_or_else(|| {
                        bad(format!(
                            "tensor `{fqn}`: no storage entry for its chunk at offsets {offsets:?}: \
                             the chunk is missing"
                        ))
                    })?;
                    let file = dir.join(&place.relative_path);
                    let size = match file_sizes.get(&file) {
                        Some(&size) => size,
                        None => {
                            let size = data_file_size(&file)?;
                            file_sizes.insert(file.clone(), size);
                            size
                        }
                    };
                    if place.offset.checked_add(place.length).is_none_or(|end| end > size) {
                        return Err(ModelError::corrupt(
                            &file,
                            format!(
                                "tensor `{fqn}`: its chunk at offsets {offsets:?} lies at bytes \
                                 {}..{}, past the end of the file ({size} bytes)",
                                place.offset,
                                place.offset.saturating_add(place.length)
                            ),
                        ));
                    }
                    Ok(Chunk {
                        offsets,
                        sizes,
                        file,
                        offset: place.offset,
                        length: place.length,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let name = fqn.strip_prefix("model.").unwrap_or(fqn).to_string();
            let tensor = DcpTensor {
                fqn: fqn.to_string(),
                dtype: tensor.dtype,
                shape: tensor.shape,
                chunks,
            };
            if let Some(other) = tensors.insert(name.clone(), tensor) {
                return Err(bad(format!(
                    "both `{}` and `{fqn}` would be tensor `{name}`",
                    other.fqn
                )));
            }
        }
        let bytes_on_disk = bytes.len() as u64 + file_sizes.values().sum::<u64>();
        Ok(Self {
            dir: dir.to_path_buf(),
            tensors,
            bytes_on_disk,
        })
    }

    /// Bytes of `.metadata` and the data files it names.
    pub fn bytes_on_disk(&self) -> u64 {
        self.bytes_on_disk
    }
}

impl TensorSource for DcpSource {
    fn describe(&self) -> String {
        self.dir.display().to_string()
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn read(&self, name: &str) -> Result<HostTensor> {
        let tensor = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                file: self.describe(),
                tensor: name.to_string(),
            })?;
        let files: BTreeSet<String> = tensor
            .chunks
            .iter()
            .map(|c| c.file.display().to_string())
            .collect();
        let file_list = files.into_iter().collect::<Vec<_>>().join(", ");
        let element =
            element_bytes(&tensor.dtype).ok_or_else(|| ModelError::UnsupportedTensorDtype {
                file: file_list.clone(),
                tensor: tensor.fqn.clone(),
                dtype: tensor.dtype.clone(),
            })?;
        // Every chunk's archive must be able to hold its values before the whole tensor is
        // allocated, so that a lying `.metadata` cannot ask for more memory than the files hold.
        for chunk in &tensor.chunks {
            // Checked: inside a shape of at most usize::MAX elements, times up to 8 bytes.
            let needed = chunk
                .sizes
                .iter()
                .try_fold(element as u64, |n, &d| n.checked_mul(d as u64));
            if needed.is_none_or(|needed| needed > chunk.length) {
                let needed = needed.map_or("more than 2^64".to_string(), |n| n.to_string());
                return Err(ModelError::corrupt(
                    &chunk.file,
                    format!(
                        "tensor `{}`: its chunk at offsets {:?} of {:?} {} needs {needed} bytes, \
                         its storage holds {}",
                        tensor.fqn, chunk.offsets, chunk.sizes, tensor.dtype, chunk.length
                    ),
                ));
            }
        }
        let mut data = vec![0.0f32; tensor.shape.iter().product()];
        for chunk in &tensor.chunks {
            let bad = |reason: String| {
                ModelError::corrupt(
                    &chunk.file,
                    format!(
                        "tensor `{}`, chunk at offsets {:?} (bytes {}..{}): {reason}",
                        tensor.fqn,
                        chunk.offsets,
                        chunk.offset,
                        chunk.offset + chunk.length
                    ),
                )
            };
            let bytes = read_range(&chunk.file, chunk.offset, chunk.length)?;
            let saved = read_torch_save(&bytes, &chunk.sizes).map_err(&bad)?;
            if saved.dtype != tensor.dtype {
                return Err(bad(format!(
                    "holds {}, `.metadata` says {}",
                    saved.dtype, tensor.dtype
                )));
            }
            place_chunk(
                &mut data,
                &tensor.shape,
                &chunk.offsets,
                &chunk.sizes,
                &saved.values,
            );
        }
        Ok(HostTensor {
            name: name.to_string(),
            file: file_list,
            shape: tensor.shape.clone(),
            data,
        })
    }

    fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    fn stored_types(&self) -> Vec<(String, usize)> {
        tally(
            self.tensors
                .values()
                .map(|t| (type_name(&t.dtype), super::elements(&t.shape))),
        )
    }
}

/// Where a chunk's bytes lie (`_StorageInfo`).
struct Place {
    relative_path: PathBuf,
    offset: u64,
    length: u64,
}

/// `storage_data`: `MetadataIndex(fqn, offset)` to `_StorageInfo`.
fn storage_entries(
    pickle: &Pickle,
    storage_data: Id,
) -> std::result::Result<HashMap<(String, Vec<usize>), Place>, String> {
    let entries = pickle
        .entries(storage_data)
        .ok_or("`storage_data` is not a dict")?;
    let mut places = HashMap::new();
    for &(index, info) in entries {
        let fqn = pickle
            .attr(index, "fqn")
            .and_then(|f| pickle.str(f))
            .ok_or("a `storage_data` key without an `fqn` string")?;
        let bad = |what: &str| format!("`storage_data` entry of `{fqn}`: {what}");
        // Bytes entries have no offset; they are never read.
        let offset = match pickle.attr(index, "offset") {
            Some(o) if pickle.get(o) != &Value::None => pickle
                .sizes(o)
                .ok_or_else(|| bad("its `offset` is not a size"))?,
            _ => continue,
        };
        let relative_path = pickle
            .attr(info, "relative_path")
            .and_then(|p| pickle.str(p))
            .ok_or_else(|| bad("no `relative_path` string"))?;
        let relative_path = PathBuf::from(relative_path);
        if !relative_path
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
        {
            return Err(bad(&format!(
                "`relative_path` {} leaves the folder",
                relative_path.display()
            )));
        }
        let number = |name: &str| {
            pickle
                .attr(info, name)
                .and_then(|v| pickle.int(v))
                .and_then(|v| u64::try_from(v).ok())
                .ok_or_else(|| bad(&format!("no non-negative `{name}`")))
        };
        let (start, length) = (number("offset")?, number("length")?);
        if let Some(t) = pickle.attr(info, "transform_descriptors") {
            let none =
                pickle.get(t) == &Value::None || pickle.items(t).is_some_and(<[_]>::is_empty);
            if !none {
                return Err(bad(
                    "its storage is transformed (`transform_descriptors`, e.g. compressed); \
                     kiln reads plain FileSystemWriter checkpoints",
                ));
            }
        }
        places.insert(
            (fqn.to_string(), offset),
            Place {
                relative_path,
                offset: start,
                length,
            },
        );
    }
    Ok(places)
}

/// A `TensorStorageMetadata` read from the pickle.
struct TensorEntry {
    dtype: String,
    shape: Vec<usize>,
    /// `(offsets, sizes)` per chunk.
    chunks: Vec<(Vec<usize>, Vec<usize>)>,
}

/// `state_dict_metadata[fqn]`: `None` for `BytesStorageMetadata`.
fn tensor_entry(
    pickle: &Pickle,
    fqn: &str,
    entry: Id,
) -> std::result::Result<Option<TensorEntry>, String> {
    let bad = |what: &str| format!("tensor `{fqn}`: {what}");
    match pickle.class_of(entry) {
        Some((_, "BytesStorageMetadata")) => return Ok(None),
        Some((_, "TensorStorageMetadata")) => {}
        _ => return Err(bad("its entry is not a TensorStorageMetadata")),
    }
    let properties = pickle
        .attr(entry, "properties")
        .ok_or_else(|| bad("no `properties`"))?;
    // TensorProperties pickles its fields as a tuple, dtype first (torch 2.x's
    // `__getstate__`); older versions as a dict of attributes.
    let dtype = pickle
        .attr(properties, "dtype")
        .or_else(|| {
            let state = pickle.state(properties)?;
            match pickle.get(state) {
                Value::Tuple(fields) => fields.first().copied(),
                _ => None,
            }
        })
        .and_then(|d| pickle.global(d))
        .filter(|(module, _)| *module == "torch")
        .ok_or_else(|| bad("no torch dtype in its `properties`"))?
        .1
        .to_string();
    let shape = pickle
        .attr(entry, "size")
        .and_then(|s| pickle.sizes(s))
        .ok_or_else(|| bad("no `size`"))?;
    let chunk_list = pickle
        .attr(entry, "chunks")
        .and_then(|c| pickle.items(c))
        .ok_or_else(|| bad("no `chunks` list"))?;
    let mut chunks = Vec::with_capacity(chunk_list.len());
    for &chunk in chunk_list {
        let get = |name: &str| {
            pickle
                .attr(chunk, name)
                .and_then(|s| pickle.sizes(s))
                .ok_or_else(|| bad(&format!("a chunk without `{name}`")))
        };
        chunks.push((get("offsets")?, get("sizes")?));
    }
    check_tiling(&shape, &chunks).map_err(|e| bad(&e))?;
    Ok(Some(TensorEntry {
        dtype,
        shape,
        chunks,
    }))
}

/// Checks that `chunks` (`(offsets, sizes)`) tile a tensor of `shape` exactly: each inside
/// it, none overlapping, their elements adding up to the tensor's.
fn check_tiling(
    shape: &[usize],
    chunks: &[(Vec<usize>, Vec<usize>)],
) -> std::result::Result<(), String> {
    let total = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| format!("shape {shape:?} has more elements than memory"))?;
    let mut covered = 0usize;
    for (offsets, sizes) in chunks {
        if offsets.len() != shape.len() || sizes.len() != shape.len() {
            return Err(format!(
                "a chunk at offsets {offsets:?} of size {sizes:?} has not the {} dimensions of \
                 shape {shape:?}",
                shape.len()
            ));
        }
        let inside = offsets
            .iter()
            .zip(sizes)
            .zip(shape)
            .all(|((&o, &s), &d)| o.checked_add(s).is_some_and(|end| end <= d));
        if !inside {
            return Err(format!(
                "its chunk at offsets {offsets:?} of size {sizes:?} lies outside its shape {shape:?}"
            ));
        }
        // Inside the shape, so its volume is at most `total`.
        covered = covered.saturating_add(sizes.iter().product());
    }
    for (i, (oa, sa)) in chunks.iter().enumerate() {
        for (ob, sb) in &chunks[i + 1..] {
            let overlap = (0..shape.len()).all(|d| oa[d] < ob[d] + sb[d] && ob[d] < oa[d] + sa[d]);
            if overlap && sa.iter().all(|&s| s > 0) && sb.iter().all(|&s| s > 0) {
                return Err(format!("its chunks at offsets {oa:?} and {ob:?} overlap"));
            }
        }
    }
    if covered != total {
        return Err(format!(
            "its chunks cover {covered} of its {total} elements (shape {shape:?}): a chunk is \
             missing"
        ));
    }
    Ok(())
}

/// Copies a chunk's row-major `values` into the tensor `data` of `shape` at `offsets`.
///
/// # Shapes
/// - `data`: `shape`, row-major
/// - `values`: `sizes`, row-major, inside `shape` at `offsets` (checked by [`check_tiling`])
fn place_chunk(
    data: &mut [f32],
    shape: &[usize],
    offsets: &[usize],
    sizes: &[usize],
    values: &[f32],
) {
    let Some((&row, outer)) = sizes.split_last() else {
        data[0] = values[0]; // a 0-d tensor
        return;
    };
    if row == 0 || outer.contains(&0) {
        return;
    }
    // Row-major strides of the whole tensor.
    let mut strides = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    let mut index = vec![0usize; outer.len()];
    for src in values.chunks_exact(row) {
        let start: usize = offsets
            .iter()
            .zip(&strides)
            .enumerate()
            .map(|(d, (&o, &s))| (o + index.get(d).copied().unwrap_or(0)) * s)
            .sum();
        data[start..start + row].copy_from_slice(src);
        // Next row of the chunk: the last outer index fastest.
        for d in (0..outer.len()).rev() {
            index[d] += 1;
            if index[d] < outer[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

/// A data file's size, as [`ModelError::MissingFile`] when it is not there.
fn data_file_size(path: &Path) -> Result<u64> {
    std::fs::metadata(path).map(|m| m.len()).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            ModelError::MissingFile {
                path: path.to_path_buf(),
                what: "torch.distributed.checkpoint data file named in .metadata",
            }
        } else {
            ModelError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })
}

/// `length` bytes of `path` from `offset` (checked against the file's size when opened).
fn read_range(path: &Path, offset: u64, length: u64) -> Result<Vec<u8>> {
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    file.seek(SeekFrom::Start(offset)).map_err(io)?;
    let mut bytes = Vec::new();
    file.take(length).read_to_end(&mut bytes).map_err(io)?;
    if (bytes.len() as u64) < length {
        return Err(ModelError::corrupt(
            path,
            format!(
                "bytes {offset}..{} are past the end of the file",
                offset + length
            ),
        ));
    }
    Ok(bytes)
}

/// [`TensorSource::stored_types`]' name for a torch dtype (`F32`, `BF16`...).
fn type_name(dtype: &str) -> String {
    match dtype {
        "float32" => "F32".into(),
        "bfloat16" => "BF16".into(),
        "float16" => "F16".into(),
        "float64" => "F64".into(),
        other => other.to_uppercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(offsets: &[usize], sizes: &[usize]) -> (Vec<usize>, Vec<usize>) {
        (offsets.to_vec(), sizes.to_vec())
    }

    #[test]
    fn chunks_must_tile_the_tensor() {
        let shape = [4, 6];
        assert!(check_tiling(&shape, &[chunk(&[0, 0], &[4, 6])]).is_ok());
        let grid = [
            chunk(&[0, 0], &[2, 3]),
            chunk(&[0, 3], &[2, 3]),
            chunk(&[2, 0], &[2, 3]),
            chunk(&[2, 3], &[2, 3]),
        ];
        assert!(check_tiling(&shape, &grid).is_ok());
        let err = check_tiling(&shape, &grid[..3]).unwrap_err();
        assert!(
            err.contains("18 of its 24") && err.contains("missing"),
            "{err}"
        );
        let overlapping = [chunk(&[0, 0], &[3, 6]), chunk(&[2, 0], &[2, 6])];
        assert!(
            check_tiling(&shape, &overlapping)
                .unwrap_err()
                .contains("overlap")
        );
        let outside = [chunk(&[0, 0], &[2, 6]), chunk(&[2, 0], &[3, 6])];
        assert!(
            check_tiling(&shape, &outside)
                .unwrap_err()
                .contains("outside")
        );
        let wrong_rank = [chunk(&[0], &[24])];
        assert!(
            check_tiling(&shape, &wrong_rank)
                .unwrap_err()
                .contains("dimensions")
        );
        assert!(check_tiling(&[], &[chunk(&[], &[])]).is_ok());
        assert!(check_tiling(&[usize::MAX, 4], &[]).is_err());
    }

    #[test]
    fn chunks_land_at_their_offsets() {
        // A 3x4 tensor of 0..12 from a 2x2 grid of chunks.
        let shape = [3, 4];
        let mut data = vec![-1.0; 12];
        let full: Vec<f32> = (0..12).map(|v| v as f32).collect();
        for (offsets, sizes) in [
            chunk(&[0, 0], &[2, 3]),
            chunk(&[0, 3], &[2, 1]),
            chunk(&[2, 0], &[1, 3]),
            chunk(&[2, 3], &[1, 1]),
        ] {
            let (o0, o1) = (offsets[0], offsets[1]);
            let values: Vec<f32> = (0..sizes[0])
                .flat_map(|r| (0..sizes[1]).map(move |c| ((o0 + r) * 4 + o1 + c) as f32))
                .collect();
            place_chunk(&mut data, &shape, &offsets, &sizes, &values);
        }
        assert_eq!(data, full);
        let mut scalar = vec![0.0];
        place_chunk(&mut scalar, &[], &[], &[], &[5.0]);
        assert_eq!(scalar, [5.0]);
    }
}
