//! Files a checkpoint directory holds: safetensors headers and indexes, GGUF, config.json.
use moe_daemon::engine::rope::Rope;
use moe_daemon::model::ModelConfig;
use moe_daemon::weights::gguf::GgufFile;
use moe_daemon::weights::safetensors::SafetensorsDir;
use moe_daemon::weights::TensorSource;

/// A directory whose `model.safetensors` holds the input: open (header parse and checks) and load
/// every tensor it lists.
pub fn safetensors_header(data: &[u8]) {
    let dir = super::scratch_dir().join("header");
    std::fs::create_dir_all(&dir).expect("scratch dir");
    std::fs::write(dir.join("model.safetensors"), data).expect("write");
    let Ok(st) = SafetensorsDir::open(&dir) else {
        return;
    };
    for name in st.names() {
        let _ = st.info(&name);
        if let Ok(t) = st.load(&name) {
            let _ = t.to_f32();
        }
    }
}

/// A valid one-tensor shard: header length, JSON header, 4 bytes of f32.
fn one_tensor_shard() -> Vec<u8> {
    let header = br#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend(header);
    b.extend(1f32.to_le_bytes());
    b
}

/// `model.safetensors.index.json` holding the input, next to one valid shard: shard names must stay
/// inside the directory and every failure must be an error.
pub fn safetensors_index(data: &[u8]) {
    let dir = super::scratch_dir().join("index");
    if !dir.join("a.safetensors").exists() {
        std::fs::create_dir_all(&dir).expect("scratch dir");
        std::fs::write(dir.join("a.safetensors"), one_tensor_shard()).expect("write");
    }
    std::fs::write(dir.join("model.safetensors.index.json"), data).expect("write");
    if let Ok(st) = SafetensorsDir::open(&dir) {
        let _ = st.names();
    }
}

/// A GGUF file holding the input: header, metadata and tensor table parse, then every tensor
/// dequantised, the HF config derived and the tokenizer built from metadata.
pub fn gguf(data: &[u8]) {
    let path = super::scratch_dir().join("model.gguf");
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
}

/// config.json: parsing, bounds, and the rotary tables built from the parsed config.
pub fn config_json(data: &[u8]) {
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
}
