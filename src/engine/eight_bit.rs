//! The 8-bit storage plan of an INT8 or FP8 engine and the kinds of its 8-bit layers.
//!
//! [`EightBitPlan`] says which values the engine keeps as 8-bit codes and which convs read and
//! write them; the conv family makes it (`ops::conv::conv8::plan`, docs/QUANT.md) and the builder
//! allocates by it. The kind prefixes let the build summary, `kiln inspect` and `Best` tell the
//! 8-bit layers from the others without knowing the ops that make them.

use super::layer::Elem;
use super::Precision;
use crate::number_format::QuantFormat;

/// Where the 8-bit plan puts each node of an 8-bit engine's graph (indexed by node id, as
/// `graph::NodeId`: a plain index here, so the engine's side needs no graph).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EightBitPlan {
    /// The format of the codes (`None`: nothing is 8-bit).
    pub format: Option<QuantFormat>,
    /// Convs lowered to an 8-bit kernel (the ResNet stem's to the 8-bit stem, `ops::conv::stem`).
    pub conv: Vec<bool>,
    /// Activation quantisers whose value is stored as 8-bit codes.
    pub stored: Vec<bool>,
    /// For an 8-bit conv whose only reader is a stored quantiser: that quantiser, whose codes the
    /// conv writes (the quantiser itself is not lowered).
    pub requant: Vec<Option<usize>>,
    /// Activation quantisers whose only reader is the 8-bit stem: the stem quantises its FP16
    /// input as it loads it, so the quantiser is not lowered (its value is its input's).
    pub folded: Vec<bool>,
}

impl EightBitPlan {
    /// The storage type of a stored quantiser's value in a `format` engine.
    pub fn elem(format: QuantFormat) -> Elem {
        match format {
            QuantFormat::Int8 => Elem::I8,
            QuantFormat::Fp8E4m3 => Elem::E4m3,
        }
    }
}

/// The kind prefix of every 8-bit conv layer (`kiln inspect`, the build summary).
pub const KIND: &str = "kernel:conv8_";

/// The kind prefix of the 8-bit convs on cuDNN's fused engines (`cudnn-graph-i8:eng4_k24=1`).
pub const LIBRARY_KIND: &str = "cudnn-graph-";

/// The kind of the layer that writes an FP16 value's 8-bit codes (a stored quantiser whose
/// producer does not requantise).
pub const QUANT_CODES: &str = "kernel:quant_codes";

/// The kind of the FP8 GEMM layers, before their epilogue's name (`cublaslt-gemm-fp8:fused`,
/// `cublaslt-gemm-fp8:bias-kernel`).
pub const FP8_GEMM: &str = "cublaslt-gemm-fp8";

/// The element types of the codes, one per format (`i8`, `e4m3` in kinds and entry points).
const CODES: [Elem; 2] = [Elem::I8, Elem::E4m3];

/// The precision an 8-bit conv layer of this kind computes in (`int8`, `fp8`), for `kiln inspect`
/// and the build summary; `None` for any other layer.
pub fn precision_of_kind(kind: &str) -> Option<&'static str> {
    let (entry, sep) = match kind.strip_prefix(KIND) {
        Some(e) => (e, '_'),
        None => (kind.strip_prefix(LIBRARY_KIND)?, ':'),
    };
    CODES.into_iter().find(|e| entry.starts_with(&format!("{}{sep}", e.suffix()))).map(Precision::name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_name_their_precision() {
        assert_eq!(CODES, [QuantFormat::Int8, QuantFormat::Fp8E4m3].map(EightBitPlan::elem));
        assert_eq!(precision_of_kind("kernel:conv8_i8_pw3"), Some("int8"));
        assert_eq!(precision_of_kind("kernel:conv8_i8_m64n64:split4"), Some("int8"));
        assert_eq!(precision_of_kind("kernel:conv8_e4m3_m128n64"), Some("fp8"));
        assert_eq!(precision_of_kind("cudnn-fused:IMPLICIT_PRECOMP_GEMM"), None);
        assert_eq!(precision_of_kind("cudnn-graph-i8:eng4_k24=1"), Some("int8"));
        assert_eq!(precision_of_kind("cudnn-graph-e4m3:eng2"), Some("fp8"));
    }
}
