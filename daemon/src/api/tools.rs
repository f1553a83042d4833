//! Chat messages and tools before the template sees them: `tool_choice` checked against `tools`,
//! the `developer` role mapped to `system` where the template has no such role, non-text content parts
//! refused (the served models read text only), and — when the template ignores `tools` — the tools
//! written into the system message in the Hermes format, with earlier calls and results in that format.
use super::error::ApiError;
use super::grammar::ToolSpec;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// The request's tools, validated.
#[derive(Debug, Clone)]
pub struct Tools {
    /// As sent (rendered into the prompt, and what the output parser types GLM values with).
    pub raw: Vec<Value>,
    pub specs: Vec<ToolSpec>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): false allows at most one call per turn.
    pub parallel: bool,
}

impl Tools {
    /// None: no tools offered (absent, empty, or `tool_choice: none`).
    pub fn parse(
        tools: Option<&[Value]>,
        tool_choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Option<Self>, ApiError> {
        let raw: Vec<Value> = tools.unwrap_or_default().to_vec();
        let mut specs = Vec::with_capacity(raw.len());
        for t in &raw {
            let spec = ToolSpec::from_openai(t).ok_or_else(|| {
                ApiError::bad_param("tools", format!("each tool needs `function.name`: {t}"))
            })?;
            if !spec.parameters.is_object() && spec.parameters != json!(true) {
                return Err(ApiError::bad_param(
                    "tools",
                    format!(
                        "`parameters` of `{}` must be a JSON schema object",
                        spec.name
                    ),
                ));
            }
            specs.push(spec);
        }
        let choice = match tool_choice {
            None => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => {
                    return Err(ApiError::bad_param(
                        "tool_choice",
                        format!(
                            "tool_choice `{other}`: use none, auto, required or a named function"
                        ),
                    ))
                }
            },
            Some(v) => {
                let name = v
                    .pointer("/function/name")
                    .or_else(|| v.get("name"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        ApiError::bad_param(
                            "tool_choice",
                            "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        )
                    })?;
                if !specs.iter().any(|s| s.name == name) {
                    return Err(ApiError::bad_param(
                        "tool_choice",
                        format!("tool_choice names `{name}`, which is not in `tools`"),
                    ));
                }
                ToolChoice::Named(name.to_string())
            }
        };
        if specs.is_empty() {
            return match choice {
                ToolChoice::Required => Err(ApiError::bad_param(
                    "tool_choice",
                    "tool_choice `required` needs `tools`",
                )),
                _ => Ok(None),
            };
        }
        if choice == ToolChoice::None {
            return Ok(None);
        }
        Ok(Some(Self {
            raw,
            specs,
            choice,
            parallel: parallel.unwrap_or(true),
        }))
    }

    /// The tools a forced choice may call (all for `required`, one for a named choice).
    pub fn forced_specs(&self) -> Option<Vec<ToolSpec>> {
        match &self.choice {
            ToolChoice::Required => Some(self.specs.clone()),
            ToolChoice::Named(n) => Some(
                self.specs
                    .iter()
                    .filter(|s| &s.name == n)
                    .cloned()
                    .collect(),
            ),
            ToolChoice::None | ToolChoice::Auto => None,
        }
    }
}

/// Refuses content the model cannot read and maps roles the template does not know.
pub fn check_messages(
    messages: &mut [Value],
    template_knows_developer: bool,
) -> Result<(), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "messages must not be empty",
        ));
    }
    for m in messages.iter_mut() {
        let Some(role) = m.get("role").and_then(Value::as_str) else {
            return Err(ApiError::bad_param(
                "messages",
                format!("every message needs a string `role`: {m}"),
            ));
        };
        if role == "developer" && !template_knows_developer {
            m["role"] = json!("system");
        }
        if let Some(Value::Array(parts)) = m.get("content") {
            if let Some(p) = parts.iter().find(|p| {
                !matches!(
                    p.get("type").and_then(Value::as_str),
                    Some("text" | "input_text" | "output_text")
                )
            }) {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("untyped");
                return Err(ApiError::bad_param(
                    "messages",
                    format!("content parts of type `{kind}` are not supported: this model reads text only"),
                ));
            }
        }
    }
    Ok(())
}

static INJECTION_LOGGED: AtomicBool = AtomicBool::new(false);

/// For templates that ignore `tools`: the Hermes tools block in the system message (a new one first
/// if there is none), assistant calls written as `<tool_call>` blocks and tool results as
/// `<tool_response>` user turns, as Hermes-format models were trained to read them.
pub fn inject_hermes_tools(messages: &[Value], tools: &[Value]) -> Vec<Value> {
    if !INJECTION_LOGGED.swap(true, Ordering::Relaxed) {
        tracing::info!(
            "the chat template ignores `tools`: writing them into the system message (Hermes format)"
        );
    }
    let mut block = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        block.push('\n');
        block.push_str(&t.to_string());
    }
    block.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments \
         within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    let mut out = Vec::with_capacity(messages.len() + 1);
    match messages.first() {
        Some(m) if m.get("role").and_then(Value::as_str) == Some("system") => {
            let text = text_of(m);
            out.push(json!({"role": "system", "content": format!("{text}\n\n{block}")}));
        }
        _ => out.push(json!({"role": "system", "content": block})),
    }
    let skip = usize::from(messages.first().is_some_and(|m| m["role"] == "system"));
    for m in &messages[skip..] {
        out.push(match m.get("role").and_then(Value::as_str) {
            Some("assistant") if m.get("tool_calls").is_some_and(|c| c.is_array()) => {
                let mut text = text_of(m);
                for c in m["tool_calls"].as_array().into_iter().flatten() {
                    let args = match c.pointer("/function/arguments") {
                        Some(Value::String(s)) => {
                            serde_json::from_str(s).unwrap_or(Value::String(s.clone()))
                        }
                        Some(v) => v.clone(),
                        None => json!({}),
                    };
                    let call = json!({"name": c.pointer("/function/name"), "arguments": args});
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
                }
                json!({"role": "assistant", "content": text})
            }
            Some("tool") => json!({"role": "user",
                "content": format!("<tool_response>\n{}\n</tool_response>", text_of(m))}),
            _ => m.clone(),
        });
    }
    out
}

/// A message's text: a string, or its text parts joined.
fn text_of(m: &Value) -> String {
    match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}})
    }

    #[test]
    fn tool_choice_forms() {
        let tools = [weather()];
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let t = Tools::parse(Some(&tools), Some(&named), Some(false))
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, ToolChoice::Named("get_weather".into()));
        assert!(!t.parallel);
        assert_eq!(t.forced_specs().unwrap().len(), 1);
        assert!(Tools::parse(Some(&tools), Some(&json!("none")), None)
            .unwrap()
            .is_none());
        assert!(Tools::parse(None, Some(&json!("required")), None).is_err());
        let unknown = json!({"type": "function", "function": {"name": "nope"}});
        assert!(Tools::parse(Some(&tools), Some(&unknown), None).is_err());
        assert!(Tools::parse(Some(&[json!({"function": {}})]), None, None).is_err());
    }

    #[test]
    fn developer_role_maps_and_images_are_refused() {
        let mut m = vec![json!({"role": "developer", "content": "be brief"})];
        check_messages(&mut m, false).unwrap();
        assert_eq!(m[0]["role"], "system");
        let mut img = vec![
            json!({"role": "user", "content": [{"type": "text", "text": "what"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}),
        ];
        let e = check_messages(&mut img, false).unwrap_err();
        assert!(e.message.contains("image_url"), "{}", e.message);
    }

    #[test]
    fn hermes_injection_writes_tools_calls_and_results() {
        let msgs = [
            json!({"role": "system", "content": "Be helpful."}),
            json!({"role": "user", "content": "weather?"}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "sunny"}),
        ];
        let out = inject_hermes_tools(&msgs, &[weather()]);
        assert_eq!(out.len(), 4);
        let sys = out[0]["content"].as_str().unwrap();
        assert!(sys.starts_with("Be helpful.") && sys.contains("<tools>\n{\"type\":\"function\""));
        assert_eq!(
            out[2]["content"],
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>"
        );
        assert_eq!(out[3]["role"], "user");
        assert!(out[3]["content"].as_str().unwrap().contains("sunny"));
        let no_system = inject_hermes_tools(&msgs[1..], &[weather()]);
        assert_eq!(no_system.len(), 4);
        assert_eq!(no_system[1]["role"], "user");
    }
}
