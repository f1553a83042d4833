//! A checkpoint directory whose `model.safetensors` holds the input: open (header parse and checks)
//! and load every tensor it lists.
#![no_main]
use libfuzzer_sys::fuzz_target;
use moe_daemon::weights::safetensors::SafetensorsDir;
use moe_daemon::weights::TensorSource;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("model.safetensors"), data).expect("write");
    let Ok(st) = SafetensorsDir::open(dir.path()) else {
        return;
    };
    for name in st.names() {
        let _ = st.info(&name);
        if let Ok(t) = st.load(&name) {
            let _ = t.to_f32();
        }
    }
});
