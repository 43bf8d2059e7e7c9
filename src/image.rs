//! Image geometry shared by the CPU presets (kiln-vision) and the GPU entry ops (kiln-models), so
//! that both compute the same pixels from the same taps: Ultralytics' letterbox, torchvision's
//! classification preset on a PIL image (`Resize`, PIL's antialiased bilinear taps, `CenterCrop`),
//! the channel order of interleaved pixels; and [`pnm`], the 8-bit PGM/PPM folders that
//! `kiln calibrate --data` reads without an image library.

pub use crate::ops::image::*;

/// Binary PGM and PPM images (`P5`, `P6`; 8-bit), one folder at a time.
pub mod pnm {
    pub use crate::pnm::{check_normalisation, parse, read_folder};
}
