//! PyTorch checkpoints (`torch.save`, `.pth`/`.pt`), read without running any of their code.
//!
//! Two containers:
//! - the zip archive (PyTorch ≥ 1.6): `<root>/data.pkl` is the pickled object, each storage is the
//!   raw little-endian bytes of `<root>/data/<key>`;
//! - the legacy stream: five pickles one after another (the magic number, the protocol version,
//!   `sys_info`, the object itself, the list of storage keys), then each storage as an 8-byte
//!   element count and its raw bytes, in the order of that list.
//!
//! In both, a tensor is `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`
//! over a storage named by a persistent id `("storage", torch.FloatStorage, key, location,
//! numel[, view])`. The unpickler here knows only the globals such a state_dict needs (the
//! rebuild functions, the storage types, `collections.OrderedDict`); any other global is an
//! `Error::CheckpointGlobal` naming it, raised as soon as the pickle names it. Sizes from the file
//! are checked before anything is allocated, and every read is bounds-checked.

use crate::graph::{numel, HostTensor};
use crate::var_builder::MAX_TENSOR_ELEMENTS;
use crate::{Error, Result};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Read;
use std::path::Path;

/// The tensors of a checkpoint's state_dict, by key.
#[derive(Clone, Debug, Default)]
pub struct Checkpoint {
    /// f32, f16 and bf16 tensors, as f32.
    pub tensors: BTreeMap<String, HostTensor>,
    /// Tensors of other dtypes (`num_batches_tracked` is int64), with their dtype's name (`I64`).
    pub other: BTreeMap<String, String>,
}

/// Whether `bytes` start like `torch.save` output: a zip archive or a pickle (protocol ≥ 2).
pub fn looks_like_checkpoint(bytes: &[u8]) -> bool {
    bytes.starts_with(b"PK\x03\x04") || bytes.first() == Some(&0x80)
}

/// Reads the state_dict of the checkpoint at `path`: a bare state_dict, or a dict holding one
/// under `state_dict`, `model` or `model_state_dict`.
pub fn read_pth(path: impl AsRef<Path>) -> Result<Checkpoint> {
    let path = path.as_ref();
    let bytes =
        crate::host::read_regular(path, "the path of a PyTorch checkpoint", |reason| Error::Checkpoint { path: path.into(), reason })?;
    decode_pth(path, &bytes)
}

/// `read_pth` on a checkpoint already in memory; `path` names it in errors.
pub fn decode_pth(path: &Path, bytes: &[u8]) -> Result<Checkpoint> {
    if bytes.starts_with(b"PK\x03\x04") {
        decode_zip(path, bytes)
    } else {
        decode_legacy(path, bytes)
    }
}

fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::Checkpoint { path: path.to_path_buf(), reason: reason.into() }
}

// ---- storages and tensors ------------------------------------------------------------------

/// A storage type's element: `torch.FloatStorage` holds F32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Elem {
    F32,
    F16,
    BF16,
    F64,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl Elem {
    fn of_storage(name: &str) -> Option<Elem> {
        Some(match name {
            "FloatStorage" => Elem::F32,
            "HalfStorage" => Elem::F16,
            "BFloat16Storage" => Elem::BF16,
            "DoubleStorage" => Elem::F64,
            "LongStorage" => Elem::I64,
            "IntStorage" => Elem::I32,
            "ShortStorage" => Elem::I16,
            "CharStorage" => Elem::I8,
            "ByteStorage" => Elem::U8,
            "BoolStorage" => Elem::Bool,
            _ => return None,
        })
    }
    /// The dtypes Kiln decodes (as f32).
    fn is_float(self) -> bool {
        matches!(self, Elem::F32 | Elem::F16 | Elem::BF16)
    }
    fn size(self) -> usize {
        match self {
            Elem::F64 | Elem::I64 => 8,
            Elem::F32 | Elem::I32 => 4,
            Elem::F16 | Elem::BF16 | Elem::I16 => 2,
            Elem::I8 | Elem::U8 | Elem::Bool => 1,
        }
    }
    /// The safetensors name of the dtype, as `VarBuilder` reports dtypes.
    fn name(self) -> &'static str {
        match self {
            Elem::F32 => "F32",
            Elem::F16 => "F16",
            Elem::BF16 => "BF16",
            Elem::F64 => "F64",
            Elem::I64 => "I64",
            Elem::I32 => "I32",
            Elem::I16 => "I16",
            Elem::I8 => "I8",
            Elem::U8 => "U8",
            Elem::Bool => "BOOL",
        }
    }
}

/// A persistent id's storage: `numel` elements of `elem` under `key`, or a view of `size`
/// elements from `offset` into it (legacy files only).
#[derive(Clone, Debug, PartialEq)]
struct StorageRef {
    elem: Elem,
    key: String,
    numel: usize,
    view: Option<(usize, usize)>,
}

#[derive(Clone, Debug)]
struct TensorRef {
    storage: StorageRef,
    offset: usize,
    shape: Vec<usize>,
    stride: Vec<usize>,
}

// ---- the unpickler -------------------------------------------------------------------------

/// A value on the stack; containers and strings live in the arena, so a value is a small copy
/// and dropping the deepest nesting recurses nowhere.
#[derive(Clone, Copy, Debug)]
enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// A float (no weight's value; only its place on the stack matters).
    Float,
    Obj(usize),
}

#[derive(Debug)]
enum Obj {
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
    Storage(StorageRef),
    Tensor(TensorRef),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Global {
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

/// One pickle's machine: a stack, the marks, the memo and the arena.
struct Unpickler<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: HashMap<u64, Value>,
    arena: Vec<Obj>,
}

impl<'a> Unpickler<'a> {
    fn new(path: &'a Path, bytes: &'a [u8], pos: usize) -> Self {
        Self { path, bytes, pos, stack: Vec::new(), marks: Vec::new(), memo: HashMap::new(), arena: Vec::new() }
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

    fn alloc(&mut self, obj: Obj) -> Value {
        self.arena.push(obj);
        Value::Obj(self.arena.len() - 1)
    }

    fn arena_mut(&mut self, v: Value) -> Option<&mut Obj> {
        match v {
            Value::Obj(i) => self.arena.get_mut(i),
            _ => None,
        }
    }

    fn obj(&self, v: Value) -> Option<&Obj> {
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
        Ok(self.alloc(Obj::Str(s)))
    }

    fn str_of(&self, v: Value) -> Option<&str> {
        match self.obj(v) {
            Some(Obj::Str(s)) => Some(s),
            _ => None,
        }
    }

    fn global(&mut self, module: &str, name: &str) -> Result<Value> {
        match allowed_global(module, name) {
            Some(g) => Ok(self.alloc(Obj::Global(g))),
            None => Err(Error::CheckpointGlobal { path: self.path.to_path_buf(), global: format!("{module}.{name}") }),
        }
    }

    /// Runs to `STOP` and returns the value; `self.pos` is then just after it. Storages named by
    /// persistent ids are recorded in `storages`.
    fn run(&mut self, storages: &mut BTreeMap<String, StorageRef>) -> Result<Value> {
        loop {
            let [code] = self.array::<1>()?;
            if code == op::STOP {
                return self.pop();
            }
            if let Some(v) = self.scalar(code)? {
                self.stack.push(v);
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
                self.long(b)
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
                self.alloc(Obj::Bytes)
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
            op::MARK => self.marks.push(self.stack.len()),
            op::POP => {
                self.pop()?;
            }
            op::POP_MARK => {
                self.pop_mark()?;
            }
            op::DUP => {
                let v = self.top()?;
                self.stack.push(v);
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
        let v = self.alloc(obj);
        self.stack.push(v);
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
                self.memo.insert(i, v);
            }
            op::BINGET | op::LONG_BINGET | op::GET => {
                let i = match code {
                    op::BINGET => self.array::<1>()?[0].into(),
                    op::LONG_BINGET => u32::from_le_bytes(self.array()?).into(),
                    _ => text_index(self)?,
                };
                let v = *self.memo.get(&i).ok_or_else(|| self.err(format!("memo entry {i} was never stored (corrupt pickle)")))?;
                self.stack.push(v);
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
        self.stack.push(v);
        Ok(true)
    }

    /// LONG1/LONG4's little-endian two's complement: an `Int` when it fits, else a `BigInt`.
    fn long(&mut self, b: &[u8]) -> Value {
        if b.len() <= 8 {
            let fill = if b.last().is_some_and(|&x| x & 0x80 != 0) { 0xff } else { 0 };
            let mut full = [fill; 8];
            full[..b.len()].copy_from_slice(b);
            Value::Int(i64::from_le_bytes(full))
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

    fn items(&self, v: Value) -> Option<&[Value]> {
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
        Ok(self.alloc(Obj::Storage(storage)))
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
                Ok(self.alloc(Obj::Dict(pairs)))
            }
            Global::RebuildTensor | Global::RebuildTensorV2 => {
                let [storage, offset, size, stride, ..] = args.as_slice() else {
                    return Err(self.err("_rebuild_tensor has fewer than 4 arguments"));
                };
                let storage = match self.obj(*storage) {
                    Some(Obj::Storage(s)) => s.clone(),
                    _ => return Err(self.err("_rebuild_tensor's first argument is not a storage")),
                };
                let offset = self.usize_of(*offset, "a tensor's storage offset")?;
                let shape = self.usizes(*size, "a tensor's size")?;
                let stride = self.usizes(*stride, "a tensor's stride")?;
                if shape.len() != stride.len() {
                    return Err(self.err(format!("a tensor's size {shape:?} and stride {stride:?} differ in length")));
                }
                Ok(self.alloc(Obj::Tensor(TensorRef { storage, offset, shape, stride })))
            }
            Global::RebuildParameter | Global::RebuildParameterWithState => match args.first() {
                Some(&data) if matches!(self.obj(data), Some(Obj::Tensor(_))) => Ok(data),
                _ => Err(self.err("_rebuild_parameter's first argument is not a tensor")),
            },
            Global::Storage(e) => Err(self.err(format!("calls the storage type of {} directly", e.name()))),
        }
    }
}

// ---- the state_dict ------------------------------------------------------------------------

/// The keys under which training scripts nest a state_dict, in the order they are tried.
const NESTED: [&str; 3] = ["state_dict", "model", "model_state_dict"];

/// The tensors of `root`'s state_dict by key (later duplicates win, as Python's dict does).
fn state_dict(u: &Unpickler, root: Value) -> Result<BTreeMap<String, TensorRef>> {
    let as_tensors = |v: Value| -> Option<BTreeMap<String, TensorRef>> {
        let Some(Obj::Dict(pairs)) = u.obj(v) else { return None };
        let mut out = BTreeMap::new();
        for &(k, v) in pairs {
            match (u.str_of(k), u.obj(v)) {
                (Some(k), Some(Obj::Tensor(t))) => out.insert(k.to_string(), t.clone()),
                _ => return None,
            };
        }
        Some(out)
    };
    let Some(Obj::Dict(pairs)) = u.obj(root) else {
        return Err(bad(u.path, "the checkpoint is not a dict, so it holds no state_dict"));
    };
    for name in NESTED {
        if let Some(&(_, v)) = pairs.iter().rev().find(|(k, _)| u.str_of(*k) == Some(name)) {
            if let Some(sd) = as_tensors(v) {
                return Ok(sd);
            }
        }
    }
    as_tensors(root).ok_or_else(|| {
        let keys: Vec<String> =
            pairs.iter().take(12).map(|(k, _)| u.str_of(*k).map_or("(not a string)".into(), |s| format!("`{s}`"))).collect();
        bad(
            u.path,
            format!(
                "no state_dict found: the checkpoint is a dict that is neither string keys to tensors nor holds one under {}; its keys: {}",
                NESTED.map(|k| format!("`{k}`")).join(", "),
                keys.join(", ")
            ),
        )
    })
}

/// Materialises every tensor from its storage's bytes (`storage(key)` gives a root storage's
/// bytes, already checked to hold its `numel` elements). A file of `file_len` bytes decodes to at
/// most `DECODED_PER_BYTE` times as many bytes of f32: f16 doubles, and a storage shared by a
/// few keys is decoded once per key; a small file naming one storage a million times is refused.
fn materialise<'b>(
    path: &Path,
    file_len: usize,
    tensors: BTreeMap<String, TensorRef>,
    mut storage: impl FnMut(&StorageRef) -> Result<&'b [u8]>,
) -> Result<Checkpoint> {
    let mut out = Checkpoint::default();
    let budget = file_len.saturating_mul(DECODED_PER_BYTE).saturating_add(1 << 20);
    let mut decoded = 0usize;
    for (key, t) in tensors {
        let elem = t.storage.elem;
        if !elem.is_float() {
            out.other.insert(key, elem.name().to_string());
            continue;
        }
        let root = storage(&t.storage)?;
        let (start, len) = t.storage.view.unwrap_or((0, t.storage.numel));
        let view = start
            .checked_add(len)
            .and_then(|end| root.get(start.checked_mul(elem.size())?..end.checked_mul(elem.size())?))
            .ok_or_else(|| bad(path, format!("tensor `{key}`: its storage view {start}+{len} is outside its storage")))?;
        let bytes = gather(path, &key, &t, view, elem.size())?;
        decoded = decoded.saturating_add(bytes.len() / elem.size() * 4);
        if decoded > budget {
            return Err(Error::TooLarge {
                what: format!("checkpoint {}", path.display()),
                reason: format!(
                    "its tensors decode to more than {DECODED_PER_BYTE} times its {file_len} bytes (storages named over and over)"
                ),
            });
        }
        let data = crate::var_builder::decode(elem.name(), &bytes, &key, path)?.unwrap_or_default();
        out.tensors.insert(key, HostTensor::try_new(t.shape, data)?);
    }
    Ok(out)
}

/// How many bytes of f32 one byte of a checkpoint may decode to (see `materialise`).
const DECODED_PER_BYTE: usize = 8;

/// The bytes of `t`'s elements in row-major order, read through its offset and strides from
/// `storage`; every index is checked against the storage first. A tensor may not hold more
/// elements than its storage (a broadcast view, stride 0, would let a few bytes claim gigabytes).
fn gather(path: &Path, key: &str, t: &TensorRef, storage: &[u8], size: usize) -> Result<Vec<u8>> {
    let n = numel(&t.shape).filter(|&n| n <= MAX_TENSOR_ELEMENTS).ok_or_else(|| Error::TooLarge {
        what: format!("tensor `{key}` in {}", path.display()),
        reason: format!("shape {:?} has more than {MAX_TENSOR_ELEMENTS} elements", t.shape),
    })?;
    let have = storage.len() / size;
    if n > have {
        return Err(bad(
            path,
            format!("tensor `{key}` has {n} elements but its storage only {have} (an expanded view: save it with .contiguous())"),
        ));
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    {
        let last = t.shape.iter().zip(&t.stride).try_fold(t.offset, |at, (&d, &s)| (d - 1).checked_mul(s)?.checked_add(at));
        if last.is_none_or(|l| l >= have) {
            return Err(bad(
                path,
                format!(
                    "tensor `{key}`: size {:?}, stride {:?} and offset {} reach past its storage of {have} elements",
                    t.shape, t.stride, t.offset
                ),
            ));
        }
    }
    let mut out = Vec::new();
    out.try_reserve_exact(n * size)
        .map_err(|_| Error::OutOfMemory { what: format!("tensor `{key}` of {}", path.display()), bytes: n * size })?;
    let contiguous = {
        let mut expect = 1;
        t.shape.iter().zip(&t.stride).rev().all(|(&d, &s)| {
            let ok = d == 1 || s == expect;
            expect *= d;
            ok
        })
    };
    if contiguous {
        // Checked above: offset + n - 1 < have.
        out.extend_from_slice(&storage[t.offset * size..(t.offset + n) * size]);
        return Ok(out);
    }
    let mut index = vec![0usize; t.shape.len()];
    for _ in 0..n {
        let at = t.offset + index.iter().zip(&t.stride).map(|(i, s)| i * s).sum::<usize>();
        out.extend_from_slice(&storage[at * size..(at + 1) * size]);
        for d in (0..index.len()).rev() {
            index[d] += 1;
            if index[d] < t.shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    Ok(out)
}

/// The bytes `s`'s root storage needs: `numel` elements.
fn storage_bytes(path: &Path, s: &StorageRef) -> Result<usize> {
    s.numel.checked_mul(s.elem.size()).ok_or_else(|| bad(path, format!("storage `{}` of {} elements is too large", s.key, s.numel)))
}

// ---- the zip archive -------------------------------------------------------------------------

type Archive<'a> = zip::ZipArchive<std::io::Cursor<&'a [u8]>>;

fn decode_zip(path: &Path, bytes: &[u8]) -> Result<Checkpoint> {
    let zip_err = |e: zip::result::ZipError| bad(path, format!("not a readable zip archive: {e}"));
    let mut archive = zip::ZipArchive::new(std::io::Cursor::new(bytes)).map_err(zip_err)?;
    let pkl = archive
        .file_names()
        .filter_map(|n| n.ok())
        .filter(|n| n.ends_with("/data.pkl") || n == "data.pkl")
        .min_by_key(|n| n.len())
        .ok_or_else(|| bad(path, "the zip archive has no data.pkl (not a torch.save checkpoint)"))?
        .to_string();
    let root = pkl.strip_suffix("data.pkl").unwrap_or("").to_string();
    if archive.index_for_name(&format!("{root}byteorder")).is_some() {
        let order = read_entry(path, &mut archive, bytes.len(), &format!("{root}byteorder"), None)?;
        if order != b"little" {
            return Err(bad(path, "the checkpoint was saved big-endian; Kiln reads little-endian checkpoints"));
        }
    }
    let pickle = read_entry(path, &mut archive, bytes.len(), &pkl, None)?;
    let mut storages = BTreeMap::new();
    let mut u = Unpickler::new(path, &pickle, 0);
    let value = u.run(&mut storages)?;
    let tensors = state_dict(&u, value)?;
    // Only the storages of tensors Kiln decodes are read.
    let wanted: BTreeSet<&str> = tensors.values().filter(|t| t.storage.elem.is_float()).map(|t| t.storage.key.as_str()).collect();
    let mut loaded: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for (key, s) in &storages {
        if !wanted.contains(key.as_str()) {
            continue;
        }
        let need = storage_bytes(path, s)?;
        let data = read_entry(path, &mut archive, bytes.len(), &format!("{root}data/{key}"), Some(need))?;
        loaded.insert(key.clone(), data);
    }
    materialise(path, bytes.len(), tensors, |s| {
        loaded.get(&s.key).map(Vec::as_slice).ok_or_else(|| bad(path, format!("storage `{}` was not read", s.key)))
    })
}

/// The bytes of entry `name`: its first `need` bytes when given (the entry must hold them), else
/// all of it. Entries must be stored uncompressed, as torch.save writes them, so a size is
/// checked against the archive's own bytes before anything is allocated.
fn read_entry(path: &Path, archive: &mut Archive, archive_len: usize, name: &str, need: Option<usize>) -> Result<Vec<u8>> {
    let mut file = archive.by_name(name).map_err(|e| bad(path, format!("entry `{name}`: {e}")))?;
    let size = file.size();
    if file.compression() != zip::CompressionMethod::Stored {
        return Err(bad(path, format!("entry `{name}` is compressed ({}); torch.save stores entries uncompressed", file.compression())));
    }
    if size > file.compressed_size() || size > archive_len as u64 {
        return Err(bad(path, format!("entry `{name}` claims {size} bytes but stores {} (corrupt archive)", file.compressed_size())));
    }
    let want = match need {
        Some(n) if (n as u64) > size => {
            return Err(bad(path, format!("entry `{name}` holds {size} bytes, but its storage needs {n} (truncated or corrupt)")))
        }
        Some(n) => n,
        None => usize::try_from(size).map_err(|_| bad(path, format!("entry `{name}` is too large")))?,
    };
    let mut out = Vec::new();
    out.try_reserve_exact(want).map_err(|_| Error::OutOfMemory { what: format!("entry `{name}` of {}", path.display()), bytes: want })?;
    (&mut file).take(want as u64).read_to_end(&mut out).map_err(|e| bad(path, format!("entry `{name}`: {e}")))?;
    if out.len() != want {
        return Err(bad(path, format!("entry `{name}` ends after {} of {want} bytes (truncated or corrupt)", out.len())));
    }
    Ok(out)
}

// ---- the legacy stream ---------------------------------------------------------------------

/// `torch.serialization`'s `MAGIC_NUMBER`, 0x1950a86a20f9469cfc6c, as little-endian bytes.
const MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];
const PROTOCOL_VERSION: i64 = 1001;

fn decode_legacy(path: &Path, bytes: &[u8]) -> Result<Checkpoint> {
    let mut storages = BTreeMap::new();
    // 1. The magic number.
    let mut u = Unpickler::new(path, bytes, 0);
    let magic = u.run(&mut storages)?;
    if !matches!(u.obj(magic), Some(Obj::BigInt(b)) if b[..] == MAGIC[..]) {
        return Err(bad(path, "not a PyTorch checkpoint: the first pickle is not torch.save's magic number"));
    }
    // 2. The protocol version.
    let mut u = Unpickler::new(path, bytes, u.pos);
    match u.run(&mut storages)? {
        Value::Int(PROTOCOL_VERSION) => {}
        Value::Int(v) => return Err(bad(path, format!("legacy serialisation protocol {v}, not {PROTOCOL_VERSION}"))),
        _ => return Err(bad(path, "the protocol version is not an integer")),
    }
    // 3. sys_info: the byte order is all that matters here.
    let mut u = Unpickler::new(path, bytes, u.pos);
    let info = u.run(&mut storages)?;
    if let Some(Obj::Dict(pairs)) = u.obj(info) {
        if pairs.iter().any(|&(k, v)| u.str_of(k) == Some("little_endian") && matches!(v, Value::Bool(false))) {
            return Err(bad(path, "the checkpoint was saved big-endian; Kiln reads little-endian checkpoints"));
        }
    }
    // 4. The object.
    let mut main = Unpickler::new(path, bytes, u.pos);
    let value = main.run(&mut storages)?;
    let tensors = state_dict(&main, value)?;
    // 5. The storage keys, then each storage: an i64 element count and the raw bytes.
    let mut u = Unpickler::new(path, bytes, main.pos);
    let keys = u.run(&mut BTreeMap::new())?;
    let keys: Vec<String> = u
        .items(keys)
        .ok_or_else(|| bad(path, "the storage keys are not a list"))?
        .iter()
        .map(|&k| u.str_of(k).map(str::to_string).ok_or_else(|| bad(path, "a storage key is not a string")))
        .collect::<Result<_>>()?;
    let mut at = u.pos;
    let mut ranges: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for key in keys {
        let s = storages.get(&key).ok_or_else(|| bad(path, format!("storage `{key}` is listed but no tensor uses it")))?;
        let count =
            bytes.get(at..at.saturating_add(8)).ok_or_else(|| bad(path, format!("storage `{key}`'s size is past the end (truncated)")))?;
        let count = u64::from_le_bytes(count.try_into().map_err(|_| bad(path, "8 bytes"))?);
        let count = usize::try_from(count).map_err(|_| bad(path, format!("storage `{key}` claims {count} elements")))?;
        if count < s.numel {
            return Err(bad(path, format!("storage `{key}` holds {count} elements, but its tensors need {}", s.numel)));
        }
        let len = count.checked_mul(s.elem.size()).ok_or_else(|| bad(path, format!("storage `{key}` claims {count} elements")))?;
        let start = at + 8;
        let end = start.checked_add(len).filter(|&e| e <= bytes.len()).ok_or_else(|| {
            bad(path, format!("storage `{key}` needs {len} bytes from byte {start}, past the end of the file (truncated)"))
        })?;
        ranges.insert(key, (start, end));
        at = end;
    }
    materialise(path, bytes.len(), tensors, |s| {
        let &(start, end) = ranges.get(&s.key).ok_or_else(|| bad(path, format!("storage `{}` is not in the file", s.key)))?;
        Ok(&bytes[start..end])
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::VarBuilder;
    use std::path::PathBuf;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pth").join(name)
    }

    fn expected() -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(fixture("expected.json")).expect("expected.json")).expect("json")
    }

    /// Every fixture holds exactly the tensors `tools/make_pth_fixtures.py` saved, bit for bit.
    #[test]
    fn fixtures_match_torch() {
        let expected = expected();
        for (file, tensors) in expected.as_object().expect("object") {
            let c = read_pth(fixture(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
            for (key, want) in tensors.as_object().expect("object") {
                let shape: Vec<usize> = serde_json::from_value(want["shape"].clone()).expect("shape");
                let values: Vec<f32> = serde_json::from_value(want["values"].clone()).expect("values");
                match want["dtype"].as_str().expect("dtype") {
                    "int64" => assert_eq!(c.other.get(key).map(String::as_str), Some("I64"), "{file}: {key}"),
                    _ => {
                        let t = c.tensors.get(key).unwrap_or_else(|| panic!("{file}: {key} missing"));
                        assert_eq!(t.shape, shape, "{file}: {key}");
                        assert_eq!(t.data, values, "{file}: {key}");
                    }
                }
            }
            assert_eq!(c.tensors.len() + c.other.len(), tensors.as_object().expect("object").len(), "{file}");
        }
    }

    #[test]
    fn both_formats_load_into_a_var_builder_strictly() {
        for file in ["tiny.zip.pth", "tiny.legacy.pth", "model.proto4.pth"] {
            let vb = VarBuilder::from_files(&[fixture(file)]).expect(file);
            vb.get(&[4, 3, 3, 3], "conv.weight").expect("conv.weight");
            vb.pp("conv").get(&[4], "bias").expect("conv.bias");
            for name in ["weight", "bias", "running_mean", "running_var"] {
                vb.pp("bn").get(&[4], name).expect(name);
            }
            vb.pp("fc").get(&[2, 4], "weight").expect("fc.weight");
            assert!(vb.check_all_used().is_err(), "{file}: fc.bias is unused");
            vb.pp("fc").get(&[2], "bias").expect("fc.bias");
            vb.check_all_used().expect("only num_batches_tracked is left, which is bookkeeping");
            // An int64 tensor is named with its dtype, not called missing.
            let e = vb.pp("bn").get(&[], "num_batches_tracked").expect_err("int64");
            assert!(matches!(e, Error::WeightDtype { ref got, .. } if got == "I64"), "{e}");
            let e = vb.get(&[4, 3, 3, 3], "missing.weight").expect_err("missing");
            assert!(e.to_string().contains(file), "the error names the file: {e}");
        }
    }

    #[test]
    fn a_foreign_global_is_refused_by_name() {
        let e = read_pth(fixture("args.zip.pth")).expect_err("argparse.Namespace");
        assert!(matches!(e, Error::CheckpointGlobal { ref global, .. } if global == "argparse.Namespace"), "{e}");
        // Hand-made pickles: GLOBAL and STACK_GLOBAL of something that runs code.
        let global = b"\x80\x02cos\nsystem\n(X\x02\x00\x00\x00lst.";
        let e = decode_zipless(global).expect_err("os.system");
        assert!(matches!(e, Error::CheckpointGlobal { ref global, .. } if global == "os.system"), "{e}");
        let stack = b"\x80\x04\x8c\x08builtins\x8c\x04eval\x93.";
        let e = decode_zipless(stack).expect_err("builtins.eval");
        assert!(matches!(e, Error::CheckpointGlobal { ref global, .. } if global == "builtins.eval"), "{e}");
    }

    /// A legacy stream whose object pickle is `object` (the real first three pickles before it).
    fn decode_zipless(object: &[u8]) -> Result<Checkpoint> {
        let legacy = std::fs::read(fixture("tiny.legacy.pth")).expect("fixture");
        let mut u = Unpickler::new(Path::new("x"), &legacy, 0);
        for _ in 0..3 {
            u.run(&mut BTreeMap::new()).expect("header pickles");
            u = Unpickler::new(Path::new("x"), &legacy, u.pos);
        }
        let mut bytes = legacy[..u.pos].to_vec();
        bytes.extend_from_slice(object);
        decode_pth(Path::new("hand-made.pth"), &bytes)
    }

    #[test]
    fn every_truncation_is_an_error() {
        for file in ["tiny.legacy.pth", "mixed.legacy.pt", "tiny.zip.pth"] {
            let bytes = std::fs::read(fixture(file)).expect(file);
            decode_pth(Path::new(file), &bytes).expect(file);
            for n in 0..bytes.len() {
                assert!(decode_pth(Path::new(file), &bytes[..n]).is_err(), "{file} cut to {n} bytes");
            }
        }
    }

    #[test]
    fn a_tensor_past_its_storage_is_an_error() {
        // {"w": _rebuild_tensor_v2(storage(FloatStorage, "0", 2 elements), 1, (2,), (1,), False, OrderedDict())}
        let object = b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02NtQK\x01K\x02\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtRs.";
        let mut tail = b"\x80\x02]X\x01\x00\x00\x000a.".to_vec();
        tail.extend(2u64.to_le_bytes());
        tail.extend([1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()));
        let mut good = object.to_vec();
        good.extend(&tail);
        let e = decode_zipless(&good).expect_err("offset 1 + 2 elements > 2");
        assert!(e.to_string().contains("reach past its storage"), "{e}");
        // The same tensor at offset 0 reads.
        let mut fixed = good.clone();
        let at = fixed.windows(4).position(|w| w == b"QK\x01K").expect("offset") + 2;
        fixed[at] = 0;
        let c = decode_zipless(&fixed).expect("in range");
        assert_eq!(c.tensors["w"].data, [1.0, 2.0]);
    }
}
