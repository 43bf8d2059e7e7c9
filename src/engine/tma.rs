//! TMA tensor maps (`cuTensorMapEncodeTiled`) for the Hopper kernels: a [`TiledMap`] describes a
//! tiled view of a global tensor (dims, byte strides, box, traversal strides, swizzle), is checked
//! on the host against the driver's documented limits, so that a refusal names the parameter, and
//! is then encoded into the 128 opaque bytes a kernel takes as a `__grid_constant__` parameter.

use cudarc::driver::sys;
use std::ffi::c_void;

/// The element types the kernels load through TMA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TmaElem {
    /// 8-bit codes (int8 or e4m3: TMA only moves bytes).
    U8,
    F16,
}

impl TmaElem {
    fn bytes(self) -> u64 {
        match self {
            TmaElem::U8 => 1,
            TmaElem::F16 => 2,
        }
    }
    fn driver(self) -> sys::CUtensorMapDataType {
        match self {
            TmaElem::U8 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            TmaElem::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        }
    }
}

/// Shared-memory swizzle of a box's rows (the wgmma descriptor's layout must match it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TmaSwizzle {
    B64,
    B128,
}

impl TmaSwizzle {
    /// The swizzle's span: a box's inner dim may be at most this many bytes.
    pub fn bytes(self) -> u64 {
        match self {
            TmaSwizzle::B64 => 64,
            TmaSwizzle::B128 => 128,
        }
    }
    fn driver(self) -> sys::CUtensorMapSwizzle {
        match self {
            TmaSwizzle::B64 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
            TmaSwizzle::B128 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        }
    }
}

/// A tiled view of a tensor in global memory, dims listed innermost (contiguous) first, as the
/// driver takes them; elements outside the tensor are loaded as zeros.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TiledMap {
    pub elem: TmaElem,
    /// Device address of element 0.
    pub address: u64,
    /// Elements per dim.
    pub dims: Vec<u64>,
    /// Byte strides of dims 1.. (dim 0 is contiguous).
    pub strides: Vec<u64>,
    /// The box: elements traversed per dim.
    pub boxes: Vec<u32>,
    /// Traversal strides: along dim i the box brings every `element_strides[i]`-th element,
    /// `boxes[i] / element_strides[i]` of them (rounded up).
    pub element_strides: Vec<u32>,
    pub swizzle: TmaSwizzle,
}

impl TiledMap {
    /// Bytes one box brings into shared memory (what its barrier is told to expect).
    pub fn box_bytes(&self) -> u64 {
        let elements: u64 = self.boxes.iter().zip(&self.element_strides).map(|(&b, &s)| u64::from(b.div_ceil(s.max(1)))).product();
        elements * self.elem.bytes()
    }

    /// Why the driver would refuse this map, or `Ok`: the limits of `cuTensorMapEncodeTiled`'s
    /// documentation (rank 1 to 5; dims in 1..=2^32; strides multiples of 16 below 2^40; boxes of 1
    /// to 256 elements, the inner one a multiple of 16 bytes and within the swizzle's span;
    /// traversal strides 1 to 8; a 16-byte aligned address).
    pub fn check(&self) -> Result<(), String> {
        let rank = self.dims.len();
        if !(1..=5).contains(&rank) || self.strides.len() + 1 != rank || self.boxes.len() != rank || self.element_strides.len() != rank {
            return Err(format!(
                "a tensor map has rank 1 to 5 with one box size and traversal stride per dim: {} dims, {} strides, {} boxes, {} traversal strides",
                rank,
                self.strides.len(),
                self.boxes.len(),
                self.element_strides.len()
            ));
        }
        if !self.address.is_multiple_of(16) {
            return Err(format!("the tensor at {:#x} is not 16-byte aligned", self.address));
        }
        if let Some(d) = self.dims.iter().find(|&&d| d == 0 || d > 1 << 32) {
            return Err(format!("dim {d} is outside 1..=2^32 (dims {:?})", self.dims));
        }
        if let Some(s) = self.strides.iter().find(|&&s| !s.is_multiple_of(16) || s >= 1 << 40) {
            return Err(format!("byte stride {s} is not a multiple of 16 below 2^40 (strides {:?})", self.strides));
        }
        if let Some(b) = self.boxes.iter().find(|&&b| b == 0 || b > 256) {
            return Err(format!("box size {b} is outside 1..=256 (box {:?})", self.boxes));
        }
        if let Some(s) = self.element_strides.iter().find(|&&s| s == 0 || s > 8) {
            return Err(format!("traversal stride {s} is outside 1..=8 ({:?})", self.element_strides));
        }
        let inner = u64::from(self.boxes[0]) * self.elem.bytes();
        if !inner.is_multiple_of(16) || inner > self.swizzle.bytes() {
            return Err(format!(
                "the box's inner dim is {inner} bytes: it must be a multiple of 16 within the {}-byte swizzle",
                self.swizzle.bytes()
            ));
        }
        Ok(())
    }

    /// The encoded map, after [`TiledMap::check`]; the driver's refusal as text.
    pub fn encode(&self) -> Result<sys::CUtensorMap, String> {
        self.check()?;
        let rank = self.dims.len();
        let mut map = sys::CUtensorMap { opaque: [0; 16] };
        // SAFETY: `check` established that `dims`, `boxes` and `element_strides` hold `rank`
        // entries and `strides` `rank - 1`, the lengths the driver reads for this rank; `map` is
        // written in place. The global address is only recorded, not dereferenced, by the
        // encoding.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                self.elem.driver(),
                rank as u32,
                self.address as *mut c_void,
                self.dims.as_ptr(),
                self.strides.as_ptr(),
                self.boxes.as_ptr(),
                self.element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                self.swizzle.driver(),
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
        .result()
        .map_err(|e| format!("cuTensorMapEncodeTiled(dims {:?}, box {:?}): {e:?}", self.dims, self.boxes))?;
        Ok(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(rows: u64, k: u64) -> TiledMap {
        TiledMap {
            elem: TmaElem::F16,
            address: 0x1000,
            dims: vec![k, rows],
            strides: vec![k * 2],
            boxes: vec![64, 128],
            element_strides: vec![1, 1],
            swizzle: TmaSwizzle::B128,
        }
    }

    #[test]
    fn the_driver_limits_are_checked_with_the_parameter_named() {
        assert!(matrix(1000, 768).check().is_ok());
        assert_eq!(matrix(1000, 768).box_bytes(), 128 * 64 * 2);
        let bad = |f: &dyn Fn(&mut TiledMap), want: &str| {
            let mut m = matrix(1000, 768);
            f(&mut m);
            let err = m.check().expect_err(want);
            assert!(err.contains(want), "{err}");
        };
        bad(&|m| m.address = 0x1008, "16-byte aligned");
        bad(&|m| m.strides = vec![770 * 2], "multiple of 16");
        bad(&|m| m.dims[1] = 0, "outside 1..=2^32");
        bad(&|m| m.boxes[1] = 257, "box size 257");
        bad(&|m| m.element_strides[1] = 9, "traversal stride 9");
        bad(&|m| m.boxes[0] = 128, "within the 128-byte swizzle");
        bad(&|m| m.swizzle = TmaSwizzle::B64, "within the 64-byte swizzle");
        bad(&|m| m.boxes.push(1), "rank 1 to 5");
    }

    #[test]
    fn traversal_strides_shrink_the_box_in_shared_memory() {
        // A stride-2 conv's patch: 16 × 8 output pixels are a 32 × 16 input box taken every
        // second pixel, 64 channels of codes each.
        let m = TiledMap {
            elem: TmaElem::U8,
            address: 0,
            dims: vec![64, 57, 57, 3],
            strides: vec![64, 64 * 57, 64 * 57 * 57],
            boxes: vec![64, 32, 16, 1],
            element_strides: vec![1, 2, 2, 1],
            swizzle: TmaSwizzle::B64,
        };
        assert!(m.check().is_ok());
        assert_eq!(m.box_bytes(), 64 * 16 * 8);
    }
}
