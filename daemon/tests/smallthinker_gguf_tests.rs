//! SmallThinker from GGUF: tests/fixtures/smallthinker/model.gguf was written by the `gguf` PyPI package
//! from the safetensors fixture the way llama.cpp's converter writes SmallThinker files
//! (tests/fixtures/make_smallthinker_gguf.py: its metadata, its tensor-name map, experts stacked per
//! layer, the tied lm_head left out). Loaded through the GGUF reader it must give the safetensors
//! fixture's logits (rel-L2 ≤ 1e-6: F32 weights both, summation order only) at the prefill and at decode
//! steps past the 5-position window, and the model repository's own logits from oracle.json at the
//! fixture's tolerance (1e-3).
mod common;

use common::rel_l2;
use moe_daemon::engine::{Engine, EngineOptions, SeqInput};
use moe_daemon::weights::gguf::GgufFile;

fn run(e: &Engine, prompt: &[u32], steps: &[u32]) -> Vec<Vec<f32>> {
    let mut c = e.new_cache();
    let mut out = vec![];
    let mut feed = |tokens: &[u32]| {
        let mut batch = [SeqInput {
            cache: &mut c,
            tokens,
        }];
        out.push(e.reserve_and_forward(&mut batch).unwrap().remove(0));
    };
    feed(prompt);
    for t in steps {
        feed(std::slice::from_ref(t));
    }
    out
}

#[test]
fn smallthinker_gguf_matches_safetensors_and_the_reference() {
    let root = common::fixtures_root().join("smallthinker");
    let g = GgufFile::open(&root.join("model.gguf")).unwrap();
    let cfg = g.hf_config().unwrap();
    assert_eq!(cfg["architectures"][0], "SmallThinkerForCausalLM");
    assert_eq!(cfg["rope_layout"], serde_json::json!([0, 1, 1, 1]));
    assert_eq!(
        cfg["sliding_window_layout"],
        serde_json::json!([0, 1, 1, 1])
    );
    assert_eq!(cfg["tie_word_embeddings"], true);
    // Expert kernels capped at the f32-activation tier: exact arithmetic, as the fixture tests run.
    let mut opts = EngineOptions::default();
    opts.cpu_moe.max_tier = Some(moe_kernels::cpu::CpuTier::Avx2);
    let from_gguf = Engine::from_source(&cfg, &g, &opts).unwrap();
    let from_st = Engine::load(&root.join("model"), &opts).unwrap();
    let oracle: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("oracle.json")).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let prompt = ids(&oracle["prompt_ids"]);
    let greedy = ids(&oracle["greedy_tokens"]);
    let got = run(&from_gguf, &prompt, &greedy);
    let want = run(&from_st, &prompt, &greedy);
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        let err = rel_l2(a, b);
        assert!(err <= 1e-6, "step {i}: GGUF vs safetensors rel-L2 {err}");
    }
    for (i, step) in oracle["steps"].as_array().unwrap().iter().enumerate() {
        let reference: Vec<f32> = step["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let err = rel_l2(&got[i], &reference);
        assert!(err <= 1e-3, "step {i}: GGUF vs the model's own code {err}");
    }
}
