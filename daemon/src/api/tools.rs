//! Chat messages and tools before the template sees them: `tool_choice` checked against `tools`,
//! the `developer` role mapped to `system` where the template has no such role, non-text content parts
//! refused (the served models read text only), and — when the template ignores `tools` — the tools
//! written into the system message in the Hermes format, with earlier calls and results in that format.
//! Before any of that, [`ToolLimits`] refuses tool lists too long to ever fit, in microseconds per tool
//! and without rendering or tokenising them.
use super::error::ApiError;
use super::grammar::ToolSpec;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};

/// Default of `--max-tools`: OpenAI takes 128 functions per request; agents with many MCP servers send
/// a few hundred.
pub const DEFAULT_MAX_TOOLS: usize = 1024;

/// Cheap bounds checked before a request's tools are validated, rendered or tokenised (a list of
/// 100,000 tools costs seconds of rendering and tokenising, and far more when compiled into a grammar).
#[derive(Debug, Clone)]
pub struct ToolLimits {
    /// `--max-tools`.
    pub max_tools: usize,
    /// The longest token of the vocabulary in bytes (an upper bound: its UTF-8 spelling in the
    /// vocabulary), so that `bytes / max_token_bytes` is a lower bound on the tokens of any text.
    pub max_token_bytes: usize,
}

impl ToolLimits {
    /// `vocab`: the vocabulary's token strings.
    pub fn new<'a>(max_tools: usize, vocab: impl IntoIterator<Item = &'a str>) -> Self {
        let max_token_bytes = vocab.into_iter().map(str::len).max().unwrap_or(1).max(1);
        Self {
            max_tools,
            max_token_bytes,
        }
    }

    /// Refuses `tools` when there are more than `max_tools`, or when the text that must reach the
    /// prompt for them cannot fit `max_context` tokens even at the vocabulary's longest token per
    /// token. That text is each tool's name when the template renders the tools itself (every
    /// template must name a tool for the model to call it), and each tool's whole JSON when the
    /// server writes them into the system message (`template_renders_tools` false).
    pub fn check(
        &self,
        tools: &[Value],
        template_renders_tools: bool,
        max_context: usize,
    ) -> Result<(), ApiError> {
        if tools.len() > self.max_tools {
            return Err(ApiError::bad_param(
                "tools",
                format!(
                    "the request has {} tools; this server takes at most {} (--max-tools)",
                    tools.len(),
                    self.max_tools
                ),
            ));
        }
        let bytes: usize = tools
            .iter()
            .map(|t| match template_renders_tools {
                true => t
                    .pointer("/function/name")
                    .and_then(Value::as_str)
                    .map_or(0, str::len),
                false => json_len(t),
            })
            .sum();
        let at_least = bytes.div_ceil(self.max_token_bytes);
        if at_least > max_context {
            return Err(ApiError::context_length(format!(
                "This model's maximum context length is {max_context} tokens. However, the {} tools \
                 alone need at least {at_least} tokens. Please send fewer tools.",
                tools.len()
            )));
        }
        Ok(())
    }
}

/// The length of `v` written as compact JSON, without writing it.
fn json_len(v: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    let _ = serde_json::to_writer(&mut c, v);
    c.0
}

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
    fn tool_lists_too_long_for_the_context_are_refused_from_their_size() {
        let limits = ToolLimits::new(8, ["a", "abcd", "ab"]);
        assert_eq!(limits.max_token_bytes, 4);
        let named = |name: &str| json!({"type": "function", "function": {"name": name}});
        // Names: 3 tools × 8 bytes need at least 6 tokens of 4 bytes.
        let tools = vec![named("12345678"); 3];
        assert!(limits.check(&tools, true, 6).is_ok());
        let e = limits.check(&tools, true, 5).unwrap_err();
        assert_eq!(e.code, Some("context_length_exceeded"));
        assert!(e.message.contains("at least 6 tokens"), "{}", e.message);
        // Injected tools count their whole JSON (50 bytes each: 38 tokens for three).
        assert_eq!(json_len(&tools[0]), 50);
        assert!(limits.check(&tools, false, 37).is_err());
        assert!(limits.check(&tools, false, 38).is_ok());
        let e = limits.check(&vec![named("f"); 9], true, 1000).unwrap_err();
        assert!(
            e.message.contains("at most 8 (--max-tools)"),
            "{}",
            e.message
        );
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
