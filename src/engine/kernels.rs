//! Kiln's own CUDA kernels: `kernels/*.cu`, embedded in the binary, compiled with NVRTC for the
//! device's architecture once per process and cached on disk, so a rebuild skips compilation.
//!
//! Every family is compiled as `kernels/common.cuh` followed by the family's source: NVRTC has no
//! CUDA headers of its own (and CI has none installed), so the shared element types and helpers
//! are prepended rather than `#include`d. Output is a CUBIN for the exact architecture (`sm_90`),
//! which the driver loads without a PTX JIT step and without caring which NVRTC made it.
//!
//! cudarc loads NVRTC dynamically and panics when the library is absent; everything here checks
//! for it first and returns `Error::NoGpu` with the reason instead.

use super::gpu::{cuda_err, Gpu};
use crate::hash::{fnv1a_extend, FNV_OFFSET};
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys, Ptx};
use std::collections::HashMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// Prepended to every kernel source (Kiln's and users').
pub const PRELUDE: &str = include_str!("../../kernels/common.cuh");

/// `kernels/depthwise.cu` as part `$n` of its seven programs (its `DW_PART`): one program takes
/// NVRTC about 20–30 s, most of it in the register-tiled kernels, and is a fresh machine's first
/// build's longest wait; its parts compile side by side in at most about 4.5 s each.
macro_rules! depthwise_part {
    ($n:literal) => {
        (concat!("depthwise.cu#", $n), concat!("#define DW_PART ", $n, "\n", include_str!("../../kernels/depthwise.cu")))
    };
}

/// Kiln's kernel families: `(file name, source)` (`depthwise.cu#k` for the depthwise parts).
pub const FAMILIES: &[(&str, &str)] = &[
    ("elementwise.cu", include_str!("../../kernels/elementwise.cu")),
    ("reformat.cu", include_str!("../../kernels/reformat.cu")),
    ("pool.cu", include_str!("../../kernels/pool.cu")),
    ("concat.cu", include_str!("../../kernels/concat.cu")),
    ("permute.cu", include_str!("../../kernels/permute.cu")),
    ("norm.cu", include_str!("../../kernels/norm.cu")),
    ("shape.cu", include_str!("../../kernels/shape.cu")),
    ("resize.cu", include_str!("../../kernels/resize.cu")),
    depthwise_part!(0),
    depthwise_part!(1),
    depthwise_part!(2),
    depthwise_part!(3),
    depthwise_part!(4),
    depthwise_part!(5),
    depthwise_part!(6),
    ("attention.cu", include_str!("../../kernels/attention.cu")),
    ("quant.cu", include_str!("../../kernels/quant.cu")),
];

/// Families compiled only when a layer that launches them is built (`Kernels::add_source`): the
/// channel padding of the FP16 cuDNN path, the im2col of the small-channel stem, the
/// depth-to-space of the sub-pixel transposed convolution, the fused stem + max-pool (FP16 and
/// 8-bit) and the 8-bit convs. The last two share `kernels/eight_bit.cuh`'s 8-bit MMA and
/// requantisation helpers, prepended to their sources.
pub const ON_DEMAND: &[(&str, &str)] = &[
    ("pad.cu", include_str!("../../kernels/pad.cu")),
    ("im2col.cu", include_str!("../../kernels/im2col.cu")),
    ("subpixel.cu", include_str!("../../kernels/subpixel.cu")),
    ("stem.cu", concat!(include_str!("../../kernels/eight_bit.cuh"), include_str!("../../kernels/stem.cu"))),
    (
        "conv8.cu",
        concat!(
            include_str!("../../kernels/eight_bit.cuh"),
            include_str!("../../kernels/conv8_epilogue.cuh"),
            include_str!("../../kernels/conv8.cu")
        ),
    ),
];

/// Hopper-native families (TMA, wgmma, setmaxnreg): compiled for the architecture-specific target
/// `sm_90a` ([`hopper_arch`]) on demand, with `kernels/hopper.cuh`'s building blocks prepended: the
/// FP16 GEMM, and the 8-bit conv (which also takes the 8-bit helpers and conv8's epilogue).
pub const HOPPER: &[(&str, &str)] = &[
    ("hopper_gemm.cu", concat!(include_str!("../../kernels/hopper.cuh"), include_str!("../../kernels/hopper_gemm.cu"))),
    (
        "conv8_hopper.cu",
        concat!(
            include_str!("../../kernels/hopper.cuh"),
            include_str!("../../kernels/eight_bit.cuh"),
            include_str!("../../kernels/conv8_epilogue.cuh"),
            include_str!("../../kernels/conv8_hopper.cu")
        ),
    ),
];

/// `kernels/hopper_gemm.cu` (with hopper.cuh) and `kernels/conv8_hopper.cu` (with hopper.cuh,
/// eight_bit.cuh and conv8_epilogue.cuh), as their layers compile them.
pub const HOPPER_GEMM: (&str, &str) = HOPPER[0];
pub const CONV8_HOPPER: (&str, &str) = HOPPER[1];

/// The architecture-specific target the Hopper families need on a device of architecture `arch`
/// (`sm_90` → `sm_90a`: wgmma and setmaxnreg exist only there), or `None` where they do not run.
/// The `a` target's code runs on sm_90 devices alone, so it is never the engine's general target.
pub fn hopper_arch(arch: &str) -> Option<String> {
    (arch == "sm_90").then(|| "sm_90a".to_string())
}

/// Compiles every Hopper family for `sm_90a` (no cache): what CI runs, beside
/// [`compile_all_for`]. Each family's name, CUBIN and NVRTC's log (its warnings, if any).
pub fn compile_hopper() -> Result<Vec<(String, Vec<u8>, String)>> {
    HOPPER
        .iter()
        .map(|(name, src)| {
            let (cubin, log) = compile_with_log(name, src, "sm_90a")?;
            Ok((name.to_string(), cubin, log))
        })
        .collect()
}

/// Loads NVRTC from an explicit path (a file, or a folder holding `libnvrtc.so*`) and keeps it
/// loaded, so that cudarc's later lookup by name finds it even when its folder is not on
/// `LD_LIBRARY_PATH` (the dynamic loader matches already-loaded libraries by soname).
pub fn preload_nvrtc(path: &Path) -> Result<PathBuf> {
    let file = if path.is_dir() {
        let mut found: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(Error::io(path))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libnvrtc.so")))
            .collect();
        found.sort();
        found.into_iter().next().ok_or_else(|| Error::NoGpu(format!("no libnvrtc.so* in {}", path.display())))?
    } else {
        path.to_path_buf()
    };
    // NVRTC opens its builtins library by name when it compiles; outside LD_LIBRARY_PATH it
    // finds it only if it is already loaded, so load the one beside it first.
    let dir = file.parent().unwrap_or(Path::new("."));
    let builtins: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(Error::io(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libnvrtc-builtins.so")))
        .collect();
    for lib in builtins.iter().chain([&file]) {
        // SAFETY: loading NVRTC runs its initialisers, as cudarc's own load would.
        let loaded = unsafe { libloading::Library::new(lib) }.map_err(|e| Error::NoGpu(format!("cannot load {}: {e}", lib.display())))?;
        // Deliberately kept for the life of the process: cudarc holds symbols from it.
        std::mem::forget(loaded);
    }
    Ok(file)
}

/// `Ok` when NVRTC can be loaded, else `Error::NoGpu` saying why. `KILN_NVRTC_PATH` (a file or a
/// folder) is tried first when set.
pub fn nvrtc_available() -> Result<()> {
    static PROBE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            if let Some(p) = std::env::var_os("KILN_NVRTC_PATH") {
                preload_nvrtc(Path::new(&p)).map_err(|e| match e {
                    Error::NoGpu(why) => format!("KILN_NVRTC_PATH: {why}"),
                    other => format!("KILN_NVRTC_PATH: {other}"),
                })?;
            }
            // SAFETY: only tries to dlopen the candidate names.
            if unsafe { nvrtc_sys::is_culib_present() } {
                Ok(())
            } else {
                Err("the NVRTC library (libnvrtc.so) is not installed or not on LD_LIBRARY_PATH (or set KILN_NVRTC_PATH)".to_string())
            }
        })
        .clone()
        .map_err(Error::NoGpu)
}

/// Runs a call into NVRTC, turning cudarc's panic on a missing symbol into `Error::NoGpu`.
fn guarded<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    nvrtc_available()?;
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err(Error::NoGpu("the NVRTC library could not be used (missing symbol)".into())))
}

/// NVRTC's version `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    guarded(|| {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: plain out-parameters.
        unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
            .result()
            .map_err(|e| Error::NoGpu(format!("nvrtcVersion failed: {e:?}")))?;
        Ok((major, minor))
    })
}

fn check_arch(arch: &str) -> Result<()> {
    let digits = arch.strip_prefix("sm_").unwrap_or("");
    if digits.len() < 2 || !digits.chars().all(|c| c.is_ascii_alphanumeric()) || !digits.starts_with(|c: char| c.is_ascii_digit()) {
        return Err(Error::Config { reason: format!("`{arch}` is not a GPU architecture (expected e.g. `sm_90`)") });
    }
    Ok(())
}

fn options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-lineinfo".into()]
}

/// An NVRTC program, destroyed on drop.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by create_program and destroyed only here.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles `PRELUDE + source` for `arch` (no cache); the CUBIN, or `Error::KernelCompile` with
/// NVRTC's log.
pub fn compile_source(name: &str, source: &str, arch: &str) -> Result<Vec<u8>> {
    compile_with_log(name, source, arch).map(|(cubin, _)| cubin)
}

/// [`compile_source`], with NVRTC's log of a successful compilation (empty, or its warnings).
fn compile_with_log(name: &str, source: &str, arch: &str) -> Result<(Vec<u8>, String)> {
    check_arch(arch)?;
    let fail = |log: String| Error::KernelCompile { name: name.to_string(), log };
    let full =
        CString::new(format!("{PRELUDE}\n#line 1 \"{name}\"\n{source}")).map_err(|_| fail("the source contains a NUL byte".into()))?;
    let cname = CString::new(name).map_err(|_| fail("the kernel name contains a NUL byte".into()))?;
    guarded(|| {
        let prog = Program(nvrtc::create_program(&full, Some(cname.as_c_str())).map_err(|e| fail(format!("nvrtcCreateProgram: {e:?}")))?);
        // SAFETY: `prog` is live until the end of this closure.
        let compiled = unsafe { nvrtc::compile_program(prog.0, &options(arch)) };
        if let Err(e) = compiled {
            // SAFETY: `prog.0` is a live program created above; the options outlive the call.
            let log = unsafe { nvrtc::get_program_log(prog.0) }.map(|l| c_chars_to_string(&l)).unwrap_or_default();
            return Err(fail(format!("{e:?} for {arch}\n{log}")));
        }
        let mut size = 0usize;
        // SAFETY: `prog.0` is a live, compiled program; `size` outlives the call.
        unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) }.result().map_err(|e| fail(format!("nvrtcGetCUBINSize: {e:?}")))?;
        let mut cubin = vec![0u8; size];
        // SAFETY: `cubin` has the size NVRTC reported for this program.
        unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) }
            .result()
            .map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}")))?;
        // SAFETY: `prog.0` is a live, compiled program.
        let log = unsafe { nvrtc::get_program_log(prog.0) }.map(|l| c_chars_to_string(&l)).unwrap_or_default();
        Ok((cubin, log))
    })
}

/// Compiles every family of `kernels/` for `arch`, bypassing all caches: what CI runs to keep a
/// kernel that does not compile from landing. Needs NVRTC, not a GPU. Returns each family's
/// name and CUBIN size.
pub fn compile_all_for(arch: &str) -> Result<Vec<(String, usize)>> {
    FAMILIES.iter().chain(ON_DEMAND).map(|(name, src)| Ok((name.to_string(), compile_source(name, src, arch)?.len()))).collect()
}

/// A stable hash of several byte strings for cache keys (std's hasher may change between
/// releases): FNV-1a with a separator after each part, so ("ab", "c") and ("a", "bc") differ.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    parts.iter().fold(FNV_OFFSET, |h, part| fnv1a_extend(fnv1a_extend(h, part), &[0xff]))
}

/// Where compiled kernels are cached: `$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else
/// `~/.cache/kiln`, else the system's temporary folder.
pub fn cache_dir() -> PathBuf {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("KILN_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|p| p.join("kiln")))
        .or_else(|| env("HOME").map(|p| p.join(".cache").join("kiln")))
        .unwrap_or_else(|| std::env::temp_dir().join("kiln-cache"))
}

/// The cache file of a source for an architecture and this NVRTC: any change to any of them
/// (or to the prelude or the options) is a new key.
fn cache_path(name: &str, source: &str, arch: &str) -> Result<PathBuf> {
    let (major, minor) = nvrtc_version()?;
    let version = format!("nvrtc {major}.{minor}; {}", options(arch).join(" "));
    let key = fnv1a(&[PRELUDE.as_bytes(), source.as_bytes(), arch.as_bytes(), version.as_bytes()]);
    let stem: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '_' }).collect();
    Ok(cache_dir().join(format!("{stem}-{arch}-{key:016x}.cubin")))
}

/// The CUBIN of a source: from this process's memory, else the disk cache, else NVRTC (then
/// written to the cache; a cache that cannot be written is not an error, only slower).
pub fn cached_compile(name: &str, source: &str, arch: &str) -> Result<Arc<Vec<u8>>> {
    static MEMORY: OnceLock<Mutex<HashMap<PathBuf, Arc<Vec<u8>>>>> = OnceLock::new();
    let path = cache_path(name, source, arch)?;
    let memory = MEMORY.get_or_init(Default::default);
    if let Some(hit) = memory.lock().unwrap_or_else(|p| p.into_inner()).get(&path) {
        return Ok(hit.clone());
    }
    let cubin = match std::fs::read(&path) {
        // An ELF image: a truncated or foreign file is recompiled rather than handed to the driver.
        Ok(bytes) if bytes.starts_with(b"\x7fELF") => bytes,
        _ => {
            let bytes = compile_source(name, source, arch)?;
            let _ = crate::host::write_atomically(&path, &bytes);
            bytes
        }
    };
    let cubin = Arc::new(cubin);
    memory.lock().unwrap_or_else(|p| p.into_inner()).insert(path, cubin.clone());
    Ok(cubin)
}

/// The loaded kernels of one device: Kiln's families, plus any source a user added
/// ([`Kernels::add_source`]); entry points are looked up by name (`relu_f16`) and kept.
pub struct Kernels {
    ctx: Arc<CudaContext>,
    arch: String,
    sm_count: u32,
    modules: Mutex<Vec<(String, Arc<CudaModule>)>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

impl Kernels {
    /// Compiles (or loads from the cache) and loads every family for the device's architecture.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Self> {
        let sm_count = gpu
            .ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_err("reading the SM count"))?;
        let kernels = Self {
            ctx: gpu.ctx.clone(),
            arch: gpu.info.arch(),
            sm_count: sm_count.max(1) as u32,
            modules: Mutex::new(Vec::new()),
            functions: Mutex::new(HashMap::new()),
        };
        // NVRTC compiles one program on one thread: compile the families side by side (a fresh
        // machine with an empty cache pays this once; later builds read the disk cache).
        let arch = kernels.arch.clone();
        std::thread::scope(|s| {
            let jobs: Vec<_> = FAMILIES.iter().map(|(name, src)| s.spawn(|| cached_compile(name, src, &arch))).collect();
            jobs.into_iter()
                .try_for_each(|j| j.join().unwrap_or_else(|_| Err(Error::NoGpu("NVRTC panicked while compiling".into()))).map(drop))
        })?;
        for (name, src) in FAMILIES {
            kernels.add_source(name, src)?;
        }
        Ok(kernels)
    }

    /// The NVRTC architecture kernels are compiled for (`sm_90`).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Streaming multiprocessors of the device (for sizing grids).
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Compiles (cached) and loads a user's kernel source; its `extern "C"` entry points then
    /// resolve through [`Kernels::get`]. The source sees `kernels/common.cuh` (types `f16`,
    /// `Pack`, `to_f32`/`from_f32`, `GRID_STRIDE`). Adding the same name again is a no-op.
    pub fn add_source(&self, name: &str, source: &str) -> Result<()> {
        let arch = self.arch.clone();
        self.add_source_for(name, source, &arch)
    }

    /// [`Kernels::add_source`] for another architecture target than the device's own (a Hopper
    /// family's `sm_90a`, see [`hopper_arch`]). Adding the same name again is a no-op.
    pub fn add_source_for(&self, name: &str, source: &str, arch: &str) -> Result<()> {
        if self.modules.lock().unwrap_or_else(|p| p.into_inner()).iter().any(|(n, _)| n == name) {
            return Ok(());
        }
        let cubin = cached_compile(name, source, arch)?;
        let module = self
            .ctx
            .load_module(Ptx::from_binary(cubin.as_ref().clone()))
            .map_err(|e| Error::KernelCompile { name: name.to_string(), log: format!("the driver rejected the compiled module: {e:?}") })?;
        self.modules.lock().unwrap_or_else(|p| p.into_inner()).push((name.to_string(), module));
        Ok(())
    }

    /// The entry point `entry` of any loaded source.
    pub fn get(&self, entry: &str) -> Result<CudaFunction> {
        if let Some(f) = self.functions.lock().unwrap_or_else(|p| p.into_inner()).get(entry) {
            return Ok(f.clone());
        }
        let modules = self.modules.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for (_, module) in &modules {
            if let Ok(f) = module.load_function(entry) {
                self.functions.lock().unwrap_or_else(|p| p.into_inner()).insert(entry.to_string(), f.clone());
                return Ok(f);
            }
        }
        let loaded: Vec<&str> = modules.iter().map(|(n, _)| n.as_str()).collect();
        Err(Error::KernelCompile {
            name: entry.to_string(),
            log: format!("no kernel entry point `{entry}` in the loaded sources {loaded:?}"),
        })
    }
}

/// Whether the symbol `name` appears whole (NUL before and after, as in an ELF string table) in
/// a compiled image: a cheap check that a family exports the entry points the layers launch.
pub fn image_has_symbol(image: &[u8], name: &str) -> bool {
    let needle: Vec<u8> = [&[0u8][..], name.as_bytes(), &[0u8][..]].concat();
    image.windows(needle.len()).any(|w| w == needle.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_keys_change_with_every_input() {
        let base = fnv1a(&[b"src", b"sm_90", b"nvrtc 13.0"]);
        assert_ne!(base, fnv1a(&[b"src ", b"sm_90", b"nvrtc 13.0"]));
        assert_ne!(base, fnv1a(&[b"src", b"sm_89", b"nvrtc 13.0"]));
        assert_ne!(base, fnv1a(&[b"src", b"sm_90", b"nvrtc 13.2"]));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        assert_eq!(base, fnv1a(&[b"src", b"sm_90", b"nvrtc 13.0"]));
    }

    #[test]
    fn architectures_are_checked() {
        for ok in ["sm_90", "sm_80", "sm_90a", "sm_100"] {
            assert!(check_arch(ok).is_ok(), "{ok}");
        }
        for bad in ["90", "sm_", "sm_9", "compute_90", "sm_9 0", "sm_x0"] {
            assert!(check_arch(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn symbols_are_found_whole() {
        let image = b"\x7fELF\0relu_f16\0add_f32\0";
        assert!(image_has_symbol(image, "relu_f16"));
        assert!(image_has_symbol(image, "add_f32"));
        assert!(!image_has_symbol(image, "relu_f1"));
        assert!(!image_has_symbol(image, "mul_f32"));
        assert!(!image_has_symbol(image, "u_f16"), "a suffix of another symbol");
    }
}
