//! GLM-5.3-Flash (hybrid linear / sparse attention, hyper-connections) beyond the fixture comparison in
//! fixture_tests.rs: the scheduler drives the real CPU engine on a KV cache too small for the load
//! (chunked prefill, batching, preemption: the linear-attention state is dropped and recomputed), and
//! every output equals the same request alone (tokens exactly, log-probabilities within 1e-4, the CPU
//! backend's batch-versus-alone difference); prefix reuse stays off for such models. The
//! `glm5_next_indexer` fixture (prompt of 29 tokens, index_topk 8) checks the key-pool indexer in the
//! whole model against transformers.
mod common;

use common::{exact_cpu, floats, ids, kv_pressure, prefill_all, rel_l2, step};
use moe_daemon::engine::Engine;

/// glm5_next attends every key (its prompts stay within index_topk 64); glm5_next_indexer (index_topk 8)
/// selects pools, so preempted sequences also recompute their indexer keys.
#[test]
fn preempted_chunked_and_batched_sequences_match_their_runs_alone() {
    for fixture in ["glm5_next", "glm5_next_indexer"] {
        let dir = common::fixtures_root().join(fixture).join("model");
        let (alone, pressured, metrics) = kv_pressure::run(&dir, &exact_cpu(), 512);
        for (i, (a, b)) in alone.iter().zip(&pressured).enumerate() {
            assert_eq!(
                a.0, b.0,
                "{fixture} request {i}: tokens differ from the run alone"
            );
            for (x, y) in a.1.iter().zip(&b.1) {
                assert!(
                    (x - y).abs() <= 1e-4,
                    "{fixture} request {i}: logprob {y} vs {x} alone"
                );
            }
        }
        assert!(
            metrics.preemptions.get() > 0,
            "{fixture}: no preemption: the cache was not under pressure"
        );
        assert_eq!(
            metrics.prefix_cache_hit_tokens.get(),
            0,
            "{fixture}: a recurrent-state model must not reuse prefixes"
        );
    }
}

#[test]
fn prompt_split_into_chunks_equals_whole_prefill() {
    let dir = common::fixtures_root().join("glm5_next/model");
    let engine = Engine::load(&dir, &exact_cpu()).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 512).collect();
    let mut whole = engine.new_cache();
    let want = step(&engine, &mut whole, &prompt);
    // Chunks of 1 (the recurrent form), 3 and longer ones (the chunked form), from a carried state.
    let mut split = engine.new_cache();
    let mut got = vec![];
    for r in [0..1, 1..4, 4..5, 5..23, 23..40] {
        got = step(&engine, &mut split, &prompt[r]);
    }
    let e = rel_l2(&got, &want);
    assert!(e < 1e-5, "chunked prefill differs: rel-L2 {e}");
    // The next token from both caches agrees too (the states are the same).
    let next = |c: &mut moe_daemon::engine::SeqCache| step(&engine, c, &[7]);
    let e = rel_l2(&next(&mut split), &next(&mut whole));
    assert!(e < 1e-5, "decode after chunked prefill differs: rel-L2 {e}");
}

/// The key-pool indexer in the whole model against transformers: a prompt of 29 tokens with index_topk 8
/// (pools of 4: most keys are left out), a layer sharing the previous layer's selection. Compared: the
/// logits at every prompt position of one prefill (`prefill_all_logits`), then transformers' cached run
/// step by step as the engine runs it (`steps`: the prefill's last position and 4 single-token decode
/// steps). rel-L2 within 1e-4 (f32 on both sides; measured ~1e-6) and the same argmax per step. The
/// fixture's seed has no near-tie at any indexer top-k boundary (gap ≥ 1e-3), so the selection is not
/// left to tie-breaking; transformers' cached and uncached runs agree to 5e-6 on it (`checks`).
#[test]
fn indexer_fixture_matches_transformers() {
    let root = common::fixtures_root().join("glm5_next_indexer");
    let o = common::oracle("glm5_next_indexer");
    let prompt = ids(&o["prompt_ids"]);
    let engine = Engine::load(&root.join("model"), &exact_cpu()).unwrap();
    let mut cache = engine.new_cache();
    let all = prefill_all(&engine, &mut cache, &prompt);
    let want_all = o["prefill_all_logits"].as_array().unwrap();
    assert_eq!(all.len(), want_all.len());
    for (p, (got, want)) in all.iter().zip(want_all).enumerate() {
        let e = rel_l2(got, &floats(want));
        assert!(e <= 1e-4, "prompt position {p}: rel-L2 {e}");
    }
    let mut cache = engine.new_cache();
    let mut tokens = prompt.clone();
    for (i, s) in o["steps"].as_array().unwrap().iter().enumerate() {
        let want = floats(&s["logits"]);
        let got = step(&engine, &mut cache, &tokens);
        let e = rel_l2(&got, &want);
        println!("glm5_next_indexer step {i}: rel-L2 {e:.2e}");
        assert!(e <= 1e-4, "step {i}: rel-L2 {e}");
        let argmax = s["argmax"].as_u64().unwrap() as u32;
        assert_eq!(
            moe_daemon::engine::sampling::argmax(&got) as u32,
            argmax,
            "step {i}"
        );
        tokens = vec![argmax];
    }
}
