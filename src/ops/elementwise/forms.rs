//! How each `Unary` op is written outside the graph, one row per variant (`Unary::form`): the
//! `Tensor` method that records it inline, the `kiln::nn` layer that records it as a module
//! (where `torch.nn` has one), and the ATen ops kiln-torch imports as it. Codegen writes what a
//! row says, with no case of its own per op; the op-completeness test (`ops::completeness`) checks
//! that each layer exists in `kiln::nn`, each ATen op in kiln-torch's table.

use super::Unary;

/// An argument of an op's method or layer config, with its value in one op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FormArg {
    F32(f32),
    Bool(bool),
}

/// How a layer's config is written from its arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigForm {
    /// No arguments: the config is `()`.
    Unit,
    /// The one argument itself (`GELU`'s `bool`).
    Value,
    /// `(a, b)` (`Hardtanh`'s `(min_val, max_val)`).
    Tuple,
    /// `Name { arg: value, .. }`, its fields named as the arguments (`SoftplusConfig { beta, threshold }`).
    Struct(&'static str),
}

/// The `kiln::nn` layer of an op, as `torch.nn` names it, and how its config is written.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerForm {
    pub ty: &'static str,
    pub config: ConfigForm,
    /// The config's arguments in order (field names for `ConfigForm::Struct`).
    pub args: Vec<(&'static str, FormArg)>,
}

impl LayerForm {
    /// The Kiln names the layer's code uses: its type and its config struct, if it has one.
    pub fn names(&self) -> Vec<&'static str> {
        match self.config {
            ConfigForm::Struct(config) => vec![self.ty, config],
            _ => vec![self.ty],
        }
    }
}

/// How one `Unary` op is written: `x.method(args)?`, its layer, and its ATen ops.
#[derive(Clone, Debug, PartialEq)]
pub struct UnaryForm {
    /// The `Tensor` method (`softplus`) and its arguments in order, named as it names them.
    pub method: &'static str,
    pub args: Vec<(&'static str, FormArg)>,
    /// `None` where `torch.nn` has no module for the op (`ops::completeness` lists why).
    pub layer: Option<LayerForm>,
    /// The ATen ops (`aten.softplus.default`) kiln-torch's table (python/kiln_torch/ops.py)
    /// imports as this op.
    pub aten: &'static [&'static str],
}

fn f(name: &'static str, v: f32) -> (&'static str, FormArg) {
    (name, FormArg::F32(v))
}

impl UnaryForm {
    fn new(method: &'static str, aten: &'static [&'static str]) -> Self {
        Self { method, args: vec![], layer: None, aten }
    }
    fn args(self, args: Vec<(&'static str, FormArg)>) -> Self {
        Self { args, ..self }
    }
    /// A layer whose config is `config` over `args`.
    fn layer(self, ty: &'static str, config: ConfigForm, args: Vec<(&'static str, FormArg)>) -> Self {
        Self { layer: Some(LayerForm { ty, config, args }), ..self }
    }
    /// A layer with no config (`()`).
    fn plain_layer(self, ty: &'static str) -> Self {
        self.layer(ty, ConfigForm::Unit, vec![])
    }
}

impl Unary {
    /// How this op is written outside the graph (see the module's doc).
    pub fn form(self) -> UnaryForm {
        use ConfigForm::{Struct, Tuple, Value};
        let new = UnaryForm::new;
        match self {
            Unary::Relu => new("relu", &["aten.relu.default"]).plain_layer("ReLU"),
            Unary::LeakyRelu { slope } => {
                let args = vec![f("negative_slope", slope)];
                new("leaky_relu", &["aten.leaky_relu.default"]).args(args.clone()).layer("LeakyReLU", Struct("LeakyReLUConfig"), args)
            }
            Unary::Sigmoid => new("sigmoid", &["aten.sigmoid.default"]).plain_layer("Sigmoid"),
            Unary::Silu => new("silu", &["aten.silu.default"]).plain_layer("SiLU"),
            Unary::Hardswish => new("hardswish", &["aten.hardswish.default"]).plain_layer("Hardswish"),
            Unary::Hardsigmoid => new("hardsigmoid", &["aten.hardsigmoid.default"]).plain_layer("Hardsigmoid"),
            Unary::Gelu { tanh } => {
                let args = vec![("approximate_tanh", FormArg::Bool(tanh))];
                new("gelu", &["aten.gelu.default"]).args(args.clone()).layer("GELU", Value, args)
            }
            Unary::Tanh => new("tanh", &["aten.tanh.default"]).plain_layer("Tanh"),
            Unary::Asinh => new("asinh", &["aten.asinh.default"]),
            Unary::Clamp { min, max } => {
                const CLAMPS: &[&str] = &[
                    "aten.clamp.default",
                    "aten.clamp_min.default",
                    "aten.clamp_max.default",
                    "aten.hardtanh.default",
                    "aten.relu6.default",
                ];
                let form = new("clamp", CLAMPS).args(vec![f("min", min), f("max", max)]);
                if min == 0.0 && max == 6.0 {
                    form.plain_layer("ReLU6")
                } else {
                    form.layer("Hardtanh", Tuple, vec![f("min_val", min), f("max_val", max)])
                }
            }
            // Arithmetic with a Python number: `x + 3`, `x * 0.5`, `1 - x`, `-x`, a sum as a mean.
            Unary::Affine { scale, shift } => new(
                "affine",
                &[
                    "aten.add.Tensor",
                    "aten.add.Scalar",
                    "aten.sub.Tensor",
                    "aten.sub.Scalar",
                    "aten.rsub.Scalar",
                    "aten.mul.Tensor",
                    "aten.mul.Scalar",
                    "aten.div.Tensor",
                    "aten.div.Scalar",
                    "aten.neg.default",
                    "aten.sum.dim_IntList",
                ],
            )
            .args(vec![f("scale", scale), f("shift", shift)]),
            Unary::Softplus { beta, threshold } => {
                let args = vec![f("beta", beta), f("threshold", threshold)];
                new("softplus", &["aten.softplus.default"]).args(args.clone()).layer("Softplus", Struct("SoftplusConfig"), args)
            }
            Unary::Exp => new("exp", &["aten.exp.default"]),
            Unary::Log => new("log", &["aten.log.default"]),
            Unary::Sqrt => new("sqrt", &["aten.sqrt.default"]),
            Unary::Rsqrt => new("rsqrt", &["aten.rsqrt.default"]),
            Unary::Reciprocal => new("reciprocal", &["aten.reciprocal.default"]),
            Unary::Abs => new("abs", &["aten.abs.default"]),
            Unary::Erf => new("erf", &["aten.erf.default"]),
            Unary::Elu { alpha } => {
                let args = vec![f("alpha", alpha)];
                new("elu", &["aten.elu.default"]).args(args.clone()).layer("ELU", Struct("ELUConfig"), args)
            }
            Unary::Mish => new("mish", &["aten.mish.default"]).plain_layer("Mish"),
            Unary::Pow { exponent } => new("pow", &["aten.pow.Tensor_Scalar"]).args(vec![f("exponent", exponent)]),
        }
    }

    /// The Kiln names every activation layer's code may use (`Softplus`, `SoftplusConfig`), sorted,
    /// each once: what generated code imports from `kiln::nn` and its own structs must not be named.
    pub fn layer_names() -> Vec<&'static str> {
        let names: std::collections::BTreeSet<&'static str> =
            Unary::examples().into_iter().filter_map(|op| op.form().layer).flat_map(|l| l.names()).collect();
        names.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_example_has_a_method_named_after_its_args() {
        for op in Unary::examples() {
            let form = op.form();
            assert!(!form.method.is_empty(), "{op:?}");
            // A layer's config names each of its arguments once.
            if let Some(layer) = &form.layer {
                let want = match layer.config {
                    ConfigForm::Unit => 0,
                    ConfigForm::Value => 1,
                    ConfigForm::Tuple => 2,
                    ConfigForm::Struct(_) => layer.args.len().max(1),
                };
                assert_eq!(layer.args.len(), want, "{op:?}: {layer:?}");
            }
        }
        assert_eq!(Unary::Clamp { min: 0.0, max: 6.0 }.form().layer.map(|l| l.ty), Some("ReLU6"));
        assert_eq!(Unary::Clamp { min: -1.0, max: 1.0 }.form().layer.map(|l| l.ty), Some("Hardtanh"));
        let names = Unary::layer_names();
        assert!(names.contains(&"SoftplusConfig") && names.contains(&"Mish") && names.contains(&"ELU"), "{names:?}");
    }
}
