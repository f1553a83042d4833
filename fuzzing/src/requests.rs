//! HTTP request bodies: parsing and every check the handlers run before tokenising.
use moe_daemon::api::types::{
    chat_logprobs, parse_body, ChatRequest, CompletionRequest, SamplingDefaults,
};
use moe_daemon::text::TextTokenizer;
use std::sync::OnceLock;

/// `/v1/chat/completions` body: parsing and every parameter check the handler runs.
pub fn chat_request(body: &[u8]) {
    let Ok(req) = parse_body::<ChatRequest>(body) else {
        return;
    };
    let _ = req.common.n();
    let _ = req.common.max_tokens();
    let _ = req.common.sampling(&SamplingDefaults::default());
    let _ = req.common.response_format();
    let _ = req.common.include_usage();
    let _ = req.common.stop.strings();
    let _ = chat_logprobs(req.logprobs, req.top_logprobs);
    let _ = moe_daemon::text::chat_template::normalize_messages(&req.messages);
}

/// `/v1/completions` body: parsing and parameter checks.
pub fn completions_request(body: &[u8]) {
    let Ok(req) = parse_body::<CompletionRequest>(body) else {
        return;
    };
    let _ = req.common.n();
    let _ = req.common.max_tokens();
    let _ = req.common.sampling(&SamplingDefaults::default());
    let _ = req.common.response_format();
    let _ = req.common.stop.strings();
}

/// A small byte-level BPE tokenizer with one special token.
fn tokenizer() -> &'static TextTokenizer {
    static TOK: OnceLock<TextTokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut vocab = serde_json::Map::new();
        for b in 0u8..=255 {
            // GPT-2 byte-to-unicode: printable bytes map to themselves, others above U+0100.
            let c = match b {
                b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff => b as char,
                _ => char::from_u32(0x100 + b as u32).unwrap_or('?'),
            };
            let n = vocab.len();
            vocab.entry(c.to_string()).or_insert(n.into());
        }
        let n = vocab.len();
        vocab.insert("<|im_end|>".into(), n.into());
        let spec = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
            "post_processor": null, "decoder": null,
            "added_tokens": [{"id": n, "content": "<|im_end|>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                              "use_regex": true},
            "model": {"type": "BPE", "vocab": vocab, "merges": []}
        });
        std::fs::write(dir.path().join("tokenizer.json"), spec.to_string()).expect("write");
        TextTokenizer::from_hf_dir(dir.path()).expect("tokenizer")
    })
}

/// `/tokenize` body's prompt through the handler's tokenising path: tokenise within the context, long
/// texts through the prefix probe.
pub fn tokenize_request(body: &[u8]) {
    let Ok(req) = parse_body::<serde_json::Value>(body) else {
        return;
    };
    let Some(prompt) = req.get("prompt").and_then(serde_json::Value::as_str) else {
        return;
    };
    // A small context, so that the prefix probe (16 bytes per token) is reached by short inputs.
    if let Ok(ids) = tokenizer().encode_within(prompt, 64) {
        assert!(ids.len() <= 64, "over the limit");
        assert!(ids.len() <= prompt.len(), "more tokens than bytes");
    }
}
