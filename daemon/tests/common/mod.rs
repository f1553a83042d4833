//! Helpers shared by the integration tests that compare against the committed fixtures: where the
//! fixtures are, reading an `oracle.json`, feeding an engine step by step, and a deterministic input
//! stream. Each test binary uses a subset of them; the CUDA tests' own set-up is in [`gpu`].
#![allow(dead_code)]

pub mod gpu;
pub mod int4_round;
pub mod kv_pressure;
pub mod sliding;
use moe_daemon::engine::{Engine, EngineOptions, SeqCache, SeqInput};
use serde_json::Value;
use std::path::PathBuf;

/// `tests/fixtures`, or `MOE_FIXTURES` when set (the GPU machine runs test binaries from elsewhere).
pub fn fixtures_root() -> PathBuf {
    std::env::var_os("MOE_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures"))
}

/// Relative L2 distance of `a` from the reference `b`.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f32 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

/// Engine options with the expert kernels capped at the f32-activation tier (AVX2/FMA or scalar):
/// exact arithmetic, as the fixture tests compare at 1e-3.
pub fn exact_cpu() -> EngineOptions {
    let mut o = EngineOptions::default();
    o.cpu_moe.max_tier = Some(moe_kernels::cpu::CpuTier::Avx2);
    o
}

/// xorshift64 stream (deterministic test inputs).
pub fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}

/// Uniform f32 in [-0.5, 0.5) from the [`xorshift`] stream of `seed` (24 bits of it).
pub fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut next = xorshift(seed);
    move || (next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

/// A fixture's `oracle.json` (what transformers or the model's own code computed).
pub fn oracle(name: &str) -> Value {
    let path = fixtures_root().join(name).join("oracle.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A JSON array of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A JSON array of numbers, as f32.
pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// The oracle's final-position logits per step (step 0 = end of prefill, then one per decode step).
pub fn oracle_step_logits(o: &Value) -> Vec<Vec<f32>> {
    o["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| floats(&s["logits"]))
        .collect()
}

/// One step of one sequence: `tokens` appended to `cache`; the logits at its last position.
pub fn step(e: &Engine, cache: &mut SeqCache, tokens: &[u32]) -> Vec<f32> {
    e.reserve_and_forward(&mut [SeqInput { cache, tokens }])
        .unwrap()
        .remove(0)
}

/// `prompt` appended to `cache` in one step; the logits at every one of its positions (CPU backend).
pub fn prefill_all(e: &Engine, cache: &mut SeqCache, prompt: &[u32]) -> Vec<Vec<f32>> {
    e.forward_all(&mut [SeqInput {
        cache,
        tokens: prompt,
    }])
    .unwrap()
}

/// Prefill of `prompt`, then one step per token of `feed` (teacher forcing); each step's final logits.
pub fn run_steps(e: &Engine, prompt: &[u32], feed: &[u32]) -> Vec<Vec<f32>> {
    let mut c = e.new_cache();
    let mut out = vec![step(e, &mut c, prompt)];
    for &t in feed {
        out.push(step(e, &mut c, &[t]));
    }
    out
}

/// The oracle's schedule as steps' tokens: its prompt, then its greedy tokens one by one.
pub fn oracle_feeds(o: &Value) -> Vec<Vec<u32>> {
    let mut feeds = vec![ids(&o["prompt_ids"])];
    feeds.extend(ids(&o["greedy_tokens"]).into_iter().map(|t| vec![t]));
    feeds
}

/// Prefill + teacher-forced decode over the oracle's sequence; returns per-step final logits.
pub fn run(engine: &Engine, o: &Value) -> Vec<Vec<f32>> {
    run_steps(engine, &ids(&o["prompt_ids"]), &ids(&o["greedy_tokens"]))
}
