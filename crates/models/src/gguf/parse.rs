//! The GGUF container (v2 and v3, little-endian): header, metadata and tensor infos, parsed
//! from a byte slice with every read bounds-checked, so a corrupt or truncated file is an
//! error naming the byte offset, never a panic or an out-of-bounds read.

use std::collections::BTreeMap;

use super::quant::{GgmlType, ggml_type_name};
use super::value::MetaValue;

/// `GGUF` read as a little-endian u32.
const MAGIC: u32 = 0x4655_4747;
/// llama.cpp's default when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Deepest array nesting accepted (llama.cpp writes one level; this bounds recursion).
const MAX_NESTING: usize = 4;
/// More dimensions than any ggml tensor has.
const MAX_DIMS: u32 = 4;

/// What went wrong, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// Byte offset in the file where the bad field starts.
    pub offset: usize,
    /// What was wrong.
    pub reason: String,
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "at byte {}: {}", self.offset, self.reason)
    }
}

/// A tensor's description in the header.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Its name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions, outermost first (the reverse of ggml's `ne`), so a linear layer is
    /// `[out, in]` as in PyTorch.
    pub shape: Vec<usize>,
    /// Its storage type.
    pub ggml_type: GgmlType,
    /// Byte range of its data within the file.
    pub data: std::ops::Range<usize>,
}

impl TensorInfo {
    /// Number of values.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether it has no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A parsed header: everything but the tensor data.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    /// 2 or 3.
    pub version: u32,
    /// Every key and value, in key order.
    pub metadata: BTreeMap<String, MetaValue>,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo>,
    /// Where tensor data starts.
    pub data_offset: usize,
}

/// A bounds-checked little-endian reader.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn fail<T>(&self, offset: usize, reason: impl Into<String>) -> Result<T, ParseError> {
        Err(ParseError {
            offset,
            reason: reason.into(),
        })
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], ParseError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let slice = &self.bytes[self.at..end];
                self.at = end;
                Ok(slice)
            }
            None => self.fail(
                self.at,
                format!(
                    "file ends while reading {what} ({n} bytes needed, {} left)",
                    self.bytes.len() - self.at
                ),
            ),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], ParseError> {
        let slice = self.take(N, what)?;
        Ok(slice.try_into().expect("take returns N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, ParseError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, ParseError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A count that must fit in what is left of the file at `min_bytes` per item.
    fn count(&mut self, what: &str, min_bytes: usize) -> Result<usize, ParseError> {
        let at = self.at;
        let n = self.u64(what)?;
        let left = (self.bytes.len() - self.at) as u64;
        if n.saturating_mul(min_bytes as u64) > left {
            return self.fail(
                at,
                format!("{what} is {n}, more than the {left} bytes left can hold"),
            );
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, ParseError> {
        let len = self.count(what, 1)?;
        let bytes = self.take(len, what)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value(&mut self, type_id: u32, depth: usize, what: &str) -> Result<MetaValue, ParseError> {
        let at = self.at;
        Ok(match type_id {
            0 => MetaValue::U8(self.array::<1>(what)?[0]),
            1 => MetaValue::I8(self.array::<1>(what)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => MetaValue::U32(self.u32(what)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return self.fail(at, format!("{what}: bool byte is {b}, not 0 or 1")),
            },
            8 => MetaValue::String(self.string(what)?),
            9 => {
                if depth >= MAX_NESTING {
                    return self.fail(
                        at,
                        format!("{what}: arrays nested deeper than {MAX_NESTING}"),
                    );
                }
                let item_type = self.u32(what)?;
                let len = self.count(what, min_value_bytes(item_type))?;
                let mut items = Vec::with_capacity(len);
                for _ in 0..len {
                    items.push(self.value(item_type, depth + 1, what)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            other => return self.fail(at, format!("{what}: unknown value type {other}")),
        })
    }
}

/// The fewest bytes a value of this type takes (bounds array lengths before allocating).
fn min_value_bytes(type_id: u32) -> usize {
    match type_id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => 1,
    }
}

/// Parses the header of a GGUF file held in `bytes`, checking that every tensor's data lies
/// within `bytes`.
///
/// # Errors
/// [`ParseError`] at the first field that is truncated, out of range or unsupported.
pub fn parse(bytes: &[u8]) -> Result<Header, ParseError> {
    let mut c = Cursor { bytes, at: 0 };
    let magic = c.u32("the magic number")?;
    if magic != MAGIC {
        return c.fail(0, "not a GGUF file (the first four bytes are not `GGUF`)");
    }
    let version = c.u32("the version")?;
    match version {
        2 | 3 => {}
        1 => return c.fail(
            4,
            "GGUF version 1 is not supported (re-convert with a llama.cpp from 2023-10 or later)",
        ),
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            return c.fail(4, "big-endian GGUF files are not supported");
        }
        v => return c.fail(4, format!("unknown GGUF version {v}")),
    }
    // A tensor info takes at least 8 (name) + 4 + 8 + 4 + 8 bytes; a key/value at least 8 + 4 + 1.
    let n_tensors = c.count("the tensor count", 32)?;
    let n_metadata = c.count("the metadata count", 13)?;

    let mut metadata = BTreeMap::new();
    for i in 0..n_metadata {
        let key = c.string(&format!("metadata key {i}"))?;
        let at = c.at;
        let type_id = c.u32(&format!("the type of `{key}`"))?;
        let value = c.value(type_id, 0, &format!("`{key}`"))?;
        if metadata.insert(key.clone(), value).is_some() {
            return c.fail(at, format!("metadata key `{key}` appears twice"));
        }
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() => a,
            _ => return c.fail(0, format!("general.alignment is {v}, not a power of two")),
        },
    };

    let mut raw = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let start = c.at;
        let name = c.string(&format!("the name of tensor {i}"))?;
        let at = c.at;
        let n_dims = c.u32(&format!("the rank of `{name}`"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return c.fail(at, format!("tensor `{name}` has {n_dims} dimensions"));
        }
        let mut shape = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let at = c.at;
            let d = c.u64(&format!("a dimension of `{name}`"))?;
            let d = usize::try_from(d)
                .or_else(|_| c.fail(at, format!("`{name}`: dimension {d} is too large")))?;
            shape.push(d);
        }
        shape.reverse();
        let at = c.at;
        let type_id = c.u32(&format!("the type of `{name}`"))?;
        let Some(ggml_type) = GgmlType::from_id(type_id) else {
            let supported: Vec<&str> = GgmlType::ALL.iter().map(|t| t.name()).collect();
            return c.fail(
                at,
                format!(
                    "tensor `{name}` is stored as {}, which kiln cannot read (supported: {})",
                    ggml_type_name(type_id),
                    supported.join(", ")
                ),
            );
        };
        let offset_at = c.at;
        let offset = c.u64(&format!("the data offset of `{name}`"))?;
        if !offset.is_multiple_of(alignment) {
            return c.fail(
                offset_at,
                format!("`{name}`: data offset {offset} is not aligned to {alignment}"),
            );
        }
        let len = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        let Some(size) = len.and_then(|n| ggml_type.bytes_for(n)) else {
            return c.fail(
                start,
                format!(
                    "tensor `{name}`: shape {shape:?} is not a whole number of {} blocks of {}",
                    ggml_type.name(),
                    ggml_type.block_size()
                ),
            );
        };
        raw.push((name, shape, ggml_type, offset, size, start));
    }

    let data_offset = (c.at as u64).div_ceil(alignment) * alignment;
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, shape, ggml_type, offset, size, start) in raw {
        let range = offset
            .checked_add(data_offset)
            .and_then(|s| usize::try_from(s).ok())
            .and_then(|s| s.checked_add(size).map(|e| s..e))
            .filter(|r| r.end <= bytes.len());
        let Some(data) = range else {
            return c.fail(start, format!(
                "tensor `{name}`: its {size} bytes at data offset {offset} lie past the end of the file ({} bytes); the file is truncated",
                bytes.len()
            ));
        };
        tensors.push(TensorInfo {
            name,
            shape,
            ggml_type,
            data,
        });
    }
    let data_offset = usize::try_from(data_offset).expect("below the file length");
    Ok(Header {
        version,
        metadata,
        tensors,
        data_offset,
    })
}
