//! Tensors in host memory and the element types of graph values: what weights, the CPU executor,
//! references and a run's inputs are made of. A leaf: it imports nothing of Kiln but errors.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

/// A dense row-major f32 tensor in host memory: weights, CPU executor values, references.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl HostTensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "HostTensor: shape {shape:?} does not match {} values", data.len());
        Self { shape, data }
    }
    /// `new` for sizes that come from a file or a flag: an overflowing element count or a length
    /// that does not match the shape is an error, not a panic.
    pub fn try_new(shape: Vec<usize>, data: Vec<f32>) -> Result<Self> {
        match numel(&shape) {
            Some(n) if n == data.len() => Ok(Self { shape, data }),
            n => Err(Error::TensorSize { expected: n.map_or("more than usize::MAX".into(), |n| n.to_string()), got: data.len(), shape }),
        }
    }
    pub fn zeros(shape: Vec<usize>) -> Self {
        let n = shape.iter().product();
        Self { shape, data: vec![0.0; n] }
    }
    pub fn numel(&self) -> usize {
        self.data.len()
    }
}

/// A dense row-major tensor of bytes in host memory: the data of an input declared `DType::U8`
/// (a decoded `uint8` image), handed to an engine as it is, one byte per element.
#[derive(Clone, Debug, PartialEq)]
pub struct ByteTensor {
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl ByteTensor {
    /// A byte tensor; an overflowing element count or a length that does not match the shape is
    /// an error (sizes often come from a file or a decoder).
    pub fn new(shape: Vec<usize>, data: Vec<u8>) -> Result<Self> {
        match numel(&shape) {
            Some(n) if n == data.len() => Ok(Self { shape, data }),
            n => Err(Error::TensorSize { expected: n.map_or("more than usize::MAX".into(), |n| n.to_string()), got: data.len(), shape }),
        }
    }
    pub fn numel(&self) -> usize {
        self.data.len()
    }
    /// The same values as f32 (exact: every byte is an f32 integer).
    pub fn to_f32(&self) -> HostTensor {
        HostTensor { shape: self.shape.clone(), data: self.data.iter().map(|&b| f32::from(b)).collect() }
    }
}

/// One input as `cpu::run` and `ExecutionContext::run` take it: f32 values, or bytes for an input
/// declared `DType::U8`. Both convert from a reference (`&HostTensor`, `&ByteTensor`), so a list
/// of f32 inputs is written as before: `&[("input", &x)]`; a mixed list names the variants.
#[derive(Clone, Copy, Debug)]
pub enum HostInput<'a> {
    F32(&'a HostTensor),
    U8(&'a ByteTensor),
}

impl<'a> From<&'a HostTensor> for HostInput<'a> {
    fn from(t: &'a HostTensor) -> Self {
        HostInput::F32(t)
    }
}

impl<'a> From<&'a ByteTensor> for HostInput<'a> {
    fn from(t: &'a ByteTensor) -> Self {
        HostInput::U8(t)
    }
}

impl<'a> HostInput<'a> {
    pub fn shape(&self) -> &'a [usize] {
        match self {
            HostInput::F32(t) => &t.shape,
            HostInput::U8(t) => &t.shape,
        }
    }

    /// Elements held, which must equal the shape's element count (the fields are public).
    fn len(&self) -> usize {
        match self {
            HostInput::F32(t) => t.data.len(),
            HostInput::U8(t) => t.data.len(),
        }
    }

    /// Checks that the data holds exactly the shape's elements: a tensor built field by field may
    /// not, and an engine copies `data` to a buffer sized from the shape.
    pub fn check_len(&self, name: &str) -> Result<()> {
        match numel(self.shape()) {
            Some(n) if n == self.len() => Ok(()),
            _ => Err(Error::Binding {
                name: name.to_string(),
                reason: format!("shape {:?} does not match its {} values", self.shape(), self.len()),
            }),
        }
    }

    /// The values the CPU executor computes with for the input `name` declared `dtype`: an f32
    /// tensor as it is (for a u8 input, once its values are checked to be bytes), bytes as f32.
    /// Bytes for an f32 input are an error: the declared type is the binding's contract.
    pub fn to_f32(self, name: &str, dtype: DType) -> Result<Cow<'a, HostTensor>> {
        self.check_len(name)?;
        match (self, dtype) {
            (_, DType::F16) => Err(unsupported_input(name, dtype)),
            (HostInput::F32(t), DType::U8) => check_bytes(name, t).map(|()| Cow::Borrowed(t)),
            (HostInput::F32(t), DType::F32) => Ok(Cow::Borrowed(t)),
            (HostInput::U8(t), DType::U8) => Ok(Cow::Owned(t.to_f32())),
            (HostInput::U8(_), DType::F32) => Err(Error::Binding {
                name: name.to_string(),
                reason: "bytes were given, but the input is declared f32; give f32 values (a HostTensor), or declare it u8 when tracing (`Tracer::input_typed`)".into(),
            }),
        }
    }

    /// The bytes an engine uploads for the input `name` declared u8: bytes as they are, f32 values
    /// converted once checked to be bytes.
    pub fn to_u8(self, name: &str) -> Result<Cow<'a, ByteTensor>> {
        self.check_len(name)?;
        match self {
            HostInput::U8(t) => Ok(Cow::Borrowed(t)),
            HostInput::F32(t) => {
                check_bytes(name, t)?;
                Ok(Cow::Owned(ByteTensor { shape: t.shape.clone(), data: t.data.iter().map(|&v| v as u8).collect() }))
            }
        }
    }
}

/// The error for an input declared with a type no binding has (f16: the graph's element types
/// include it, but the host API hands over f32 values or bytes).
fn unsupported_input(name: &str, dtype: DType) -> Error {
    Error::Binding { name: name.to_string(), reason: format!("is declared {dtype}; inputs are f32 or u8") }
}

/// Every value of `t` is an integer in 0..=255; otherwise the first that is not, by index.
fn check_bytes(name: &str, t: &HostTensor) -> Result<()> {
    let Some(flat) = t.data.iter().position(|&v| !(0.0..=255.0).contains(&v) || v.fract() != 0.0) else { return Ok(()) };
    // The flat index as a multi-index of the shape, innermost dim last.
    let mut index = vec![0; t.shape.len()];
    let mut rest = flat;
    for (i, &d) in t.shape.iter().enumerate().rev() {
        index[i] = rest % d.max(1);
        rest /= d.max(1);
    }
    Err(Error::NotAByte { name: name.to_string(), index, value: t.data[flat] })
}

/// Element type of a graph value. The graph computes in f32 (engines choose their own physical
/// precision); a graph input may be declared `U8` (`Tracer::input_typed`): its data are bytes,
/// which an engine uploads one byte per element and converts on entry, and which every reader
/// sees as their f32 values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum DType {
    #[default]
    F32,
    F16,
    U8,
}

impl DType {
    /// `f32`, `f16`, `u8`: the name shown in listings and errors.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::U8 => "u8",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The element count of `shape`, or `None` when it overflows `usize`.
pub fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}
