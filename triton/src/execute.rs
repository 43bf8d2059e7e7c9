//! `TRITONBACKEND_ModelInstanceExecute`: the requests Triton's scheduler hands an instance are
//! read and checked one by one, grouped into engine runs, run, answered and released. A bad
//! request gets its own error response; the others in its batch still run.

use crate::copy::Place;
use crate::error::{catch, BackendError, Failure, Result};
use crate::ffi::{self, Api};
use crate::kiln_api::InputDims;
use crate::model::LoadedModel;
use crate::request::{self, Checked, Limits, RequestData};
use crate::runner::{Dest, Member, Runner};
use crate::triton::{check, log, new_error, now_ns};
use std::sync::Arc;

/// One instance: its model, what it runs on, and its name for the log.
pub struct InstanceState {
    pub model: Arc<LoadedModel>,
    pub name: String,
    pub runner: Box<dyn Runner>,
}

/// A request in flight: what was read, whether it passed, and its response.
struct Slot {
    request: *mut ffi::Request,
    response: *mut ffi::Response,
    data: RequestData,
    checked: Option<Checked>,
    error: Option<Failure>,
    /// exec start, compute start, compute end, exec end (ns); zero until it ran.
    times: [u64; 4],
}

/// Runs `requests` and takes ownership of them: every one gets a response (its outputs or its
/// error), its statistics, and is released.
///
/// # Safety
/// `requests` are live requests Triton handed this instance; `instance` is that instance.
pub unsafe fn execute(api: &Api, instance: *mut ffi::ModelInstance, state: &mut InstanceState, requests: &[*mut ffi::Request]) {
    let exec_start = now_ns();
    let (memory, device) = state.runner.preferred();
    let mut slots: Vec<Slot> = requests
        .iter()
        .map(|&request| {
            let mut response = std::ptr::null_mut();
            // SAFETY: `request` is live; the response belongs to it.
            let created = check(api, "TRITONBACKEND_ResponseNew", unsafe { (api.TRITONBACKEND_ResponseNew)(&mut response, request) });
            // SAFETY: `request` is live and ours.
            let data = created.and_then(|()| catch("reading a request", || unsafe { request::read(api, request, memory, device) }));
            let (data, error) = match data {
                Ok(d) => (d, None),
                Err(e) => (RequestData::default(), Some(Failure::from(&e))),
            };
            Slot { request, response, data, checked: None, error, times: [0; 4] }
        })
        .collect();

    let model = state.model.clone();
    let accepts = |d: &InputDims| model.accepts(d);
    let accepted = || model.accepted_text();
    let limits = Limits {
        spec: &model.spec,
        max_batch: model.max_batch(),
        declared_outputs: model.config.output.iter().map(|o| o.name.clone()).collect(),
        accepts: &accepts,
        accepted: &accepted,
    };
    for slot in slots.iter_mut().filter(|s| s.error.is_none()) {
        let checked = catch("checking a request", || {
            let c = request::check_request(&limits, &slot.data)?;
            if model.refuse_non_finite {
                // SAFETY: the request's buffers are live until it is released, and were checked
                // to hold the bytes its shape needs.
                unsafe { request::check_finite(&model.spec, &slot.data, &c) }?;
            }
            Ok(c)
        });
        match checked {
            Ok(c) => slot.checked = Some(c),
            Err(e) => slot.error = Some(Failure::from(&e)),
        }
    }

    let items: Vec<(usize, &InputDims, usize)> = slots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| s.checked.as_ref().filter(|_| s.error.is_none()).map(|c| (i, &c.dims, c.batch)))
        .collect();
    let runs = request::plan_runs(&items, model.max_batch());
    for run in runs {
        let outcome = catch("running a batch", || run_batch(api, &model, state.runner.as_mut(), &mut slots, &run, exec_start));
        if let Err(e) = outcome {
            for &i in &run {
                slots[i].error.get_or_insert_with(|| Failure::from(&e));
            }
        } else {
            let total: usize = run.iter().filter_map(|&i| slots[i].checked.as_ref().map(|c| c.batch)).sum();
            let t = slots[run[0]].times;
            // SAFETY: `instance` is the live instance these requests ran on.
            let reported =
                unsafe { (api.TRITONBACKEND_ModelInstanceReportBatchStatistics)(instance, total as u64, t[0], t[1], t[2], t[3]) };
            if let Err(e) = check(api, "TRITONBACKEND_ModelInstanceReportBatchStatistics", reported) {
                log(api, ffi::log_level::WARN, &format!("{}: {e}", state.name));
            }
        }
    }

    for slot in slots {
        respond(api, instance, &state.name, slot);
    }
}

/// Runs one group of requests as one batch and writes each request's outputs into its response.
fn run_batch(api: &Api, model: &LoadedModel, runner: &mut dyn Runner, slots: &mut [Slot], run: &[usize], exec_start: u64) -> Result<()> {
    let mut offset = 0;
    let mut members = Vec::with_capacity(run.len());
    for &i in run {
        let checked = slots[i].checked.as_ref().ok_or_else(|| BackendError::Request { reason: "was not checked".into() })?;
        members.push(Member { data: &slots[i].data, checked, offset });
        offset += checked.batch;
    }
    let dims = members[0].checked.dims.clone();
    let compute_start = now_ns();
    // On a GPU this only enqueues the batch: the responses' buffers are asked for below while it
    // runs, their copies queue behind it, and `finish` waits once for all of it.
    runner.run(model, &dims, &members, offset)?;
    drop(members);

    let (memory, device) = runner.preferred();
    let mut offset = 0;
    for &i in run {
        let slot = &mut slots[i];
        let Some(checked) = slot.checked.as_ref() else { continue };
        let batch = checked.batch;
        let written = catch("writing outputs", || {
            for name in &checked.outputs {
                let dims = runner.output_dims(name)?;
                let mut shape = vec![batch as i64];
                shape.extend(dims.iter().map(|&d| d as i64));
                let bytes = batch * dims.iter().product::<usize>() * 4;
                let cname = crate::triton::c_string(name);
                let mut output = std::ptr::null_mut();
                // SAFETY: the response is live and ours; name and shape outlive the call.
                check(api, "TRITONBACKEND_ResponseOutput", unsafe {
                    (api.TRITONBACKEND_ResponseOutput)(
                        slot.response,
                        &mut output,
                        cname.as_ptr(),
                        ffi::datatype::FP32,
                        shape.as_ptr(),
                        shape.len() as u32,
                    )
                })?;
                let (mut buffer, mut mem, mut dev) = (std::ptr::null_mut(), memory, device);
                // SAFETY: `output` belongs to the live response; the out-pointers outlive the call.
                check(api, "TRITONBACKEND_OutputBuffer", unsafe {
                    (api.TRITONBACKEND_OutputBuffer)(output, &mut buffer, bytes as u64, &mut mem, &mut dev)
                })?;
                if buffer.is_null() && bytes > 0 {
                    return Err(BackendError::Output { name: name.clone(), reason: "Triton gave no buffer".into() });
                }
                runner.write_output(
                    name,
                    offset,
                    batch,
                    Dest { place: Place { ptr: buffer as u64, memory: mem, device: dev }, len: bytes },
                )?;
            }
            Ok(())
        });
        if let Err(e) = written {
            slot.error = Some(Failure::from(&e));
        }
        offset += batch;
    }
    let compute_end = runner.finish()?;
    let exec_end = now_ns();
    for &i in run {
        slots[i].times = [exec_start, compute_start, compute_end, exec_end];
    }
    Ok(())
}

/// What a request's statistics report says: `Some(true)` for a request that ran, `Some(false)` for
/// one that failed in the backend (Triton counts it in `nv_inference_request_failure` with
/// `reason="BACKEND"`), and `None` (no report) for one refused as the caller's mistake
/// (INVALID_ARG, HTTP 400): Triton counts every failure a backend reports as the backend's, and
/// does not count the mistakes it refuses itself (a wrong datatype or shape for the config), so
/// Kiln's refusals are left out as Triton's own are.
fn statistics_outcome(error: Option<&Failure>, ran: bool) -> Option<bool> {
    match error {
        Some(e) if e.code == ffi::code::INVALID_ARG => None,
        Some(_) => Some(false),
        None => Some(ran),
    }
}

/// Sends a request's response (its error, if any), reports its statistics and releases it.
fn respond(api: &Api, instance: *mut ffi::ModelInstance, name: &str, slot: Slot) {
    let Slot { request, response, error, times, .. } = slot;
    if !response.is_null() {
        let err = error.as_ref().map_or(std::ptr::null_mut(), |e| new_error(api, e.code, &e.message));
        // SAFETY: the response is live and ours; sending hands it to Triton. We keep `err` and
        // delete it after (ResponseSend does not take it).
        let sent = unsafe { (api.TRITONBACKEND_ResponseSend)(response, ffi::RESPONSE_COMPLETE_FINAL, err) };
        if !err.is_null() {
            // SAFETY: `err` was created above and is ours.
            unsafe { (api.TRITONSERVER_ErrorDelete)(err) };
        }
        if let Err(e) = check(api, "TRITONBACKEND_ResponseSend", sent) {
            log(api, ffi::log_level::ERROR, &format!("{name}: {e}"));
        }
    }
    if let Some(e) = &error {
        log(api, ffi::log_level::VERBOSE, &format!("{name}: request failed: {}", e.message));
    }
    if let Some(ok) = statistics_outcome(error.as_ref(), times[0] != 0) {
        // SAFETY: the request is live until released below; failed requests' times are ignored.
        let reported =
            unsafe { (api.TRITONBACKEND_ModelInstanceReportStatistics)(instance, request, ok, times[0], times[1], times[2], times[3]) };
        if let Err(e) = check(api, "TRITONBACKEND_ModelInstanceReportStatistics", reported) {
            log(api, ffi::log_level::WARN, &format!("{name}: {e}"));
        }
    }
    // SAFETY: we own the request and nothing reads it after this.
    let released = unsafe { (api.TRITONBACKEND_RequestRelease)(request, ffi::REQUEST_RELEASE_ALL) };
    if let Err(e) = check(api, "TRITONBACKEND_RequestRelease", released) {
        log(api, ffi::log_level::ERROR, &format!("{name}: {e}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request refused as the caller's mistake is not reported, so Triton's failure counter
    /// (`reason="BACKEND"`) counts only the backend's own failures.
    #[test]
    fn client_mistakes_are_not_counted_as_backend_failures() {
        let mistake = Failure { code: ffi::code::INVALID_ARG, message: "input `input`: per-image dims ...".into() };
        let failure = Failure { code: ffi::code::INTERNAL, message: "CUDA ...".into() };
        assert_eq!(statistics_outcome(Some(&mistake), false), None);
        assert_eq!(statistics_outcome(Some(&failure), true), Some(false));
        assert_eq!(statistics_outcome(None, true), Some(true));
        assert_eq!(statistics_outcome(None, false), Some(false), "a request that never ran is not a success");
    }
}
