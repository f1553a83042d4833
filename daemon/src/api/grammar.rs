//! The grammars that constrain output, written for llguidance: JSON (`response_format`) and tool calls
//! whose arguments follow each tool's `parameters` schema, in the model's call format: Hermes
//! (`<tool_call>\n{"name":…,"arguments":…}\n</tool_call>`) or GLM's XML (`glm_calls.rs`). JSON is on one line: at most one space after `,` and `:` (the Python `json.dumps`
//! style models were trained on, or none), no other whitespace — few tokens, no runaway indentation.
//! Pure functions from request values to grammars; compiling them is `structured.rs`'s job.
use super::glm_calls::{self, ArgTags, Tag};
use llguidance::api::TopLevelGrammar;
use serde_json::{json, Map, Value};

/// llguidance JSON options: one-line separators (regexes), no free whitespace. `lenient`: keywords llguidance
/// cannot enforce are ignored instead of refused (for schemas not marked `strict`).
fn compact_options(lenient: bool) -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ?", "key_separator": ": ?",
           "coerce_one_of": true, "lenient": lenient})
}

/// `schema` with llguidance's compact-JSON options attached (a schema's own `x-guidance` wins).
pub(super) fn with_options(schema: &Value, lenient: bool) -> Value {
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

/// How a model writes tool calls (told by its chat template).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFormat {
    /// `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>` (Qwen, Hermes, and the block the
    /// server injects for templates that ignore tools).
    Hermes,
    /// `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>` (GLM-4.5 … 5.x).
    Glm,
}

/// How the tool-call tags are written in the grammar: as special tokens when the vocabulary has them
/// as single tokens (Qwen, Hermes, GLM models), otherwise as literal text.
#[derive(Debug, Clone)]
pub struct CallTags {
    pub open: String,
    pub close: String,
    /// GLM's argument tags.
    pub args: ArgTags,
}

pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";

impl CallTags {
    /// `is_token`: whether the vocabulary has this tag as one special token.
    pub fn new(is_token: impl Fn(&str) -> bool) -> Self {
        Self {
            open: Tag::new(CALL_OPEN, is_token(CALL_OPEN)).atom(),
            close: Tag::new(CALL_CLOSE, is_token(CALL_CLOSE)).atom(),
            args: ArgTags::new(is_token),
        }
    }
}

/// A lark string literal.
pub(super) fn lark_string(s: &str) -> String {
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

/// Lark rules defining `call` (one whole call, tags included) and `call_rest` (what follows the
/// opening tag, for `auto`) in `format`, plus the `calls` rule (`count` calls). Err: a tool's schema
/// asks for what the call format cannot enforce (the message says what).
fn call_rules(
    tools: &[ToolSpec],
    tags: &CallTags,
    format: CallFormat,
    count: CallCount,
) -> Result<String, String> {
    let (open, close) = (&tags.open, &tags.close);
    let (rules, sep) = match format {
        CallFormat::Hermes => (
            format!(
                "call: {open} \"\\n\" body \"\\n\" {close}\n\
                 call_rest: WS? body \"\\n\"? {close}\n\
                 WS: /[ \\t\\r\\n]+/\n\
                 body: %json {body}\n",
                body = call_body_schema(tools),
            ),
            "\"\\n\"",
        ),
        CallFormat::Glm => (
            format!(
                "call: {open} glm_call_rest\ncall_rest: glm_call_rest\n{}",
                glm_calls::call_rules(tools, &tags.args, close)?
            ),
            // GLM-4.5 writes a newline between calls, 4.7 and later none.
            "\"\\n\"?",
        ),
    };
    let calls = match count {
        CallCount::One => "calls: call".to_string(),
        CallCount::OneOrMore => format!("calls: call ({sep} call)*"),
    };
    Ok(format!("{calls}\n{rules}"))
}

/// `tool_choice` required / named: the whole output is tool calls (one, or one or more), then the end.
pub fn forced_calls(
    tools: &[ToolSpec],
    tags: &CallTags,
    format: CallFormat,
    count: CallCount,
) -> Result<TopLevelGrammar, String> {
    let rules = call_rules(tools, tags, format, count)?;
    Ok(TopLevelGrammar::from_lark(format!("start: calls\n{rules}")))
}

/// `tool_choice: auto` with `response_format` JSON: either the JSON answer or tool calls.
pub fn json_or_calls(
    schema: Option<&Value>,
    strict: bool,
    tools: &[ToolSpec],
    tags: &CallTags,
    format: CallFormat,
    count: CallCount,
) -> Result<TopLevelGrammar, String> {
    let schema = schema.cloned().unwrap_or_else(|| json!({"type": "object"}));
    let answer = with_options(&schema, !strict);
    let rules = call_rules(tools, tags, format, count)?;
    Ok(TopLevelGrammar::from_lark(format!(
        "start: answer | calls\nanswer: %json {answer}\n{rules}"
    )))
}

/// `tool_choice: auto`: the rest of one call, engaged once the model has written the opening tag (and,
/// in the Hermes format, the `{` that starts the JSON; the whitespace before it is already written,
/// whatever it is).
pub fn call_after_open(
    tools: &[ToolSpec],
    tags: &CallTags,
    format: CallFormat,
) -> Result<TopLevelGrammar, String> {
    let rules = call_rules(tools, tags, format, CallCount::One)?;
    Ok(TopLevelGrammar::from_lark(format!(
        "start: call_rest\n{rules}"
    )))
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
        let tags = CallTags::new(|t| t == CALL_OPEN);
        let g = serde_json::to_string(
            &forced_calls(&tools, &tags, CallFormat::Hermes, CallCount::One).unwrap(),
        )
        .unwrap();
        assert!(g.contains("<tool_call>"), "{g}");
        assert!(g.contains(r#"\"</tool_call>\""#), "{g}");
        assert!(g.contains("get_weather") && g.contains("whitespace_flexible"));
    }
}
