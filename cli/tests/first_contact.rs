//! Issue 42's first contact, through the `kiln` binary: a newcomer's first commands on a graph file
//! as kiln-torch writes it (inputs named after `forward`'s arguments, one output called `output`,
//! random weights marked in the metadata). One test per problem, `pN_` after its number.

mod common;

use common::*;

use kiln::nn::{AdaptiveAvgPool2d, Conv2d, Conv2dConfig, Linear, LinearConfig};
use kiln::{Forward, Graph, HostTensor, Module, Tracer, VarBuilder};
use std::collections::BTreeMap;
use std::path::Path;

/// Writes `graph` as kiln-torch does: model `model`, random weights marked as such.
fn write_as_kiln_torch(graph: &Graph, path: &Path, model: &str) {
    let meta = BTreeMap::from([
        ("model".to_string(), model.to_string()),
        ("weights".to_string(), "random (torch init, seed 0)".to_string()),
        (kiln::files::graph::KEY_RANDOM_WEIGHTS.to_string(), "true".to_string()),
        ("kiln.tool".to_string(), "kiln-torch 0.1.0".to_string()),
    ]);
    kiln::files::graph::write(graph, path, &meta).expect("write graph file");
}

/// A tiny classifier as kiln-torch exports one: input `x` [1, 3, 16, 16], conv, pooled, a linear
/// layer to `classes` scores, output `output` (or `name`).
fn classifier(classes: usize, name: &str) -> Graph {
    let vb = VarBuilder::seeded();
    let conv = Conv2d::load(vb.pp("features"), &Conv2dConfig::new(3, 8, 3).padding(1)).expect("conv");
    let gap = AdaptiveAvgPool2d::load(vb.pp("avgpool"), &[1, 1]).expect("gap");
    let fc = Linear::load(vb.pp("fc"), &LinearConfig::new(8, classes)).expect("fc");
    let t = Tracer::new();
    let x = t.input("x", &[1, 3, 16, 16]);
    let y = conv.forward(&x).and_then(|y| gap.forward(&y)).and_then(|y| y.flatten(1)).and_then(|y| fc.forward(&y)).expect("trace");
    t.output(name, &y);
    t.graph()
}

/// A 24x20 photo as a binary PPM (one of the formats `--image` reads).
fn photo(path: &Path) {
    let mut bytes = b"P6\n24 20\n255\n".to_vec();
    bytes.extend((0..24 * 20 * 3).map(|i| (i * 7 % 256) as u8));
    std::fs::write(path, bytes).expect("write photo");
}

#[test]
fn p1_an_imported_classifier_names_its_classes_with_and_without_image() {
    let dir = temp_dir("p1");
    let model = dir.join("rn.kiln.safetensors");
    write_as_kiln_torch(&classifier(1000, "output"), &model, "mynet");
    let out = kiln(&["run", arg(&model), "--cpu", "--seed", "1", "--top", "3"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("image 0: top-3:"), "a [N, 1000] output is read as class scores:\n{stdout}");
    let names = kiln_vision::imagenet_classes();
    let class_lines: Vec<&str> = stdout.lines().filter(|l| l.trim_start().starts_with("class ")).collect();
    assert_eq!(class_lines.len(), 3, "{stdout}");
    for line in class_lines {
        let class: usize = line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).expect("a class number");
        assert!(line.ends_with(names[class]), "each class is named: {line}");
    }
    assert!(!stdout.contains("output: [1, 1000], min"), "not summarised as a range too:\n{stdout}");

    let cat = dir.join("cat.ppm");
    photo(&cat);
    let out = kiln(&["run", arg(&model), "--cpu", "--image", arg(&cat), "--top", "2"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains(&format!("{}: top-2:", cat.display())), "{stdout}");
    let printed: Vec<&str> = stdout.lines().filter(|l| l.trim_start().starts_with("p ")).collect();
    assert_eq!(printed.len(), 2, "{stdout}");
    assert!(printed.iter().all(|l| names.iter().any(|n| l.contains(n))), "named classes: {printed:?}");

    // A bundled model's name with no scores to read: the message calls the output an output.
    let other = dir.join("other.kiln.safetensors");
    write_as_kiln_torch(&classifier(10, "scores"), &other, "mobilenet_v2");
    let stderr = fails_with(
        &["run", arg(&other), "--cpu", "--image", arg(&cat)],
        &["output `logits`:", "has no such output to read (its outputs: [\"scores\"])", "--output-name logits"],
    );
    assert!(!stderr.contains("input `logits`"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two inputs, `x` and `mask`, named as kiln-torch names them: `out = x * mask + x`.
fn two_inputs() -> Graph {
    let t = Tracer::new();
    let x = t.input("x", &[1, 4]);
    let mask = t.input("mask", &[1, 4]);
    let y = x.mul(&mask).and_then(|y| y.add(&x)).expect("trace");
    t.output("out", &y);
    t.graph()
}

fn write_reference(path: &Path, tensors: &[(&str, &HostTensor)]) {
    let map: BTreeMap<String, HostTensor> = tensors.iter().map(|(k, v)| (k.to_string(), HostTensor::clone(v))).collect();
    kiln::files::write_safetensors(path, &map).expect("write reference");
}

#[test]
fn p3_compare_binds_the_reference_by_input_name_with_several_inputs_and_old_files() {
    let dir = temp_dir("p3");
    let model = dir.join("two.kiln.safetensors");
    let graph = two_inputs();
    write_as_kiln_torch(&graph, &model, "TwoInputs");
    let x = HostTensor::new(vec![2, 4], vec![1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 0.0, 2.0]);
    let mask = HostTensor::new(vec![2, 4], vec![0.0, 1.0, 2.0, -1.0, 1.0, 1.0, 3.0, 0.5]);
    let out = kiln::run_cpu(&graph, &[("x", &x), ("mask", &mask)]).expect("run").remove("out").expect("out");
    let reference = dir.join("two.reference.safetensors");
    write_reference(&reference, &[("input.x", &x), ("input.mask", &mask), ("output.out", &out)]);
    let run = kiln(&["compare", arg(&model), "--reference", arg(&reference), "--cpu"]);
    let (stdout, stderr) = text(&run);
    assert!(run.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("(batch 2,") && stdout.contains("out: rel_l2") && stdout.contains("PASS"), "{stdout}");

    // A reference of another model: each missing or extra input is named.
    let partial = dir.join("partial.safetensors");
    write_reference(&partial, &[("input.x", &x), ("output.out", &out)]);
    fails_with(&["compare", arg(&model), "--reference", arg(&partial), "--cpu"], &["input `mask`", "holds no `input.mask`"]);
    let extra = dir.join("extra.safetensors");
    write_reference(&extra, &[("input.x", &x), ("input.mask", &mask), ("input.input", &x), ("output.out", &out)]);
    fails_with(&["compare", arg(&model), "--reference", arg(&extra), "--cpu"], &["holds `input.input`", "has no such input"]);

    // An older file's one unnamed `input` binds to a one-input model whatever its input's name.
    let one = dir.join("one.kiln.safetensors");
    let graph = classifier(5, "output");
    write_as_kiln_torch(&graph, &one, "Net");
    let x = kiln::dev::uniform_tensor(&[1, 3, 16, 16], 3);
    let out = kiln::run_cpu(&graph, &[("x", &x)]).expect("run").remove("output").expect("output");
    let old = dir.join("old.safetensors");
    write_reference(&old, &[("input", &x), ("output.output", &out)]);
    let run = kiln(&["compare", arg(&one), "--reference", arg(&old), "--cpu"]);
    assert!(run.status.success() && text(&run).0.contains("PASS"), "{:?}", text(&run));
    fails_with(&["compare", arg(&model), "--reference", arg(&old), "--cpu"], &["holds one unnamed `input`", "2 inputs"]);

    // --save-outputs stores every input by name, and compares back equal.
    let saved = dir.join("saved.safetensors");
    let run = kiln(&["compare", arg(&model), "--cpu", "--batch", "3", "--seed", "4", "--save-outputs", arg(&saved)]);
    assert!(run.status.success(), "{:?}", text(&run));
    let tensors = kiln::files::read_safetensors(&saved).expect("saved");
    assert_eq!(tensors.keys().collect::<Vec<_>>(), ["input.mask", "input.x", "output.out"]);
    assert_eq!(kiln::files::read_metadata(&saved).expect("meta")["input_shape"], "x:3x4,mask:3x4");
    let run = kiln(&["compare", arg(&model), "--cpu", "--load-outputs", arg(&saved), "--atol", "0", "--rtol", "0"]);
    assert!(run.status.success() && text(&run).0.contains("0 of 12 elements fail"), "{:?}", text(&run));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn p5_a_channels_last_shape_is_answered_with_the_nchw_one() {
    let stderr = fails_with(&["run", "resnet18", "--cpu", "--shapes", "input:1x224x224x3"], &["write input:1x3x224x224"]);
    assert!(!stderr.contains("Nx3x224x3"), "{stderr}");
}

#[test]
fn p5_a_graph_file_of_any_input_name_runs_at_another_size_and_answers_a_channels_last_shape() {
    // kiln-torch names the input after `forward`'s argument (`x`): the shapes are re-inferred for
    // it at another H x W, and a channels-last shape is answered before any re-inference.
    let dir = temp_dir("p5");
    let model = dir.join("net.kiln.safetensors");
    write_as_kiln_torch(&classifier(5, "output"), &model, "Net");
    for flags in [&["--shapes", "x:2x3x24x20"][..], &["--size", "32"][..]] {
        let run = kiln(&[&["run", arg(&model), "--cpu", "--seed", "1"][..], flags].concat());
        let (stdout, stderr) = text(&run);
        assert!(run.status.success(), "{flags:?}: {stdout}{stderr}");
    }
    let stderr = fails_with(&["run", arg(&model), "--cpu", "--shapes", "x:1x24x20x3"], &["write x:1x3x24x20"]);
    assert!(!stderr.contains("has no such input") && !stderr.contains("run at 20x3"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn p6_verbosity_shows_the_steps_of_a_cpu_run() {
    let dir = temp_dir("p6");
    let model = dir.join("net.kiln.safetensors");
    write_as_kiln_torch(&classifier(5, "output"), &model, "Net");
    let quiet = text(&kiln(&["run", arg(&model), "--cpu", "--seed", "1"])).1;
    assert!(!quiet.contains("optimise:"), "no steps by default: {quiet}");
    let debug = text(&kiln(&["-v", "run", arg(&model), "--cpu", "--seed", "1"])).1;
    for step in ["loaded graph file", "optimise: folded and fused", "run: CPU executor starts", "run: CPU executor done"] {
        assert!(debug.contains(step), "-v shows `{step}`:\n{debug}");
    }
    assert!(!debug.contains("run: op"), "per-op lines are -vv's:\n{debug}");
    let trace = text(&kiln(&["-vv", "run", arg(&model), "--cpu", "--seed", "1"])).1;
    assert!(trace.contains("run: op") && trace.contains("path=fc"), "-vv shows each op with its module path:\n{trace}");
    let env = text(&kiln_env(&["run", "resnet18", "--cpu", "--seed", "1", "--size", "32"], &[("RUST_LOG", "trace")])).1;
    for step in ["trace: graph recorded", "optimise: pass done", "run: op"] {
        assert!(env.contains(step), "RUST_LOG=trace shows `{step}`:\n{env}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn p7_a_mistyped_model_gets_a_suggestion_and_a_mistyped_file_is_a_missing_file() {
    let stderr = fails_with(&["run", "resnt50", "--cpu"], &["unknown model `resnt50`; did you mean `resnet50`?"]);
    assert!(!stderr.contains("vgg16_bn"), "not every model again: {stderr}");
    fails_with(&["run", "nosuchthing", "--cpu"], &["unknown model `nosuchthing`; the bundled models are:", "vgg16_bn"]);
    let dir = temp_dir("p7");
    let model = dir.join("rn50.kiln.safetensors");
    write_as_kiln_torch(&classifier(5, "output"), &model, "Net");
    let typo = dir.join("rn50.kiln.safetensor");
    let stderr = fails_with(&["run", arg(&typo), "--cpu"], &["no such file; did you mean", "rn50.kiln.safetensors?"]);
    assert!(!stderr.contains("unknown model"), "{stderr}");
    // Without a folder, an extension alone says it is a file.
    fails_with(&["run", "rn50.pth", "--cpu"], &["rn50.pth", "no such file"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn p8_random_weights_are_called_meaningless_and_bench_without_a_gpu_suggests_cpu() {
    let dir = temp_dir("p8");
    let model = dir.join("net.kiln.safetensors");
    write_as_kiln_torch(&classifier(5, "output"), &model, "Net");
    let (stdout, _) = text(&kiln(&["run", arg(&model), "--cpu", "--seed", "1"]));
    assert!(stdout.contains("random weights: ") && stdout.contains("answers below are meaningless"), "{stdout}");
    // Real weights (a graph without the mark) carry no such warning.
    let trained = dir.join("trained.kiln.safetensors");
    let meta = BTreeMap::from([("model".to_string(), "Net".to_string()), ("weights".to_string(), "net.safetensors".to_string())]);
    kiln::files::graph::write(&classifier(5, "output"), &trained, &meta).expect("write");
    let (stdout, _) = text(&kiln(&["run", arg(&trained), "--cpu", "--seed", "1"]));
    assert!(!stdout.contains("meaningless"), "{stdout}");
    if kiln::engine::gpu_available().is_err() {
        fails_with(&["bench", arg(&model)], &["no GPU available", "`kiln bench --cpu` times the CPU reference executor instead"]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
