//! The arithmetic of an engine ([`Precision`]), the per-layer rules that override it
//! ([`LayerPrecision`], TensorRT's `--layerPrecisions`), and the element types values are stored
//! in ([`Elem`]).

use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// Element type in device memory. Every value a layer reads or writes is `F32` or `F16` (its
/// node's precision), except in an 8-bit engine: an activation quantiser's value that only 8-bit
/// convs read is stored as its codes, `I8` or `E4m3` (`engine::eight_bit::EightBitPlan`), with the
/// scale of the quantiser node that defines it. `U8` is only ever the type of an input binding
/// declared u8 (`DType::U8`), which the builder's entry reformat converts to its reader's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Elem {
    F32,
    F16,
    U8,
    I8,
    E4m3,
}

impl Elem {
    pub fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::F16 => 2,
            Elem::U8 | Elem::I8 | Elem::E4m3 => 1,
        }
    }
    /// The suffix of kernel entry points stamped out per type (`relu_f16`, `cast_u8_f16`).
    pub fn suffix(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::F16 => "f16",
            Elem::U8 => "u8",
            Elem::I8 => "i8",
            Elem::E4m3 => "e4m3",
        }
    }
}

/// Arithmetic of an engine. `Fp32` forbids TF32 (cuDNN FMA math, cuBLASLt `COMPUTE_32F`); `Tf32`
/// keeps f32 storage and lets tensor cores round inputs to TF32; `Fp16` stores activations and
/// weights in f16 and accumulates in f32. `Int8` and `Fp8` quantise the inputs and weights of
/// convolutions and Linear layers with a calibration cache's scales (or a graph's own Q/DQ
/// nodes), see `kiln::calibrate`; every other layer runs in FP16. `Fp8` needs sm_89 or newer.
/// `Best` is TensorRT's `--best`: per layer the fastest of FP16, FP8 GEMMs and INT8 convs on 8-bit
/// tensor cores, by timing (`engine::best`), with the cache's scales and no quantiser where a
/// 16-bit layer wins (`calibrate::prepare_for_best`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Precision {
    Fp32,
    Tf32,
    #[default]
    Fp16,
    Int8,
    Fp8,
    Best,
}

impl Precision {
    /// The element type activations and weights are stored in.
    pub fn elem(self) -> Elem {
        match self {
            Precision::Fp32 | Precision::Tf32 => Elem::F32,
            Precision::Fp16 | Precision::Int8 | Precision::Fp8 | Precision::Best => Elem::F16,
        }
    }

    /// `fp32` / `fp16`: the name of a storage type, for layer listings (`u8` for a byte binding).
    pub fn name(elem: Elem) -> &'static str {
        match elem {
            Elem::F32 => "fp32",
            Elem::F16 => "fp16",
            Elem::U8 => "u8",
            Elem::I8 => "int8",
            Elem::E4m3 => "fp8",
        }
    }

    /// Parses a precision name as the CLI writes it (`fp32`, `tf32`, `fp16`, `int8`, `fp8`,
    /// `best`; any case).
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name.to_ascii_lowercase().as_str() {
            "fp32" => Precision::Fp32,
            "tf32" => Precision::Tf32,
            "fp16" => Precision::Fp16,
            "int8" => Precision::Int8,
            "fp8" => Precision::Fp8,
            "best" => Precision::Best,
            _ => return None,
        })
    }

    /// The 8-bit format this precision quantises to (`None`: not a quantised precision).
    pub fn quant_format(self) -> Option<crate::number_format::QuantFormat> {
        match self {
            Precision::Int8 => Some(crate::number_format::QuantFormat::Int8),
            Precision::Fp8 => Some(crate::number_format::QuantFormat::Fp8E4m3),
            // Best's 8-bit chains are INT8 (as fast as FP8 on the same tensor cores, and closer to
            // FP32); its FP8 GEMMs clip at the same ranges (`engine::quant`).
            Precision::Best => Some(crate::number_format::QuantFormat::Int8),
            Precision::Fp32 | Precision::Tf32 | Precision::Fp16 => None,
        }
    }

    /// `fp32`, `tf32`, `fp16`, `int8`, `fp8`, `best`: the name `parse` reads.
    pub fn short_name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Fp16 => "fp16",
            Precision::Int8 => "int8",
            Precision::Fp8 => "fp8",
            Precision::Best => "best",
        }
    }
}

/// One per-layer precision rule, TensorRT's `--layerPrecisions` with `--precisionConstraints=obey`:
/// the nodes whose module path matches `pattern` compute in `precision` (weights and activations
/// stored in its type) whatever the engine's precision. A pattern matches a path when it matches
/// the whole path or one of its ancestors (`model.22` covers `model.22.dfl.conv`); `*` matches any
/// run of characters, dots included, and `?` one character. The last matching rule wins.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerPrecision {
    pub pattern: String,
    pub precision: Precision,
}

/// The flag whose syntax [`LayerPrecision::parse_list`] reads, named in its errors.
pub const LAYER_PRECISIONS_FLAG: &str = "--layer-precisions";

impl LayerPrecision {
    pub fn new(pattern: impl Into<String>, precision: Precision) -> Self {
        Self { pattern: pattern.into(), precision }
    }

    /// Parses `pattern:precision[,pattern:precision...]` (`model.22.*:fp32,stem:fp32`), as
    /// trtexec's `--layerPrecisions`. Precisions are `fp32`, `tf32` and `fp16`; the pattern is what
    /// comes before the last `:`. Errors are `Error::Flag` naming `--layer-precisions`.
    pub fn parse_list(spec: &str) -> Result<Vec<Self>> {
        let bad = |reason: String| Error::Flag { flag: LAYER_PRECISIONS_FLAG.into(), reason };
        let mut rules = Vec::new();
        for item in spec.split(',').map(str::trim) {
            let Some((pattern, name)) = item.rsplit_once(':') else {
                return Err(bad(format!("`{item}` is not `pattern:precision` (e.g. `model.22.*:fp32`)")));
            };
            let pattern = pattern.trim();
            if pattern.is_empty() {
                return Err(bad(format!("`{item}` has an empty module-path pattern (`*` matches every layer)")));
            }
            let precision = Precision::parse(name.trim())
                .ok_or_else(|| bad(format!("`{item}`: unknown precision `{}` (expected fp32, tf32 or fp16)", name.trim())))?;
            let rule = Self::new(pattern, precision);
            rule.check().map_err(bad)?;
            rules.push(rule);
        }
        Ok(rules)
    }

    /// Only storage precisions can be asked per layer: an 8-bit layer needs calibration scales.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        match self.precision {
            Precision::Fp32 | Precision::Tf32 | Precision::Fp16 => Ok(()),
            p => Err(format!("`{}:{}`: per-layer {p:?} is not supported (use fp32, tf32 or fp16)", self.pattern, p.short_name())),
        }
    }

    /// Whether the rule covers the node at `path` (the path itself or one of its ancestors).
    pub fn matches(&self, path: &str) -> bool {
        let ancestors = path.match_indices('.').map(|(i, _)| &path[..i]);
        ancestors.chain(std::iter::once(path)).any(|p| glob_match(&self.pattern, p))
    }
}

/// Whether `text` matches the glob `pattern` as a whole: `*` any run of characters (dots too),
/// `?` exactly one; everything else literally.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    // The classic two-pointer match with backtracking to the last `*` (linear in practice).
    let (mut i, mut j, mut star, mut mark) = (0, 0, None, 0);
    while j < t.len() {
        if i < p.len() && (p[i] == '?' || p[i] == t[j]) {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some(i);
            mark = j;
            i += 1;
        } else if let Some(s) = star {
            i = s + 1;
            mark += 1;
            j = mark;
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_whole_paths() {
        assert!(glob_match("model.22.*", "model.22.dfl.conv"));
        assert!(glob_match("*", ""));
        assert!(glob_match("layer?.0.conv1", "layer3.0.conv1"));
        assert!(glob_match("*.se.*", "trunk_output.block1.block1-0.f.se.fc1"));
        assert!(glob_match("a*b*c", "axxbyybc"));
        assert!(!glob_match("model.22.*", "model.22"));
        assert!(!glob_match("layer?.conv", "layer10.conv"));
        assert!(!glob_match("stem", "stem.0"));
    }

    #[test]
    fn a_pattern_covers_a_path_and_what_is_under_it() {
        let rule = LayerPrecision::new("trunk_output.block1", Precision::Fp32);
        assert!(rule.matches("trunk_output.block1"));
        assert!(rule.matches("trunk_output.block1.block1-0.f.a.0"));
        assert!(!rule.matches("trunk_output.block10.x"), "ancestors end at a dot");
        assert!(!rule.matches("trunk_output"));
        assert!(LayerPrecision::new("*.f.a", Precision::Fp32).matches("trunk_output.block2.block2-1.f.a.0"));
    }

    #[test]
    fn layer_precision_specs_parse_as_trtexec_writes_them() {
        let rules = LayerPrecision::parse_list("model.22.*:fp32, stem:FP16,layer?.0:tf32").expect("valid");
        assert_eq!(
            rules,
            [
                LayerPrecision::new("model.22.*", Precision::Fp32),
                LayerPrecision::new("stem", Precision::Fp16),
                LayerPrecision::new("layer?.0", Precision::Tf32)
            ]
        );
        // A pattern may hold a colon: the precision is after the last one.
        assert_eq!(LayerPrecision::parse_list("a:b:fp32").expect("valid")[0].pattern, "a:b");
        for (spec, why) in [
            ("model.22", "not `pattern:precision`"),
            (":fp32", "empty module-path pattern"),
            ("stem:fp64", "unknown precision `fp64`"),
            ("stem:int8", "per-layer Int8 is not supported"),
            ("stem:fp32,", "not `pattern:precision`"),
        ] {
            let err = LayerPrecision::parse_list(spec).expect_err(spec);
            assert!(matches!(&err, Error::Flag { flag, .. } if flag == LAYER_PRECISIONS_FLAG), "{spec}: {err:?}");
            let text = err.to_string();
            assert!(text.starts_with("--layer-precisions") && text.contains(why), "{spec}: {text}");
        }
    }
}
