//! The plugin's kernels compile with NVRTC for the device's architecture (`sm_90`), behind Kiln's
//! prelude exactly as `ctx.kernels.add_source` compiles them, and define every entry point the
//! layer launches. Needs NVRTC, not a GPU: CI sets `KILN_REQUIRE_NVRTC=1` (with NVRTC on
//! `LD_LIBRARY_PATH`); elsewhere a missing NVRTC skips with the reason.

use kiln::plugin::{compile_source, image_has_symbol, nvrtc_available};
use kiln_deform_conv::gpu::{entry_points, DEFORM_CONV_CU};

#[test]
fn deform_conv_kernels_compile_for_sm_90_with_every_entry_point() {
    if let Err(why) = nvrtc_available() {
        assert_ne!(std::env::var("KILN_REQUIRE_NVRTC").as_deref(), Ok("1"), "KILN_REQUIRE_NVRTC=1 but NVRTC is unavailable: {why}");
        println!("skipped: {why}");
        return;
    }
    let image = compile_source("deform_conv.cu", DEFORM_CONV_CU, "sm_90").unwrap_or_else(|e| panic!("{e}"));
    println!("deform_conv.cu: {} bytes of CUBIN for sm_90", image.len());
    for entry in entry_points() {
        assert!(image_has_symbol(&image, &entry), "deform_conv.cu defines no `{entry}`");
    }
}
