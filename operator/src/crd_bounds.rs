//! Rules added to the generated CRD schema that the Rust types cannot state through schemars:
//! explicit integer bounds and the object-name rule.
//!
//! The API server does not enforce `format: uint32` / `uint64` (only its own formats), so without a
//! `maximum` it stores a value such as 2^40 in a `u32` field, and from then on every list call of
//! the controller fails to deserialize that object and reconciliation stops for all of them.
//! Bounding every integer in the schema makes the API server reject such a value at admission.

use serde_json::{json, Value};

/// Longest MoEDeployment name: the StatefulSet's pods get a `controller-revision-hash` label of
/// `<name>-<10 character hash>`, and label values are at most 63 characters
/// (apimachinery `validation.IsValidLabelValue`), so StatefulSet names above 52 fail.
pub const MAX_NAME_LENGTH: usize = 52;

/// The name rule: a DNS-1035 label (the Services carry the name; core `ValidateServiceName` uses
/// `IsDNS1035Label`) of at most [`MAX_NAME_LENGTH`] characters.
pub const NAME_RULE: &str =
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 52";
pub const NAME_RULE_MESSAGE: &str = "metadata.name must be a DNS-1035 label (lower-case letters, digits and '-', starting with a letter) of at most 52 characters";

/// Largest integer every reader of the schema keeps exact: the API server holds `maximum` as a
/// float64, and so do Helm's YAML reader and JavaScript, so ±(2^63 − 1) would round to ±2^63.
pub const MAX_EXACT_INTEGER: i64 = (1 << 53) - 1;

/// `(minimum, maximum)` an integer of this OpenAPI format can hold once stored by the API server
/// and read back into the Rust type; 64-bit fields are capped at [`MAX_EXACT_INTEGER`] (byte counts
/// up to 8 PiB, which no field here approaches).
fn format_range(format: &str) -> Option<(i64, i64)> {
    match format {
        "int32" => Some((i32::MIN as i64, i32::MAX as i64)),
        "uint32" => Some((0, u32::MAX as i64)),
        "int64" => Some((-MAX_EXACT_INTEGER, MAX_EXACT_INTEGER)),
        "uint64" => Some((0, MAX_EXACT_INTEGER)),
        _ => None,
    }
}

/// Adds `minimum` / `maximum` to every integer schema that lacks them.
pub fn bound_integers(schema: &mut Value) {
    match schema {
        Value::Object(map) => {
            let is_integer = map.get("type").and_then(Value::as_str) == Some("integer");
            let range = map
                .get("format")
                .and_then(Value::as_str)
                .and_then(format_range);
            if let (true, Some((lo, hi))) = (is_integer, range) {
                map.entry("minimum").or_insert(json!(lo));
                map.entry("maximum").or_insert(json!(hi));
            }
            for child in map.values_mut() {
                bound_integers(child);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(bound_integers),
        _ => {}
    }
}

/// Applies the bounds and the root name rule to a CRD rendered as JSON.
pub fn harden(crd: &mut Value) {
    let Some(versions) = crd["spec"]["versions"].as_array_mut() else {
        return;
    };
    for version in versions {
        let root = &mut version["schema"]["openAPIV3Schema"];
        bound_integers(root);
        let rules = root
            .as_object_mut()
            .map(|m| m.entry("x-kubernetes-validations").or_insert(json!([])));
        if let Some(Value::Array(rules)) = rules {
            rules.push(json!({"rule": NAME_RULE, "message": NAME_RULE_MESSAGE}));
        }
    }
}

/// The same name rule in Rust, for offline plans and the reconciler.
pub fn check_name(name: &str) -> Result<(), String> {
    let bytes = name.as_bytes();
    let dns1035 = !bytes.is_empty()
        && bytes[0].is_ascii_lowercase()
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes.last() != Some(&b'-');
    if dns1035 && name.len() <= MAX_NAME_LENGTH {
        Ok(())
    } else {
        Err(format!("{NAME_RULE_MESSAGE} (got {name:?})"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_get_bounds_and_existing_bounds_stay() {
        let mut s = json!({"properties": {
            "a": {"type": "integer", "format": "uint32", "minimum": 1.0},
            "b": {"type": "integer", "format": "int32"},
            "c": {"type": "integer", "format": "uint64"},
            "d": {"type": "string", "format": "uint32"},
        }});
        bound_integers(&mut s);
        assert_eq!(s["properties"]["a"]["minimum"], json!(1.0));
        assert_eq!(s["properties"]["a"]["maximum"], json!(4294967295i64));
        assert_eq!(s["properties"]["b"]["minimum"], json!(-2147483648i64));
        assert_eq!(s["properties"]["c"]["maximum"], json!(MAX_EXACT_INTEGER));
        // Exact in float64, as the API server and Helm read it.
        assert_eq!(MAX_EXACT_INTEGER as f64 as i64, MAX_EXACT_INTEGER);
        assert!(s["properties"]["d"].get("maximum").is_none());
    }

    #[test]
    fn names() {
        for ok in ["qwen", "glm-4-5-air", "a", &"x".repeat(52)] {
            assert_eq!(check_name(ok), Ok(()), "{ok}");
        }
        for bad in ["glm-4.5", "4qwen", "Qwen", "qwen-", "", &"x".repeat(53)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}
