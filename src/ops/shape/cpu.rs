//! The CPU references: gathers over contiguous strides.

use super::rules::{
    cat_shape, edge_pad_shape, flatten_shape, numel, pad_shape, pads_per_dim, permute_shape, reshape_shape, roll_per_dim, roll_shape,
    slice_shape,
};
use crate::error::OpError;
use crate::graph::HostTensor;

/// Row-major strides of `shape` (in elements): what a contiguous tensor of that shape has.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for k in (0..shape.len().saturating_sub(1)).rev() {
        strides[k] = strides[k + 1] * shape[k + 1];
    }
    strides
}

/// Calls `f(i, offset)` for each index `i` of `shape` in row-major order, with
/// `offset = base + sum(index[k] * strides[k])`.
fn for_each_offset(shape: &[usize], strides: &[usize], base: usize, mut f: impl FnMut(usize, usize)) {
    let n: usize = shape.iter().product();
    let mut idx = vec![0; shape.len()];
    let mut off = base;
    for i in 0..n {
        f(i, off);
        for k in (0..shape.len()).rev() {
            idx[k] += 1;
            off += strides[k];
            if idx[k] < shape[k] {
                break;
            }
            off -= strides[k] * shape[k];
            idx[k] = 0;
        }
    }
}

/// A tensor of `shape` whose element `i` is `x[base + sum(index[k] * strides[k])]`.
fn gather(x: &[f32], shape: Vec<usize>, strides: &[usize], base: usize) -> HostTensor {
    let mut out = vec![0.0; shape.iter().product()];
    for_each_offset(&shape, strides, base, |i, off| out[i] = x[off]);
    HostTensor::new(shape, out)
}

/// `torch.flatten(x, start)`: the data is already in that order, only the shape changes.
pub fn flatten_cpu(start: usize, mut x: HostTensor) -> Result<HostTensor, OpError> {
    x.shape = flatten_shape(start, &[&x.shape])?;
    Ok(x)
}

/// `x.reshape(N, *dims)`: the data is already in that order.
pub fn reshape_cpu(dims: &[usize], mut x: HostTensor) -> Result<HostTensor, OpError> {
    x.shape = reshape_shape(dims, &x.shape)?;
    Ok(x)
}

/// `x.permute(*dims)`.
pub fn permute_cpu(dims: &[usize], x: &HostTensor) -> Result<HostTensor, OpError> {
    let shape = permute_shape(dims, &x.shape)?;
    let xs = contiguous_strides(&x.shape);
    let strides: Vec<usize> = dims.iter().map(|&d| xs[d]).collect();
    Ok(gather(&x.data, shape, &strides, 0))
}

/// `x.narrow(dim, start, len)`.
pub fn slice_cpu(dim: usize, start: usize, len: usize, x: &HostTensor) -> Result<HostTensor, OpError> {
    let shape = slice_shape(dim, start, len, &x.shape)?;
    let xs = contiguous_strides(&x.shape);
    Ok(gather(&x.data, shape, &xs, start * xs[dim]))
}

/// `F.pad(x, pads, value=value)`: `value` everywhere, `x` copied inside.
pub fn pad_cpu(pads: &[usize], value: f32, x: &HostTensor) -> Result<HostTensor, OpError> {
    let shape = pad_shape(pads, &x.shape)?;
    let ys = contiguous_strides(&shape);
    let base = pads_per_dim(pads, x.shape.len()).iter().zip(&ys).map(|((before, _), s)| before * s).sum();
    let mut out = vec![value; shape.iter().product()];
    for_each_offset(&x.shape, &ys, base, |i, off| out[off] = x.data[i]);
    Ok(HostTensor::new(shape, out))
}

/// `torch.roll(x, shifts, dims)`: output index `i` along each dim reads input index `i - shift`
/// modulo the dim's size.
pub fn roll_cpu(shifts: &[i64], dims: &[usize], x: &HostTensor) -> Result<HostTensor, OpError> {
    let shape = roll_shape(shifts, dims, &x.shape)?;
    let per = roll_per_dim(shifts, dims, &shape);
    let xs = contiguous_strides(&shape);
    let n = numel(&shape)?;
    let mut out = vec![0.0; n];
    let mut idx = vec![0usize; shape.len()];
    for (i, o) in out.iter_mut().enumerate() {
        let mut rem = i;
        for k in (0..shape.len()).rev() {
            idx[k] = rem % shape[k];
            rem /= shape[k];
        }
        let off: usize = idx.iter().zip(&shape).zip(&per).zip(&xs).map(|(((&j, &n), &s), &st)| ((j + n - s) % n) * st).sum();
        *o = x.data[off];
    }
    Ok(HostTensor::new(shape, out))
}

/// `torch.cat(inputs, dim)`: for each index of the dims before `dim`, the inputs' contiguous blocks
/// follow one another.
pub fn cat_cpu(dim: usize, inputs: &[&HostTensor]) -> Result<HostTensor, OpError> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let out_shape = cat_shape(dim, &shapes)?;
    let outer: usize = out_shape[..dim].iter().product();
    let blocks: Vec<usize> = inputs.iter().map(|t| t.shape[dim..].iter().product()).collect();
    let mut out = Vec::with_capacity(numel(&out_shape)?);
    for o in 0..outer {
        for (t, &len) in inputs.iter().zip(&blocks) {
            out.extend_from_slice(&t.data[o * len..(o + 1) * len]);
        }
    }
    Ok(HostTensor::new(out_shape, out))
}

/// The input index an output index `i` of a dim padded by `before` reads, for an input of `n`
/// (`n > 0`; reflect: the pads are below `n`).
fn edge_source(i: usize, before: usize, n: usize, reflect: bool) -> usize {
    let j = i as isize - before as isize;
    let last = n as isize - 1;
    let k = match (j < 0, j > last, reflect) {
        (true, _, true) => -j,
        (true, _, false) => 0,
        (_, true, true) => 2 * last - j,
        (_, true, false) => last,
        _ => j,
    };
    k as usize
}

/// `F.pad(x, pads, mode="reflect" | "replicate")`.
pub fn edge_pad_cpu(pads: &[usize], reflect: bool, x: &HostTensor) -> Result<HostTensor, OpError> {
    let shape = edge_pad_shape(pads, reflect, &x.shape)?;
    let per = pads_per_dim(pads, x.shape.len());
    let xs = contiguous_strides(&x.shape);
    let n = numel(&shape)?;
    let mut out = Vec::with_capacity(n);
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..n {
        let off: usize = (0..shape.len()).map(|k| edge_source(idx[k], per[k].0, x.shape[k], reflect) * xs[k]).sum();
        out.push(x.data[off]);
        for k in (0..shape.len()).rev() {
            idx[k] += 1;
            if idx[k] < shape[k] {
                break;
            }
            idx[k] = 0;
        }
    }
    Ok(HostTensor::new(shape, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[usize]) -> HostTensor {
        let n = shape.iter().product::<usize>();
        HostTensor::new(shape.to_vec(), (0..n).map(|v| v as f32).collect())
    }

    #[test]
    fn cpu_references() {
        let x = t(&[1, 2, 3]);
        let p = permute_cpu(&[0, 2, 1], &x).unwrap();
        assert_eq!((p.shape, p.data), (vec![1, 3, 2], vec![0., 3., 1., 4., 2., 5.]));
        let s = slice_cpu(2, 1, 2, &x).unwrap();
        assert_eq!((s.shape, s.data), (vec![1, 2, 2], vec![1., 2., 4., 5.]));
        let q = pad_cpu(&[1, 0, 0, 1], -1.0, &x).unwrap();
        assert_eq!((q.shape, q.data), (vec![1, 3, 4], vec![-1., 0., 1., 2., -1., 3., 4., 5., -1., -1., -1., -1.]));
        let r = reshape_cpu(&[3, 2], x.clone()).unwrap();
        assert_eq!((r.shape, r.data), (vec![1, 3, 2], x.data.clone()));
        assert!(reshape_cpu(&[4], x).is_err());
    }
}
