//! A small, bounded reader of Python pickles (protocols 2 to 5) as torch writes them: the
//! `.metadata` of a `torch.distributed.checkpoint` folder and the `data.pkl` of a
//! `torch.save` archive.
//!
//! It builds values and never runs code: a class named by `GLOBAL` / `STACK_GLOBAL` stays a
//! name, and calling it (`REDUCE`, `NEWOBJ`) makes a [`Value::Object`] holding the class, its
//! constructor arguments and the state `BUILD` gives it. Values live in one arena and refer to
//! each other by [`Id`], as Python objects share references: a memo `GET` copies nothing, and
//! a `BUILD` or `SETITEMS` on a memoized object is seen through every reference. Every opcode
//! adds at most one value and every length read is checked against the bytes left, so what it
//! allocates is bounded by the input's length.
//!
//! burn-store's pickle reader is not used here: its dictionaries key on strings (a DCP
//! `storage_data` keys on `MetadataIndex` objects), its memo copies values, and it allocates
//! the lengths it reads before checking them.

use std::collections::HashMap;

/// A value's index in [`Pickle`]'s arena.
pub(crate) type Id = usize;

/// One unpickled value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An integer that fits 64 bits (wider ones are refused).
    Int(i64),
    /// A float.
    Float(f64),
    /// A `str`.
    Str(String),
    /// `bytes` or `bytearray` (or a protocol-2 `str` that is not UTF-8).
    Bytes(Vec<u8>),
    /// A tuple.
    Tuple(Vec<Id>),
    /// A list.
    List(Vec<Id>),
    /// A dict (or an `OrderedDict`), in insertion order.
    Dict(Vec<(Id, Id)>),
    /// A set or frozenset.
    Set(Vec<Id>),
    /// A class or function named by module and name, never imported.
    Global {
        /// `torch.distributed.checkpoint.metadata`.
        module: String,
        /// `Metadata`.
        name: String,
    },
    /// What calling `class` with `args` made, with the state `BUILD` gave it.
    Object {
        /// What was called (usually a [`Value::Global`]).
        class: Id,
        /// The positional arguments.
        args: Vec<Id>,
        /// The `BUILD` state (a dict of attributes, or what `__getstate__` returned).
        state: Option<Id>,
    },
    /// A persistent id (`torch.save`'s storage references).
    Persistent(Id),
}

/// An unpickled value graph.
#[derive(Debug)]
pub(crate) struct Pickle {
    values: Vec<Value>,
    root: Id,
}

impl Pickle {
    /// Reads the pickle at the start of `bytes` (anything after its `STOP` is ignored).
    ///
    /// # Errors
    /// A message with the byte offset for an unknown or unsupported opcode, a truncated
    /// input, a stack or memo inconsistency, or an integer wider than 64 bits.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let mut parser = Parser {
            bytes,
            pos: 0,
            values: Vec::new(),
            stack: Vec::new(),
            metastack: Vec::new(),
            memo: HashMap::new(),
        };
        match parser.run() {
            Ok(root) => Ok(Self {
                values: parser.values,
                root,
            }),
            Err(e) => Err(format!("pickle byte {}: {e}", parser.pos)),
        }
    }

    /// The pickled object.
    pub fn root(&self) -> Id {
        self.root
    }

    /// The value at `id`.
    pub fn get(&self, id: Id) -> &Value {
        &self.values[id]
    }

    /// An integer.
    pub fn int(&self, id: Id) -> Option<i64> {
        match self.get(id) {
            Value::Int(v) => Some(*v),
            _ => None,
        }
    }

    /// A string.
    pub fn str(&self, id: Id) -> Option<&str> {
        match self.get(id) {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// A tuple's or list's items.
    pub fn items(&self, id: Id) -> Option<&[Id]> {
        match self.get(id) {
            Value::Tuple(items) | Value::List(items) => Some(items),
            _ => None,
        }
    }

    /// A dict's entries.
    pub fn entries(&self, id: Id) -> Option<&[(Id, Id)]> {
        match self.get(id) {
            Value::Dict(entries) => Some(entries),
            _ => None,
        }
    }

    /// A global's `(module, name)`.
    pub fn global(&self, id: Id) -> Option<(&str, &str)> {
        match self.get(id) {
            Value::Global { module, name } => Some((module, name)),
            _ => None,
        }
    }

    /// An object's class `(module, name)`, when its class is a global.
    pub fn class_of(&self, id: Id) -> Option<(&str, &str)> {
        match self.get(id) {
            Value::Object { class, .. } => self.global(*class),
            _ => None,
        }
    }

    /// An object's constructor arguments.
    pub fn args(&self, id: Id) -> Option<&[Id]> {
        match self.get(id) {
            Value::Object { args, .. } => Some(args),
            _ => None,
        }
    }

    /// An object's `BUILD` state.
    pub fn state(&self, id: Id) -> Option<Id> {
        match self.get(id) {
            Value::Object { state, .. } => *state,
            _ => None,
        }
    }

    /// The value under the string key `key` in the dict `dict`.
    pub fn dict_get(&self, dict: Id, key: &str) -> Option<Id> {
        self.entries(dict)?
            .iter()
            .find(|(k, _)| self.str(*k) == Some(key))
            .map(|&(_, v)| v)
    }

    /// An object's attribute `name` from its `BUILD` state: a dict of attributes, or the
    /// `(dict, slots)` pair Python pickles for classes with `__slots__`.
    pub fn attr(&self, object: Id, name: &str) -> Option<Id> {
        let state = self.state(object)?;
        if let Some(value) = self.dict_get(state, name) {
            return Some(value);
        }
        match self.get(state) {
            Value::Tuple(pair) if pair.len() == 2 => {
                pair.iter().find_map(|&part| self.dict_get(part, name))
            }
            _ => None,
        }
    }

    /// A tuple or list of non-negative integers, or a `torch.Size` made of one.
    pub fn sizes(&self, id: Id) -> Option<Vec<usize>> {
        let items = match self.class_of(id) {
            Some(("torch", "Size")) => {
                let args = self.args(id)?;
                match args {
                    [] => &[][..],
                    [tuple] => self.items(*tuple)?,
                    _ => return None,
                }
            }
            _ => self.items(id)?,
        };
        items
            .iter()
            .map(|&i| self.int(i).and_then(|v| usize::try_from(v).ok()))
            .collect()
    }
}

/// The unpickling machine: CPython's `_Unpickler` without `find_class`.
struct Parser<'a> {
    bytes: &'a [u8],
    pos: usize,
    values: Vec<Value>,
    stack: Vec<Id>,
    /// The stacks saved by `MARK`s still open.
    metastack: Vec<Vec<Id>>,
    memo: HashMap<u32, Id>,
}

impl<'a> Parser<'a> {
    fn run(&mut self) -> Result<Id, String> {
        loop {
            let op = self.byte()?;
            match op {
                // PROTO
                0x80 => {
                    let version = self.byte()?;
                    if !(2..=5).contains(&version) {
                        return Err(format!("protocol {version} (kiln reads 2 to 5)"));
                    }
                }
                // FRAME: a length hint; the frame's contents follow as ordinary opcodes.
                0x95 => {
                    let len = self.u64()?;
                    if len > self.left() as u64 {
                        return Err(format!(
                            "frame of {len} bytes, {} left: the file is truncated",
                            self.left()
                        ));
                    }
                }
                b'.' => return self.pop(),
                b'(' => self.metastack.push(std::mem::take(&mut self.stack)),
                b'0' => {
                    if self.stack.is_empty() {
                        self.pop_mark()?;
                    } else {
                        self.pop()?;
                    }
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let top = self.top()?;
                    self.stack.push(top);
                }
                b'N' => self.push(Value::None),
                0x88 => self.push(Value::Bool(true)),
                0x89 => self.push(Value::Bool(false)),
                b'K' => {
                    let v = self.byte()?;
                    self.push(Value::Int(i64::from(v)));
                }
                b'M' => {
                    let b = self.take(2)?;
                    self.push(Value::Int(i64::from(u16::from_le_bytes([b[0], b[1]]))));
                }
                b'J' => {
                    let b = self.take(4)?;
                    self.push(Value::Int(i64::from(i32::from_le_bytes([
                        b[0], b[1], b[2], b[3],
                    ]))));
                }
                0x8a => {
                    let n = usize::from(self.byte()?);
                    let v = self.long(n)?;
                    self.push(Value::Int(v));
                }
                0x8b => {
                    let n = self.u32()? as usize;
                    let v = self.long(n)?;
                    self.push(Value::Int(v));
                }
                b'I' => {
                    let line = self.line()?;
                    let value = match line {
                        "00" => Value::Bool(false),
                        "01" => Value::Bool(true),
                        _ => Value::Int(
                            line.parse()
                                .map_err(|_| format!("INT `{line}` is not a 64-bit integer"))?,
                        ),
                    };
                    self.push(value);
                }
                b'L' => {
                    let line = self.line()?;
                    let digits = line.strip_suffix('L').unwrap_or(line);
                    let v = digits
                        .parse()
                        .map_err(|_| format!("LONG `{line}` is not a 64-bit integer"))?;
                    self.push(Value::Int(v));
                }
                b'G' => {
                    let b = self.take(8)?;
                    let bits: [u8; 8] = b.try_into().map_err(|_| "short float")?;
                    self.push(Value::Float(f64::from_be_bytes(bits)));
                }
                b'F' => {
                    let line = self.line()?;
                    let v = line
                        .parse()
                        .map_err(|_| format!("FLOAT `{line}` is not a number"))?;
                    self.push(Value::Float(v));
                }
                // SHORT_BINUNICODE, BINUNICODE, BINUNICODE8
                0x8c | b'X' | 0x8d => {
                    let n = self.length(op, 0x8c, b'X')?;
                    let b = self.take(n)?;
                    let s = std::str::from_utf8(b).map_err(|_| "a str that is not UTF-8")?;
                    self.push(Value::Str(s.to_string()));
                }
                // SHORT_BINSTRING, BINSTRING: Python 2 `str`, text when it is UTF-8.
                b'U' | b'T' => {
                    let n = if op == b'U' {
                        usize::from(self.byte()?)
                    } else {
                        self.u32()? as usize
                    };
                    let b = self.take(n)?;
                    let value = match std::str::from_utf8(b) {
                        Ok(s) => Value::Str(s.to_string()),
                        Err(_) => Value::Bytes(b.to_vec()),
                    };
                    self.push(value);
                }
                // SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8
                b'C' | b'B' | 0x8e | 0x96 => {
                    let n = self.length(op, b'C', b'B')?;
                    let b = self.take(n)?.to_vec();
                    self.push(Value::Bytes(b));
                }
                b')' => self.push(Value::Tuple(Vec::new())),
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Value::Tuple(items));
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    if self.stack.len() < n {
                        return Err("stack underflow".into());
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.push(Value::Tuple(items));
                }
                b']' => self.push(Value::List(Vec::new())),
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Value::List(items));
                }
                b'a' => {
                    let item = self.pop()?;
                    self.extend_list(vec![item])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.extend_list(items)?;
                }
                b'}' => self.push(Value::Dict(Vec::new())),
                b'd' => {
                    let items = self.pop_mark()?;
                    let entries = pairs(items)?;
                    self.push(Value::Dict(entries));
                }
                b's' => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    self.extend_dict(vec![(key, value)])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.extend_dict(pairs(items)?)?;
                }
                0x8f => self.push(Value::Set(Vec::new())),
                0x91 => {
                    let items = self.pop_mark()?;
                    self.push(Value::Set(items));
                }
                0x90 => {
                    let items = self.pop_mark()?;
                    let set = self.top()?;
                    match &mut self.values[set] {
                        Value::Set(members) => members.extend(items),
                        _ => return Err("ADDITEMS on something not a set".into()),
                    }
                }
                b'c' => {
                    let module = self.line()?.to_string();
                    let name = self.line()?.to_string();
                    self.push(Value::Global { module, name });
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (&self.values[module], &self.values[name]) {
                        (Value::Str(module), Value::Str(name)) => {
                            let (module, name) = (module.clone(), name.clone());
                            self.push(Value::Global { module, name });
                        }
                        _ => return Err("STACK_GLOBAL of something not two strings".into()),
                    }
                }
                b'R' => {
                    let args = self.pop()?;
                    let class = self.pop()?;
                    let args = self.tuple_items(args, "REDUCE")?;
                    let ordered_dict = matches!(&self.values[class],
                        Value::Global { module, name } if module == "collections" && name == "OrderedDict");
                    if ordered_dict && args.is_empty() {
                        self.push(Value::Dict(Vec::new()));
                    } else {
                        self.push(Value::Object {
                            class,
                            args,
                            state: None,
                        });
                    }
                }
                0x81 => {
                    let args = self.pop()?;
                    let class = self.pop()?;
                    let args = self.tuple_items(args, "NEWOBJ")?;
                    self.push(Value::Object {
                        class,
                        args,
                        state: None,
                    });
                }
                0x92 => {
                    let _kwargs = self.pop()?;
                    let args = self.pop()?;
                    let class = self.pop()?;
                    let args = self.tuple_items(args, "NEWOBJ_EX")?;
                    self.push(Value::Object {
                        class,
                        args,
                        state: None,
                    });
                }
                b'b' => {
                    let new_state = self.pop()?;
                    let object = self.top()?;
                    match &mut self.values[object] {
                        Value::Object { state, .. } => *state = Some(new_state),
                        _ => return Err("BUILD on something not an object".into()),
                    }
                }
                b'P' => {
                    let pid = self.line()?.to_string();
                    let id = self.add(Value::Str(pid));
                    self.push(Value::Persistent(id));
                }
                b'Q' => {
                    let pid = self.pop()?;
                    self.push(Value::Persistent(pid));
                }
                b'p' => {
                    let line = self.line()?;
                    let index = line
                        .parse()
                        .map_err(|_| format!("PUT index `{line}` is not a number"))?;
                    self.put(index)?;
                }
                b'q' => {
                    let index = u32::from(self.byte()?);
                    self.put(index)?;
                }
                b'r' => {
                    let index = self.u32()?;
                    self.put(index)?;
                }
                0x94 => {
                    let index = u32::try_from(self.memo.len()).map_err(|_| "memo too large")?;
                    self.put(index)?;
                }
                b'g' => {
                    let line = self.line()?;
                    let index = line
                        .parse()
                        .map_err(|_| format!("GET index `{line}` is not a number"))?;
                    self.get(index)?;
                }
                b'h' => {
                    let index = u32::from(self.byte()?);
                    self.get(index)?;
                }
                b'j' => {
                    let index = self.u32()?;
                    self.get(index)?;
                }
                other => return Err(format!("unsupported pickle opcode 0x{other:02x}")),
            }
        }
    }

    fn left(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.left() {
            return Err(format!(
                "{n} bytes wanted, {} left: the file is truncated",
                self.left()
            ));
        }
        let bytes: &'a [u8] = self.bytes;
        let slice = &bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(slice)
    }

    fn byte(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        let bits: [u8; 8] = b.try_into().map_err(|_| "short length")?;
        Ok(u64::from_le_bytes(bits))
    }

    /// The length prefix of a string or bytes opcode: one byte for the `short` opcode, four
    /// for the `four` one, eight for the rest.
    fn length(&mut self, op: u8, short: u8, four: u8) -> Result<usize, String> {
        let n = if op == short {
            u64::from(self.byte()?)
        } else if op == four {
            u64::from(self.u32()?)
        } else {
            self.u64()?
        };
        usize::try_from(n).map_err(|_| format!("length {n} does not fit memory"))
    }

    /// A little-endian two's-complement integer of `n` bytes (`LONG1`, `LONG4`).
    fn long(&mut self, n: usize) -> Result<i64, String> {
        if n > 8 {
            return Err(format!("an integer of {n} bytes (kiln reads up to 8)"));
        }
        let b = self.take(n)?;
        let mut bits = [0u8; 8];
        bits[..n].copy_from_slice(b);
        if b.last().is_some_and(|&last| last & 0x80 != 0) {
            bits[n..].fill(0xff);
        }
        Ok(i64::from_le_bytes(bits))
    }

    /// A newline-terminated line of text (`GLOBAL`'s names, text integers).
    fn line(&mut self) -> Result<&'a str, String> {
        let bytes: &'a [u8] = self.bytes;
        let rest = &bytes[self.pos..];
        let end = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or("a line without its newline: the file is truncated")?;
        self.pos += end + 1;
        std::str::from_utf8(&rest[..end]).map_err(|_| "a line that is not UTF-8".to_string())
    }

    fn add(&mut self, value: Value) -> Id {
        self.values.push(value);
        self.values.len() - 1
    }

    fn push(&mut self, value: Value) {
        let id = self.add(value);
        self.stack.push(id);
    }

    fn pop(&mut self) -> Result<Id, String> {
        self.stack.pop().ok_or_else(|| "stack underflow".into())
    }

    fn top(&self) -> Result<Id, String> {
        self.stack
            .last()
            .copied()
            .ok_or_else(|| "stack underflow".into())
    }

    /// The items pushed since the last `MARK`, which is closed.
    fn pop_mark(&mut self) -> Result<Vec<Id>, String> {
        let outer = self.metastack.pop().ok_or("no MARK to pop to")?;
        Ok(std::mem::replace(&mut self.stack, outer))
    }

    fn put(&mut self, index: u32) -> Result<(), String> {
        let top = self.top()?;
        self.memo.insert(index, top);
        Ok(())
    }

    fn get(&mut self, index: u32) -> Result<(), String> {
        let id = *self
            .memo
            .get(&index)
            .ok_or_else(|| format!("memo entry {index} was never stored"))?;
        self.stack.push(id);
        Ok(())
    }

    fn tuple_items(&self, id: Id, op: &str) -> Result<Vec<Id>, String> {
        match &self.values[id] {
            Value::Tuple(items) => Ok(items.clone()),
            _ => Err(format!("{op} arguments that are not a tuple")),
        }
    }

    fn extend_list(&mut self, items: Vec<Id>) -> Result<(), String> {
        let list = self.top()?;
        match &mut self.values[list] {
            Value::List(existing) => {
                existing.extend(items);
                Ok(())
            }
            _ => Err("APPEND to something not a list".into()),
        }
    }

    fn extend_dict(&mut self, entries: Vec<(Id, Id)>) -> Result<(), String> {
        let dict = self.top()?;
        match &mut self.values[dict] {
            Value::Dict(existing) => {
                existing.extend(entries);
                Ok(())
            }
            _ => Err("SETITEM on something not a dict".into()),
        }
    }
}

/// Alternating keys and values as pairs.
fn pairs(items: Vec<Id>) -> Result<Vec<(Id, Id)>, String> {
    if !items.len().is_multiple_of(2) {
        return Err("a dict with a key and no value".into());
    }
    Ok(items.chunks_exact(2).map(|kv| (kv[0], kv[1])).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `pickle.dumps(obj, protocol=4)` of small values, made with CPython 3.11.
    #[test]
    fn reads_containers_memo_and_objects() {
        // {"a": (1, -2, 300, 2**40), "b": [None, True, 1.5], "c": b"xy"}
        let bytes: &[u8] = b"\x80\x04\x95:\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94(K\x01J\xfe\xff\xff\xffM,\x01\x8a\x06\x00\x00\x00\x00\x00\x01t\x94\x8c\x01b\x94]\x94(N\x88G?\xf8\x00\x00\x00\x00\x00\x00e\x8c\x01c\x94C\x02xy\x94u.";
        let p = Pickle::parse(bytes).unwrap();
        let a = p.dict_get(p.root(), "a").unwrap();
        let ints: Vec<i64> = p
            .items(a)
            .unwrap()
            .iter()
            .map(|&i| p.int(i).unwrap())
            .collect();
        assert_eq!(ints, [1, -2, 300, 1 << 40]);
        let b = p.dict_get(p.root(), "b").unwrap();
        let b = p.items(b).unwrap();
        assert_eq!(p.get(b[0]), &Value::None);
        assert_eq!(p.get(b[1]), &Value::Bool(true));
        assert_eq!(p.get(b[2]), &Value::Float(1.5));
        let c = p.dict_get(p.root(), "c").unwrap();
        assert_eq!(p.get(c), &Value::Bytes(b"xy".to_vec()));
    }

    /// A memoized object built after it was stored is seen built through the memo, as in
    /// Python; classes are names, never imported.
    #[test]
    fn build_is_seen_through_memo_references() {
        // STACK_GLOBAL m.C, NEWOBJ (), MEMOIZE, {"x": 7} BUILD, then a tuple (obj, GET obj)
        let bytes: &[u8] =
            b"\x80\x04\x8c\x01m\x8c\x01C\x93)\x81\x94}\x8c\x01xK\x07sb\x94h\x00\x86.";
        let p = Pickle::parse(bytes).unwrap();
        let pair = p.items(p.root()).unwrap();
        assert_eq!(pair[0], pair[1]);
        assert_eq!(p.class_of(pair[1]), Some(("m", "C")));
        assert_eq!(p.int(p.attr(pair[1], "x").unwrap()), Some(7));
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        let cases: [(&[u8], &str); 7] = [
            (b"", "truncated"),
            (b"\x80\x04X\xff\xff\xff\x7fabc", "truncated"),
            (b"\x80\x04\x8e\xff\xff\xff\xff\xff\xff\xff\xff", "truncated"),
            (b"\x80\x04h\x05.", "never stored"),
            (b"\x80\x04a.", "underflow"),
            (b"\x80\x04t.", "MARK"),
            (b"\x80\x04K\x01K\x02b.", "not an object"),
        ];
        for (bytes, expected) in cases {
            let err = Pickle::parse(bytes).unwrap_err();
            assert!(err.contains(expected), "{bytes:?}: {err}");
        }
        // Every prefix of a valid pickle fails cleanly.
        let bytes: &[u8] =
            b"\x80\x04\x8c\x01m\x8c\x01C\x93)\x81\x94}\x8c\x01xK\x07sb\x94h\x00\x86.";
        for end in 0..bytes.len() {
            assert!(Pickle::parse(&bytes[..end]).is_err(), "prefix of {end}");
        }
    }
}
