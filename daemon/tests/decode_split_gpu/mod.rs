//! Decode steps whose layers hand a share of their routed DRAM experts to the GPU's side stream
//! (`engine::gpu::decode_split`) against the same engine with the split off.
//!
//! Tolerance, as the prefill split's (`split_prefill_matches_the_unsplit_path`): every routed expert
//! is still computed once, on one side; only the side differs (the GPU multiplies bf16 activations
//! by the unpacked weights, the CPU kernels their own way), so per decode step rel-L2 ≤ 2e-2 for
//! bf16 experts and ≤ 5e-2 for int8 ones against the unsplit path. Steps run as CUDA graphs with the
//! hand-off pipelined, the share added on the host before the flag. The split really ran (experts on
//! both sides), with and without GPU-resident experts (device-routed mixed layers). The switch off
//! is the path without the split bit for bit, also after the split ran in the same engine.
use crate::common::gpu::gpu;
use crate::common::{fixtures_root as fixtures, rel_l2, step};
use moe_daemon::engine::gpu::switches::DecodeSwitch;
use moe_daemon::engine::placement::PlacementStrategy;
use moe_daemon::engine::{Engine, EngineOptions};
use moe_kernels::cpu::moe::WeightFormat;

/// Teacher-forced decode tokens after the prompt.
const STEPS: u32 = 8;

/// The logits of every decode step of one new sequence (a 12-token prompt, then `STEPS` tokens),
/// and how many routed DRAM experts the steps gave the GPU's share and the CPU.
fn decode(e: &Engine, vocab: u32) -> (Vec<Vec<f32>>, u64, u64) {
    let mut c = e.new_cache();
    let prompt: Vec<u32> = (0..12u32).map(|i| (i * 37 + 11) % vocab).collect();
    step(e, &mut c, &prompt);
    let (mut gpu, mut cpu) = (0, 0);
    let mut out = Vec::new();
    for i in 0..STEPS {
        out.push(step(e, &mut c, &[(i * 53 + 7) % vocab]));
        let t = e.last_step_times();
        gpu += t.split_gpu_experts;
        cpu += t.split_cpu_experts;
    }
    (out, gpu, cpu)
}

#[test]
fn decode_split_matches_the_unsplit_path() {
    let cases = [
        ("qwen3_moe", None, 0),
        ("qwen3_moe", None, 4),
        ("qwen3_moe", Some(WeightFormat::Int8), 0),
        ("qwen3_moe", Some(WeightFormat::Int8), 4),
        ("glm4_moe", None, 0),
        ("smallthinker_softmax", None, 2),
    ];
    for (name, fmt, gpu_experts) in cases {
        let dir = fixtures().join(name).join("model_bf16");
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        let vocab = cfg["vocab_size"].as_u64().unwrap() as u32;
        let opts = EngineOptions {
            expert_format: fmt,
            cuda_graphs: true,
            // the expert stream (whose staging the split borrows) is set up below the KV capacity
            gpu_prefill_threshold: 1000,
            ..gpu(gpu_experts, PlacementStrategy::Uniform)
        };
        let label = format!("{name} {fmt:?}, {gpu_experts} GPU experts");
        let plain = Engine::load(&dir, &opts).unwrap();
        let (off, g0, _) = decode(&plain, vocab);
        assert_eq!(g0, 0, "{label}: split off");
        let e = Engine::load(&dir, &opts).unwrap();
        assert!(
            e.set_decode_switch(DecodeSwitch::DecodeSplitFixed(2), true),
            "{label}: no decode split"
        );
        let (on, g, c) = decode(&e, vocab);
        assert!(
            g > 0 && c > 0,
            "{label}: the steps did not split ({g} experts to the GPU, {c} to the CPU)"
        );
        let tol = if fmt.is_some() { 5e-2 } else { 2e-2 };
        let worst = on
            .iter()
            .zip(&off)
            .map(|(a, b)| rel_l2(a, b))
            .fold(0f32, f32::max);
        println!(
            "{label}: {g} / {c} routed DRAM experts to the GPU / CPU over {STEPS} steps; worst step rel-L2 vs unsplit {worst:.2e}"
        );
        assert!(worst <= tol, "{label}: split vs unsplit {worst}");
        // the balance's own share runs too (it may take none: then nothing changes)
        assert!(e.set_decode_switch(DecodeSwitch::DecodeSplit, true));
        let (auto, ..) = decode(&e, vocab);
        let worst_auto = auto
            .iter()
            .zip(&off)
            .map(|(a, b)| rel_l2(a, b))
            .fold(0f32, f32::max);
        assert!(
            worst_auto <= tol,
            "{label}: auto split vs unsplit {worst_auto}"
        );
        // off again: the unsplit path bit for bit
        assert!(e.set_decode_switch(DecodeSwitch::DecodeSplit, false));
        let (again, g2, _) = decode(&e, vocab);
        assert_eq!(g2, 0, "{label}: split off again");
        assert!(
            again == off,
            "{label}: the switch off is not the unsplit path"
        );
    }
}
