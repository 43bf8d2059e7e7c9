//! A request as the backend sees it (plain data read through Triton's API), its checks, and how
//! a batch of requests is split into engine runs. Everything but [`read`] is pure, and tested here.

use crate::config::{dims_text, ModelSpec};
use crate::error::{BackendError, Result};
use crate::ffi::{self, datatype, Api};
use crate::kiln_api::InputDims;
use crate::triton::{check, cstr};

/// One contiguous piece of an input's data, where Triton holds it.
#[derive(Clone, Copy, Debug)]
pub struct Buffer {
    pub ptr: *const u8,
    pub len: usize,
    pub memory: u32,
    pub device: i64,
}

#[derive(Clone, Debug)]
pub struct InputData {
    pub name: String,
    pub datatype: u32,
    pub shape: Vec<i64>,
    pub byte_size: u64,
    pub buffers: Vec<Buffer>,
}

#[derive(Clone, Debug, Default)]
pub struct RequestData {
    pub inputs: Vec<InputData>,
    /// The outputs the client asked for (empty: all of them).
    pub outputs: Vec<String>,
}

/// A request that passed the checks: its batch, per-image input dims, its inputs in the model's
/// order (indices into `RequestData::inputs`) and the outputs to send.
#[derive(Clone, Debug, PartialEq)]
pub struct Checked {
    pub batch: usize,
    pub dims: InputDims,
    pub inputs: Vec<usize>,
    pub outputs: Vec<String>,
}

/// What the checks need to know of the model.
pub struct Limits<'a> {
    pub spec: &'a ModelSpec,
    pub max_batch: usize,
    /// The outputs config.pbtxt declares (what a request without a list of outputs gets).
    pub declared_outputs: Vec<String>,
    pub accepts: &'a dyn Fn(&InputDims) -> bool,
    pub accepted: &'a dyn Fn() -> String,
}

/// Reads a request's inputs (asking for their buffers in `memory`/`device`; Triton says where
/// they are) and the outputs it asks for.
///
/// # Safety
/// `request` is a live request this backend owns.
pub unsafe fn read(api: &Api, request: *mut ffi::Request, memory: u32, device: i64) -> Result<RequestData> {
    let mut data = RequestData::default();
    let mut count = 0u32;
    // SAFETY: `request` is live (the caller's contract); `count` outlives the call.
    check(api, "TRITONBACKEND_RequestInputCount", unsafe { (api.TRITONBACKEND_RequestInputCount)(request, &mut count) })?;
    for index in 0..count {
        let mut input = std::ptr::null_mut();
        // SAFETY: `index < count`; `input` outlives the call.
        check(api, "TRITONBACKEND_RequestInputByIndex", unsafe { (api.TRITONBACKEND_RequestInputByIndex)(request, index, &mut input) })?;
        let (mut name, mut dtype, mut shape, mut rank, mut byte_size, mut buffers) =
            (std::ptr::null(), 0u32, std::ptr::null(), 0u32, 0u64, 0u32);
        // SAFETY: `input` belongs to the live request; every out-pointer outlives the call.
        check(api, "TRITONBACKEND_InputProperties", unsafe {
            (api.TRITONBACKEND_InputProperties)(input, &mut name, &mut dtype, &mut shape, &mut rank, &mut byte_size, &mut buffers)
        })?;
        // SAFETY: Triton returns a NUL-terminated name and `rank` dims that live as long as the request.
        let (name, shape) =
            unsafe { (cstr(name), if shape.is_null() { Vec::new() } else { std::slice::from_raw_parts(shape, rank as usize).to_vec() }) };
        let mut list = Vec::with_capacity(buffers as usize);
        for b in 0..buffers {
            let (mut ptr, mut len, mut mem, mut dev) = (std::ptr::null(), 0u64, memory, device);
            // SAFETY: `b < buffers`; the out-pointers outlive the call; `mem`/`dev` carry our preference in.
            check(api, "TRITONBACKEND_InputBuffer", unsafe {
                (api.TRITONBACKEND_InputBuffer)(input, b, &mut ptr, &mut len, &mut mem, &mut dev)
            })?;
            list.push(Buffer { ptr: ptr.cast(), len: len as usize, memory: mem, device: dev });
        }
        data.inputs.push(InputData { name, datatype: dtype, shape, byte_size, buffers: list });
    }
    let mut outputs = 0u32;
    // SAFETY: as above.
    check(api, "TRITONBACKEND_RequestOutputCount", unsafe { (api.TRITONBACKEND_RequestOutputCount)(request, &mut outputs) })?;
    for index in 0..outputs {
        let mut name = std::ptr::null();
        // SAFETY: `index < outputs`; the name lives as long as the request.
        check(api, "TRITONBACKEND_RequestOutputName", unsafe { (api.TRITONBACKEND_RequestOutputName)(request, index, &mut name) })?;
        // SAFETY: a NUL-terminated string owned by the request.
        data.outputs.push(unsafe { cstr(name) });
    }
    Ok(data)
}

/// Checks a request against the model: every input present and known, of the model's type, with a
/// batch dim, a batch within max_batch_size, per-image dims the model accepts, and exactly the
/// bytes those dims need; every output asked for is one the model has.
pub fn check_request(limits: &Limits, req: &RequestData) -> Result<Checked> {
    let spec = limits.spec;
    let input_names: Vec<&str> = spec.inputs.iter().map(|b| b.name.as_str()).collect();
    if let Some(unknown) = req.inputs.iter().find(|i| !input_names.contains(&i.name.as_str())) {
        return Err(BackendError::Input {
            name: unknown.name.clone(),
            reason: format!("the model has no such input; its inputs are {input_names:?}"),
        });
    }
    let mut batch = None;
    let mut dims = InputDims::new();
    let mut order = Vec::with_capacity(spec.inputs.len());
    for b in &spec.inputs {
        let Some(pos) = req.inputs.iter().position(|i| i.name == b.name) else {
            return Err(BackendError::Input {
                name: b.name.clone(),
                reason: format!("is missing from the request; the model needs {input_names:?}"),
            });
        };
        let i = &req.inputs[pos];
        let bad = |reason: String| BackendError::Input { name: b.name.clone(), reason };
        if i.datatype != b.elem.datatype() {
            return Err(bad(format!("is {}, but the model takes {}", datatype::name(i.datatype), b.elem.wire_name())));
        }
        let want = format!("[batch, {}]", b.dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "));
        if i.shape.len() != b.dims.len() + 1 {
            return Err(bad(format!(
                "has shape {:?}, but the model takes {want} ({} dims with the batch first)",
                i.shape,
                b.dims.len() + 1
            )));
        }
        if i.shape.iter().any(|&d| d < 1) {
            return Err(bad(format!("has shape {:?}: every dim must be at least 1", i.shape)));
        }
        let n = i.shape[0] as usize;
        if *batch.get_or_insert(n) != n {
            return Err(BackendError::Request {
                reason: format!("its inputs have different batch sizes ({} and {n})", batch.unwrap_or(n)),
            });
        }
        if n > limits.max_batch {
            return Err(BackendError::Request {
                reason: format!("batch {n} (input `{}`) is more than the model's max_batch_size {}", b.name, limits.max_batch),
            });
        }
        let per_image: Vec<usize> = i.shape[1..].iter().map(|&d| d as usize).collect();
        let bytes = per_image.iter().try_fold(n * b.elem.size(), |acc, &d| acc.checked_mul(d));
        // Saturating: buffer lengths come from the request, and their sum must not wrap to a match.
        let held = i.buffers.iter().fold(0usize, |sum, b| sum.saturating_add(b.len));
        if bytes != Some(i.byte_size as usize) || held != i.byte_size as usize {
            return Err(bad(format!(
                "holds {} bytes in {} buffer(s), but shape {:?} of {} needs {}",
                held,
                i.buffers.len(),
                i.shape,
                b.elem.wire_name(),
                bytes.map_or("more than fit in memory".into(), |b| b.to_string())
            )));
        }
        dims.insert(b.name.clone(), per_image);
        order.push(pos);
    }
    if !(limits.accepts)(&dims) {
        let given: Vec<String> = dims.iter().map(|(n, d)| format!("{n} {}", dims_text(d))).collect();
        let name = dims.keys().cloned().collect::<Vec<_>>().join(",");
        return Err(BackendError::Input {
            name,
            reason: format!("per-image dims {} are outside what the model accepts: {}", given.join(", "), (limits.accepted)()),
        });
    }
    let outputs = if req.outputs.is_empty() { limits.declared_outputs.clone() } else { req.outputs.clone() };
    for o in &outputs {
        if !spec.outputs.iter().any(|b| &b.name == o) {
            let have: Vec<&str> = spec.outputs.iter().map(|b| b.name.as_str()).collect();
            return Err(BackendError::Output {
                name: o.clone(),
                reason: format!("the model has no such output; its outputs are {have:?}"),
            });
        }
    }
    Ok(Checked { batch: batch.unwrap_or(1), dims, inputs: order, outputs })
}

/// Splits requests (by index, with their dims and batch) into engine runs: requests of the same
/// input dims run together, in arrival order, up to `max_batch` images a run.
pub fn plan_runs(items: &[(usize, &InputDims, usize)], max_batch: usize) -> Vec<Vec<usize>> {
    let mut runs: Vec<(InputDims, usize, Vec<usize>)> = Vec::new();
    let mut closed = Vec::new();
    for &(index, dims, batch) in items {
        match runs.iter_mut().find(|(d, total, _)| d == dims && total + batch <= max_batch) {
            Some((_, total, members)) => {
                *total += batch;
                members.push(index);
            }
            None => {
                // A full run of these dims is closed; a new one starts.
                if let Some(pos) = runs.iter().position(|(d, _, _)| d == dims) {
                    closed.push(runs.remove(pos).2);
                }
                runs.push((dims.clone(), batch, vec![index]));
            }
        }
    }
    closed.extend(runs.into_iter().map(|(_, _, m)| m));
    closed.sort_by_key(|m| m[0]);
    closed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Binding, ElemType};

    fn spec() -> ModelSpec {
        ModelSpec {
            file: "model.kiln.safetensors".into(),
            inputs: vec![Binding { name: "input".into(), elem: ElemType::F32, dims: vec![3, 8, 8], range: vec![(3, 3), (4, 16), (4, 16)] }],
            outputs: vec![Binding::fixed("logits", ElemType::F32, &[10])],
            batch: None,
        }
    }

    fn input(dtype: u32, shape: &[i64], bytes: usize) -> InputData {
        InputData {
            name: "input".into(),
            datatype: dtype,
            shape: shape.to_vec(),
            byte_size: bytes as u64,
            buffers: vec![Buffer { ptr: std::ptr::null(), len: bytes, memory: crate::ffi::memory::CPU, device: 0 }],
        }
    }

    fn run_check(req: &RequestData) -> Result<Checked> {
        let spec = spec();
        let accepts = |d: &InputDims| d["input"][0] == 3 && (4..=16).contains(&d["input"][1]) && (4..=16).contains(&d["input"][2]);
        let accepted = || "input 3x4x4..3x16x16".to_string();
        let limits = Limits { spec: &spec, max_batch: 4, declared_outputs: vec!["logits".into()], accepts: &accepts, accepted: &accepted };
        check_request(&limits, req)
    }

    #[test]
    fn a_good_request_passes_with_its_batch_and_dims() {
        let req = RequestData { inputs: vec![input(datatype::FP32, &[2, 3, 8, 12], 2 * 3 * 8 * 12 * 4)], outputs: vec![] };
        let c = run_check(&req).unwrap();
        assert_eq!(c.batch, 2);
        assert_eq!(c.dims["input"], vec![3, 8, 12]);
        assert_eq!(c.outputs, vec!["logits".to_string()]);
    }

    #[test]
    fn each_bad_request_gets_its_own_error() {
        let msg = |req: RequestData| run_check(&req).unwrap_err().to_string();
        let one = |i: InputData| RequestData { inputs: vec![i], outputs: vec![] };
        assert_eq!(msg(one(input(datatype::FP64, &[1, 3, 8, 8], 1536))), "input `input`: is FP64, but the model takes FP32");
        assert!(msg(one(input(datatype::FP32, &[3, 8, 8], 768))).contains("has shape [3, 8, 8], but the model takes [batch, 3, 8, 8]"));
        assert!(msg(RequestData::default()).contains("input `input`: is missing from the request"));
        assert!(msg(one(input(datatype::FP32, &[5, 3, 8, 8], 5 * 768)))
            .contains("batch 5 (input `input`) is more than the model's max_batch_size 4"));
        let outside = msg(one(input(datatype::FP32, &[1, 3, 32, 32], 3 * 32 * 32 * 4)));
        assert!(outside.contains("per-image dims input 3x32x32 are outside what the model accepts: input 3x4x4..3x16x16"), "{outside}");
        assert!(msg(one(input(datatype::FP32, &[1, 3, 8, 8], 100)))
            .contains("holds 100 bytes in 1 buffer(s), but shape [1, 3, 8, 8] of FP32 needs 768"));
        assert!(msg(one(input(datatype::FP32, &[1, 3, 0, 8], 0))).contains("every dim must be at least 1"));
        let mut extra = one(input(datatype::FP32, &[1, 3, 8, 8], 768));
        extra.inputs.push(InputData { name: "mask".into(), ..extra.inputs[0].clone() });
        assert!(msg(extra).contains("input `mask`: the model has no such input"));
        let mut wrong_out = one(input(datatype::FP32, &[1, 3, 8, 8], 768));
        wrong_out.outputs = vec!["boxes".into()];
        assert!(msg(wrong_out).contains("output `boxes`: the model has no such output; its outputs are [\"logits\"]"));
    }

    #[test]
    fn runs_group_equal_dims_up_to_the_max_batch_in_arrival_order() {
        let a = InputDims::from([("input".to_string(), vec![3, 8, 8])]);
        let b = InputDims::from([("input".to_string(), vec![3, 16, 16])]);
        let items = [(0, &a, 1), (1, &b, 1), (2, &a, 2), (3, &a, 2), (4, &b, 3), (5, &a, 1)];
        assert_eq!(plan_runs(&items, 4), vec![vec![0, 2], vec![1, 4], vec![3, 5]]);
        assert_eq!(plan_runs(&items[..1], 4), vec![vec![0]]);
        assert!(plan_runs(&[], 4).is_empty());
    }
}
