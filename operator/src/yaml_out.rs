//! YAML text that reads back the same under YAML 1.1 (kubectl, Helm, go-yaml v2, PyYAML) and 1.2.
//!
//! serde_yaml 0.9 quotes only what YAML 1.2 would misread, so a string such as `off`, `yes`, `on`
//! or `0777` comes out plain, and a YAML 1.1 reader turns it into a boolean or an octal number.
//! This writer leaves a string plain only when it is unambiguous in both versions (it starts
//! with a letter, `_` or `/`, uses a small safe alphabet and is no 1.1 boolean or null word);
//! everything else is written as a JSON string, which is a valid double-quoted YAML scalar.

use serde_json::Value;

/// Words YAML 1.1 resolves to booleans or null (compared case-insensitively).
const YAML11_WORDS: [&str; 10] = [
    "y", "n", "yes", "no", "true", "false", "on", "off", "null", "~",
];

fn plain_is_safe(s: &str) -> bool {
    let mut chars = s.chars();
    let Some(first) = chars.next() else {
        return false;
    };
    (first.is_ascii_alphabetic() || first == '_' || first == '/')
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/'))
        && !YAML11_WORDS.contains(&s.to_ascii_lowercase().as_str())
}

fn scalar(s: &str) -> String {
    if plain_is_safe(s) {
        s.to_string()
    } else {
        // A JSON string literal is a YAML double-quoted scalar with the same value.
        Value::String(s.to_string()).to_string()
    }
}

fn is_collection(v: &Value) -> bool {
    matches!(v, Value::Object(o) if !o.is_empty()) || matches!(v, Value::Array(a) if !a.is_empty())
}

fn inline(v: &Value) -> String {
    match v {
        Value::String(s) => scalar(s),
        Value::Object(_) => "{}".into(),
        Value::Array(_) => "[]".into(),
        other => other.to_string(),
    }
}

fn write(v: &Value, indent: usize, out: &mut String, sort_keys: bool) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(map) if !map.is_empty() => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            for (k, child) in entries {
                out.push_str(&pad);
                out.push_str(&scalar(k));
                out.push(':');
                if is_collection(child) {
                    out.push('\n');
                    // Sequences under a key sit at the key's indentation, as kubectl prints them.
                    let child_indent = if child.is_array() { indent } else { indent + 2 };
                    write(child, child_indent, out, sort_keys);
                } else {
                    out.push(' ');
                    out.push_str(&inline(child));
                    out.push('\n');
                }
            }
        }
        Value::Array(items) if !items.is_empty() => {
            for item in items {
                out.push_str(&pad);
                out.push('-');
                if is_collection(item) {
                    // The first line of the nested block follows the dash.
                    let mut nested = String::new();
                    let child_indent = indent + 2;
                    write(item, child_indent, &mut nested, sort_keys);
                    out.push(' ');
                    out.push_str(&nested[child_indent..]);
                } else {
                    out.push(' ');
                    out.push_str(&inline(item));
                    out.push('\n');
                }
            }
        }
        other => {
            out.push_str(&pad);
            out.push_str(&inline(other));
            out.push('\n');
        }
    }
}

/// One YAML document (no `---`), keys in the map's own order.
pub fn to_yaml(v: &Value) -> String {
    let mut out = String::new();
    write(v, 0, &mut out, false);
    out
}

/// One YAML document with every mapping's keys sorted (stable text for checked-in files).
pub fn to_yaml_sorted(v: &Value) -> String {
    let mut out = String::new();
    write(v, 0, &mut out, true);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ambiguous_words_are_quoted_and_round_trip() {
        let v = json!({
            "enum": ["auto", "off", "On", "yes", "N", "1Gi", "2Mi", "0777", "1:20", "~", "", ".inf"],
            "plain": "moe-daemon/v1.2_x",
            "nested": {"list": [{"a": 1, "b": [true, null]}, []], "empty": {}},
            "multi": "line one\nline \"two\"\n",
            "weird key: x": -1.5,
        });
        let text = to_yaml(&v);
        for quoted in [
            "\"off\"", "\"On\"", "\"yes\"", "\"N\"", "\"0777\"", "\"1:20\"", "\"1Gi\"",
        ] {
            assert!(text.contains(quoted), "{quoted} not quoted in:\n{text}");
        }
        assert!(text.contains("plain: moe-daemon/v1.2_x\n"), "{text}");
        let back: Value = serde_yaml::from_str(&text).expect("valid YAML");
        assert_eq!(back, v, "{text}");
    }

    #[test]
    fn sorted_keys() {
        let v = json!({"b": 1, "a": {"d": 2, "c": 3}});
        assert_eq!(to_yaml_sorted(&v), "a:\n  c: 3\n  d: 2\nb: 1\n");
    }
}
