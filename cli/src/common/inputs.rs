//! A model's inputs as the commands make data for them: their names, dims and types, random
//! data at a seed, or a tensor read from an `--input` file.

use super::dims::MAX_INPUT_ELEMENTS;
use kiln::engine::Engine;
use kiln::{ByteTensor, DType, Error, Graph, HostInput, HostTensor, Result};
use std::path::Path;

/// One graph input as the commands make data for it: name, per-image dims, declared type.
#[derive(Clone, Debug, PartialEq)]
pub struct InputSpec {
    pub name: String,
    pub dims: Vec<usize>,
    pub dtype: DType,
}

/// Each input's name, per-image dims and type, for messages: `frame 720x3840 u8`.
pub(super) fn inputs_text(graph: &Graph) -> String {
    let inputs = graph_inputs(graph);
    inputs.iter().map(|i| format!("{} {} {}", i.name, crate::shapes::dims_text(&i.dims), i.dtype)).collect::<Vec<_>>().join(", ")
}

/// The inputs of a graph, in binding order.
pub fn graph_inputs(graph: &Graph) -> Vec<InputSpec> {
    graph
        .inputs
        .iter()
        .zip(graph.input_names())
        .map(|(&i, name)| InputSpec { name: name.to_string(), dims: graph.nodes[i].shape[1..].to_vec(), dtype: graph.nodes[i].dtype })
        .collect()
}

/// The inputs of an engine at its first plan's dims, in binding order.
pub fn engine_inputs(engine: &Engine) -> Vec<InputSpec> {
    engine
        .inputs()
        .into_iter()
        .map(|(name, dims)| InputSpec { name: name.to_string(), dims: dims.to_vec(), dtype: engine.input_dtype(name).unwrap_or_default() })
        .collect()
}

/// One input's data as a command holds it: f32 values, or bytes for an input declared u8.
#[derive(Clone, Debug, PartialEq)]
pub enum InputData {
    F32(HostTensor),
    U8(ByteTensor),
}

impl InputData {
    pub fn as_input(&self) -> HostInput<'_> {
        match self {
            InputData::F32(t) => HostInput::F32(t),
            InputData::U8(t) => HostInput::U8(t),
        }
    }

    pub fn shape(&self) -> &[usize] {
        match self {
            InputData::F32(t) => &t.shape,
            InputData::U8(t) => &t.shape,
        }
    }
}

/// Named inputs as `run` takes them.
pub fn bind(inputs: &[(String, InputData)]) -> Vec<(&str, HostInput<'_>)> {
    inputs.iter().map(|(n, d)| (n.as_str(), d.as_input())).collect()
}

/// Random data for `inputs` at `batch`: uniform in [-1, 1) for f32 inputs, uniform bytes for u8
/// ones (an image as decoded). The k-th input is drawn from `seed + k`, so a one-input model's
/// input depends on `seed` alone, as `--seed` promises.
pub fn random_inputs(inputs: &[InputSpec], batch: usize, seed: u64) -> Result<Vec<(String, InputData)>> {
    let mut out = Vec::with_capacity(inputs.len());
    for (k, spec) in inputs.iter().enumerate() {
        let shape: Vec<usize> = std::iter::once(batch).chain(spec.dims.iter().copied()).collect();
        let values = random_input(&shape, seed.wrapping_add(k as u64))?;
        let data = match spec.dtype {
            // [-1, 1) onto the 256 levels, each equally likely.
            DType::U8 => {
                InputData::U8(ByteTensor::new(shape, values.data.iter().map(|v| ((v + 1.0) * 128.0).clamp(0.0, 255.0) as u8).collect())?)
            }
            _ => InputData::F32(values),
        };
        out.push((spec.name.clone(), data));
    }
    Ok(out)
}

/// A random input of `shape` whose memory is requested with `try_reserve`.
fn random_input(shape: &[usize], seed: u64) -> Result<HostTensor> {
    kiln::dev::try_uniform_tensor(shape, seed)
}

/// Reads an input tensor from a safetensors file: the tensor named `input`, or its only tensor.
pub fn read_input(path: &Path) -> Result<HostTensor> {
    let (mut tensors, _) = kiln::files::read_tensors_within(path, "input", |_| true, MAX_INPUT_ELEMENTS)?;
    if let Some(t) = tensors.remove("input") {
        return Ok(t);
    }
    if tensors.len() == 1 {
        return Ok(tensors.into_values().next().expect("one tensor"));
    }
    Err(Error::Safetensors {
        path: path.to_path_buf(),
        reason: format!("holds no tensor named `input` and {} others: {:?}", tensors.len(), tensors.keys().take(5).collect::<Vec<_>>()),
    })
}

/// `--input`'s tensor as a command binds it: f32 values (from f32, f16 or bf16), or bytes where the
/// file stores it as U8 (a decoded frame for a model whose input is declared u8). Returns its key
/// in the file (`input`, or the file's only tensor) and its data.
pub fn read_input_data(path: &Path) -> Result<(String, InputData)> {
    match read_input(path) {
        Ok(t) => Ok(("input".into(), InputData::F32(t))),
        Err(Error::TensorDtype { got, key, what, path: p }) if got == "U8" => match read_u8_input(path)? {
            Some((key, t)) => Ok((key, InputData::U8(t))),
            None => Err(Error::TensorDtype { got, key, what, path: p }),
        },
        Err(e) => Err(e),
    }
}

/// The U8 tensor `input`, or the file's only tensor, of a safetensors file (`None` when that
/// tensor is not U8). The header is checked first, and the file's size is limited before it is read.
fn read_u8_input(path: &Path) -> Result<Option<(String, ByteTensor)>> {
    let bad = |reason: String| Error::Safetensors { path: path.to_path_buf(), reason };
    kiln::files::read_metadata(path)?;
    let size = std::fs::metadata(path).map_err(Error::io(path))?.len();
    // One byte per element, and room for a header.
    if size > (MAX_INPUT_ELEMENTS as u64).saturating_add(1 << 24) {
        return Err(Error::TooLarge {
            what: format!("--input {}", path.display()),
            reason: format!("{size} bytes, more than an input of {MAX_INPUT_ELEMENTS} elements"),
        });
    }
    let bytes = std::fs::read(path).map_err(Error::io(path))?;
    let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(format!("{e:?}")))?;
    let names = file.names();
    let key = match names.as_slice() {
        _ if names.iter().any(|n| *n == "input") => "input".to_string(),
        [only] => only.to_string(),
        _ => return Err(bad(format!("holds no tensor named `input` and {} others", names.len()))),
    };
    let view = file.tensor(&key).map_err(|e| bad(format!("tensor `{key}`: {e:?}")))?;
    if view.dtype() != safetensors::Dtype::U8 {
        return Ok(None);
    }
    Ok(Some((key, ByteTensor::new(view.shape().to_vec(), view.data().to_vec())?)))
}

#[cfg(test)]
mod tests {

    #[test]
    fn random_inputs_are_reproducible_by_seed() {
        let (a, b) = (kiln::dev::uniform_tensor(&[1, 3, 2, 2], 5), kiln::dev::uniform_tensor(&[1, 3, 2, 2], 5));
        assert_eq!(a, b);
        assert_ne!(a, kiln::dev::uniform_tensor(&[1, 3, 2, 2], 6));
        assert!(a.data.iter().all(|v| (-1.0..1.0).contains(v)));
    }
}
