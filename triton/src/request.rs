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

/// Little-endian f32 values fed in pieces (an element may straddle two buffers): how many are
/// NaN or infinite, and the index of the first.
#[derive(Default)]
struct FiniteScan {
    carry: [u8; 4],
    carried: usize,
    at: usize,
    first: Option<usize>,
    count: usize,
}

impl FiniteScan {
    fn value(&mut self, bytes: [u8; 4]) {
        if !f32::from_le_bytes(bytes).is_finite() {
            self.first.get_or_insert(self.at);
            self.count += 1;
        }
        self.at += 1;
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        if self.carried > 0 {
            let take = (4 - self.carried).min(bytes.len());
            self.carry[self.carried..self.carried + take].copy_from_slice(&bytes[..take]);
            self.carried += take;
            bytes = &bytes[take..];
            if self.carried < 4 {
                return;
            }
            self.carried = 0;
            self.value(self.carry);
        }
        // All exponent bits set: NaN or infinity. Counted branch-free (it vectorises); the first
        // is looked for only in a piece that has one.
        let values = bytes.chunks_exact(4);
        let rest = values.remainder();
        let special = |v: &[u8]| u32::from_le_bytes([v[0], v[1], v[2], v[3]]) & 0x7f80_0000 == 0x7f80_0000;
        let bad = values.clone().filter(|v| special(v)).count();
        if bad > 0 {
            self.first.get_or_insert(self.at + values.clone().position(special).unwrap_or(0));
            self.count += bad;
        }
        self.at += bytes.len() / 4;
        self.carry[..rest.len()].copy_from_slice(rest);
        self.carried = rest.len();
    }
}

/// With `parameters["refuse_non_finite"]`: an error naming the first NaN or infinity in a checked
/// request's FP32 inputs (its input, image and element, and how many there are), or `Ok`. Host
/// buffers are read where they are; a buffer in GPU memory is copied to the host first, a chunk
/// at a time.
///
/// # Safety
/// `req`'s buffers are live and hold the bytes `checked` found in them.
pub unsafe fn check_finite(spec: &ModelSpec, req: &RequestData, checked: &Checked) -> Result<()> {
    for (b, &pos) in spec.inputs.iter().zip(&checked.inputs) {
        if b.elem != crate::config::ElemType::F32 {
            continue;
        }
        let input = &req.inputs[pos];
        let per_image: usize = input.shape[1..].iter().map(|&d| d as usize).product();
        let mut scan = FiniteScan::default();
        for buf in &input.buffers {
            if buf.memory == ffi::memory::GPU {
                // 4 MiB at a time.
                let mut host = vec![0u8; buf.len.min(4 << 20)];
                let mut done = 0;
                while done < buf.len {
                    let n = (buf.len - done).min(host.len());
                    let src = crate::copy::Place { ptr: buf.ptr as u64 + done as u64, memory: buf.memory, device: buf.device };
                    // SAFETY: the buffer holds `buf.len` bytes (the caller's contract); `host` holds `n`.
                    unsafe { crate::copy::copy(crate::copy::Place::host(host.as_mut_ptr()), src, n, None) }?;
                    scan.feed(&host[..n]);
                    done += n;
                }
            } else if buf.len > 0 {
                // SAFETY: a live host buffer of `buf.len` bytes (the caller's contract).
                scan.feed(unsafe { std::slice::from_raw_parts(buf.ptr, buf.len) });
            }
        }
        if let Some(i) = scan.first {
            let count = scan.count;
            return Err(BackendError::Input {
                name: b.name.clone(),
                reason: format!(
                    "holds {count} NaN or infinite value(s), the first at element {} of image {} (parameters[\"refuse_non_finite\"] is true)",
                    i % per_image.max(1),
                    i / per_image.max(1)
                ),
            });
        }
    }
    Ok(())
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

    /// NaN and infinity anywhere in an FP32 input, also straddling two buffers, are found and
    /// named by image and element; finite inputs pass.
    #[test]
    fn non_finite_inputs_are_found_across_buffers() {
        let mut values = vec![0.5f32; 2 * 3 * 8 * 8];
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let check = |data: &[u8], split: usize| {
            let (a, b) = data.split_at(split);
            let buffers = vec![
                Buffer { ptr: a.as_ptr(), len: a.len(), memory: crate::ffi::memory::CPU, device: 0 },
                Buffer { ptr: b.as_ptr(), len: b.len(), memory: crate::ffi::memory::CPU, device: 0 },
            ];
            let req = RequestData {
                inputs: vec![InputData {
                    name: "input".into(),
                    datatype: datatype::FP32,
                    shape: vec![2, 3, 8, 8],
                    byte_size: data.len() as u64,
                    buffers,
                }],
                outputs: vec![],
            };
            let checked = run_check(&req).expect("a good request");
            // SAFETY: the buffers point into `data`, alive for the call.
            unsafe { check_finite(&spec(), &req, &checked) }.map_err(|e| e.to_string())
        };
        assert_eq!(check(&bytes(&values), 101), Ok(()));
        values[200] = f32::NAN;
        values[300] = f32::INFINITY;
        for split in [0, 4 * 200 + 2, 4 * 200, 1536] {
            let e = check(&bytes(&values), split).expect_err("NaN");
            assert_eq!(
                e,
                "input `input`: holds 2 NaN or infinite value(s), the first at element 8 of image 1 (parameters[\"refuse_non_finite\"] is true)",
                "split at {split}"
            );
        }
    }

    /// The check's cost (docs/SERVING.md): a batch of 8 images of 3x224x224 FP32, scanned 50
    /// times finite (what every valid request pays) and with a NaN in its last element.
    /// `cargo test --release -p kiln-triton --lib -- --ignored --nocapture non_finite_check_cost`.
    #[test]
    #[ignore = "a measurement"]
    fn non_finite_check_cost() {
        let n = 8 * 3 * 224 * 224;
        let mut data: Vec<u8> = std::iter::repeat_n(0.25f32.to_le_bytes(), n).flatten().collect();
        let spec = ModelSpec {
            inputs: vec![Binding {
                name: "input".into(),
                elem: ElemType::F32,
                dims: vec![3, 224, 224],
                range: vec![(3, 3), (224, 224), (224, 224)],
            }],
            ..spec()
        };
        let checked =
            Checked { batch: 8, dims: InputDims::from([("input".to_string(), vec![3, 224, 224])]), inputs: vec![0], outputs: vec![] };
        for nan in [false, true] {
            if nan {
                data[4 * (n - 1)..].copy_from_slice(&f32::NAN.to_le_bytes());
            }
            let buffers = vec![Buffer { ptr: data.as_ptr(), len: data.len(), memory: crate::ffi::memory::CPU, device: 0 }];
            let input = InputData {
                name: "input".into(),
                datatype: datatype::FP32,
                shape: vec![8, 3, 224, 224],
                byte_size: data.len() as u64,
                buffers,
            };
            let req = RequestData { inputs: vec![input], outputs: vec![] };
            let started = std::time::Instant::now();
            for _ in 0..50 {
                // SAFETY: the buffer points into `data`, alive for the call.
                let result = unsafe { check_finite(&spec, &req, &checked) };
                assert_eq!(result.is_err(), nan, "{result:?}");
            }
            let per = started.elapsed() / 50;
            let what = if nan { "a NaN last" } else { "finite" };
            println!("non-finite check, {what}: {per:?} for 8 x 3x224x224 FP32 ({:.2} ns an element)", per.as_nanos() as f64 / n as f64);
        }
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
