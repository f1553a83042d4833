//! A checkpoint directory whose `model.safetensors` holds the input: open (header parse and checks)
//! and load every tensor it lists.
#![no_main]
use libfuzzer_sys::fuzz_target;
use moe_daemon::weights::safetensors::SafetensorsDir;
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
    std::fs::write(dir().join("model.safetensors"), data).expect("write");
    let Ok(st) = SafetensorsDir::open(dir()) else {
        return;
    };
    for name in st.names() {
        let _ = st.info(&name);
        if let Ok(t) = st.load(&name) {
            let _ = t.to_f32();
        }
    }
});
