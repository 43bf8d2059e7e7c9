//! Kiln's bundled models, with the `state_dict` names of their PyTorch twins:
//! torchvision's `resnet18` and `resnet50`, and CenterNet-R50 (`centernet`), whose decode is a
//! custom op (`centernet_decode`) registered the way a user crate registers its own.
//!
//! `tools/export_reference.py` builds the same models in PyTorch and writes references to compare
//! against (docs/REFERENCES.md).

pub mod centernet;
pub mod resnet;

pub use centernet::{centernet_r50, decode, CenterNet, CenterNetOutput};
pub use resnet::{resnet18, resnet50, resnet50_backbone, BasicBlock, Bottleneck, ResNet, ResNet18, ResNet50};

use kiln::{Error, Forward, Graph, Result, Tracer, VarBuilder};

/// A bundled model: its name, default square input size and graph outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BundledModel {
    pub name: &'static str,
    pub input_size: usize,
    pub outputs: &'static [&'static str],
    pub description: &'static str,
}

pub const BUNDLED: &[BundledModel] = &[
    BundledModel { name: "resnet18", input_size: 224, outputs: &["logits"], description: "torchvision ResNet-18, 1000 classes" },
    BundledModel { name: "resnet50", input_size: 224, outputs: &["logits"], description: "torchvision ResNet-50, 1000 classes" },
    BundledModel {
        name: "centernet",
        input_size: 512,
        outputs: &["hm", "wh", "reg", "detections"],
        description: "CenterNet-R50, 80 classes, maps at stride 4, top-100 decode",
    },
];

/// The bundled model called `name`.
pub fn bundled(name: &str) -> Result<&'static BundledModel> {
    BUNDLED
        .iter()
        .find(|m| m.name == name)
        .ok_or_else(|| Error::UnknownModel { name: name.to_string(), known: BUNDLED.iter().map(|m| m.name).collect::<Vec<_>>().join(", ") })
}

/// Traces a bundled model on an input named `input` of shape [batch, 3, size, size].
///
/// Outputs: `logits` for the ResNets; `hm`, `wh`, `reg` and `detections` ([batch, 100, 6]) for
/// CenterNet (80 classes). Keep a clone of `vb` to ask it afterwards for keys the model never
/// used (`VarBuilder::check_all_used`).
pub fn trace(model: &str, vb: VarBuilder, batch: usize, size: usize) -> Result<Graph> {
    let info = bundled(model)?;
    let tracer = Tracer::new();
    let x = tracer.input("input", &[batch, 3, size, size]);
    match info.name {
        "resnet18" => resnet18(vb)?.forward(&x)?.mark_output("logits"),
        "resnet50" => resnet50(vb)?.forward(&x)?.mark_output("logits"),
        _ => {
            let out = centernet_r50(vb, 80)?.forward(&x)?;
            let detections = decode(&out, centernet::DEFAULT_K)?;
            out.hm.mark_output("hm");
            out.wh.mark_output("wh");
            out.reg.mark_output("reg");
            detections.mark_output("detections");
        }
    }
    Ok(tracer.graph())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln::Op;

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

    #[test]
    fn unknown_model_is_a_typed_error() {
        let err = trace("vgg16", VarBuilder::seeded(), 1, 224).unwrap_err();
        assert!(matches!(&err, Error::UnknownModel { name, known } if name == "vgg16" && known.contains("resnet50")), "{err}");
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
