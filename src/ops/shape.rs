//! Shape ops: flatten and cat.

pub fn flatten_shape(start: usize, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
    let [x] = inputs else { return Err(format!("expected 1 input, got {}", inputs.len())) };
    if start >= x.len() {
        return Err(format!("start dim {start} is out of range for shape {x:?}"));
    }
    let mut out = x[..start].to_vec();
    out.push(x[start..].iter().product());
    Ok(out)
}

pub fn cat_shape(dim: usize, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
    let first = inputs.first().ok_or("cat needs at least one input")?;
    if dim >= first.len() {
        return Err(format!("dim {dim} is out of range for shape {first:?}"));
    }
    let mut out = first.to_vec();
    for s in &inputs[1..] {
        let same_rest = s.len() == first.len() && s.iter().zip(first.iter()).enumerate().all(|(i, (a, b))| i == dim || a == b);
        if !same_rest {
            return Err(format!("shapes {first:?} and {s:?} differ outside dim {dim}"));
        }
        out[dim] += s[dim];
    }
    Ok(out)
}
