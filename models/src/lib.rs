//! Kiln's bundled models, with the `state_dict` names of their PyTorch twins: torchvision's
//! classifiers (ResNet, ResNeXt, Wide ResNet, AlexNet, VGG, SqueezeNet, DenseNet, GoogLeNet,
//! MobileNetV2/V3, EfficientNet, ShuffleNetV2, RegNet, ConvNeXt; one file per family, with
//! torchvision.ops.misc's shared blocks in `misc`) and CenterNet-R50 (`centernet`), whose decode is a custom op
//! (`centernet_decode`) registered the way a user crate registers its own; CenterNet-R50-DCN
//! (`centernet_dcn`), whose deformable convs come from the `kiln-deform-conv` plugin crate.
//! Ultralytics' YOLOv8 and YOLO11 (`yolo`) come with their post-processing (`yolo_nms`) and
//! preprocessing (`yolo_letterbox`) as custom ops registered the same way; `classify_preset` is
//! torchvision's classification preset as such an op, and `trace_frames` puts a bundled model
//! behind its entry op, so that its engine takes decoded u8 frames.
//!
//! `BUNDLED` is the one list of them: `trace`, the `kiln` CLI (its `--help` and `kiln models`), the
//! README's table (checked by a test here) and the tests of every model all read it. The Python
//! tools read it through `kiln models --json`: `tools/export_reference.py` builds the same models in
//! PyTorch and writes references to compare against (docs/REFERENCES.md), `tools/bench_zoo.py`
//! times torchvision's twins.

pub mod alexnet;
pub mod centernet;
pub mod centernet_dcn;
pub mod classify_preset;
pub mod convnext;
pub mod densenet;
pub mod digits;
pub mod efficientnet;
mod frame_stage;
pub mod googlenet;
pub mod misc;
pub mod mobilenetv2;
pub mod mobilenetv3;
pub mod regnet;
pub mod resnet;
mod sequential;
pub mod shufflenetv2;
pub mod squeezenet;
pub mod swin;
pub mod vgg;
pub mod vit;
pub mod yolo;
pub mod yolo_letterbox;
pub mod yolo_nms;

pub use alexnet::{alexnet, AlexNet};
pub use centernet::{centernet_r50, decode, CenterNet, CenterNetOutput};
pub use centernet_dcn::{centernet_dcn_r50, CenterNetDcn};
pub use convnext::{convnext_tiny, ConvNeXt};
pub use densenet::{densenet121, DenseNet};
pub use digits::{digits_resnet, DigitsResNet, DIGITS_WEIGHTS};
pub use efficientnet::{efficientnet_b0, EfficientNet};
pub use googlenet::{googlenet, GoogLeNet};
pub use mobilenetv2::{mobilenet_v2, MobileNetV2};
pub use mobilenetv3::{mobilenet_v3_large, MobileNetV3};
pub use regnet::{regnet_y_400mf, RegNet};
pub use resnet::{
    resnet101, resnet152, resnet18, resnet34, resnet50, resnet50_backbone, resnext50_32x4d, wide_resnet50_2, BasicBlock, Bottleneck,
    ResNet, ResNet18, ResNet50,
};
pub use shufflenetv2::{shufflenet_v2_x1_0, ShuffleNetV2};
pub use squeezenet::{squeezenet1_0, squeezenet1_1, SqueezeNet};
pub use swin::{swin_t, SwinTransformer};
pub use vgg::{vgg16, vgg16_bn, Vgg};
pub use vit::{vit_b_16, VisionTransformer};
pub use yolo::{yolo11n, yolo11s, yolov8n, yolov8s, Yolo};

use kiln::{Error, Forward, Graph, Result, Tracer, VarBuilder};

/// A bundled model: its name, default square input size, graph outputs, and how to load it.
#[derive(Clone, Copy, Debug)]
pub struct BundledModel {
    pub name: &'static str,
    pub input_size: usize,
    pub outputs: &'static [&'static str],
    pub description: &'static str,
    /// `torchvision.models` has a builder of this name: the PyTorch twin the Python tools build.
    pub torchvision: bool,
    load: Load,
}

impl BundledModel {
    /// What kind of model it is, as `kiln models --json` says: `classifier` (one `logits`
    /// output), `centernet` (CenterNet's maps and their decode) or `yolo` (predictions and NMS).
    pub fn family(&self) -> &'static str {
        match self.load {
            Load::Classifier(_) => "classifier",
            Load::CenterNet | Load::CenterNetDcn => "centernet",
            Load::Yolo(_) => "yolo",
        }
    }
}

/// How `trace` builds a bundled model.
#[derive(Clone, Copy, Debug)]
enum Load {
    /// One input, one output: the `logits`.
    Classifier(fn(VarBuilder) -> Result<Box<dyn Forward>>),
    /// CenterNet's three maps and their decode.
    CenterNet,
    /// CenterNet-R50-DCN (the `kiln-deform-conv` plugin's op): the same outputs.
    CenterNetDcn,
    /// A YOLO detector: its raw predictions and their NMS.
    Yolo(fn(VarBuilder) -> Result<Yolo>),
}

fn boxed<M: Forward + 'static>(model: Result<M>) -> Result<Box<dyn Forward>> {
    Ok(Box::new(model?))
}

/// A 1000-class torchvision classifier at 224x224, loaded by `$load`.
macro_rules! classifier {
    ($name:literal, $load:path, $description:literal) => {
        BundledModel {
            name: $name,
            input_size: 224,
            outputs: &["logits"],
            description: $description,
            torchvision: true,
            load: Load::Classifier(|vb| boxed($load(vb))),
        }
    };
}

/// Every bundled model, in the order `kiln --help` and the README list them. Adding one is a row
/// here and its reference in `tests/fixtures` (the tests check it); a model that is not one of
/// torchvision's also needs its PyTorch twin's builder in `tools/export_reference.py`.
pub const BUNDLED: &[BundledModel] = &[
    classifier!("resnet18", resnet18, "torchvision ResNet-18"),
    classifier!("resnet34", resnet34, "torchvision ResNet-34"),
    classifier!("resnet50", resnet50, "torchvision ResNet-50"),
    classifier!("resnet101", resnet101, "torchvision ResNet-101"),
    classifier!("resnet152", resnet152, "torchvision ResNet-152"),
    classifier!("resnext50_32x4d", resnext50_32x4d, "torchvision ResNeXt-50 32x4d (grouped 3x3 convs)"),
    classifier!("wide_resnet50_2", wide_resnet50_2, "torchvision Wide ResNet-50-2"),
    classifier!("alexnet", alexnet, "torchvision AlexNet"),
    classifier!("vgg16", vgg16, "torchvision VGG-16"),
    classifier!("vgg16_bn", vgg16_bn, "torchvision VGG-16 with BatchNorm"),
    classifier!("squeezenet1_0", squeezenet1_0, "torchvision SqueezeNet 1.0"),
    classifier!("squeezenet1_1", squeezenet1_1, "torchvision SqueezeNet 1.1"),
    classifier!("densenet121", densenet121, "torchvision DenseNet-121"),
    classifier!("googlenet", googlenet, "torchvision GoogLeNet (Inception v1), inference path, no aux heads"),
    classifier!("mobilenet_v2", mobilenet_v2, "torchvision MobileNetV2 (inverted residuals, ReLU6)"),
    classifier!("mobilenet_v3_large", mobilenet_v3_large, "torchvision MobileNetV3-Large (Hardswish, squeeze-excitation)"),
    classifier!("efficientnet_b0", efficientnet_b0, "torchvision EfficientNet-B0 (MBConv, SiLU, squeeze-excitation)"),
    classifier!("shufflenet_v2_x1_0", shufflenet_v2_x1_0, "torchvision ShuffleNetV2 1.0x (channel split and shuffle)"),
    classifier!("regnet_y_400mf", regnet_y_400mf, "torchvision RegNetY-400MF (grouped convs, squeeze-excitation)"),
    classifier!("convnext_tiny", convnext_tiny, "torchvision ConvNeXt-Tiny (depthwise 7x7, LayerNorm, GELU, layer scale)"),
    classifier!("swin_t", swin_t, "torchvision Swin-T (shifted windows, relative position bias, patch merging)"),
    classifier!("vit_b_16", vit_b_16, "torchvision ViT-B/16 (class token, multi-head attention)"),
    BundledModel {
        name: "digits_resnet",
        input_size: 32,
        outputs: &["logits"],
        description: "small ResNet trained on scikit-learn's digits (tools/train_digits.py; weights in models/weights/)",
        torchvision: false,
        load: Load::Classifier(|vb| boxed(digits_resnet(vb))),
    },
    BundledModel {
        name: "centernet",
        input_size: 512,
        outputs: &["hm", "wh", "reg", "detections"],
        description: "CenterNet-R50, 80 classes, maps at stride 4, top-100 decode",
        torchvision: false,
        load: Load::CenterNet,
    },
    BundledModel {
        name: "centernet_dcn",
        input_size: 512,
        outputs: &["hm", "wh", "reg", "detections"],
        description: "CenterNet-R50-DCN: deformable 3x3 convs (plugin op `deform_conv2d`) before the deconvs",
        torchvision: false,
        load: Load::CenterNetDcn,
    },
    BundledModel {
        name: "yolov8n",
        input_size: 640,
        outputs: &["predictions", "detections"],
        description: "Ultralytics YOLOv8n, 80 classes: [N, 84, anchors] (xywh + scores), class-aware NMS to 300",
        torchvision: false,
        load: Load::Yolo(yolov8n),
    },
    BundledModel {
        name: "yolo11n",
        input_size: 640,
        outputs: &["predictions", "detections"],
        description: "Ultralytics YOLO11n (C3k2, C2PSA attention), 80 classes, class-aware NMS to 300",
        torchvision: false,
        load: Load::Yolo(yolo11n),
    },
];

/// The bundled model called `name`.
pub fn bundled(name: &str) -> Result<&'static BundledModel> {
    BUNDLED.iter().find(|m| m.name == name).ok_or_else(|| Error::UnknownModel {
        name: name.to_string(),
        suggestion: closest_name(name, BUNDLED.iter().map(|m| m.name)).map(str::to_string),
        known: bundled_names(),
    })
}

/// The name among `known` nearest to `name` by edit distance (insertions, deletions,
/// substitutions and swaps of neighbours, case ignored), when it is near enough to be a typo: at
/// most one edit per three characters (and at least one). Ties go to the first.
pub fn closest_name<'a>(name: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (name.chars().count() / 3).max(1);
    let mut best: Option<(usize, &str)> = None;
    for k in known {
        let d = edit_distance(&name.to_lowercase(), &k.to_lowercase());
        if d <= limit && best.is_none_or(|(b, _)| d < b) {
            best = Some((d, k));
        }
    }
    best.map(|(_, k)| k)
}

/// Optimal string alignment distance: Levenshtein's, with a swap of two neighbours as one edit.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    // rows[i][j]: the distance between a[..i] and b[..j]; three rows are live at a time.
    let mut rows = vec![(0..=b.len()).collect::<Vec<usize>>()];
    for i in 1..=a.len() {
        let mut row = vec![i; b.len() + 1];
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            row[j] = (rows[i - 1][j] + 1).min(row[j - 1] + 1).min(rows[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                row[j] = row[j].min(rows[i - 2][j - 2] + 1);
            }
        }
        rows.push(row);
    }
    rows[a.len()][b.len()]
}

/// The bundled models' names, comma-separated, in `BUNDLED`'s order.
pub fn bundled_names() -> String {
    BUNDLED.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
}

/// The bundled models as a Markdown table (name, default input, outputs, description): the
/// README's list, kept equal to this by a test.
pub fn bundled_markdown() -> String {
    let mut s = String::from("| model | default input | outputs | what |\n|---|---|---|---|\n");
    for m in BUNDLED {
        let outputs = m.outputs.iter().map(|o| format!("`{o}`")).collect::<Vec<_>>().join(", ");
        s += &format!("| `{}` | {}x{} | {outputs} | {} |\n", m.name, m.input_size, m.input_size, m.description);
    }
    s
}

/// Traces a bundled model on an input named `input` of shape [batch, 3, size, size].
///
/// Outputs: `logits` for the classifiers; `hm`, `wh`, `reg` and `detections` ([batch, 100, 6])
/// for CenterNet (80 classes); `predictions` ([batch, 84, anchors]) and `detections`
/// ([batch, 300, 6], `yolo_nms`) for the YOLOs. Keep a clone of `vb` to ask it afterwards for keys the model never
/// used (`VarBuilder::check_all_used`).
pub fn trace(model: &str, vb: VarBuilder, batch: usize, size: usize) -> Result<Graph> {
    trace_hw(model, vb, batch, [size, size])
}

/// `trace` at an input of height × width `hw` (not necessarily square).
pub fn trace_hw(model: &str, vb: VarBuilder, batch: usize, hw: [usize; 2]) -> Result<Graph> {
    let info = bundled(model)?;
    let tracer = Tracer::new();
    let x = tracer.input("input", &[batch, 3, hw[0], hw[1]]);
    match info.load {
        Load::Classifier(load) => load(vb)?.forward(&x)?.mark_output("logits"),
        Load::CenterNet | Load::CenterNetDcn => {
            let out = match info.load {
                Load::CenterNetDcn => centernet_dcn_r50(vb, 80)?.forward(&x)?,
                _ => centernet_r50(vb, 80)?.forward(&x)?,
            };
            let detections = decode(&out, centernet::DEFAULT_K)?;
            out.hm.mark_output("hm");
            out.wh.mark_output("wh");
            out.reg.mark_output("reg");
            detections.mark_output("detections");
        }
        Load::Yolo(load) => {
            let predictions = load(vb)?.forward(&x)?;
            let detections = yolo_nms::nms(&predictions, &yolo_nms::NmsConfig::default())?;
            predictions.mark_output("predictions");
            detections.mark_output("detections");
        }
    }
    Ok(tracer.graph())
}

/// A bundled model behind its entry op, on a u8 input named `frame`: `[batch, h, w * 3]`
/// decoded frames of (h, w) `frame`, their pixels in `order`. A classifier reads them through
/// `classify_preset` (torchvision's ImageNet preset for its input size: `Resize(256)`,
/// `CenterCrop(224)` at 224), a YOLO detector through `yolo_letterbox` (its `detections` in the
/// frame's pixels); the outputs are `trace`'s. CenterNet has no entry op: an error says so.
pub fn trace_frames(model: &str, vb: VarBuilder, batch: usize, frame: [usize; 2], order: kiln::image::ChannelOrder) -> Result<Graph> {
    let info = bundled(model)?;
    let tracer = Tracer::new();
    let x = classify_preset::frame_input(&tracer, "frame", batch, frame);
    let input = [info.input_size, info.input_size];
    match info.load {
        Load::Classifier(load) => {
            let preset = classify_preset::Preset { order, ..classify_preset::Preset::for_input(info.input_size) };
            load(vb)?.forward(&classify_preset::classify_preset(&x, &preset)?)?.mark_output("logits")
        }
        Load::Yolo(load) => {
            let predictions = load(vb)?.forward(&yolo_letterbox::letterbox_with(&x, input, order)?)?;
            let config = yolo_nms::NmsConfig { frame: Some((frame, input)), ..Default::default() };
            let detections = yolo_nms::nms(&predictions, &config)?;
            predictions.mark_output("predictions");
            detections.mark_output("detections");
        }
        Load::CenterNet | Load::CenterNetDcn => {
            return Err(Error::Config {
                reason: format!(
                "{model} takes no frames: only the classifiers (classify_preset) and the YOLO detectors (yolo_letterbox) have an entry op"
            ),
            })
        }
    }
    Ok(tracer.graph())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln::plugin::Op;

    fn count(g: &Graph, op: &str) -> usize {
        g.nodes.iter().filter(|n| n.op.name() == op).count()
    }

    fn shape_of(g: &Graph, output: &str) -> Vec<usize> {
        let id = g.outputs.iter().find(|(n, _)| n == output).map(|(_, id)| *id).expect("output");
        g.nodes[id].shape.clone()
    }

    #[test]
    fn resnet50_has_torchvision_structure() {
        let g = trace("resnet50", VarBuilder::seeded(), 2, 224).expect("trace");
        // 1 stem conv + 16 blocks x 3 + 4 downsample convs; BN follows each conv.
        assert_eq!(count(&g, "conv2d"), 53);
        assert_eq!(count(&g, "batch_norm2d"), 53);
        assert_eq!(count(&g, "add"), 16);
        assert_eq!(count(&g, "relu"), 1 + 16 * 3);
        assert_eq!(shape_of(&g, "logits"), [2, 1000]);
        // Weights are keyed by their state_dict names.
        assert!(g.weights.contains_key("layer2.0.downsample.0.weight"));
        assert!(g.weights.contains_key("layer4.2.bn3.running_var"));
        assert_eq!(g.weights["fc.weight"].shape, [1000, 2048]);
        let params: usize = g.weights.iter().filter(|(k, _)| !k.contains("running")).map(|(_, w)| w.numel()).sum();
        assert_eq!(params, 25_557_032, "torchvision's resnet50 parameter count");
    }

    #[test]
    fn nodes_follow_pytorch_execution_order() {
        let g = trace("resnet50", VarBuilder::seeded(), 1, 64).expect("trace");
        let paths: Vec<&str> =
            g.nodes.iter().filter(|n| !matches!(n.op, Op::Weight { .. } | Op::Input { .. })).map(|n| n.path.as_str()).collect();
        let first_block: Vec<&str> = paths.iter().copied().skip_while(|p| !p.starts_with("layer1.0")).take(12).collect();
        assert_eq!(
            first_block,
            [
                "layer1.0.conv1",
                "layer1.0.bn1",
                "layer1.0.relu",
                "layer1.0.conv2",
                "layer1.0.bn2",
                "layer1.0.relu",
                "layer1.0.conv3",
                "layer1.0.bn3",
                "layer1.0.downsample.0",
                "layer1.0.downsample.1",
                "layer1.0.add",
                "layer1.0.relu",
            ]
        );
        assert_eq!(&paths[paths.len() - 3..], ["avgpool", "flatten", "fc"]);
    }

    #[test]
    fn resnet18_shapes_and_names() {
        let g = trace("resnet18", VarBuilder::seeded(), 1, 224).expect("trace");
        assert_eq!(count(&g, "conv2d"), 20);
        assert_eq!(count(&g, "add"), 8);
        assert!(g.weights.contains_key("layer3.0.downsample.1.running_mean"));
        assert!(!g.weights.contains_key("layer1.0.downsample.0.weight"), "layer1 keeps its identity");
        let params: usize = g.weights.iter().filter(|(k, _)| !k.contains("running")).map(|(_, w)| w.numel()).sum();
        assert_eq!(params, 11_689_512, "torchvision's resnet18 parameter count");
    }

    #[test]
    fn centernet_maps_are_a_quarter_of_the_input() {
        let g = trace("centernet", VarBuilder::seeded(), 1, 512).expect("trace");
        assert_eq!(shape_of(&g, "hm"), [1, 80, 128, 128]);
        assert_eq!(shape_of(&g, "wh"), [1, 2, 128, 128]);
        assert_eq!(shape_of(&g, "reg"), [1, 2, 128, 128]);
        assert_eq!(shape_of(&g, "detections"), [1, 100, 6]);
        assert_eq!(count(&g, "conv_transpose2d"), 3);
        assert!(g.weights.contains_key("backbone.layer1.0.conv1.weight"));
        assert!(g.weights.contains_key("upsampler.deconv_layers.7.running_var"));
        assert_eq!(g.weights["upsampler.deconv_layers.0.weight"].shape, [2048, 256, 4, 4]);
        assert_eq!(g.weights["head.hm.2.weight"].shape, [80, 64, 1, 1]);
        assert!(g.weights.contains_key("head.reg.0.bias"));
        assert!(!g.weights.keys().any(|k| k.contains("fc") || k.contains("avgpool")));
    }

    /// Parameters and `state_dict` tensors (without `num_batches_tracked`) of torchvision's twin,
    /// from `sum(p.numel() for p in m.parameters())` and `len(m.state_dict())` (torchvision 0.29),
    /// and a few keys with their shapes.
    type Expected = (&'static str, usize, usize, &'static [(&'static str, &'static [usize])]);
    const TORCHVISION: &[Expected] = &[
        ("resnet34", 21_797_672, 182, &[("layer3.5.conv2.weight", &[256, 256, 3, 3]), ("fc.weight", &[1000, 512])]),
        ("resnet101", 44_549_160, 522, &[("layer3.22.conv3.weight", &[1024, 256, 1, 1])]),
        ("resnet152", 60_192_808, 777, &[("layer3.35.bn3.weight", &[1024]), ("layer2.7.conv2.weight", &[128, 128, 3, 3])]),
        ("resnext50_32x4d", 25_028_904, 267, &[("layer1.0.conv2.weight", &[128, 4, 3, 3]), ("layer4.2.conv3.weight", &[2048, 1024, 1, 1])]),
        (
            "wide_resnet50_2",
            68_883_240,
            267,
            &[("layer1.0.conv2.weight", &[128, 128, 3, 3]), ("layer4.0.conv1.weight", &[1024, 1024, 1, 1])],
        ),
        (
            "alexnet",
            61_100_840,
            16,
            &[("features.0.weight", &[64, 3, 11, 11]), ("features.10.bias", &[256]), ("classifier.1.weight", &[4096, 9216])],
        ),
        (
            "vgg16",
            138_357_544,
            32,
            &[("features.28.weight", &[512, 512, 3, 3]), ("classifier.0.weight", &[4096, 25088]), ("classifier.6.bias", &[1000])],
        ),
        (
            "vgg16_bn",
            138_365_992,
            84,
            &[("features.1.running_var", &[64]), ("features.41.weight", &[512]), ("classifier.6.weight", &[1000, 4096])],
        ),
        ("squeezenet1_0", 1_248_424, 52, &[("features.0.weight", &[96, 3, 7, 7]), ("features.12.expand3x3.weight", &[256, 64, 3, 3])]),
        ("squeezenet1_1", 1_235_496, 52, &[("features.0.weight", &[64, 3, 3, 3]), ("classifier.1.weight", &[1000, 512, 1, 1])]),
        (
            "densenet121",
            7_978_856,
            606,
            &[
                ("features.denseblock1.denselayer1.norm1.weight", &[64]),
                ("features.denseblock4.denselayer16.conv2.weight", &[32, 128, 3, 3]),
                ("features.transition3.conv.weight", &[512, 1024, 1, 1]),
                ("features.norm5.running_var", &[1024]),
                ("classifier.weight", &[1000, 1024]),
            ],
        ),
        (
            "googlenet",
            6_624_904,
            287,
            &[
                ("conv1.bn.running_var", &[64]),
                ("inception3a.branch2.1.conv.weight", &[128, 96, 3, 3]),
                ("inception5b.branch4.1.bn.weight", &[128]),
                ("fc.weight", &[1000, 1024]),
            ],
        ),
        (
            "mobilenet_v2",
            3_504_872,
            262,
            &[
                ("features.0.0.weight", &[32, 3, 3, 3]),
                ("features.1.conv.0.0.weight", &[32, 1, 3, 3]),
                ("features.2.conv.1.0.weight", &[96, 1, 3, 3]),
                ("features.9.conv.3.running_mean", &[64]),
                ("features.18.1.running_var", &[1280]),
                ("classifier.1.weight", &[1000, 1280]),
            ],
        ),
        (
            "mobilenet_v3_large",
            5_483_032,
            266,
            &[
                ("features.0.0.weight", &[16, 3, 3, 3]),
                ("features.4.block.2.fc1.weight", &[24, 72, 1, 1]),
                ("features.4.block.2.fc2.bias", &[72]),
                ("features.9.block.0.1.running_mean", &[184]),
                ("features.16.0.weight", &[960, 160, 1, 1]),
                ("classifier.0.weight", &[1280, 960]),
                ("classifier.3.weight", &[1000, 1280]),
            ],
        ),
        (
            "efficientnet_b0",
            5_288_548,
            311,
            &[
                ("features.1.0.block.0.0.weight", &[32, 1, 3, 3]),
                ("features.1.0.block.1.fc1.weight", &[8, 32, 1, 1]),
                ("features.5.0.block.1.0.weight", &[480, 1, 5, 5]),
                ("features.6.3.block.2.fc2.weight", &[1152, 48, 1, 1]),
                ("features.8.1.running_var", &[1280]),
                ("classifier.1.weight", &[1000, 1280]),
            ],
        ),
        (
            "shufflenet_v2_x1_0",
            2_278_604,
            282,
            &[
                ("conv1.0.weight", &[24, 3, 3, 3]),
                ("stage2.0.branch1.0.weight", &[24, 1, 3, 3]),
                ("stage2.0.branch2.0.weight", &[58, 24, 1, 1]),
                ("stage3.3.branch2.6.running_mean", &[116]),
                ("conv5.1.running_var", &[1024]),
                ("fc.weight", &[1000, 1024]),
            ],
        ),
        (
            "regnet_y_400mf",
            4_344_144,
            331,
            &[
                ("stem.0.weight", &[32, 3, 3, 3]),
                ("trunk_output.block1.block1-0.proj.0.weight", &[48, 32, 1, 1]),
                ("trunk_output.block1.block1-0.f.se.fc1.weight", &[8, 48, 1, 1]),
                ("trunk_output.block2.block2-1.f.b.0.weight", &[104, 8, 3, 3]),
                ("trunk_output.block3.block3-3.f.se.fc2.weight", &[208, 52, 1, 1]),
                ("trunk_output.block4.block4-5.f.c.1.running_var", &[440]),
                ("fc.weight", &[1000, 440]),
            ],
        ),
        (
            "convnext_tiny",
            28_589_128,
            182,
            &[
                ("features.0.0.weight", &[96, 3, 4, 4]),
                ("features.0.1.weight", &[96]),
                ("features.1.0.block.0.weight", &[96, 1, 7, 7]),
                ("features.1.0.block.2.bias", &[96]),
                ("features.2.0.weight", &[96]),
                ("features.2.1.weight", &[192, 96, 2, 2]),
                ("features.5.2.block.5.weight", &[384, 1536]),
                ("features.5.3.layer_scale", &[384, 1, 1]),
                ("classifier.0.bias", &[768]),
                ("classifier.2.weight", &[1000, 768]),
            ],
        ),
    ];

    #[test]
    fn classifiers_have_torchvision_parameters_and_names() {
        for &(name, params, tensors, keys) in TORCHVISION {
            let g = trace(name, VarBuilder::seeded(), 1, 224).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(shape_of(&g, "logits"), [1, 1000], "{name}");
            let ours: usize = g.weights.iter().filter(|(k, _)| !k.contains("running")).map(|(_, w)| w.numel()).sum();
            assert_eq!(ours, params, "{name}: torchvision's parameter count");
            assert_eq!(g.weights.len(), tensors, "{name}: torchvision's state_dict entries");
            for (key, shape) in keys {
                let w = g.weights.get(*key).unwrap_or_else(|| panic!("{name}: no `{key}`"));
                assert_eq!(w.shape, *shape, "{name}: {key}");
            }
        }
    }

    #[test]
    fn every_bundled_model_traces_at_its_default_size() {
        for m in BUNDLED {
            let g = trace(m.name, VarBuilder::seeded(), 1, m.input_size).unwrap_or_else(|e| panic!("{}: {e}", m.name));
            let outputs: Vec<&str> = g.outputs.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(outputs, m.outputs, "{}", m.name);
        }
    }

    #[test]
    fn googlenet_and_densenet_follow_torchvision() {
        let g = trace("googlenet", VarBuilder::seeded(), 1, 224).expect("trace");
        // 3 stem convs + 9 Inception modules x 6 convs, each with its BatchNorm (eps 0.001).
        assert_eq!(count(&g, "conv2d"), 3 + 9 * 6);
        assert!(g.nodes.iter().all(|n| !matches!(n.op, Op::Norm(kiln::plugin::Norm::BatchNorm2d { eps }) if eps != 1e-3)));
        assert_eq!(count(&g, "cat"), 9);
        assert_eq!(count(&g, "relu"), 3 + 9 * 6);
        let g = trace("densenet121", VarBuilder::seeded(), 1, 224).expect("trace");
        // conv0 + 58 dense layers x 2 + 3 transitions; a cat before every layer but each block's first, and after each block.
        assert_eq!(count(&g, "conv2d"), 1 + 58 * 2 + 3);
        assert_eq!(count(&g, "cat"), (58 - 4) + 4);
        assert_eq!(count(&g, "avg_pool2d"), 3);
        let pooled = g.nodes.iter().find(|n| n.op.name() == "adaptive_avg_pool2d").expect("global pool");
        assert_eq!(pooled.shape, [1, 1024, 1, 1]);
    }

    #[test]
    fn readme_lists_the_bundled_models() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
        let readme = std::fs::read_to_string(&path).expect("README.md");
        let (begin, end) = ("<!-- bundled models: begin -->\n", "<!-- bundled models: end -->");
        let start = readme.find(begin).expect("README has the bundled-models markers") + begin.len();
        let stop = readme[start..].find(end).expect("end marker") + start;
        let want = bundled_markdown();
        if readme[start..stop] != want && std::env::var_os("KILN_BLESS").is_some() {
            std::fs::write(&path, format!("{}{want}{}", &readme[..start], &readme[stop..])).expect("write README.md");
            return;
        }
        assert_eq!(readme[start..stop], want, "README's model table differs from BUNDLED; rerun with KILN_BLESS=1 to rewrite it");
    }

    #[test]
    fn unknown_model_is_a_typed_error() {
        let err = trace("inception_v3", VarBuilder::seeded(), 1, 224).unwrap_err();
        assert!(
            matches!(&err, Error::UnknownModel { name, known, suggestion: None } if name == "inception_v3" && known.contains("vgg16_bn")),
            "{err}"
        );
    }

    #[test]
    fn a_mistyped_model_name_gets_the_nearest_bundled_one() {
        let err = bundled("resnt50").unwrap_err();
        assert!(matches!(&err, Error::UnknownModel { suggestion: Some(s), .. } if s == "resnet50"), "{err}");
        assert!(err.to_string().contains("did you mean `resnet50`?"), "{err}");
        assert_eq!(closest_name("Mobilenet_V2", BUNDLED.iter().map(|m| m.name)), Some("mobilenet_v2"), "case is ignored");
        assert_eq!(closest_name("vgg61", BUNDLED.iter().map(|m| m.name)), Some("vgg16"), "a swap is one edit");
        assert_eq!(closest_name("transformer", BUNDLED.iter().map(|m| m.name)), None, "nothing near");
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
    }

    #[test]
    fn bad_weights_and_inputs_are_typed_errors() {
        let wrong = [("conv1.weight".to_string(), kiln::HostTensor::zeros(vec![64, 3, 3, 3]))].into_iter().collect();
        let err = trace("resnet18", VarBuilder::from_tensors(wrong), 1, 224).unwrap_err();
        assert!(matches!(&err, Error::MissingWeight { .. } | Error::WeightShape { .. }), "{err}");
        let err = trace("resnet18", VarBuilder::seeded(), 1, 0).unwrap_err();
        assert!(matches!(&err, Error::Shape { path, .. } if path == "conv1"), "{err}");
    }
}
