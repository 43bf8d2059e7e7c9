//! A bundled model as a repository's source: traced with seeded weights or a state_dict, and for
//! the YOLO detectors optionally with the letterbox in front, so that the served model takes
//! decoded frames (`[N, H, W * 3]` bytes) and answers detections in frame coordinates.

use crate::error::{BackendError, Result};
use crate::kiln_api::{
    bundled, trace_bundled, yolo11n, yolo11s, yolo_letterbox, yolo_nms, yolov8n, yolov8s, Forward, NmsConfig, Tracer, VarBuilder, Yolo,
};
use crate::repository::ModelSource;
use std::collections::BTreeMap;
use std::path::Path;

/// `name` (a bundled model) traced at batch 1 and its default size; with `frame`, a YOLO model
/// behind `yolo_letterbox` for frames of that height and width, its output `detections` only.
pub fn bundled_source(name: &str, weights: Option<&Path>, frame: Option<[usize; 2]>) -> Result<ModelSource> {
    let info = bundled(name).map_err(BackendError::kiln("choosing the model"))?;
    let vb = || match weights {
        Some(p) => VarBuilder::from_files(&[p]).map_err(BackendError::kiln(format!("reading {}", p.display()))),
        None => Ok(VarBuilder::seeded()),
    };
    let what = format!("tracing {name}");
    let mut metadata = BTreeMap::from([
        ("model".to_string(), name.to_string()),
        ("weights".to_string(), weights.map_or("seeded".into(), |p| p.display().to_string())),
    ]);
    let graph = match frame {
        None => trace_bundled(name, vb()?, 1, [info.input_size, info.input_size]).map_err(BackendError::kiln(what))?,
        Some(hw) => {
            let load: fn(VarBuilder) -> crate::kiln_api::KilnResult<Yolo> = match name {
                "yolov8n" => yolov8n,
                "yolov8s" => yolov8s,
                "yolo11n" => yolo11n,
                "yolo11s" => yolo11s,
                _ => {
                    return Err(BackendError::Unsupported {
                        what: format!("a letterbox in front of {name}"),
                        reason: "only the YOLO detectors take frames".into(),
                    })
                }
            };
            let input = [info.input_size, info.input_size];
            let vb = vb()?;
            let tracer = Tracer::new();
            let frame_in = yolo_letterbox::frame_input(&tracer, "frame", 1, hw);
            let traced = (|| -> crate::kiln_api::KilnResult<()> {
                let x = yolo_letterbox::letterbox(&frame_in, input)?;
                let predictions = load(vb)?.forward(&x)?;
                let config = NmsConfig { frame: Some((hw, input)), ..NmsConfig::default() };
                yolo_nms::nms(&predictions, &config)?.mark_output("detections");
                Ok(())
            })();
            traced.map_err(BackendError::kiln(what))?;
            metadata.insert("frame".into(), format!("{}x{} BGR u8, letterboxed to {}x{}", hw[0], hw[1], input[0], input[1]));
            tracer.graph()
        }
    };
    Ok(ModelSource::Graph { graph: Box::new(graph), metadata })
}
