//! Tests across modules without a server: repositories written and loaded back as the backend
//! loads them, and requests run through the CPU runner as `execute` runs them.

use crate::config::{ElemType, ProfileShapes};
use crate::copy::Place;
use crate::ffi::{datatype, memory};
use crate::kiln_api::{
    encode_engine_file, run_cpu, BuildConfig, DType, Graph, Header, HostTensor, InputDims, Payload, Tracer, FORMAT_VERSION,
};
use crate::repository::{load_written, write_repository, InstanceKind, ModelSource, RepositoryOptions};
use crate::request::{check_request, Buffer, InputData, Limits, RequestData};
use crate::runner::{CpuRunner, Dest, Member, Runner};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// input [N,3,H,W] → global average pool → flatten → 2x+1: runs at any H x W.
fn tiny() -> Graph {
    let t = Tracer::new();
    let x = t.input("input", &[1, 3, 8, 8]);
    let y = x.adaptive_avg_pool2d([1, 1]).and_then(|p| p.flatten(1)).and_then(|f| f.affine(2.0, 1.0)).expect("tiny graph");
    t.output("logits", &y);
    t.graph()
}

/// The same on an input of bytes.
fn tiny_u8() -> Graph {
    let t = Tracer::new();
    let x = t.input_typed("image", &[1, 3, 4, 4], DType::U8);
    let y = x.affine(1.0 / 255.0, 0.0).and_then(|a| a.adaptive_avg_pool2d([1, 1])).and_then(|p| p.flatten(1)).expect("tiny u8 graph");
    t.output("mean", &y);
    t.graph()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-triton-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn cpu_options(name: &str) -> RepositoryOptions {
    RepositoryOptions { name: name.into(), kind: InstanceKind::Cpu, max_batch_size: Some(4), ..Default::default() }
}

/// A request of `batch` images of `dims` whose data is `data`.
fn request(name: &str, dtype: u32, batch: usize, dims: &[usize], data: &[u8]) -> RequestData {
    let mut shape = vec![batch as i64];
    shape.extend(dims.iter().map(|&d| d as i64));
    // Two buffers, as Triton may hand an input in pieces.
    let half = data.len() / 2;
    let buffers = vec![
        Buffer { ptr: data.as_ptr(), len: half, memory: memory::CPU, device: 0 },
        Buffer { ptr: data[half..].as_ptr(), len: data.len() - half, memory: memory::CPU_PINNED, device: 0 },
    ];
    RequestData {
        inputs: vec![InputData { name: name.into(), datatype: dtype, shape, byte_size: data.len() as u64, buffers }],
        outputs: vec![],
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn a_written_graph_repository_loads_and_says_how_to_serve_it() {
    let out = temp_dir("graph");
    let w =
        write_repository(&ModelSource::Graph { graph: Box::new(tiny()), metadata: BTreeMap::new() }, &out, &cpu_options("tiny")).unwrap();
    assert!(w.model_file.ends_with("tiny/1/model.kiln.safetensors") && w.model_file.is_file());
    let text = std::fs::read_to_string(w.model_dir.join("config.pbtxt")).unwrap();
    for line in [
        "name: \"tiny\"",
        "backend: \"kiln\"",
        "max_batch_size: 4",
        "dims: [ 3, 8, 8 ]",
        "dims: [ 3 ]",
        "kind: KIND_CPU",
        "max_queue_delay_microseconds",
    ] {
        assert!(text.contains(line), "config.pbtxt lacks `{line}`:\n{text}");
    }
    let readme = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(readme.contains("tritonserver --model-repository=") && readme.contains("--backend-directory="), "{readme}");
    let model = load_written(&w).unwrap();
    assert_eq!(model.spec.inputs[0].dims, vec![3, 8, 8]);
    assert_eq!(model.spec.outputs[0].dims, vec![3]);
    assert!(model.accepts(&InputDims::from([("input".into(), vec![3, 8, 8])])));
    assert!(!model.accepts(&InputDims::from([("input".into(), vec![3, 9, 9])])));
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn a_profile_makes_varying_dims_minus_one_and_bounds_what_runs() {
    let out = temp_dir("profile");
    let profile = ProfileShapes {
        min: BTreeMap::from([("input".into(), vec![3, 4, 4])]),
        opt: None,
        max: BTreeMap::from([("input".into(), vec![3, 16, 16])]),
    };
    let options = RepositoryOptions { profile: Some(profile), ..cpu_options("dyn") };
    let w = write_repository(&ModelSource::Graph { graph: Box::new(tiny()), metadata: BTreeMap::new() }, &out, &options).unwrap();
    assert!(w.config_pbtxt.contains("dims: [ 3, -1, -1 ]") && w.config_pbtxt.contains("key: \"min_shapes\""), "{}", w.config_pbtxt);
    let model = load_written(&w).unwrap();
    assert!(model.accepts(&InputDims::from([("input".into(), vec![3, 5, 16])])));
    assert!(!model.accepts(&InputDims::from([("input".into(), vec![3, 32, 32])])));
    assert_eq!(model.accepted_text(), "input 3x4x4..3x16x16");
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn requests_of_one_batch_run_together_on_the_cpu_and_each_gets_its_own_rows() {
    let out = temp_dir("run");
    let w =
        write_repository(&ModelSource::Graph { graph: Box::new(tiny()), metadata: BTreeMap::new() }, &out, &cpu_options("tiny")).unwrap();
    let model = load_written(&w).unwrap();
    let per_image = 3 * 8 * 8;
    let x: Vec<f32> = (0..3 * per_image).map(|i| ((i * 37) % 101) as f32 / 10.0 - 4.0).collect();
    let (a, b) = (f32_bytes(&x[..per_image]), f32_bytes(&x[per_image..]));
    let reqs = [request("input", datatype::FP32, 1, &[3, 8, 8], &a), request("input", datatype::FP32, 2, &[3, 8, 8], &b)];
    let accepts = |d: &InputDims| model.accepts(d);
    let accepted = || model.accepted_text();
    let limits = Limits {
        spec: &model.spec,
        max_batch: model.max_batch(),
        declared_outputs: vec!["logits".into()],
        accepts: &accepts,
        accepted: &accepted,
    };
    let checked: Vec<_> = reqs.iter().map(|r| check_request(&limits, r).unwrap()).collect();
    let members = [Member { data: &reqs[0], checked: &checked[0], offset: 0 }, Member { data: &reqs[1], checked: &checked[1], offset: 1 }];
    let mut runner = CpuRunner::new();
    runner.run(&model, &checked[0].dims, &members, 3).unwrap();
    assert_eq!(runner.output_dims("logits").unwrap(), vec![3]);
    let mut second = vec![0f32; 6];
    let dst = Dest { place: Place::host(second.as_mut_ptr().cast()), len: 24 };
    runner.write_output("logits", 1, 2, dst).unwrap();
    let expected = run_cpu(&tiny(), &[("input", &HostTensor::new(vec![3, 3, 8, 8], x))]).unwrap();
    assert_eq!(second, expected["logits"].data[3..]);
    let small = Dest { place: Place::host(second.as_mut_ptr().cast()), len: 8 };
    assert!(runner.write_output("logits", 1, 2, small).unwrap_err().to_string().contains("Triton gave 8 bytes for 24"));
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn a_u8_input_is_served_as_uint8() {
    let out = temp_dir("u8");
    let w = write_repository(&ModelSource::Graph { graph: Box::new(tiny_u8()), metadata: BTreeMap::new() }, &out, &cpu_options("bytes"))
        .unwrap();
    assert!(w.config_pbtxt.contains("data_type: TYPE_UINT8"), "{}", w.config_pbtxt);
    let model = load_written(&w).unwrap();
    assert_eq!(model.spec.inputs[0].elem, ElemType::U8);
    let data: Vec<u8> = (0..48).map(|i| (i * 5) as u8).collect();
    let req = request("image", datatype::UINT8, 1, &[3, 4, 4], &data);
    let accepts = |d: &InputDims| model.accepts(d);
    let accepted = || model.accepted_text();
    let limits = Limits { spec: &model.spec, max_batch: 4, declared_outputs: vec!["mean".into()], accepts: &accepts, accepted: &accepted };
    let checked = check_request(&limits, &req).unwrap();
    let mut runner = CpuRunner::new();
    runner.run(&model, &checked.dims, &[Member { data: &req, checked: &checked, offset: 0 }], 1).unwrap();
    let mut got = [0f32; 3];
    runner.write_output("mean", 0, 1, Dest { place: Place::host(got.as_mut_ptr().cast()), len: 12 }).unwrap();
    for (c, g) in got.iter().enumerate() {
        let want = data[c * 16..(c + 1) * 16].iter().map(|&b| b as f32 / 255.0).sum::<f32>() / 16.0;
        assert!((g - want).abs() < 1e-6, "channel {c}: {g} vs {want}");
    }
    let wrong = request("image", datatype::FP32, 1, &[3, 4, 4], &[0u8; 192]);
    assert!(check_request(&limits, &wrong).unwrap_err().to_string().contains("is FP32, but the model takes UINT8"));
    let _ = std::fs::remove_dir_all(out);
}

/// An engine file for sm_90 holding `graph` with batch range `1..=max` (no GPU needed to write one).
fn engine_file(graph: Graph, max: usize, path: &std::path::Path) {
    let header = Header { version: FORMAT_VERSION, sm: 90, driver_version: 13000, cudnn_version: 91400 };
    let payload = Payload { config: BuildConfig::default().batch(1, max, max), graph, tactics: BTreeMap::new() };
    std::fs::write(path, encode_engine_file(&header, &payload).unwrap()).unwrap();
}

#[test]
fn an_engine_files_batch_range_decides_max_batch_size() {
    let out = temp_dir("engine");
    let file = out.join("tiny.kiln");
    engine_file(tiny(), 4, &file);
    let options = RepositoryOptions { max_batch_size: None, ..cpu_options("eng") };
    let w = write_repository(&ModelSource::from_path(&file), &out.join("repo"), &options).unwrap();
    assert!(w.model_file.ends_with("eng/1/model.kiln") && w.config_pbtxt.contains("max_batch_size: 4"), "{}", w.config_pbtxt);
    assert_eq!(ModelSource::from_path(&file).default_name(), "tiny");
    assert_eq!(ModelSource::from_path("x/resnet18.kiln.safetensors").default_name(), "resnet18");
    // The engine's graph runs on the CPU executor too.
    let model = load_written(&w).unwrap();
    assert_eq!(model.spec.batch, Some((1, 4)));
    // A config asking for more than the engine runs fails, naming both.
    let options = RepositoryOptions { max_batch_size: Some(8), ..cpu_options("eng") };
    let e = write_repository(&ModelSource::from_path(&file), &out.join("repo2"), &options).unwrap_err().to_string();
    assert!(e.contains("max_batch_size: is 8, but model.kiln runs batches 1..=4"), "{e}");
    // As the backend sees it when config.pbtxt is edited by hand.
    let mut config = crate::repository::read_written_config(&w).unwrap();
    config.max_batch_size = 16;
    let e = crate::model::LoadedModel::load(config, &w.model_dir.join("1")).err().unwrap().to_string();
    assert!(e.contains("is 16, but model.kiln runs batches 1..=4"), "{e}");
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn a_version_folder_with_no_or_two_model_files_is_refused() {
    let out = temp_dir("files");
    let w = write_repository(&ModelSource::Graph { graph: Box::new(tiny()), metadata: BTreeMap::new() }, &out, &cpu_options("m")).unwrap();
    let config = crate::repository::read_written_config(&w).unwrap();
    engine_file(tiny(), 4, &w.model_dir.join("1/model.kiln"));
    let e = crate::model::LoadedModel::load(config.clone(), &w.model_dir.join("1")).err().unwrap().to_string();
    assert!(e.contains("both model.kiln and model.kiln.safetensors"), "{e}");
    let e = crate::model::LoadedModel::load(config, &out.join("nowhere")).err().unwrap().to_string();
    assert!(e.contains("no model file"), "{e}");
    let _ = std::fs::remove_dir_all(out);
}

/// On the device (`cargo test --release -p kiln-triton -- --ignored`): the GPU runner as
/// `execute` drives it, on a graph file built into an FP32 engine on GPU 0 (then loaded from the
/// cache), with inputs and outputs in host and in device memory, at two sizes of a profile.
#[test]
#[ignore = "needs a GPU"]
fn the_gpu_runner_matches_the_cpu_executor_from_host_and_device_memory() {
    gpu_runner_case("gpu", 0, 0);
}

/// On a two-GPU device: an instance on GPU 1 serves requests whose input and output buffers live
/// on GPU 0 (where perf_analyzer's CUDA shared memory sits): peer copies both ways.
#[test]
#[ignore = "needs two GPUs"]
fn an_instance_on_gpu_1_reads_and_writes_buffers_on_gpu_0() {
    if crate::kiln_api::gpu_available().is_ok() && cudarc::driver::CudaContext::device_count().unwrap_or(0) < 2 {
        eprintln!("skipped: one GPU");
        return;
    }
    gpu_runner_case("peer", 1, 0);
}

/// Runs the tiny model on GPU `on` with request 0 in host memory and request 1 (input and output)
/// in device memory of GPU `data`, against the CPU executor.
fn gpu_runner_case(name: &str, on: usize, data: usize) {
    use crate::kiln_api::{gpu_available, Precision};
    use crate::runner::GpuRunner;
    use cudarc::driver::result as drv;
    if let Err(reason) = gpu_available() {
        eprintln!("skipped: {reason}");
        return;
    }
    let out = temp_dir(name);
    let profile = ProfileShapes {
        min: BTreeMap::from([("input".into(), vec![3, 4, 4])]),
        opt: None,
        max: BTreeMap::from([("input".into(), vec![3, 16, 16])]),
    };
    let options = RepositoryOptions {
        name: "tiny".into(),
        kind: InstanceKind::Gpu,
        max_batch_size: Some(4),
        precision: Some(Precision::Fp32),
        profile: Some(profile),
        ..Default::default()
    };
    let w = write_repository(&ModelSource::Graph { graph: Box::new(tiny()), metadata: BTreeMap::new() }, &out, &options).unwrap();
    let logged = std::sync::Mutex::new(Vec::<String>::new());
    let log = |m: &str| logged.lock().unwrap().push(m.to_string());
    let engine = load_written(&w).unwrap().engine(on, &log).unwrap();
    drop(engine);
    let model = load_written(&w).unwrap();
    let engine = model.engine(on, &log).unwrap();
    assert!(logged.lock().unwrap().iter().any(|m| m.contains("loaded the cached engine")), "{:?}", logged.lock().unwrap());
    let mut runner = GpuRunner::new(engine.clone(), on).unwrap();
    if on != data {
        assert!(runner.peers().contains(&data), "GPU {on} has no peer access to GPU {data}: {:?}", runner.peers());
    }
    let data_ctx = cudarc::driver::CudaContext::new(data).unwrap();
    for dims in [[3usize, 8, 8], [3, 12, 16]] {
        let per_image: usize = dims.iter().product();
        let x: Vec<f32> = (0..3 * per_image).map(|i| ((i * 37) % 101) as f32 / 10.0 - 4.0).collect();
        let want = run_cpu(
            &tiny().with_input_dims(&InputDims::from([("input".into(), dims.to_vec())])).unwrap(),
            &[("input", &HostTensor::new(vec![3, dims[0], dims[1], dims[2]], x.clone()))],
        )
        .unwrap();
        // Request 0 (one image) from the host; request 1 (two images) from device memory.
        let a = f32_bytes(&x[..per_image]);
        let b = f32_bytes(&x[per_image..]);
        data_ctx.bind_to_thread().unwrap();
        // SAFETY: a fresh allocation of b's size, filled from `b` and freed at the end of the loop.
        let dev_in = unsafe { drv::malloc_sync(b.len()) }.unwrap();
        // SAFETY: `dev_in` holds `b.len()` bytes.
        unsafe { drv::memcpy_htod_sync(dev_in, &b) }.unwrap();
        // SAFETY: freed below, after the copy back.
        let dev_out = unsafe { drv::malloc_sync(24) }.unwrap();
        let mut on_device = request("input", datatype::FP32, 2, &dims, &b);
        on_device.inputs[0].buffers = vec![Buffer { ptr: dev_in as *const u8, len: b.len(), memory: memory::GPU, device: data as i64 }];
        let reqs = [request("input", datatype::FP32, 1, &dims, &a), on_device];
        let accepts = |d: &InputDims| model.accepts(d);
        let accepted = || model.accepted_text();
        let limits =
            Limits { spec: &model.spec, max_batch: 4, declared_outputs: vec!["logits".into()], accepts: &accepts, accepted: &accepted };
        let checked: Vec<_> = reqs.iter().map(|r| check_request(&limits, r).unwrap()).collect();
        let members =
            [Member { data: &reqs[0], checked: &checked[0], offset: 0 }, Member { data: &reqs[1], checked: &checked[1], offset: 1 }];
        runner.run(&model, &checked[0].dims, &members, 3).unwrap();
        assert_eq!(runner.output_dims("logits").unwrap(), vec![3]);
        // Output of request 0 to the host, of request 1 to device memory; neither is written before `finish`.
        let mut first = [0f32; 3];
        runner.write_output("logits", 0, 1, Dest { place: Place::host(first.as_mut_ptr().cast()), len: 12 }).unwrap();
        let small = Dest { place: Place { ptr: dev_out, memory: memory::GPU, device: data as i64 }, len: 20 };
        assert!(runner.write_output("logits", 1, 2, small).unwrap_err().to_string().contains("Triton gave 20 bytes for 24"));
        runner
            .write_output("logits", 1, 2, Dest { place: Place { ptr: dev_out, memory: memory::GPU, device: data as i64 }, len: 24 })
            .unwrap();
        runner.finish().unwrap();
        let mut rest = [0f32; 6];
        data_ctx.bind_to_thread().unwrap();
        // SAFETY: `dev_out` holds 24 bytes, written by the finished copy.
        unsafe { drv::memcpy_dtoh_sync(&mut rest, dev_out) }.unwrap();
        // SAFETY: neither allocation is used after this.
        unsafe { drv::free_sync(dev_in) }.unwrap();
        // SAFETY: as above.
        unsafe { drv::free_sync(dev_out) }.unwrap();
        let got: Vec<f32> = first.iter().chain(&rest).copied().collect();
        let err = got.iter().zip(&want["logits"].data).map(|(g, w)| (g - w).abs() / w.abs().max(1e-6)).fold(0f32, f32::max);
        assert!(err < 1e-5, "dims {dims:?}: {got:?} vs {:?}", want["logits"].data);
    }
    let _ = std::fs::remove_dir_all(out);
}

/// `--max-batch-size 1099511627776` was written to config.pbtxt, which Triton (an int32 field)
/// cannot load; past Kiln's batch limit it is refused, naming the field.
#[test]
fn a_max_batch_size_past_kilns_limit_is_refused() {
    let out = temp_dir("max-batch");
    let source = ModelSource::Graph { graph: Box::new(tiny()), metadata: BTreeMap::new() };
    for huge in [1usize << 40, crate::kiln_api::MAX_BATCH + 1, usize::MAX] {
        let options = RepositoryOptions { max_batch_size: Some(huge), ..cpu_options("big") };
        let e = write_repository(&source, &out, &options).expect_err("too large").to_string();
        assert!(e.contains("max_batch_size") && e.contains(&format!("is {}", i64::try_from(huge).unwrap_or(i64::MAX))), "{e}");
        assert!(!out.join("big").exists(), "nothing is written");
    }
    let options = RepositoryOptions { max_batch_size: Some(crate::kiln_api::MAX_BATCH), ..cpu_options("big") };
    write_repository(&source, &out, &options).expect("the limit itself");
    let _ = std::fs::remove_dir_all(out);
}

/// The server command (printed, and in the README) quotes what a shell would split: `-o "my
/// repo"` gave a broken command; a control character (a newline would start a second command
/// line in the README) is refused.
#[test]
fn the_server_command_quotes_its_paths_and_refuses_control_characters() {
    let out = temp_dir("quoted").join("my repo");
    let source = ModelSource::Graph { graph: Box::new(tiny()), metadata: BTreeMap::new() };
    let options = RepositoryOptions { backend_directory: Some("/opt/it's here".into()), ..cpu_options("tiny") };
    let w = write_repository(&source, &out, &options).expect("written");
    let repo = std::path::absolute(&out).expect("absolute");
    assert_eq!(w.serve_command, format!("tritonserver --model-repository='{}' --backend-directory='/opt/it'\\''s here'", repo.display()));
    let readme = std::fs::read_to_string(out.join("README.md")).expect("readme");
    assert!(readme.contains(&w.serve_command), "{readme}");
    // A plain path stays as it is.
    let plain = RepositoryOptions { backend_directory: Some("/opt/tritonserver/backends".into()), ..cpu_options("tiny") };
    let w = write_repository(&source, &out, &plain).expect("written");
    assert!(w.serve_command.ends_with(" --backend-directory=/opt/tritonserver/backends"), "{}", w.serve_command);
    let newline = RepositoryOptions { backend_directory: Some("/opt\nrm -rf /".into()), ..cpu_options("tiny") };
    let e = write_repository(&source, &out, &newline).expect_err("newline").to_string();
    assert!(e.contains("backend_directory") && e.contains("control character"), "{e}");
    let e = write_repository(&source, &out.join("a\nb"), &cpu_options("tiny")).expect_err("newline").to_string();
    assert!(e.contains("output") && e.contains("control character"), "{e}");
    let _ = std::fs::remove_dir_all(out.parent().expect("temp dir"));
}

/// A field of /proc/self/status in kB (`VmRSS`, `VmHWM`).
fn status_kb(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix(field)?.trim_start_matches(':').trim().strip_suffix("kB")?.trim().parse().ok()).unwrap_or(0)
}

/// Where a CPU instance's memory goes (docs/SERVING.md): ResNet-18 at 224x224 with seeded
/// weights, loaded as the backend loads it, then 30 rounds of 12 requests of batch 1 to 4 through
/// the CPU runner; the resident size after each round. `cargo test --release -p kiln-triton --lib
/// -- --ignored --nocapture cpu_instance_memory_levels_off`.
#[test]
#[ignore = "a measurement (about a minute on two cores)"]
fn cpu_instance_memory_levels_off() {
    let start = status_kb("VmRSS");
    let out = temp_dir("memory");
    let source = crate::bundled_source("resnet18", None, None).expect("traced");
    let w = write_repository(&source, &out, &RepositoryOptions { max_batch_size: Some(4), ..cpu_options("rn18") }).expect("written");
    drop(source);
    let model = load_written(&w).expect("loaded");
    let loaded = status_kb("VmRSS");
    let per_image = 3 * 224 * 224;
    let images: Vec<Vec<u8>> =
        (1..=4).map(|b| f32_bytes(&(0..b * per_image).map(|i| ((i * 31) % 97) as f32 / 50.0 - 1.0).collect::<Vec<_>>())).collect();
    let accepts = |d: &InputDims| model.accepts(d);
    let accepted = || model.accepted_text();
    let limits =
        Limits { spec: &model.spec, max_batch: 4, declared_outputs: vec!["logits".into()], accepts: &accepts, accepted: &accepted };
    let mut runner = CpuRunner::new();
    let mut rounds = Vec::new();
    for _ in 0..30 {
        for i in 0..12 {
            let batch = 1 + i % 4;
            let req = request("input", datatype::FP32, batch, &[3, 224, 224], &images[batch - 1]);
            let checked = check_request(&limits, &req).expect("valid");
            runner.run(&model, &checked.dims, &[Member { data: &req, checked: &checked, offset: 0 }], batch).expect("ran");
            let mut logits = vec![0f32; batch * 1000];
            let dst = Dest { place: Place::host(logits.as_mut_ptr().cast()), len: logits.len() * 4 };
            runner.write_output("logits", 0, batch, dst).expect("written");
            assert!(logits.iter().all(|v| v.is_finite()));
        }
        rounds.push(status_kb("VmRSS"));
    }
    println!("CPU instance memory (kB): before {start}, loaded {loaded}, after each round {rounds:?}, peak {}", status_kb("VmHWM"));
    // Levels off: the last twenty rounds hold no more than the tenth did, give or take 8 MiB.
    assert!(rounds[10..].iter().all(|&r| r <= rounds[9] + 8192), "{rounds:?}");
    let _ = std::fs::remove_dir_all(out);
}
