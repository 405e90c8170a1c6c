//! The GGUF container (v2 and v3, little-endian): header, metadata and tensor infos, parsed
//! from a byte slice with every read bounds-checked, so a corrupt or truncated file is an
//! error naming the byte offset, never a panic or an out-of-bounds read.
//!
//! A file that lies cannot make the parser allocate more than the file justifies: every count
//! is checked against the bytes left before anything is allocated, arrays are held as typed
//! vectors ([`MetaArray`]), and the parsed [`Header`] takes at most
//! [`HEADER_MEMORY_FACTOR`] bytes of memory per byte of header in the file (plus a constant).
//! Every tensor's data lies inside the file and no two tensors share bytes, so reading every
//! tensor reads at most the file.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;

use super::quant::{GgmlType, ggml_type_name};
use super::value::{MetaArray, MetaValue, Strings};

/// `GGUF` read as a little-endian u32.
const MAGIC: u32 = 0x4655_4747;
/// llama.cpp's default when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Deepest array nesting accepted (llama.cpp writes one level; this bounds recursion).
const MAX_NESTING: usize = 4;
/// More dimensions than any ggml tensor has.
const MAX_DIMS: u32 = 4;
/// The most memory [`parse`] holds per byte of the header it reads (metadata and tensor
/// infos), plus [`HEADER_MEMORY_SLACK`]. Arrays of numbers take what they take in the file,
/// arrays of strings little more; the worst cases are the smallest entries, measured by
/// `gguf::metadata_memory_is_bounded_by_its_bytes`: many one-byte scalars under short keys
/// (a map entry each: about 8 bytes per byte), nested empty arrays (4), tensor
/// infos with one-letter names (2.5). Twice the worst, for margin.
pub const HEADER_MEMORY_FACTOR: usize = 16;
/// Memory [`parse`] may hold whatever the header's size (maps' and vectors' first
/// allocations).
pub const HEADER_MEMORY_SLACK: usize = 64 << 10;

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
            9 => MetaValue::Array(self.meta_array(depth, what)?),
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            other => return self.fail(at, format!("{what}: unknown value type {other}")),
        })
    }
}

impl Cursor<'_> {
    /// An array value after its `ARRAY` type id: item type, count, items, read into one
    /// vector of the item type.
    fn meta_array(&mut self, depth: usize, what: &str) -> Result<MetaArray, ParseError> {
        let at = self.at;
        if depth >= MAX_NESTING {
            return self.fail(
                at,
                format!("{what}: arrays nested deeper than {MAX_NESTING}"),
            );
        }
        let item_type = self.u32(what)?;
        let Some(min_bytes) = min_value_bytes(item_type) else {
            return self.fail(at, format!("{what}: unknown array item type {item_type}"));
        };
        let len = self.count(what, min_bytes)?;
        Ok(match item_type {
            0 => MetaArray::U8(self.take(len, what)?.to_vec()),
            1 => MetaArray::I8(self.numbers(len, what, i8::from_le_bytes)?),
            2 => MetaArray::U16(self.numbers(len, what, u16::from_le_bytes)?),
            3 => MetaArray::I16(self.numbers(len, what, i16::from_le_bytes)?),
            4 => MetaArray::U32(self.numbers(len, what, u32::from_le_bytes)?),
            5 => MetaArray::I32(self.numbers(len, what, i32::from_le_bytes)?),
            6 => MetaArray::F32(self.numbers(len, what, f32::from_le_bytes)?),
            7 => {
                let start = self.at;
                let bytes = self.take(len, what)?;
                if let Some(i) = bytes.iter().position(|&b| b > 1) {
                    return self.fail(
                        start + i,
                        format!("{what}[{i}]: bool byte is {}, not 0 or 1", bytes[i]),
                    );
                }
                MetaArray::Bool(bytes.iter().map(|&b| b == 1).collect())
            }
            8 => MetaArray::String(self.strings(len, what)?),
            9 => {
                let mut items = Vec::with_capacity(len);
                for _ in 0..len {
                    // Each item is an array without its `ARRAY` type id: item type, count, items.
                    items.push(self.meta_array(depth + 1, what)?);
                }
                MetaArray::Array(items)
            }
            10 => MetaArray::U64(self.numbers(len, what, u64::from_le_bytes)?),
            11 => MetaArray::I64(self.numbers(len, what, i64::from_le_bytes)?),
            12 => MetaArray::F64(self.numbers(len, what, f64::from_le_bytes)?),
            _ => return self.fail(at, format!("{what}: unknown array item type {item_type}")),
        })
    }

    /// `len` little-endian numbers of `N` bytes each.
    fn numbers<const N: usize, T>(
        &mut self,
        len: usize,
        what: &str,
        from_le: fn([u8; N]) -> T,
    ) -> Result<Vec<T>, ParseError> {
        // `count` checked that `len * N` bytes are left, so the product does not overflow.
        let (chunks, _) = self.take(len * N, what)?.as_chunks::<N>();
        Ok(chunks.iter().map(|&c| from_le(c)).collect())
    }

    /// `len` strings, into one buffer sized by a first pass over them.
    fn strings(&mut self, len: usize, what: &str) -> Result<Strings, ParseError> {
        let mut probe = Cursor {
            bytes: self.bytes,
            at: self.at,
        };
        let mut text_bytes = 0usize;
        for _ in 0..len {
            let n = probe.count(what, 1)?;
            text_bytes += Strings::lossy_len(probe.take(n, what)?);
        }
        let mut strings = Strings::with_capacity(len, text_bytes);
        for _ in 0..len {
            let n = self.count(what, 1)?;
            strings.push_lossy(self.take(n, what)?);
        }
        Ok(strings)
    }
}

/// The fewest bytes a value of this type takes (bounds array lengths before allocating), or
/// `None` for an unknown type.
fn min_value_bytes(type_id: u32) -> Option<usize> {
    Some(match type_id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
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
        match metadata.entry(key) {
            Entry::Occupied(e) => {
                return c.fail(at, format!("metadata key `{}` appears twice", e.key()));
            }
            Entry::Vacant(e) => {
                e.insert(value);
            }
        }
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() => a,
            _ => return c.fail(0, format!("general.alignment is {v}, not a power of two")),
        },
    };

    let mut tensors = Vec::with_capacity(n_tensors);
    // Where each tensor's info starts, for the errors found once every info is read.
    let mut info_at = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        info_at.push(c.at);
        tensors.push(c.tensor_info(i, alignment)?);
    }

    // Tensor data starts at the first multiple of the alignment after the infos (less than
    // the file's length plus the alignment, both at most 2^63: no overflow).
    let data_offset = (c.at as u64).div_ceil(alignment) * alignment;
    let Ok(data_offset) = usize::try_from(data_offset) else {
        return c.fail(
            c.at,
            format!("tensor data would start at byte {data_offset}"),
        );
    };
    for (t, &at) in tensors.iter_mut().zip(&info_at) {
        let range = t.data.start.checked_add(data_offset).and_then(|start| {
            let end = t.data.end.checked_add(data_offset)?;
            (end <= bytes.len()).then_some(start..end)
        });
        let Some(range) = range else {
            return c.fail(
                at,
                format!(
                    "tensor `{}`: its {} bytes at data offset {} lie past the end of the file \
                     ({} bytes); the file is truncated",
                    t.name,
                    t.data.len(),
                    t.data.start,
                    bytes.len()
                ),
            );
        };
        t.data = range;
    }
    refuse_overlaps(&tensors, &info_at)?;
    Ok(Header {
        version,
        metadata,
        tensors,
        data_offset,
    })
}

impl Cursor<'_> {
    /// Tensor info `i`: name, rank, dimensions, type and data offset, with the data's range
    /// relative to the start of the data section (checked against the file by [`parse`]).
    fn tensor_info(&mut self, i: usize, alignment: u64) -> Result<TensorInfo, ParseError> {
        let start = self.at;
        let name = self.string(&format!("the name of tensor {i}"))?;
        let at = self.at;
        let n_dims = self.u32(&format!("the rank of `{name}`"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return self.fail(at, format!("tensor `{name}` has {n_dims} dimensions"));
        }
        let mut shape = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let at = self.at;
            let d = self.u64(&format!("a dimension of `{name}`"))?;
            let d = usize::try_from(d)
                .or_else(|_| self.fail(at, format!("`{name}`: dimension {d} is too large")))?;
            shape.push(d);
        }
        shape.reverse();
        let at = self.at;
        let type_id = self.u32(&format!("the type of `{name}`"))?;
        let Some(ggml_type) = GgmlType::from_id(type_id) else {
            let supported: Vec<&str> = GgmlType::ALL.iter().map(|t| t.name()).collect();
            return self.fail(
                at,
                format!(
                    "tensor `{name}` is stored as {}, which kiln cannot read (supported: {})",
                    ggml_type_name(type_id),
                    supported.join(", ")
                ),
            );
        };
        let offset_at = self.at;
        let offset = self.u64(&format!("the data offset of `{name}`"))?;
        if !offset.is_multiple_of(alignment) {
            return self.fail(
                offset_at,
                format!("`{name}`: data offset {offset} is not aligned to {alignment}"),
            );
        }
        let Some(len) = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)) else {
            return self.fail(
                start,
                format!("tensor `{name}`: shape {shape:?} has more values than a usize counts"),
            );
        };
        if !len.is_multiple_of(ggml_type.block_size()) {
            return self.fail(
                start,
                format!(
                    "tensor `{name}`: shape {shape:?} is not a whole number of {} blocks of {}",
                    ggml_type.name(),
                    ggml_type.block_size()
                ),
            );
        }
        let range = ggml_type.bytes_for(len).and_then(|size| {
            let start = usize::try_from(offset).ok()?;
            Some(start..start.checked_add(size)?)
        });
        let Some(data) = range else {
            return self.fail(
                start,
                format!(
                    "tensor `{name}`: {len} {} values at data offset {offset} lie past the end \
                     of any file",
                    ggml_type.name()
                ),
            );
        };
        Ok(TensorInfo {
            name,
            shape,
            ggml_type,
            data,
        })
    }
}

/// Refuses tensors whose data share bytes: reading every tensor must not read more than the
/// file (300 layers all pointing at layer 0's bytes once made 877 MiB of weights out of a
/// 100 MB file). Sorted by start, each non-empty range must start at or after the end of the
/// one before (if any two overlap, two neighbours in that order do).
fn refuse_overlaps(tensors: &[TensorInfo], info_at: &[usize]) -> Result<(), ParseError> {
    let mut order: Vec<usize> = (0..tensors.len())
        .filter(|&i| !tensors[i].data.is_empty())
        .collect();
    order.sort_unstable_by_key(|&i| (tensors[i].data.start, tensors[i].data.end));
    for pair in order.windows(2) {
        let (a, b) = (&tensors[pair[0]], &tensors[pair[1]]);
        if b.data.start < a.data.end {
            return Err(ParseError {
                offset: info_at[pair[1]],
                reason: format!(
                    "tensor `{}` (bytes {}..{}) overlaps tensor `{}` (bytes {}..{}); each tensor \
                     needs its own data",
                    b.name, b.data.start, b.data.end, a.name, a.data.start, a.data.end
                ),
            });
        }
    }
    Ok(())
}
