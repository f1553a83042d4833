//! GLM-5.3-Flash (linear attention, hyper-connections, key-pool indexer) and GLM-5 (per-token DSA
//! indexer) on the CUDA backend, against transformers' fixture logits and the CPU backend.
//!
//! Tolerances as `glm_mla_variants_on_cuda`: per-step rel-L2 ≤ 5e-2 against transformers (f32) and the
//! CPU backend, argmax equal where the oracle's top-1/top-2 gap exceeds 0.1. Runs of the same engine
//! that only regroup the work (chunked prefill, batching, a cache that starts over) agree to ≤ 2e-2:
//! only the GEMMs' row blocking differs.
use super::common::rel_l2;
use super::{fixtures, gpu, oracle, run, step};
use moe_daemon::engine::placement::PlacementStrategy;
use moe_daemon::engine::{Engine, EngineOptions, SeqInput};
use serde_json::Value;

/// GLM-5.3-Flash with every layer kind and 4 streams; its indexer fixture (29 tokens, top 8 positions
/// in pools of 4, a `shared` layer); GLM-5 (top 4 of 12+ tokens, roped indexer keys, a `shared` layer).
const HYBRID: &[&str] = &["glm5_next", "glm5_next_indexer", "glm_moe_dsa"];

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn check_against(name: &str, label: &str, got: &[Vec<f32>], cpu: &[Vec<f32>], o: &Value) {
    for (i, (g, s)) in got.iter().zip(o["steps"].as_array().unwrap()).enumerate() {
        let want: Vec<f32> = s["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let (err, err_cpu) = (rel_l2(g, &want), rel_l2(g, &cpu[i]));
        println!("{name} {label} step {i}: rel-L2 vs transformers {err:.2e}, vs CPU {err_cpu:.2e}");
        assert!(
            err <= 5e-2 && err_cpu <= 5e-2,
            "{name} {label} step {i}: {err} / {err_cpu}"
        );
        if s["top1_top2_gap"].as_f64().unwrap() > 0.1 {
            let am = moe_daemon::engine::sampling::argmax(g) as u64;
            assert_eq!(
                am,
                s["argmax"].as_u64().unwrap(),
                "{name} {label} step {i} argmax"
            );
        }
    }
}

/// Prefill then teacher-forced decode (the oracle's greedy tokens), experts all in DRAM and all on the
/// GPU, FP32 and BF16 checkpoints.
#[test]
fn glm_hybrid_models_on_cuda() {
    for name in HYBRID {
        let o = oracle(name);
        for variant in ["model_bf16", "model"] {
            let dir = fixtures().join(name).join(variant);
            let cpu = run(&Engine::load(&dir, &EngineOptions::default()).unwrap(), &o);
            for n_gpu in [0, 64] {
                let e = Engine::load(&dir, &gpu(n_gpu, PlacementStrategy::Uniform)).unwrap();
                let got = run(&e, &o);
                check_against(
                    name,
                    &format!("{variant} gpu_experts={n_gpu}"),
                    &got,
                    &cpu,
                    &o,
                );
            }
        }
    }
}

/// Chunked prefill (chunks of 1, 3 and the rest: the recurrence and convolution tail carried across
/// steps, indexer keys of earlier chunks), batching of sequences at different positions, and a cache that
/// starts over (its GPU state zeroed) give what one whole prefill gives.
#[test]
fn glm_hybrid_chunks_batches_and_restarts_on_cuda() {
    for name in HYBRID {
        let o = oracle(name);
        let dir = fixtures().join(name).join("model_bf16");
        let e = Engine::load(&dir, &gpu(0, PlacementStrategy::Uniform)).unwrap();
        let prompt = ids(&o["prompt_ids"]);
        let greedy = ids(&o["greedy_tokens"]);
        let whole = {
            let mut c = e.new_cache();
            step(&e, &mut c, &prompt)
        };
        // chunked: 1, 3, rest
        let mut c = e.new_cache();
        step(&e, &mut c, &prompt[..1]);
        step(&e, &mut c, &prompt[1..4]);
        let chunked = step(&e, &mut c, &prompt[4..]);
        let err = rel_l2(&chunked, &whole);
        println!("{name} chunked prefill vs whole: {err:.2e}");
        assert!(err <= 2e-2, "{name} chunked prefill: {err}");
        // decode after the chunked prefill continues the sequence
        let next = step(&e, &mut c, &greedy[..1]);
        let alone = run(&e, &o);
        let err = rel_l2(&next, &alone[1]);
        println!("{name} decode after chunked prefill: {err:.2e}");
        assert!(err <= 2e-2, "{name} decode after chunked prefill: {err}");
        // a cache that starts over (truncation clears a recurrent state) equals a fresh one
        c.truncate(0);
        let again = step(&e, &mut c, &prompt);
        let err = rel_l2(&again, &whole);
        println!("{name} restarted cache: {err:.2e}");
        assert!(err <= 2e-2, "{name} restarted cache: {err}");
        // batching: a sequence mid-prefill beside a decoding one, then both decoding
        let other: Vec<u32> = prompt.iter().rev().copied().collect();
        let other_alone = {
            let mut c = e.new_cache();
            vec![step(&e, &mut c, &other), step(&e, &mut c, &greedy[..1])]
        };
        let mut a = e.new_cache();
        let mut b = e.new_cache();
        step(&e, &mut a, &prompt);
        let out = e
            .reserve_and_forward(&mut [
                SeqInput {
                    cache: &mut a,
                    tokens: &greedy[..1],
                },
                SeqInput {
                    cache: &mut b,
                    tokens: &other,
                },
            ])
            .unwrap();
        let out2 = e
            .reserve_and_forward(&mut [
                SeqInput {
                    cache: &mut a,
                    tokens: &greedy[1..2],
                },
                SeqInput {
                    cache: &mut b,
                    tokens: &greedy[..1],
                },
            ])
            .unwrap();
        for (label, got, want) in [
            ("a decode 1", &out[0], &alone[1]),
            ("b prefill", &out[1], &other_alone[0]),
            ("a decode 2", &out2[0], &alone[2]),
            ("b decode 1", &out2[1], &other_alone[1]),
        ] {
            let err = rel_l2(got, want);
            println!("{name} batched {label}: {err:.2e}");
            assert!(err <= 2e-2, "{name} batched {label}: {err}");
        }
    }
}
