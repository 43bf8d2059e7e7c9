//! Hostile and mistaken inputs through the `kiln` binary, each of which once aborted, ran out of
//! memory, answered silently or misled (docs/RELIABILITY.md, "Bounds of every reader"). Each test
//! runs the command within 2 GB of address space and 10 s, and checks the typed error (exit 1, no
//! panic) or the correct answer.

mod common;

use common::*;

use kiln::plugin::{ConvAttrs, Norm, Op};
use kiln::{Graph, HostTensor};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The address space every run gets, in kB (`ulimit -v`): 2 GB.
const ADDRESS_SPACE_KB: u64 = 2_000_000;

/// The longest a run may take.
const MAX_SECONDS: u64 = 10;

/// Runs `kiln args` in `dir` under `ulimit -v limit_kb` (none when 0); a run over
/// [`MAX_SECONDS`] is killed and fails the test.
fn kiln_limited(dir: &Path, limit_kb: u64, args: &[&str]) -> Output {
    let prefix = if limit_kb > 0 { format!("ulimit -v {limit_kb};") } else { String::new() };
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!("{prefix} exec \"$0\" \"$@\""))
        .arg(kiln_exe())
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the kiln binary");
    let start = Instant::now();
    while child.try_wait().expect("try_wait").is_none() {
        if start.elapsed() > Duration::from_secs(MAX_SECONDS) {
            child.kill().expect("kill");
            panic!("kiln {args:?} ran past {MAX_SECONDS} s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

fn kiln(dir: &Path, args: &[&str]) -> Output {
    kiln_limited(dir, ADDRESS_SPACE_KB, args)
}

/// Asserts a clean error (exit 1, no panic or abort) whose stderr says each of `says`.
fn refused(args: &[&str], out: &Output, says: &[&str]) {
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "kiln {args:?}: {:?}\nstdout: {stdout}\nstderr: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    for s in says {
        assert!(stderr.contains(s), "kiln {args:?}: expected `{s}` in stderr: {stderr}");
    }
}

/// Asserts exit 0 and returns stdout and stderr.
fn succeeded(args: &[&str], out: &Output) -> (String, String) {
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    assert_eq!(out.status.code(), Some(0), "kiln {args:?}: {:?}\nstdout: {stdout}\nstderr: {stderr}", out.status);
    (stdout, stderr)
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/pth").join(name)
}

/// A 50 MB pickle of empty lists took 8 GB and aborted; the pickle machine's stack bound
/// refuses it at the byte that passes it.
#[test]
fn a_pickle_of_fifty_million_lists_is_refused_at_the_stack_bound() {
    let dir = temp_dir("deep");
    let mut bytes = b"\x80\x02".to_vec();
    bytes.resize(2 + 50_000_000, b']');
    bytes.push(b'.');
    std::fs::write(dir.join("deep.pth"), bytes).expect("write");
    let args = ["run", "mobilenet_v2", "--cpu", "--weights", "deep.pth"];
    refused(&args, &kiln(&dir, &args), &["deep.pth: its pickle passes the limit of 1048576 values on the stack at byte 1048578"]);
    std::fs::remove_dir_all(&dir).ok();
}

/// A PNG of 32768x1 pixels, which `Resize(256)` makes 8,388,608x256 (6.6 GB, or an abort), is
/// classified at the cost of its crop.
#[test]
fn a_thin_image_is_classified_within_bounds() {
    let dir = temp_dir("thin");
    let thin = kiln_vision::RgbImage::from_pixel(32768, 1, kiln_vision::image::Rgb([128, 128, 128]));
    kiln_vision::save_png(&thin, dir.join("thin.png")).expect("png");
    let args = ["run", "resnet18", "--cpu", "--image", "thin.png", "--top", "1"];
    let (stdout, _) = succeeded(&args, &kiln(&dir, &args));
    assert!(stdout.contains("thin.png: top-1:"), "{stdout}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A reference whose `input` declares [1, 3, 27000, 27000] (a sparse 8.7 GB file) was decoded
/// (17.1 GB, up to 32 s) before its limit applied; its header decides now, as `run --input`'s
/// does (with no address-space limit: the file is mapped, not read).
#[test]
fn a_reference_input_over_the_limit_is_refused_from_its_header() {
    let dir = temp_dir("bigref");
    let n: u64 = 3 * 27000 * 27000;
    let header = format!("{{\"input\":{{\"dtype\":\"F32\",\"shape\":[1,3,27000,27000],\"data_offsets\":[0,{}]}}}}", 4 * n);
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    let path = dir.join("x_big.safetensors");
    std::fs::write(&path, &bytes).expect("write");
    std::fs::OpenOptions::new().write(true).open(&path).expect("open").set_len(bytes.len() as u64 + 4 * n).expect("sparse");
    for flag in ["--reference", "--load-outputs"] {
        let args = ["compare", "resnet18", "--cpu", flag, "x_big.safetensors"];
        let started = Instant::now();
        refused(
            &args,
            &kiln_limited(&dir, 0, &args),
            &["reference tensor `input` of shape [1, 3, 27000, 27000] in x_big.safetensors is too large: 2187000000 elements"],
        );
        assert!(started.elapsed() < Duration::from_secs(2), "{flag}: {:?}", started.elapsed());
    }
    // Within 2 GB of address space the file cannot even be mapped: named as such.
    let args = ["compare", "resnet18", "--cpu", "--reference", "x_big.safetensors"];
    refused(&args, &kiln(&dir, &args), &["out of memory: mapping x_big.safetensors (only ", "(ulimit -v)) needs "]);
    std::fs::remove_dir_all(&dir).ok();
}

/// A JPEG cut in half decoded with grey rows and changed the answer without a word; it is
/// refused, `--accept-truncated-images` decodes it with a warning, and a JPEG missing only its
/// end marker is whole.
#[test]
fn a_truncated_jpeg_is_refused_unless_accepted() {
    let dir = temp_dir("jpeg");
    let photo =
        kiln_vision::RgbImage::from_fn(160, 120, |x, y| kiln_vision::image::Rgb([(x * 3) as u8, (y * 2) as u8, ((x + y) % 256) as u8]));
    let mut jpeg = std::io::Cursor::new(Vec::new());
    kiln_vision::image::DynamicImage::ImageRgb8(photo).write_to(&mut jpeg, kiln_vision::image::ImageFormat::Jpeg).expect("jpeg");
    let jpeg = jpeg.into_inner();
    std::fs::write(dir.join("half.jpg"), &jpeg[..jpeg.len() / 2]).expect("write");
    std::fs::write(dir.join("no_end.jpg"), &jpeg[..jpeg.len() - 2]).expect("write");
    let args = ["run", "resnet18", "--cpu", "--image", "half.jpg", "--top", "1"];
    refused(&args, &kiln(&dir, &args), &["cannot read image half.jpg: it is truncated (", "--accept-truncated-images decodes it anyway"]);
    let args = ["run", "resnet18", "--cpu", "--image", "half.jpg", "--top", "1", "--accept-truncated-images"];
    let (stdout, stderr) = succeeded(&args, &kiln(&dir, &args));
    assert!(stderr.contains("warning: half.jpg is truncated (") && stdout.contains("half.jpg: top-1:"), "{stdout}\n{stderr}");
    let args = ["run", "resnet18", "--cpu", "--image", "no_end.jpg", "--top", "1"];
    let (stdout, stderr) = succeeded(&args, &kiln(&dir, &args));
    assert!(stdout.contains("no_end.jpg: top-1:") && !stderr.contains("truncated"), "{stdout}\n{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

/// input [1, 3, 4, 4] → 1x1 conv to 2 channels: the output `name`, [1, 2, 4, 4]; `norm` puts a
/// BatchNorm2d of that eps after the conv.
fn small_graph(name: &str, norm: Option<f32>) -> Graph {
    let mut g = Graph::default();
    let x = g.push_unchecked(Op::Input { name: "input".into() }, vec![], vec![1, 3, 4, 4], "input".into());
    let w = g.weight("conv.weight", Arc::new(HostTensor::new(vec![2, 3, 1, 1], vec![0.5, -0.25, 1.0, 0.125, 0.75, -1.0])));
    let mut y = g.push(Op::Conv(ConvAttrs::default()), vec![x, w], "conv".into()).expect("conv");
    if let Some(eps) = norm {
        let params = ["weight", "bias", "running_mean", "running_var"]
            .map(|p| g.weight(&format!("bn.{p}"), Arc::new(HostTensor::new(vec![2], vec![1.0; 2]))));
        let inputs = [vec![y], params.to_vec()].concat();
        y = g.push(Op::Norm(Norm::BatchNorm2d { eps: 1e-5 }), inputs, "bn".into()).expect("bn");
        g.nodes[y].op = Op::Norm(Norm::BatchNorm2d { eps });
    }
    g.inputs.push(x);
    g.mark_output(name, y);
    g
}

/// An output named `logits` that is not [N, classes] (a segmentation model's [N, C, H, W], as
/// Hugging Face names it) printed nothing but the header and the timing; it is shown as its
/// shape and range.
#[test]
fn a_logits_output_that_is_not_class_scores_is_still_shown() {
    let dir = temp_dir("seg");
    small_graph("logits", None).save(dir.join("seg.kiln.safetensors")).expect("save");
    let args = ["run", "seg.kiln.safetensors", "--cpu"];
    let (stdout, _) = succeeded(&args, &kiln(&dir, &args));
    assert!(stdout.contains("logits: [1, 2, 4, 4], min "), "{stdout}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A graph file's BatchNorm with eps -1 passed validation and gave NaN outputs.
#[test]
fn a_graph_files_batch_norm_with_eps_minus_one_is_refused() {
    let dir = temp_dir("eps");
    small_graph("y", Some(-1.0)).save(dir.join("eps.kiln.safetensors")).expect("save");
    let args = ["run", "eps.kiln.safetensors", "--cpu"];
    refused(&args, &kiln(&dir, &args), &["invalid graph: node %", "(`bn`): batch_norm2d: eps must be positive and finite, got -1"]);
    std::fs::remove_dir_all(&dir).ok();
}

/// `--max-batch-size 1099511627776` was written to config.pbtxt (Triton's field is an int32);
/// the server command was not quoted (`-o "my repo"`), and a newline could put a second command
/// line into the README.
#[test]
fn triton_repo_bounds_its_batch_and_quotes_its_command() {
    let dir = temp_dir("triton");
    let args = ["triton-repo", "resnet18", "--cpu", "-o", "repo", "--max-batch-size", "1099511627776"];
    refused(&args, &kiln(&dir, &args), &["--max-batch-size must be at most 1048576 (Kiln's largest engine batch), got 1099511627776"]);
    assert!(!dir.join("repo").exists());
    let args = ["triton-repo", "resnet18", "--cpu", "-o", "my repo", "--backend-directory", "/opt/tritonserver/backends"];
    let (stdout, _) = succeeded(&args, &kiln(&dir, &args));
    let repo = std::path::absolute(dir.join("my repo")).expect("absolute");
    let command = format!("tritonserver --model-repository='{}' --backend-directory=/opt/tritonserver/backends", repo.display());
    assert!(stdout.contains(&command), "{stdout}");
    assert!(std::fs::read_to_string(dir.join("my repo/README.md")).expect("readme").contains(&command));
    let args = ["triton-repo", "resnet18", "--cpu", "-o", "repo", "--backend-directory", "/opt\nrm -rf /"];
    refused(&args, &kiln(&dir, &args), &["--backend-directory \"/opt\\nrm -rf /\" holds a control character"]);
    std::fs::remove_dir_all(&dir).ok();
}

/// Weights files that are not what they seem: a zip naming a member twice (the reader kept the
/// last, and the error said a weight was missing), a text file, a PNG, an empty zip (all three
/// "cannot read safetensors file").
#[test]
fn weights_files_of_the_wrong_kind_are_named_for_what_they_are() {
    let dir = temp_dir("weights");
    let zip = std::fs::read(fixture("tiny.zip.pth")).expect("fixture");
    let from = b"tiny.zip/data/2";
    let mut twice = zip.clone();
    for at in (0..zip.len() - from.len()).filter(|&i| &zip[i..i + from.len()] == from) {
        twice[at..at + from.len()].copy_from_slice(b"tiny.zip/data/1");
    }
    std::fs::write(dir.join("twice.pth"), twice).expect("write");
    std::fs::write(dir.join("notes.txt"), "these are not weights\n").expect("write");
    kiln_vision::save_png(&kiln_vision::RgbImage::new(4, 4), dir.join("cat.png")).expect("png");
    std::fs::write(dir.join("empty.zip"), [&b"PK\x05\x06"[..], &[0u8; 18]].concat()).expect("write");
    for (file, says) in [
        ("twice.pth", "cannot read PyTorch checkpoint twice.pth: the zip archive names one member twice"),
        ("notes.txt", "cannot read weights file notes.txt: is a text file, neither a safetensors file nor a PyTorch checkpoint"),
        ("cat.png", "cannot read weights file cat.png: is a PNG image"),
        ("empty.zip", "cannot read PyTorch checkpoint empty.zip: is an empty zip archive"),
    ] {
        let args = ["run", "resnet18", "--cpu", "--weights", file];
        refused(&args, &kiln(&dir, &args), &[says]);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `run yolov8n --save <a directory>` said "cannot read image X: cannot write image X: Is a
/// directory"; it is named as the flag's mistake before the model runs.
#[test]
fn save_into_a_directory_is_the_flags_mistake() {
    let dir = temp_dir("save");
    std::fs::create_dir_all(dir.join("out")).expect("dir");
    kiln_vision::save_png(&kiln_vision::RgbImage::new(64, 48), dir.join("street.png")).expect("png");
    let args = ["run", "yolov8n", "--cpu", "--image", "street.png", "--save", "out"];
    refused(&args, &kiln(&dir, &args), &["--save out is a directory; give the path of the PNG file to write (e.g. out/boxes.png)"]);
    std::fs::remove_dir_all(&dir).ok();
}

/// A file read whole (an engine file, a calibration cache) larger than the memory left was read
/// until the allocation aborted; its size is checked first. A sparse 64 GB "engine file".
#[test]
fn a_file_read_whole_is_checked_against_the_memory_left() {
    let dir = temp_dir("whole");
    let path = dir.join("huge.kiln");
    std::fs::write(&path, b"KILNENG\0").expect("write");
    std::fs::OpenOptions::new().write(true).open(&path).expect("open").set_len(64 << 30).expect("sparse");
    let args = ["run", "huge.kiln", "--cpu"];
    let out = Command::new(kiln_exe()).args(args).current_dir(&dir).env("KILN_CPU_MEMORY_BYTES", "100000000").output().expect("run");
    refused(
        &args,
        &out,
        &["out of memory: reading huge.kiln (only 100000000 bytes are available (KILN_CPU_MEMORY_BYTES)) needs 68719476736 bytes"],
    );
    std::fs::remove_dir_all(&dir).ok();
}
