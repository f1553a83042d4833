//! Bad checkpoints give a clear error naming the file and tensor, never a panic.
use moe_daemon::engine::{Engine, EngineOptions};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
        .join("model")
}

/// A writable copy of a fixture checkpoint.
fn copy(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    dir
}

fn load_err(dir: &Path) -> String {
    match Engine::load(dir, &EngineOptions::default()) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, serde_json::to_string(&v).unwrap()).unwrap();
}

#[test]
fn truncated_file_names_the_file() {
    let d = copy("qwen3_moe");
    let st = d.path().join("model.safetensors");
    let len = std::fs::metadata(&st).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&st).unwrap();
    f.set_len(len - 100).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains("not a valid safetensors"),
        "{e}"
    );
}

#[test]
fn garbage_header_is_corrupt_not_panic() {
    let d = copy("qwen3_moe");
    std::fs::write(
        d.path().join("model.safetensors"),
        b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage",
    )
    .unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn missing_shard_from_index() {
    let d = copy("qwen3_moe");
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        r#"{"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("model-00001-of-00002.safetensors") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn shape_mismatch_names_tensor() {
    let d = copy("qwen3_moe");
    edit_config(d.path(), |v| v["intermediate_size"] = 100.into());
    let e = load_err(d.path());
    assert!(
        e.contains("model.layers.0.mlp.gate_proj.weight") && e.contains("shape"),
        "{e}"
    );
}

#[test]
fn missing_tensor_names_tensor() {
    let d = copy("mixtral");
    let layers = 2; // the fixture has layers 0 and 1; config now asks for a third
    edit_config(d.path(), |v| v["num_hidden_layers"] = (layers + 1).into());
    let e = load_err(d.path());
    assert!(
        e.contains("`model.layers.2.") && e.contains("not found"),
        "{e}"
    );
}

#[test]
fn unknown_architecture_lists_supported() {
    let d = copy("qwen3_moe");
    edit_config(d.path(), |v| {
        v["architectures"] = serde_json::json!(["GPT2LMHeadModel"])
    });
    let e = load_err(d.path());
    assert!(
        e.contains("GPT2LMHeadModel") && e.contains("DeepseekV3ForCausalLM"),
        "{e}"
    );
}

#[test]
fn missing_config_and_bad_json() {
    let d = copy("qwen3_moe");
    std::fs::write(d.path().join("config.json"), "{not json").unwrap();
    assert!(load_err(d.path()).contains("config.json"));
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    assert!(load_err(d.path()).contains("config.json"));
}

#[test]
fn sharded_checkpoint_loads_like_single_file() {
    // Split the fixture into two shards with an index, as hub checkpoints are stored.
    let src = fixture("glm4_moe");
    let d = copy("glm4_moe");
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_owned).collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (i, part) in [a, b].iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        let views: Vec<(String, safetensors::tensor::TensorView)> = part
            .iter()
            .map(|n| (n.clone(), st.tensor(n).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &d.path().join(&file)).unwrap();
        for n in part.iter() {
            map.insert(n.clone(), file.clone().into());
        }
    }
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let one = Engine::load(&src, &EngineOptions::default()).unwrap();
    let two = Engine::load(d.path(), &EngineOptions::default()).unwrap();
    let run = |e: &Engine| {
        let mut c = e.new_cache();
        e.reserve_and_forward(&mut [moe_daemon::engine::SeqInput {
            cache: &mut c,
            tokens: &[1, 2, 3],
        }])
        .unwrap()
    };
    assert_eq!(run(&one), run(&two));
}

#[test]
fn fifo_in_place_of_the_weights_is_an_error_not_a_hang() {
    let d = copy("qwen3_moe");
    let st = d.path().join("model.safetensors");
    std::fs::remove_file(&st).unwrap();
    let made = std::process::Command::new("mkfifo").arg(&st).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo failed");
    // Opening a FIFO for reading blocks until a writer appears: run the load on a thread and
    // give it a deadline so a regression fails instead of hanging the suite.
    let dir = d.path().to_owned();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(load_err(&dir));
    });
    let e = rx
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("loading a FIFO hung");
    assert!(
        e.contains("model.safetensors") && e.contains("not a regular file"),
        "{e}"
    );
}

#[test]
fn index_naming_a_shard_outside_the_model_dir_is_refused() {
    for shard in ["../../etc/passwd", "/etc/passwd", "sub/../../x.safetensors"] {
        let d = copy("qwen3_moe");
        std::fs::write(
            d.path().join("model.safetensors.index.json"),
            serde_json::json!({"weight_map": {"model.embed_tokens.weight": shard}}).to_string(),
        )
        .unwrap();
        let e = load_err(d.path());
        assert!(
            e.contains("model.safetensors.index.json") && e.contains("inside the model directory"),
            "{shard}: {e}"
        );
    }
}

#[test]
fn gguf_file_in_place_of_safetensors_says_so() {
    let d = copy("qwen3_moe");
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend([0u8; 16]);
    std::fs::write(d.path().join("model.safetensors"), bytes).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("not a valid safetensors file") && e.contains("GGUF"),
        "{e}"
    );
}

#[test]
fn nan_weight_is_refused_naming_the_tensor() {
    let src = fixture("qwen3_moe");
    let d = copy("qwen3_moe");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let target = "model.norm.weight";
    let mut owned: Vec<(String, Vec<u8>, safetensors::Dtype, Vec<usize>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.data().to_vec(), t.dtype(), t.shape().to_vec()))
        .collect();
    let (_, data, dtype, _) = owned.iter_mut().find(|(n, ..)| n == target).unwrap();
    // Element 1 becomes NaN in whatever float width the fixture stores.
    match dtype {
        safetensors::Dtype::F32 => data[4..8].copy_from_slice(&f32::NAN.to_le_bytes()),
        _ => data[2..4].copy_from_slice(&0x7fc0u16.to_le_bytes()),
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(n, data, dtype, shape)| {
            let v = safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap();
            (n.clone(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &d.path().join("model.safetensors")).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains(target) && e.contains("non-finite") && e.contains("element 1"),
        "{e}"
    );
}

#[test]
fn absurd_config_values_are_errors_not_aborts() {
    for (key, value) in [
        (
            "num_hidden_layers",
            serde_json::json!(1_000_000_000_000_000u64),
        ),
        ("head_dim", serde_json::json!(1u64 << 40)),
        ("head_dim", serde_json::json!(1u64 << 29)),
        ("rope_theta", serde_json::json!(0.0)),
    ] {
        let d = copy("qwen3_moe");
        edit_config(d.path(), |v| v[key] = value.clone());
        let e = load_err(d.path());
        assert!(e.contains(key), "{key}: {e}");
    }
}
