//! f32 dot products for the engine's small reductions (attention scores and value sums, router logits,
//! reference linear rows) and the f16 widening of KV rows, on the best tier of this CPU, detected
//! once. The daemon is built for the baseline x86-64 target, so its own loops get 4-wide SSE; these
//! run 16 lanes (AVX-512) or 8 (AVX2 + FMA).
//! Results differ from a sequential sum only in rounding order (the tests bound it against f64).

use super::features::{detected_tier, CpuTier};
use super::moe::act::exp_fast;

/// `Σ a[i]·b[i]` over `a.len()` elements; `b` must be at least as long.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let b = &b[..a.len()];
    #[cfg(target_arch = "x86_64")]
    {
        let tier = detected_tier();
        if tier >= CpuTier::Avx512 {
            // SAFETY: the tier was detected on this CPU; equal lengths.
            return unsafe { dot_avx512(a, b) };
        }
        if tier >= CpuTier::Avx2 {
            // SAFETY: as above.
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_scalar(a, b)
}

fn axpy_scalar(w: f32, x: &[f32], y: &mut [f32]) {
    for (o, v) in y.iter_mut().zip(x) {
        *o += w * v;
    }
}

/// Attention scores of a tile: `out[j·n + i] = q_j · k_i` for the `q.len() / hd` query rows and the
/// `n = k.len() / hd` key rows (one call per tile instead of one per score).
pub fn dot_rows(q: &[f32], k: &[f32], hd: usize, out: &mut [f32]) {
    assert!(out.len() >= (q.len() / hd) * (k.len() / hd));
    #[cfg(target_arch = "x86_64")]
    {
        let tier = detected_tier();
        if tier >= CpuTier::Avx512 {
            // SAFETY: the tier was detected on this CPU; every row is `hd` long (checked above).
            return unsafe { dot_rows_avx512(q, k, hd, out) };
        }
        if tier >= CpuTier::Avx2 {
            // SAFETY: as above.
            return unsafe { dot_rows_avx2(q, k, hd, out) };
        }
    }
    dot_rows_body(q, k, hd, out, dot_scalar)
}

/// The loop of [`dot_rows`] over one dot product of `hd` values, inlined into each tier's build.
#[inline(always)]
fn dot_rows_body(
    q: &[f32],
    k: &[f32],
    hd: usize,
    out: &mut [f32],
    dot: impl Fn(&[f32], &[f32]) -> f32,
) {
    let n = k.len() / hd;
    for (j, qj) in q.chunks_exact(hd).enumerate() {
        for (i, ki) in k.chunks_exact(hd).enumerate() {
            out[j * n + i] = dot(qj, ki);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_rows_avx512(q: &[f32], k: &[f32], hd: usize, out: &mut [f32]) {
    // SAFETY: (caller) AVX-512F present; chunks are equally long.
    dot_rows_body(q, k, hd, out, |a, b| unsafe { dot_avx512(a, b) })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_rows_avx2(q: &[f32], k: &[f32], hd: usize, out: &mut [f32]) {
    // SAFETY: (caller) AVX2 and FMA present; chunks are equally long.
    dot_rows_body(q, k, hd, out, |a, b| unsafe { dot_avx2(a, b) })
}

/// A tile's weighted sum of value rows: `acc_j += Σ_i w[j·n + i] · v_i` for the `acc.len() / hd`
/// accumulators and the `n = v.len() / hd` value rows; each accumulator stays in registers over the
/// tile (one load and store per tile, not per row).
pub fn weighted_rows(w: &[f32], v: &[f32], hd: usize, acc: &mut [f32]) {
    assert!(w.len() >= (acc.len() / hd) * (v.len() / hd));
    #[cfg(target_arch = "x86_64")]
    if detected_tier() >= CpuTier::Avx512 {
        // SAFETY: the tier was detected on this CPU; lengths checked above.
        return unsafe { weighted_rows_avx512(w, v, hd, acc) };
    }
    // Portable: the compiler vectorizes the row update.
    let n = v.len() / hd;
    for (j, a) in acc.chunks_exact_mut(hd).enumerate() {
        for (i, vi) in v.chunks_exact(hd).enumerate() {
            axpy_scalar(w[j * n + i], vi, a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn weighted_rows_avx512(w: &[f32], v: &[f32], hd: usize, acc: &mut [f32]) {
    use std::arch::x86_64::*;
    let (g, n) = (acc.len() / hd, v.len() / hd);
    let (pv, pa) = (v.as_ptr(), acc.as_mut_ptr());
    for j in 0..g {
        for_lanes16(hd, |c, m| {
            // SAFETY: elements c .. c + 16 (masked to hd) of accumulator j and of each value row.
            unsafe {
                let mut a = _mm512_maskz_loadu_ps(m, pa.add(j * hd + c));
                for i in 0..n {
                    let x = _mm512_maskz_loadu_ps(m, pv.add(i * hd + c));
                    a = _mm512_fmadd_ps(_mm512_set1_ps(w[j * n + i]), x, a);
                }
                _mm512_mask_storeu_ps(pa.add(j * hd + c), m, a);
            }
        });
    }
}

/// Calls `f(i, mask)` for `i = 0, 16, 32, … < n` with the mask of the lanes `i .. min(i + 16, n)`:
/// the loop of every 16-lane AVX-512 pass over a row whose length is not a multiple of 16.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn for_lanes16(n: usize, mut f: impl FnMut(usize, u16)) {
    let mut i = 0;
    while i < n {
        let left = n - i;
        f(
            i,
            if left >= 16 {
                0xFFFF
            } else {
                (1u16 << left) - 1
            },
        );
        i += 16;
    }
}

/// `x[i] = e^(x[i] − m)` in place, returning `Σ x[i]`: the softmax weights of an attention tile against
/// its running max. `exp_fast` (~2e-7 relative) in 16 lanes; libm's scalar `exp` per score cost as much
/// as the rest of a small model's attention.
pub fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if detected_tier() >= CpuTier::Avx512 {
        // SAFETY: the tier was detected on this CPU.
        return unsafe { exp_sub_sum_avx512(x, m) };
    }
    exp_sub_sum_body(x, m)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn exp_sub_sum_avx512(x: &mut [f32], m: f32) -> f32 {
    exp_sub_sum_body(x, m)
}

#[inline(always)]
fn exp_sub_sum_body(x: &mut [f32], m: f32) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact_mut(16);
    for c in &mut chunks {
        for (v, a) in c.iter_mut().zip(acc.iter_mut()) {
            *v = exp_fast(*v - m);
            *a += *v;
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp_fast(*v - m);
        sum += *v;
    }
    sum
}

/// In place RMSNorm of each `weight.len()`-wide row of `x`: `x · w / sqrt(mean(x²) + eps)`, 16 lanes
/// on AVX-512 (the daemon's baseline build sums the squares one value at a time: ~1 µs per row of
/// 576, 3840 rows in a 64-token prefill of a 30-layer model).
pub fn rms_norm_rows(x: &mut [f32], weight: &[f32], eps: f32) {
    #[cfg(target_arch = "x86_64")]
    if detected_tier() >= CpuTier::Avx512 {
        // SAFETY: the tier was detected on this CPU.
        return unsafe { rms_norm_rows_avx512(x, weight, eps) };
    }
    rms_norm_rows_body(x, weight, eps)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn rms_norm_rows_avx512(x: &mut [f32], weight: &[f32], eps: f32) {
    rms_norm_rows_body(x, weight, eps)
}

#[inline(always)]
fn rms_norm_rows_body(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    for row in x.chunks_exact_mut(dim) {
        let mut acc = [0f32; 16];
        let mut chunks = row.chunks_exact(16);
        for c in &mut chunks {
            for (a, v) in acc.iter_mut().zip(c) {
                *a += v * v;
            }
        }
        let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
        let ms = (acc.iter().sum::<f32>() + tail) / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v * inv * w;
        }
    }
}

/// IEEE f16 bits → f32 (exact), `dst.len()` values: the CPU KV cache's rows as attention reads them
/// (16 per `vcvtph2ps` on AVX-512; a generic F16C path converting 8 at a time through a function
/// call per chunk made f16 rows slower to read than f32 ones).
pub fn f16_to_f32(src: &[u16], dst: &mut [f32]) {
    let src = &src[..dst.len()];
    #[cfg(target_arch = "x86_64")]
    if detected_tier() >= CpuTier::Avx512 {
        // SAFETY: the tier was detected on this CPU; equal lengths.
        return unsafe { f16_to_f32_avx512(src, dst) };
    }
    for (o, &h) in dst.iter_mut().zip(src) {
        *o = half::f16::from_bits(h).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn f16_to_f32_avx512(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
    // SAFETY: every access covers elements i .. i + 16 (masked to the length) of both slices.
    for_lanes16(dst.len(), |i, m| unsafe {
        let h = _mm256_maskz_loadu_epi16(m, ps.add(i).cast());
        _mm512_mask_storeu_ps(pd.add(i), m, _mm512_cvtph_ps(h));
    });
}

/// Rows of IEEE f16 (`bf16` false) or bf16 bits at a stride, widened to f32 (exact): row `i` of `dst`
/// (`width` values each) from `src[i · stride ..]`. One call per KV tile: attention widened each
/// cached row through its own call, ~25 ns of dispatch for 64 values.
pub fn widen_rows(src: &[u16], stride: usize, bf16: bool, dst: &mut [f32], width: usize) {
    let n = dst.len() / width;
    if n == 0 {
        return;
    }
    assert!(width <= stride && src.len() >= (n - 1) * stride + width);
    #[cfg(target_arch = "x86_64")]
    if detected_tier() >= CpuTier::Avx512 {
        // SAFETY: the tier was detected on this CPU; every row is in bounds (checked above).
        return unsafe { widen_rows_avx512(src, stride, bf16, dst, width) };
    }
    for (i, d) in dst.chunks_exact_mut(width).enumerate() {
        let row = &src[i * stride..i * stride + width];
        if bf16 {
            bf16_to_f32(row, d)
        } else {
            f16_to_f32(row, d)
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn widen_rows_avx512(src: &[u16], stride: usize, bf16: bool, dst: &mut [f32], width: usize) {
    use std::arch::x86_64::*;
    for (i, d) in dst.chunks_exact_mut(width).enumerate() {
        let (ps, pd) = (src[i * stride..].as_ptr(), d.as_mut_ptr());
        // SAFETY: elements j .. j + 16 (masked to `width`) of this row of `src` and of `d`.
        for_lanes16(width, |j, m| unsafe {
            let h = _mm256_maskz_loadu_epi16(m, ps.add(j).cast());
            let x = if bf16 {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            } else {
                _mm512_cvtph_ps(h)
            };
            _mm512_mask_storeu_ps(pd.add(j), m, x);
        });
    }
}

/// bf16 bits → f32 (exact: the bits shifted into the high half).
pub fn bf16_to_f32(src: &[u16], dst: &mut [f32]) {
    let src = &src[..dst.len()];
    #[cfg(target_arch = "x86_64")]
    if detected_tier() >= CpuTier::Avx512 {
        // SAFETY: the tier was detected on this CPU; equal lengths.
        return unsafe { bf16_to_f32_avx512(src, dst) };
    }
    for (o, &h) in dst.iter_mut().zip(src) {
        *o = f32::from_bits((h as u32) << 16);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn bf16_to_f32_avx512(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
    // SAFETY: every access covers elements i .. i + 16 (masked to the length) of both slices.
    for_lanes16(dst.len(), |i, m| unsafe {
        let h = _mm256_maskz_loadu_epi16(m, ps.add(i).cast());
        let x = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
        _mm512_mask_storeu_ps(pd.add(i), m, _mm512_castsi512_ps(x));
    });
}

/// The portable version (and the tail of the SIMD ones): eight interleaved partial sums.
fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    tail + acc.iter().sum::<f32>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 2];
    let mut i = 0;
    // SAFETY: every load reads elements i .. i + 16 < n (or masked to n) of both slices.
    unsafe {
        while i + 32 <= n {
            for (u, acc) in acc.iter_mut().enumerate() {
                let (x, y) = (
                    _mm512_loadu_ps(pa.add(i + 16 * u)),
                    _mm512_loadu_ps(pb.add(i + 16 * u)),
                );
                *acc = _mm512_fmadd_ps(x, y, *acc);
            }
            i += 32;
        }
        for_lanes16(n - i, |t, m| {
            let (x, y) = (
                _mm512_maskz_loadu_ps(m, pa.add(i + t)),
                _mm512_maskz_loadu_ps(m, pb.add(i + t)),
            );
            acc[0] = _mm512_fmadd_ps(x, y, acc[0]);
        });
        _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]))
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut i = 0;
    // SAFETY: every load reads elements i .. i + 8 ≤ n of both slices.
    unsafe {
        while i + 16 <= n {
            for (u, acc) in acc.iter_mut().enumerate() {
                let (x, y) = (
                    _mm256_loadu_ps(pa.add(i + 8 * u)),
                    _mm256_loadu_ps(pb.add(i + 8 * u)),
                );
                *acc = _mm256_fmadd_ps(x, y, *acc);
            }
            i += 16;
        }
        let v = _mm256_add_ps(acc[0], acc[1]);
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), v);
        lanes.iter().sum::<f32>() + dot_scalar(&a[i..], &b[i..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tile kernels against their definitions, for head sizes on and off the vector width.
    #[test]
    fn tile_kernels_match_their_definitions() {
        for hd in [16usize, 40, 128] {
            let (g, n) = (3, 5);
            let f = |i: usize| ((i * 7919 % 1000) as f32 / 500.0) - 1.0;
            let q: Vec<f32> = (0..g * hd).map(f).collect();
            let k: Vec<f32> = (0..n * hd).map(|i| f(i + 13)).collect();
            let mut s = vec![0f32; g * n];
            dot_rows(&q, &k, hd, &mut s);
            // every tier's build of the score loop gives the same scores as the dispatched one
            let mut tiers = vec![vec![0f32; g * n]];
            dot_rows_body(&q, &k, hd, &mut tiers[0], dot_scalar);
            #[cfg(target_arch = "x86_64")]
            if detected_tier() >= CpuTier::Avx2 {
                tiers.push(vec![0f32; g * n]);
                unsafe { dot_rows_avx2(&q, &k, hd, tiers.last_mut().unwrap()) };
            }
            for t in &tiers {
                for (a, b) in t.iter().zip(&s) {
                    assert!((a - b).abs() < 1e-5, "hd {hd}: {a} vs {b}");
                }
            }
            let mut acc: Vec<f32> = (0..g * hd).map(|i| f(i + 99)).collect();
            let mut want_acc = acc.clone();
            weighted_rows(&s, &k, hd, &mut acc);
            for j in 0..g {
                for i in 0..n {
                    let want: f64 = (0..hd)
                        .map(|d| q[j * hd + d] as f64 * k[i * hd + d] as f64)
                        .sum();
                    assert!((s[j * n + i] as f64 - want).abs() < 1e-4, "hd {hd}");
                    for d in 0..hd {
                        want_acc[j * hd + d] += s[j * n + i] * k[i * hd + d];
                    }
                }
            }
            for (a, b) in acc.iter().zip(&want_acc) {
                assert!(
                    (a - b).abs() < 1e-4 * (1.0 + b.abs()),
                    "hd {hd}: {a} vs {b}"
                );
            }
        }
    }

    /// Softmax weights of a tile: each within exp_fast's error of libm's, the sum within f32 rounding of
    /// theirs, at lengths around the vector width; −inf scores (masked positions) give 0.
    #[test]
    fn exp_sub_sum_matches_libm() {
        for n in [0usize, 1, 15, 16, 17, 48, 100] {
            let mut x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 9.0).collect();
            if n > 3 {
                x[3] = f32::NEG_INFINITY;
            }
            let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let want: Vec<f64> = x.iter().map(|&v| ((v - m) as f64).exp()).collect();
            let sum = exp_sub_sum(&mut x, m);
            for (g, w) in x.iter().zip(&want) {
                assert!(
                    (*g as f64 - w).abs() <= 1e-6 * w + 1e-30,
                    "n {n}: {g} vs {w}"
                );
            }
            let ws: f64 = want.iter().sum();
            assert!(
                (sum as f64 - ws).abs() <= 1e-6 * ws + 1e-30,
                "n {n}: {sum} vs {ws}"
            );
        }
    }

    /// Every f16 class (normal, subnormal, zero, infinity) converts exactly, at every length.
    /// Against the f64 definition, 1e-6 relative per value (rounding order of the sum only); rows
    /// whose width is not a multiple of 16.
    #[test]
    fn rms_norm_rows_matches_its_definition() {
        for dim in [5usize, 16, 57, 576] {
            let x: Vec<f32> = (0..3 * dim)
                .map(|i| (i as f32 * 0.71).sin() * 3.0)
                .collect();
            let w: Vec<f32> = (0..dim).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
            let mut got = x.clone();
            rms_norm_rows(&mut got, &w, 1e-5);
            for (r, row) in x.chunks(dim).enumerate() {
                let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
                let inv = 1.0 / (ms + 1e-5).sqrt();
                for (c, &v) in row.iter().enumerate() {
                    let want = v as f64 * inv * w[c] as f64;
                    let g = got[r * dim + c] as f64;
                    assert!(
                        (g - want).abs() <= 1e-6 * want.abs().max(1e-3),
                        "{g} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn strided_rows_widen_exactly() {
        let src: Vec<u16> = (0..300u32).map(|i| (i * 977 % 30000) as u16).collect();
        for (stride, width, n) in [(40usize, 33usize, 7usize), (64, 64, 4), (20, 16, 1)] {
            for bf16 in [false, true] {
                let mut got = vec![0f32; n * width];
                widen_rows(&src, stride, bf16, &mut got, width);
                for i in 0..n {
                    for j in 0..width {
                        let h = src[i * stride + j];
                        let want = if bf16 {
                            f32::from_bits((h as u32) << 16)
                        } else {
                            half::f16::from_bits(h).to_f32()
                        };
                        assert_eq!(got[i * width + j].to_bits(), want.to_bits());
                    }
                }
            }
        }
    }

    #[test]
    fn f16_rows_widen_exactly() {
        for n in [0usize, 1, 15, 16, 17, 128, 131] {
            let src: Vec<u16> = (0..n as u32)
                .map(|i| (i.wrapping_mul(2654435761) >> 16) as u16)
                .collect();
            let mut got = vec![f32::NAN; n];
            bf16_to_f32(&src, &mut got);
            for (g, &h) in got.iter().zip(&src) {
                assert_eq!(g.to_bits(), (h as u32) << 16, "bf16 {h:#x}");
            }
            f16_to_f32(&src, &mut got);
            for (g, &h) in got.iter().zip(&src) {
                let want = half::f16::from_bits(h).to_f32();
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "{h:#x}"
                );
            }
        }
    }

    /// Every tier of this CPU against the f64 sum, lengths around the vector widths; relative to
    /// Σ|a·b| the error stays at f32 rounding (≤ 1e-6 here).
    #[test]
    fn every_tier_matches_the_f64_sum() {
        let mut s = 0x9E37_79B9u32;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s >> 8) as f32 / (1 << 24) as f32 - 0.5
        };
        for n in [0usize, 1, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 576, 2051] {
            let a: Vec<f32> = (0..n).map(|_| next()).collect();
            let b: Vec<f32> = (0..n + 3).map(|_| next()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let mag: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (*x as f64 * *y as f64).abs())
                .sum();
            let mut got = vec![("scalar", dot_scalar(&a, &b[..n]))];
            #[cfg(target_arch = "x86_64")]
            {
                let tier = detected_tier();
                if tier >= CpuTier::Avx2 {
                    got.push(("avx2", unsafe { dot_avx2(&a, &b[..n]) }));
                }
                if tier >= CpuTier::Avx512 {
                    got.push(("avx512", unsafe { dot_avx512(&a, &b[..n]) }));
                }
            }
            got.push(("dispatch", dot_f32(&a, &b)));
            for (name, g) in got {
                let e = (g as f64 - want).abs();
                assert!(
                    e <= 1e-6 * mag.max(1e-30) + 1e-30,
                    "{name} n={n}: {g} vs {want}"
                );
            }
        }
    }
}
