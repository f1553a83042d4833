//! The grammars that constrain output, written for llguidance: JSON (`response_format`) and Hermes-style
//! tool calls (`<tool_call>\n{"name":…,"arguments":…}\n</tool_call>`) whose arguments follow each tool's
//! `parameters` schema. JSON is on one line: at most one space after `,` and `:` (the Python `json.dumps`
//! style models were trained on, or none), no other whitespace — few tokens, no runaway indentation.
//! Pure functions from request values to grammars; compiling them is `structured.rs`'s job.
use llguidance::api::TopLevelGrammar;
use serde_json::{json, Map, Value};

/// llguidance JSON options: one-line separators (regexes), no free whitespace. `lenient`: keywords llguidance
/// cannot enforce are ignored instead of refused (for schemas not marked `strict`).
fn compact_options(lenient: bool) -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ?", "key_separator": ": ?",
           "coerce_one_of": true, "lenient": lenient})
}

/// `schema` with llguidance's compact-JSON options attached (a schema's own `x-guidance` wins).
fn with_options(schema: &Value, lenient: bool) -> Value {
    let mut s = match schema {
        Value::Object(o) => o.clone(),
        // `true` / absent: any JSON value.
        _ => Map::new(),
    };
    if !s.contains_key("x-guidance") {
        s.insert("x-guidance".into(), compact_options(lenient));
    }
    Value::Object(s)
}

/// `response_format: json_object` (any object) or `json_schema` (that schema).
pub fn json_response(schema: Option<&Value>, strict: bool) -> TopLevelGrammar {
    let schema = schema.cloned().unwrap_or_else(|| json!({"type": "object"}));
    TopLevelGrammar::from_json_schema(with_options(&schema, !strict))
}

/// One tool from a request: its name and the JSON schema of its arguments.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub name: String,
    pub parameters: Value,
    pub strict: bool,
}

impl ToolSpec {
    /// From an OpenAI tool (`{"type": "function", "function": {"name", "parameters", "strict"}}`).
    pub fn from_openai(tool: &Value) -> Option<Self> {
        let f = tool.get("function")?;
        Some(Self {
            name: f.get("name")?.as_str()?.to_string(),
            // No `parameters`: a function without arguments still takes an object.
            parameters: f
                .get("parameters")
                .filter(|p| !p.is_null())
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"})),
            strict: f.get("strict").and_then(Value::as_bool).unwrap_or(false),
        })
    }
}

/// How the tool-call tags are written in the grammar: as special tokens when the vocabulary has them
/// as single tokens (Qwen, Hermes models), otherwise as literal text.
#[derive(Debug, Clone)]
pub struct CallTags {
    pub open: String,
    pub close: String,
}

pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";

impl CallTags {
    pub fn new(open_is_token: bool, close_is_token: bool) -> Self {
        let atom = |tag: &str, token: bool| match token {
            true => tag.to_string(),
            false => lark_string(tag),
        };
        Self {
            open: atom(CALL_OPEN, open_is_token),
            close: atom(CALL_CLOSE, close_is_token),
        }
    }
}

/// A lark string literal.
fn lark_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// The JSON body of one call: `{"name":"<one of tools>","arguments":<that tool's schema>}`.
fn call_body_schema(tools: &[ToolSpec]) -> Value {
    let one = |t: &ToolSpec| {
        json!({
            "type": "object",
            "properties": {
                "name": {"const": t.name},
                "arguments": t.parameters,
            },
            "required": ["name", "arguments"],
            "additionalProperties": false,
        })
    };
    let lenient = !tools.iter().all(|t| t.strict);
    let body = match tools {
        [t] => one(t),
        _ => json!({"anyOf": tools.iter().map(one).collect::<Vec<_>>()}),
    };
    with_options(&body, lenient)
}

/// How many calls a forced tool choice produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallCount {
    One,
    OneOrMore,
}

/// `tool_choice` required / named: the whole output is tool calls (one, or one or more), then the end.
pub fn forced_calls(tools: &[ToolSpec], tags: &CallTags, count: CallCount) -> TopLevelGrammar {
    let body = call_body_schema(tools);
    let start = match count {
        CallCount::One => "start: call",
        CallCount::OneOrMore => "start: call (\"\\n\" call)*",
    };
    TopLevelGrammar::from_lark(format!(
        "{start}\ncall: {open} \"\\n\" body \"\\n\" {close}\nbody: %json {body}\n",
        open = tags.open,
        close = tags.close,
    ))
}

/// `tool_choice: auto` with `response_format` JSON: either the JSON answer or tool calls.
pub fn json_or_calls(
    schema: Option<&Value>,
    strict: bool,
    tools: &[ToolSpec],
    tags: &CallTags,
    count: CallCount,
) -> TopLevelGrammar {
    let schema = schema.cloned().unwrap_or_else(|| json!({"type": "object"}));
    let answer = with_options(&schema, !strict);
    let calls = match count {
        CallCount::One => "call",
        CallCount::OneOrMore => "call (\"\\n\" call)*",
    };
    TopLevelGrammar::from_lark(format!(
        "start: answer | {calls}\nanswer: %json {answer}\ncall: {open} \"\\n\" body \"\\n\" {close}\nbody: %json {body}\n",
        open = tags.open,
        close = tags.close,
        body = call_body_schema(tools),
    ))
}

/// `tool_choice: auto`: the rest of one call, engaged once the model has written the opening tag and
/// the `{` that starts a Hermes call (the whitespace before it is already written, whatever it is).
pub fn call_after_open(tools: &[ToolSpec], tags: &CallTags) -> TopLevelGrammar {
    let body = call_body_schema(tools);
    TopLevelGrammar::from_lark(format!(
        "start: WS? body \"\\n\"? {close}\nWS: /[ \\t\\r\\n]+/\nbody: %json {body}\n",
        close = tags.close,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    #[test]
    fn tool_specs_read_openai_tools() {
        let t = ToolSpec::from_openai(&weather()).unwrap();
        assert_eq!(t.name, "get_weather");
        assert_eq!(t.parameters["required"], json!(["city"]));
        let bare = ToolSpec::from_openai(&json!({"function": {"name": "now"}})).unwrap();
        assert_eq!(bare.parameters, json!({"type": "object"}));
        assert!(ToolSpec::from_openai(&json!({"function": {}})).is_none());
    }

    #[test]
    fn call_grammar_names_the_tags_and_the_schema() {
        let tools = [ToolSpec::from_openai(&weather()).unwrap()];
        let g = serde_json::to_string(&forced_calls(
            &tools,
            &CallTags::new(true, false),
            CallCount::One,
        ))
        .unwrap();
        assert!(g.contains("<tool_call>"), "{g}");
        assert!(g.contains(r#"\"</tool_call>\""#), "{g}");
        assert!(g.contains("get_weather") && g.contains("whitespace_flexible"));
    }
}
