//! Q4_K weights as llama.cpp's quantizer writes them, through the packed kernels, against the exact
//! dequantization, with llama.cpp's own CPU dot (Q4_K × Q8_K activations) as the yardstick: where the
//! error of the kernel path comes from, and that it is no worse than llama.cpp's.
use super::*;
use crate::cpu::ggml::{self, GgmlBlock};
use crate::cpu::moe::format_for_ggml;

/// Values per Q4_K / Q8_K super-block.
const QK_K: usize = 256;

/// llama.cpp's `nearest_int` (round half to even through the float magic).
fn nearest_int(x: f32) -> i32 {
    x.round_ties_even() as i32
}

/// llama.cpp's `make_qkx2_quants` (ggml-quants.c): the 4-bit codes of one sub-block, its scale and
/// (negated) min, by a weighted search over 21 scales.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    the_min: &mut f32,
    nmax: i32,
    (rmin, rdelta, nstep): (f32, f32, i32),
) -> f32 {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        min = min.min(x[i]);
        max = max.max(x[i]);
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        *the_min = -min;
        return 0.0;
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        l[i] = nearest_int(iscale * (x[i] - min)).clamp(0, nmax) as u8;
        let diff = scale * l[i] as f32 + min - x[i];
        best_error += weights[i] * diff * diff;
    }
    let mut laux = vec![0u8; n];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let li = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = li as u8;
            let (w, lf) = (weights[i], li as f32);
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * diff * diff;
            }
            if cur_error < best_error {
                l.copy_from_slice(&laux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    scale
}

/// llama.cpp's `quantize_row_q4_K_ref`: one row (a multiple of 256 values) as Q4_K blocks.
fn quantize_row_q4_k(x: &[f32], out: &mut Vec<u8>) {
    let h = |v: f32| half::f16::from_f32(v);
    for x in x.chunks_exact(QK_K) {
        let mut l = [0u8; QK_K];
        let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
        for j in 0..8 {
            let xs = &x[32 * j..32 * j + 32];
            let av_x = (xs.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
            let weights: Vec<f32> = xs.iter().map(|v| av_x + v.abs()).collect();
            scales[j] = make_qkx2_quants(
                xs,
                &weights,
                &mut l[32 * j..32 * j + 32],
                &mut mins[j],
                15,
                (-1.0, 0.1, 20),
            );
        }
        let max_scale = scales.iter().copied().fold(0f32, f32::max);
        let max_min = mins.iter().copied().fold(0f32, f32::max);
        let inv_scale = if max_scale > 0.0 {
            63.0 / max_scale
        } else {
            0.0
        };
        let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
        let mut sc = [0u8; 12];
        for j in 0..8 {
            let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
            let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
            if j < 4 {
                sc[j] = ls;
                sc[j + 4] = lm;
            } else {
                sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
                sc[j - 4] |= (ls >> 4) << 6;
                sc[j] |= (lm >> 4) << 6;
            }
        }
        let (d, dmin) = (h(max_scale / 63.0), h(max_min / 63.0));
        for j in 0..8 {
            let (s, m) = ggml::scale_min_k4(j, &sc);
            let dj = d.to_f32() * s as f32;
            if dj == 0.0 {
                continue;
            }
            let dm = dmin.to_f32() * m as f32;
            for i in 0..32 {
                l[32 * j + i] = nearest_int((x[32 * j + i] + dm) / dj).clamp(0, 15) as u8;
            }
        }
        out.extend_from_slice(&d.to_le_bytes());
        out.extend_from_slice(&dmin.to_le_bytes());
        out.extend_from_slice(&sc);
        for j in (0..QK_K).step_by(64) {
            out.extend((0..32).map(|i| l[j + i] | (l[j + i + 32] << 4)));
        }
    }
}

/// llama.cpp's `quantize_row_q8_K_ref` followed by its dequantization: one int8 code per value
/// and one f32 scale per 256 values (the activations llama.cpp's CPU dot multiplies Q4_K by).
fn q8_k_roundtrip(x: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for b in x.chunks_exact(QK_K) {
        let max = b
            .iter()
            .copied()
            .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
        if max == 0.0 {
            out.extend(std::iter::repeat_n(0.0, QK_K));
            continue;
        }
        let iscale = -127.0 / max;
        out.extend(
            b.iter()
                .map(|&v| nearest_int(iscale * v).min(127) as f32 / iscale),
        );
    }
    out
}

/// Deterministic values with the shape of real tensors: roughly normal (sum of uniforms), scaled
/// by `std`.
fn normal_values(n: usize, seed: u64, std: f32) -> Vec<f32> {
    let mut s = seed;
    let mut uniform = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    (0..n)
        .map(|_| (0..4).map(|_| uniform()).sum::<f32>() * std * 1.732)
        .collect()
}

/// `y = W·x` in f64 for `tokens` rows of `x`.
fn exact(w: &[f32], (n, k): (usize, usize), x: &[f32], tokens: usize) -> Vec<f32> {
    let mut y = vec![0f32; tokens * n];
    for t in 0..tokens {
        for r in 0..n {
            let (wr, xt) = (&w[r * k..(r + 1) * k], &x[t * k..(t + 1) * k]);
            y[t * n + r] = wr
                .iter()
                .zip(xt)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32;
        }
    }
    y
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// A Q4_K matrix from llama.cpp's quantizer (weights ~N(0, 0.02), a few rows 4× wider) times
/// hidden-state-like activations (~N(0, 1) with outlier channels at 20–40× the rest, as real
/// models' residual streams have), rel-L2 of the outputs against the exact dequantized weights in
/// f64, for 1 and 8 tokens (measured on AVX-512 VNNI: 1 token / 8 tokens):
/// - the packed weights alone (each sub-block scale `d·sc` and min `dmin·m` rounded once to f16):
///   6.3e-4 on the weights (the quantizer's mins are as large as the scaled codes, so the two
///   rounded terms cancel: more than random codes' 3e-4), 5.3e-4 / 6.7e-4 on the outputs; bound 1e-3;
/// - the kernels with the default input for 4-bit codes (int8 pairs, a residual row in outlier
///   groups): 3.4e-3 / 2.5e-3; bound 6e-3 and no worse than llama.cpp's own CPU dot, which
///   multiplies Q4_K by Q8_K activations (one int8 scale per 256 values: the outliers set it) and
///   is 10× further off: 3.0e-2;
/// - with a residual in every group (`Int8PairAll`, ~int16 activations): 5.4e-4 / 6.7e-4, the
///   weights' rounding alone; bound 1e-3;
/// - one int8 row per token with a scale per 32 values (`Int8`, what the routed-expert kernels
///   feed every format): 1.0e-2 / 1.1e-2; no worse than llama.cpp's.
///
/// So a model's logits moving by 1e-2 on such weights come from the activations' int8 rounding
/// compounded over its layers, not from the repack; llama.cpp rounds them coarser.
#[test]
fn q4_k_from_llama_quantizer_is_as_accurate_as_llama_cpp() {
    let (n, k) = (96, 1024);
    let mut wf = normal_values(n * k, 7, 0.02);
    for r in (0..n).step_by(13) {
        wf[r * k..(r + 1) * k].iter_mut().for_each(|v| *v *= 4.0);
    }
    let mut data = Vec::new();
    for row in wf.chunks_exact(k) {
        quantize_row_q4_k(row, &mut data);
    }
    assert_eq!(data.len(), n * GgmlBlock::Q4K.row_bytes(k).unwrap());
    let mut deq = vec![0f32; n * k];
    ggml::dequantize(GgmlBlock::Q4K, &data, &mut deq);
    // The quantizer works: 4-bit codes keep the weights to a few percent.
    let q_err = rel_l2(&deq, &wf);
    assert!(q_err < 0.12, "quantizer rel-L2 {q_err}");
    let src = SourceTensor::Ggml {
        kind: GgmlBlock::Q4K,
        data: &data,
    };
    let pool = WorkerPool::new(&[vec![0, 0]], false, std::time::Duration::from_micros(50));
    for tokens in [1, 8] {
        let mut x = normal_values(tokens * k, 11 + tokens as u64, 1.0);
        for t in 0..tokens {
            for (c, f) in [(5, 30.0), (300, -40.0), (777, 20.0)] {
                x[t * k + c] *= f;
            }
        }
        let want = exact(&deq, (n, k), &x, tokens);
        let llama_x: Vec<f32> = x.chunks_exact(k).flat_map(q8_k_roundtrip).collect();
        let llama = rel_l2(&exact(&deq, (n, k), &llama_x, tokens), &want);
        let mut errs = Vec::new();
        for input in [
            None,
            Some(GroupedInput::Int8PairAll),
            Some(GroupedInput::Int8),
        ] {
            let mut w =
                DenseMatrix::new(format_for_ggml(GgmlBlock::Q4K), n, k, &src, None).unwrap();
            if let Some(i) = input {
                w.set_grouped_input(i);
            }
            let mut packed = vec![0f32; n * k];
            for r in 0..n {
                w.row_f32(r, &mut packed[r * k..(r + 1) * k]);
            }
            let on_weights = rel_l2(&packed, &deq);
            let repack = rel_l2(&exact(&packed, (n, k), &x, tokens), &want);
            assert!(
                on_weights <= 1e-3 && repack <= 1e-3,
                "repacked weights alone: {on_weights} on the weights, {repack} on the outputs"
            );
            let mut y = vec![0f32; tokens * n];
            w.forward(&pool, &x, tokens, None, &mut y).unwrap();
            errs.push(rel_l2(&y, &want));
        }
        let (pair, pair_all, single) = (errs[0], errs[1], errs[2]);
        eprintln!(
            "{tokens} tokens: kernels (int8 pairs) {pair:.2e}, (int8 pairs everywhere) {pair_all:.2e}, \
             (one int8 row per 32) {single:.2e}, llama.cpp Q4_K x Q8_K {llama:.2e}"
        );
        assert!(
            single <= llama,
            "one int8 row {single} (llama.cpp's: {llama})"
        );
        assert!(
            pair <= 6e-3 && pair <= llama,
            "int8 pairs {pair} (llama.cpp's Q4_K x Q8_K: {llama})"
        );
        assert!(pair_all <= 1e-3, "int8 pairs everywhere {pair_all}");
    }
}
