//! Tests of the packed dense matrices: repacking of GGML blocks, every tier and activation input
//! against the f64 evaluation, group calls, int8 pairs, AMX-INT8 against VNNI.
use super::*;
use crate::cpu::ggml::{self, GgmlBlock};
use crate::cpu::moe::format_for_ggml;
use std::time::Duration;

fn rng_values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn naive(w: &DenseMatrix, x: &[f32], tokens: usize) -> Vec<f32> {
    let (n, k) = (w.rows(), w.cols());
    let mut row = vec![0f32; k];
    let mut y = vec![0f32; tokens * n];
    for r in 0..n {
        w.row_f32(r, &mut row);
        for t in 0..tokens {
            y[t * n + r] = (0..k)
                .map(|c| row[c] as f64 * x[t * k + c] as f64)
                .sum::<f64>() as f32;
        }
    }
    y
}

fn rel_l2(a: &[f32], b: &[f32]) -> f32 {
    let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f32 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-30)).sqrt()
}

/// GGML bytes of a `[rows, cols]` matrix: random blocks with finite f16 scales.
fn ggml_bytes(kind: GgmlBlock, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    if kind == GgmlBlock::F16 {
        return rng_values(rows * cols, seed)
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect();
    }
    let (_, bb) = kind.block();
    let mut b: Vec<u8> = rng_values(rows * kind.row_bytes(cols).unwrap(), seed)
        .iter()
        .map(|v| ((v + 1.0) * 127.5) as u8)
        .collect();
    let f16 = |x: f32| half::f16::from_f32(x).to_le_bytes();
    for blk in b.chunks_exact_mut(bb) {
        match kind {
            GgmlBlock::Q6K => blk[208..210].copy_from_slice(&f16(0.0007)),
            GgmlBlock::Q4K | GgmlBlock::Q5K => {
                blk[..2].copy_from_slice(&f16(0.0011));
                blk[2..4].copy_from_slice(&f16(0.0009));
            }
            _ => blk[..2].copy_from_slice(&f16(0.01)),
        }
        if kind == GgmlBlock::Q4_1 {
            blk[2..4].copy_from_slice(&f16(-0.07));
        }
    }
    b
}

/// Q4_K, Q5_K and Q6_K keep every code; each weight differs from llama.cpp's dequantized value
/// only by the one f16 rounding of its sub-block scale (and min): rel-L2 ≤ 3e-4 over the matrix
/// (2⁻¹¹ = 4.9e-4 is the largest relative change of one scale). Requantizing the values instead
/// gave ~1e-2 (Q4_K / Q6_K) and 3.6e-3 (Q5_K into Int8Group).
#[test]
fn kquants_keep_their_codes() {
    let (n, k) = (37, 512);
    for kind in [GgmlBlock::Q4K, GgmlBlock::Q5K, GgmlBlock::Q6K] {
        let data = ggml_bytes(kind, n, k, 21);
        let src = SourceTensor::Ggml { kind, data: &data };
        let w = DenseMatrix::new(format_for_ggml(kind), n, k, &src, None).unwrap();
        let mut want = vec![0f32; n * k];
        ggml::dequantize(kind, &data, &mut want);
        let mut got = vec![0f32; n * k];
        for r in 0..n {
            w.row_f32(r, &mut got[r * k..(r + 1) * k]);
        }
        let e = rel_l2(&got, &want);
        assert!(e < 3e-4, "{kind:?}: rel-L2 {e}");
    }
}

#[test]
fn ggml_blocks_repack_bit_for_bit() {
    let (n, k) = (35, 96);
    for kind in [
        GgmlBlock::Q4_0,
        GgmlBlock::Q4_1,
        GgmlBlock::Q8_0,
        GgmlBlock::F16,
    ] {
        let data = ggml_bytes(kind, n, k, 3);
        let src = SourceTensor::Ggml { kind, data: &data };
        let w = DenseMatrix::new(format_for_ggml(kind), n, k, &src, None).unwrap();
        let mut want = vec![0f32; n * k];
        ggml::dequantize(kind, &data, &mut want);
        let mut row = vec![0f32; k];
        for r in 0..n {
            w.row_f32(r, &mut row);
            for c in 0..k {
                assert_eq!(
                    row[c].to_bits(),
                    want[r * k + c].to_bits(),
                    "{kind:?} ({r},{c})"
                );
            }
        }
    }
}

/// Every tier against the f64 evaluation of the packed weights; int8 activations (per-row
/// scale) bound the error at ~1% relative L2, bf16 activations at ~0.5%.
#[test]
fn forward_matches_naive_on_every_tier_and_format() {
    let pool = WorkerPool::new(&[vec![0, 0, 0]], false, Duration::from_micros(50));
    let (n, k) = (83, 160);
    let f32_src = rng_values(n * k, 11);
    let q41 = ggml_bytes(GgmlBlock::Q4_1, n, k, 5);
    let q80 = ggml_bytes(GgmlBlock::Q8_0, n, k, 6);
    let q40 = ggml_bytes(GgmlBlock::Q4_0, n, k, 7);
    let k_k = 256; // K-quant rows are whole super-blocks
    let f32_kq = rng_values(n * k_k, 13);
    let q6k = ggml_bytes(GgmlBlock::Q6K, n, k_k, 8);
    let q5k = ggml_bytes(GgmlBlock::Q5K, n, k_k, 12);
    let f16 = ggml_bytes(GgmlBlock::F16, n, k, 10);
    let cases: Vec<(WeightFormat, SourceTensor)> = vec![
        (WeightFormat::Bf16, SourceTensor::F32(&f32_src)),
        (WeightFormat::Int8, SourceTensor::F32(&f32_src)),
        (
            WeightFormat::Int4 { group: 32 },
            SourceTensor::F32(&f32_src),
        ),
        (
            WeightFormat::Int4Min { group: 32 },
            SourceTensor::F32(&f32_src),
        ),
        (
            WeightFormat::Int8Group { group: 32 },
            SourceTensor::F32(&f32_src),
        ),
        (
            WeightFormat::Int4Min { group: 32 },
            SourceTensor::Ggml {
                kind: GgmlBlock::Q4_1,
                data: &q41,
            },
        ),
        (
            WeightFormat::Int8Group { group: 32 },
            SourceTensor::Ggml {
                kind: GgmlBlock::Q8_0,
                data: &q80,
            },
        ),
        (
            WeightFormat::Int4 { group: 32 },
            SourceTensor::Ggml {
                kind: GgmlBlock::Q4_0,
                data: &q40,
            },
        ),
    ];
    let mut cases: Vec<(WeightFormat, SourceTensor, usize)> =
        cases.into_iter().map(|(f, s)| (f, s, k)).collect();
    cases.push((
        WeightFormat::Int8Group { group: 16 },
        SourceTensor::Ggml {
            kind: GgmlBlock::Q6K,
            data: &q6k,
        },
        k_k,
    ));
    cases.push((
        WeightFormat::Int8Group { group: 16 },
        SourceTensor::F32(&f32_kq),
        k_k,
    ));
    cases.push((
        WeightFormat::Int8Min { group: 32 },
        SourceTensor::Ggml {
            kind: GgmlBlock::Q5K,
            data: &q5k,
        },
        k_k,
    ));
    cases.push((
        WeightFormat::Int8Min { group: 32 },
        SourceTensor::F32(&f32_kq),
        k_k,
    ));
    cases.push((
        WeightFormat::F16,
        SourceTensor::Ggml {
            kind: GgmlBlock::F16,
            data: &f16,
        },
        k,
    ));
    let bias = rng_values(n, 9);
    let inputs = [
        GroupedInput::Int8,
        GroupedInput::Int8Pair,
        GroupedInput::Int8PairAll,
        GroupedInput::Bf16,
    ];
    for ((fmt, src, k), input) in cases
        .iter()
        .flat_map(|c| inputs.iter().map(move |i| (c, *i)))
    {
        let (fmt, k) = (*fmt, *k);
        let mut w = DenseMatrix::new(fmt, n, k, src, None).unwrap();
        w.set_grouped_input(input);
        for tier in CpuTier::available() {
            w.set_max_tier(tier);
            for tokens in [1usize, 5, 9, 33] {
                let x = rng_values(tokens * k, tokens as u64);
                let mut y = vec![f32::NAN; tokens * n];
                w.forward(&pool, &x, tokens, Some(&bias), &mut y).unwrap();
                let mut want = naive(&w, &x, tokens);
                for t in 0..tokens {
                    for r in 0..n {
                        want[t * n + r] += bias[r];
                    }
                }
                let e = rel_l2(&y, &want);
                assert!(
                    e < 1e-2,
                    "{fmt:?} {input:?} {tier} tokens={tokens}: rel err {e}"
                );
                if tier <= CpuTier::Avx2 {
                    assert!(e < 1e-5, "{fmt:?} {tier} f32 path: rel err {e}");
                }
            }
        }
    }
}

/// AMX-INT8 (from 1 row on) against the VNNI kernels on the same int8 activations: the same
/// integer dots per group, scaled in another order, so within 1e-5 relative L2; every grouped
/// format and group size, single and paired rows, row counts around the 16-row A tile. Where the
/// CPU has no AMX both sides run VNNI (the comparison is then exact).
#[test]
fn amx_int8_matches_vnni() {
    if CpuTier::Avx512.clamp_to_cpu() < CpuTier::Avx512 {
        return;
    }
    let pool = WorkerPool::new(&[vec![0, 0]], false, Duration::from_micros(50));
    let (n, k) = (40, 256);
    let kinds = [
        GgmlBlock::Q4_1,
        GgmlBlock::Q4_0,
        GgmlBlock::Q8_0,
        GgmlBlock::Q6K,
        GgmlBlock::Q5K,
        GgmlBlock::Q4K,
    ];
    for kind in kinds {
        let data = ggml_bytes(kind, n, k, 31);
        let src = SourceTensor::Ggml { kind, data: &data };
        let mut w = DenseMatrix::new(format_for_ggml(kind), n, k, &src, None).unwrap();
        for input in [
            GroupedInput::Int8,
            GroupedInput::Int8Pair,
            GroupedInput::Int8PairAll,
        ] {
            w.set_grouped_input(input);
            for tokens in [1usize, 3, 8, 15, 17] {
                let mut x = rng_values(tokens * k, 70 + tokens as u64);
                x[5] = 40.0; // an outlier: paired rows get residual groups
                let run = |w: &mut DenseMatrix, from: usize| {
                    w.set_amx_int_min_rows(from);
                    let mut y = vec![0f32; tokens * n];
                    w.forward(&pool, &x, tokens, None, &mut y).unwrap();
                    y
                };
                let vnni = run(&mut w, usize::MAX);
                let amx = run(&mut w, 1);
                let e = rel_l2(&amx, &vnni);
                assert!(e < 1e-5, "{kind:?} {input:?} tokens {tokens}: {e}");
            }
        }
    }
}

/// The dense AMX-INT8 kernel (`dense_amx_int`) against the experts' one on the same rows: the same
/// integer dots scaled in the same order, so equal bit for bit (no output here is an exact zero, the
/// one value whose sign may differ); every grouped format, single and
/// paired rows, 1–15 rows (the 8-row fallback and the 16-row tile, a second m-tile from 9 paired
/// tokens), N-tiles in chunks of one and several (prefetch of the next tile), K of 1 to 18 groups.
#[test]
fn dense_amx_int8_equals_the_experts_kernel() {
    if CpuTier::Avx512.clamp_to_cpu() < CpuTier::Avx512 {
        return;
    }
    let pool = WorkerPool::new(&[vec![0, 0]], false, Duration::from_micros(50));
    let kinds = [
        GgmlBlock::Q4_1,
        GgmlBlock::Q4_0,
        GgmlBlock::Q8_0,
        GgmlBlock::Q6K,
        GgmlBlock::Q5K,
        GgmlBlock::Q4K,
    ];
    for kind in kinds {
        let k_min = kind.block().0;
        for (n, k) in [(40, k_min), (200, 576.max(k_min).div_ceil(k_min) * k_min)] {
            let data = ggml_bytes(kind, n, k, 43);
            let src = SourceTensor::Ggml { kind, data: &data };
            let mut w = DenseMatrix::new(format_for_ggml(kind), n, k, &src, None).unwrap();
            w.set_amx_int_min_rows(1);
            for input in [
                GroupedInput::Int8,
                GroupedInput::Int8Pair,
                GroupedInput::Int8PairAll,
            ] {
                w.set_grouped_input(input);
                for tokens in [1usize, 5, 8, 9, 15] {
                    let mut x = rng_values(tokens * k, 90 + tokens as u64);
                    x[3] = 30.0; // an outlier: paired rows get residual groups
                    let run = |w: &mut DenseMatrix, kernel: AmxIntKernel| {
                        w.set_amx_int_kernel(kernel);
                        let mut y = vec![0f32; tokens * n];
                        w.forward(&pool, &x, tokens, None, &mut y).unwrap();
                        y
                    };
                    let want = run(&mut w, AmxIntKernel::PerGroup);
                    let got = run(&mut w, AmxIntKernel::Pipelined);
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{kind:?} {n}x{k} {input:?} tokens {tokens}");
                }
            }
        }
    }
}

#[test]
fn group_call_equals_separate_calls() {
    let pool = WorkerPool::new(&[vec![0, 0]], false, Duration::from_micros(50));
    let k = 96;
    let mut mats: Vec<DenseMatrix> = [
        (WeightFormat::Int4Min { group: 32 }, 40),
        (WeightFormat::Int8Group { group: 32 }, 70),
        (WeightFormat::Int4 { group: 32 }, 17),
    ]
    .iter()
    .map(|&(f, n)| {
        let src = rng_values(n * k, n as u64);
        DenseMatrix::new(f, n, k, &SourceTensor::F32(&src), None).unwrap()
    })
    .collect();
    for (input, tokens) in [
        GroupedInput::Int8,
        GroupedInput::Int8Pair,
        GroupedInput::Int8PairAll,
        GroupedInput::Bf16,
    ]
    .into_iter()
    .flat_map(|i| [1usize, 7, 20].map(|t| (i, t)))
    {
        for m in mats.iter_mut() {
            m.set_grouped_input(input);
        }
        let x = rng_values(tokens * k, 99);
        let mut outs: Vec<Vec<f32>> = mats.iter().map(|m| vec![0.0; tokens * m.rows()]).collect();
        let mut calls: Vec<DenseCall> = mats
            .iter()
            .zip(outs.iter_mut())
            .map(|(w, y)| DenseCall { w, bias: None, y })
            .collect();
        forward_group(&pool, &mut calls, &x, tokens).unwrap();
        for (m, got) in mats.iter().zip(&outs) {
            let mut want = vec![0.0; tokens * m.rows()];
            m.forward(&pool, &x, tokens, None, &mut want).unwrap();
            assert_eq!(got, &want);
        }
    }
    let bf = DenseMatrix::new(
        WeightFormat::Bf16,
        16,
        k,
        &SourceTensor::F32(&[0.0; 16 * 96]),
        None,
    )
    .unwrap();
    if CpuTier::Avx512.clamp_to_cpu() == CpuTier::Avx512 {
        mats[1].set_grouped_input(GroupedInput::Int8);
        assert!(
            !mats[0].shares_input_with(&mats[1]),
            "bf16-widened and int8 inputs differ"
        );
        assert!(
            !bf.shares_input_with(&mats[1]),
            "bf16 and int8 activations differ"
        );
    }
}

/// Hidden states with outlier channels (a few values 60× the rest, as in small LLMs): one int8 row
/// per token rounds the other values of an outlier's group to steps of amax/127; the pair (codes,
/// then residual codes in the outlier groups) keeps those at ~amax/32000 and the rest at amax/254.
/// Q4_1 weights, 1, 5 and 8 tokens, against the f64 evaluation of the packed weights with the exact
/// inputs: the pair's error is below 1e-3 and a tenth of one row's.
#[test]
fn int8_pair_keeps_outlier_groups_accurate() {
    if CpuTier::Avx512.clamp_to_cpu() < CpuTier::Avx512 {
        return; // int8 activations exist from the AVX-512 tier on
    }
    let pool = WorkerPool::new(&[vec![0, 0]], false, Duration::from_micros(50));
    let (n, k) = (64, 576);
    let q41 = ggml_bytes(GgmlBlock::Q4_1, n, k, 17);
    let src = SourceTensor::Ggml {
        kind: GgmlBlock::Q4_1,
        data: &q41,
    };
    let mut w = DenseMatrix::new(format_for_ggml(GgmlBlock::Q4_1), n, k, &src, None).unwrap();
    w.set_max_tier(CpuTier::Avx512);
    for tokens in [1usize, 5, 8] {
        let mut x = rng_values(tokens * k, 40 + tokens as u64);
        for t in 0..tokens {
            // outliers shared by every token, and one of each token's own (the residual rows of
            // a group are then live for some tokens only)
            for c in [7, 100, 333, (200 + 61 * t) % k] {
                x[t * k + c] = 60.0;
            }
        }
        let want = naive(&w, &x, tokens);
        let err = |input| {
            let mut w2 =
                DenseMatrix::new(format_for_ggml(GgmlBlock::Q4_1), n, k, &src, None).unwrap();
            w2.set_max_tier(CpuTier::Avx512);
            w2.set_grouped_input(input);
            let mut y = vec![0f32; tokens * n];
            w2.forward(&pool, &x, tokens, None, &mut y).unwrap();
            rel_l2(&y, &want)
        };
        let (pair, single) = (err(GroupedInput::Int8Pair), err(GroupedInput::Int8));
        let all = err(GroupedInput::Int8PairAll);
        assert!(
            all < pair / 4.0,
            "tokens={tokens}: residual in every group {all}, in outlier groups {pair}"
        );
        assert!(
            pair < 1e-3,
            "tokens={tokens}: pair rel err {pair} (single {single})"
        );
        assert!(
            single > 10.0 * pair,
            "tokens={tokens}: single {single} vs pair {pair}"
        );
    }
}

#[test]
fn bad_lengths_are_errors() {
    let pool = WorkerPool::new(&[vec![0]], false, Duration::from_micros(50));
    let src = vec![0f32; 32 * 64];
    let w = DenseMatrix::new(WeightFormat::Bf16, 32, 64, &SourceTensor::F32(&src), None).unwrap();
    let mut y = vec![0f32; 32];
    assert!(w.forward(&pool, &[0.0; 63], 1, None, &mut y).is_err());
    assert!(w
        .forward(&pool, &[0.0; 64], 1, Some(&[0.0; 3]), &mut y)
        .is_err());
    assert!(DenseMatrix::new(
        WeightFormat::Bf16,
        32,
        64,
        &SourceTensor::F32(&src[1..]),
        None
    )
    .is_err());
    let q = vec![0u8; 18 * 2];
    let bad = SourceTensor::Ggml {
        kind: GgmlBlock::Q4_0,
        data: &q,
    };
    assert!(DenseMatrix::new(WeightFormat::Int4 { group: 32 }, 1, 48, &bad, None).is_err());
}

/// Rows made where the call converts its input (`forward_made`, in the conversion's pool region
/// for several tokens) give what the same rows given as `x` give, bit for bit: every grouped input
/// (outlier-only pairs with outliers in some rows), 1 token (made on the caller), 3 and 9 (made in
/// parallel), 2 threads.
#[test]
fn made_rows_equal_given_rows() {
    let pool = WorkerPool::new(&[vec![0, 0]], false, Duration::from_micros(50));
    let (n, k) = (48, 160);
    let src = rng_values(n * k, 7);
    let mut w = DenseMatrix::new(
        WeightFormat::Int4Min { group: 32 },
        n,
        k,
        &SourceTensor::F32(&src),
        None,
    )
    .unwrap();
    for input in [
        GroupedInput::Int8,
        GroupedInput::Int8Pair,
        GroupedInput::Int8PairAll,
        GroupedInput::Bf16,
    ] {
        w.set_grouped_input(input);
        for tokens in [1usize, 3, 9] {
            let mut x = rng_values(tokens * k, 11 + tokens as u64);
            for t in (0..tokens).step_by(2) {
                x[t * k + 5 + t] = 40.0; // an outlier in every other token
            }
            let mut want = vec![0.0; tokens * n];
            w.forward(&pool, &x, tokens, None, &mut want).unwrap();
            let mut got = vec![0.0; tokens * n];
            let make = |t: usize, row: &mut [f32]| row.copy_from_slice(&x[t * k..(t + 1) * k]);
            w.forward_made(&pool, &make, tokens, None, &mut got)
                .unwrap();
            assert_eq!(got, want, "{input:?}, {tokens} tokens");
        }
    }
}

/// One vector per token (`forward_rows`, written in place) holds what `forward` writes into one
/// block, bit for bit, with a bias and without; 0 tokens give no rows; a wrong bias is an error.
#[test]
fn rows_out_equal_one_block() {
    let pool = WorkerPool::new(&[vec![0, 0]], false, Duration::from_micros(50));
    let (n, k) = (72, 96); // 72 = 4.5 N-tiles: the last one partly past the rows
    let src = rng_values(n * k, 5);
    let w = DenseMatrix::new(
        WeightFormat::Int8Group { group: 32 },
        n,
        k,
        &SourceTensor::F32(&src),
        None,
    )
    .unwrap();
    let bias = rng_values(n, 6);
    for tokens in [0usize, 1, 8, 17] {
        let x = rng_values(tokens * k, 9);
        for b in [None, Some(&bias[..])] {
            let mut want = vec![0.0; tokens * n];
            w.forward(&pool, &x, tokens, b, &mut want).unwrap();
            let got = w.forward_rows(&pool, &x, tokens, b).unwrap();
            assert_eq!(got.len(), tokens);
            for (t, row) in got.iter().enumerate() {
                assert_eq!(row[..], want[t * n..(t + 1) * n], "token {t} of {tokens}");
            }
        }
    }
    assert!(w
        .forward_rows(&pool, &rng_values(k, 1), 1, Some(&bias[..3]))
        .is_err());
}
