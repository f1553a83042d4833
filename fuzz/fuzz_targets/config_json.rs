//! config.json: parsing, bounds, and the rotary tables built from the parsed config.
#![no_main]
use libfuzzer_sys::fuzz_target;
use moe_daemon::engine::rope::Rope;
use moe_daemon::model::ModelConfig;

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let Ok(cfg) = ModelConfig::from_json(&v) else {
        return;
    };
    let rope = Rope::new(&cfg.rope);
    let (cos, sin) = rope.cos_sin(cfg.max_position_embeddings.saturating_sub(1));
    assert_eq!(cos.len(), sin.len());
    let _ = cfg.attention_scale();
});
