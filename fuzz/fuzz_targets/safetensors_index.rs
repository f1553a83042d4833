//! `model.safetensors.index.json` holding the input, next to one valid shard: shard names must stay
//! inside the directory and every failure must be an error.
#![no_main]
use libfuzzer_sys::fuzz_target;
use moe_daemon::weights::safetensors::SafetensorsDir;
use std::sync::OnceLock;

/// A valid one-tensor shard: header length, JSON header, 4 bytes of f32.
fn shard() -> Vec<u8> {
    let header = br#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend(header);
    b.extend(1f32.to_le_bytes());
    b
}

/// One directory for the whole run, holding the shard; the index is rewritten per input.
fn dir() -> &'static std::path::Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    let d = DIR
        .get_or_init(|| tempfile::tempdir().expect("temp dir"))
        .path();
    if !d.join("a.safetensors").exists() {
        std::fs::write(d.join("a.safetensors"), shard()).expect("write");
    }
    d
}

fuzz_target!(|data: &[u8]| {
    std::fs::write(dir().join("model.safetensors.index.json"), data).expect("write");
    if let Ok(st) = SafetensorsDir::open(dir()) {
        let _ = st.names();
    }
});
