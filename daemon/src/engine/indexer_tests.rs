//! The indexer against small hand-checked cases; the key-pool variant against transformers'
//! `Glm5NextTextIndexer` on random inputs (`attention_layer` of tests/fixtures/glm5_next_indexer/oracle.json,
//! made by tests/fixtures/make_glm_indexer.py).
use super::*;

fn rel_l2(a: &[f32], b: &[f32]) -> f32 {
    let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f32 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

#[test]
fn top_k_keeps_the_best_ascending_with_ties_to_the_lower_index() {
    assert_eq!(top_k_ascending(&[0.1, 0.9, 0.5, 0.9, -1.0], 2), vec![1, 3]);
    assert_eq!(top_k_ascending(&[0.0, 0.0, 0.0, 1.0], 2), vec![0, 3]);
    assert_eq!(top_k_ascending(&[3.0, 1.0], 5), vec![0, 1]);
}

#[test]
fn layer_norm_matches_its_definition() {
    let mut x = vec![1.0, 2.0, 3.0, 6.0];
    layer_norm(&mut x, &[1.0, 2.0, 1.0, 1.0], &[0.0, 0.0, 1.0, 0.0], 0.0);
    // mean 3, variance 3.5
    let s = 3.5f32.sqrt();
    let want = [-2.0 / s, -2.0 / s, 1.0, 3.0 / s];
    for (a, b) in x.iter().zip(want) {
        assert!((a - b).abs() < 1e-6, "{x:?}");
    }
}

#[test]
fn selection_positions() {
    let s = Selection::from_lists(vec![None, Some(vec![0, 4, 5])]);
    assert_eq!(s.positions(0, 3).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    assert_eq!(s.positions(1, 5).collect::<Vec<_>>(), vec![0, 4, 5]);
    assert_eq!(Selection::all(2).positions(1, 1).count(), 2);
}

/// The key-pool variant (GLM-5.3-Flash) inside NoPE MLA against transformers' `Glm5NextTextAttention`
/// on random inputs: the oracle ran the whole sequence at once without a cache; here the same tokens
/// arrive in chunks (prefill pieces, then single decode tokens) through non-contiguous KV blocks, so
/// the indexer rows are read back from the blocks. Every query's selected positions must be equal and
/// the attention output within 1e-4 rel-L2 (f32 on both sides).
#[test]
fn key_pool_indexer_matches_transformers() {
    use crate::engine::attention::mla_forward;
    use crate::engine::kv::{LayerRows, BLOCK};
    use crate::engine::Segment;
    use crate::model::config::{IndexerLayer, LayerAttention, ModelConfig};
    use crate::model::{MlaAttention, MlaQuery, SparseAttention};
    use crate::weights::{HostData, HostTensor};
    use serde_json::{json, Value};

    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/glm5_next_indexer/oracle.json");
    let file: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    // The file's whole-model oracle is for tests/hybrid_tests.rs; this test reads its one-layer part.
    let o = &file["attention_layer"];
    let floats = |v: &Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    let tensor = |name: &str| -> HostTensor {
        let w = &o["weights"][name];
        HostTensor {
            shape: w["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect(),
            data: HostData::F32(floats(&w["data"])),
        }
    };
    let linear = |name: &str| Linear::new(tensor(&format!("{name}.weight")), None);
    let c = &o["config"];
    let u = |k: &str| c[k].as_u64().unwrap() as usize;
    // A GLM-5 config reshaped into GLM-5.3-Flash's attention: no RoPE, pooled indexer.
    let mut cfg = ModelConfig::from_json(&json!({
        "architectures": ["GlmMoeDsaForCausalLM"], "hidden_size": u("hidden_size"),
        "num_attention_heads": u("num_attention_heads"), "num_hidden_layers": 1, "vocab_size": 64,
        "q_lora_rank": u("q_lora_rank"), "kv_lora_rank": u("kv_lora_rank"),
        "qk_nope_head_dim": u("qk_nope_head_dim"), "qk_rope_head_dim": 2, "v_head_dim": u("v_head_dim"),
        "n_routed_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 8,
        "index_topk": u("index_topk"), "index_head_dim": u("index_head_dim"),
        "index_n_heads": u("index_n_heads"), "rms_norm_eps": 1e-6}))
    .unwrap();
    let pool = u("index_kpool");
    let mla = cfg.mla.as_mut().unwrap();
    mla.qk_rope_head_dim = 0;
    cfg.head_dim = mla.qk_nope_head_dim;
    let ix = cfg.indexer.as_mut().unwrap();
    ix.rope_dim = 0;
    ix.pooling = IndexerPooling::KeyPool { pool };
    assert_eq!(ix.layers, vec![IndexerLayer::Own]);
    let d = ix.head_dim;
    let attn = MlaAttention {
        q: MlaQuery::LowRank {
            a: linear("q_a_proj"),
            norm: tensor("q_a_layernorm.weight").to_f32(),
            b: linear("q_b_proj"),
        },
        kv_a: linear("kv_a_proj_with_mqa"),
        kv_a_norm: tensor("kv_a_layernorm.weight").to_f32(),
        kv_b: tensor("kv_b_proj.weight").to_f32(),
        o: linear("o_proj"),
        indexer: Some(SparseAttention::Own(Box::new(IndexerWeights {
            wq_b: linear("indexer.wq_b"),
            wk: linear("indexer.wk"),
            k_norm_weight: tensor("indexer.k_norm.weight").to_f32(),
            k_norm_bias: tensor("indexer.k_norm.bias").to_f32(),
            weights_proj: linear("indexer.weights_proj"),
            pool: Some(KeyPoolWeights {
                ape: tensor("indexer.index_kpool_compress_ape").to_f32(),
                gate: Linear::new(tensor("indexer.index_kpool_compress_gate"), None),
            }),
        }))),
    };
    let hidden = floats(&o["hidden"]);
    let want_out = floats(&o["output"]);
    let hs = cfg.hidden_size;
    let seq = hidden.len() / hs;
    let want_sel: Vec<Vec<usize>> = o["selected"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect()
        })
        .collect();
    assert_eq!(want_sel.len(), seq);
    let rope = Rope::new(&cfg.rope);
    let table: Vec<BlockId> = (0..seq.div_ceil(BLOCK) as BlockId)
        .rev()
        .map(|b| b * 2 + 1)
        .collect();
    let m = cfg.mla.as_ref().unwrap();
    let mut rows = LayerRows {
        a_width: m.kv_lora_rank,
        b_width: 0,
        c_width: 2 * d,
        ..Default::default()
    };
    let nope = LayerAttention {
        rope: false,
        window: None,
    };
    let (mut pos0, mut got_out, mut got_sel) = (0, vec![], vec![]);
    for len in [7, 9, 1, 1, 1, 1, 1, 1, 1] {
        let seg = Segment { row0: 0, len, pos0 };
        let mut selection = None;
        let out = mla_forward(
            &attn,
            &cfg,
            nope,
            &rope,
            &hidden[pos0 * hs..(pos0 + len) * hs],
            &[seg],
            &[&table],
            &mut rows,
            &mut selection,
        );
        let selection = selection.expect("an Own layer leaves its selection");
        for t in 0..len {
            got_sel.push(selection.positions(t, pos0 + t).collect::<Vec<_>>());
        }
        got_out.extend(out);
        pos0 += len;
    }
    assert_eq!(pos0, seq);
    for (p, (g, w)) in got_sel.iter().zip(&want_sel).enumerate() {
        assert_eq!(g, w, "query {p}");
    }
    assert!(
        want_sel.iter().any(|s| s.len() < s.last().unwrap() + 1),
        "the fixture must leave positions out"
    );
    for p in 0..seq {
        let e = rel_l2(
            &got_out[p * hs..(p + 1) * hs],
            &want_out[p * hs..(p + 1) * hs],
        );
        assert!(e < 1e-4, "query {p}: rel-L2 {e}");
    }
}
