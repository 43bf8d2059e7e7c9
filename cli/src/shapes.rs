//! trtexec's shape flags: `--shapes input:1x3x480x640` (the shape to run), and
//! `--minShapes/--optShapes/--maxShapes` (the range an engine accepts), parsed into one
//! `[min, opt, max]` dims profile per input. Today an engine's range is over the batch only, so the
//! other dims must equal the graph's; the profile keeps every dim so that H/W ranges plug in.

use kiln::{Error, Result};
use std::collections::BTreeMap;

/// One `name:d0xd1x...` item of a shape flag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeSpec {
    pub name: String,
    pub dims: Vec<usize>,
}

/// The most dims a shape flag may give.
const MAX_DIMS: usize = 8;

/// Parses one flag value: `input:1x3x224x224`, or several separated by commas (trtexec's form).
/// A clap `value_parser`; the error says which item is wrong and what the form is.
pub fn parse_shapes(value: &str) -> std::result::Result<Vec<ShapeSpec>, String> {
    let form = "expected NAME:DIMS with DIMS like 1x3x224x224 (several separated by commas)";
    value
        .split(',')
        .map(|item| {
            let (name, dims) = item.rsplit_once(':').ok_or_else(|| format!("`{item}`: no `:`; {form}"))?;
            let name = name.trim().trim_matches('\'').trim_matches('"');
            if name.is_empty() {
                return Err(format!("`{item}`: the input name is empty; {form}"));
            }
            let dims = dims
                .split('x')
                .map(|d| d.trim().parse::<usize>().map_err(|e| format!("`{item}`: dim `{d}` is not a size ({e}); {form}")))
                .collect::<std::result::Result<Vec<usize>, String>>()?;
            if dims.is_empty() || dims.len() > MAX_DIMS {
                return Err(format!("`{item}`: {} dims; between 1 and {MAX_DIMS} are allowed", dims.len()));
            }
            if dims.contains(&0) {
                return Err(format!("`{item}`: every dim must be at least 1"));
            }
            if kiln::dev::numel(&dims).is_none() {
                return Err(format!("`{item}`: the element count overflows"));
            }
            Ok(ShapeSpec { name: name.to_string(), dims })
        })
        .collect()
}

/// The dims one input accepts: TensorRT's optimisation profile, `[min, opt, max]` per dim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Profile {
    pub min: Vec<usize>,
    pub opt: Vec<usize>,
    pub max: Vec<usize>,
}

impl Profile {
    /// One fixed shape (`--shapes` alone): min = opt = max.
    pub fn fixed(dims: &[usize]) -> Self {
        Self { min: dims.to_vec(), opt: dims.to_vec(), max: dims.to_vec() }
    }
    /// The batch range `(min, opt, max)` (dim 0).
    pub fn batch(&self) -> (usize, usize, usize) {
        (self.min[0], self.opt[0], self.max[0])
    }
}

/// Gathers the shape flags into one profile per input name. A name given in any of the three range
/// flags must be given in all three, with as many dims, and min <= opt <= max dim by dim;
/// `--shapes` alone fixes min = opt = max. The flag named in errors is the trtexec one.
pub fn profiles(shapes: &[ShapeSpec], min: &[ShapeSpec], opt: &[ShapeSpec], max: &[ShapeSpec]) -> Result<BTreeMap<String, Profile>> {
    let flag = |flag: &str, reason: String| Error::Flag { flag: flag.into(), reason };
    let index = |flag_name: &str, specs: &[ShapeSpec]| -> Result<BTreeMap<String, Vec<usize>>> {
        let mut m = BTreeMap::new();
        for s in specs {
            if m.insert(s.name.clone(), s.dims.clone()).is_some() {
                return Err(flag(flag_name, format!("names input `{}` twice", s.name)));
            }
        }
        Ok(m)
    };
    let (fixed, min, opt, max) =
        (index("--shapes", shapes)?, index("--minShapes", min)?, index("--optShapes", opt)?, index("--maxShapes", max)?);
    let mut out = BTreeMap::new();
    let names: std::collections::BTreeSet<&String> = min.keys().chain(opt.keys()).chain(max.keys()).collect();
    for name in names {
        let get = |m: &BTreeMap<String, Vec<usize>>, f: &str| {
            m.get(name).cloned().ok_or_else(|| {
                flag(f, format!("does not name input `{name}`, which another of --minShapes/--optShapes/--maxShapes names; give all three"))
            })
        };
        let p = Profile { min: get(&min, "--minShapes")?, opt: get(&opt, "--optShapes")?, max: get(&max, "--maxShapes")? };
        if p.min.len() != p.opt.len() || p.opt.len() != p.max.len() {
            return Err(flag(
                "--minShapes",
                format!("input `{name}`: min {:?}, opt {:?} and max {:?} have different numbers of dims", p.min, p.opt, p.max),
            ));
        }
        if let Some(d) = (0..p.min.len()).find(|&d| !(p.min[d] <= p.opt[d] && p.opt[d] <= p.max[d])) {
            return Err(flag(
                "--minShapes",
                format!("input `{name}`: dim {d} must satisfy min <= opt <= max, got min {:?}, opt {:?}, max {:?}", p.min, p.opt, p.max),
            ));
        }
        out.insert(name.clone(), p);
    }
    for (name, dims) in fixed {
        match out.get(&name) {
            Some(p) if (0..dims.len()).any(|d| dims.len() != p.min.len() || dims[d] < p.min[d] || dims[d] > p.max[d]) => {
                return Err(flag("--shapes", format!("input `{name}`: {dims:?} is outside the range {:?}..={:?}", p.min, p.max)));
            }
            Some(_) => {}
            None => {
                out.insert(name, Profile::fixed(&dims));
            }
        }
    }
    Ok(out)
}

/// Formats dims as trtexec does: `1x3x224x224`.
pub use kiln::engine::dims_text;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trtexec_shape_values_parse() {
        let s = parse_shapes("input:1x3x480x640").expect("parses");
        assert_eq!(s, [ShapeSpec { name: "input".into(), dims: vec![1, 3, 480, 640] }]);
        let two = parse_shapes("a:2x3,'b':4").expect("parses");
        assert_eq!((two[0].dims.clone(), two[1].name.as_str()), (vec![2, 3], "b"));
        for bad in ["input", "input:", "input:1x0x2", "input:1xfoo", ":1x2", "x:18446744073709551615x2x2"] {
            assert!(parse_shapes(bad).is_err(), "{bad} is rejected");
        }
    }

    #[test]
    fn range_flags_become_one_profile_per_input() {
        let p = |s: &str| parse_shapes(s).expect("parses");
        let got = profiles(&[], &p("input:1x3x224x224"), &p("input:8x3x224x224"), &p("input:64x3x224x224")).expect("valid");
        assert_eq!(got["input"].batch(), (1, 8, 64));
        assert_eq!(got["input"].max, [64, 3, 224, 224]);
        let fixed = profiles(&p("input:2x3x32x48"), &[], &[], &[]).expect("valid");
        assert_eq!(fixed["input"], Profile::fixed(&[2, 3, 32, 48]));
        let e = profiles(&[], &p("input:8x3x2x2"), &p("input:4x3x2x2"), &p("input:2x3x2x2")).unwrap_err().to_string();
        assert!(e.contains("dim 0 must satisfy min <= opt <= max"), "{e}");
        let e = profiles(&[], &p("input:1x3x2x2"), &[], &p("input:2x3x2x2")).unwrap_err().to_string();
        assert!(e.starts_with("--optShapes"), "{e}");
        let e = profiles(&p("input:9x3x2x2"), &p("input:1x3x2x2"), &p("input:2x3x2x2"), &p("input:4x3x2x2")).unwrap_err().to_string();
        assert!(e.contains("outside the range"), "{e}");
    }
}
