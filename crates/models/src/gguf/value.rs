//! GGUF metadata values: the thirteen value types of the format and typed accessors.
//!
//! An array is held as one vector of its item type ([`MetaArray`]), not as a value per item:
//! a value took 32 bytes, so a 24 MiB array of `u8` once took 800 MiB. Held this way, an
//! array of numbers or bools takes as many bytes in memory as in the file, an array of strings
//! at most that plus the replacement of invalid UTF-8 (U+FFFD, three bytes, for each invalid
//! sequence of one to three bytes), and nested arrays 48 bytes for the 12 each takes at the
//! least.

use std::fmt;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// `UINT8`
    U8(u8),
    /// `INT8`
    I8(i8),
    /// `UINT16`
    U16(u16),
    /// `INT16`
    I16(i16),
    /// `UINT32`
    U32(u32),
    /// `INT32`
    I32(i32),
    /// `UINT64`
    U64(u64),
    /// `INT64`
    I64(i64),
    /// `FLOAT32`
    F32(f32),
    /// `FLOAT64`
    F64(f64),
    /// `BOOL`
    Bool(bool),
    /// `STRING` (UTF-8; invalid bytes are replaced)
    String(String),
    /// `ARRAY` of values of one type
    Array(MetaArray),
}

/// An `ARRAY` value: one vector of its item type.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaArray {
    /// Of `UINT8`.
    U8(Vec<u8>),
    /// Of `INT8`.
    I8(Vec<i8>),
    /// Of `UINT16`.
    U16(Vec<u16>),
    /// Of `INT16`.
    I16(Vec<i16>),
    /// Of `UINT32`.
    U32(Vec<u32>),
    /// Of `INT32`.
    I32(Vec<i32>),
    /// Of `UINT64`.
    U64(Vec<u64>),
    /// Of `INT64`.
    I64(Vec<i64>),
    /// Of `FLOAT32`.
    F32(Vec<f32>),
    /// Of `FLOAT64`.
    F64(Vec<f64>),
    /// Of `BOOL`.
    Bool(Vec<bool>),
    /// Of `STRING`.
    String(Strings),
    /// Of `ARRAY`s.
    Array(Vec<MetaArray>),
}

/// Strings laid end to end in one buffer (a vocabulary of 100k tokens is two allocations, not
/// 100k).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Strings {
    text: String,
    /// Where each string ends in `text`.
    ends: Vec<usize>,
}

impl Strings {
    /// Room for `count` strings of `text_bytes` bytes in all, allocated once.
    pub(crate) fn with_capacity(count: usize, text_bytes: usize) -> Self {
        Self {
            text: String::with_capacity(text_bytes),
            ends: Vec::with_capacity(count),
        }
    }

    /// Appends one string given as bytes, replacing invalid UTF-8 as
    /// [`String::from_utf8_lossy`] does (without its temporary copy).
    pub(crate) fn push_lossy(&mut self, bytes: &[u8]) {
        for chunk in bytes.utf8_chunks() {
            self.text.push_str(chunk.valid());
            if !chunk.invalid().is_empty() {
                self.text.push(char::REPLACEMENT_CHARACTER);
            }
        }
        self.ends.push(self.text.len());
    }

    /// The length of `bytes` once [`Strings::push_lossy`] has replaced its invalid UTF-8.
    pub(crate) fn lossy_len(bytes: &[u8]) -> usize {
        bytes
            .utf8_chunks()
            .map(|c| {
                let replaced = if c.invalid().is_empty() { 0 } else { 3 };
                c.valid().len() + replaced
            })
            .sum()
    }

    /// The number of strings.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// String `i`.
    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)?;
        let start = match i {
            0 => 0,
            _ => self.ends[i - 1],
        };
        self.text.get(start..end)
    }
}

/// One item of a [`MetaArray`], borrowed from it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MetaItem<'a> {
    /// `UINT8`
    U8(u8),
    /// `INT8`
    I8(i8),
    /// `UINT16`
    U16(u16),
    /// `INT16`
    I16(i16),
    /// `UINT32`
    U32(u32),
    /// `INT32`
    I32(i32),
    /// `UINT64`
    U64(u64),
    /// `INT64`
    I64(i64),
    /// `FLOAT32`
    F32(f32),
    /// `FLOAT64`
    F64(f64),
    /// `BOOL`
    Bool(bool),
    /// `STRING`
    String(&'a str),
    /// `ARRAY`
    Array(&'a MetaArray),
}

impl<'a> MetaItem<'a> {
    /// The item as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The item as a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            Self::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The item as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The item as a boolean.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The item as a string.
    pub fn as_str(&self) -> Option<&'a str> {
        match *self {
            Self::String(v) => Some(v),
            _ => None,
        }
    }

    /// The item as an array.
    pub fn as_array(&self) -> Option<&'a MetaArray> {
        match *self {
            Self::Array(v) => Some(v),
            _ => None,
        }
    }

    /// The name of the item's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::U8(_) => "u8",
            Self::I8(_) => "i8",
            Self::U16(_) => "u16",
            Self::I16(_) => "i16",
            Self::U32(_) => "u32",
            Self::I32(_) => "i32",
            Self::U64(_) => "u64",
            Self::I64(_) => "i64",
            Self::F32(_) => "f32",
            Self::F64(_) => "f64",
            Self::Bool(_) => "bool",
            Self::String(_) => "string",
            Self::Array(_) => "array",
        }
    }
}

impl MetaArray {
    /// The number of items.
    pub fn len(&self) -> usize {
        match self {
            Self::U8(v) => v.len(),
            Self::I8(v) => v.len(),
            Self::U16(v) => v.len(),
            Self::I16(v) => v.len(),
            Self::U32(v) => v.len(),
            Self::I32(v) => v.len(),
            Self::U64(v) => v.len(),
            Self::I64(v) => v.len(),
            Self::F32(v) => v.len(),
            Self::F64(v) => v.len(),
            Self::Bool(v) => v.len(),
            Self::String(v) => v.len(),
            Self::Array(v) => v.len(),
        }
    }

    /// Whether it has no items.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Item `i`.
    pub fn get(&self, i: usize) -> Option<MetaItem<'_>> {
        Some(match self {
            Self::U8(v) => MetaItem::U8(*v.get(i)?),
            Self::I8(v) => MetaItem::I8(*v.get(i)?),
            Self::U16(v) => MetaItem::U16(*v.get(i)?),
            Self::I16(v) => MetaItem::I16(*v.get(i)?),
            Self::U32(v) => MetaItem::U32(*v.get(i)?),
            Self::I32(v) => MetaItem::I32(*v.get(i)?),
            Self::U64(v) => MetaItem::U64(*v.get(i)?),
            Self::I64(v) => MetaItem::I64(*v.get(i)?),
            Self::F32(v) => MetaItem::F32(*v.get(i)?),
            Self::F64(v) => MetaItem::F64(*v.get(i)?),
            Self::Bool(v) => MetaItem::Bool(*v.get(i)?),
            Self::String(v) => MetaItem::String(v.get(i)?),
            Self::Array(v) => MetaItem::Array(v.get(i)?),
        })
    }

    /// The items in order.
    pub fn iter(&self) -> Items<'_> {
        Items {
            array: self,
            next: 0,
        }
    }
}

impl<'a> IntoIterator for &'a MetaArray {
    type Item = MetaItem<'a>;
    type IntoIter = Items<'a>;

    fn into_iter(self) -> Items<'a> {
        self.iter()
    }
}

/// The items of a [`MetaArray`] ([`MetaArray::iter`]).
#[derive(Debug, Clone)]
pub struct Items<'a> {
    array: &'a MetaArray,
    next: usize,
}

impl<'a> Iterator for Items<'a> {
    type Item = MetaItem<'a>;

    fn next(&mut self) -> Option<MetaItem<'a>> {
        let item = self.array.get(self.next)?;
        self.next += 1;
        Some(item)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.array.len().saturating_sub(self.next);
        (left, Some(left))
    }
}

impl ExactSizeIterator for Items<'_> {}

impl MetaValue {
    /// The value as an item, the borrowed form every accessor reads.
    pub fn item(&self) -> MetaItem<'_> {
        match self {
            Self::U8(v) => MetaItem::U8(*v),
            Self::I8(v) => MetaItem::I8(*v),
            Self::U16(v) => MetaItem::U16(*v),
            Self::I16(v) => MetaItem::I16(*v),
            Self::U32(v) => MetaItem::U32(*v),
            Self::I32(v) => MetaItem::I32(*v),
            Self::U64(v) => MetaItem::U64(*v),
            Self::I64(v) => MetaItem::I64(*v),
            Self::F32(v) => MetaItem::F32(*v),
            Self::F64(v) => MetaItem::F64(*v),
            Self::Bool(v) => MetaItem::Bool(*v),
            Self::String(v) => MetaItem::String(v),
            Self::Array(v) => MetaItem::Array(v),
        }
    }

    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        self.item().as_u64()
    }

    /// The value as a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        self.item().as_i64()
    }

    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        self.item().as_f64()
    }

    /// The value as a boolean.
    pub fn as_bool(&self) -> Option<bool> {
        self.item().as_bool()
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        self.item().as_str()
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&MetaArray> {
        self.item().as_array()
    }

    /// The name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        self.item().type_name()
    }
}

impl fmt::Display for MetaValue {
    /// Scalars as written; arrays by their length (a vocabulary is 100k strings).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::String(s) => write!(f, "{s:?}"),
            Self::Array(items) => write!(f, "[{} items]", items.len()),
            Self::Bool(v) => write!(f, "{v}"),
            Self::F32(v) => write!(f, "{v}"),
            Self::F64(v) => write!(f, "{v}"),
            other => match other.as_u64() {
                Some(v) => write!(f, "{v}"),
                None => write!(f, "{}", other.as_i64().unwrap_or_default()),
            },
        }
    }
}
