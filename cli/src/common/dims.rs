//! The dims a command asks for (`--batch`, `--size`, `--shapes`), checked before anything is
//! traced or allocated: against the input size limit and against the model's own inputs.

use super::inputs::{graph_inputs, InputSpec};
use crate::ModelArgs;
use kiln::{Error, Graph, Result};

/// The most elements an input may have: 2^31 (8 GiB as f32).
pub const MAX_INPUT_ELEMENTS: usize = 1 << 31;

/// Checks `--batch` and `--size` before anything is traced or allocated: both at least 1, and an
/// input of batch × 3 × H × W that neither overflows nor exceeds `MAX_INPUT_ELEMENTS`.
pub fn check_input_dims(batch: usize, hw: [usize; 2]) -> Result<()> {
    let flag = |flag: &str, reason: String| Error::Flag { flag: flag.into(), reason };
    if batch == 0 {
        return Err(flag("--batch", "must be at least 1".into()));
    }
    if hw[0] == 0 || hw[1] == 0 {
        return Err(flag("--size", "must be at least 1".into()));
    }
    let [h, w] = hw;
    let what = if h == w {
        format!("an input of --batch {batch} at --size {h} ({batch} x 3 x {h} x {w})")
    } else {
        format!("an input of --batch {batch} at {h}x{w} ({batch} x 3 x {h} x {w})")
    };
    match kiln::dev::numel(&[batch, 3, h, w]) {
        None => Err(Error::TooLarge { what, reason: "its element count overflows".into() }),
        Some(n) if n > MAX_INPUT_ELEMENTS => Err(Error::TooLarge {
            what,
            reason: format!("{n} elements, more than the limit of {MAX_INPUT_ELEMENTS} (8 GiB as f32); lower --batch or --size"),
        }),
        Some(_) => Ok(()),
    }
}

/// The batch and H × W a command asked for, from `--batch`, `--size` and `--shapes input:NxCxHxW`
/// together; flags that disagree are an error naming both.
pub fn requested(m: &ModelArgs, batch: Option<usize>) -> Result<(Option<usize>, Option<[usize; 2]>)> {
    let size = m.size.map(|s| [s, s]);
    let Some(shapes) = &m.shapes else { return Ok((batch, size)) };
    let spec = match shapes.0.as_slice() {
        [one] => one,
        more => {
            return Err(Error::Flag { flag: "--shapes".into(), reason: format!("names {} inputs; the model has one, `input`", more.len()) })
        }
    };
    let [n, _, h, w] = spec.dims[..] else {
        return Err(Error::Flag {
            flag: "--shapes".into(),
            reason: format!("gives {} dims for `{}`; the input is NxCxHxW", spec.dims.len(), spec.name),
        });
    };
    let disagree = |flag: &str, given: String| Error::Flag {
        flag: flag.into(),
        reason: format!("{given} disagrees with --shapes {}:{}", spec.name, crate::shapes::dims_text(&spec.dims)),
    };
    if let Some(b) = batch.filter(|&b| b != n) {
        return Err(disagree("--batch", b.to_string()));
    }
    if let Some(s) = m.size.filter(|&s| [s, s] != [h, w]) {
        return Err(disagree("--size", s.to_string()));
    }
    Ok((Some(n), Some([h, w])))
}

/// The input H × W of a graph whose first input is an NCHW image, for graph files and user
/// models; `None` for other inputs (they run at their traced per-image dims).
pub(super) fn graph_hw(graph: &Graph) -> Option<[usize; 2]> {
    match graph.inputs.first().map(|&i| graph.nodes[i].shape.as_slice()) {
        Some(&[_, _, h, w]) => Some([h, w]),
        _ => None,
    }
}

/// `check_input_dims` for a graph of any inputs: a batch of at least 1, and every input at
/// `batch` within `MAX_INPUT_ELEMENTS`.
pub(super) fn check_graph_inputs(batch: usize, graph: &Graph, name: &str) -> Result<()> {
    if let Some(hw) = graph_hw(graph) {
        return check_input_dims(batch, hw);
    }
    if batch == 0 {
        return Err(Error::Flag { flag: "--batch".into(), reason: "must be at least 1".into() });
    }
    for spec in graph_inputs(graph) {
        let what = format!("input `{}` of {name} at --batch {batch} ({batch} x {})", spec.name, crate::shapes::dims_text(&spec.dims));
        match spec.dims.iter().try_fold(batch, |n, &d| n.checked_mul(d)) {
            None => return Err(Error::TooLarge { what, reason: "its element count overflows".into() }),
            Some(n) if n > MAX_INPUT_ELEMENTS => {
                return Err(Error::TooLarge {
                    what,
                    reason: format!("{n} elements, more than the limit of {MAX_INPUT_ELEMENTS}; lower --batch"),
                })
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// `--shapes NAME:DIMS` against the model's inputs (per-image dims, as `graph_inputs` and
/// `engine_inputs` give them): each name must be an input's, and its dims the input's, except the
/// batch and an image's H x W, which the flag sets. An error names the flag, the input and both
/// shapes.
pub fn check_shapes(shapes: Option<&crate::Shapes>, inputs: &[InputSpec], model: &str) -> Result<()> {
    let Some(shapes) = shapes else { return Ok(()) };
    let text = |dims: &[usize]| crate::shapes::dims_text(dims);
    for spec in &shapes.0 {
        let given = format!("{}:{}", spec.name, text(&spec.dims));
        let Some(input) = inputs.iter().find(|i| i.name == spec.name) else {
            let have: Vec<String> = inputs.iter().map(|i| format!("`{}` Nx{}", i.name, text(&i.dims))).collect();
            return Err(Error::Flag {
                flag: "--shapes".into(),
                reason: format!("{given}: {model} has no input `{}`; its inputs: {}", spec.name, have.join(", ")),
            });
        };
        // An image's H and W are the flag's to set; every other dim is the model's.
        let fixed = |dims: &[usize]| if dims.len() == 3 { dims[..1].to_vec() } else { dims.to_vec() };
        if spec.dims.len() != input.dims.len() + 1 || fixed(&spec.dims[1..]) != fixed(&input.dims) {
            return Err(Error::Flag { flag: "--shapes".into(), reason: format!("{given}: {}", expected_shape(&spec.dims, input, model)) });
        }
    }
    Ok(())
}

/// What `--shapes` should have given for `input`: its per-image dims (traced at the flag's H x W),
/// and for a channels-last NxHxWxC image, whose H x W were read from the wrong dims, the NCHW
/// shape meant instead.
fn expected_shape(given: &[usize], input: &InputSpec, model: &str) -> String {
    let text = |dims: &[usize]| crate::shapes::dims_text(dims);
    match (input.dims.as_slice(), given) {
        (&[c, _, _], &[n, h, w, last]) if last == c => format!(
            "{model}'s input `{}` is NxCxHxW with C = {c} (channels first); for a {h}x{w} image write {}:{}",
            input.name,
            input.name,
            text(&[n, c, h, w])
        ),
        (dims, _) => format!("{model}'s input `{}` is Nx{}", input.name, text(dims)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image_input() -> InputSpec {
        InputSpec { name: "input".into(), dims: vec![3, 224, 3], dtype: kiln::DType::F32 }
    }

    #[test]
    fn a_channels_last_shape_is_answered_with_the_nchw_one() {
        // Traced at the flag's 224x3 (its H x W read from NxCxHxW), the model's input is [3, 224, 3].
        let text = expected_shape(&[1, 224, 224, 3], &image_input(), "resnet50");
        assert!(text.contains("for a 224x224 image write input:1x3x224x224"), "{text}");
        assert!(!text.contains("224x3"), "the traced size is not the expected shape: {text}");
        let traced = InputSpec { dims: vec![3, 224, 224], ..image_input() };
        let text = expected_shape(&[1, 4, 224, 224], &traced, "resnet50");
        assert_eq!(text, "resnet50's input `input` is Nx3x224x224");
        let tokens = InputSpec { name: "ids".into(), dims: vec![16], dtype: kiln::DType::F32 };
        assert_eq!(expected_shape(&[1, 8], &tokens, "m"), "m's input `ids` is Nx16");
    }
}
