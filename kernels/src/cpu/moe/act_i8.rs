//! Int8 activation rows: symmetric codes per group of inputs (scale = amax / 127, llama.cpp's q8_0
//! activations) with each group's code sum, and the residual row of an int8 pair (what the codes of
//! an outlier group leave over, quantized with its own scales).
//!
//! Cost: a decode token converts ~4 rows per layer on the calling thread while the other workers
//! wait, so this runs on AVX-512 (~30 instructions per 32 inputs); the scalar loops it replaced took
//! ~5 cycles per input, 10–20 µs per layer of a small model. The AVX-512 build and its scalar twin give
//! identical bits: the same operations in the same order (round to nearest even, products without
//! FMA, the row's sum of squares in 16 lanes summed in lane order). NaN inputs give unspecified codes.

/// A group of activations whose largest magnitude exceeds this many times the row's RMS holds an
/// outlier channel (small LLMs' hidden states have a few channels 20–100× the rest): its residual is
/// kept by [`quantize_row_split`] with this ratio. Gaussian groups of 32 have amax ≈ 2.5 RMS. With 0
/// every group keeps its residual (~int16 precision).
pub(crate) const OUTLIER_RMS_RATIO: f32 = 3.0;

/// One int8 row's storage: `k_pad` codes, and per group of `group` codes a scale and a code sum.
pub(crate) struct I8Row<'a> {
    pub codes: &'a mut [i8],
    pub scale: &'a mut [f32],
    pub gsum: &'a mut [i32],
}

impl I8Row<'_> {
    fn reborrow(&mut self) -> I8Row<'_> {
        I8Row {
            codes: self.codes,
            scale: self.scale,
            gsum: self.gsum,
        }
    }
}

/// Codes of `src` (at most `codes.len()` values, the rest zero) per group of `group`: scale
/// `amax / 127` (1 for an all-zero group), codes `round(x / scale)`.
pub(crate) fn quantize_row(src: &[f32], group: usize, row: I8Row<'_>) {
    check(src, group, &row);
    #[cfg(target_arch = "x86_64")]
    if simd(group) {
        // SAFETY: AVX-512F present (checked by `simd`); shapes checked above.
        return unsafe { avx512::quantize_row(src, group, row) };
    }
    twin::quantize_row(src, group, row)
}

/// `src` as two rows: `hi` its codes ([`quantize_row`]); `lo`, in the groups of `hi` whose amax is
/// above `ratio` times the row's RMS (every group with 0; outlier groups with
/// [`OUTLIER_RMS_RATIO`]), the codes of `src − code·scale` with their own scales, elsewhere zero
/// codes with a zero scale (the kernels skip those groups).
pub(crate) fn quantize_row_split(
    src: &[f32],
    group: usize,
    ratio: f32,
    hi: I8Row<'_>,
    lo: I8Row<'_>,
) {
    check(src, group, &hi);
    check(src, group, &lo);
    #[cfg(target_arch = "x86_64")]
    if simd(group) {
        // SAFETY: AVX-512F present (checked by `simd`); shapes checked above.
        return unsafe { avx512::quantize_row_split(src, group, ratio, hi, lo) };
    }
    twin::quantize_row_split(src, group, ratio, hi, lo)
}

fn check(src: &[f32], group: usize, row: &I8Row<'_>) {
    let k = row.codes.len();
    assert!(group > 0 && k.is_multiple_of(group) && src.len() <= k);
    assert!(row.scale.len() >= k / group && row.gsum.len() >= k / group);
}

#[cfg(target_arch = "x86_64")]
fn simd(group: usize) -> bool {
    group.is_multiple_of(16)
        && crate::cpu::features::detected_tier() >= crate::cpu::features::CpuTier::Avx512
}

/// Whether a group (scale `s` of its codes) keeps a residual in a row with this RMS.
#[inline(always)]
fn keeps_residual(s: f32, rms: f32, ratio: f32) -> bool {
    s * 127.0 > ratio * rms
}

#[inline(always)]
fn scale_of(amax: f32) -> f32 {
    if amax > 0.0 {
        amax / 127.0
    } else {
        1.0
    }
}

/// The scalar builds, which tests hold the AVX-512 ones to.
pub(crate) mod twin {
    use super::{keeps_residual, scale_of, I8Row};

    /// Σ x² in 16 lanes (lane `i % 16` takes element i), then the lanes in order.
    pub(crate) fn sum_squares(src: &[f32]) -> f32 {
        let mut lanes = [0f32; 16];
        for (i, &x) in src.iter().enumerate() {
            lanes[i % 16] += x * x;
        }
        lanes.iter().fold(0.0, |a, &l| a + l)
    }

    /// Quantizes the values `x(i)`, `i < len`, of one group (codes past `len` are zero); returns
    /// (scale, code sum).
    #[inline(always)]
    fn group(len: usize, x: impl Fn(usize) -> f32, codes: &mut [i8]) -> (f32, i32) {
        let amax = (0..len).fold(0f32, |a, i| a.max(x(i).abs()));
        let s = scale_of(amax);
        let inv = 1.0 / s;
        let mut sum = 0;
        for (i, c) in codes.iter_mut().enumerate() {
            let q = if i < len {
                ((x(i) * inv).round_ties_even() as i32).clamp(-128, 127)
            } else {
                0
            };
            *c = q as i8;
            sum += q;
        }
        (s, sum)
    }

    pub(crate) fn quantize_row(src: &[f32], group_len: usize, row: I8Row<'_>) {
        for (g, codes) in row.codes.chunks_exact_mut(group_len).enumerate() {
            let base = g * group_len;
            let len = src.len().saturating_sub(base).min(group_len);
            let (s, sum) = group(len, |i| src[base + i], codes);
            row.scale[g] = s;
            row.gsum[g] = sum;
        }
    }

    pub(crate) fn quantize_row_split(
        src: &[f32],
        group_len: usize,
        ratio: f32,
        mut hi: I8Row<'_>,
        lo: I8Row<'_>,
    ) {
        let rms = (sum_squares(src) / src.len().max(1) as f32).sqrt();
        quantize_row(src, group_len, hi.reborrow());
        for (g, codes) in lo.codes.chunks_exact_mut(group_len).enumerate() {
            let base = g * group_len;
            let len = src.len().saturating_sub(base).min(group_len);
            let s = hi.scale[g];
            let (ls, sum) = if keeps_residual(s, rms, ratio) {
                let hc = &hi.codes[base..];
                let (ls, sum) = group(len, |i| src[base + i] - hc[i] as f32 * s, codes);
                if codes.iter().all(|&c| c == 0) {
                    (0.0, 0)
                } else {
                    (ls, sum)
                }
            } else {
                codes.fill(0);
                (0.0, 0)
            };
            lo.scale[g] = ls;
            lo.gsum[g] = sum;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{keeps_residual, scale_of, I8Row};
    use std::arch::x86_64::*;

    /// Lanes `0 .. n.min(16)`.
    #[inline(always)]
    fn first(n: usize) -> __mmask16 {
        if n >= 16 {
            0xFFFF
        } else {
            ((1u32 << n) - 1) as __mmask16
        }
    }

    /// The group's values `x(c)` for chunks `c` of 16 (lanes past `len` zero): (scale, code sum),
    /// codes stored to `codes` (group-long).
    #[inline(always)]
    unsafe fn group(
        group: usize,
        len: usize,
        x: impl Fn(usize, __mmask16) -> __m512,
        codes: *mut i8,
    ) -> (f32, i32) {
        // SAFETY: (caller) AVX-512F; `codes` holds `group` values; `x` reads only masked lanes.
        unsafe {
            let mut m = _mm512_setzero_ps();
            let mut c = 0;
            while c < len {
                m = _mm512_max_ps(m, _mm512_abs_ps(x(c, first(len - c))));
                c += 16;
            }
            let s = scale_of(_mm512_reduce_max_ps(m));
            let inv = _mm512_set1_ps(1.0 / s);
            let mut sum = _mm512_setzero_si512();
            let mut c = 0;
            while c < group {
                let mask = if c < len { first(len - c) } else { 0 };
                let q = _mm512_cvtps_epi32(_mm512_mul_ps(x(c, mask), inv));
                sum = _mm512_add_epi32(sum, q);
                _mm_storeu_si128(codes.add(c).cast(), _mm512_cvtsepi32_epi8(q));
                c += 16;
            }
            (s, _mm512_reduce_add_epi32(sum))
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn quantize_row(src: &[f32], group_len: usize, row: I8Row<'_>) {
        let p = src.as_ptr();
        for g in 0..row.codes.len() / group_len {
            let base = g * group_len;
            let len = src.len().saturating_sub(base).min(group_len);
            // SAFETY: masked loads stay inside `src`; codes of group g are in `row.codes`.
            let (s, sum) = unsafe {
                group(
                    group_len,
                    len,
                    |c, k| _mm512_maskz_loadu_ps(k, p.add(base + c)),
                    row.codes.as_mut_ptr().add(base),
                )
            };
            row.scale[g] = s;
            row.gsum[g] = sum;
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn quantize_row_split(
        src: &[f32],
        group_len: usize,
        ratio: f32,
        mut hi: I8Row<'_>,
        lo: I8Row<'_>,
    ) {
        let p = src.as_ptr();
        // Σ x² in 16 lanes, then the lanes in order (as the twin).
        let mut acc = _mm512_setzero_ps();
        let mut c = 0;
        while c < src.len() {
            // SAFETY: masked load inside `src`.
            let v = unsafe { _mm512_maskz_loadu_ps(first(src.len() - c), p.add(c)) };
            acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
            c += 16;
        }
        let mut lanes = [0f32; 16];
        // SAFETY: 16 floats.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
        let ss = lanes.iter().fold(0.0, |a, &l| a + l);
        let rms = (ss / src.len().max(1) as f32).sqrt();
        // SAFETY: (caller) AVX-512F; shapes checked.
        unsafe { quantize_row(src, group_len, hi.reborrow()) };
        for g in 0..lo.codes.len() / group_len {
            let base = g * group_len;
            let len = src.len().saturating_sub(base).min(group_len);
            let s = hi.scale[g];
            let out = &mut lo.codes[base..base + group_len];
            let (ls, sum) = if keeps_residual(s, rms, ratio) {
                let hc = hi.codes[base..].as_ptr();
                let sv = _mm512_set1_ps(s);
                // SAFETY: masked loads inside `src` and the group's codes (16 bytes per chunk
                // within the group).
                let (ls, sum) = unsafe {
                    group(
                        group_len,
                        len,
                        |c, k| {
                            let x = _mm512_maskz_loadu_ps(k, p.add(base + c));
                            let q = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, hc.add(c).cast()));
                            _mm512_maskz_sub_ps(k, x, _mm512_mul_ps(_mm512_cvtepi32_ps(q), sv))
                        },
                        out.as_mut_ptr(),
                    )
                };
                if out.iter().all(|&c| c == 0) {
                    (0.0, 0)
                } else {
                    (ls, sum)
                }
            } else {
                out.fill(0);
                (0.0, 0)
            };
            lo.scale[g] = ls;
            lo.gsum[g] = sum;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(k: usize, group: usize) -> (Vec<i8>, Vec<f32>, Vec<i32>) {
        (vec![7; k], vec![9.0; k / group], vec![5; k / group])
    }

    fn view<'a>(r: &'a mut (Vec<i8>, Vec<f32>, Vec<i32>)) -> I8Row<'a> {
        I8Row {
            codes: &mut r.0,
            scale: &mut r.1,
            gsum: &mut r.2,
        }
    }

    /// The dispatched build (AVX-512 on this CPU when present) against the scalar twin, bit for bit,
    /// over rows with outlier channels, short rows (zero padding), all-zero groups and the group
    /// sizes the formats use (16, 32, a whole row); and the codes against their definition.
    #[test]
    fn simd_and_twin_agree_bit_for_bit() {
        let mut seed = 12345u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        for (k, group, len) in [
            (576, 32, 576),
            (1536, 32, 1530),
            (256, 16, 256),
            (96, 96, 80),
        ] {
            for trial in 0..20 {
                let mut src: Vec<f32> = (0..len).map(|_| next()).collect();
                if trial % 2 == 0 {
                    for c in [3, 40, len - 1] {
                        src[c] = 60.0 * next();
                    }
                }
                if trial % 5 == 0 {
                    src[..group.min(len)].fill(0.0);
                }
                let (mut a, mut b) = (rows(k, group), rows(k, group));
                quantize_row(&src, group, view(&mut a));
                twin::quantize_row(&src, group, view(&mut b));
                assert_eq!(a, b, "k {k} group {group} trial {trial}");
                for (i, &x) in src.iter().enumerate() {
                    let s = a.1[i / group];
                    assert!((a.0[i] as f32 * s - x).abs() <= 0.5 * s * (1.0 + 1e-6));
                }
                assert!(a.0[len..].iter().all(|&c| c == 0));
                let (mut ah, mut al) = (rows(k, group), rows(k, group));
                let (mut bh, mut bl) = (rows(k, group), rows(k, group));
                let ratio = if trial % 3 == 0 {
                    0.0
                } else {
                    OUTLIER_RMS_RATIO
                };
                quantize_row_split(&src, group, ratio, view(&mut ah), view(&mut al));
                twin::quantize_row_split(&src, group, ratio, view(&mut bh), view(&mut bl));
                assert_eq!((&ah, &al), (&bh, &bl), "split: k {k} group {group} {trial}");
                assert_eq!(ah, a);
                if trial % 2 == 0 && group < k {
                    assert!(al.1.iter().any(|&s| s != 0.0), "outliers keep a residual");
                }
            }
        }
    }
}
