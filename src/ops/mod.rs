//! One file per op family: its layers (modules), its shape rule, its CPU reference and its
//! converter. Adding an op touches one file here (plus a kernel in `kernels/` when it needs one).

pub mod conv;
pub mod custom;
pub mod elementwise;
pub mod linear;
pub mod norm;
pub mod pool;
pub mod shape;
