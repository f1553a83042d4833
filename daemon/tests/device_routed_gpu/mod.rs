//! Resident experts computed from the routing on the device (`gpu::routed`) against the host-planned
//! path (`MOE_DEVICE_ROUTED=0`; the device path is the default), in one engine switched between
//! the two.
//!
//! Tolerance: the device-routed kernels round as the host-planned path does (f32 sums, bf16
//! activations, each token's experts summed in ascending expert order) but are GEMVs that accumulate
//! in another order than cuBLAS's GEMMs. One sequence: per step rel-L2 ≤ 2e-3 against the
//! host-planned path (on the H200 every case was bit-identical or within 2e-6). A batch of three,
//! where an expert chosen by 2–3 rows goes through cuBLAS's tensor-core GEMMs on the host-planned
//! path: ≤ 6e-3 against it (one bf16 step of one residual element moves the 48-wide smallthinker
//! fixtures' logits by up to 5.3e-3: `scripts/bf16_step_sensitivity.py`; measured 4.4e-3 on
//! smallthinker_softmax), and no further from the CPU backend (the independent reference of the same
//! steps) than the host-planned path is, beyond 1e-3 or 10 %, whichever is larger. Both: the same
//! argmax wherever the host-planned top-1/top-2 gap exceeds 1e-2 (near-ties may flip; they are
//! printed), each path deterministic (a second run bit-identical), and with no resident expert the
//! device path never runs and the logits are bit-identical.
use crate::common::gpu::gpu;
use crate::common::{fixtures_root as fixtures, oracle, rel_l2, run, step};
use cudarc::driver::CudaSlice;
use half::bf16;
use moe_daemon::engine::placement::PlacementStrategy;
use moe_daemon::engine::sampling::argmax;
use moe_daemon::engine::{Engine, EngineOptions, SeqCache, SeqInput};
use moe_daemon::model::ModelConfig;
use moe_kernels::cuda::routed::RoutedTable;
use std::path::PathBuf;

/// The MoE fixtures with bf16 checkpoints; the MLA ones (DeepSeek-V3) have no pipelined decode, so
/// their mixed layers keep the host-planned path (only all-resident layers are device-routed).
const MOE: &[(&str, bool)] = &[
    ("qwen3_moe", false),
    ("glm4_moe", false),
    ("mixtral", false),
    ("qwen2_moe", false),
    ("deepseek_v3", true),
    ("deepseek_v3_plain", true),
    ("smallthinker", false),
    ("smallthinker_softmax", false),
];

/// One sequence against the host-planned path.
const TOLERANCE: f32 = 2e-3;
/// A batch against the host-planned path (tensor-core GEMMs there, GEMVs here).
const BATCH_TOLERANCE: f32 = 6e-3;
/// How much further than the host-planned path the device path may be from the CPU backend:
/// max(absolute, relative × the host-planned distance).
const CPU_SLACK_ABS: f32 = 1e-3;
const CPU_SLACK_REL: f32 = 0.10;
const TIE_GAP: f32 = 1e-2;

fn top_gap(l: &[f32]) -> f32 {
    let mut v = l.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v[1]
}

/// `dev` against `host` step by step at `tolerance`: the worst rel-L2, and a line in `failures` for
/// every step that breaks a bound (so that one run reports every case).
fn compare_into(
    label: &str,
    dev: &[Vec<f32>],
    host: &[Vec<f32>],
    tolerance: f32,
    failures: &mut Vec<String>,
) -> f32 {
    assert_eq!(dev.len(), host.len(), "{label}: step counts");
    let mut worst = 0f32;
    for (i, (d, h)) in dev.iter().zip(host).enumerate() {
        let err = rel_l2(d, h);
        worst = worst.max(err);
        if err > tolerance {
            failures.push(format!("{label} step {i}: rel-L2 {err:.3e}"));
        }
        if argmax(d) != argmax(h) {
            let gap = top_gap(h);
            println!("{label} step {i}: argmax differs at a top-1/top-2 gap of {gap:.2e}");
            if gap > TIE_GAP {
                failures.push(format!("{label} step {i}: argmax differs (gap {gap})"));
            }
        }
    }
    worst
}

/// Asserts `dev` matches `host` step by step at the module's tolerance; returns the worst rel-L2.
fn compare(label: &str, dev: &[Vec<f32>], host: &[Vec<f32>]) -> f32 {
    let mut failures = Vec::new();
    let worst = compare_into(label, dev, host, TOLERANCE, &mut failures);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    worst
}

/// The largest per-step rel-L2 between two runs of the same steps.
fn worst_rel_l2(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| rel_l2(x, y))
        .fold(0f32, f32::max)
}

/// A MoE fixture's bf16 checkpoint, loaded on either backend.
struct RoutedFixture {
    dir: PathBuf,
    /// Routed experts per MoE layer.
    experts: usize,
}

impl RoutedFixture {
    fn new(name: &str) -> Self {
        let dir = fixtures().join(name).join("model_bf16");
        let config = ModelConfig::from_dir(&dir).unwrap();
        let experts = config.moe.as_ref().unwrap().num_experts;
        RoutedFixture { dir, experts }
    }

    /// The CPU backend: the independent reference of the same steps.
    fn cpu(&self) -> Engine {
        Engine::load(&self.dir, &EngineOptions::default()).unwrap()
    }

    /// The CUDA backend with `resident` experts per MoE layer (placed uniformly), CUDA graphs on or
    /// off, the device-routed experts on or off (`Engine::set_device_routed` switches them later).
    fn gpu(&self, resident: usize, graphs: bool, device_routed: bool) -> Engine {
        let opts = EngineOptions {
            cuda_graphs: graphs,
            ..gpu(resident, PlacementStrategy::Uniform)
        };
        self.load(&opts, device_routed)
    }

    /// The fixture loaded with `opts`, the device-routed experts on or off.
    fn load(&self, opts: &EngineOptions, device_routed: bool) -> Engine {
        let e = Engine::load(&self.dir, opts).unwrap();
        e.set_device_routed(device_routed);
        e
    }
}

/// The first `seqs` of the batched runs' three prompts (3, 14 and 1 tokens).
fn batch_prompts(seqs: usize) -> Vec<Vec<u32>> {
    let prompts: [Vec<u32>; 3] = [vec![1, 2, 3], (10..24).collect(), vec![7]];
    prompts[..seqs].to_vec()
}

/// `steps` decode steps of the first `seqs` sequences, a token each: step i feeds 5 + i, 40 + 3i
/// and 90 + i.
fn batch_feed(seqs: usize, steps: u32) -> Vec<Vec<u32>> {
    (0..steps)
        .map(|i| [5 + i, 40 + 3 * i, 90 + i][..seqs].to_vec())
        .collect()
}

/// One batched decode step per entry of `feed` (a token per sequence of `caches`): each step's
/// logits.
fn decode_batch(e: &Engine, caches: &mut [SeqCache], feed: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let mut all = Vec::new();
    for toks in feed {
        let t: Vec<[u32; 1]> = toks.iter().map(|&t| [t]).collect();
        all.extend(
            e.reserve_and_forward(&mut SeqInput::batch(caches, &t))
                .unwrap(),
        );
    }
    all
}

/// The three [`batch_prompts`] in one prefill batch, then `feed` as batched decode steps: every
/// step's logits.
fn batch_run(e: &Engine, feed: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let prompts = batch_prompts(3);
    let mut caches: Vec<_> = prompts.iter().map(|_| e.new_cache()).collect();
    let mut all = e
        .reserve_and_forward(&mut SeqInput::batch(&mut caches, &prompts))
        .unwrap();
    all.extend(decode_batch(e, &mut caches, feed));
    all
}

/// Every MoE fixture at 0, half and all experts resident, eager and from CUDA graphs: the oracle's
/// prompt and teacher-forced decode (one sequence), and a batch of three sequences, with the
/// device-routed experts on and off. Every case runs before the bounds are asserted, and each prints
/// how far both paths are from the CPU backend (the reference for the same steps) and how far each
/// path is from a second run of itself (both should be deterministic), so that a miss shows which
/// side moved.
#[test]
fn device_routed_experts_match_the_host_planned_path() {
    let feed = batch_feed(3, 8);
    let mut failures = Vec::new();
    for &(name, mla) in MOE {
        let o = oracle(name);
        let fixture = RoutedFixture::new(name);
        let experts = fixture.experts;
        let cpu_batch = batch_run(&fixture.cpu(), &feed);
        for gpu_experts in [0, experts / 2, experts] {
            for graphs in [false, true] {
                let label = format!("{name} {gpu_experts}/{experts} resident, graphs {graphs}");
                let e = fixture.gpu(gpu_experts, graphs, false);
                let (host, host_batch) = (run(&e, &o), batch_run(&e, &feed));
                assert_eq!(e.last_step_times().device_routed_layers, 0, "{label}");
                e.set_device_routed(true);
                let dev = run(&e, &o);
                let routed_layers = e.last_step_times().device_routed_layers;
                let dev_batch = batch_run(&e, &feed);
                let batch_routed = e.last_step_times().device_routed_layers;
                if gpu_experts == 0 {
                    assert_eq!(dev, host, "{label}: no resident expert, same path");
                    assert_eq!(dev_batch, host_batch, "{label}: batch");
                    assert_eq!(routed_layers + batch_routed, 0, "{label}");
                    continue;
                }
                // all resident: every MoE layer; half: the mixed layers of pipelined (GQA) models
                if gpu_experts == experts || !mla {
                    assert!(routed_layers > 0, "{label}: no layer was device-routed");
                    assert!(
                        batch_routed > 0,
                        "{label}: batch: no layer was device-routed"
                    );
                }
                let dev_again = batch_run(&e, &feed);
                e.set_device_routed(false);
                let host_again = batch_run(&e, &feed);
                let w1 = compare_into(&label, &dev, &host, TOLERANCE, &mut failures);
                let batch_label = format!("{label} batch 3");
                let w3 = compare_into(
                    &batch_label,
                    &dev_batch,
                    &host_batch,
                    BATCH_TOLERANCE,
                    &mut failures,
                );
                let (host_cpu, dev_cpu) = (
                    worst_rel_l2(&host_batch, &cpu_batch),
                    worst_rel_l2(&dev_batch, &cpu_batch),
                );
                let slack = CPU_SLACK_ABS.max(CPU_SLACK_REL * host_cpu);
                if dev_cpu > host_cpu + slack {
                    failures.push(format!(
                        "{batch_label}: {dev_cpu:.3e} from the CPU backend, host-planned {host_cpu:.3e}"
                    ));
                }
                for (path, again, first) in [
                    ("device-routed", &dev_again, &dev_batch),
                    ("host-planned", &host_again, &host_batch),
                ] {
                    if again != first {
                        failures.push(format!("{batch_label}: {path} not deterministic"));
                    }
                }
                println!(
                    "{label}: {routed_layers} device-routed layers per decode step; worst rel-L2 vs host-planned {w1:.2e} (1 sequence), {w3:.2e} (batch of 3); batch vs the CPU backend: host-planned {:.2e}, device-routed {:.2e}; a second run of each: host-planned {:.2e}, device-routed {:.2e}",
                    host_cpu,
                    dev_cpu,
                    worst_rel_l2(&host_again, &host_batch),
                    worst_rel_l2(&dev_again, &dev_batch),
                );
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Live re-placement between steps: the device tables follow the expert table. Two engines with the
/// same placement and the same moves (an expert of every MoE layer swapped each time), one
/// device-routed and one host-planned, agree at the module's tolerance at every step, from graphs.
#[test]
fn device_routed_experts_follow_live_replacement() {
    let fixture = RoutedFixture::new("qwen3_moe");
    let opts = EngineOptions {
        cuda_graphs: true,
        live_placement: Some(crate::live_still()),
        ..gpu(8, PlacementStrategy::Uniform)
    };
    let (dev, host) = (fixture.load(&opts, true), fixture.load(&opts, false));
    let moe_layers: Vec<usize> = (0..dev.config().num_layers)
        .filter(|&l| dev.config().moe_layers[l])
        .collect();
    let (mut cd, mut ch) = (dev.new_cache(), host.new_cache());
    let mut worst = 0f32;
    // `tokens` through both engines, compared: the host-planned path's greedy next token, and how
    // many layers the device-routed engine routed on the device
    let mut step_both = |label: &str, tokens: &[u32]| {
        let d = step(&dev, &mut cd, tokens);
        let routed = dev.last_step_times().device_routed_layers;
        let h = step(&host, &mut ch, tokens);
        worst = worst.max(compare(label, &[d], std::slice::from_ref(&h)));
        (argmax(&h) as u32, routed)
    };
    let prompt: Vec<u32> = (3..9).collect();
    let (mut next, _) = step_both("live prompt", &prompt);
    let mut routed = 0;
    // (admit, evict): DRAM experts 8.. come in, resident 0..8 go out, then back
    let moves = [(12, 3), (9, 0), (3, 12), (15, 9)];
    for (i, &(admit, evict)) in moves.iter().enumerate() {
        for &l in &moe_layers {
            dev.move_expert_now(l, admit, evict).unwrap();
            host.move_expert_now(l, admit, evict).unwrap();
        }
        assert_eq!(dev.gpu_residency(), host.gpu_residency());
        for s in 0..3 {
            let (token, layers) = step_both(&format!("live move {i} step {s}"), &[next]);
            (next, routed) = (token, routed + layers);
        }
    }
    assert!(routed > 0, "no layer was device-routed");
    println!("live re-placement: worst rel-L2 device-routed vs host-planned {worst:.2e}");
}

/// The routed kernels' expert table over `weights` (each expert's gate_up and down matrices on the
/// device): the gate_up addresses, then the down ones, 0 for an expert that is not `resident`; and
/// the same addresses on the host.
fn expert_table(
    dev: &moe_kernels::cuda::GpuDevice,
    weights: (&[CudaSlice<bf16>], &[CudaSlice<bf16>]),
    resident: &[bool],
) -> (RoutedTable, Vec<u64>) {
    let experts = resident.len();
    let mut addrs = vec![0u64; 2 * experts];
    for e in (0..experts).filter(|&e| resident[e]) {
        addrs[e] = dev.addr(&weights.0[e]);
        addrs[experts + e] = dev.addr(&weights.1[e]);
    }
    let table = RoutedTable {
        addrs: dev.stream.clone_htod(&addrs).unwrap(),
        experts,
    };
    (table, addrs)
}

/// The routed kernels against a host reference on a step that the fixtures do not reach: 64 rows over
/// 5 experts (about 25 rows per expert, so each expert's rows span several of the kernels' chunks),
/// two of them not resident (left alone), widths that are not multiples of a warp's loads, every
/// gated activation (SwiGLU with and without its clamp, ReGLU, GELU-tanh). Bf16 inputs, f32 sums in
/// another order, activations rounded to bf16 on both sides: the added rows within 2e-3 rel-L2.
#[test]
fn routed_kernels_match_a_host_reference() {
    use crate::common::xorshift;
    use moe_kernels::cuda::ops::GateActivation;
    use moe_kernels::cuda::routed::{RoutedKernels, RoutedScratch, RoutedShape};
    use moe_kernels::cuda::GpuDevice;
    let dev = GpuDevice::open(0).unwrap();
    let s = &dev.stream;
    let kernels = RoutedKernels::load(&dev).unwrap();
    let (rows, k, experts, hd, inter) = (64usize, 2usize, 5usize, 72usize, 40usize);
    let resident = [true, false, true, false, true];
    let mut next = xorshift(17);
    let mut unit = move || (next() >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0;
    let rnd = |n: usize, scale: f32, u: &mut dyn FnMut() -> f32| -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(u() * scale)).collect()
    };
    let gate_up: Vec<Vec<bf16>> = (0..experts)
        .map(|_| rnd(2 * inter * hd, 0.3, &mut unit))
        .collect();
    let down: Vec<Vec<bf16>> = (0..experts)
        .map(|_| rnd(hd * inter, 0.3, &mut unit))
        .collect();
    let xb = rnd(rows * hd, 1.0, &mut unit);
    let x0: Vec<f32> = (0..rows * hd).map(|_| unit()).collect();
    let mut ids = Vec::with_capacity(rows * k);
    let mut w = Vec::with_capacity(rows * k);
    for r in 0..rows {
        let a = r % experts;
        let b = (a + 1 + (r / experts) % (experts - 1)) % experts;
        ids.extend([a as i32, b as i32]);
        w.extend([0.3 + 0.01 * (r % 7) as f32, 0.7 - 0.01 * (r % 5) as f32]);
    }
    let d_gu: Vec<_> = gate_up.iter().map(|m| s.clone_htod(m).unwrap()).collect();
    let d_dn: Vec<_> = down.iter().map(|m| s.clone_htod(m).unwrap()).collect();
    let (table, _) = expert_table(&dev, (&d_gu, &d_dn), &resident);
    let (d_ids, d_w, d_xb) = (
        s.clone_htod(&ids).unwrap(),
        s.clone_htod(&w).unwrap(),
        s.clone_htod(&xb).unwrap(),
    );
    let mut scratch = RoutedScratch::new(&dev, rows * k, hd, inter).unwrap();
    let shape = RoutedShape {
        rows,
        top_k: k,
        hidden: hd,
        inter,
    };
    let acts = [
        (GateActivation::Silu, None),
        (GateActivation::Silu, Some(0.5f32)),
        (GateActivation::Relu, None),
        (GateActivation::GeluTanh, None),
    ];
    for (act, limit) in acts {
        let f = |g: f32| match act {
            GateActivation::Silu => g / (1.0 + (-g).exp()),
            GateActivation::Relu => g.max(0.0),
            GateActivation::GeluTanh => {
                0.5 * g * (1.0 + (0.797_884_6 * (g + 0.044715 * g * g * g)).tanh())
            }
        };
        let mut want = vec![0f32; rows * hd];
        for r in 0..rows {
            for slot in 0..k {
                let e = ids[r * k + slot] as usize;
                if !resident[e] {
                    continue;
                }
                let dot = |m: &[bf16], row: usize, v: &[f32]| -> f32 {
                    v.iter()
                        .enumerate()
                        .map(|(c, x)| m[row * v.len() + c].to_f32() * x)
                        .sum()
                };
                let xr: Vec<f32> = xb[r * hd..(r + 1) * hd]
                    .iter()
                    .map(|v| v.to_f32())
                    .collect();
                let a: Vec<f32> = (0..inter)
                    .map(|j| {
                        let (mut g, mut u) =
                            (dot(&gate_up[e], j, &xr), dot(&gate_up[e], inter + j, &xr));
                        if let Some(l) = limit {
                            g = g.min(l);
                            u = u.clamp(-l, l);
                        }
                        bf16::from_f32(f(g) * u).to_f32()
                    })
                    .collect();
                for j in 0..hd {
                    want[r * hd + j] += w[r * k + slot] * dot(&down[e], j, &a);
                }
            }
        }
        let mut d_x = s.clone_htod(&x0).unwrap();
        kernels
            .forward(
                &dev,
                shape,
                (&d_ids, &d_w),
                &table,
                &d_xb,
                (act, limit),
                &mut scratch,
                &mut d_x,
            )
            .unwrap();
        let got: Vec<f32> = s
            .clone_dtoh(&d_x)
            .unwrap()
            .iter()
            .zip(&x0)
            .map(|(a, b)| a - b)
            .collect();
        let err = rel_l2(&got, &want);
        println!("routed kernels, {act:?} limit {limit:?}: rel-L2 {err:.2e} against the host");
        assert!(err <= TOLERANCE, "{act:?} limit {limit:?}: rel-L2 {err}");
    }
}

/// `prompts` prefilled one by one, then one decode step per entry of `feed` (a token per sequence):
/// each decode step's logits.
fn decode_steps(e: &Engine, prompts: &[Vec<u32>], feed: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let mut caches: Vec<_> = prompts.iter().map(|_| e.new_cache()).collect();
    for (c, p) in caches.iter_mut().zip(prompts) {
        step(e, c, p);
    }
    decode_batch(e, &mut caches, feed)
}

/// Every expert resident: each decode step stays on the device, so its whole layer stack is one
/// CUDA graph per row count (two graphs for steps of 1 and 3 rows, not one per layer), whose logits
/// equal eager steps' (same kernels in the same order: 1e-5 rel-L2) and the host-planned path's at
/// the module's tolerance. GQA fixtures with a dense first layer (glm4_moe), a router on the layer
/// input (smallthinker) and plain top-k (qwen3_moe); 10 decode steps, so that the 14-token prompt
/// crosses a cache block boundary.
#[test]
fn all_resident_decode_steps_replay_as_one_graph() {
    for name in ["qwen3_moe", "glm4_moe", "smallthinker"] {
        let fixture = RoutedFixture::new(name);
        let all = fixture.experts;
        let (graphed, eager, host) = (
            fixture.gpu(all, true, true),
            fixture.gpu(all, false, true),
            fixture.gpu(all, true, false),
        );
        let mut worst = (0f32, 0f32);
        for seqs in [1, 3] {
            let (prompts, feed) = (batch_prompts(seqs), batch_feed(seqs, 10));
            let g = decode_steps(&graphed, &prompts, &feed);
            let layers = graphed.last_step_times().device_routed_layers;
            assert!(layers > 0, "{name}: no layer was device-routed");
            let e = decode_steps(&eager, &prompts, &feed);
            let h = decode_steps(&host, &prompts, &feed);
            for (i, (a, b)) in g.iter().zip(&e).enumerate() {
                let err = rel_l2(a, b);
                worst.0 = worst.0.max(err);
                assert!(
                    err <= 1e-5,
                    "{name} {seqs} sequences step {i}: graph vs eager {err}"
                );
            }
            let label = format!("{name}, every expert resident, {seqs} sequences");
            worst.1 = worst.1.max(compare(&label, &g, &h));
        }
        assert_eq!(
            graphed.cuda_graphs_captured(),
            2,
            "{name}: one whole-step graph per row count (1 and 3)"
        );
        println!(
            "{name}: whole-step graphs vs eager worst rel-L2 {:.2e}, vs host-planned {:.2e}",
            worst.0, worst.1
        );
    }
}

/// Where a device-routed decode step's GPU time goes in its experts: the routed kernels (grouping,
/// gate_up with the activation, down, combine) against the host-planned path's expert kernels for
/// the same products (`gemm_bf16_items` for gate_up and down, `gated_mul` between; its host
/// planning, copies, gather and combine left out), at SmallThinker-21B's expert shape (hidden 2560,
/// intermediate 768, 64 experts, top-8) with 1, 8 and 32 rows, and cuBLAS's one-row GEMMs of the
/// attention projections' shapes. Prints µs per layer and the weight bytes read per second (each
/// chosen expert's weights once); asserts only that both ran.
#[test]
fn routed_kernels_time_at_smallthinker_21b_shape() {
    use cudarc::driver::sys::CUevent_flags;
    use moe_kernels::cuda::ops::GateActivation;
    use moe_kernels::cuda::routed::{RoutedKernels, RoutedScratch, RoutedShape};
    use moe_kernels::cuda::{GemmItem, GpuDevice};
    let dev = GpuDevice::open(0).unwrap();
    let s = dev.stream.clone();
    let kernels = RoutedKernels::load(&dev).unwrap();
    let (experts, k, hd, inter) = (64usize, 8usize, 2560usize, 768usize);
    let gate_up: Vec<_> = (0..experts)
        .map(|_| s.alloc_zeros::<bf16>(2 * inter * hd).unwrap())
        .collect();
    let down: Vec<_> = (0..experts)
        .map(|_| s.alloc_zeros::<bf16>(hd * inter).unwrap())
        .collect();
    let (table, addrs) = expert_table(&dev, (&gate_up, &down), &vec![true; experts]);
    let most_rows = 32;
    let mut scratch = RoutedScratch::new(&dev, most_rows * k, hd, inter).unwrap();
    let xb = s.alloc_zeros::<bf16>(most_rows * hd).unwrap();
    // the host-planned path's gathered rows, gate_up and activations (a row per routed pair)
    let xe = s.alloc_zeros::<bf16>(most_rows * k * hd).unwrap();
    let (gu, mut act) = (
        s.alloc_zeros::<f32>(most_rows * k * 2 * inter).unwrap(),
        s.alloc_zeros::<bf16>(most_rows * k * inter).unwrap(),
    );
    let ye = s.alloc_zeros::<f32>(most_rows * k * hd).unwrap();
    let mut gemm_table = s
        .alloc_zeros::<u64>(moe_kernels::cuda::table_len(experts, most_rows * k))
        .unwrap();
    let event = || {
        dev.ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap()
    };
    let reps = 50;
    // µs per call of `f` (after 3 warm-up calls)
    let time = |f: &mut dyn FnMut()| -> f64 {
        for _ in 0..3 {
            f();
        }
        let (a, b) = (event(), event());
        a.record(&s).unwrap();
        for _ in 0..reps {
            f();
        }
        b.record(&s).unwrap();
        s.synchronize().unwrap();
        a.elapsed_ms(&b).unwrap() as f64 * 1e3 / reps as f64
    };
    for rows in [1usize, 8, 32] {
        // row r takes experts r·13 + 8s (distinct within a row)
        let ids: Vec<i32> = (0..rows * k)
            .map(|p| ((p / k) * 13 + 8 * (p % k)) as i32 % experts as i32)
            .collect();
        let w = vec![1.0f32 / k as f32; rows * k];
        let (d_ids, d_w) = (s.clone_htod(&ids).unwrap(), s.clone_htod(&w).unwrap());
        let mut x = s.alloc_zeros::<f32>(rows * hd).unwrap();
        let shape = RoutedShape {
            rows,
            top_k: k,
            hidden: hd,
            inter,
        };
        let routed = time(&mut || {
            kernels
                .forward(
                    &dev,
                    shape,
                    (&d_ids, &d_w),
                    &table,
                    &xb,
                    (GateActivation::Relu, None),
                    &mut scratch,
                    &mut x,
                )
                .unwrap()
        });
        // the host plan's groups: each chosen expert's rows consecutive, experts ascending
        let mut chosen: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
        chosen.sort_unstable();
        let mut groups: Vec<(usize, usize, usize)> = Vec::new(); // (expert, row0, rows)
        for (i, &e) in chosen.iter().enumerate() {
            match groups.last_mut() {
                Some(g) if g.0 == e => g.2 += 1,
                _ => groups.push((e, i, 1)),
            }
        }
        let (bf, f4) = (2u64, 4u64);
        let items = |x: u64, xw: usize, y: u64, yw: usize, ws: &[u64]| -> Vec<GemmItem> {
            groups
                .iter()
                .map(|&(e, r0, n)| GemmItem {
                    x: x + (r0 * xw) as u64 * bf,
                    w: ws[e],
                    y: y + (r0 * yw) as u64 * f4,
                    rows: n,
                })
                .collect()
        };
        let gate_up_items = items(
            dev.addr(&xe),
            hd,
            dev.addr(&gu),
            2 * inter,
            &addrs[..experts],
        );
        let down_items = items(dev.addr(&act), inter, dev.addr(&ye), hd, &addrs[experts..]);
        let pairs = rows * k;
        let planned = time(&mut || {
            // SAFETY: every item's rows lie inside the buffers above (sized for 32 rows · top-8) and
            // every weight address is a whole matrix of the shape; all outlive the synchronisation.
            unsafe {
                dev.gemm_bf16_items(&gate_up_items, 2 * inter, hd, &mut gemm_table)
                    .unwrap();
            }
            dev.gated_mul(&gu, (pairs, inter), GateActivation::Relu, None, &mut act)
                .unwrap();
            // SAFETY: as above.
            unsafe {
                dev.gemm_bf16_items(&down_items, hd, inter, &mut gemm_table)
                    .unwrap();
            }
        });
        let bytes = (groups.len() * 3 * hd * inter * 2) as f64;
        println!(
            "SmallThinker-21B experts, {rows} rows ({} experts chosen): routed kernels {routed:.1} µs ({:.0} GB/s), host-planned expert GEMMs {planned:.1} µs ({:.0} GB/s)",
            groups.len(),
            bytes / routed * 1e-3,
            bytes / planned * 1e-3
        );
        assert!(routed > 0.0 && planned > 0.0);
    }
    // The rest of a layer's segment goes through cuBLAS at one row: q_proj's and o_proj's shapes
    // (SmallThinker-21B: 28 heads × 128 = 3584 wide) for comparison with the experts above.
    let w = s.alloc_zeros::<bf16>(3584 * hd).unwrap();
    let x1 = s.alloc_zeros::<bf16>(3584).unwrap();
    let mut y1 = s.alloc_zeros::<f32>(3584).unwrap();
    for (name, m, kk) in [("q_proj", 3584, hd), ("o_proj", hd, 3584)] {
        let t = time(&mut || dev.gemm_bf16(&x1, &w, &mut y1, 1, m, kk, false).unwrap());
        let gbs = (m * kk * 2) as f64 / t * 1e-3;
        println!("cuBLAS one-row GEMM of {name}'s shape ({m} × {kk}): {t:.1} µs ({gbs:.0} GB/s)");
    }
}
