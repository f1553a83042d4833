//! The committed safetensors fixtures rewritten as GGUF files the way llama.cpp's converter lays
//! them out (merged experts, GGUF names and metadata), then run through the engine against the
//! safetensors checkpoint of the same weights.
use super::super::gguf::tests::write_gguf;
use super::super::gguf::{GgmlType, GgufFile, GgufValue};
use super::super::safetensors::SafetensorsDir;
use super::super::TensorSource;
use super::*;
use crate::engine::{Engine, EngineOptions, SeqInput};
use std::collections::BTreeMap;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../tests/fixtures/{name}/model"))
}

/// llama.cpp's `quantize_row_q8_0_ref`.
fn q8_0(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in v.chunks(32) {
        let amax = b.iter().fold(0f32, |a, x| a.max(x.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(half::f16::from_f32(d).to_le_bytes());
        out.extend(b.iter().map(|x| (x * id).round() as i8 as u8));
    }
    out
}

type ShapedValues = (Vec<usize>, Vec<f32>);

/// (GGUF name, dims innermost first, values) of every fixture tensor, experts merged per layer.
fn gguf_tensors(arch: &str, st: &SafetensorsDir) -> Vec<(String, Vec<u64>, Vec<f32>)> {
    let mut merged: BTreeMap<String, BTreeMap<usize, ShapedValues>> = BTreeMap::new();
    let mut out = Vec::new();
    for hf in st.names() {
        let t = st.load(&hf).unwrap();
        let fixed = match hf.as_str() {
            "model.embed_tokens.weight" => Some("token_embd.weight".to_string()),
            "model.norm.weight" => Some("output_norm.weight".to_string()),
            "lm_head.weight" => Some("output.weight".to_string()),
            _ => None,
        };
        let r = match fixed {
            Some(name) => GgufRef::plain(name),
            None => tensor_ref(arch, &hf).unwrap_or_else(|| panic!("no GGUF name for {hf}")),
        };
        match r.expert {
            Some(e) => {
                merged
                    .entry(r.name)
                    .or_default()
                    .insert(e, (t.shape.clone(), t.to_f32()));
            }
            None => out.push((
                r.name,
                t.shape.iter().rev().map(|&d| d as u64).collect(),
                t.to_f32(),
            )),
        }
    }
    for (name, experts) in merged {
        let shape = experts[&0].0.clone();
        let mut dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        dims.push(experts.len() as u64);
        let data = experts.into_values().flat_map(|(_, v)| v).collect();
        out.push((name, dims, data));
    }
    out
}

/// How the projections and experts are stored in the written file.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Storage {
    F32,
    Q8_0,
    /// F32 holding exactly the values the Q8_0 file decodes to.
    F32OfQ8_0,
}

fn write_fixture_gguf(name: &str, arch: &str, storage: Storage) -> PathBuf {
    let dir = fixture(name);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let st = SafetensorsDir::open(&dir).unwrap();
    let u = |k: &str| GgufValue::U64(cfg[k].as_u64().unwrap());
    let f = |k: &str| GgufValue::F64(cfg[k].as_f64().unwrap());
    let key = |k: &str| format!("{arch}.{k}");
    let mut meta: Vec<(String, GgufValue)> = vec![
        ("general.architecture".into(), GgufValue::Str(arch.into())),
        (key("block_count"), u("num_hidden_layers")),
        (key("embedding_length"), u("hidden_size")),
        (key("feed_forward_length"), u("intermediate_size")),
        (
            key("expert_feed_forward_length"),
            u("moe_intermediate_size"),
        ),
        (key("attention.head_count"), u("num_attention_heads")),
        (key("attention.head_count_kv"), u("num_key_value_heads")),
        (key("expert_used_count"), u("num_experts_per_tok")),
        (key("attention.layer_norm_rms_epsilon"), f("rms_norm_eps")),
        (key("rope.freq_base"), f("rope_theta")),
        (key("vocab_size"), u("vocab_size")),
        (key("context_length"), u("max_position_embeddings")),
    ];
    if cfg.get("head_dim").is_some() {
        meta.push((key("attention.key_length"), u("head_dim")));
    }
    if arch == "qwen3moe" {
        meta.push((key("expert_count"), u("num_experts")));
    } else if arch == "deepseek2" {
        let rs = &cfg["rope_scaling"];
        let qk =
            cfg["qk_nope_head_dim"].as_u64().unwrap() + cfg["qk_rope_head_dim"].as_u64().unwrap();
        meta.extend([
            (key("expert_count"), u("n_routed_experts")),
            (key("expert_shared_count"), u("n_shared_experts")),
            (key("leading_dense_block_count"), u("first_k_dense_replace")),
            (key("expert_weights_scale"), f("routed_scaling_factor")),
            (key("expert_group_count"), u("n_group")),
            (key("expert_group_used_count"), u("topk_group")),
            (key("expert_gating_func"), GgufValue::U64(2)),
            (key("attention.q_lora_rank"), u("q_lora_rank")),
            (key("attention.kv_lora_rank"), u("kv_lora_rank")),
            (key("attention.key_length"), GgufValue::U64(qk)),
            (key("attention.value_length"), u("v_head_dim")),
            (key("rope.dimension_count"), u("qk_rope_head_dim")),
            (key("rope.scaling.type"), GgufValue::Str("yarn".into())),
            (
                key("rope.scaling.factor"),
                GgufValue::F64(rs["factor"].as_f64().unwrap()),
            ),
            (
                key("rope.scaling.original_context_length"),
                GgufValue::U64(rs["original_max_position_embeddings"].as_u64().unwrap()),
            ),
            (
                key("rope.scaling.yarn_log_multiplier"),
                GgufValue::F64(0.1 * rs["mscale_all_dim"].as_f64().unwrap()),
            ),
        ]);
    } else {
        let rot = (cfg["head_dim"].as_f64().unwrap()
            * cfg["partial_rotary_factor"].as_f64().unwrap()) as u64;
        meta.extend([
            (key("expert_count"), u("n_routed_experts")),
            (key("expert_shared_count"), u("n_shared_experts")),
            (key("leading_dense_block_count"), u("first_k_dense_replace")),
            (key("expert_weights_scale"), f("routed_scaling_factor")),
            (key("rope.dimension_count"), GgufValue::U64(rot)),
        ]);
    }
    let tensors: Vec<(String, u32, Vec<u64>, Vec<u8>)> = gguf_tensors(arch, &st)
        .into_iter()
        .map(|(n, dims, v)| {
            // Projections and experts as Q8_0 (llama.cpp keeps norms, routers and biases in F32).
            let quant = dims.len() >= 2 && dims[0] % 32 == 0 && !n.contains("gate_inp");
            let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect();
            match storage {
                Storage::Q8_0 if quant => (n, 8, dims, q8_0(&v)),
                Storage::F32OfQ8_0 if quant => {
                    let exact = crate::weights::gguf_quant::dequantize(GgmlType::Q8_0, &q8_0(&v));
                    (n, 0, dims, f32s(&exact))
                }
                _ => (n, 0, dims, f32s(&v)),
            }
        })
        .collect();
    let meta_refs: Vec<(&str, GgufValue)> =
        meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let t_refs: Vec<(&str, u32, Vec<u64>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, ty, d, b)| (n.as_str(), *ty, d.clone(), b.clone()))
        .collect();
    let path = std::env::temp_dir().join(format!(
        "moe-gguf-arch-{name}-{storage:?}-{}.gguf",
        std::process::id()
    ));
    std::fs::write(&path, write_gguf(&meta_refs, &t_refs)).unwrap();
    path
}

fn logits(e: &Engine, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut c = e.new_cache();
    let mut out = vec![e
        .reserve_and_forward(&mut [SeqInput {
            cache: &mut c,
            tokens: prompt,
        }])
        .unwrap()
        .remove(0)];
    for t in [7u32, 99, 3] {
        out.push(
            e.reserve_and_forward(&mut [SeqInput {
                cache: &mut c,
                tokens: &[t],
            }])
            .unwrap()
            .remove(0),
        );
    }
    out
}

fn rel_l2(a: &[f32], b: &[f32]) -> f32 {
    let n: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let d: f32 = b.iter().map(|y| y * y).sum();
    (n / d.max(1e-30)).sqrt()
}

fn engine(path: &std::path::Path, opts: &EngineOptions) -> Engine {
    let g = GgufFile::open(path).unwrap();
    let cfg = g.hf_config().unwrap();
    Engine::from_source(&cfg, &g, opts).unwrap()
}

/// F32 GGUF: the same weights through another file format give the same logits (1e-6: summation
/// order only). Q8_0 GGUF (what llama.cpp users have): the same logits as an F32 file holding the
/// values those blocks decode to, run on the f32 reference path (1e-5 with the kernels capped at the
/// f32-activation tier: the blocks are repacked losslessly for experts and dense layers alike; f32 KV
/// rows on both sides, since rounding the cache to f16 turns summation-order differences into
/// occasional 1-ulp flips of f16 values, ~5e-5 in the logits).
fn check(name: &str, arch: &str) {
    let prompt: Vec<u32> = (0..11).map(|i| (i * 37 + 5) % 500).collect();
    let st = Engine::load(&fixture(name), &EngineOptions::default()).unwrap();
    let write = |s| write_fixture_gguf(name, arch, s);
    let compare = |got: Vec<Vec<f32>>, want: &[Vec<f32>], tol: f32, what: &str| {
        for (s, (a, b)) in got.iter().zip(want).enumerate() {
            let err = rel_l2(a, b);
            assert!(err <= tol, "{name} {what} step {s}: rel L2 {err}");
        }
    };
    let f32_file = write(Storage::F32);
    let got = logits(&engine(&f32_file, &EngineOptions::default()), &prompt);
    compare(got, &logits(&st, &prompt), 1e-6, "F32 GGUF vs safetensors");
    let mut exact = EngineOptions::default();
    exact.cpu_moe.max_tier = Some(moe_kernels::cpu::CpuTier::Avx2);
    exact.cpu_kv_dtype = Some(crate::engine::kv::KvDtype::F32);
    let (q8, q8_f32) = (write(Storage::Q8_0), write(Storage::F32OfQ8_0));
    let got = logits(&engine(&q8, &exact), &prompt);
    // The reference side on the f32 reference path: the kernels would round f32 experts to bf16.
    let reference = EngineOptions {
        cpu_kernels: false,
        cpu_kv_dtype: exact.cpu_kv_dtype,
        ..Default::default()
    };
    let want = logits(&engine(&q8_f32, &reference), &prompt);
    compare(got, &want, 1e-5, "Q8_0 GGUF vs its values in F32");
    for p in [f32_file, q8, q8_f32] {
        std::fs::remove_file(p).ok();
    }
}

#[test]
fn qwen3moe_gguf_matches_safetensors() {
    check("qwen3_moe", "qwen3moe");
}

#[test]
fn deepseek2_gguf_matches_safetensors() {
    check("deepseek_v3", "deepseek2");
}

#[test]
fn glm4moe_gguf_matches_safetensors() {
    check("glm4_moe", "glm4moe");
}

/// SmallThinker metadata without a sliding window and with the softmax router (the 21B file has a
/// window and sigmoid; the fixture GGUF in daemon/tests covers that): every layer RoPE and full
/// attention, as llama.cpp's loader makes it, and a config the engine accepts.
#[test]
fn smallthinker_without_window_is_all_rope_full_attention() {
    let key = |k: &str| format!("smallthinker.{k}");
    let meta: Vec<(String, GgufValue)> = vec![
        (
            "general.architecture".into(),
            GgufValue::Str("smallthinker".into()),
        ),
        (key("block_count"), GgufValue::U64(6)),
        (key("embedding_length"), GgufValue::U64(64)),
        (key("attention.head_count"), GgufValue::U64(4)),
        (key("attention.head_count_kv"), GgufValue::U64(2)),
        (key("attention.key_length"), GgufValue::U64(16)),
        (key("expert_count"), GgufValue::U64(8)),
        (key("expert_used_count"), GgufValue::U64(2)),
        (key("expert_feed_forward_length"), GgufValue::U64(32)),
        (key("expert_gating_func"), GgufValue::U64(1)),
        (key("vocab_size"), GgufValue::U64(128)),
    ];
    let meta_refs: Vec<(&str, GgufValue)> =
        meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let path = std::env::temp_dir().join(format!("moe-st-meta-{}.gguf", std::process::id()));
    std::fs::write(&path, write_gguf(&meta_refs, &[])).unwrap();
    let cfg = GgufFile::open(&path).unwrap().hf_config().unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(cfg["rope_layout"], serde_json::json!([1, 1, 1, 1, 1, 1]));
    assert_eq!(
        cfg["sliding_window_layout"],
        serde_json::json!([0, 0, 0, 0, 0, 0])
    );
    assert_eq!(cfg["moe_primary_router_apply_softmax"], true);
    let c = crate::model::ModelConfig::from_json(&cfg).unwrap();
    assert_eq!(c.arch, crate::model::config::Arch::SmallThinker);
    assert_eq!(c.activation, crate::model::config::Activation::Relu);
    assert!(c
        .layer_attention
        .iter()
        .all(|a| a.rope && a.window.is_none()));
    assert_eq!(
        tensor_ref(
            "smallthinker",
            "model.layers.3.block_sparse_moe.experts.5.down.weight"
        ),
        Some(GgufRef {
            name: "blk.3.ffn_down_exps.weight".into(),
            permute: None,
            expert: Some(5)
        })
    );
}
