//! Tensor parallelism (`--tensor-parallel N`) on the CUDA backend.
//!
//! On one GPU the loopback communicator runs every rank on the same device (separate weights, KV
//! pools, streams and buffers; the all-reduce sums the ranks' buffers with device adds), so the sharded
//! model — head and KV-head splits, KV heads replicated over 4 ranks, column / row-parallel MLPs and
//! shared experts, lm_head by vocabulary, GPU experts spread over the ranks, DRAM experts once on rank
//! 0 — is checked against one GPU. With two GPUs or more the NCCL test runs too.
//!
//! Tolerance: the ranks' partial sums are added in another order than one GEMM adds them, which
//! moves the bf16 GEMM inputs of later layers by a rounding step: logits agree with one GPU to
//! rel-L2 ≤ 2e-2 per step (the bound placements of one model agree to), and with transformers to
//! ≤ 5e-2 as every GPU test. `--tensor-parallel 1` is the single-GPU path: bit for bit.
mod gemm_split;
mod hybrid;
mod mla;
mod probed;

use crate::common::gpu::gpu;
use crate::common::{fixtures_root as fixtures, oracle, oracle_step_logits, rel_l2, run};
use moe_daemon::engine::parallel::{CommKind, TensorParallel};
use moe_daemon::engine::placement::PlacementStrategy;
use moe_daemon::engine::{Engine, EngineOptions};
use serde_json::Value;

/// GQA fixtures: Qwen3-MoE (dense first layer, qk-norm), Qwen2-MoE (gated shared expert), Mixtral,
/// GLM-4.5 (shared expert, q/k/v biases, partial rotary, sigmoid router), dense Llama and Qwen3 (tied
/// embeddings), Qwen2 (q/k/v biases), SmallThinker (router on the layer input, sliding windows,
/// NoPE layers). Each has 4 query and 2 KV heads.
const GQA: &[&str] = &[
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "glm4_moe",
    "llama",
    "qwen3",
    "qwen2",
    "smallthinker",
];

fn tp(opts: EngineOptions, size: usize, comm: CommKind) -> EngineOptions {
    EngineOptions {
        tensor_parallel: TensorParallel { size, comm },
        ..opts
    }
}

/// `got` against one GPU (≤ 2e-2) and transformers (≤ 5e-2), step by step.
fn check(tag: &str, got: &[Vec<f32>], one_gpu: &[Vec<f32>], o: &Value) {
    let want = oracle_step_logits(o);
    assert_eq!(got.len(), one_gpu.len(), "{tag}: steps");
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g.len(), one_gpu[i].len(), "{tag} step {i}: vocabulary rows");
        let e1 = rel_l2(g, &one_gpu[i]);
        let eo = rel_l2(g, &want[i]);
        println!("{tag} step {i}: rel-L2 vs one GPU {e1:.2e}, vs transformers {eo:.2e}");
        assert!(e1 <= 2e-2 && eo <= 5e-2, "{tag} step {i}: {e1} / {eo}");
    }
}

/// `name`'s oracle run over each of `worlds` ranks through `comm` against one GPU (`check`), routed
/// experts all in DRAM (rank 0's hand-off) and 6 per layer spread over the ranks, CUDA graphs on
/// or off on both sides.
fn group_matches_one_gpu(name: &str, comm: CommKind, worlds: &[usize], cuda_graphs: bool) {
    let o = oracle(name);
    let dir = fixtures().join(name).join("model_bf16");
    for n_gpu in [0, 6] {
        let base = EngineOptions {
            cuda_graphs,
            ..gpu(n_gpu, PlacementStrategy::Uniform)
        };
        let one = run(&Engine::load(&dir, &base).unwrap(), &o);
        for &world in worlds {
            let e = Engine::load(&dir, &tp(base.clone(), world, comm)).unwrap();
            check(
                &format!("{name} {comm:?} tp={world} gpu_experts={n_gpu} graphs={cuda_graphs}"),
                &run(&e, &o),
                &one,
                &o,
            );
        }
    }
}

/// `got` against one GPU's `one`, step by step, at the group's bound (rel-L2 ≤ 2e-2); `step_name`
/// names a step in the printout.
fn check_against_one_gpu(
    tag: &str,
    got: &[Vec<f32>],
    one: &[Vec<f32>],
    step_name: impl Fn(usize) -> String,
) {
    assert_eq!(got.len(), one.len(), "{tag}: steps");
    for (i, (g, w)) in got.iter().zip(one).enumerate() {
        let e = rel_l2(g, w);
        let step = step_name(i);
        println!("{tag} {step}: rel-L2 vs one GPU {e:.2e}");
        assert!(e <= 2e-2, "{tag} {step}: {e}");
    }
}

/// Asserts that every rank of `e` captured CUDA graphs, as many as each other; returns the counts.
fn assert_ranks_captured_alike(tag: &str, e: &Engine) -> Vec<usize> {
    let per_rank = e.cuda_graphs_captured_per_gpu();
    println!("{tag}: graphs per rank {per_rank:?}");
    assert!(
        per_rank.iter().all(|&g| g > 0 && g == per_rank[0]),
        "{tag}: graphs per rank {per_rank:?}"
    );
    per_rank
}

#[test]
fn tensor_parallel_loopback_matches_one_gpu() {
    for name in GQA {
        let worlds: &[usize] = if matches!(*name, "qwen3_moe" | "glm4_moe") {
            &[2, 4] // 4 ranks: each of the 2 KV heads replicated on 2 ranks
        } else {
            &[2]
        };
        group_matches_one_gpu(name, CommKind::Loopback, worlds, false);
    }
}

/// Long prompts: rank 0 streams (or uploads) the DRAM experts while the other ranks compute their
/// resident ones.
#[test]
fn tensor_parallel_loopback_layerwise_prefill() {
    let name = "qwen3_moe";
    let o = oracle(name);
    let dir = fixtures().join(name).join("model_bf16");
    let base = EngineOptions {
        gpu_prefill_threshold: 4,
        ..gpu(6, PlacementStrategy::Uniform)
    };
    let one = run(&Engine::load(&dir, &base).unwrap(), &o);
    let e = Engine::load(&dir, &tp(base, 2, CommKind::Loopback)).unwrap();
    check(
        &format!("{name} tp=2 layerwise prefill"),
        &run(&e, &o),
        &one,
        &o,
    );
}

/// `--tensor-parallel 1` (whatever the communicator) is today's single-GPU step, bit for bit.
#[test]
fn tensor_parallel_one_is_the_single_gpu_path() {
    for name in ["qwen3_moe", "glm4_moe"] {
        let o = oracle(name);
        let dir = fixtures().join(name).join("model_bf16");
        let base = gpu(6, PlacementStrategy::Uniform);
        let want = run(&Engine::load(&dir, &base).unwrap(), &o);
        for comm in [CommKind::Nccl, CommKind::Loopback] {
            let got = run(&Engine::load(&dir, &tp(base.clone(), 1, comm)).unwrap(), &o);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same && g.len() == w.len(),
                    "{name} {comm:?} step {i}: not bit-identical"
                );
            }
        }
    }
}

/// What the model cannot split over is refused with the reason, before any upload.
#[test]
fn tensor_parallel_refuses_what_does_not_divide() {
    let dir = fixtures().join("qwen3_moe").join("model_bf16");
    let opts = tp(gpu(0, PlacementStrategy::Uniform), 3, CommKind::Loopback);
    let err = Engine::load(&dir, &opts).err().expect("3 ranks of 4 heads");
    let text = format!("{err:#}");
    assert!(
        text.contains("4 attention heads do not split over 3 GPUs"),
        "{text}"
    );
}

/// What does not split is refused at load with the reason, without a panic, and nothing stays on the
/// GPU: FP8 blocks a GPU's heads would cut (DeepSeek-V3's FP8 fixture keeps 32-wide blocks: 2 of its
/// 4 MLA heads are 48 q_b rows), and attention heads that do not divide (GLM-5.3-Flash's fixture
/// over 3 ranks).
#[test]
fn tensor_parallel_refuses_layer_kinds_without_a_split() {
    let dev = moe_kernels::cuda::GpuDevice::open(0).unwrap();
    for (name, variant, world, reason) in [
        ("deepseek_v3_fp8", "model", 2, "FP8 blocks"),
        (
            "glm5_next",
            "model_bf16",
            3,
            "4 attention heads do not split over 3 GPUs",
        ),
    ] {
        let dir = fixtures().join(name).join(variant);
        let opts = tp(
            gpu(0, PlacementStrategy::Uniform),
            world,
            CommKind::Loopback,
        );
        let (free_before, _) = dev.memory().unwrap();
        let loaded = std::panic::catch_unwind(|| Engine::load(&dir, &opts).map(|_| ()));
        let Ok(Err(err)) = loaded else {
            panic!("{name}: loading with --tensor-parallel {world} did not fail cleanly");
        };
        let text = format!("{err:#}");
        println!("{name} tp={world}: {text}");
        assert!(text.contains(reason), "{name}: {text}");
        let (free_after, _) = dev.memory().unwrap();
        assert!(
            free_after + (64 << 20) >= free_before,
            "{name}: {} MiB left on the GPU",
            (free_before - free_after) >> 20
        );
    }
}

/// The group sizes of 2 and 4 that the visible GPUs allow NCCL to run, one GPU per rank; `None`
/// (and a line saying `test` was skipped) with fewer than two.
fn nccl_worlds(test: &str) -> Option<Vec<usize>> {
    let visible = cudarc::driver::CudaContext::device_count().unwrap_or(0) as usize;
    if visible < 2 {
        println!("{test}: {visible} GPU visible, skipped");
        return None;
    }
    Some([2, 4].into_iter().filter(|&w| w <= visible).collect())
}

/// Two or more visible GPUs: NCCL all-reduce, one GPU per rank (skipped on one GPU).
#[test]
fn tensor_parallel_nccl_matches_one_gpu() {
    let Some(worlds) = nccl_worlds("tensor_parallel_nccl_matches_one_gpu") else {
        return;
    };
    // GQA fixtures (MLA's: `mla::tensor_parallel_nccl_mla_matches_one_gpu`); Qwen3-MoE also with
    // CUDA graphs (each GPU captures its own halves)
    let cases = [
        ("qwen3_moe", false),
        ("qwen3_moe", true),
        ("glm4_moe", false),
        ("qwen2_moe", false),
        ("llama", false),
    ];
    for (name, cuda_graphs) in cases {
        group_matches_one_gpu(name, CommKind::Nccl, &worlds, cuda_graphs);
    }
}

/// Each GPU holds its slice, read back from the uploaded device weights: the logits above match one
/// GPU while every rank computes only its heads, MLP units, vocabulary rows and experts, which they
/// can only do through the all-reduce. (They match bit for bit on these fixtures: every GEMM takes
/// bf16-rounded activations, so the last-bit differences of the f32 reductions rarely survive.)
#[test]
fn tensor_parallel_ranks_hold_their_slices() {
    use moe_daemon::engine::parallel::ShardSummary;
    // qwen3_moe: 4 heads × 32 (2 KV heads), dense layer 0 of 128 units, vocabulary 512, two MoE
    // layers with 6 of 16 experts on the GPUs
    let dir = fixtures().join("qwen3_moe").join("model_bf16");
    let base = gpu(6, PlacementStrategy::Uniform);
    let one = Engine::load(&dir, &base).unwrap().gpu_shards();
    assert_eq!(one.len(), 1);
    assert_eq!(
        (one[0].q_rows, one[0].kv_width, one[0].gpu_experts),
        (128, 64, 12)
    );
    let two = Engine::load(&dir, &tp(base.clone(), 2, CommKind::Loopback))
        .unwrap()
        .gpu_shards();
    for (r, s) in two.iter().enumerate() {
        let want = ShardSummary {
            rank: r,
            q_rows: 64,
            o_cols: 64,
            kv_width: 32,
            dense_units: 64,
            lm_head_rows: 256,
            gpu_experts: 6,
        };
        assert_eq!(s, &want);
    }
    let four = Engine::load(&dir, &tp(base, 4, CommKind::Loopback))
        .unwrap()
        .gpu_shards();
    assert_eq!(four.len(), 4);
    for s in &four {
        // one query head each; the 2 KV heads replicated on 2 ranks each
        assert_eq!(
            (
                s.q_rows,
                s.o_cols,
                s.kv_width,
                s.dense_units,
                s.lm_head_rows
            ),
            (32, 32, 32, 32, 128)
        );
        assert!((1..=4).contains(&s.gpu_experts), "{s:?}");
    }
    assert_eq!(four.iter().map(|s| s.gpu_experts).sum::<usize>(), 12);
}

/// The loopback all-reduce sums every rank's buffer into all of them (only the first `len` values),
/// and a rank that fails wakes the others with an error instead of leaving them waiting.
#[test]
fn loopback_all_reduce_sums_every_rank_and_aborts() {
    use moe_daemon::engine::parallel::comm::{Communicator, Loopback};
    use moe_kernels::cuda::GpuDevice;
    let world = 3;
    let comm = Loopback::new(world);
    let devs: Vec<GpuDevice> = (0..world).map(|_| GpuDevice::open(0).unwrap()).collect();
    std::thread::scope(|s| {
        for (r, d) in devs.iter().enumerate() {
            let comm = &comm;
            s.spawn(move || {
                d.ctx.bind_to_thread().unwrap();
                let mut b = d.stream.clone_htod(&vec![(r + 1) as f32; 1000]).unwrap();
                for _ in 0..3 {
                    // repeated: the barrier generations must not mix reductions
                    comm.all_reduce_sum(r, d, &mut b, 700).unwrap();
                    let fill = d.stream.clone_htod(&vec![(r + 1) as f32; 700]).unwrap();
                    d.stream
                        .memcpy_dtod(&fill, &mut b.slice_mut(..700))
                        .unwrap();
                }
                comm.all_reduce_sum(r, d, &mut b, 700).unwrap();
                let h = d.stream.clone_dtoh(&b).unwrap();
                assert!(h[..700].iter().all(|&v| v == 6.0), "rank {r}: {}", h[0]);
                assert!(
                    h[700..].iter().all(|&v| v == (r + 1) as f32),
                    "rank {r} past len"
                );
            });
        }
    });
    let two = Loopback::new(2);
    let d = &devs[0];
    std::thread::scope(|s| {
        let waiting = s.spawn(|| {
            d.ctx.bind_to_thread().unwrap();
            let mut b = d.stream.clone_htod(&[1f32; 8]).unwrap();
            two.all_reduce_sum(0, d, &mut b, 8)
        });
        std::thread::sleep(std::time::Duration::from_millis(200));
        two.abort();
        assert!(waiting.join().unwrap().is_err());
    });
}

/// The load-time warm-up steps every rank through the group (it used to drive rank 0 alone, whose
/// first all-reduce then waited forever): loading returns, each rank captured its decode graphs in
/// the warm-up, another warm-up leaves no KV block held and records no routing, and the logits
/// still match one GPU.
#[test]
fn tensor_parallel_loopback_warm_up_steps_every_rank() {
    let name = "qwen3_moe";
    let o = oracle(name);
    let dir = fixtures().join(name).join("model_bf16");
    let base = EngineOptions {
        cuda_graphs: true,
        max_step_tokens: 256,
        ..gpu(6, PlacementStrategy::Uniform)
    };
    let one = run(&Engine::load(&dir, &base).unwrap(), &o);
    let e = Engine::load(
        &dir,
        &EngineOptions {
            record_routing: true,
            ..tp(base, 2, CommKind::Loopback)
        },
    )
    .unwrap();
    let graphs = assert_ranks_captured_alike(&format!("{name} tp=2 after the warm-up"), &e);
    assert_eq!(graphs.len(), 2);
    assert_eq!(e.warm_up(100).unwrap(), 100);
    assert_eq!(e.kv_usage(), 0.0, "the warm-up left KV blocks held");
    let stats = std::env::temp_dir().join(format!("tp-warm-{}.json", std::process::id()));
    e.save_routing_stats(&stats).unwrap();
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    std::fs::remove_file(&stats).ok();
    let counted: u64 = saved["counts"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|row| row.as_array().unwrap().iter())
        .map(|c| c.as_u64().unwrap())
        .sum();
    assert_eq!(counted, 0, "the warm-up's routing was recorded: {saved}");
    check(
        &format!("{name} tp=2 after warm-ups"),
        &run(&e, &o),
        &one,
        &o,
    );
}

/// Each GPU holds its MLA heads, read back from the uploaded device weights: DeepSeek-V3's fixture
/// (4 heads, q-LoRA, nope 16 + rope 8, value 16, latent 32) over 2 ranks: 2 heads' rows of q_b
/// (48) and value columns of o (32) each, the latent cache (32 wide) whole on both.
#[test]
fn tensor_parallel_mla_ranks_hold_their_heads() {
    use moe_daemon::engine::parallel::ShardSummary;
    let dir = fixtures().join("deepseek_v3").join("model_bf16");
    let base = gpu(0, PlacementStrategy::Uniform);
    let one = Engine::load(&dir, &base).unwrap().gpu_shards();
    assert_eq!(
        (one[0].q_rows, one[0].o_cols, one[0].kv_width),
        (96, 64, 32)
    );
    let two = Engine::load(&dir, &tp(base, 2, CommKind::Loopback))
        .unwrap()
        .gpu_shards();
    assert_eq!(two.len(), 2);
    for (r, s) in two.iter().enumerate() {
        let want = ShardSummary {
            rank: r,
            q_rows: 48,
            o_cols: 32,
            kv_width: 32,
            dense_units: 64,
            lm_head_rows: 256,
            gpu_experts: 0,
        };
        assert_eq!(s, &want);
    }
}

/// CUDA graphs with 2 ranks: each rank captures its decode segments in two halves around the
/// attention's all-reduce (which runs eagerly between the replays); decode with DRAM experts is
/// pipelined on rank 0. Logits against one GPU with graphs, and every rank captured as many graphs.
#[test]
fn tensor_parallel_loopback_cuda_graphs_match_one_gpu() {
    for name in ["qwen3_moe", "glm4_moe", "smallthinker"] {
        let o = oracle(name);
        let dir = fixtures().join(name).join("model_bf16");
        let base = EngineOptions {
            cuda_graphs: true,
            ..gpu(4, PlacementStrategy::Uniform)
        };
        let e1 = Engine::load(&dir, &base).unwrap();
        let one = run(&e1, &o);
        assert!(
            e1.cuda_graphs_captured() > 0,
            "{name}: one GPU captured none"
        );
        let e = Engine::load(&dir, &tp(base, 2, CommKind::Loopback)).unwrap();
        let got = run(&e, &o);
        let graphs = assert_ranks_captured_alike(name, &e);
        assert_eq!(graphs.len(), 2);
        check(&format!("{name} tp=2 cuda graphs"), &got, &one, &o);
    }
}

/// Live re-placement with 2 ranks: a move copies the admitted expert onto the GPU holding the one it
/// evicts (each GPU keeps its count), every rank then computes it there, and the evicted one goes
/// back to rank 0's CPU experts. The same moves on one GPU give the same logits (≤ 2e-2 rel-L2, the
/// group's bound against one GPU), before and after, and the moved weights are bit for bit equal.
#[test]
fn tensor_parallel_loopback_live_move_matches_one_gpu() {
    let name = "qwen3_moe";
    let dir = fixtures().join(name).join("model_bf16");
    let base = EngineOptions {
        live_placement: Some(super::live_still()),
        ..gpu(4, PlacementStrategy::Uniform)
    };
    let one = Engine::load(&dir, &base).unwrap();
    let two = Engine::load(&dir, &tp(base, 2, CommKind::Loopback)).unwrap();
    assert_eq!(one.gpu_residency(), two.gpu_residency(), "node placement");
    let moe_layers: Vec<usize> = (0..one.config().num_layers)
        .filter(|&l| one.config().moe_layers[l])
        .collect();
    let mut next = crate::common::xorshift(7);
    let tokens: Vec<u32> = (0..14).map(|_| (next() % 500) as u32).collect();
    let schedule: Vec<&[u32]> = std::iter::once(&tokens[..4])
        .chain(tokens[4..].chunks(1))
        .collect();
    let compare = |tag: &str, a: &Engine, b: &Engine| {
        let steps = |e: &Engine| {
            let mut c = e.new_cache();
            let logits: Vec<Vec<f32>> = schedule
                .iter()
                .map(|t| crate::common::step(e, &mut c, t))
                .collect();
            logits
        };
        check_against_one_gpu(&format!("{tag} tp=2"), &steps(b), &steps(a), |i| {
            format!("step {i}")
        });
    };
    compare("before the moves", &one, &two);
    // Per MoE layer: a DRAM expert replaces one held by rank 1, another one held by rank 0.
    for &layer in &moe_layers {
        for rank in [1, 0] {
            let per_gpu = two.gpu_residency_per_gpu();
            let node = two.gpu_residency().unwrap();
            let evict = per_gpu[rank][layer].iter().position(|&r| r).unwrap();
            let admit = node[layer].iter().rposition(|&r| !r).unwrap();
            one.move_expert_now(layer, admit, evict).unwrap();
            two.move_expert_now(layer, admit, evict).unwrap();
            let per_gpu = two.gpu_residency_per_gpu();
            assert!(
                per_gpu[rank][layer][admit] && !per_gpu[rank][layer][evict],
                "layer {layer}: expert {admit} did not land on GPU {rank} in place of {evict}"
            );
            assert!(
                !per_gpu[1 - rank][layer][admit],
                "layer {layer}: expert {admit} on both GPUs"
            );
            assert_eq!(
                one.gpu_expert_bits(layer, admit).unwrap(),
                two.gpu_expert_bits(layer, admit).unwrap(),
                "layer {layer} expert {admit}: moved weights"
            );
        }
    }
    assert_eq!(one.gpu_residency(), two.gpu_residency(), "after the moves");
    let counts: Vec<usize> = two
        .gpu_residency_per_gpu()
        .iter()
        .map(|g| g.iter().flatten().filter(|&&r| r).count())
        .collect();
    assert_eq!(counts, vec![4, 4], "each GPU keeps its share");
    compare("after the moves", &one, &two);
}
