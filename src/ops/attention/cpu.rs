//! The CPU references of `attention` and `qkv_attention` (PyTorch's arithmetic: f32, the row
//! maximum subtracted before the softmax).

use super::{attention_shape, bias_strides, qkv_attention_shape, QkvAttention};
use crate::error::OpError;
use crate::graph::HostTensor;

/// Per (image, head) problem: `scale · Q·Kᵀ` by one GEMM, the bias added, softmax in f32 with the
/// row maximum subtracted (PyTorch's), then `P·V` by a second GEMM.
pub fn attention_cpu(scale: f32, bias: bool, inputs: &[&HostTensor]) -> Result<HostTensor, OpError> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let out_shape = attention_shape(bias, &shapes)?;
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    let r = q.shape.len();
    let (l, d, s, dv) = (q.shape[r - 2], q.shape[r - 1], k.shape[r - 2], v.shape[r - 1]);
    let lead = &q.shape[..r - 2];
    let count: usize = lead.iter().product();
    let scores_shape: Vec<usize> = [lead, &[l, s][..]].concat();
    let bias = if bias { Some((inputs[3], bias_strides(&inputs[3].shape, &scores_shape)?)) } else { None };
    let mut out = vec![0.0f32; count * l * dv];
    let mut p = vec![0.0f32; l * s];
    for z in 0..count {
        if l * s == 0 {
            break;
        }
        if d > 0 {
            // SAFETY: q's block at z is l×d row-major, k's is s×d read transposed (strides 1, d),
            // p is l×s; the shape rule checked the extents.
            unsafe {
                matrixmultiply::sgemm(
                    l,
                    d,
                    s,
                    scale,
                    q.data[z * l * d..].as_ptr(),
                    d as isize,
                    1,
                    k.data[z * s * d..].as_ptr(),
                    1,
                    d as isize,
                    0.0,
                    p.as_mut_ptr(),
                    s as isize,
                    1,
                )
            }
        } else {
            p.fill(0.0);
        }
        if let Some((b, st)) = &bias {
            // The bias offset of problem z from its leading indices.
            let (mut rem, mut base) = (z, 0);
            for i in (0..lead.len()).rev() {
                base += (rem % lead[i]) * st[i];
                rem /= lead[i];
            }
            let (sl, ss) = (st[r - 2], st[r - 1]);
            for (i, row) in p.chunks_exact_mut(s).enumerate() {
                row.iter_mut().enumerate().for_each(|(j, x)| *x += b.data[base + i * sl + j * ss]);
            }
        }
        for row in p.chunks_exact_mut(s) {
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            row.iter_mut().for_each(|x| {
                *x = (*x - m).exp();
                sum += *x;
            });
            row.iter_mut().for_each(|x| *x /= sum);
        }
        if dv > 0 {
            // SAFETY: p is l×s, v's block at z is s×dv row-major, out's block is l×dv.
            unsafe {
                matrixmultiply::sgemm(
                    l,
                    s,
                    dv,
                    1.0,
                    p.as_ptr(),
                    s as isize,
                    1,
                    v.data[z * s * dv..].as_ptr(),
                    dv as isize,
                    1,
                    0.0,
                    out[z * l * dv..].as_mut_ptr(),
                    dv as isize,
                    1,
                )
            }
        }
    }
    Ok(HostTensor::new(out_shape, out))
}

/// The packed op on the CPU: q, k and v copied out of the packed rows into `[N, G..., H, L, D]`,
/// `attention_cpu` (so the arithmetic is exactly `attention`'s), the result's heads moved back
/// into each row. The two copies cost nothing next to the GEMMs.
pub fn qkv_attention_cpu(attrs: QkvAttention, inputs: &[&HostTensor]) -> Result<HostTensor, OpError> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let out_shape = qkv_attention_shape(attrs.heads, attrs.bias, &shapes)?;
    let x = inputs[0];
    let r = x.shape.len();
    let (rows, l, h) = (x.shape[..r - 2].iter().product::<usize>(), x.shape[r - 2], attrs.heads);
    let d = x.shape[r - 1] / (3 * h);
    let split: Vec<usize> = [&x.shape[..r - 2], &[h, l, d][..]].concat();
    let mut parts = [vec![0.0f32; rows * h * l * d], vec![0.0f32; rows * h * l * d], vec![0.0f32; rows * h * l * d]];
    if d > 0 {
        // Row `i` of block `o` holds q's heads, then k's, then v's, D values each.
        for (oi, row) in x.data.chunks_exact(3 * h * d).enumerate() {
            let (o, i) = (oi / l, oi % l);
            for (p, part) in parts.iter_mut().enumerate() {
                for hh in 0..h {
                    let at = ((o * h + hh) * l + i) * d;
                    part[at..at + d].copy_from_slice(&row[(p * h + hh) * d..][..d]);
                }
            }
        }
    }
    let [q, k, v] = parts.map(|p| HostTensor::new(split.clone(), p));
    let mut args = vec![&q, &k, &v];
    args.extend(inputs.get(1).copied().filter(|_| attrs.bias));
    let y = attention_cpu(attrs.scale, attrs.bias, &args)?;
    let mut out = vec![0.0f32; rows * l * h * d];
    if l * d > 0 {
        for (ohi, head_rows) in y.data.chunks_exact(l * d).enumerate() {
            let (o, hh) = (ohi / h, ohi % h);
            for (i, src) in head_rows.chunks_exact(d).enumerate() {
                let at = ((o * l + i) * h + hh) * d;
                out[at..at + d].copy_from_slice(src);
            }
        }
    }
    Ok(HostTensor::new(out_shape, out))
}

#[cfg(test)]
mod tests {
    use crate::tensor::Param;
    use std::sync::Arc;

    /// What the models did before `qkv_attention`: the packed projection reshaped, permuted and
    /// narrowed into q, k and v `[N, G..., H, L, D]`, `attention`, then permuted and reshaped back.
    fn unpacked(x: &crate::Tensor, heads: usize, bias: Option<&Param>, scale: Option<f32>) -> crate::Result<crate::Tensor> {
        let s: Vec<isize> = x.shape().iter().map(|&v| v as isize).collect();
        let r = s.len();
        let (h, d) = (heads as isize, s[r - 1] / (3 * heads as isize));
        // [N, G.., L, 3, H, D] -> [N, 3, G.., H, L, D].
        let split: Vec<isize> = [&s[..r - 1], &[3, h, d][..]].concat();
        let g = r - 3; // group dims after N
        let order: Vec<isize> =
            [vec![0, r - 1], (1..=g).collect(), vec![r, r - 2, r + 1]].concat().into_iter().map(|v| v as isize).collect();
        let qkv = x.reshape(&split)?.permute(&order)?;
        let part_shape: Vec<isize> = [&s[..r - 2], &[h, s[r - 2], d][..]].concat();
        let part = |k: usize| qkv.narrow(1, k, 1)?.reshape(&part_shape);
        let (q, k, v) = (part(0)?, part(1)?, part(2)?);
        let y = match bias {
            Some(b) => q.attention_weight("attn", &k, &v, b, scale)?,
            None => q.attention(&k, &v, None, scale)?,
        };
        // [N, G.., H, L, D] -> [N, G.., L, H, D] -> [N, G.., L, H·D].
        let back: Vec<isize> = [(0..=g).collect(), vec![g + 2, g + 1, g + 3]].concat().into_iter().map(|v| v as isize).collect();
        y.permute(&back)?.reshape(&[&s[..r - 1], &[h * d][..]].concat())
    }

    #[test]
    fn qkv_attention_cpu_equals_the_unpacked_graph_bit_for_bit() {
        let rel = |heads: usize, l: usize| Param { name: "rel".into(), value: Arc::new(crate::seeded::weight("rel", &[heads, l, l])) };
        let windows = |g: usize, heads: usize, l: usize| Param {
            name: "win".into(),
            value: Arc::new(crate::seeded::weight("win", &[g, heads, l, l])),
        };
        // (name, qkv shape, heads, bias, scale)
        type Case = (&'static str, Vec<usize>, usize, Option<Param>, Option<f32>);
        let cases: Vec<Case> = vec![
            ("ViT-like, 2 heads of 4", vec![2, 7, 24], 2, None, None),
            ("one head of 5, scale 0.3", vec![3, 6, 15], 1, None, Some(0.3)),
            ("Swin-like windows, a bias per head", vec![2, 3, 9, 72], 3, Some(rel(3, 9)), None),
            ("Swin-like windows, a bias per window and head", vec![2, 3, 9, 72], 3, Some(windows(3, 3, 9)), Some(0.25)),
            ("two group dims", vec![1, 2, 2, 4, 36], 2, Some(rel(2, 4)), None),
        ];
        for (name, shape, heads, bias, scale) in cases {
            let run = |packed: bool| {
                let t = crate::Tracer::new();
                let x = t.input("x", &shape);
                let y = match (&bias, packed) {
                    (Some(b), true) => x.qkv_attention_weight("attn", heads, b, scale),
                    (None, true) => x.qkv_attention(heads, None, scale),
                    (b, false) => unpacked(&x, heads, b.as_ref(), scale),
                }
                .unwrap_or_else(|e| panic!("{name}: {e}"));
                t.output("y", &y);
                let g = t.graph();
                let ops = g.nodes.iter().filter(|n| n.op.name().contains("attention")).count();
                assert_eq!(ops, 1, "{name}");
                let input = crate::seeded::weight(&format!("{name}.x"), &shape);
                crate::cpu::run(&g, &[("x", &input)]).expect("cpu").remove("y").expect("y")
            };
            let (got, want) = (run(true), run(false));
            assert_eq!(got.shape, want.shape, "{name}");
            assert!(got.data == want.data, "{name}: qkv_attention differs from the unpacked graph");
        }
    }
}
