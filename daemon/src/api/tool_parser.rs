//! Tool calls in generated text → OpenAI `tool_calls`. Two formats, told apart per call by what follows
//! the opening tag:
//! - Qwen3 / Hermes JSON: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`
//! - GLM-4.5 XML: `<tool_call>f\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>`
//!   (a value is raw text when the tool's schema admits only strings, otherwise JSON when it parses:
//!   `glm_calls::value_form`, the rule the call grammar writes values by).
//!
//! Streaming: text outside calls passes through as content (a tag split across tokens is held back);
//! each call is emitted whole, name and complete arguments, once its closing tag arrives.
use super::glm_calls::{value_form, ValueForm};
use super::reasoning::partial_tag_suffix;
use serde_json::{Map, Value};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// JSON-encoded object, as OpenAI returns it.
    pub arguments: String,
}

#[derive(Debug, Default, PartialEq)]
pub struct ToolSplit {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

pub struct ToolCallParser {
    /// Tool name → JSON schema of its parameters (for GLM value typing).
    schemas: Map<String, Value>,
    held: String,
    inside: bool,
    /// A call has been emitted: whitespace after it is held back, and dropped if only more calls or
    /// the end follow (the `\n` between `</tool_call>` and `<tool_call>` is not content).
    after_call: bool,
    pending_ws: String,
}

impl ToolCallParser {
    pub fn new(tools: &[Value]) -> Self {
        let schemas = tools
            .iter()
            .filter_map(|t| {
                let f = t.get("function")?;
                Some((
                    f.get("name")?.as_str()?.to_string(),
                    f.get("parameters").cloned().unwrap_or(Value::Null),
                ))
            })
            .collect();
        Self {
            schemas,
            held: String::new(),
            inside: false,
            after_call: false,
            pending_ws: String::new(),
        }
    }

    pub fn push(&mut self, delta: &str) -> ToolSplit {
        self.held.push_str(delta);
        let mut out = ToolSplit::default();
        loop {
            if self.inside {
                let Some(end) = self.held.find(CLOSE) else {
                    return out;
                };
                let body = self.held[..end].to_string();
                self.held.drain(..end + CLOSE.len());
                self.inside = false;
                match self.parse_call(&body) {
                    Some(call) => {
                        self.pending_ws.clear();
                        self.after_call = true;
                        out.calls.push(call);
                    }
                    // Not a well-formed call: give the text back rather than lose it.
                    None => self.emit(&format!("{OPEN}{body}{CLOSE}"), &mut out),
                }
            } else if let Some(start) = self.held.find(OPEN) {
                let text = self.held[..start].to_string();
                self.emit(&text, &mut out);
                self.held.drain(..start + OPEN.len());
                self.inside = true;
            } else {
                let keep = partial_tag_suffix(&self.held, OPEN);
                let emit = self.held.len() - keep;
                let text = self.held[..emit].to_string();
                self.emit(&text, &mut out);
                self.held.drain(..emit);
                return out;
            }
        }
    }

    /// Content text, except whitespace after a call, which waits to see what follows.
    fn emit(&mut self, text: &str, out: &mut ToolSplit) {
        if self.after_call && text.trim().is_empty() {
            self.pending_ws.push_str(text);
            return;
        }
        out.content.push_str(&std::mem::take(&mut self.pending_ws));
        out.content.push_str(text);
    }

    /// End of generation: an unterminated call is attempted as is, otherwise returned as text.
    pub fn finish(&mut self) -> ToolSplit {
        let rest = std::mem::take(&mut self.held);
        if !self.inside {
            let mut out = ToolSplit::default();
            self.emit(&rest, &mut out);
            return out;
        }
        self.inside = false;
        // A GLM call without its closing tag is whole only if its last value is: one cut short by
        // max_tokens (`<tool_call>get_wea`) is not a call.
        let body = rest.trim();
        let cut_short = !body.starts_with('{') && !body.ends_with("</arg_value>");
        match self.parse_call(&rest).filter(|_| !cut_short) {
            Some(call) => ToolSplit {
                content: String::new(),
                calls: vec![call],
            },
            None => ToolSplit {
                content: format!("{OPEN}{rest}"),
                calls: vec![],
            },
        }
    }

    fn parse_call(&self, body: &str) -> Option<ToolCall> {
        let body = body.trim();
        if body.starts_with('{') {
            parse_hermes(body)
        } else {
            self.parse_glm(body)
        }
    }

    fn parse_glm(&self, body: &str) -> Option<ToolCall> {
        let (name, mut rest) = match body.find("<arg_key>") {
            Some(i) => (body[..i].trim(), &body[i..]),
            None => (body.trim(), ""),
        };
        if name.is_empty() || name.contains(char::is_whitespace) {
            return None;
        }
        let schema = self.schemas.get(name).unwrap_or(&Value::Null);
        let props = schema.get("properties");
        let mut args = Map::new();
        while let Some(k0) = rest.find("<arg_key>") {
            let after_k = &rest[k0 + "<arg_key>".len()..];
            let k1 = after_k.find("</arg_key>")?;
            let key = after_k[..k1].trim().to_string();
            let after = &after_k[k1 + "</arg_key>".len()..];
            let v0 = after.find("<arg_value>")?;
            let after_v = &after[v0 + "<arg_value>".len()..];
            let v1 = after_v.find("</arg_value>")?;
            let raw = &after_v[..v1];
            let value = match value_form(props.and_then(|p| p.get(&key)), schema) {
                ValueForm::Text => Value::String(raw.to_string()),
                ValueForm::Json | ValueForm::Any => serde_json::from_str(raw.trim())
                    .unwrap_or_else(|_| Value::String(raw.to_string())),
            };
            args.insert(key, value);
            rest = &after_v[v1 + "</arg_value>".len()..];
        }
        Some(ToolCall {
            name: name.to_string(),
            arguments: Value::Object(args).to_string(),
        })
    }
}

fn parse_hermes(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
        None => "{}".to_string(),
    };
    Some(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(p: &mut ToolCallParser, pieces: &[&str]) -> ToolSplit {
        let mut all = ToolSplit::default();
        let mut parts: Vec<ToolSplit> = pieces.iter().map(|s| p.push(s)).collect();
        parts.push(p.finish());
        for piece in parts {
            all.content += &piece.content;
            all.calls.extend(piece.calls);
        }
        all
    }

    #[test]
    fn hermes_calls_streamed_in_pieces() {
        let mut p = ToolCallParser::new(&[]);
        let s = run(
            &mut p,
            &[
                "Sure.\n<tool",
                "_call>\n{\"name\": \"get_weather\", \"argu",
                "ments\": {\"city\": \"Paris\"}}\n</tool_call>",
                "<tool_call>{\"name\":\"t\",\"arguments\":{}}</tool_call>",
            ],
        );
        assert_eq!(s.content, "Sure.\n");
        assert_eq!(s.calls.len(), 2);
        let mut p = ToolCallParser::new(&[]);
        let two = run(
            &mut p,
            &[
                "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>",
                "\n",
                "<tool_call>{\"name\":\"b\",\"arguments\":{}}</tool_call>\n",
            ],
        );
        assert_eq!((two.content.as_str(), two.calls.len()), ("", 2));
        assert_eq!(s.calls[0].name, "get_weather");
        let args: Value = serde_json::from_str(&s.calls[0].arguments).unwrap();
        assert_eq!(args, json!({"city": "Paris"}));
    }

    #[test]
    fn glm_xml_calls_use_the_schema_for_types() {
        let tools = [
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}),
        ];
        let mut p = ToolCallParser::new(&tools);
        let s = run(
            &mut p,
            &[
                "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>",
                "123</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
            ],
        );
        assert_eq!(s.content, "");
        let args: Value = serde_json::from_str(&s.calls[0].arguments).unwrap();
        assert_eq!(args, json!({"city": "123", "days": 3}));
    }

    #[test]
    fn unterminated_glm_calls_count_only_when_their_last_value_is_whole() {
        let mut p = ToolCallParser::new(&[]);
        let s = run(
            &mut p,
            &["<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n"],
        );
        assert_eq!(s.calls.len(), 1);
        let mut p = ToolCallParser::new(&[]);
        let s = run(&mut p, &["<tool_call>get_wea"]);
        assert!(s.calls.is_empty());
        assert_eq!(s.content, "<tool_call>get_wea");
        let mut p = ToolCallParser::new(&[]);
        let s = run(&mut p, &["<tool_call>f<arg_key>a</arg_key><arg_value>Par"]);
        assert!(s.calls.is_empty());
    }

    #[test]
    fn malformed_calls_and_plain_text_stay_text() {
        let mut p = ToolCallParser::new(&[]);
        let s = run(&mut p, &["a < b <tool_call>{not json</tool_call> end"]);
        assert!(s.calls.is_empty());
        assert_eq!(s.content, "a < b <tool_call>{not json</tool_call> end");
    }
}
