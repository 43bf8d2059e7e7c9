//! Every kernel in `kernels/` compiles with NVRTC for the device's architecture (`sm_90`), on a
//! machine without a GPU. CI installs NVRTC and sets `KILN_REQUIRE_NVRTC=1`, so a kernel that
//! does not compile never lands; elsewhere, a missing NVRTC skips these tests with the reason.

use kiln::dev::kernels::kernel_entry_points;
use kiln::dev::kernels::{self, cached_compile, compile_all_for, compile_hopper, FAMILIES, HOPPER, ON_DEMAND};
use kiln::plugin::{compile_source, image_has_symbol};
use kiln::Error;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

const ARCH: &str = "sm_90";

/// The `nvidia/cu13/lib` folder of a pip-installed `nvidia-cuda-nvrtc`, if python has one.
fn pip_nvrtc_dir() -> Option<PathBuf> {
    let out = std::process::Command::new("python3")
        .args(["-c", "import nvidia, os; print(list(nvidia.__path__)[0])"])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let root = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    ["cu13/lib", "cuda_nvrtc/lib"].iter().map(|d| root.join(d)).find(|d| d.is_dir())
}

/// `Ok` when NVRTC is usable; finds a pip install when it is not on `LD_LIBRARY_PATH`.
fn nvrtc() -> Result<(), String> {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    READY
        .get_or_init(|| {
            // SAFETY: only tries to dlopen NVRTC's candidate names.
            let on_path = unsafe { cudarc::nvrtc::sys::is_culib_present() };
            if !on_path && std::env::var_os("KILN_NVRTC_PATH").is_none() {
                if let Some(dir) = pip_nvrtc_dir() {
                    let file = kernels::preload_nvrtc(&dir).map_err(|e| e.to_string())?;
                    println!("using NVRTC from {}", file.display());
                }
            }
            kernels::nvrtc_available().map_err(|e| e.to_string())
        })
        .clone()
}

/// Skips (prints why) when NVRTC is missing, unless CI requires it.
fn require_nvrtc() -> bool {
    match nvrtc() {
        Ok(()) => true,
        Err(why) if std::env::var("KILN_REQUIRE_NVRTC").as_deref() == Ok("1") => {
            panic!("KILN_REQUIRE_NVRTC=1 but NVRTC is unavailable: {why}")
        }
        Err(why) => {
            println!("skipped: {why}");
            false
        }
    }
}

#[test]
fn every_kernel_family_compiles_for_sm_90() {
    if !require_nvrtc() {
        return;
    }
    let (major, minor) = kernels::nvrtc_version().expect("version");
    let t = Instant::now();
    let compiled = compile_all_for(ARCH).unwrap_or_else(|e| panic!("{e}"));
    println!("NVRTC {major}.{minor}: {} families for {ARCH} in {:.2?}", compiled.len(), t.elapsed());
    assert_eq!(compiled.len(), FAMILIES.len() + ON_DEMAND.len(), "every family, eager and on demand");
    for (name, bytes) in &compiled {
        println!("  {name:<16} {bytes:>8} bytes of CUBIN");
        assert!(*bytes > 1000, "{name} compiled to a suspiciously small image");
    }
}

/// The Hopper-native families compile for the architecture-specific target `sm_90a` (wgmma and
/// setmaxnreg exist only there), through NVRTC's `--gpu-architecture=sm_90a`, without a warning
/// (ptxas reports a wgmma pipeline it had to serialise as one), with the entry points their
/// layers launch: the wgmma GEMM's and the 8-bit wgmma conv's.
#[test]
fn hopper_families_compile_for_sm_90a() {
    if !require_nvrtc() {
        return;
    }
    let t = Instant::now();
    let compiled = compile_hopper().unwrap_or_else(|e| panic!("{e}"));
    println!("{} Hopper families for sm_90a in {:.2?}", compiled.len(), t.elapsed());
    assert_eq!(compiled.len(), HOPPER.len());
    let gemm: Vec<String> = ["hopper_gemm_f16_n128_s4", "hopper_gemm_f16_n256_s3"].map(String::from).into();
    let entries = [("hopper_gemm.cu", gemm), ("conv8_hopper.cu", kiln::dev::kernels::conv8_hopper_entry_points())];
    assert_eq!(compiled.iter().map(|(n, ..)| n.as_str()).collect::<Vec<_>>(), entries.iter().map(|(n, _)| *n).collect::<Vec<_>>());
    for ((name, image, log), (_, entries)) in compiled.iter().zip(&entries) {
        println!("  {name:<16} {:>8} bytes of CUBIN", image.len());
        assert!(!log.to_lowercase().contains("warning"), "{name} compiles with warnings:\n{log}");
        assert!(!entries.is_empty());
        for entry in entries {
            assert!(image_has_symbol(image, entry), "{name} lacks {entry}");
        }
    }
    // The plain sm_90 target rejects wgmma: the family must never be compiled for it.
    let (name, src) = HOPPER[0];
    let err = compile_source(name, src, ARCH).expect_err("wgmma compiled for plain sm_90");
    assert!(err.to_string().contains("wgmma") || err.to_string().contains("sm_90a"), "{err}");
}

#[test]
fn every_entry_point_the_layers_launch_exists() {
    if !require_nvrtc() {
        return;
    }
    let images: Vec<(&str, Vec<u8>)> =
        FAMILIES.iter().map(|(n, s)| (*n, compile_source(n, s, ARCH).unwrap_or_else(|e| panic!("{e}")))).collect();
    for entry in kernel_entry_points() {
        let homes: Vec<&str> = images.iter().filter(|(_, img)| image_has_symbol(img, &entry)).map(|(n, _)| *n).collect();
        assert_eq!(homes.len(), 1, "entry point `{entry}` should be defined by exactly one family, found in {homes:?}");
    }
}

#[test]
fn the_8_bit_conv_kernels_compile_with_every_entry_point() {
    if !require_nvrtc() {
        return;
    }
    let image = compile_source("conv8.cu", kiln::dev::kernels::CONV8_CU, ARCH).unwrap_or_else(|e| panic!("{e}"));
    let entries = kiln::dev::kernels::conv8_entry_points();
    assert_eq!(entries.len(), 12, "3 tile shapes, the pointwise kernel's 2 and a finishing kernel per format: {entries:?}");
    for entry in entries {
        assert!(image_has_symbol(&image, &entry), "conv8.cu defines no `{entry}`");
    }
}

#[test]
fn centernet_decode_kernels_compile_with_every_entry_point() {
    if !require_nvrtc() {
        return;
    }
    let image = compile_source("decode.cu", kiln_models::centernet::DECODE_CU, ARCH).unwrap_or_else(|e| panic!("{e}"));
    for entry in kiln_models::centernet::decode_entry_points() {
        assert!(image_has_symbol(&image, &entry), "decode.cu defines no `{entry}`");
    }
}

#[test]
fn a_broken_kernel_is_a_compile_error_with_the_log() {
    if !require_nvrtc() {
        return;
    }
    let bad = r#"extern "C" __global__ void broken(float* y) { y[0] = undefined_thing; }"#;
    match compile_source("broken.cu", bad, ARCH) {
        Err(Error::KernelCompile { name, log }) => {
            assert_eq!(name, "broken.cu");
            assert!(log.contains("undefined_thing"), "the log names the culprit: {log}");
            // `#line` after the prelude: the log points into the user's file, not the prelude.
            assert!(log.contains("broken.cu(1)"), "the log points at the user's line: {log}");
        }
        other => panic!("expected KernelCompile, got {other:?}"),
    }
}

#[test]
fn a_bad_architecture_is_an_error_not_a_panic() {
    let err = compile_source("k.cu", "extern \"C\" __global__ void k() {}", "compute90").unwrap_err();
    assert!(err.to_string().contains("compute90"), "{err}");
    if !require_nvrtc() {
        return;
    }
    // Well-formed but unknown to NVRTC: NVRTC's own error, as KernelCompile.
    let err = compile_source("k.cu", "extern \"C\" __global__ void k() {}", "sm_12345").unwrap_err();
    assert!(matches!(err, Error::KernelCompile { .. }), "{err:?}");
}

#[test]
fn compiled_kernels_are_cached_on_disk() {
    if !require_nvrtc() {
        return;
    }
    // A source no other run has compiled, so the first call really compiles.
    let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let src = format!("// {nonce}\nextern \"C\" __global__ void cached_k(float* y) {{ y[threadIdx.x] = 1.f; }}\n");
    let name = format!("cache_test_{nonce}.cu");
    let t = Instant::now();
    let first = cached_compile(&name, &src, ARCH).expect("compile");
    let compile_time = t.elapsed();
    let on_disk: Vec<PathBuf> = std::fs::read_dir(kernels::cache_dir())
        .expect("cache folder exists after a compile")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().contains(&format!("cache_test_{nonce}")))
        .collect();
    assert_eq!(on_disk.len(), 1, "one cache file for the source: {on_disk:?}");
    assert_eq!(std::fs::read(&on_disk[0]).expect("read cache"), *first);
    let second = cached_compile(&name, &src, ARCH).expect("cached");
    assert_eq!(first, second);
    println!("compile {compile_time:.2?}; cache file {}", on_disk[0].display());
    let _ = std::fs::remove_file(&on_disk[0]);
}

#[test]
fn yolo_nms_letterbox_and_classify_preset_kernels_compile_with_every_entry_point() {
    if !require_nvrtc() {
        return;
    }
    let sources = [
        ("nms.cu", kiln_models::yolo_nms::NMS_CU, kiln_models::yolo_nms::nms_entry_points()),
        ("letterbox.cu", kiln_models::yolo_letterbox::LETTERBOX_CU, kiln_models::yolo_letterbox::letterbox_entry_points()),
        (
            "classify_preset.cu",
            kiln_models::classify_preset::CLASSIFY_PRESET_CU,
            kiln_models::classify_preset::classify_preset_entry_points(),
        ),
    ];
    for (name, source, entries) in sources {
        let image = compile_source(name, source, ARCH).unwrap_or_else(|e| panic!("{e}"));
        for entry in entries {
            assert!(image_has_symbol(&image, &entry), "{name} defines no `{entry}`");
        }
    }
}
