//! The pickle machine: only the opcodes and globals a state_dict needs, no code run, and bounds
//! on everything a pickle can make it hold (see [`Bounds`]).

use super::{bad, Elem, StorageRef, TensorRef};
use crate::{Error, Result};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// A value on the stack; containers and strings live in the arena, so a value is a small copy
/// and dropping the deepest nesting recurses nowhere.
#[derive(Clone, Copy, Debug)]
pub(super) enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// A float (no weight's value; only its place on the stack matters).
    Float,
    Obj(usize),
}

#[derive(Debug)]
pub(super) enum Obj {
    Str(String),
    /// A bytes object (no weight's value; only its place on the stack matters).
    Bytes,
    /// An integer beyond i64 (the legacy magic number), as its little-endian two's complement bytes.
    BigInt(Vec<u8>),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    Set,
    Global(Global),
    // Boxed: they are rare, and an object is then 32 bytes.
    Storage(Box<StorageRef>),
    Tensor(Box<TensorRef>),
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Global {
    OrderedDict,
    RebuildTensor,
    RebuildTensorV2,
    RebuildParameter,
    RebuildParameterWithState,
    Storage(Elem),
}

/// The globals a state_dict's pickle may name; `None` for everything else.
fn allowed_global(module: &str, name: &str) -> Option<Global> {
    Some(match (module, name) {
        ("collections", "OrderedDict") => Global::OrderedDict,
        ("torch._utils", "_rebuild_tensor") => Global::RebuildTensor,
        ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildTensorV2,
        ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
        ("torch._utils", "_rebuild_parameter_with_state") => Global::RebuildParameterWithState,
        ("torch", storage) => Global::Storage(Elem::of_storage(storage)?),
        _ => return None,
    })
}

/// Pickle opcodes (Python's `pickle` module names them).
mod op {
    pub const MARK: u8 = b'(';
    pub const STOP: u8 = b'.';
    pub const POP: u8 = b'0';
    pub const POP_MARK: u8 = b'1';
    pub const DUP: u8 = b'2';
    pub const INT: u8 = b'I';
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const BININT2: u8 = b'M';
    pub const LONG: u8 = b'L';
    pub const NONE: u8 = b'N';
    pub const BINPERSID: u8 = b'Q';
    pub const REDUCE: u8 = b'R';
    pub const BINSTRING: u8 = b'T';
    pub const SHORT_BINSTRING: u8 = b'U';
    pub const BINUNICODE: u8 = b'X';
    pub const APPEND: u8 = b'a';
    pub const BUILD: u8 = b'b';
    pub const GLOBAL: u8 = b'c';
    pub const DICT: u8 = b'd';
    pub const EMPTY_DICT: u8 = b'}';
    pub const APPENDS: u8 = b'e';
    pub const GET: u8 = b'g';
    pub const BINGET: u8 = b'h';
    pub const LONG_BINGET: u8 = b'j';
    pub const LIST: u8 = b'l';
    pub const EMPTY_LIST: u8 = b']';
    pub const PUT: u8 = b'p';
    pub const BINPUT: u8 = b'q';
    pub const LONG_BINPUT: u8 = b'r';
    pub const SETITEM: u8 = b's';
    pub const TUPLE: u8 = b't';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const SETITEMS: u8 = b'u';
    pub const BINFLOAT: u8 = b'G';
    pub const BINBYTES: u8 = b'B';
    pub const SHORT_BINBYTES: u8 = b'C';
    pub const PROTO: u8 = 0x80;
    pub const NEWOBJ: u8 = 0x81;
    pub const TUPLE1: u8 = 0x85;
    pub const TUPLE2: u8 = 0x86;
    pub const TUPLE3: u8 = 0x87;
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const LONG1: u8 = 0x8a;
    pub const LONG4: u8 = 0x8b;
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE8: u8 = 0x8d;
    pub const BINBYTES8: u8 = 0x8e;
    pub const EMPTY_SET: u8 = 0x8f;
    pub const ADDITEMS: u8 = 0x90;
    pub const FROZENSET: u8 = 0x91;
    pub const STACK_GLOBAL: u8 = 0x93;
    pub const MEMOIZE: u8 = 0x94;
    pub const FRAME: u8 = 0x95;
    pub const BYTEARRAY8: u8 = 0x96;
}

/// The bounds of one pickle's machine. `torch.save` writes a state_dict's pickle with about 37
/// opcodes, 9 memo entries and 10 objects per tensor (MobileNetV2: 11,462 opcodes for 314
/// tensors), nesting under 10, and fills its containers in batches of 1,000 items; each bound is
/// far above that, and together they keep what a pickle can make the machine hold (at most one
/// object, one stored value or one memo entry per opcode, 16 to 32 bytes each) under 1 GiB.
pub(super) struct Bounds;

impl Bounds {
    /// Opcodes in one pickle: about 450,000 tensors' worth.
    pub(super) const OPCODES: usize = 1 << 24;
    /// Values on the stack at once (16 bytes each).
    pub(super) const STACK: usize = 1 << 20;
    /// Memo entries.
    pub(super) const MEMO: usize = 1 << 21;
    /// Marks open at once (MARK inside MARK).
    pub(super) const MARKS: usize = 64;
    /// Containers inside containers (a state_dict nested in a checkpoint's dict is 2 or 3).
    pub(super) const NESTING: usize = 32;
}

/// One pickle's machine: a stack, the marks, the memo and the arena (each object's nesting depth
/// beside it).
pub(super) struct Unpickler<'a> {
    pub(super) path: &'a Path,
    bytes: &'a [u8],
    pub(super) pos: usize,
    /// Where the opcode being run starts.
    at: usize,
    opcodes: usize,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: HashMap<u64, Value>,
    arena: Vec<Obj>,
    depth: Vec<u8>,
}

impl<'a> Unpickler<'a> {
    pub(super) fn new(path: &'a Path, bytes: &'a [u8], pos: usize) -> Self {
        Self {
            path,
            bytes,
            pos,
            at: pos,
            opcodes: 0,
            stack: Vec::new(),
            marks: Vec::new(),
            memo: HashMap::new(),
            arena: Vec::new(),
            depth: Vec::new(),
        }
    }

    /// The error for passing bound `bound` of `limit`, at the opcode being run.
    fn limit(&self, bound: &'static str, limit: usize) -> Error {
        Error::PickleLimit { path: self.path.to_path_buf(), offset: self.at, bound, limit }
    }

    fn push(&mut self, v: Value) -> Result<()> {
        if self.stack.len() >= Bounds::STACK {
            return Err(self.limit("values on the stack", Bounds::STACK));
        }
        self.stack.push(v);
        Ok(())
    }

    /// The nesting depth of `v`: 0 for a scalar, a string or a tensor, 1 + its deepest item's
    /// for a container.
    fn depth_of(&self, v: Value) -> usize {
        match v {
            Value::Obj(i) => self.depth.get(i).copied().map_or(0, usize::from),
            _ => 0,
        }
    }

    /// 1 + the deepest of `items`, checked against [`Bounds::NESTING`].
    fn container_depth(&self, items: impl Iterator<Item = Value>) -> Result<u8> {
        let d = 1 + items.map(|v| self.depth_of(v)).max().unwrap_or(0);
        if d > Bounds::NESTING {
            return Err(self.limit("levels of nesting", Bounds::NESTING));
        }
        Ok(d as u8)
    }

    /// Raises container `v`'s depth for the `items` put into it.
    fn deepen(&mut self, v: Value, items: impl Iterator<Item = Value>) -> Result<()> {
        let d = self.container_depth(items)?;
        if let Value::Obj(i) = v {
            if let Some(slot) = self.depth.get_mut(i) {
                *slot = (*slot).max(d);
            }
        }
        Ok(())
    }

    fn err(&self, reason: impl std::fmt::Display) -> Error {
        bad(self.path, format!("pickle at byte {}: {reason}", self.pos))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let bytes: &'a [u8] = self.bytes;
        let end = self.pos.checked_add(n).filter(|&e| e <= bytes.len());
        let Some(end) = end else {
            return Err(self.err(format!("needs {n} more bytes, but the file ends (truncated)")));
        };
        let out = &bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let b = self.take(N)?;
        let mut out = [0; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    /// A length read from the file as `u64`, checked against the bytes left.
    fn take_len(&mut self, len: u64) -> Result<&'a [u8]> {
        let n = usize::try_from(len).map_err(|_| self.err(format!("length {len} is larger than memory")))?;
        self.take(n)
    }

    fn line(&mut self) -> Result<&'a str> {
        let rest = self.bytes.get(self.pos..).unwrap_or(&[]);
        let n = rest.iter().position(|&b| b == b'\n').ok_or_else(|| self.err("a text line has no end (truncated)"))?;
        let line = self.take(n + 1)?;
        std::str::from_utf8(&line[..n]).map_err(|_| self.err("a text line is not UTF-8"))
    }

    /// Stores `obj` in the arena (at most one object per opcode, so the opcode bound bounds it).
    fn alloc(&mut self, obj: Obj) -> Result<Value> {
        let depth = match &obj {
            Obj::Tuple(items) | Obj::List(items) => self.container_depth(items.iter().copied())?,
            Obj::Dict(pairs) => self.container_depth(pairs.iter().flat_map(|&(k, v)| [k, v]))?,
            _ => 0,
        };
        self.arena.push(obj);
        self.depth.push(depth);
        Ok(Value::Obj(self.arena.len() - 1))
    }

    fn arena_mut(&mut self, v: Value) -> Option<&mut Obj> {
        match v {
            Value::Obj(i) => self.arena.get_mut(i),
            _ => None,
        }
    }

    pub(super) fn obj(&self, v: Value) -> Option<&Obj> {
        match v {
            Value::Obj(i) => self.arena.get(i),
            _ => None,
        }
    }

    fn pop(&mut self) -> Result<Value> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.err("pops an empty stack (corrupt pickle)"));
        }
        self.stack.pop().ok_or_else(|| self.err("pops an empty stack (corrupt pickle)"))
    }

    fn top(&self) -> Result<Value> {
        let floor = self.marks.last().copied().unwrap_or(0);
        match self.stack.last() {
            Some(v) if self.stack.len() > floor => Ok(*v),
            _ => Err(self.err("reads an empty stack (corrupt pickle)")),
        }
    }

    fn pop_mark(&mut self) -> Result<Vec<Value>> {
        let mark = self.marks.pop().ok_or_else(|| self.err("no mark to pop to (corrupt pickle)"))?;
        Ok(self.stack.split_off(mark.min(self.stack.len())))
    }

    fn string(&mut self, bytes: &[u8]) -> Result<Value> {
        let s = std::str::from_utf8(bytes).map_err(|_| self.err("a string is not UTF-8"))?.to_string();
        self.alloc(Obj::Str(s))
    }

    pub(super) fn str_of(&self, v: Value) -> Option<&str> {
        match self.obj(v) {
            Some(Obj::Str(s)) => Some(s),
            _ => None,
        }
    }

    fn global(&mut self, module: &str, name: &str) -> Result<Value> {
        match allowed_global(module, name) {
            Some(g) => self.alloc(Obj::Global(g)),
            None => Err(Error::CheckpointGlobal { path: self.path.to_path_buf(), global: format!("{module}.{name}") }),
        }
    }

    /// Runs to `STOP` and returns the value; `self.pos` is then just after it. Storages named by
    /// persistent ids are recorded in `storages`.
    pub(super) fn run(&mut self, storages: &mut BTreeMap<String, StorageRef>) -> Result<Value> {
        loop {
            self.at = self.pos;
            self.opcodes += 1;
            if self.opcodes > Bounds::OPCODES {
                return Err(self.limit("opcodes", Bounds::OPCODES));
            }
            let [code] = self.array::<1>()?;
            if code == op::STOP {
                return self.pop();
            }
            if let Some(v) = self.scalar(code)? {
                self.push(v)?;
            } else if !(self.stack_op(code)? || self.container(code)? || self.memo(code)? || self.call(code, storages)?) {
                return Err(self.err(format!(
                    "opcode 0x{code:02x} is not one a state_dict needs (objects, extensions and out-of-band buffers are refused)"
                )));
            }
        }
    }

    /// The value of a number, string or bytes opcode; `None` for any other opcode.
    fn scalar(&mut self, code: u8) -> Result<Option<Value>> {
        Ok(Some(match code {
            op::NONE => Value::None,
            op::NEWTRUE => Value::Bool(true),
            op::NEWFALSE => Value::Bool(false),
            op::BININT => Value::Int(i32::from_le_bytes(self.array()?).into()),
            op::BININT1 => Value::Int(self.array::<1>()?[0].into()),
            op::BININT2 => Value::Int(u16::from_le_bytes(self.array()?).into()),
            op::INT | op::LONG => {
                let line = self.line()?;
                match line.trim_end_matches('L') {
                    "00" => Value::Bool(false),
                    "01" => Value::Bool(true),
                    t => Value::Int(t.parse().map_err(|_| self.err(format!("`{line}` is not an integer")))?),
                }
            }
            op::LONG1 | op::LONG4 => {
                let n = self.length(code)?;
                let b = self.take_len(n)?;
                self.long(b)?
            }
            op::BINFLOAT => {
                self.take(8)?;
                Value::Float
            }
            // Python 2's `str` (BINSTRING) too: the storage keys of old checkpoints are ASCII.
            op::SHORT_BINUNICODE | op::BINUNICODE | op::BINUNICODE8 | op::SHORT_BINSTRING | op::BINSTRING => {
                let n = self.length(code)?;
                let b = self.take_len(n)?;
                self.string(b)?
            }
            op::SHORT_BINBYTES | op::BINBYTES | op::BINBYTES8 | op::BYTEARRAY8 => {
                let n = self.length(code)?;
                self.take_len(n)?;
                self.alloc(Obj::Bytes)?
            }
            _ => return Ok(None),
        }))
    }

    /// The length argument of a sized opcode: one byte, four (BINSTRING's signed) or eight.
    fn length(&mut self, code: u8) -> Result<u64> {
        Ok(match code {
            op::LONG1 | op::SHORT_BINUNICODE | op::SHORT_BINSTRING | op::SHORT_BINBYTES => self.array::<1>()?[0].into(),
            op::BINSTRING => u64::try_from(i32::from_le_bytes(self.array()?)).map_err(|_| self.err("negative string length"))?,
            op::BINUNICODE8 | op::BINBYTES8 | op::BYTEARRAY8 => u64::from_le_bytes(self.array()?),
            _ => u32::from_le_bytes(self.array()?).into(),
        })
    }

    /// The protocol header, framing, marks and stack shuffles; `false` for any other opcode.
    fn stack_op(&mut self, code: u8) -> Result<bool> {
        match code {
            op::PROTO => {
                let [v] = self.array::<1>()?;
                if v > 5 {
                    return Err(self.err(format!("pickle protocol {v} is newer than 5")));
                }
            }
            op::FRAME => {
                self.take(8)?;
            }
            op::MARK => {
                if self.marks.len() >= Bounds::MARKS {
                    return Err(self.limit("marks open at once", Bounds::MARKS));
                }
                self.marks.push(self.stack.len());
            }
            op::POP => {
                self.pop()?;
            }
            op::POP_MARK => {
                self.pop_mark()?;
            }
            op::DUP => {
                let v = self.top()?;
                self.push(v)?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Builds or fills a tuple, list, dict or set; `false` for any other opcode.
    fn container(&mut self, code: u8) -> Result<bool> {
        let obj = match code {
            op::EMPTY_TUPLE => Obj::Tuple(vec![]),
            op::EMPTY_LIST => Obj::List(vec![]),
            op::EMPTY_DICT => Obj::Dict(vec![]),
            op::EMPTY_SET => Obj::Set,
            op::TUPLE1 | op::TUPLE2 | op::TUPLE3 => {
                let n = usize::from(code - op::TUPLE1 + 1);
                let mut items = (0..n).map(|_| self.pop()).collect::<Result<Vec<_>>>()?;
                items.reverse();
                Obj::Tuple(items)
            }
            op::TUPLE => Obj::Tuple(self.pop_mark()?),
            op::LIST => Obj::List(self.pop_mark()?),
            op::DICT => {
                let items = self.pop_mark()?;
                Obj::Dict(self.pairs(items)?)
            }
            op::FROZENSET => {
                self.pop_mark()?;
                Obj::Set
            }
            op::APPEND | op::APPENDS => {
                let items = if code == op::APPEND { vec![self.pop()?] } else { self.pop_mark()? };
                let list = self.top()?;
                self.deepen(list, items.iter().copied())?;
                match self.arena_mut(list) {
                    Some(Obj::List(l)) => l.extend(items),
                    _ => return Err(self.err("APPEND to something not a list (corrupt pickle)")),
                }
                return Ok(true);
            }
            // Later keys win, as in Python; `state_dict` resolves duplicates.
            op::SETITEM | op::SETITEMS => {
                let items = if code == op::SETITEM {
                    let value = self.pop()?;
                    vec![self.pop()?, value]
                } else {
                    self.pop_mark()?
                };
                let pairs = self.pairs(items)?;
                let dict = self.top()?;
                self.deepen(dict, pairs.iter().flat_map(|&(k, v)| [k, v]))?;
                match self.arena_mut(dict) {
                    Some(Obj::Dict(d)) => d.extend(pairs),
                    _ => return Err(self.err("SETITEM on something not a dict (corrupt pickle)")),
                }
                return Ok(true);
            }
            op::ADDITEMS => {
                self.pop_mark()?;
                match self.obj(self.top()?) {
                    Some(Obj::Set) => return Ok(true),
                    _ => return Err(self.err("ADDITEMS to something not a set (corrupt pickle)")),
                }
            }
            _ => return Ok(false),
        };
        let v = self.alloc(obj)?;
        self.push(v)?;
        Ok(true)
    }

    /// Stores the top of the stack in the memo or pushes a stored value; `false` for any other opcode.
    fn memo(&mut self, code: u8) -> Result<bool> {
        let text_index = |u: &mut Self| -> Result<u64> {
            let line = u.line()?;
            line.parse().map_err(|_| u.err(format!("memo index `{line}` is not a number")))
        };
        match code {
            op::BINPUT | op::LONG_BINPUT | op::PUT | op::MEMOIZE => {
                let i = match code {
                    op::BINPUT => self.array::<1>()?[0].into(),
                    op::LONG_BINPUT => u32::from_le_bytes(self.array()?).into(),
                    op::PUT => text_index(self)?,
                    _ => self.memo.len() as u64,
                };
                let v = self.top()?;
                if self.memo.len() >= Bounds::MEMO && !self.memo.contains_key(&i) {
                    return Err(self.limit("memo entries", Bounds::MEMO));
                }
                self.memo.insert(i, v);
            }
            op::BINGET | op::LONG_BINGET | op::GET => {
                let i = match code {
                    op::BINGET => self.array::<1>()?[0].into(),
                    op::LONG_BINGET => u32::from_le_bytes(self.array()?).into(),
                    _ => text_index(self)?,
                };
                let v = *self.memo.get(&i).ok_or_else(|| self.err(format!("memo entry {i} was never stored (corrupt pickle)")))?;
                self.push(v)?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Globals, persistent ids, calls and BUILD; `false` for any other opcode.
    fn call(&mut self, code: u8, storages: &mut BTreeMap<String, StorageRef>) -> Result<bool> {
        let v = match code {
            op::GLOBAL => {
                let module = self.line()?;
                let name = self.line()?;
                self.global(module, name)?
            }
            op::STACK_GLOBAL => {
                let name = self.pop()?;
                let module = self.pop()?;
                let (Some(module), Some(name)) = (self.str_of(module), self.str_of(name)) else {
                    return Err(self.err("STACK_GLOBAL of something not a string (corrupt pickle)"));
                };
                let (module, name) = (module.to_string(), name.to_string());
                self.global(&module, &name)?
            }
            op::BINPERSID => {
                let pid = self.pop()?;
                self.persistent_load(pid, storages)?
            }
            op::REDUCE | op::NEWOBJ => {
                let args = self.pop()?;
                let callable = self.pop()?;
                self.reduce(callable, args)?
            }
            op::BUILD => {
                self.pop()?;
                return match self.obj(self.top()?) {
                    // OrderedDict's `_metadata` and a Parameter's state: nothing a weight needs.
                    Some(Obj::Dict(_) | Obj::Tensor(_)) => Ok(true),
                    _ => Err(self.err("BUILD on something not a dict or tensor (corrupt pickle)")),
                };
            }
            _ => return Ok(false),
        };
        self.push(v)?;
        Ok(true)
    }

    /// LONG1/LONG4's little-endian two's complement: an `Int` when it fits, else a `BigInt`.
    fn long(&mut self, b: &[u8]) -> Result<Value> {
        if b.len() <= 8 {
            let fill = if b.last().is_some_and(|&x| x & 0x80 != 0) { 0xff } else { 0 };
            let mut full = [fill; 8];
            full[..b.len()].copy_from_slice(b);
            Ok(Value::Int(i64::from_le_bytes(full)))
        } else {
            self.alloc(Obj::BigInt(b.to_vec()))
        }
    }

    fn pairs(&self, items: Vec<Value>) -> Result<Vec<(Value, Value)>> {
        if !items.len().is_multiple_of(2) {
            return Err(self.err("a dict's items are not key-value pairs (corrupt pickle)"));
        }
        Ok(items.chunks_exact(2).map(|p| (p[0], p[1])).collect())
    }

    pub(super) fn items(&self, v: Value) -> Option<&[Value]> {
        match self.obj(v) {
            Some(Obj::Tuple(t) | Obj::List(t)) => Some(t),
            _ => None,
        }
    }

    fn usize_of(&self, v: Value, what: &str) -> Result<usize> {
        match v {
            Value::Int(i) => usize::try_from(i).map_err(|_| self.err(format!("{what} is {i}, not a size"))),
            _ => Err(self.err(format!("{what} is not an integer"))),
        }
    }

    fn usizes(&self, v: Value, what: &str) -> Result<Vec<usize>> {
        let items = self.items(v).ok_or_else(|| self.err(format!("{what} is not a tuple")))?;
        items.iter().map(|&x| self.usize_of(x, what)).collect()
    }

    /// `("storage", storage_type, key, location, numel[, view_metadata])`.
    fn persistent_load(&mut self, pid: Value, storages: &mut BTreeMap<String, StorageRef>) -> Result<Value> {
        let items = self.items(pid).ok_or_else(|| self.err("a persistent id is not a tuple"))?.to_vec();
        match items.first().and_then(|&v| self.str_of(v)) {
            Some("storage") => {}
            Some("module") => {
                return Err(self.err("the checkpoint holds a whole nn.Module, not a state_dict: save `model.state_dict()` instead"))
            }
            _ => return Err(self.err("a persistent id is not a storage")),
        }
        let [_, ty, key, _location, numel, rest @ ..] = items.as_slice() else {
            return Err(self.err(format!("a storage's persistent id has {} fields, not 5 or 6", items.len())));
        };
        let elem = match self.obj(*ty) {
            Some(Obj::Global(Global::Storage(e))) => *e,
            _ => return Err(self.err("a storage's type is not a torch storage type")),
        };
        let key = self.str_of(*key).ok_or_else(|| self.err("a storage's key is not a string"))?.to_string();
        let numel = self.usize_of(*numel, "a storage's size")?;
        let view = match rest {
            [] | [Value::None] => None,
            [v] => match self.items(*v) {
                Some(&[_, offset, size]) => Some((self.usize_of(offset, "a view's offset")?, self.usize_of(size, "a view's size")?)),
                _ => return Err(self.err("a storage view is not (key, offset, size)")),
            },
            _ => return Err(self.err(format!("a storage's persistent id has {} fields, not 5 or 6", items.len()))),
        };
        let storage = StorageRef { elem, key: key.clone(), numel, view };
        let root = StorageRef { view: None, ..storage.clone() };
        match storages.get(&key) {
            Some(first) if first.elem != elem => {
                return Err(self.err(format!("storage `{key}` is named as {} and as {}", first.elem.name(), elem.name())))
            }
            // Every mention of a root storage gives its whole size; keep the largest if they differ.
            Some(first) if first.numel >= numel => {}
            _ => {
                storages.insert(key, root);
            }
        }
        self.alloc(Obj::Storage(Box::new(storage)))
    }

    fn reduce(&mut self, callable: Value, args: Value) -> Result<Value> {
        let global = match self.obj(callable) {
            Some(Obj::Global(g)) => *g,
            _ => return Err(self.err("calls something that is not an allowed global (corrupt pickle)")),
        };
        let args = self.items(args).ok_or_else(|| self.err("a call's arguments are not a tuple"))?.to_vec();
        match global {
            Global::OrderedDict => {
                let pairs = match args.as_slice() {
                    [] => vec![],
                    [items] => {
                        let items = self.items(*items).ok_or_else(|| self.err("OrderedDict's argument is not a list"))?;
                        let mut pairs = Vec::with_capacity(items.len());
                        for &item in items {
                            match self.items(item) {
                                Some(&[k, v]) => pairs.push((k, v)),
                                _ => return Err(self.err("OrderedDict's items are not pairs")),
                            }
                        }
                        pairs
                    }
                    _ => return Err(self.err("OrderedDict takes at most one argument")),
                };
                self.alloc(Obj::Dict(pairs))
            }
            Global::RebuildTensor | Global::RebuildTensorV2 => {
                let [storage, offset, size, stride, ..] = args.as_slice() else {
                    return Err(self.err("_rebuild_tensor has fewer than 4 arguments"));
                };
                let storage = match self.obj(*storage) {
                    Some(Obj::Storage(s)) => (**s).clone(),
                    _ => return Err(self.err("_rebuild_tensor's first argument is not a storage")),
                };
                let offset = self.usize_of(*offset, "a tensor's storage offset")?;
                let shape = self.usizes(*size, "a tensor's size")?;
                let stride = self.usizes(*stride, "a tensor's stride")?;
                if shape.len() != stride.len() {
                    return Err(self.err(format!("a tensor's size {shape:?} and stride {stride:?} differ in length")));
                }
                self.alloc(Obj::Tensor(Box::new(TensorRef { storage, offset, shape, stride })))
            }
            Global::RebuildParameter | Global::RebuildParameterWithState => match args.first() {
                Some(&data) if matches!(self.obj(data), Some(Obj::Tensor(_))) => Ok(data),
                _ => Err(self.err("_rebuild_parameter's first argument is not a tensor")),
            },
            Global::Storage(e) => Err(self.err(format!("calls the storage type of {} directly", e.name()))),
        }
    }
}
