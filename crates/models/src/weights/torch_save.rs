//! The one tensor of a `torch.save(tensor)` archive, as `torch.distributed.checkpoint`'s
//! `FileSystemWriter` stores each chunk: a stored zip with `<name>/data.pkl` and the storage in
//! `<name>/data/<key>`, read through its size, stride and offset. burn-store reads `.pth` files
//! from a path and expects a dict at their root, so it cannot read these (a bare tensor inside
//! a byte range of a larger file).

use std::io::{Cursor, Read};

use super::pickle::{Pickle, Value};

/// A tensor read from a `torch.save` archive.
pub(super) struct SavedTensor {
    /// torch's dtype name (`float32`...).
    pub dtype: String,
    /// Row-major, as f32.
    pub values: Vec<f32>,
}

/// Reads the one tensor a `torch.save(tensor)` archive holds: a stored zip with
/// `<name>/data.pkl` (`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`)
/// and the storage in `<name>/data/<key>`. Its shape must be `expected` (what the caller's
/// index says), checked before its values are allocated: a blob claiming a shape of 2^40
/// elements over a small storage with zero strides must not ask for terabytes.
pub(super) fn read_torch_save(
    bytes: &[u8],
    expected: &[usize],
) -> std::result::Result<SavedTensor, String> {
    let mut zip = zip::ZipArchive::new(Cursor::new(bytes))
        .map_err(|e| format!("not a torch.save archive: {e}"))?;
    let pkl_name = zip
        .file_names()
        .find(|n| *n == "data.pkl" || n.ends_with("/data.pkl"))
        .ok_or("a torch.save archive without data.pkl")?
        .to_string();
    let prefix = &pkl_name[..pkl_name.len() - "data.pkl".len()];
    let limit = bytes.len() as u64;
    let mut entry = |name: &str| -> std::result::Result<Option<Vec<u8>>, String> {
        let mut file = match zip.by_name(name) {
            Ok(file) => file,
            Err(zip::result::ZipError::FileNotFound) => return Ok(None),
            Err(e) => return Err(format!("archive entry {name}: {e}")),
        };
        let mut out = Vec::new();
        (&mut file)
            .take(limit)
            .read_to_end(&mut out)
            .map_err(|e| format!("archive entry {name}: {e}"))?;
        Ok(Some(out))
    };
    if let Some(order) = entry(&format!("{prefix}byteorder"))?
        && order != b"little"
    {
        return Err("a big-endian torch.save archive".into());
    }
    let pkl = entry(&pkl_name)?.ok_or("data.pkl unreadable")?;
    let pickle = Pickle::parse(&pkl).map_err(|e| format!("data.pkl: {e}"))?;
    let mut tensor = pickle.root();
    // `nn.Parameter`s are saved as `_rebuild_parameter(tensor, requires_grad, hooks)`.
    if pickle.class_of(tensor) == Some(("torch._utils", "_rebuild_parameter")) {
        tensor = *pickle
            .args(tensor)
            .and_then(<[_]>::first)
            .ok_or("_rebuild_parameter without a tensor")?;
    }
    if pickle.class_of(tensor) != Some(("torch._utils", "_rebuild_tensor_v2")) {
        return Err("data.pkl holds something other than one plain tensor".into());
    }
    let args = pickle.args(tensor).unwrap_or(&[]);
    let [storage, offset, size, stride, ..] = args else {
        return Err("_rebuild_tensor_v2 with fewer than 4 arguments".into());
    };
    let storage = match pickle.get(*storage) {
        Value::Persistent(pid) => pickle.items(*pid),
        _ => None,
    }
    .ok_or("the tensor's storage is not a persistent reference")?;
    let [_, class, key, ..] = storage else {
        return Err("a storage reference of fewer than 3 fields".into());
    };
    let storage_type = pickle
        .global(*class)
        .map(|(_, name)| name)
        .ok_or("a storage type that is not a class")?;
    let dtype = storage_dtype(storage_type)
        .ok_or_else(|| format!("unsupported storage type {storage_type}"))?;
    let key = pickle
        .str(*key)
        .ok_or("a storage key that is not a string")?;
    let offset = pickle
        .int(*offset)
        .and_then(|o| usize::try_from(o).ok())
        .ok_or("a storage offset that is not a non-negative integer")?;
    let shape = pickle.sizes(*size).ok_or("a size that is not a tuple")?;
    let stride = pickle
        .sizes(*stride)
        .ok_or("a stride that is not a tuple")?;
    if stride.len() != shape.len() {
        return Err(format!("size {shape:?} with stride {stride:?}"));
    }
    if shape != expected {
        return Err(format!(
            "holds shape {shape:?}, `.metadata` says {expected:?}"
        ));
    }
    let raw = entry(&format!("{prefix}data/{key}"))?
        .ok_or_else(|| format!("the archive lacks storage data/{key}"))?;
    let element = element_bytes(dtype).ok_or("unsupported dtype")?;
    let stored = raw.len() / element;
    let numel = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| format!("size {shape:?} has more elements than memory"))?;
    if numel > 0 {
        let last = shape.iter().zip(&stride).try_fold(offset, |at, (&n, &s)| {
            at.checked_add((n - 1).checked_mul(s)?)
        });
        if last.is_none_or(|last| last >= stored) {
            return Err(format!(
                "size {shape:?}, stride {stride:?} and offset {offset} reach past its storage of \
                 {stored} elements"
            ));
        }
    }
    let value = |i: usize| -> f32 {
        let b = &raw[i * element..(i + 1) * element];
        match dtype {
            "float32" => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            "bfloat16" => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            "float16" => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
            _ => f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32,
        }
    };
    // Element `i` of the row-major order, through the tensor's strides.
    let mut values = Vec::with_capacity(numel);
    let mut index = vec![0usize; shape.len()];
    for _ in 0..numel {
        let at = offset + index.iter().zip(&stride).map(|(i, s)| i * s).sum::<usize>();
        values.push(value(at));
        for d in (0..shape.len()).rev() {
            index[d] += 1;
            if index[d] < shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    Ok(SavedTensor {
        dtype: dtype.to_string(),
        values,
    })
}

/// torch's dtype name for a `torch.save` storage class.
fn storage_dtype(storage_type: &str) -> Option<&'static str> {
    Some(match storage_type {
        "FloatStorage" => "float32",
        "BFloat16Storage" => "bfloat16",
        "HalfStorage" => "float16",
        "DoubleStorage" => "float64",
        _ => return None,
    })
}

/// Bytes per element of the dtypes kiln reads.
pub(super) fn element_bytes(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "float32" => 4,
        "bfloat16" | "float16" => 2,
        "float64" => 8,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blob_that_is_not_an_archive_is_named() {
        let err = read_torch_save(b"not a zip at all", &[1]).err().unwrap();
        assert!(err.contains("not a torch.save archive"), "{err}");
    }
}
