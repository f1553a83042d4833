//! A GGUF file holding the input: header, metadata and tensor table parse, then every tensor
//! dequantised, the HF config derived and the tokenizer built from metadata.
#![no_main]
use libfuzzer_sys::fuzz_target;
use moe_daemon::model::ModelConfig;
use moe_daemon::weights::gguf::GgufFile;
use moe_daemon::weights::TensorSource;
use std::sync::OnceLock;

/// One directory for the whole run: the file is rewritten per input (creating a directory per input
/// would halve the speed).
fn dir() -> &'static std::path::Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"))
        .path()
}

fuzz_target!(|data: &[u8]| {
    let path = dir().join("model.gguf");
    std::fs::write(&path, data).expect("write");
    let Ok(g) = GgufFile::open(&path) else {
        return;
    };
    let names: Vec<String> = g.tensors.keys().cloned().collect();
    for n in names {
        let _ = g.load_gguf(&n);
    }
    if let Ok(cfg) = g.hf_config() {
        if let Ok(cfg) = ModelConfig::from_json(&cfg) {
            for l in 0..cfg.num_layers.min(4) {
                let _ = g.load(&format!("model.layers.{l}.self_attn.q_proj.weight"));
                let _ = g.load(&format!("model.layers.{l}.self_attn.k_proj.weight"));
            }
        }
    }
    let _ = moe_daemon::text::TextTokenizer::from_gguf(&g);
});
