//! Every name this crate takes from Kiln, in one place: when Kiln's public modules move, only
//! these paths change. The rest of the crate says `crate::kiln_api::…`.

pub use kiln::engine::{
    checksum, optimize, BuildConfig, DimsRange, Engine, EngineBuilder, ExecutionContext, Gpu, InputDims, Precision, ShapeProfile,
};
/// The largest batch an engine takes, which Triton's `max_batch_size` may not pass.
pub use kiln::files::engine::MAX_BATCH;
pub use kiln::run_cpu;
pub use kiln::{ByteTensor, DType, Error as KilnError, Graph, HostInput, HostTensor, Result as KilnResult};
pub use kiln::{Forward, Tracer, VarBuilder};
pub use kiln_models::yolo_nms::NmsConfig;
pub use kiln_models::{bundled, trace_hw as trace_bundled, yolo11n, yolo11s, yolo_letterbox, yolo_nms, yolov8n, yolov8s, Yolo};

/// Custom ops register themselves (inventory) in the crate that defines them. Referencing a function
/// of each of those modules keeps their registrations linked into `libtriton_kiln.so`, so graph
/// files with YOLO's letterbox and NMS, the classifier preset, CenterNet's decode or deformable convs
/// run here too.
#[used]
static CUSTOM_OPS: [fn() -> Vec<String>; 4] = [
    kiln_models::yolo_letterbox::letterbox_entry_points,
    kiln_models::classify_preset::classify_preset_entry_points,
    kiln_models::yolo_nms::nms_entry_points,
    kiln_models::centernet::decode_entry_points,
];
#[used]
static PLUGIN_OPS: fn(&[f32], usize, usize, f32, f32) -> f32 = kiln_deform_conv::op::bilinear;

#[cfg(test)]
pub use kiln::engine::gpu_available;
#[cfg(test)]
pub use kiln::files::engine::{encode as encode_engine_file, Header, Payload, FORMAT_VERSION};
