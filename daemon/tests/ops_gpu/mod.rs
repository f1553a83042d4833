//! The op layer's CUDA kernels against references of the same arithmetic, outside any model: the
//! router top-k (block per token, thread per token, host), the packed-expert unpack (CPU reader),
//! the gated activation (CPU backend), RMSNorm and the weighted scatter-add (host), and the grouped
//! expert GEMM (cuBLAS batched, host). Each test names its tolerance.
use crate::common::{rel_l2, xorshift};

/// The block-per-token router (`router_topk`) picks the same experts with the same weights as the
/// one-thread-per-token kernel (`router_topk_serial`) and the op layer's host reference: softmax top-8
/// of 128 with and without renormalisation, and sigmoid + correction bias with 8 groups keeping 4
/// (DeepSeek/GLM style) over 256 experts. Weights within 1e-6 of the serial kernel (same f32
/// operations, reduction order aside) and 1e-5 of the host (libm's exp against the device's `__expf`).
#[test]
fn parallel_router_matches_serial_router() {
    use moe_kernels::cuda::ops::{reference, RouterKind};
    use moe_kernels::cuda::GpuDevice;
    let dev = GpuDevice::open(0).unwrap();
    let s = &dev.stream;
    let mut next = xorshift(12345);
    let mut rnd = || (next() >> 11) as f32 / (1u64 << 53) as f32 * 8.0 - 4.0;
    let grouped = |n_group, topk_group, scaling| RouterKind::SigmoidGrouped {
        n_group,
        topk_group,
        renormalize: true,
        scaling,
    };
    // (experts, k, router, with correction bias)
    let cases = [
        (
            128usize,
            8usize,
            RouterKind::Softmax { renormalize: true },
            false,
        ),
        (128, 8, RouterKind::Softmax { renormalize: false }, false),
        (256, 8, grouped(8, 4, 2.5), true),
        (160, 6, grouped(1, 1, 1.0), true),
    ];
    for (e, k, kind, with_bias) in cases {
        let n = 37usize;
        let logits: Vec<f32> = (0..n * e).map(|_| rnd()).collect();
        let bias: Vec<f32> = (0..e).map(|_| rnd() * 0.05).collect();
        let d_logits = s.clone_htod(&logits).unwrap();
        let d_bias = s.clone_htod(&bias).unwrap();
        let mut out = Vec::new();
        for parallel in [true, false] {
            let mut ids = s.alloc_zeros::<i32>(n * k).unwrap();
            let mut w = s.alloc_zeros::<f32>(n * k).unwrap();
            let b = with_bias.then_some(&d_bias);
            if parallel {
                dev.router_topk(&d_logits, (n, e, k), &kind, b, &mut ids, &mut w)
            } else {
                dev.router_topk_serial(&d_logits, (n, e, k), &kind, b, &mut ids, &mut w)
            }
            .unwrap();
            out.push((s.clone_dtoh(&ids).unwrap(), s.clone_dtoh(&w).unwrap()));
        }
        let host = reference::router_topk(&logits, e, k, &kind, with_bias.then_some(&bias[..]));
        out.push(host);
        // the two kernels share their f32 operations; the host uses libm's exp
        for (name, (ids, w), tol) in [("serial", &out[1], 1e-6), ("host reference", &out[2], 1e-5)]
        {
            assert_eq!(
                &out[0].0, ids,
                "experts {e} {kind:?}: ids differ from the {name}"
            );
            for (a, b) in out[0].1.iter().zip(w) {
                assert!(
                    (a - b).abs() <= tol * b.abs().max(1.0),
                    "{name}: weights {a} vs {b}"
                );
            }
        }
    }
}

/// `unpack_experts` on the GPU reproduces the CPU kernels' own reading of the same packed bytes
/// (`unpack_bf16`, itself checked against the source weights) bit for bit, for bf16, FP8 (128×128 block scales, the real checkpoints' shape),
/// int8 and int4 experts (symmetric groups of 32 and 64, groups of 32 with minimums: GGUF Q4_0 / Q4_1 /
/// Q4_K), with sizes that are not multiples of any tile.
#[test]
fn gpu_unpack_matches_cpu_reader() {
    use moe_kernels::cpu::moe::{
        unpack_bf16, CpuExpertSet, ExpertSetConfig, ExpertSource, SourceTensor, WeightFormat,
    };
    use moe_kernels::cpu::WorkerPool;
    use moe_kernels::cuda::GpuDevice;
    let dev = GpuDevice::open(0).unwrap();
    let pool = WorkerPool::new(&[vec![0, 0]], false, std::time::Duration::from_micros(100));
    let (h, i, experts) = (320usize, 200usize, 3usize);
    let mut next = xorshift(99);
    for fmt in [
        WeightFormat::Bf16,
        WeightFormat::Fp8Block,
        WeightFormat::Int8,
        WeightFormat::Int4 { group: 32 },
        WeightFormat::Int4 { group: 64 },
        WeightFormat::Int4Min { group: 32 },
    ] {
        let fp8 = fmt == WeightFormat::Fp8Block;
        // per expert: gate, up ([i, h]) and down ([h, i]) as bf16 bits or fp8 bytes + scales
        let mut bf: Vec<[Vec<u16>; 3]> = Vec::new();
        let mut f8: Vec<[(Vec<u8>, Vec<f32>); 3]> = Vec::new();
        for _ in 0..experts {
            let shapes = [(i, h), (i, h), (h, i)];
            bf.push(shapes.map(|(r, c)| {
                (0..r * c)
                    .map(|_| 0x3c00 | (next() as u16 & 0x83ff))
                    .collect()
            }));
            f8.push(shapes.map(|(r, c)| {
                let bytes = (0..r * c)
                    .map(|_| {
                        let b = next() as u8;
                        if b & 0x7f == 0x7f {
                            0x30
                        } else {
                            b
                        }
                    })
                    .collect();
                let scales = (0..r.div_ceil(128) * c.div_ceil(128))
                    .map(|_| 1e-3 * (1 + next() % 7) as f32)
                    .collect();
                (bytes, scales)
            }));
        }
        let sources: Vec<ExpertSource> = (0..experts)
            .map(|e| {
                let t = |m: usize| {
                    if fp8 {
                        SourceTensor::Fp8E4M3 {
                            data: &f8[e][m].0,
                            scale_inv: &f8[e][m].1,
                        }
                    } else {
                        SourceTensor::Bf16(&bf[e][m])
                    }
                };
                ExpertSource {
                    gate: t(0),
                    up: t(1),
                    down: t(2),
                }
            })
            .collect();
        let ids: Vec<u32> = (0..experts as u32).collect();
        let set =
            CpuExpertSet::new(&ExpertSetConfig::new(h, i, fmt), &ids, &sources, &pool).unwrap();
        let g = set.packed_geometry();
        let mut packed = Vec::new();
        for &id in &ids {
            packed.extend_from_slice(set.packed_expert(id).unwrap());
        }
        let d_packed = dev.stream.clone_htod(&packed).unwrap();
        let mut dense = dev
            .stream
            .alloc_zeros::<half::bf16>(experts * g.dense_elems())
            .unwrap();
        dev.unpack_experts(&g, &d_packed, experts, &mut dense)
            .unwrap();
        let got = dev.stream.clone_dtoh(&dense).unwrap();
        for (e, &id) in ids.iter().enumerate() {
            let want = unpack_bf16(&g, set.packed_expert(id).unwrap());
            let got_e: Vec<u16> = got[e * g.dense_elems()..(e + 1) * g.dense_elems()]
                .iter()
                .map(|x| x.to_bits())
                .collect();
            assert!(got_e == want, "{fmt:?} expert {e}: GPU unpack differs");
        }
    }
}

/// `gated_mul` with GLM's `swiglu_limit` (gate ≤ limit, up within ±limit before SiLU) and without one
/// (an infinite limit) equals the CPU backend's `GatedAct` on values on both sides of the limit, to bf16
/// rounding of the output (relative 1e-2).
#[test]
fn gpu_gated_mul_clamps_like_cpu() {
    use moe_daemon::engine::moe::GatedAct;
    use moe_daemon::model::config::Activation;
    use moe_kernels::cuda::ops::GateActivation;
    use moe_kernels::cuda::GpuDevice;
    let dev = GpuDevice::open(0).unwrap();
    let (rows, inter) = (3usize, 257usize);
    let mut next = xorshift(5);
    // gate and up spread over about ±20, so a limit of 7 clamps a large share of both
    let gate_up: Vec<f32> = (0..rows * 2 * inter)
        .map(|_| (next() % 40_001) as f32 / 1000.0 - 20.0)
        .collect();
    for limit in [Some(7.0f32), None] {
        let act = GatedAct {
            act: Activation::Silu,
            swiglu_limit: limit,
        };
        let d_in = dev.stream.clone_htod(&gate_up).unwrap();
        let mut d_out = dev.stream.alloc_zeros::<half::bf16>(rows * inter).unwrap();
        dev.gated_mul(
            &d_in,
            (rows, inter),
            GateActivation::Silu,
            limit,
            &mut d_out,
        )
        .unwrap();
        let got = dev.stream.clone_dtoh(&d_out).unwrap();
        for r in 0..rows {
            for c in 0..inter {
                let (g, u) = (
                    gate_up[r * 2 * inter + c],
                    gate_up[r * 2 * inter + inter + c],
                );
                let want = act.apply(g, u);
                let have = got[r * inter + c].to_f32();
                assert!(
                    (have - want).abs() <= 1e-2 * want.abs().max(1e-2),
                    "limit {limit:?}: gate {g} up {u}: GPU {have}, CPU {want}"
                );
            }
        }
    }
}

/// The op layer's kernels against its host references (`moe_kernels::cuda::ops::reference`):
/// `rms_norm` (bf16 and f32 outputs, a width that is not a multiple of the block) within 1e-5 in f32
/// and bf16 rounding in bf16; `scatter_add_weighted` on a CSR with an empty token within 1e-6. And a
/// buffer shorter than the shape it is launched with is refused before any launch.
#[test]
fn op_layer_matches_host_references() {
    use moe_kernels::cuda::ops::reference;
    use moe_kernels::cuda::GpuDevice;
    let dev = GpuDevice::open(0).unwrap();
    let s = &dev.stream;
    let mut next = xorshift(77);
    let mut rnd = || (next() >> 11) as f32 / (1u64 << 53) as f32 * 4.0 - 2.0;
    let (rows, dim) = (5usize, 1000usize);
    let x: Vec<f32> = (0..rows * dim).map(|_| rnd()).collect();
    let w: Vec<f32> = (0..dim).map(|_| rnd()).collect();
    let (d_x, d_w) = (s.clone_htod(&x).unwrap(), s.clone_htod(&w).unwrap());
    let mut out_b = s.alloc_zeros::<half::bf16>(rows * dim).unwrap();
    let mut out_f = s.alloc_zeros::<f32>(rows * dim).unwrap();
    dev.rms_norm(&d_x, &d_w, 1e-6, (rows, dim), &mut out_b, Some(&mut out_f))
        .unwrap();
    let want = reference::rms_norm(&x, &w, 1e-6);
    let (got_f, got_b) = (s.clone_dtoh(&out_f).unwrap(), s.clone_dtoh(&out_b).unwrap());
    for ((f, b), r) in got_f.iter().zip(&got_b).zip(&want) {
        assert!(
            (f - r).abs() <= 1e-5 * r.abs().max(1.0),
            "rms_norm f32 {f} vs {r}"
        );
        assert!(
            (b.to_f32() - r).abs() <= 8e-3 * r.abs().max(1e-3),
            "rms_norm bf16 {b} vs {r}"
        );
    }
    let mut short = s.alloc_zeros::<half::bf16>(rows * dim - 1).unwrap();
    let e = dev
        .rms_norm(&d_x, &d_w, 1e-6, (rows, dim), &mut short, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("out_bf16"), "{e}");

    // 4 tokens, 6 expert rows; token 2 has none
    let (tokens, expert_rows, dim) = (4usize, 6usize, 300usize);
    let y: Vec<f32> = (0..expert_rows * dim).map(|_| rnd()).collect();
    let wts: Vec<f32> = (0..expert_rows).map(|_| rnd()).collect();
    let offsets = [0i32, 2, 3, 3, 6];
    let token_rows = [4i32, 0, 5, 1, 3, 2];
    let base: Vec<f32> = (0..tokens * dim).map(|_| rnd()).collect();
    let mut d_out = s.clone_htod(&base).unwrap();
    dev.scatter_add_weighted(
        &s.clone_htod(&y).unwrap(),
        &s.clone_htod(&offsets).unwrap(),
        &s.clone_htod(&token_rows).unwrap(),
        &s.clone_htod(&wts).unwrap(),
        (tokens, expert_rows, dim),
        &mut d_out,
    )
    .unwrap();
    let mut want = base.clone();
    reference::scatter_add_weighted(&y, &offsets, &token_rows, &wts, dim, &mut want);
    for (g, r) in s.clone_dtoh(&d_out).unwrap().iter().zip(&want) {
        assert!(
            (g - r).abs() <= 1e-6 * r.abs().max(1.0),
            "scatter {g} vs {r}"
        );
    }
}

/// The expert GEMMs of `gemm_bf16_items` as one grouped launch against one cuBLAS batched call per row
/// count, and both against a host product, on items with different, repeated, zero and multi-tile row
/// counts (as a long prompt's experts have), a column count that is not a multiple of the kernel's
/// 64-wide tiles and an inner size that is not a multiple of its 32-deep steps: within 1e-4 rel-L2 of
/// the host (bf16 inputs, f32 sums in another order) and 1e-5 of each other; the rule's path (many
/// row counts: grouped) gives the same output.
#[test]
fn grouped_expert_gemm_matches_batched_and_host() {
    use moe_kernels::cuda::{ExpertGemmPath, GemmItem, GpuDevice};
    let dev = GpuDevice::open(0).unwrap();
    let s = &dev.stream;
    let mut next = xorshift(91);
    let mut rnd = || half::bf16::from_f32((next() >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0);
    let (m, k) = (96usize, 160usize);
    let rows = [7usize, 0, 33, 7, 64, 1, 33, 130];
    let total: usize = rows.iter().sum();
    let x: Vec<half::bf16> = (0..total * k).map(|_| rnd()).collect();
    let w: Vec<half::bf16> = (0..rows.len() * m * k).map(|_| rnd()).collect();
    let (d_x, d_w) = (s.clone_htod(&x).unwrap(), s.clone_htod(&w).unwrap());
    let mut table = s
        .alloc_zeros::<u64>(moe_kernels::cuda::table_len(rows.len(), total))
        .unwrap();
    let mut want = vec![0f32; total * m];
    let mut r0 = 0;
    for (e, &r) in rows.iter().enumerate() {
        for (t, j) in (r0..r0 + r).flat_map(|t| (0..m).map(move |j| (t, j))) {
            let dot: f32 = (0..k)
                .map(|c| x[t * k + c].to_f32() * w[(e * m + j) * k + c].to_f32())
                .sum();
            want[t * m + j] = dot;
        }
        r0 += r;
    }
    let mut outputs = Vec::new();
    // batched, grouped, then the rule's choice
    for path in [
        Some(ExpertGemmPath::Batched),
        Some(ExpertGemmPath::Grouped),
        None,
    ] {
        let d_y = s.alloc_zeros::<f32>(total * m).unwrap();
        let (xa, wa, ya) = (dev.addr(&d_x), dev.addr(&d_w), dev.addr(&d_y));
        let mut r0 = 0;
        let items: Vec<GemmItem> = rows
            .iter()
            .enumerate()
            .map(|(e, &r)| {
                let it = GemmItem {
                    x: xa + (r0 * k * 2) as u64,
                    w: wa + (e * m * k * 2) as u64,
                    y: ya + (r0 * m * 4) as u64,
                    rows: r,
                };
                r0 += r;
                it
            })
            .collect();
        // SAFETY: every item's rows lie inside d_x / d_y and its weights inside d_w, all alive
        // until the copy back below has synchronised the stream.
        let ran = unsafe {
            match path {
                Some(p) => dev.gemm_bf16_items_via(&items, m, k, &mut table, p),
                None => dev.gemm_bf16_items(&items, m, k, &mut table),
            }
        }
        .unwrap();
        let expected = path.unwrap_or(ExpertGemmPath::Grouped);
        if dev.expert_gemm_uses().1.is_none() || path.is_some() {
            assert_eq!(ran, expected, "the path that ran");
        }
        outputs.push(s.clone_dtoh(&d_y).unwrap());
    }
    for (name, got) in ["batched", "grouped", "rule"].iter().zip(&outputs) {
        let err = rel_l2(got, &want);
        assert!(err <= 1e-4, "{name} against the host product: rel-L2 {err}");
    }
    let err = rel_l2(&outputs[1], &outputs[0]);
    println!("grouped against batched: rel-L2 {err:.2e}");
    assert!(err <= 1e-5, "grouped against batched: rel-L2 {err}");
}
