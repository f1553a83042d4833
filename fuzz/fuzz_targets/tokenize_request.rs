//! `/tokenize` body through the same path as the handler: parse, then tokenise within the context,
//! long texts through the prefix probe (a small byte-level BPE tokenizer with a special token).
#![no_main]
use libfuzzer_sys::fuzz_target;
use moe_daemon::api::types::parse_body;
use moe_daemon::api::TokenizeRequest;
use moe_daemon::text::TextTokenizer;
use std::sync::OnceLock;

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

fuzz_target!(|body: &[u8]| {
    let Ok(req) = parse_body::<TokenizeRequest>(body) else {
        return;
    };
    // A small context, so that the prefix probe (16 bytes per token) is reached by short inputs.
    if let Ok(ids) = tokenizer().encode_within(&req.prompt, 64) {
        assert!(ids.len() <= 64, "over the limit");
        assert!(ids.len() <= req.prompt.len(), "more tokens than bytes");
    }
});
