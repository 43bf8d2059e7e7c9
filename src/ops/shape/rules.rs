//! The shape rules: each op's output shape, or an error naming the op and the shapes (none moves,
//! merges or splits the batch).

use super::list;
use crate::error::OpError;
use crate::ops::one_input;

/// The product of `dims`, or an error naming them when it overflows.
pub(super) fn numel(dims: &[usize]) -> Result<usize, OpError> {
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| OpError::TooLarge(format!("the element count of {dims:?} overflows")))
}

pub fn flatten_shape(start: usize, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    let x = one_input(inputs)?;
    if start >= x.len() {
        return Err(format!("start dim {start} is out of range for shape {x:?}").into());
    }
    if start == 0 && x.len() > 1 {
        return Err(format!("flatten from dim 0 merges the batch of {x:?} into other dims: the engine keeps the batch as dim 0").into());
    }
    let mut out = x[..start].to_vec();
    out.push(numel(&x[start..])?);
    Ok(out)
}

pub fn cat_shape(dim: usize, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    let first = inputs.first().ok_or("cat needs at least one input")?;
    if dim >= first.len() {
        return Err(format!("dim {dim} is out of range for shape {first:?}").into());
    }
    let mut out = first.to_vec();
    for s in &inputs[1..] {
        let same_rest = s.len() == first.len() && s.iter().zip(first.iter()).enumerate().all(|(i, (a, b))| i == dim || a == b);
        if !same_rest {
            return Err(format!("shapes {first:?} and {s:?} differ outside dim {dim}").into());
        }
        out[dim] = out[dim].checked_add(s[dim]).ok_or_else(|| format!("the size of dim {dim} overflows"))?;
    }
    Ok(out)
}

/// `[N, *dims]` when `dims` holds as many elements as one image of `x`.
pub fn reshape_shape(dims: &[usize], x: &[usize]) -> Result<Vec<usize>, OpError> {
    let (&n, per_image) = x.split_first().ok_or("reshape needs an input with a batch dim")?;
    let (have, want) = (numel(per_image)?, numel(dims)?);
    if have != want {
        return Err(format!(
            "cannot reshape {x:?} to [N, {}]: {have} elements per image against {want} (the engine keeps the batch as dim 0)",
            list(dims)
        )
        .into());
    }
    Ok([&[n][..], dims].concat())
}

/// Checks that `dims` permutes `0..x.len()` and keeps the batch first.
pub fn permute_shape(dims: &[usize], x: &[usize]) -> Result<Vec<usize>, OpError> {
    if dims.len() != x.len() {
        return Err(format!("permutation {dims:?} has {} dims, the input {x:?} has {}", dims.len(), x.len()).into());
    }
    let mut seen = vec![false; x.len()];
    for &d in dims {
        if d >= x.len() || std::mem::replace(&mut seen[d], true) {
            return Err(format!("{dims:?} is not a permutation of the dims of {x:?}").into());
        }
    }
    if dims.first() != Some(&0) {
        return Err(format!("permutation {dims:?} of {x:?} moves the batch: the engine keeps the batch as dim 0").into());
    }
    Ok(dims.iter().map(|&d| x[d]).collect())
}

pub fn slice_shape(dim: usize, start: usize, len: usize, x: &[usize]) -> Result<Vec<usize>, OpError> {
    if dim == 0 {
        return Err(format!("slicing dim 0 of {x:?} changes the batch: the engine keeps the batch as dim 0").into());
    }
    let size = *x.get(dim).ok_or_else(|| format!("dim {dim} is out of range for shape {x:?}"))?;
    if len == 0 {
        return Err(format!("an empty slice of dim {dim} of {x:?} (start {start}, length 0)").into());
    }
    if start.checked_add(len).is_none_or(|end| end > size) {
        return Err(format!("slice [{start}, {start} + {len}) of dim {dim} is out of range for shape {x:?}").into());
    }
    let mut out = x.to_vec();
    out[dim] = len;
    Ok(out)
}

/// `x` grown by `pads` (last dim first, `(before, after)` pairs).
pub fn pad_shape(pads: &[usize], x: &[usize]) -> Result<Vec<usize>, OpError> {
    if !pads.len().is_multiple_of(2) {
        return Err(format!("pads {pads:?} must come in (before, after) pairs").into());
    }
    if pads.len() / 2 >= x.len() {
        return Err(format!(
            "pads {pads:?} pad {} dims of {x:?}, which would pad the batch: the engine keeps the batch as dim 0",
            pads.len() / 2
        )
        .into());
    }
    let mut out = x.to_vec();
    for (i, pair) in pads.chunks(2).enumerate() {
        let d = x.len() - 1 - i;
        out[d] =
            x[d].checked_add(pair[0]).and_then(|v| v.checked_add(pair[1])).ok_or_else(|| format!("padding dim {d} of {x:?} overflows"))?;
    }
    Ok(out)
}

/// Checks that `shifts` and `dims` pair up and that no dim is the batch or out of range.
pub fn roll_shape(shifts: &[i64], dims: &[usize], x: &[usize]) -> Result<Vec<usize>, OpError> {
    if shifts.len() != dims.len() || dims.is_empty() {
        return Err(format!("roll needs one shift per dim, got shifts {shifts:?} and dims {dims:?}").into());
    }
    if let Some(d) = dims.iter().find(|&&d| d == 0 || d >= x.len()) {
        return Err(format!("roll dim {d} of {x:?} is the batch or out of range (the engine keeps the batch as dim 0)").into());
    }
    Ok(x.to_vec())
}

/// The net shift of each dim of `shape`, in `[0, size)` (repeated dims add up, as PyTorch's).
pub(super) fn roll_per_dim(shifts: &[i64], dims: &[usize], shape: &[usize]) -> Vec<usize> {
    let mut per = vec![0usize; shape.len()];
    for (&s, &d) in shifts.iter().zip(dims) {
        if let Some(&size) = shape.get(d).filter(|&&n| n > 0) {
            let size = size as i128;
            per[d] = ((per[d] as i128 + s as i128).rem_euclid(size)) as usize;
        }
    }
    per
}

/// The shape of a reflect (`reflect`) or replicate pad: as a constant pad's, and each padded dim
/// must hold an element (replicate) or more than its pads (reflect), as PyTorch requires.
pub fn edge_pad_shape(pads: &[usize], reflect: bool, x: &[usize]) -> Result<Vec<usize>, OpError> {
    let out = pad_shape(pads, x)?;
    for (d, &(before, after)) in pads_per_dim(pads, x.len()).iter().enumerate() {
        if before == 0 && after == 0 {
            continue;
        }
        if x[d] == 0 || (reflect && (before >= x[d] || after >= x[d])) {
            let mode = if reflect { "reflect" } else { "replicate" };
            return Err(format!("{mode} padding ({before}, {after}) of dim {d} of {x:?}: each pad must be below the dim's size").into());
        }
    }
    Ok(out)
}

/// The `(before, after)` padding of each dim of a rank-`rank` tensor.
pub(super) fn pads_per_dim(pads: &[usize], rank: usize) -> Vec<(usize, usize)> {
    let mut per = vec![(0, 0); rank];
    for (i, pair) in pads.chunks(2).enumerate() {
        if let (Some(slot), [a, b]) = (rank.checked_sub(1 + i).and_then(|d| per.get_mut(d)), pair) {
            *slot = (*a, *b);
        }
    }
    per
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_rules_reject_moving_the_batch() {
        let x: &[usize] = &[2, 3, 4];
        assert!(permute_shape(&[1, 0, 2], x).unwrap_err().to_string().contains("batch"));
        assert!(permute_shape(&[0, 2], x).unwrap_err().to_string().contains("has 2 dims"));
        assert!(permute_shape(&[0, 2, 2], x).unwrap_err().to_string().contains("not a permutation"));
        assert!(permute_shape(&[0, 3, 1], x).unwrap_err().to_string().contains("not a permutation"));
        assert_eq!(permute_shape(&[0, 2, 1], x).unwrap(), vec![2, 4, 3]);
        assert!(slice_shape(0, 0, 1, x).unwrap_err().to_string().contains("batch"));
        assert!(slice_shape(3, 0, 1, x).unwrap_err().to_string().contains("out of range"));
        assert!(slice_shape(2, 3, 2, x).unwrap_err().to_string().contains("out of range"));
        assert!(slice_shape(2, usize::MAX, 2, x).unwrap_err().to_string().contains("out of range"));
        assert!(slice_shape(2, 1, 0, x).unwrap_err().to_string().contains("empty"));
        assert!(flatten_shape(0, &[x]).unwrap_err().to_string().contains("batch"));
        assert!(flatten_shape(3, &[x]).unwrap_err().to_string().contains("out of range"));
        assert!(pad_shape(&[1, 1, 1, 1, 1, 1], x).unwrap_err().to_string().contains("batch"));
        assert!(pad_shape(&[1], x).unwrap_err().to_string().contains("pairs"));
        assert!(pad_shape(&[usize::MAX, 1], x).unwrap_err().to_string().contains("overflows"));
        assert_eq!(pad_shape(&[1, 2, 0, 3], x).unwrap(), vec![2, 6, 7]);
        assert!(reshape_shape(&[5, 2], x).unwrap_err().to_string().contains("12 elements per image against 10"));
        assert!(reshape_shape(&[usize::MAX, 2], x).unwrap_err().to_string().contains("overflows"));
        assert_eq!(reshape_shape(&[2, 2, 3], x).unwrap(), vec![2, 2, 2, 3]);
        assert!(cat_shape(1, &[&[2, 3], &[2, usize::MAX]]).unwrap_err().to_string().contains("overflows"));
    }
}
