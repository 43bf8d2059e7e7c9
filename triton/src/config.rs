//! The model's `config.pbtxt` as Triton hands it to the backend (JSON), the Kiln parameters it
//! may carry, and the check that it agrees with the model file.
//!
//! Kiln's parameters (all optional, `parameters { key: "precision" value { string_value: "fp16" } }`):
//! - `precision`: `fp32`, `tf32`, `fp16` (default), `int8`, `fp8` or `best`, for a graph file
//!   built on a GPU instance (`int8`/`fp8`/`best` need `calibration_cache`);
//! - `calibration_cache`: a `kiln calibrate` cache, relative to the model version folder;
//! - `opt_batch`: the batch algorithms are timed at (default: `max_batch_size`);
//! - `min_shapes`, `opt_shapes`, `max_shapes`: an optimization profile over the per-image dims
//!   of a graph file's inputs, trtexec-style without the batch (`input:3x128x128`, several
//!   separated by commas); `opt_shapes` defaults to the traced dims. An engine file brings its own;
//! - `cuda_graphs`: `true` (default) or `false`;
//! - `refuse_non_finite`: `true` refuses a request whose FP32 input holds NaN or infinity, as an
//!   invalid argument (HTTP 400), naming the input, image and element; `false` (default) runs it,
//!   and NaN in gives NaN out (docs/SERVING.md). An engine file takes it too: it changes no build.

use crate::error::{BackendError, Result};
use crate::kiln_api::{BuildConfig, DimsRange, Precision, ShapeProfile};
use serde::Deserialize;
use std::collections::BTreeMap;

/// The parts of Triton's `ModelConfig` this backend reads (Triton's JSON form, field names as in
/// model_config.proto). Unknown fields are ignored: Triton validates its own.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ModelConfig {
    pub name: String,
    pub max_batch_size: i64,
    pub input: Vec<TensorConfig>,
    pub output: Vec<TensorConfig>,
    pub default_model_filename: String,
    pub parameters: BTreeMap<String, Parameter>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct TensorConfig {
    pub name: String,
    pub data_type: String,
    /// Triton writes int64 dims as JSON strings (the protobuf mapping) or numbers; both are read.
    #[serde(deserialize_with = "int_list")]
    pub dims: Vec<i64>,
    pub reshape: Option<serde_json::Value>,
    pub allow_ragged_batch: bool,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct Parameter {
    pub string_value: String,
}

fn int_list<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Vec<i64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Int {
        Number(i64),
        Text(String),
    }
    let items = Vec::<Int>::deserialize(d)?;
    items
        .into_iter()
        .map(|i| match i {
            Int::Number(n) => Ok(n),
            Int::Text(s) => s.trim().parse().map_err(|_| serde::de::Error::custom(format!("dim `{s}` is not an integer"))),
        })
        .collect()
}

impl ModelConfig {
    pub fn from_json(json: &str) -> Result<Self> {
        serde_json::from_str(json).map_err(|e| BackendError::Config {
            model: "?".into(),
            field: "(as JSON from Triton)".into(),
            reason: format!("cannot be read: {e}"),
        })
    }

    fn err(&self, field: impl Into<String>, reason: impl Into<String>) -> BackendError {
        BackendError::Config { model: self.name.clone(), field: field.into(), reason: reason.into() }
    }

    /// `parameters[key]`'s string value, if set.
    pub fn parameter(&self, key: &str) -> Option<&str> {
        self.parameters.get(key).map(|p| p.string_value.trim())
    }

    /// The Kiln parameters (see the module doc); unknown keys are an error, so that a typo is not
    /// silently ignored.
    pub fn kiln_parameters(&self) -> Result<KilnParameters> {
        const KNOWN: [&str; 8] =
            ["precision", "calibration_cache", "opt_batch", "min_shapes", "opt_shapes", "max_shapes", "cuda_graphs", "refuse_non_finite"];
        if let Some(unknown) = self.parameters.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(
                self.err(format!("parameters[\"{unknown}\"]"), format!("is not a Kiln parameter; the backend reads {}", KNOWN.join(", ")))
            );
        }
        let precision = match self.parameter("precision") {
            None | Some("") => Precision::Fp16,
            Some(p) => Precision::parse(p)
                .ok_or_else(|| self.err("parameters[\"precision\"]", format!("`{p}` is not one of fp32, tf32, fp16, int8, fp8, best")))?,
        };
        let opt_batch = match self.parameter("opt_batch") {
            None | Some("") => None,
            Some(b) => Some(b.parse::<usize>().ok().filter(|&b| b >= 1).ok_or_else(|| {
                self.err("parameters[\"opt_batch\"]", format!("`{b}` is not a batch size (a whole number from 1 to max_batch_size)"))
            })?),
        };
        let cuda_graphs = match self.parameter("cuda_graphs") {
            None | Some("") | Some("true") => true,
            Some("false") => false,
            Some(v) => return Err(self.err("parameters[\"cuda_graphs\"]", format!("`{v}` is not true or false"))),
        };
        let refuse_non_finite = match self.parameter("refuse_non_finite") {
            None | Some("") | Some("false") => false,
            Some("true") => true,
            Some(v) => return Err(self.err("parameters[\"refuse_non_finite\"]", format!("`{v}` is not true or false"))),
        };
        let shapes = |key: &str| -> Result<Option<BTreeMap<String, Vec<usize>>>> {
            match self.parameter(key) {
                None | Some("") => Ok(None),
                Some(text) => parse_shapes(text).map(Some).map_err(|reason| self.err(format!("parameters[\"{key}\"]"), reason)),
            }
        };
        let (min, opt, max) = (shapes("min_shapes")?, shapes("opt_shapes")?, shapes("max_shapes")?);
        let profile = match (min, max) {
            (None, None) if opt.is_none() => None,
            (Some(min), Some(max)) => Some(ProfileShapes { min, opt, max }),
            _ => {
                return Err(self.err("parameters", "an optimization profile needs both min_shapes and max_shapes (opt_shapes is optional)"))
            }
        };
        let calibration_cache = self.parameter("calibration_cache").filter(|s| !s.is_empty()).map(str::to_string);
        if let Some(cache) = &calibration_cache {
            let inside = std::path::Path::new(cache).components().all(|c| matches!(c, std::path::Component::Normal(_)));
            if !inside {
                return Err(self.err(
                    "parameters[\"calibration_cache\"]",
                    format!("`{cache}` must be a path inside the model's version folder (no `..`, not absolute)"),
                ));
            }
        }
        Ok(KilnParameters { precision, opt_batch, cuda_graphs, calibration_cache, profile, refuse_non_finite })
    }
}

/// Per-image dims by input name, from `min_shapes`/`opt_shapes`/`max_shapes`.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileShapes {
    pub min: BTreeMap<String, Vec<usize>>,
    pub opt: Option<BTreeMap<String, Vec<usize>>>,
    pub max: BTreeMap<String, Vec<usize>>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct KilnParameters {
    pub precision: Precision,
    pub opt_batch: Option<usize>,
    pub cuda_graphs: bool,
    pub calibration_cache: Option<String>,
    pub profile: Option<ProfileShapes>,
    /// Refuse requests whose FP32 inputs hold NaN or infinity (a serving option: no build reads it).
    pub refuse_non_finite: bool,
}

/// Reads `input:3x128x128[,name:dims...]` (per-image dims, no batch).
pub fn parse_shapes(text: &str) -> std::result::Result<BTreeMap<String, Vec<usize>>, String> {
    let mut out = BTreeMap::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, dims) = item.rsplit_once(':').ok_or_else(|| format!("`{item}` is not `name:dims` (e.g. `input:3x224x224`)"))?;
        let dims: Vec<usize> = dims
            .split('x')
            .map(|d| d.trim().parse::<usize>().ok().filter(|&d| d >= 1))
            .collect::<Option<_>>()
            .ok_or_else(|| format!("`{item}`: the dims must be whole numbers of at least 1 joined by `x` (per image, no batch)"))?;
        if out.insert(name.trim().to_string(), dims).is_some() {
            return Err(format!("input `{}` is given twice", name.trim()));
        }
    }
    if out.is_empty() {
        return Err("is empty".into());
    }
    Ok(out)
}

/// `3x224x224`.
pub fn dims_text(dims: &[usize]) -> String {
    dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")
}

/// A binding's element type as Triton names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemType {
    F32,
    U8,
}

impl ElemType {
    /// `TYPE_FP32`, as config.pbtxt writes it.
    pub fn config_name(self) -> &'static str {
        match self {
            ElemType::F32 => "TYPE_FP32",
            ElemType::U8 => "TYPE_UINT8",
        }
    }
    /// `FP32`, as requests name it.
    pub fn wire_name(self) -> &'static str {
        match self {
            ElemType::F32 => "FP32",
            ElemType::U8 => "UINT8",
        }
    }
    pub fn datatype(self) -> u32 {
        match self {
            ElemType::F32 => crate::ffi::datatype::FP32,
            ElemType::U8 => crate::ffi::datatype::UINT8,
        }
    }
    pub fn size(self) -> usize {
        match self {
            ElemType::F32 => 4,
            ElemType::U8 => 1,
        }
    }
}

/// One input or output of the model: its traced per-image dims and, per dim, the range the
/// model's optimization profiles allow (the traced dim where there are none).
#[derive(Clone, Debug, PartialEq)]
pub struct Binding {
    pub name: String,
    pub elem: ElemType,
    pub dims: Vec<usize>,
    pub range: Vec<(usize, usize)>,
}

impl Binding {
    pub fn fixed(name: &str, elem: ElemType, dims: &[usize]) -> Self {
        Self { name: name.into(), elem, dims: dims.to_vec(), range: dims.iter().map(|&d| (d, d)).collect() }
    }
    /// Dims for config.pbtxt: `-1` where the profiles let a dim vary.
    pub fn config_dims(&self) -> Vec<i64> {
        self.range.iter().map(|&(lo, hi)| if lo == hi { lo as i64 } else { -1 }).collect()
    }
}

/// What the model file offers: its bindings, and the batch range of an engine file (a graph file
/// runs any batch).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// The model file's name (`model.kiln`), for messages.
    pub file: String,
    pub inputs: Vec<Binding>,
    pub outputs: Vec<Binding>,
    pub batch: Option<(usize, usize)>,
}

/// The parameters' profile as Kiln's, checked against the model's inputs (`traced`: per-image
/// dims by name); `opt` defaults to the traced dims.
pub fn shape_profile(p: &ProfileShapes, traced: &BTreeMap<String, Vec<usize>>) -> std::result::Result<ShapeProfile, String> {
    let mut profile = ShapeProfile::new();
    let names: Vec<&String> = p.min.keys().chain(p.max.keys()).chain(p.opt.iter().flat_map(|o| o.keys())).collect();
    for name in names {
        let Some(t) = traced.get(name) else {
            return Err(format!("names input `{name}`, which the model does not have; it has {:?}", traced.keys().collect::<Vec<_>>()));
        };
        let (Some(min), Some(max)) = (p.min.get(name), p.max.get(name)) else {
            return Err(format!("input `{name}` needs both min_shapes and max_shapes"));
        };
        let opt = p.opt.as_ref().and_then(|o| o.get(name)).unwrap_or(t);
        // Checked here, not only when an engine is built: a CPU instance asks the ranges whether
        // they hold a request's dims, dim by dim.
        if [min, opt, max].iter().any(|d| d.len() != t.len()) {
            return Err(format!(
                "input `{name}`: min {} opt {} max {} must each give its {} per-image dims (traced: {})",
                dims_text(min),
                dims_text(opt),
                dims_text(max),
                t.len(),
                dims_text(t)
            ));
        }
        if (0..t.len()).any(|d| !(min[d] <= opt[d] && opt[d] <= max[d])) {
            return Err(format!(
                "input `{name}`: each dim must satisfy min <= opt <= max, got min {} opt {} max {}",
                dims_text(min),
                dims_text(opt),
                dims_text(max)
            ));
        }
        profile.insert(name.clone(), DimsRange::new(min, opt, max));
    }
    Ok(profile)
}

/// The build config of a graph file: the parameters, with the batch range `1..=max_batch_size`.
pub fn build_config(
    config: &ModelConfig,
    params: &KilnParameters,
    profile: Option<ShapeProfile>,
    version_dir: &std::path::Path,
) -> BuildConfig {
    let max = config.max_batch_size.max(1) as usize;
    let opt = params.opt_batch.unwrap_or(max).min(max);
    let mut build = BuildConfig::default().precision(params.precision).batch(1, opt, max).cuda_graphs(params.cuda_graphs);
    if let Some(cache) = &params.calibration_cache {
        build = build.calibration_cache(version_dir.join(cache));
    }
    if let Some(p) = profile {
        build = build.profile(p);
    }
    build
}

/// Checks config.pbtxt against the model: batching, then each input and output by name, type and
/// dims. Every error names the field, what the config says and what the model has.
pub fn check(config: &ModelConfig, spec: &ModelSpec) -> Result<()> {
    let mbs = config.max_batch_size;
    if mbs < 1 {
        let most = spec.batch.map_or(String::new(), |(_, max)| format!(" (the engine accepts up to {max})"));
        return Err(config.err(
            "max_batch_size",
            format!("is {mbs}: Kiln models take the batch as their first dim, so set max_batch_size to at least 1{most}"),
        ));
    }
    // Triton's field is an int32 (a larger value is written, and the server cannot load the
    // repository); Kiln's engines take batches up to `MAX_BATCH`, which fits it.
    if mbs > crate::kiln_api::MAX_BATCH as i64 {
        return Err(config.err(
            "max_batch_size",
            format!("is {mbs}, more than the {} batches Kiln's engines take (Triton's field is an int32)", crate::kiln_api::MAX_BATCH),
        ));
    }
    if let Some((min, max)) = spec.batch {
        if mbs as usize > max || min > 1 {
            return Err(config.err(
                "max_batch_size",
                format!(
                    "is {mbs}, but {} runs batches {min}..={max}: Triton sends any batch from 1 to max_batch_size, so set max_batch_size to at most {max}{}",
                    spec.file,
                    if min > 1 { format!(" and rebuild the engine with a minimum batch of 1 (it has {min})") } else { String::new() }
                ),
            ));
        }
    }
    for t in &config.input {
        let field = format!("input \"{}\"", t.name);
        let Some(b) = spec.inputs.iter().find(|b| b.name == t.name) else {
            return Err(config.err(field, format!("is not an input of {}; its inputs are {:?}", spec.file, names(&spec.inputs))));
        };
        if t.reshape.as_ref().is_some_and(|r| !r.is_null() && r.as_object().is_none_or(|o| !o.is_empty())) {
            return Err(config.err(field, "uses reshape, which the Kiln backend does not support; give the model's own dims"));
        }
        if t.allow_ragged_batch {
            return Err(config.err(field, "allows ragged batches, which the Kiln backend does not support"));
        }
        check_tensor(config, &field, t, b)?;
    }
    if let Some(missing) = spec.inputs.iter().find(|b| !config.input.iter().any(|t| t.name == b.name)) {
        return Err(config.err(
            "input",
            format!(
                "lacks `{}` ({}, dims {:?}), an input of {}",
                missing.name,
                missing.elem.config_name(),
                missing.config_dims(),
                spec.file
            ),
        ));
    }
    for t in &config.output {
        let field = format!("output \"{}\"", t.name);
        let Some(b) = spec.outputs.iter().find(|b| b.name == t.name) else {
            return Err(config.err(field, format!("is not an output of {}; its outputs are {:?}", spec.file, names(&spec.outputs))));
        };
        check_tensor(config, &field, t, b)?;
    }
    Ok(())
}

fn names(b: &[Binding]) -> Vec<&str> {
    b.iter().map(|b| b.name.as_str()).collect()
}

fn check_tensor(config: &ModelConfig, field: &str, t: &TensorConfig, b: &Binding) -> Result<()> {
    if t.data_type != b.elem.config_name() {
        return Err(config.err(format!("{field} data_type"), format!("is {}, but the model's is {}", t.data_type, b.elem.config_name())));
    }
    let want = b.config_dims();
    let fits = t.dims.len() == b.range.len()
        && t.dims.iter().zip(&b.range).all(|(&d, &(lo, hi))| if d == -1 { lo < hi } else { d >= 1 && lo as i64 <= d && d <= hi as i64 });
    // An output dim that varies with the input must be -1: a fixed one would be wrong at other sizes.
    let outputs_vary_ok = t.dims.iter().zip(&b.range).all(|(&d, &(lo, hi))| d == -1 || lo == hi || !field.starts_with("output"));
    if !fits || !outputs_vary_ok {
        let ranges: Vec<String> = b.range.iter().map(|&(lo, hi)| if lo == hi { lo.to_string() } else { format!("{lo}..={hi}") }).collect();
        return Err(config.err(
            format!("{field} dims"),
            format!(
                "are {:?}, but the model's are {want:?} (per image, without the batch; each dim in [{}], -1 where it varies)",
                t.dims,
                ranges.join(", ")
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(batch: Option<(usize, usize)>) -> ModelSpec {
        ModelSpec {
            file: "model.kiln".into(),
            inputs: vec![Binding {
                name: "input".into(),
                elem: ElemType::F32,
                dims: vec![3, 224, 224],
                range: vec![(3, 3), (128, 320), (128, 320)],
            }],
            outputs: vec![Binding::fixed("logits", ElemType::F32, &[1000])],
            batch,
        }
    }

    const CONFIG: &str = r#"{"name":"rn","max_batch_size":8,"backend":"kiln",
        "input":[{"name":"input","data_type":"TYPE_FP32","format":"FORMAT_NONE","dims":["3","-1","-1"],"is_shape_tensor":false}],
        "output":[{"name":"logits","data_type":"TYPE_FP32","dims":[1000],"label_filename":""}],
        "instance_group":[{"name":"rn_0","kind":"KIND_CPU","count":1,"gpus":[]}],
        "parameters":{"precision":{"string_value":"fp32"},"min_shapes":{"string_value":"input:3x128x128"},"max_shapes":{"string_value":"input:3x320x320"}}}"#;

    #[test]
    fn reads_tritons_json_with_string_or_number_dims() {
        let c = ModelConfig::from_json(CONFIG).unwrap();
        assert_eq!(c.max_batch_size, 8);
        assert_eq!(c.input[0].dims, vec![3, -1, -1]);
        assert_eq!(c.output[0].dims, vec![1000]);
        let p = c.kiln_parameters().unwrap();
        assert_eq!(p.precision, Precision::Fp32);
        assert!(p.cuda_graphs);
        let profile = p.profile.unwrap();
        assert_eq!(profile.min["input"], vec![3, 128, 128]);
        assert_eq!(profile.max["input"], vec![3, 320, 320]);
        check(&c, &spec(Some((1, 8)))).unwrap();
    }

    #[test]
    fn max_batch_size_outside_the_engines_range_names_both() {
        let mut c = ModelConfig::from_json(CONFIG).unwrap();
        c.max_batch_size = 16;
        let e = check(&c, &spec(Some((1, 8)))).unwrap_err().to_string();
        assert!(e.contains("max_batch_size: is 16") && e.contains("model.kiln runs batches 1..=8"), "{e}");
        c.max_batch_size = 4;
        let e = check(&c, &spec(Some((2, 8)))).unwrap_err().to_string();
        assert!(e.contains("minimum batch of 1 (it has 2)"), "{e}");
        c.max_batch_size = 0;
        let e = check(&c, &spec(None)).unwrap_err().to_string();
        assert!(e.contains("set max_batch_size to at least 1"), "{e}");
    }

    #[test]
    fn names_types_and_dims_are_checked() {
        let base = ModelConfig::from_json(CONFIG).unwrap();
        let mut c = base.clone();
        c.input[0].data_type = "TYPE_FP16".into();
        assert!(check(&c, &spec(None)).unwrap_err().to_string().contains("is TYPE_FP16, but the model's is TYPE_FP32"));
        let mut c = base.clone();
        c.input[0].dims = vec![3, 224, 400];
        let e = check(&c, &spec(None)).unwrap_err().to_string();
        assert!(e.contains("[3, 224, 400]") && e.contains("128..=320"), "{e}");
        let mut c = base.clone();
        c.input[0].dims = vec![-1, 224, 224];
        assert!(check(&c, &spec(None)).is_err(), "a channel count the profile fixes cannot be -1");
        let mut c = base.clone();
        c.input[0].dims = vec![3, 224, 224];
        check(&c, &spec(None)).unwrap();
        let mut c = base.clone();
        c.input[0].name = "image".into();
        assert!(check(&c, &spec(None)).unwrap_err().to_string().contains("is not an input of model.kiln; its inputs are [\"input\"]"));
        let mut c = base.clone();
        c.input.clear();
        assert!(check(&c, &spec(None)).unwrap_err().to_string().contains("lacks `input` (TYPE_FP32, dims [3, -1, -1])"));
        let mut c = base.clone();
        c.output[0].dims = vec![10];
        assert!(check(&c, &spec(None)).is_err());
        let mut c = base;
        c.output[0].name = "boxes".into();
        assert!(check(&c, &spec(None)).unwrap_err().to_string().contains("its outputs are [\"logits\"]"));
    }

    #[test]
    fn parameters_are_checked() {
        let mut c = ModelConfig::from_json(CONFIG).unwrap();
        c.parameters.insert("precison".into(), Parameter { string_value: "fp16".into() });
        assert!(c.kiln_parameters().unwrap_err().to_string().contains("parameters[\"precison\"]: is not a Kiln parameter"));
        c.parameters.remove("precison");
        c.parameters.insert("precision".into(), Parameter { string_value: "fp12".into() });
        assert!(c.kiln_parameters().is_err());
        c.parameters.insert("precision".into(), Parameter { string_value: "fp16".into() });
        c.parameters.remove("max_shapes");
        assert!(c.kiln_parameters().unwrap_err().to_string().contains("needs both min_shapes and max_shapes"));
        assert_eq!(parse_shapes("input:3x8x8, mask:1x8x8").unwrap().len(), 2);
        assert!(parse_shapes("input:3x0x8").is_err());
        assert!(parse_shapes("input3x8x8").is_err());
    }

    #[test]
    fn profile_defaults_opt_to_the_traced_dims() {
        let traced = BTreeMap::from([("input".to_string(), vec![3, 224, 224])]);
        let p = ProfileShapes {
            min: BTreeMap::from([("input".into(), vec![3, 128, 128])]),
            opt: None,
            max: BTreeMap::from([("input".into(), vec![3, 320, 320])]),
        };
        let profile = shape_profile(&p, &traced).unwrap();
        assert_eq!(profile["input"].opt, vec![3, 224, 224]);
        let mut bad = p.clone();
        bad.min.insert("mask".into(), vec![1]);
        assert!(shape_profile(&bad, &traced).unwrap_err().contains("names input `mask`"));
        // Ranks and order are checked (a range of fewer dims than the input would fail later).
        let mut short = p.clone();
        short.max.insert("input".into(), vec![3, 320]);
        assert!(shape_profile(&short, &traced).unwrap_err().contains("must each give its 3 per-image dims"));
        let mut upside_down = p.clone();
        upside_down.max.insert("input".into(), vec![3, 100, 320]);
        assert!(shape_profile(&upside_down, &traced).unwrap_err().contains("min <= opt <= max"));
    }
}
