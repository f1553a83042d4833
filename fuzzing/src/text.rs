//! Text in and out of the model: chat-template rendering, tool-call and reasoning extraction.
use moe_daemon::api::reasoning::ReasoningParser;
use moe_daemon::api::tool_parser::ToolCallParser;
use moe_daemon::text::ChatTemplate;
use std::sync::OnceLock;

const QWEN3: &str = include_str!("../../daemon/src/text/testdata/qwen3_chat_template.jinja");

fn qwen3() -> &'static ChatTemplate {
    static T: OnceLock<ChatTemplate> = OnceLock::new();
    T.get_or_init(|| ChatTemplate::new(QWEN3, None, Some("<|im_end|>")).expect("template"))
}

/// Chat-template rendering of request messages and tools (a real Qwen3 template, the inputs a client
/// controls), and compiling an arbitrary template source (what `--chat-template` or a checkpoint
/// gives). The first byte picks the mode; the rest is the input.
pub fn chat_template(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 4 == 0 {
        if let Ok(src) = std::str::from_utf8(rest) {
            let _ = ChatTemplate::new(src, Some("<s>"), Some("</s>"));
        }
        return;
    }
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(rest) else {
        return;
    };
    let messages = v.get("messages").and_then(|m| m.as_array()).cloned();
    let messages = messages.unwrap_or_else(|| vec![v.clone()]);
    let tools = v.get("tools").and_then(|t| t.as_array()).cloned();
    let extra = v
        .get("chat_template_kwargs")
        .and_then(|k| k.as_object())
        .cloned()
        .unwrap_or_default();
    let _ = qwen3().render(&messages, tools.as_deref(), mode % 2 == 1, &extra);
}

/// The input after its first byte as UTF-8 text, fed in pieces of `first % 7 + 1` characters, as
/// streamed tokens would arrive.
fn pieces(data: &[u8]) -> Option<(u8, Vec<String>, usize)> {
    let (&cut, rest) = data.split_first()?;
    let text = std::str::from_utf8(rest).ok()?;
    let chars: Vec<char> = text.chars().collect();
    let step = cut as usize % 7 + 1;
    let pieces = chars.chunks(step).map(|p| p.iter().collect()).collect();
    Some((cut, pieces, text.len()))
}

/// Tool-call extraction (Hermes `<tool_call>` JSON and GLM `<arg_key>` XML) from model output fed in
/// arbitrary pieces: never panics, and no text is both content and call.
pub fn tool_parser(data: &[u8]) {
    let Some((_, pieces, len)) = pieces(data) else {
        return;
    };
    let tools = serde_json::json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
         "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "f"}}
    ]);
    let mut p = ToolCallParser::new(tools.as_array().map(Vec::as_slice).unwrap_or(&[]));
    let mut content_len = 0;
    for s in &pieces {
        content_len += p.push(s).content.len();
    }
    content_len += p.finish().content.len();
    assert!(content_len <= len, "content longer than the input");
}

/// `<think>…</think>` splitting of model output fed in arbitrary pieces: every byte of the input ends
/// up in reasoning or content, never both, never lost (tags excepted).
pub fn reasoning_parser(data: &[u8]) {
    let Some((cut, pieces, len)) = pieces(data) else {
        return;
    };
    let mut p = ReasoningParser::new(cut & 0x80 != 0);
    let mut out = 0;
    for s in &pieces {
        let split = p.push(s);
        out += split.reasoning.len() + split.content.len();
    }
    let split = p.finish();
    out += split.reasoning.len() + split.content.len();
    assert!(out <= len, "output longer than the input");
}
