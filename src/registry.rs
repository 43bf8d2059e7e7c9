//! Name-keyed tables of `inventory` registrations (custom ops, converters), built once.
//! Registration order is unspecified, so a name registered twice is an error, never a silent pick.

use std::collections::HashMap;

/// Builds a table keyed by `key(item)`; the error names the first duplicate key.
pub fn build_table<T: 'static>(
    items: impl Iterator<Item = &'static T>,
    key: fn(&T) -> &'static str,
) -> Result<HashMap<&'static str, &'static T>, String> {
    let mut table = HashMap::new();
    for item in items {
        if table.insert(key(item), item).is_some() {
            return Err(key(item).to_string());
        }
    }
    Ok(table)
}
