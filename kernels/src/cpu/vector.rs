//! f32 dot products for the engine's small reductions (MLA attention scores, router logits,
//! reference linear rows) and the f16 widening of KV rows, on the best tier of this CPU, detected
//! once. The daemon is built for the baseline x86-64 target, so its own loops get 4-wide SSE; these
//! run 16 lanes (AVX-512) or 8 (AVX2 + FMA).
//! Results differ from a sequential sum only in rounding order (the tests bound it against f64).

use super::features::{detected_tier, CpuTier};

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

    /// Every f16 class (normal, subnormal, zero, infinity) converts exactly, at every length.
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
