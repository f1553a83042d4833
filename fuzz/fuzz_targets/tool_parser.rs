//! Tool-call extraction (Hermes `<tool_call>` JSON and GLM `<arg_key>` XML) from model output fed in
//! arbitrary pieces: never panics, and no text is both content and call.
#![no_main]
use libfuzzer_sys::fuzz_target;
use moe_daemon::api::tool_parser::ToolCallParser;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let tools = serde_json::json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
         "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "f"}}
    ]);
    let mut p = ToolCallParser::new(tools.as_array().map(Vec::as_slice).unwrap_or(&[]));
    // Feed in pieces of `cut % 7 + 1` characters, as streamed tokens would arrive.
    let step = cut as usize % 7 + 1;
    let chars: Vec<char> = text.chars().collect();
    let mut content_len = 0;
    for piece in chars.chunks(step) {
        let s: String = piece.iter().collect();
        content_len += p.push(&s).content.len();
    }
    content_len += p.finish().content.len();
    assert!(content_len <= text.len(), "content longer than the input");
});
