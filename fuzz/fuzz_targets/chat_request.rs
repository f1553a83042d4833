//! `/v1/chat/completions` body: parsing and every parameter check the handler runs before tokenising.
#![no_main]
use libfuzzer_sys::fuzz_target;
use moe_daemon::api::types::{chat_logprobs, parse_body, ChatRequest};

fuzz_target!(|body: &[u8]| {
    let Ok(req) = parse_body::<ChatRequest>(body) else {
        return;
    };
    let _ = req.common.n();
    let _ = req.common.max_tokens();
    let _ = req.common.sampling();
    let _ = req.common.json_mode();
    let _ = req.common.include_usage();
    let _ = req.common.stop.strings();
    let _ = chat_logprobs(req.logprobs, req.top_logprobs);
    let _ = moe_daemon::text::chat_template::normalize_messages(&req.messages);
});
