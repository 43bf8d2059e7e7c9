//! `kiln models`: the bundled models (`kiln_models::BUNDLED`) and the program's own, as a table for
//! people or as JSON for the Python tools (`tools/bundled.py`), so that the list is kept in one place.

use super::{common, ModelsArgs};
use kiln::{Error, Result};
use std::process::ExitCode;

/// `BUNDLED` as `kiln models --json` writes it, in its order: name, input_size (the default
/// height and width), outputs, family (`BundledModel::family`), torchvision (whether
/// `torchvision.models` has a builder of that name) and description.
pub fn to_json() -> serde_json::Value {
    let models = kiln_models::BUNDLED.iter().map(|m| {
        serde_json::json!({
            "name": m.name,
            "input_size": m.input_size,
            "outputs": m.outputs,
            "family": m.family(),
            "torchvision": m.torchvision,
            "description": m.description,
        })
    });
    serde_json::Value::Array(models.collect())
}

pub fn models(a: ModelsArgs) -> Result<ExitCode> {
    if a.json {
        let text = serde_json::to_string_pretty(&to_json())
            .map_err(|e| Error::Serialize { what: "the model list".into(), reason: e.to_string() })?;
        say!("{text}");
        return Ok(ExitCode::SUCCESS);
    }
    for m in kiln_models::BUNDLED {
        let size = format!("{0}x{0}", m.input_size);
        say!("{:<20} {size:<8} {:<32} {}", m.name, m.outputs.join(", "), m.description);
    }
    let own = common::user_model_names();
    if !own.is_empty() {
        say!("this program's own: {}", own.join(", "));
    }
    Ok(ExitCode::SUCCESS)
}
