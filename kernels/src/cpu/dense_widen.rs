//! Group-scaled int weights (Int4 / Int4Min / Int8Group: llama.cpp's Q4_0 / Q4_1 / Q8_0 blocks) widened
//! to the bf16 tile layout a few N-tiles at a time, so dense projections can take bf16 activations
//! instead of int8 ones. Why: per-group int8 activations are what llama.cpp does, but the massive
//! outlier channels of small LLMs' hidden states make their rounding error add up over layers
//! (SmolLM2-135M: 15% relative error of the logits after 30 layers, wrong greedy answers); bf16
//! activations keep 2⁻⁹ relative per element whatever the outliers. Cost: ~20 instructions per 64
//! weight bytes to widen (L1-resident output, reused by every row of the call).

use std::arch::x86_64::*;
use std::mem::transmute;

use crate::cpu::moe::pack::{GroupedCodes, MatRef, WeightFormat};

/// Whether [`widen_tiles`] handles this format.
pub(crate) fn widens(format: WeightFormat) -> bool {
    GroupedCodes::of(format).is_some()
}

/// Writes N-tiles `nt0 .. nt0 + nts` of `w` as bf16 tiles (`k_pad · 16` values each, pair rows of 16
/// outputs × 2 inputs) into `out`, each weight `code·d (+ m)` rounded to bf16 once.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/BF16; `w` is one of the [`widens`] formats; `out` holds
/// `nts · k_pad · 16` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn widen_tiles(w: &MatRef<'_>, nt0: usize, nts: usize, out: &mut [u16]) {
    let codes = GroupedCodes::of(w.l.format).expect("a format `widens` accepts (caller)");
    let (group, int4, with_min, off) = (codes.group, codes.int4, codes.with_min, codes.off);
    let offset = off as f32;
    let k_pad = w.l.k_pad;
    let groups = k_pad / group;
    let quads = k_pad / 4;
    assert!(out.len() >= nts * k_pad * 16);
    let even: __m512i =
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd: __m512i = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    // Lane l of value chunk c (values j·4 + q, 16 per chunk) belongs to output j = 4c + l/4.
    let lanes = _mm512_srli_epi32::<2>(_mm512_setr_epi32(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
    ));
    let lane_j: [__m512i; 4] =
        std::array::from_fn(|c| _mm512_add_epi32(_mm512_set1_epi32(4 * c as i32), lanes));
    let off = _mm512_set1_ps(offset);
    let nib = _mm512_set1_epi8(0x0F);
    let s16 = w.s16();
    for t in 0..nts {
        let nt = nt0 + t;
        let wp = w.ntile(nt).as_ptr();
        let dst = out[t * k_pad * 16..].as_mut_ptr();
        let quads_per_group = group / 4;
        let mut d_c = [_mm512_setzero_ps(); 4];
        let mut m_c = [_mm512_setzero_ps(); 4];
        for kk in 0..quads {
            // SAFETY: packed row of quad kk (64 bytes), its 16 (or 32) f16 scales and the output pair
            // rows 2kk, 2kk + 1 are in bounds.
            unsafe {
                if kk % quads_per_group == 0 {
                    // Per-lane scale and offset of this group, once per group: w = u·d + (m − off·d).
                    let at = codes.scale_at(groups, nt, kk / quads_per_group);
                    let dv = _mm512_cvtph_ps(_mm256_loadu_si256(s16.as_ptr().add(at).cast()));
                    let mv = if with_min {
                        _mm512_cvtph_ps(_mm256_loadu_si256(s16.as_ptr().add(at + 16).cast()))
                    } else {
                        _mm512_setzero_ps()
                    };
                    let bias = _mm512_fnmadd_ps(off, dv, mv);
                    for c in 0..4 {
                        d_c[c] = _mm512_permutexvar_ps(lane_j[c], dv);
                        m_c[c] = _mm512_permutexvar_ps(lane_j[c], bias);
                    }
                }
                let codes = if int4 {
                    let v = _mm512_loadu_si512(wp.add(kk / 2 * 64).cast());
                    if kk % 2 == 0 {
                        _mm512_and_si512(v, nib)
                    } else {
                        _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib)
                    }
                } else {
                    _mm512_loadu_si512(wp.add(kk * 64).cast())
                };
                let f = |c: usize, bytes: __m128i| {
                    let u = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
                    _mm512_fmadd_ps(u, d_c[c], m_c[c])
                };
                let c0 = f(0, _mm512_extracti32x4_epi32::<0>(codes));
                let c1 = f(1, _mm512_extracti32x4_epi32::<1>(codes));
                let c2 = f(2, _mm512_extracti32x4_epi32::<2>(codes));
                let c3 = f(3, _mm512_extracti32x4_epi32::<3>(codes));
                let x = transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(c1, c0));
                let y = transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(c3, c2));
                _mm512_storeu_si512(
                    dst.add(2 * kk * 32).cast(),
                    _mm512_permutex2var_epi32(x, even, y),
                );
                _mm512_storeu_si512(
                    dst.add((2 * kk + 1) * 32).cast(),
                    _mm512_permutex2var_epi32(x, odd, y),
                );
            }
        }
    }
}
