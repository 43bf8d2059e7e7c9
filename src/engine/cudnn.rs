//! cuDNN layers: fused convolution (bias, residual, ReLU), transposed convolution, batch norm.
