//! Set-up shared by the CUDA backend's tests (`gpu_tests` and its modules): engine options on the
//! device, the comparison of a run against transformers and the CPU backend at the GPU tolerance, and
//! the graph-replay-versus-eager check.
use super::{floats, rel_l2, step};
use moe_daemon::engine::placement::{GpuExperts, PlacementStrategy};
use moe_daemon::engine::sampling::argmax;
use moe_daemon::engine::{Device, Engine, EngineOptions, SeqInput};
use serde_json::Value;

/// The CUDA backend on device 0 with `n` GPU experts per layer placed by `placement`, 4096 KV positions.
pub fn gpu(n: usize, placement: PlacementStrategy) -> EngineOptions {
    EngineOptions {
        device: Device::Cuda(0),
        gpu_experts: GpuExperts::Count(n),
        placement,
        kv_cache_tokens: 4096,
        ..Default::default()
    }
}

/// Compares the steps of `got` before `until` (a routing divergence, or all) with the oracle `o`
/// (transformers, f32) and the CPU backend's `cpu`: rel-L2 ≤ 5e-2 against both, argmax equal where the
/// oracle's top-1/top-2 gap exceeds 0.1. Returns how many steps it compared.
pub fn check_against_oracle(
    name: &str,
    label: &str,
    got: &[Vec<f32>],
    cpu: &[Vec<f32>],
    o: &Value,
    until: usize,
) -> usize {
    let mut compared = 0;
    for (i, (g, s)) in got.iter().zip(o["steps"].as_array().unwrap()).enumerate() {
        if i >= until {
            break;
        }
        compared += 1;
        let want = floats(&s["logits"]);
        let (err, err_cpu) = (rel_l2(g, &want), rel_l2(g, &cpu[i]));
        println!("{name} {label} step {i}: rel-L2 vs transformers {err:.2e}, vs CPU {err_cpu:.2e}");
        assert!(
            err <= 5e-2 && err_cpu <= 5e-2,
            "{name} {label} step {i}: {err} / {err_cpu}"
        );
        if s["top1_top2_gap"].as_f64().unwrap() > 0.1 {
            assert_eq!(
                argmax(g) as u64,
                s["argmax"].as_u64().unwrap(),
                "{name} {label} step {i} argmax"
            );
        }
    }
    compared
}

/// `name`'s fixture with `gpu_experts` GPU experts per layer, graphs on and off: prompts of 3, 14 and 1
/// tokens, then 20 greedy decode steps, alone and as a batch; asserts that graphs were captured and
/// every step's logits agree within 1e-5 rel-L2 (prints the largest difference).
pub fn graphs_match_eager(name: &str, gpu_experts: usize) {
    let dir = super::fixtures_root().join(name).join("model_bf16");
    let engine = |graphs: bool| {
        Engine::load(
            &dir,
            &EngineOptions {
                cuda_graphs: graphs,
                cuda_graphs_hybrid: graphs,
                ..gpu(gpu_experts, PlacementStrategy::Uniform)
            },
        )
        .unwrap()
    };
    let (with, without) = (engine(true), engine(false));
    let prompts: [Vec<u32>; 3] = [vec![1, 2, 3], (10..24).collect(), vec![7]];
    let run = |e: &Engine, batch: &[Vec<u32>]| -> Vec<Vec<f32>> {
        let mut caches: Vec<_> = batch.iter().map(|_| e.new_cache()).collect();
        let mut next: Vec<u32> = Vec::new();
        for (c, p) in caches.iter_mut().zip(batch) {
            let l = step(e, c, p);
            next.push(argmax(&l) as u32);
        }
        let mut all = Vec::new();
        for _ in 0..20 {
            let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let out = e
                .reserve_and_forward(&mut SeqInput::batch(&mut caches, &toks))
                .unwrap();
            next = out.iter().map(|l| argmax(l) as u32).collect();
            all.extend(out);
        }
        all
    };
    for batch in [&prompts[..1], &prompts[..]] {
        let (a, b) = (run(&with, batch), run(&without, batch));
        assert!(
            with.cuda_graphs_captured() > 0,
            "{name}: no CUDA graph was captured (the capture fell back to eager steps)"
        );
        assert_eq!(without.cuda_graphs_captured(), 0);
        let mut worst = 0f32;
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            let err = rel_l2(x, y);
            worst = worst.max(err);
            assert!(err <= 1e-5, "{name} batch {} step {i}: {err}", batch.len());
        }
        println!(
            "{name} graphs vs eager, batch {}, {} GPU experts: {} graphs, worst rel-L2 {worst:.2e}",
            batch.len(),
            gpu_experts,
            with.cuda_graphs_captured()
        );
    }
}
