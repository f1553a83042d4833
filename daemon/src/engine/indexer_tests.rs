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
    use crate::engine::cpu::attention::mla_forward;
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

/// The indexer as it was before pooled keys were kept: every step pools every complete pool of each
/// sequence again from the keys and gate logits of its positions (which this reference keeps in rows of
/// its own). The reference `select_incremental_pools_matches_recomputing_every_step` compares against.
#[allow(clippy::too_many_arguments)]
fn select_recomputing_pools(
    w: &IndexerWeights,
    cfg: &IndexerConfig,
    h: &[f32],
    q_resid: &[f32],
    segments: &[Segment],
    tables: &[&[BlockId]],
    rows: &mut LayerRows,
) -> (Selection, Vec<Vec<f32>>) {
    let IndexerPooling::KeyPool { pool } = cfg.pooling else {
        unreachable!("a key-pool config")
    };
    let pw = w.pool.as_ref().unwrap();
    let n = segments.iter().map(|s| s.len).sum::<usize>();
    let (nh, d) = (cfg.n_heads, cfg.head_dim);
    let q = w.wq_b.forward(q_resid, n);
    let mut k = w.wk.forward(h, n);
    let mut weights = w.weights_proj.forward(h, n);
    let head_weight = (nh as f32).powf(-0.5);
    weights.iter_mut().for_each(|x| *x *= head_weight);
    let gate = pw.gate.forward(h, n);
    let mut row = vec![0f32; 2 * d];
    for (seg, table) in segments.iter().zip(tables) {
        for i in 0..seg.len {
            let (t, pos) = (seg.row0 + i, seg.pos0 + i);
            let kt = &mut k[t * d..(t + 1) * d];
            layer_norm(kt, &w.k_norm_weight, &w.k_norm_bias, K_NORM_EPS);
            row[..d].copy_from_slice(kt);
            row[d..].copy_from_slice(&gate[t * d..(t + 1) * d]);
            rows.write_c(slot(table, pos), &row);
        }
    }
    let scale = (d as f32).powf(-0.5);
    let score = |t: usize, key: &[f32]| -> f32 {
        (0..nh)
            .map(|hh| {
                let s = dot(&q[(t * nh + hh) * d..(t * nh + hh + 1) * d], key) * scale;
                weights[t * nh + hh] * s.max(0.0)
            })
            .sum()
    };
    let (mut out, mut all_keys) = (Vec::new(), Vec::new());
    for (seg, table) in segments.iter().zip(tables) {
        let pools = (seg.pos0 + seg.len) / pool;
        let mut keys = vec![0f32; pools * d];
        for (j, key) in keys.chunks_mut(d).enumerate() {
            let slots: Vec<&[f32]> = (0..pool)
                .map(|i| rows.c_row(slot(table, j * pool + i)))
                .collect();
            let mut logits = vec![0f32; pool];
            for (c, o) in key.iter_mut().enumerate() {
                for (i, r) in slots.iter().enumerate() {
                    logits[i] = r[d + c] + pw.ape[i * d + c];
                }
                crate::engine::ops::softmax(&mut logits);
                *o = slots.iter().zip(&logits).map(|(r, p)| p * r[c]).sum();
            }
        }
        for i in 0..seg.len {
            let (t, pos) = (seg.row0 + i, seg.pos0 + i);
            let visible = (pos + 1) / pool;
            let scores: Vec<f32> = keys[..visible * d].chunks(d).map(|k| score(t, k)).collect();
            let chosen = top_k_ascending(&scores, (cfg.topk / pool).min(visible));
            let mut list: Vec<u32> = chosen
                .iter()
                .flat_map(|&j| j as usize * pool..(j as usize + 1) * pool)
                .map(|p| p as u32)
                .collect();
            list.extend((visible * pool..=pos).map(|p| p as u32));
            out.push(Some(list));
        }
        all_keys.push(keys);
    }
    (Selection::from_lists(out), all_keys)
}

/// Pooled keys kept per sequence (computed once, when a pool completes, and stored in the pool's last
/// slot) select exactly what recomputing every pool at every step selected, and the kept keys are
/// bit-identical to the recomputed ones: two sequences through non-contiguous blocks, prefill chunks
/// that end inside and on pool boundaries, a step holding a chunk of one and a decode token of the
/// other, then decode steps past the top-k budget (so the selection really chooses).
#[test]
fn select_incremental_pools_matches_recomputing_every_step() {
    use crate::engine::kv::BLOCK;
    use crate::model::config::IndexerLayer;
    use crate::weights::{HostData, HostTensor};
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut uni = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let (hidden, q_lora, nh, d, pool) = (24usize, 16usize, 4usize, 8usize, 4usize);
    let mut linear = |out: usize, inp: usize| {
        Linear::new(
            HostTensor {
                shape: vec![out, inp],
                data: HostData::F32((0..out * inp).map(|_| uni()).collect()),
            },
            None,
        )
    };
    let w = IndexerWeights {
        wq_b: linear(nh * d, q_lora),
        wk: linear(d, hidden),
        k_norm_weight: vec![1.0; d],
        k_norm_bias: vec![0.0; d],
        weights_proj: linear(nh, hidden),
        pool: Some(KeyPoolWeights {
            ape: (0..pool * d).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect(),
            gate: linear(d, hidden),
        }),
    };
    let cfg = IndexerConfig {
        n_heads: nh,
        head_dim: d,
        topk: 3 * pool,
        rope_dim: 0,
        pooling: IndexerPooling::KeyPool { pool },
        layers: vec![IndexerLayer::Own],
    };
    // no rotation (rope_dim 0): the rope is never applied
    let rope = Rope::new(&crate::model::config::RopeConfig {
        theta: 10000.0,
        rotary_dim: 2,
        style: crate::model::config::RopeStyle::Neox,
        scaling: crate::model::config::RopeScaling::None,
    });
    let tables: [Vec<BlockId>; 2] = [vec![5, 1, 3, 8], vec![2, 7, 0, 4]];
    // (rows grow with the latent `a`, so it needs a width)
    let new_rows = || LayerRows {
        a_width: 1,
        c_width: cfg.row_width(),
        ..Default::default()
    };
    let (mut kept, mut recomputed) = (new_rows(), new_rows());
    let mut pos = [0usize; 2];
    // (tokens of sequence 0, tokens of sequence 1) per step
    let steps: Vec<(usize, usize)> = [(6, 0), (0, 9), (2, 1), (5, 3), (1, 4)]
        .into_iter()
        .chain(std::iter::repeat_n((1, 1), 30))
        .collect();
    let mut compared = 0;
    for (a, b) in steps {
        let mut segments = Vec::new();
        let mut seg_tables: Vec<&[BlockId]> = Vec::new();
        for (s, len) in [(0, a), (1, b)] {
            if len > 0 {
                let row0 = segments.iter().map(|g: &Segment| g.len).sum();
                segments.push(Segment {
                    row0,
                    len,
                    pos0: pos[s],
                });
                seg_tables.push(&tables[s]);
            }
        }
        let n = a + b;
        let h: Vec<f32> = (0..n * hidden).map(|_| uni()).collect();
        let q_resid: Vec<f32> = (0..n * q_lora).map(|_| uni()).collect();
        let got = select(
            &w,
            &cfg,
            &rope,
            &h,
            &q_resid,
            &segments,
            &seg_tables,
            &mut kept,
        );
        let (want, keys) = select_recomputing_pools(
            &w,
            &cfg,
            &h,
            &q_resid,
            &segments,
            &seg_tables,
            &mut recomputed,
        );
        assert_eq!(got, want, "selection at positions {pos:?}");
        for (seg, (table, keys)) in segments.iter().zip(seg_tables.iter().zip(&keys)) {
            for (j, key) in keys.chunks(d).enumerate() {
                let at = slot(table, j * pool + pool - 1);
                let kept_key = &kept.c_row(at)[d..2 * d];
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(kept_key), bits(key), "pool {j} at {}", seg.pos0);
            }
        }
        compared += got.len();
        pos[0] += a;
        pos[1] += b;
    }
    assert!(pos.iter().all(|&p| p > 3 * pool + pool && p < 4 * BLOCK));
    assert!(compared > 60);
}
