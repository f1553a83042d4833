//! The decode segment's fused kernels (`moe_kernels::cuda::ops::segment`, `paged_attention_warps`)
//! against the ops they replace and host references, and the whole segment switched between them
//! on one engine. Each test names its tolerance.
use crate::common::{rel_l2, xorshift};
use half::bf16;
use moe_kernels::cuda::ops::{
    reference, CacheAppend, CacheRows, FusedRouter, GemvGrid, GemvMat, HandoffPort, NormRows,
    PagedIndex, RotaryStyle, Rotation, RouterKind,
};
use moe_kernels::cuda::GpuDevice;

/// Uniform values in [-a, a).
fn values(n: usize, a: f32, seed: u64) -> Vec<f32> {
    let mut next = xorshift(seed);
    (0..n)
        .map(|_| ((next() >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0) * a)
        .collect()
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// `gemv_bf16` over three matrices at once (rows 1, 2, 3 and 8, the 1- and 2-row entries and the
/// general one; inputs of 520, not a multiple of the 256 inputs a warp reads per step, and of 4096
/// and 6152, whose rows are split over 2 and 4 warps; output counts not multiples of the 8 rows of a
/// block) against cuBLAS (`gemm_bf16`) and an f64 host product of the same bf16 values: rel-L2 ≤
/// 1e-5 against both (f32 sums in another order), and so when accumulating into existing rows. The
/// second matrix has a bias, which the launch adds as `add_bias` after cuBLAS does (the same f32 add);
/// the launch on a grid of 3 blocks (`GemvGrid::AtMost`, each striding over the rows, as a resident
/// grid does on wide matrices) gives the same values bit for bit. Shapes it does not take (9 rows, an input of 12) are refused before any
/// launch.
#[test]
fn gemv_bf16_matches_cublas_and_host() {
    let dev = GpuDevice::open(0).unwrap();
    for inp in [520, 4096, 6152] {
        gemv_bf16_case(&dev, inp);
    }
}

fn gemv_bf16_case(dev: &GpuDevice, inp: usize) {
    let s = &dev.stream;
    let outs = [300usize, 64, 72];
    let ws: Vec<Vec<f32>> = outs
        .iter()
        .enumerate()
        .map(|(i, &o)| {
            to_bf16(&values(o * inp, 0.1, 7 + i as u64))
                .iter()
                .map(|b| b.to_f32())
                .collect()
        })
        .collect();
    let dw: Vec<_> = ws
        .iter()
        .map(|w| s.clone_htod(&to_bf16(w)).unwrap())
        .collect();
    let bias_host = values(outs[1], 0.5, 13);
    let bias = s.clone_htod(&bias_host).unwrap();
    let biases = [None, Some(&bias), None];
    for rows in [1usize, 2, 3, 8] {
        let x: Vec<f32> = to_bf16(&values(rows * inp, 1.0, 99 + rows as u64))
            .iter()
            .map(|b| b.to_f32())
            .collect();
        let dx = s.clone_htod(&to_bf16(&x)).unwrap();
        for accumulate in [false, true] {
            let base: Vec<Vec<f32>> = outs
                .iter()
                .map(|&o| values(rows * o, 1.0, 5 + o as u64))
                .collect();
            let launch = |grid: GemvGrid| {
                let mut ys: Vec<_> = base.iter().map(|b| s.clone_htod(b).unwrap()).collect();
                let mut mats: Vec<GemvMat> = ys
                    .iter_mut()
                    .zip(&dw)
                    .zip(outs)
                    .zip(biases)
                    .map(|(((y, w), out), bias)| GemvMat { w, y, out, bias })
                    .collect();
                dev.gemv_bf16_grid(&dx, (rows, inp), &mut mats, accumulate, grid)
                    .unwrap();
                ys
            };
            let (ys, resident) = (launch(GemvGrid::PerRows), launch(GemvGrid::AtMost(3)));
            let mut cublas: Vec<_> = base.iter().map(|b| s.clone_htod(b).unwrap()).collect();
            for (((y, w), &out), b) in cublas.iter_mut().zip(&dw).zip(&outs).zip(biases) {
                dev.gemm_bf16(&dx, w, y, rows, out, inp, accumulate)
                    .unwrap();
                if let Some(b) = b {
                    dev.add_bias(y, b, (rows, out)).unwrap();
                }
            }
            for (m, &out) in outs.iter().enumerate() {
                let got = s.clone_dtoh(&ys[m]).unwrap();
                let want_blas = s.clone_dtoh(&cublas[m]).unwrap();
                let mut host = if accumulate {
                    base[m].clone()
                } else {
                    vec![0f32; rows * out]
                };
                for t in 0..rows {
                    for r in 0..out {
                        let dot: f64 = (0..inp)
                            .map(|c| x[t * inp + c] as f64 * ws[m][r * inp + c] as f64)
                            .sum();
                        let b = if m == 1 { bias_host[r] as f64 } else { 0.0 };
                        host[t * out + r] = (host[t * out + r] as f64 + dot + b) as f32;
                    }
                }
                let label = format!("{inp} inputs rows {rows} matrix {m} accumulate {accumulate}");
                assert!(
                    got == s.clone_dtoh(&resident[m]).unwrap(),
                    "{label}: the resident grid differs"
                );
                let (e_blas, e_host) = (rel_l2(&got, &want_blas), rel_l2(&got, &host));
                assert!(
                    e_blas <= 1e-5 && e_host <= 1e-5,
                    "{label}: vs cuBLAS {e_blas}, vs host {e_host}"
                );
            }
        }
    }
    if inp != 520 {
        return;
    }
    let mut y = s.alloc_zeros::<f32>(9 * 300).unwrap();
    let x9 = s.alloc_zeros::<bf16>(9 * inp).unwrap();
    let mut mats = [GemvMat {
        w: &dw[0],
        y: &mut y,
        out: 300,
        bias: None,
    }];
    let e = dev.gemv_bf16(&x9, (9, inp), &mut mats, false).unwrap_err();
    assert!(e.to_string().contains("9 rows"), "{e}");
    let e = dev.gemv_bf16(&x9, (1, 12), &mut mats, false).unwrap_err();
    assert!(e.to_string().contains("12 inputs"), "{e}");
}

/// `qk_norm_rope_append` gives exactly what `qk_norm_rope` on q, on k and `kv_append` give (the same
/// f32 operations per head, bit for bit): with and without per-head norms, with and without RoPE
/// (NoPE layers), head dims 128 and 64, 3 rows appended at scattered cache slots; cache rows it
/// does not own stay untouched.
#[test]
fn norm_rope_append_matches_the_separate_ops() {
    let dev = GpuDevice::open(0).unwrap();
    let s = &dev.stream;
    let (rows, heads, kv_heads) = (3usize, 8usize, 2usize);
    for (dh, norms, rope) in [
        (128usize, true, true),
        (128, false, true),
        (64, true, false),
    ] {
        let width = kv_heads * dh;
        let q = values(rows * heads * dh, 2.0, 1);
        let k = values(rows * width, 2.0, 2);
        let v = values(rows * width, 2.0, 3);
        let qn = s.clone_htod(&values(dh, 1.0, 4)).unwrap();
        let kn = s.clone_htod(&values(dh, 1.0, 5)).unwrap();
        let positions = s.clone_htod(&[0i32, 17, 4000]).unwrap();
        let inv_freq: Vec<f32> = (0..dh / 2)
            .map(|i| 1e4f32.powf(-2.0 * i as f32 / dh as f32))
            .collect();
        let inv_freq = s.clone_htod(&inv_freq).unwrap();
        let rotation = Rotation {
            positions: &positions,
            inv_freq: &inv_freq,
            attn_factor: 1.0,
            rotary_dim: dh,
            offset: 0,
            style: RotaryStyle::Neox,
        };
        let rot = rope.then_some(&rotation);
        let slots = s.clone_htod(&[37i32, 2, 90]).unwrap();
        let cache_rows = 100;
        let stale = to_bf16(&values(cache_rows * width, 1.0, 6));
        let (qn_opt, kn_opt) = if norms {
            (Some(&qn), Some(&kn))
        } else {
            (None, None)
        };
        let mut outs = Vec::new();
        for fused in [false, true] {
            let (mut dq, mut dk) = (s.clone_htod(&q).unwrap(), s.clone_htod(&k).unwrap());
            let dv = s.clone_htod(&v).unwrap();
            let (mut kc, mut vc) = (s.clone_htod(&stale).unwrap(), s.clone_htod(&stale).unwrap());
            if fused {
                let cache = CacheAppend {
                    k_cache: &mut kc,
                    v_cache: &mut vc,
                    slot_of_row: &slots,
                };
                dev.qk_norm_rope_append(
                    (&mut dq, &mut dk, &dv),
                    (rows, heads, kv_heads, dh),
                    (qn_opt, kn_opt, 1e-6),
                    rot,
                    cache,
                )
                .unwrap();
            } else {
                dev.qk_norm_rope(&mut dq, (rows, heads, dh), qn_opt.map(|w| (w, 1e-6)), rot)
                    .unwrap();
                dev.qk_norm_rope(
                    &mut dk,
                    (rows, kv_heads, dh),
                    kn_opt.map(|w| (w, 1e-6)),
                    rot,
                )
                .unwrap();
                dev.kv_append(&dk, &dv, (rows, width, width), &mut kc, &mut vc, &slots, 16)
                    .unwrap();
            }
            outs.push((
                s.clone_dtoh(&dq).unwrap(),
                s.clone_dtoh(&dk).unwrap(),
                s.clone_dtoh(&kc).unwrap(),
                s.clone_dtoh(&vc).unwrap(),
            ));
        }
        let label = format!("head dim {dh}, norms {norms}, rope {rope}");
        assert!(outs[0].0 == outs[1].0, "{label}: q differs");
        assert!(outs[0].1 == outs[1].1, "{label}: k differs");
        assert!(outs[0].2 == outs[1].2, "{label}: k cache differs");
        assert!(outs[0].3 == outs[1].3, "{label}: v cache differs");
    }
}

/// The attention output (`len` bf16 values as f32, 7.0 where the call wrote nothing) of the warps
/// kernel or the tile kernel, for `rows` of `call` (q, caches, index, heads, scale and window).
#[allow(clippy::type_complexity)]
fn attention_rows(
    dev: &GpuDevice,
    warps: bool,
    (q, caches, index, hw, scale_window): (
        &cudarc::driver::CudaSlice<f32>,
        (CacheRows<'_>, CacheRows<'_>),
        &PagedIndex<'_>,
        (usize, usize, usize),
        (f32, Option<usize>),
    ),
    rows: std::ops::Range<usize>,
    len: usize,
) -> Vec<f32> {
    let s = &dev.stream;
    let mut out = s.clone_htod(&vec![bf16::from_f32(7.0); len]).unwrap();
    if warps {
        dev.paged_attention_warps(q, caches, index, hw, scale_window, rows, &mut out)
    } else {
        dev.paged_attention(q, caches, index, hw, scale_window, rows, &mut out)
    }
    .unwrap();
    s.clone_dtoh(&out)
        .unwrap()
        .iter()
        .map(|b| b.to_f32())
        .collect()
}

/// `paged_attention_warps` against the f64 host attention (`reference::causal_attention` over the
/// bf16 cache values) and the tile kernel it replaces in the decode segment: one decode row per
/// sequence at contexts of 1, 5, 33, 300 and 2100 positions (blocks scattered over the pool), GQA
/// groups of 4 and 1, head dims 128 and 64, without and with a sliding window of 37, and rows
/// 2.. alone (`row0`): rel-L2 ≤ 5e-3 per (row, head) against both (the bf16 rounding of the
/// output: ≤ 2e-3 expected); rows outside the call stay untouched. 8-bit caches: against the tile
/// kernel, same bound.
#[test]
fn paged_attention_warps_matches_host_and_tile_kernel() {
    use moe_kernels::cuda::kv_q8::{KvCode, Q8Rows};
    let dev = GpuDevice::open(0).unwrap();
    let s = &dev.stream;
    const BLOCK: usize = 16;
    let contexts = [1usize, 5, 33, 300, 2100];
    let rows = contexts.len();
    let max_blocks = contexts.iter().max().unwrap().div_ceil(BLOCK);
    let pool_blocks = rows * max_blocks;
    // sequence r's block j: pool block (j * rows + r) counted from the end
    let tables: Vec<i32> = (0..rows)
        .flat_map(|r| (0..max_blocks).map(move |j| (pool_blocks - 1 - (j * rows + r)) as i32))
        .collect();
    let slot = |r: usize, p: usize| tables[r * max_blocks + p / BLOCK] as usize * BLOCK + p % BLOCK;
    let d_tables = s.clone_htod(&tables).unwrap();
    let d_seq = s.clone_htod(&(0..rows as i32).collect::<Vec<_>>()).unwrap();
    let pos: Vec<i32> = contexts.iter().map(|&c| c as i32 - 1).collect();
    let d_pos = s.clone_htod(&pos).unwrap();
    let index = PagedIndex {
        block_tables: &d_tables,
        max_blocks,
        seq_of_row: &d_seq,
        pos_of_row: &d_pos,
        block_size: BLOCK,
    };
    for (heads, kv_heads, dh) in [(8usize, 2usize, 128usize), (4, 4, 64)] {
        let width = kv_heads * dh;
        let scale = 1.0 / (dh as f32).sqrt();
        let cache_len = pool_blocks * BLOCK * width;
        let kc: Vec<f32> = to_bf16(&values(cache_len, 2.0, 11))
            .iter()
            .map(|b| b.to_f32())
            .collect();
        let vc: Vec<f32> = to_bf16(&values(cache_len, 1.0, 12))
            .iter()
            .map(|b| b.to_f32())
            .collect();
        let (dkc, dvc) = (
            s.clone_htod(&to_bf16(&kc)).unwrap(),
            s.clone_htod(&to_bf16(&vc)).unwrap(),
        );
        let q = values(rows * heads * dh, 1.0, 13);
        let dq = s.clone_htod(&q).unwrap();
        let caches = (CacheRows::Bf16(&dkc), CacheRows::Bf16(&dvc));
        for window in [None, Some(37usize)] {
            let hw = (heads, kv_heads, dh);
            let run = |warps: bool, range: std::ops::Range<usize>| {
                let call = (&dq, caches, &index, hw, (scale, window));
                attention_rows(&dev, warps, call, range, rows * heads * dh)
            };
            let (warps, tiles, tail) =
                (run(true, 0..rows), run(false, 0..rows), run(true, 2..rows));
            for r in 0..rows {
                // the sequence's keys as contiguous rows for the host reference
                let keys = contexts[r];
                let gather = |c: &[f32]| -> Vec<f32> {
                    (0..keys)
                        .flat_map(|p| c[slot(r, p) * width..][..width].to_vec())
                        .collect()
                };
                let qr = &q[r * heads * dh..][..heads * dh];
                let host = reference::causal_attention(
                    qr,
                    &gather(&kc),
                    &gather(&vc),
                    (1, keys - 1),
                    (heads, kv_heads, dh),
                    scale,
                    window,
                );
                for h in 0..heads {
                    let at = r * heads * dh + h * dh;
                    let (w, t) = (&warps[at..at + dh], &tiles[at..at + dh]);
                    let label = format!("heads {heads}/{kv_heads} dh {dh} window {window:?} context {keys} head {h}");
                    let (e_host, e_tiles) = (rel_l2(w, &host[h * dh..][..dh]), rel_l2(w, t));
                    assert!(
                        e_host <= 5e-3 && e_tiles <= 5e-3,
                        "{label}: vs host {e_host}, vs tiles {e_tiles}"
                    );
                    let tail_row = &tail[at..at + dh];
                    if r < 2 {
                        assert!(
                            tail_row.iter().all(|&x| x == 7.0),
                            "{label}: row outside the call written"
                        );
                    } else {
                        assert_eq!(tail_row, w, "{label}: row0 2 differs");
                    }
                }
            }
        }
        // 8-bit rows of the same values: the two kernels read them with the same `at`
        for code in [KvCode::Int8, KvCode::E4m3] {
            let positions = pool_blocks * BLOCK;
            let mut kq = Q8Rows::alloc(&dev, positions, (kv_heads, dh), code).unwrap();
            let mut vq = Q8Rows::alloc(&dev, positions, (kv_heads, dh), code).unwrap();
            let all_slots = s
                .clone_htod(&(0..positions as i32).collect::<Vec<_>>())
                .unwrap();
            let (kf, vf) = (s.clone_htod(&kc).unwrap(), s.clone_htod(&vc).unwrap());
            dev.kv_append_q8((&kf, &vf), positions, &mut kq, &mut vq, &all_slots)
                .unwrap();
            let caches = (CacheRows::Q8(&kq), CacheRows::Q8(&vq));
            let hw = (heads, kv_heads, dh);
            let run = |warps: bool| {
                let call = (&dq, caches, &index, hw, (scale, None));
                attention_rows(&dev, warps, call, 0..rows, rows * heads * dh)
            };
            let (w, t) = (run(true), run(false));
            for (i, (a, b)) in w.chunks(dh).zip(t.chunks(dh)).enumerate() {
                let e = rel_l2(a, b);
                assert!(
                    e <= 5e-3,
                    "{code:?} heads {heads}/{kv_heads} dh {dh} (row, head) {i}: {e}"
                );
            }
        }
    }
}

/// Inputs of the router tests' rows.
const ROUTER_INPUTS: usize = 2048;

/// The routers the fused router's tests cover, as (experts, k, kind, with a correction bias): softmax
/// top-8 of 128 with and without renormalisation (Qwen3), sigmoid + correction bias with 8 groups
/// keeping 4 of 256 (DeepSeek-V3: the block top-k), sigmoid + correction bias in one group, top-8 of
/// 128 (GLM-4.5-Air: the warp top-k), softmax top-6 of 64 (SmallThinker-21B).
fn router_cases() -> [(usize, usize, RouterKind, bool); 5] {
    let sigmoid = |n_group, topk_group, scaling| RouterKind::SigmoidGrouped {
        n_group,
        topk_group,
        renormalize: true,
        scaling,
    };
    [
        (128, 8, RouterKind::Softmax { renormalize: true }, false),
        (128, 8, RouterKind::Softmax { renormalize: false }, false),
        (256, 8, sigmoid(8, 4, 2.5), true),
        (128, 8, sigmoid(1, 1, 1.0), true),
        (64, 6, RouterKind::Softmax { renormalize: true }, false),
    ]
}

/// `router_gemv_topk` against cuBLAS's f32 GEMM (`gemm_f32`) and the top-k kernel (`router_topk`)
/// on its own logits: logits within 1e-5 rel-L2 (f32 sums in another order), and the ids
/// `router_topk` gives on them, weights within 1e-6 (a warp's softmax sum in another order), for
/// every router of [`router_cases`]; rows 1, 5 and 8; three launches in a row (the finished-block
/// counter is back at 0 after each). Publishing in the same launch leaves exactly those ids and
/// weights (and the input rows, when asked; none otherwise) in the hand-off's host buffers, with DOWN
/// raised.
#[test]
fn router_gemv_topk_matches_gemm_and_topk() {
    let dev = GpuDevice::open(0).unwrap();
    let s = &dev.stream;
    let inp = ROUTER_INPUTS;
    for (experts, k, kind, with_bias) in router_cases() {
        let w = s.clone_htod(&values(experts * inp, 0.05, 21)).unwrap();
        let bias = s.clone_htod(&values(experts, 0.05, 22)).unwrap();
        let router = FusedRouter {
            w: &w,
            experts,
            k,
            kind: &kind,
            bias: with_bias.then_some(&bias),
        };
        for rows in [1usize, 5, 8] {
            let x = s
                .clone_htod(&values(rows * inp, 1.0, 23 + rows as u64))
                .unwrap();
            let mut logits = s.alloc_zeros::<f32>(rows * experts).unwrap();
            let mut ids = s.alloc_zeros::<i32>(rows * k).unwrap();
            let mut wts = s.alloc_zeros::<f32>(rows * k).unwrap();
            for _ in 0..3 {
                let routing = (&mut ids, &mut wts);
                dev.router_gemv_topk(&x, (rows, inp), &router, &mut logits, routing, None)
                    .unwrap();
            }
            let mut blas = s.alloc_zeros::<f32>(rows * experts).unwrap();
            dev.gemm_f32(&x, &w, &mut blas, rows, experts, inp).unwrap();
            let mut ids2 = s.alloc_zeros::<i32>(rows * k).unwrap();
            let mut wts2 = s.alloc_zeros::<f32>(rows * k).unwrap();
            let b = with_bias.then_some(&bias);
            dev.router_topk(&logits, (rows, experts, k), &kind, b, &mut ids2, &mut wts2)
                .unwrap();
            let got = s.clone_dtoh(&logits).unwrap();
            let e = rel_l2(&got, &s.clone_dtoh(&blas).unwrap());
            let label = format!("{experts} experts top-{k} {kind:?} rows {rows}");
            assert!(e <= 1e-5, "{label}: logits vs cuBLAS {e}");
            assert_eq!(
                s.clone_dtoh(&ids).unwrap(),
                s.clone_dtoh(&ids2).unwrap(),
                "{label}: ids"
            );
            // (the warp top-k of ungrouped routers sums the softmax in another order: 1 ulp)
            let (w1, w2) = (s.clone_dtoh(&wts).unwrap(), s.clone_dtoh(&wts2).unwrap());
            for (a, b) in w1.iter().zip(&w2) {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
                    "{label}: weights {a} vs {b}"
                );
            }
            // publishing in the same launch: the hand-off's host buffers and DOWN flag, as
            // `handoff_publish` leaves them
            for with_rows in [true, false] {
                let port = HandoffPort::new(&dev, rows * k, rows * inp).unwrap();
                let routing = (&mut ids, &mut wts);
                let publish = Some((&port, with_rows));
                dev.router_gemv_topk(&x, (rows, inp), &router, &mut logits, routing, publish)
                    .unwrap();
                s.synchronize().unwrap();
                assert!(port.take_published(), "{label}: DOWN not raised");
                // SAFETY: the stream is idle (synchronised above): no GPU write is pending.
                let (hi, hw, hx) = unsafe {
                    (
                        port.ids.host(rows * k).to_vec(),
                        port.w.host(rows * k).to_vec(),
                        port.x.host(rows * inp).to_vec(),
                    )
                };
                assert_eq!(hi, s.clone_dtoh(&ids).unwrap(), "{label}: published ids");
                assert_eq!(
                    hw,
                    s.clone_dtoh(&wts).unwrap(),
                    "{label}: published weights"
                );
                let want_x = if with_rows {
                    s.clone_dtoh(&x).unwrap()
                } else {
                    vec![0f32; rows * inp]
                };
                assert_eq!(
                    hx, want_x,
                    "{label}: published rows (with_rows {with_rows})"
                );
            }
        }
    }
}

/// The whole model with the fused segment (norms folded into the q/k/v and router launches, the
/// default) against the fused segment with separate norms (`fold-norms` off: the same values, so
/// within 1e-6, expected identical), the old kernels and the o projection by the segment's GEMV
/// (`o-gemv`: another summation order, 1e-2) on the same engine (`bench decode --ab`'s switches),
/// CUDA graphs on: qwen3_moe (q/k norms, softmax router), glm4_moe
/// (sigmoid grouped router with correction bias), qwen2_moe (q/k/v biases, shared expert), llama
/// (dense) and smallthinker (router on the layer input, NoPE layers, sliding windows); prompts of 3
/// and 14 tokens, then 12 decode steps teacher-forced on the fused run's tokens: every step's logits
/// within 1e-2 rel-L2 of the old kernels' (f32 summation order and the bf16 rounding of the
/// attention output; a router near-tie flipping an expert would exceed it), and graphs captured for
/// both.
#[test]
fn fused_segment_matches_old_kernels_end_to_end() {
    use crate::common::gpu::gpu;
    use crate::common::{fixtures_root, step};
    use moe_daemon::engine::gpu::switches::DecodeSwitch;
    use moe_daemon::engine::placement::PlacementStrategy;
    use moe_daemon::engine::sampling::argmax;
    use moe_daemon::engine::{Engine, EngineOptions};
    for name in [
        "qwen3_moe",
        "glm4_moe",
        "qwen2_moe",
        "llama",
        "smallthinker",
    ] {
        let dir = fixtures_root().join(name).join("model_bf16");
        let opts = EngineOptions {
            cuda_graphs: true,
            ..gpu(0, PlacementStrategy::Uniform)
        };
        let e = Engine::load(&dir, &opts).unwrap();
        let prompts: [Vec<u32>; 2] = [vec![1, 2, 3], (10..24).collect()];
        let mut forced: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
        let mut runs = Vec::new();
        // (fused segment, norms folded, o GEMV): the default first, its tokens forced on the others
        let configs = [
            (true, true, false),
            (true, false, false),
            (false, false, false),
            (true, true, true),
        ];
        for (ri, (fused, fold, o_gemv)) in configs.into_iter().enumerate() {
            assert!(e.set_decode_switch(DecodeSwitch::FusedSegment, fused));
            assert!(e.set_decode_switch(DecodeSwitch::FoldNorms, fold));
            assert!(e.set_decode_switch(DecodeSwitch::OGemv, o_gemv));
            let mut logits = Vec::new();
            for (pi, prompt) in prompts.iter().enumerate() {
                let mut cache = e.new_cache();
                let mut last = step(&e, &mut cache, prompt);
                logits.push(last.clone());
                for i in 0..12 {
                    if ri == 0 {
                        forced[pi].push(argmax(&last) as u32);
                    }
                    last = step(&e, &mut cache, &[forced[pi][i]]);
                    logits.push(last.clone());
                }
            }
            runs.push(logits);
        }
        assert!(e.set_decode_switch(DecodeSwitch::FusedSegment, true));
        assert!(e.set_decode_switch(DecodeSwitch::FoldNorms, true));
        assert!(e.set_decode_switch(DecodeSwitch::OGemv, false));
        assert!(e.cuda_graphs_captured() > 0, "{name}: no graph captured");
        let mut worst = [0f32; 3];
        for (i, a) in runs[0].iter().enumerate() {
            let errs = [1, 2, 3].map(|r| rel_l2(a, &runs[r][i]));
            for (w, e) in worst.iter_mut().zip(errs) {
                *w = w.max(e);
            }
            let [fold_err, err, o_err] = errs;
            assert!(
                fold_err <= 1e-6,
                "{name} step {i}: folded vs separate norms {fold_err}"
            );
            assert!(err <= 1e-2, "{name} step {i}: fused vs old kernels {err}");
            assert!(o_err <= 1e-2, "{name} step {i}: o GEMV vs cuBLAS {o_err}");
        }
        println!(
            "{name}: worst rel-L2 against the default: separate norms {:.2e}, old kernels {:.2e}, o GEMV {:.2e}",
            worst[0], worst[1], worst[2]
        );
    }
}

/// The normalised rows of `x` (`[rows, inp]`) by `rms_norm` (bf16 and f32), the norm the fused launches
/// fold in.
fn rms_norm_rows(
    dev: &GpuDevice,
    x: &cudarc::driver::CudaSlice<f32>,
    w: &cudarc::driver::CudaSlice<f32>,
    (rows, inp): (usize, usize),
) -> (Vec<bf16>, Vec<f32>) {
    let s = &dev.stream;
    let mut hb = s.alloc_zeros::<bf16>(rows * inp).unwrap();
    let mut hf = s.alloc_zeros::<f32>(rows * inp).unwrap();
    dev.rms_norm(x, w, EPS, (rows, inp), &mut hb, Some(&mut hf))
        .unwrap();
    (s.clone_dtoh(&hb).unwrap(), s.clone_dtoh(&hf).unwrap())
}

const EPS: f32 = 1e-6;

/// `gemv_bf16_norm` (the attention norm folded into the q/k/v launch) gives exactly what `rms_norm`
/// then `gemv_bf16` then `add_bias` give: the same bf16 normalised rows (each block sums the squares in
/// `rms_norm`'s order) written to `normed`, and the same outputs bit for bit, with biases on the first
/// and last matrices (GLM's q/k/v biases) and on a grid of 3 blocks striding over the rows
/// (`GemvGrid::AtMost`) alike; the rows also within bf16 rounding (rel-L2 ≤ 4e-3) of an f64 host
/// norm, and the outputs within 1e-5 of an f64 host product of them plus the bias. Rows 1, 2 and 8,
/// inputs 520, 2048 and 4096 (1 and 2 rows), three matrices of 300, 64 and 72 rows. Rows whose bf16
/// copy would not fit its shared memory (8 × 4096) are refused.
#[test]
fn gemv_bf16_norm_matches_rms_norm_then_gemv() {
    let dev = GpuDevice::open(0).unwrap();
    let s = &dev.stream;
    let outs = [300usize, 64, 72];
    let bias_host: Vec<Vec<f32>> = outs.iter().map(|&o| values(o, 0.5, 37)).collect();
    let bias: Vec<_> = bias_host.iter().map(|b| s.clone_htod(b).unwrap()).collect();
    let biases = [Some(&bias[0]), None, Some(&bias[2])];
    for inp in [520usize, 2048, 4096] {
        let ws: Vec<_> = outs
            .iter()
            .enumerate()
            .map(|(i, &o)| to_bf16(&values(o * inp, 0.1, 31 + i as u64)))
            .collect();
        let dw: Vec<_> = ws.iter().map(|w| s.clone_htod(w).unwrap()).collect();
        let norm_w_host: Vec<f32> = values(inp, 0.5, 41).iter().map(|v| 1.0 + v).collect();
        let norm_w = s.clone_htod(&norm_w_host).unwrap();
        for rows in [1usize, 2, 8] {
            if !GpuDevice::gemv_bf16_norm_takes(rows, inp) {
                continue;
            }
            let label = format!("{rows} rows of {inp}");
            let xh = values(rows * inp, 3.0, 51 + rows as u64);
            let x = s.clone_htod(&xh).unwrap();
            let (want_hb, _) = rms_norm_rows(&dev, &x, &norm_w, (rows, inp));
            let mut want_y: Vec<_> = outs
                .iter()
                .map(|&o| s.alloc_zeros::<f32>(rows * o).unwrap())
                .collect();
            let dhb = s.clone_htod(&want_hb).unwrap();
            let mut mats: Vec<GemvMat> = want_y
                .iter_mut()
                .zip(&dw)
                .zip(outs)
                .map(|((y, w), out)| GemvMat {
                    w,
                    y,
                    out,
                    bias: None,
                })
                .collect();
            dev.gemv_bf16(&dhb, (rows, inp), &mut mats, false).unwrap();
            for ((y, b), &out) in want_y.iter_mut().zip(biases).zip(&outs) {
                if let Some(b) = b {
                    dev.add_bias(y, b, (rows, out)).unwrap();
                }
            }
            let norm = NormRows {
                x: &x,
                w: &norm_w,
                eps: EPS,
            };
            let launch = |grid: GemvGrid| {
                let mut ys: Vec<_> = outs
                    .iter()
                    .map(|&o| s.clone_htod(&values(rows * o, 1.0, 61)).unwrap())
                    .collect();
                let mut normed = s.alloc_zeros::<bf16>(rows * inp).unwrap();
                let mut mats: Vec<GemvMat> = ys
                    .iter_mut()
                    .zip(&dw)
                    .zip(outs)
                    .zip(biases)
                    .map(|(((y, w), out), bias)| GemvMat { w, y, out, bias })
                    .collect();
                dev.gemv_bf16_norm_grid(&norm, (rows, inp), &mut normed, &mut mats, grid)
                    .unwrap();
                (ys, s.clone_dtoh(&normed).unwrap())
            };
            let ((ys, got_hb), (strided, strided_hb)) =
                (launch(GemvGrid::PerRows), launch(GemvGrid::AtMost(3)));
            assert!(got_hb == want_hb, "{label}: normalised rows differ");
            assert!(
                strided_hb == want_hb,
                "{label}: normalised rows (3 blocks) differ"
            );
            // the host norm in f64
            let host_hb: Vec<f32> = (0..rows)
                .flat_map(|t| {
                    let r = &xh[t * inp..][..inp];
                    let ms = r.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / inp as f64;
                    let inv = 1.0 / (ms + EPS as f64).sqrt();
                    r.iter()
                        .zip(&norm_w_host)
                        .map(move |(&v, &g)| (v as f64 * inv * g as f64) as f32)
                        .collect::<Vec<_>>()
                })
                .collect();
            let got_hb_f: Vec<f32> = got_hb.iter().map(|b| b.to_f32()).collect();
            let e = rel_l2(&got_hb_f, &host_hb);
            assert!(e <= 4e-3, "{label}: normalised rows vs host {e}");
            for (m, &out) in outs.iter().enumerate() {
                let got = s.clone_dtoh(&ys[m]).unwrap();
                let want = s.clone_dtoh(&want_y[m]).unwrap();
                assert!(
                    got == want,
                    "{label} matrix {m}: differs from rms_norm + gemv_bf16 + add_bias"
                );
                assert!(
                    s.clone_dtoh(&strided[m]).unwrap() == want,
                    "{label} matrix {m}: 3 blocks differ"
                );
                let host: Vec<f32> = (0..rows * out)
                    .map(|i| {
                        let (t, r) = (i / out, i % out);
                        let b = biases[m].map_or(0.0, |_| bias_host[m][r] as f64);
                        let dot: f64 = (0..inp)
                            .map(|c| got_hb_f[t * inp + c] as f64 * ws[m][r * inp + c].to_f64())
                            .sum();
                        (dot + b) as f32
                    })
                    .collect();
                let e = rel_l2(&got, &host);
                assert!(e <= 1e-5, "{label} matrix {m}: vs host {e}");
            }
        }
    }
    assert!(GpuDevice::gemv_bf16_norm_takes(2, 4096));
    assert!(!GpuDevice::gemv_bf16_norm_takes(8, 4096));
    let x = s.alloc_zeros::<f32>(8 * 4096).unwrap();
    let w = s.alloc_zeros::<f32>(4096).unwrap();
    let wm = s.alloc_zeros::<bf16>(4096).unwrap();
    let mut y = s.alloc_zeros::<f32>(8).unwrap();
    let mut normed = s.alloc_zeros::<bf16>(8 * 4096).unwrap();
    let mut mats = [GemvMat {
        w: &wm,
        y: &mut y,
        out: 1,
        bias: None,
    }];
    let norm = NormRows {
        x: &x,
        w: &w,
        eps: EPS,
    };
    let e = dev
        .gemv_bf16_norm(&norm, (8, 4096), &mut normed, &mut mats)
        .unwrap_err();
    assert!(e.to_string().contains("8 rows of 4096"), "{e}");
}

/// `router_gemv_topk_norm` (the FFN norm folded into the router's launch) gives exactly what
/// `rms_norm` then `router_gemv_topk` give: the same bf16 and f32 normalised rows written to `hb` and
/// `hf` (each block normalises in `rms_norm`'s order), the same logits, experts and weights bit for
/// bit, and, publishing, the same normalised rows in the hand-off's host buffer. Every router of
/// [`router_cases`]; rows 1, 2 and 5 of 2048 (the shared memory holds 5 × 2048 f32 rows and the
/// top-k's arrays); 8 rows of 2048 are refused (64 KiB of rows).
#[test]
fn router_gemv_topk_norm_matches_rms_norm_then_router() {
    let dev = GpuDevice::open(0).unwrap();
    let s = &dev.stream;
    let inp = ROUTER_INPUTS;
    let norm_w: Vec<f32> = values(inp, 0.5, 71).iter().map(|v| 1.0 + v).collect();
    let norm_w = s.clone_htod(&norm_w).unwrap();
    for (experts, k, kind, with_bias) in router_cases() {
        let w = s.clone_htod(&values(experts * inp, 0.05, 72)).unwrap();
        let bias = s.clone_htod(&values(experts, 0.05, 73)).unwrap();
        let router = FusedRouter {
            w: &w,
            experts,
            k,
            kind: &kind,
            bias: with_bias.then_some(&bias),
        };
        for rows in [1usize, 2, 5] {
            let label = format!("{experts} experts top-{k} rows {rows}");
            let x = s
                .clone_htod(&values(rows * inp, 3.0, 74 + rows as u64))
                .unwrap();
            let (want_hb, want_hf) = rms_norm_rows(&dev, &x, &norm_w, (rows, inp));
            let hf = s.clone_htod(&want_hf).unwrap();
            let mut outs = Vec::new();
            for fold in [false, true] {
                let port = HandoffPort::new(&dev, rows * k, rows * inp).unwrap();
                let mut logits = s.alloc_zeros::<f32>(rows * experts).unwrap();
                let mut ids = s.alloc_zeros::<i32>(rows * k).unwrap();
                let mut wts = s.alloc_zeros::<f32>(rows * k).unwrap();
                let mut hb_out = s.alloc_zeros::<bf16>(rows * inp).unwrap();
                let mut hf_out = s.alloc_zeros::<f32>(rows * inp).unwrap();
                let publish = Some((&port, true));
                let routing = (&mut ids, &mut wts);
                if fold {
                    let norm = NormRows {
                        x: &x,
                        w: &norm_w,
                        eps: EPS,
                    };
                    let out = (&mut hb_out, &mut hf_out);
                    dev.router_gemv_topk_norm(
                        &norm,
                        out,
                        (rows, inp),
                        &router,
                        &mut logits,
                        routing,
                        publish,
                    )
                    .unwrap();
                    assert!(s.clone_dtoh(&hb_out).unwrap() == want_hb, "{label}: hb");
                    assert!(s.clone_dtoh(&hf_out).unwrap() == want_hf, "{label}: hf");
                } else {
                    let logits = &mut logits;
                    dev.router_gemv_topk(&hf, (rows, inp), &router, logits, routing, publish)
                        .unwrap();
                }
                s.synchronize().unwrap();
                assert!(port.take_published(), "{label}: DOWN not raised");
                // SAFETY: the stream is idle (synchronised above): no GPU write is pending.
                let published = unsafe { port.x.host(rows * inp).to_vec() };
                assert!(published == want_hf, "{label} fold {fold}: published rows");
                outs.push((
                    s.clone_dtoh(&logits).unwrap(),
                    s.clone_dtoh(&ids).unwrap(),
                    s.clone_dtoh(&wts).unwrap(),
                ));
            }
            assert!(outs[0].0 == outs[1].0, "{label}: logits differ");
            assert_eq!(outs[0].1, outs[1].1, "{label}: ids");
            assert!(outs[0].2 == outs[1].2, "{label}: weights differ");
        }
    }
    assert!(!GpuDevice::router_norm_takes(8, inp, 128));
    let x = s.alloc_zeros::<f32>(8 * inp).unwrap();
    let w = s.alloc_zeros::<f32>(128 * inp).unwrap();
    let kind = RouterKind::Softmax { renormalize: true };
    let router = FusedRouter {
        w: &w,
        experts: 128,
        k: 8,
        kind: &kind,
        bias: None,
    };
    let (mut hb, mut hf) = (
        s.alloc_zeros::<bf16>(8 * inp).unwrap(),
        s.alloc_zeros::<f32>(8 * inp).unwrap(),
    );
    let mut logits = s.alloc_zeros::<f32>(8 * 128).unwrap();
    let (mut ids, mut wts) = (
        s.alloc_zeros::<i32>(64).unwrap(),
        s.alloc_zeros::<f32>(64).unwrap(),
    );
    let norm = NormRows {
        x: &x,
        w: &w,
        eps: EPS,
    };
    let e = dev
        .router_gemv_topk_norm(
            &norm,
            (&mut hb, &mut hf),
            (8, inp),
            &router,
            &mut logits,
            (&mut ids, &mut wts),
            None,
        )
        .unwrap_err();
    assert!(e.to_string().contains("8 rows of 2048"), "{e}");
}

/// The hand-off's wait-and-add: enqueued before the host's sum is there, it waits for UP (no "seen"
/// stamp while the host holds the flag down), then adds the sum from host memory
/// exactly (f32 adds) and lowers UP, so a second wait enqueued after it waits for the next raise:
/// its "seen" stamp comes after the host's pause (≥ 3 ms of the 5 ms slept after the first add's
/// stamp) instead of at once. One block (2048 elements) and two with a tail that is not a multiple
/// of 4 (30001).
#[test]
fn handoff_wait_add_waits_adds_and_lowers_the_flag() {
    use std::time::Duration;
    let dev = GpuDevice::open(0).unwrap();
    let s = &dev.stream;
    for n in [2048usize, 30001] {
        let label = format!("{n} elements");
        let port = HandoffPort::new(&dev, 8, n).unwrap();
        let x0 = values(n, 1.0, 81);
        let y = values(n, 1.0, 82);
        let mut x = s.clone_htod(&x0).unwrap();
        // SAFETY: no GPU work on the port is pending yet.
        unsafe { port.y.host_mut(n).copy_from_slice(&y) };
        dev.handoff_wait_add(&mut x, n, &port).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        // (the stamps live in host memory: readable while the wait spins)
        assert_eq!(
            port.stamps().seen_ns,
            0,
            "{label}: saw UP before it was raised"
        );
        port.raise_sum();
        s.synchronize().unwrap();
        let once: Vec<f32> = x0.iter().zip(&y).map(|(a, b)| a + b).collect();
        assert_eq!(s.clone_dtoh(&x).unwrap(), once, "{label}: sum added");
        let first = port.stamps();
        assert!(
            first.seen_ns > 0 && first.added_ns >= first.seen_ns,
            "{label}: {first:?}"
        );
        dev.handoff_wait_add(&mut x, n, &port).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        port.raise_sum();
        s.synchronize().unwrap();
        let second = port.stamps();
        let waited_ms = second.seen_ns.saturating_sub(first.added_ns) as f64 * 1e-6;
        assert!(
            waited_ms >= 3.0,
            "{label}: the second wait saw UP {waited_ms} ms after the first add (not lowered?)"
        );
        let twice: Vec<f32> = once.iter().zip(&y).map(|(a, b)| a + b).collect();
        assert_eq!(s.clone_dtoh(&x).unwrap(), twice, "{label}: second sum");
        assert!(!port.reset(), "{label}: a wait timed out");
    }
}
