//! Chat-template rendering of request messages and tools (a real Qwen3 template, the inputs a client
//! controls), and compiling an arbitrary template source (what `--chat-template` or a checkpoint gives).
#![no_main]
use libfuzzer_sys::fuzz_target;
use moe_daemon::text::ChatTemplate;
use std::sync::OnceLock;

const QWEN3: &str = include_str!("../../daemon/src/text/testdata/qwen3_chat_template.jinja");

fn qwen3() -> &'static ChatTemplate {
    static T: OnceLock<ChatTemplate> = OnceLock::new();
    T.get_or_init(|| ChatTemplate::new(QWEN3, None, Some("<|im_end|>")).expect("template"))
}

fuzz_target!(|data: &[u8]| {
    // First byte picks the mode; the rest is the input.
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
});
