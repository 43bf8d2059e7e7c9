//! Which quantised layers cost a model its accuracy, measured: the CPU simulation of the 8-bit
//! engine against FP32 with every layer quantised, then with one scope at a time kept out of 8
//! bits (`--layer-precisions <scope>:fp16`): each quantised layer, and each module holding from
//! two to a quarter of them (a ResNet's `layer4`, a block). The evidence a user picks
//! `--layer-precisions` from (`kiln calibrate --sensitivity`), in the spirit of Polygraphy's
//! `debug precision`.

use super::quantise::simulate_optimized;
use super::*;
use crate::engine::{LayerPrecision, Precision};

/// One scope kept in FP16: its module path, how many quantised layers it covers, and the
/// simulation's rel L2 against FP32 over every output.
#[derive(Clone, Debug, PartialEq)]
pub struct ScopeError {
    pub scope: String,
    pub layers: usize,
    pub rel_l2: f64,
}

/// The sensitivity of a `format` engine built with `cache`: the fully quantised simulation's rel
/// L2 against FP32 on `inputs` (batches for the graph's one input), and each scope's with that
/// scope in FP16, best first. `progress(done, total)` is called after each simulation.
pub fn quant_sensitivity(
    graph: &Graph,
    cache: &CalibrationCache,
    format: QuantFormat,
    inputs: &[HostTensor],
    mut progress: impl FnMut(usize, usize),
) -> Result<(f64, Vec<ScopeError>)> {
    let optimized = crate::passes::optimize(graph)?;
    let names = optimized.input_names();
    let [input] = names.as_slice() else {
        return Err(Error::Config { reason: format!("sensitivity feeds graphs of one input; this one has {names:?}") });
    };
    if inputs.is_empty() {
        return Err(Error::Config { reason: "sensitivity needs at least one batch".into() });
    }
    let outputs = |g: &Graph| -> Result<Vec<f32>> {
        let mut all = vec![];
        for x in inputs {
            for t in crate::cpu::run(g, &[(*input, x)])?.into_values() {
                all.extend_from_slice(&t.data);
            }
        }
        Ok(all)
    };
    let fp32 = outputs(&optimized)?;
    let fp32 = HostTensor::new(vec![fp32.len()], fp32);
    // The harness's rel L2 of every output, each run's values end to end.
    let error = |rules: &[LayerPrecision]| -> Result<f64> {
        let got = outputs(&simulate_optimized(&optimized, cache, format, rules)?)?;
        Ok(crate::compare::compare("outputs", &HostTensor::new(vec![got.len()], got), &fp32).rel_l2)
    };
    // The quantised layers, as the simulation has them.
    let sim = simulate_optimized(&optimized, cache, format, &[])?;
    let layers: Vec<String> = sim
        .nodes
        .iter()
        .filter(|n| quantizable(&n.op) && n.inputs.iter().any(|&i| matches!(sim.nodes[i].op, Op::Quant(_))))
        .map(|n| n.path.clone())
        .collect();
    let scopes = scopes(&layers);
    let total = scopes.len() + 1;
    let all = error(&[])?;
    progress(1, total);
    let mut out = Vec::with_capacity(scopes.len());
    for (i, (scope, covered)) in scopes.into_iter().enumerate() {
        let rel_l2 = error(&[LayerPrecision::new(scope.as_str(), Precision::Fp16)])?;
        out.push(ScopeError { scope, layers: covered, rel_l2 });
        progress(i + 2, total);
    }
    out.sort_by(|a, b| a.rel_l2.total_cmp(&b.rel_l2).then(a.layers.cmp(&b.layers)));
    Ok((all, out))
}

/// The scopes of `layers` (module paths): each layer, and each ancestor module covering from two
/// to a quarter of them (a module holding most of the network, MobileNetV2's `features`, would
/// win by not quantising at all), with the count it covers; of modules covering the same layers
/// (`features.17` and `features.17.conv`) the outermost. Modules first, in order of first
/// appearance.
fn scopes(layers: &[String]) -> Vec<(String, usize)> {
    let mut modules: Vec<(String, Vec<usize>)> = vec![];
    for (j, l) in layers.iter().enumerate() {
        for (i, _) in l.match_indices('.') {
            let m = &l[..i];
            match modules.iter_mut().find(|(p, _)| p == m) {
                Some((_, covered)) => covered.push(j),
                None => modules.push((m.to_string(), vec![j])),
            }
        }
    }
    let most = (layers.len() / 4).max(2);
    let mut out: Vec<(String, Vec<usize>)> = vec![];
    for (m, covered) in modules {
        if (2..=most).contains(&covered.len()) && !out.iter().any(|(_, c)| *c == covered) {
            out.push((m, covered));
        }
    }
    out.into_iter().map(|(m, c)| (m, c.len())).chain(layers.iter().map(|l| (l.clone(), 1))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_are_the_layers_and_the_modules_holding_a_few() {
        let mut layers: Vec<String> =
            ["conv1", "layer1.0.conv1", "layer1.0.conv2", "layer1.1.conv1", "layer2.0.conv1", "fc"].map(String::from).into();
        layers.extend((0..6).map(|i| format!("big.{i}.conv")));
        let s = scopes(&layers);
        // `big` covers 6 of 12, more than a quarter; each `big.i` one layer; `layer2` one.
        let modules: Vec<(String, usize)> = s.iter().filter(|(_, n)| *n > 1).cloned().collect();
        assert_eq!(modules, [("layer1".to_string(), 3), ("layer1.0".to_string(), 2)]);
        assert_eq!(s.len(), 2 + layers.len(), "every layer too: {s:?}");
        assert_eq!(s[2..].iter().map(|(l, _)| l.as_str()).collect::<Vec<_>>(), layers.iter().map(String::as_str).collect::<Vec<_>>());
        // Of `a` and `a.b`, which cover the same two layers, the outermost.
        let same: Vec<String> = ["a.b.x", "a.b.y", "c", "d", "e", "f", "g", "h"].map(String::from).into();
        assert_eq!(scopes(&same)[0], ("a".to_string(), 2));
        assert_eq!(scopes(&same).iter().filter(|(_, n)| *n > 1).count(), 1);
    }
}
