//! cuBLASLt layers: 1x1 convolutions and Linear as GEMMs with fused epilogues.
