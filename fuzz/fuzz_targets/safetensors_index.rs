//! `model.safetensors.index.json` holding the input, next to one valid shard: shard names must stay
//! inside the directory and every failure must be an error.
#![no_main]
use libfuzzer_sys::fuzz_target;
use moe_daemon::weights::safetensors::SafetensorsDir;

/// A valid one-tensor shard: header length, JSON header, 4 bytes of f32.
fn shard() -> Vec<u8> {
    let header = br#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend(header);
    b.extend(1f32.to_le_bytes());
    b
}

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("model.safetensors.index.json"), data).expect("write");
    std::fs::write(dir.path().join("a.safetensors"), shard()).expect("write");
    if let Ok(st) = SafetensorsDir::open(dir.path()) {
        let _ = st.names();
    }
});
