//! SmallThinker beyond the architecture itself.
//!
//! Sliding-window layers' KV (fixture: one full layer, three with a 5-position window): giving back the
//! blocks that left the window changes no output, and a long sequence holds only the window in those
//! layers.
//!
//! GGUF input: tests/fixtures/smallthinker/model.gguf was written by the `gguf` PyPI package from the
//! safetensors fixture the way llama.cpp's converter writes SmallThinker files
//! (tests/fixtures/make_smallthinker_gguf.py: its metadata, its tensor-name map, experts stacked per
//! layer, the tied lm_head left out). Loaded through the GGUF reader it must give the safetensors
//! fixture's logits (rel-L2 ≤ 1e-6: F32 weights both, summation order only) at the prefill and at decode
//! steps past the window, and the model repository's own logits from oracle.json at the fixture
//! tolerance (1e-3).
mod common;

use common::sliding::{engine, model_dir, run, DECODE, PROMPT};
use common::{exact_cpu, ids, kv_pressure, oracle_step_logits, rel_l2, run_steps, step};
use moe_daemon::engine::{Engine, EngineOptions};
use moe_daemon::weights::gguf::GgufFile;

#[test]
fn releasing_window_blocks_changes_no_logit_and_holds_only_the_window() {
    let positions = PROMPT + DECODE;
    let blocks = positions.div_ceil(16);
    for window in [5usize, 37] {
        let dir = model_dir(window);
        let keep_engine = engine(dir.path(), false, &EngineOptions::default());
        // One layer's rows of one block: 16 positions of K and V (4 layers in a position's bytes).
        let layer_block = 16 * moe_daemon::engine::kv::bytes_per_position(keep_engine.config()) / 4;
        let (keep, keep_blocks, keep_bytes) = run(&keep_engine);
        let sliding = engine(dir.path(), true, &EngineOptions::default());
        assert_eq!(
            sliding.kv_layout().groups().len(),
            4,
            "one full layer and three sliding ones, a layer per group"
        );
        let (release, release_blocks, release_bytes) = run(&sliding);
        // The same positions are read in the same order: bit for bit.
        assert_eq!(keep.len(), release.len());
        for (i, (a, b)) in keep.iter().zip(&release).enumerate() {
            assert!(a == b, "window {window}, step {i}: logits differ");
        }
        // Keeping everything: one table per sequence, each block holds all 4 layers. Released: the
        // full layer's table plus, per sliding layer, the blocks from the window's start back to its
        // block boundary.
        assert_eq!(keep_blocks, 2 * blocks);
        assert_eq!(keep_bytes, 2 * blocks * 4 * layer_block);
        let per_sliding = (window - 1).div_ceil(16) + 1;
        assert!(
            release_blocks <= 2 * (blocks + 3 * per_sliding),
            "window {window}: {release_blocks} blocks held"
        );
        // The store grows to the most blocks in use at once: the full layers' plus, per sliding layer,
        // a window and a prefill chunk (written before its blocks can go).
        let peak = 2 * (blocks + 3 * (per_sliding + 3));
        assert!(
            release_bytes <= peak * layer_block,
            "window {window}: {release_bytes} B"
        );
        eprintln!(
            "window {window}, 2 × {positions} positions: KV {keep_bytes} B keeping every position, {release_bytes} B with windows released ({release_blocks} of {} layer-blocks held at the end)",
            4 * keep_blocks
        );
    }
}

/// The scheduler on a tight cache: preemption, prefix sharing and batching over sliding tables give
/// every request the tokens it gets alone (log-probabilities within the CPU batch tolerance).
#[test]
fn tight_cache_with_sliding_windows_matches_requests_alone() {
    let dir = common::fixtures_root().join("smallthinker/model");
    let (alone, pressured, metrics) =
        kv_pressure::run_with(&dir, &EngineOptions::default(), 512, 80);
    kv_pressure::check(&alone, &pressured, &metrics, 1e-4);
}

/// The measurement behind the figure in docs/SMALLTHINKER.md (not in CI: about a minute of prefill): one
/// 16K-position sequence with the 21B's layout in small (layer 0 of 4 full, the others a 4096 window),
/// the CPU store's bytes keeping every position and releasing the window's leftovers.
/// `cargo test -p moe-daemon --test smallthinker_tests -- --ignored --nocapture`
#[test]
#[ignore]
fn sixteen_k_sequence_bytes() {
    let dir = model_dir(4096);
    let positions = 16384;
    let mut bytes = vec![];
    for release in [false, true] {
        let e = Engine::load(
            dir.path(),
            &EngineOptions {
                release_window_kv: release,
                kv_cache_tokens: positions,
                ..Default::default()
            },
        )
        .unwrap();
        let mut c = e.new_cache();
        let tokens: Vec<u32> = (0..positions as u32).map(|i| (i * 37 + 11) % 512).collect();
        for chunk in tokens.chunks(512) {
            step(&e, &mut c, chunk);
        }
        bytes.push((e.cpu_kv_bytes().unwrap(), c.held_blocks()));
    }
    let ((keep, keep_blocks), (release, release_blocks)) = (bytes[0], bytes[1]);
    eprintln!(
        "{positions} positions: keeping every position {keep} B ({keep_blocks} blocks of 4 layers); \
         windows released {release} B at the peak, {release_blocks} one-layer blocks held at the end \
         ({:.1}% of the bytes)",
        100.0 * release as f64 / keep as f64
    );
    assert!(release < keep / 2);
}

// ---- GGUF input

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
    let opts = exact_cpu();
    let from_gguf = Engine::from_source(&cfg, &g, &opts).unwrap();
    let from_st = Engine::load(&root.join("model"), &opts).unwrap();
    let oracle = common::oracle("smallthinker");
    let prompt = ids(&oracle["prompt_ids"]);
    let greedy = ids(&oracle["greedy_tokens"]);
    let got = run_steps(&from_gguf, &prompt, &greedy);
    let want = run_steps(&from_st, &prompt, &greedy);
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        let err = rel_l2(a, b);
        assert!(err <= 1e-6, "step {i}: GGUF vs safetensors rel-L2 {err}");
    }
    for (i, reference) in oracle_step_logits(&oracle).iter().enumerate() {
        let err = rel_l2(&got[i], reference);
        assert!(err <= 1e-3, "step {i}: GGUF vs the model's own code {err}");
    }
}
