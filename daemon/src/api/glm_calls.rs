//! GLM's XML tool calls (GLM-4.5, 4.6, 4.7, 5.x templates) as llguidance Lark rules:
//! `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>`, with the newlines of the
//! GLM-4.5 templates (after the name, the key and each value) optional, as the 4.7 / 5.x templates drop
//! them.
//!
//! The argument names come from the tool's `parameters` schema, in the schema's order (required ones
//! must appear, the others may), as llama.cpp's GLM grammar does; a schema without `properties` takes
//! any names. Values are written as GLM's template writes them (`v | tojson if v is not string else
//! v`): an argument whose schema admits only strings is raw text, any other typed argument is compact
//! JSON following its schema, an argument with no constraint at all is free text (read back as JSON
//! when it parses). [`value_form`] is that rule, shared with the output parser so that what the grammar
//! lets the model write is what the parser reads. Raw text is held to the string keywords a JSON
//! string would be (`raw_text.rs`: lengths, `pattern`, `format`).
use super::grammar::{lark_string, with_options, ToolSpec};
use super::raw_text::{self, ANY_TEXT};
use serde_json::{Map, Value};
use std::fmt::Write;

/// One tag of the call syntax, as the grammar must name it: a special token of the vocabulary
/// (`<arg_key>` in lark, matched by token id) or plain text (`"<arg_key>"`).
#[derive(Debug, Clone)]
pub struct Tag {
    pub text: &'static str,
    pub special: bool,
}

impl Tag {
    pub fn new(text: &'static str, special: bool) -> Self {
        Self { text, special }
    }

    /// The tag as a lark atom.
    pub fn atom(&self) -> String {
        match self.special {
            true => self.text.to_string(),
            false => lark_string(self.text),
        }
    }
}

/// The argument tags of GLM calls (the call's own `<tool_call>` / `</tool_call>` are shared with
/// the Hermes format and live in [`super::grammar::CallTags`]).
#[derive(Debug, Clone)]
pub struct ArgTags {
    pub key: Tag,
    pub key_end: Tag,
    pub value: Tag,
    pub value_end: Tag,
}

pub const ARG_KEY: &str = "<arg_key>";
pub const ARG_KEY_END: &str = "</arg_key>";
pub const ARG_VALUE: &str = "<arg_value>";
pub const ARG_VALUE_END: &str = "</arg_value>";

impl ArgTags {
    pub fn new(is_token: impl Fn(&str) -> bool) -> Self {
        let tag = |t: &'static str| Tag::new(t, is_token(t));
        Self {
            key: tag(ARG_KEY),
            key_end: tag(ARG_KEY_END),
            value: tag(ARG_VALUE),
            value_end: tag(ARG_VALUE_END),
        }
    }
}

/// How one argument's value is written between `<arg_value>` and `</arg_value>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueForm {
    /// The schema admits only strings: the raw text, unquoted.
    Text,
    /// The schema admits other values (perhaps strings too): JSON following the schema.
    Json,
    /// No constraint at all (or an argument the schema does not name): free text, read as JSON
    /// when it parses.
    Any,
}

/// Keywords that constrain a value; a schema with none of them accepts anything.
const CONSTRAINING: [&str; 8] = [
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "not", "$ref",
];

/// How GLM writes the argument whose schema is `prop` (None: not in the schema); `root` is the
/// tool's `parameters`, against which local `$ref`s resolve.
pub fn value_form(prop: Option<&Value>, root: &Value) -> ValueForm {
    let Some(prop) = prop.map(|p| resolve_ref(p, root)) else {
        return ValueForm::Any;
    };
    let Some(obj) = prop.as_object() else {
        return ValueForm::Any; // `true` (or a malformed schema, left to llguidance)
    };
    if !CONSTRAINING.iter().any(|k| obj.contains_key(*k)) {
        return ValueForm::Any;
    }
    let all_strings = |vals: &[Value]| !vals.is_empty() && vals.iter().all(Value::is_string);
    let only_strings = match obj.get("type") {
        Some(Value::String(t)) => t == "string",
        Some(_) => false,
        None => match (obj.get("enum"), obj.get("const")) {
            (_, Some(c)) => c.is_string(),
            (Some(Value::Array(e)), None) => all_strings(e),
            _ => false,
        },
    };
    match only_strings {
        true => ValueForm::Text,
        false => ValueForm::Json,
    }
}

/// Follows local `$ref`s (`#/$defs/X`, `#/definitions/X`) a few hops; anything else is returned
/// as is.
fn resolve_ref<'a>(mut schema: &'a Value, root: &'a Value) -> &'a Value {
    for _ in 0..8 {
        let Some(r) = schema.get("$ref").and_then(Value::as_str) else {
            break;
        };
        match r.strip_prefix('#').and_then(|p| root.pointer(p)) {
            Some(target) => schema = target,
            None => break,
        }
    }
    schema
}

/// `prop` as a stand-alone schema: the root's `$defs` / `definitions` carried along so that its
/// `$ref`s still resolve, and llguidance's compact-JSON options attached.
fn standalone(prop: &Value, root: &Value, lenient: bool) -> Value {
    let mut s = match prop {
        Value::Object(o) => o.clone(),
        _ => Map::new(),
    };
    for defs in ["$defs", "definitions"] {
        if let (Some(d), false) = (root.get(defs), s.contains_key(defs)) {
            s.insert(defs.into(), d.clone());
        }
    }
    with_options(&Value::Object(s), lenient)
}

/// Lark rules for GLM calls over `tools`: `glm_call_rest` (what follows the opening tag: the name,
/// the arguments and the closing tag) plus the rules it uses. `close` is the `</tool_call>` atom.
/// Err: a raw-text argument's `pattern` or `format` cannot be enforced (the message names it).
pub fn call_rules(tools: &[ToolSpec], tags: &ArgTags, close: &str) -> Result<String, String> {
    let mut g = String::new();
    let alts: Vec<String> = (0..tools.len()).map(|i| format!("glm_tool_{i}")).collect();
    let _ = writeln!(g, "glm_call_rest: {}", alts.join(" | "));
    let _ = writeln!(g, "GLM_NL: \"\\n\"");
    for (i, tool) in tools.iter().enumerate() {
        let args = tool_args(i, tool, tags, &mut g)?;
        let _ = writeln!(
            g,
            "glm_tool_{i}: {name} GLM_NL? {args}{close}",
            name = lark_string(&tool.name),
        );
    }
    Ok(g)
}

/// Writes the rules of tool `i`'s arguments into `g`; returns the expansion that lists them (empty
/// when the tool takes none, else ending in a space).
fn tool_args(i: usize, tool: &ToolSpec, tags: &ArgTags, g: &mut String) -> Result<String, String> {
    let schema = &tool.parameters;
    let props = schema.get("properties").and_then(Value::as_object);
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let (key, key_end, value) = (tags.key.atom(), tags.key_end.atom(), tags.value.atom());
    let Some(props) = props.filter(|p| !p.is_empty()) else {
        // No named arguments: any names, free values (a schema with `properties: {}` and
        // `additionalProperties: false` takes none).
        if schema.get("additionalProperties") == Some(&Value::Bool(false)) {
            return Ok(String::new());
        }
        let name = text_until(
            &format!("glm_key_{i}"),
            &["[^<\\n]+".into()],
            &tags.key_end,
            g,
        );
        let val = text_until(&format!("glm_any_{i}"), &[], &tags.value_end, g);
        let _ = writeln!(
            g,
            "glm_extra_{i}: {key} {name} GLM_NL? {value} {val} GLM_NL?"
        );
        return Ok(format!("glm_extra_{i}* "));
    };
    // Required names the schema does not describe still have to be written (with any value).
    let undescribed = required
        .iter()
        .filter(|r| !props.contains_key(**r))
        .map(|r| (r.to_string(), Value::Bool(true)));
    let args: Vec<(String, Value)> = props
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .chain(undescribed)
        .collect();
    let mut list = String::new();
    for (j, (arg, prop)) in args.iter().enumerate() {
        let rule = format!("glm_v_{i}_{j}");
        let val = value_rule(&rule, prop, schema, tool.strict, tags, g)
            .map_err(|e| format!("tool `{}`, argument `{arg}`: {e}", tool.name))?;
        let _ = writeln!(
            g,
            "glm_a_{i}_{j}: {key} {name} {key_end} GLM_NL? {value} {val} GLM_NL?",
            name = lark_string(arg),
        );
        let optional = if required.contains(&arg.as_str()) {
            ""
        } else {
            "?"
        };
        let _ = write!(list, "glm_a_{i}_{j}{optional} ");
    }
    Ok(list)
}

/// Writes the rule for one argument's value, closing tag included, into `g`; returns its name.
fn value_rule(
    rule: &str,
    prop: &Value,
    root: &Value,
    strict: bool,
    tags: &ArgTags,
    g: &mut String,
) -> Result<String, String> {
    let end = tags.value_end.atom();
    Ok(match value_form(Some(prop), root) {
        ValueForm::Json => {
            let schema = standalone(prop, root, !strict);
            let _ = writeln!(g, "{rule}_json: %json {schema}");
            let _ = writeln!(g, "{rule}: {rule}_json {end}");
            rule.to_string()
        }
        ValueForm::Text => {
            let prop = resolve_ref(prop, root);
            match string_choices(prop) {
                Some(choices) => {
                    let alts: Vec<String> = choices.iter().map(|c| lark_string(c)).collect();
                    let _ = writeln!(g, "{rule}: ({}) {end}", alts.join(" | "));
                    rule.to_string()
                }
                None => {
                    let regexes = raw_text::text_regexes(prop, strict)?;
                    text_until(rule, &regexes, &tags.value_end, g)
                }
            }
        }
        ValueForm::Any => text_until(rule, &[], &tags.value_end, g),
    })
}

/// The values an only-strings schema allows when it lists them (`const`, `enum`).
fn string_choices(prop: &Value) -> Option<Vec<&str>> {
    if let Some(c) = prop.get("const") {
        return c.as_str().map(|s| vec![s]);
    }
    let e = prop.get("enum")?.as_array()?;
    e.iter().map(Value::as_str).collect()
}

/// A rule named `rule`: text matching every regex of `body` (any text when empty) up to and
/// including the closing tag `end`, which the text cannot contain. A special token cannot occur
/// inside text at all; a text tag ends the text at its first occurrence (a lazy lexeme), and a
/// constrained text is also kept from containing it, so that a value the constraint rejects cannot
/// run on past the tag.
fn text_until(rule: &str, body: &[String], end: &Tag, g: &mut String) -> String {
    let terminal = rule.to_uppercase();
    match end.special {
        true => {
            let _ = writeln!(g, "{terminal}: {}", raw_text::terminal_expr(body));
            let _ = writeln!(g, "{rule}: {terminal} {}", end.atom());
        }
        false if body.is_empty() => {
            let _ = writeln!(g, "{rule}[lazy]: /{ANY_TEXT}/ {}", end.atom());
        }
        false => {
            let tag = llguidance::regex_to_lark(&regex_syntax::escape(end.text), "");
            let _ = writeln!(
                g,
                "{terminal}: {} & ~/(?s:.*{tag}.*)/",
                raw_text::terminal_expr(body)
            );
            let _ = writeln!(g, "{rule}[lazy]: {terminal} {}", end.atom());
        }
    }
    rule.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn value_forms_follow_what_the_schema_admits() {
        let root = json!({"$defs": {"Unit": {"enum": ["C", "F"]}, "N": {"type": "integer"}}});
        let form = |p: Value| value_form(Some(&p), &root);
        assert_eq!(form(json!({"type": "string"})), ValueForm::Text);
        assert_eq!(form(json!({"enum": ["a", "b"]})), ValueForm::Text);
        assert_eq!(form(json!({"const": "a"})), ValueForm::Text);
        assert_eq!(form(json!({"$ref": "#/$defs/Unit"})), ValueForm::Text);
        assert_eq!(form(json!({"$ref": "#/$defs/N"})), ValueForm::Json);
        assert_eq!(form(json!({"type": "integer"})), ValueForm::Json);
        assert_eq!(form(json!({"type": ["string", "null"]})), ValueForm::Json);
        assert_eq!(form(json!({"enum": ["a", 1]})), ValueForm::Json);
        assert_eq!(
            form(json!({"anyOf": [{"type": "string"}, {"type": "array"}]})),
            ValueForm::Json
        );
        assert_eq!(form(json!({"description": "anything"})), ValueForm::Any);
        assert_eq!(form(json!(true)), ValueForm::Any);
        assert_eq!(value_form(None, &root), ValueForm::Any);
    }

    #[test]
    fn rules_name_each_argument_and_type_each_value() {
        let tool =
            ToolSpec::from_openai(&json!({"function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]},
            "days": {"type": "integer"}, "note": {"type": "string"}}, "required": ["city"]}}}))
            .unwrap();
        let tags = ArgTags::new(|t| t == ARG_VALUE_END);
        let g = call_rules(&[tool], &tags, "</tool_call>").unwrap();
        assert!(
            g.contains(
                "glm_tool_0: \"get_weather\" GLM_NL? glm_a_0_0 glm_a_0_1? glm_a_0_2? </tool_call>"
            ),
            "{g}"
        );
        assert!(
            g.contains("glm_v_0_0: (\"Paris\" | \"Lyon\") </arg_value>"),
            "{g}"
        );
        assert!(g.contains("glm_v_0_1_json: %json {"), "{g}");
        assert!(
            g.contains("GLM_V_0_2: /(?s:.*)/\nglm_v_0_2: GLM_V_0_2 </arg_value>"),
            "{g}"
        );
        let text_tags = ArgTags::new(|_| false);
        let tool = ToolSpec::from_openai(&json!({"function": {"name": "f", "parameters": {
            "type": "object", "properties": {"q": {"type": "string"}}}}}))
        .unwrap();
        let g = call_rules(&[tool], &text_tags, "\"</tool_call>\"").unwrap();
        assert!(
            g.contains("glm_v_0_0[lazy]: /(?s:.*)/ \"</arg_value>\""),
            "{g}"
        );
        // A required name without a description is still asked for.
        let tool = ToolSpec::from_openai(&json!({"function": {"name": "f", "parameters": {
            "type": "object", "properties": {"q": {"type": "string"}}, "required": ["id"]}}}))
        .unwrap();
        let g = call_rules(&[tool], &text_tags, "\"</tool_call>\"").unwrap();
        assert!(
            g.contains("GLM_NL? glm_a_0_0? glm_a_0_1 \"</tool_call>\""),
            "{g}"
        );
        assert!(g.contains("glm_a_0_1: \"<arg_key>\" \"id\""), "{g}");
    }
}
