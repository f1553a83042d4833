//! GGML block formats (what GGUF files store): block sizes, exact dequantization with llama.cpp's
//! reference formulas (`dequantize_row_*` in `ggml-quants.c`, same float operations in the same
//! order, so the values are bit-identical), and the code/scale view the packer uses to repack
//! Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 into the kernels' tile formats without changing a single weight, and Q4_K / Q5_K /
//! Q6_K keeping every code (their sub-block scales and mins rounded once to f16).
//!
//! | type | elements per block | bytes | value |
//! |---|---|---|---|
//! | Q4_0 | 32 | 18: f16 d, 16 B nibbles | `(q − 8)·d` |
//! | Q4_1 | 32 | 20: f16 d, f16 m, nibbles | `q·d + m` |
//! | Q5_0 | 32 | 22: f16 d, 32 fifth bits, nibbles | `(q − 16)·d` |
//! | Q5_1 | 32 | 24: f16 d, f16 m, 32 fifth bits, nibbles | `q·d + m` |
//! | Q8_0 | 32 | 34: f16 d, 32 i8 | `q·d` |
//! | Q4_K | 256 | 144: f16 d, f16 dmin, 12 B 6-bit scales/mins, 128 B nibbles | `(d·sc)·q − dmin·m` per 32 |
//! | Q5_K | 256 | 176: as Q4_K plus 32 B of fifth bits | as Q4_K, q < 32 |
//! | Q6_K | 256 | 210: 128 B low nibbles, 64 B high pairs, 16 i8 scales, f16 d | `(d·sc)·(q − 32)` per 16 |
//! | F16 / BF16 / F32 | 1 | 2 / 2 / 4 | as stored |

use half::{bf16, f16};

/// A GGML tensor type the kernels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlBlock {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    /// llama-quantize's fallback for Q4_K rows that are not whole 256-blocks (e.g. GLM-4.5-Air's
    /// 1408-wide expert down projections in a Q4_K_M file).
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl GgmlBlock {
    /// The type for a GGUF type id (`ggml_type`), if the kernels read it.
    pub fn from_ggml_id(id: u32) -> Option<GgmlBlock> {
        Some(match id {
            0 => GgmlBlock::F32,
            1 => GgmlBlock::F16,
            2 => GgmlBlock::Q4_0,
            3 => GgmlBlock::Q4_1,
            6 => GgmlBlock::Q5_0,
            7 => GgmlBlock::Q5_1,
            8 => GgmlBlock::Q8_0,
            12 => GgmlBlock::Q4K,
            13 => GgmlBlock::Q5K,
            14 => GgmlBlock::Q6K,
            30 => GgmlBlock::Bf16,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlBlock::F32 => "F32",
            GgmlBlock::F16 => "F16",
            GgmlBlock::Bf16 => "BF16",
            GgmlBlock::Q4_0 => "Q4_0",
            GgmlBlock::Q4_1 => "Q4_1",
            GgmlBlock::Q5_0 => "Q5_0",
            GgmlBlock::Q5_1 => "Q5_1",
            GgmlBlock::Q8_0 => "Q8_0",
            GgmlBlock::Q4K => "Q4_K",
            GgmlBlock::Q5K => "Q5_K",
            GgmlBlock::Q6K => "Q6_K",
        }
    }

    /// (elements, bytes) of one block.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlBlock::F32 => (1, 4),
            GgmlBlock::F16 | GgmlBlock::Bf16 => (1, 2),
            GgmlBlock::Q4_0 => (32, 18),
            GgmlBlock::Q4_1 => (32, 20),
            GgmlBlock::Q5_0 => (32, 22),
            GgmlBlock::Q5_1 => (32, 24),
            GgmlBlock::Q8_0 => (32, 34),
            GgmlBlock::Q4K => (256, 144),
            GgmlBlock::Q5K => (256, 176),
            GgmlBlock::Q6K => (256, 210),
        }
    }

    /// Bytes of a row of `cols` elements, `None` if `cols` is not a whole number of blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        let (per, bytes) = self.block();
        cols.is_multiple_of(per).then(|| cols / per * bytes)
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Q4_K / Q5_K: scale and min of sub-block `j` (0..8) from the 12 packed bytes (`get_scale_min_k4`).
#[inline]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q5_0 / Q5_1: the 5-bit codes (0..32) of one block, element order: the low nibbles of `qs` are
/// elements 0..16, the high nibbles 16..32; fifth bit of element e is bit e of the little-endian `qh`.
fn q5_codes(kind: GgmlBlock, b: &[u8], codes: &mut [u8; 32]) {
    let at = if kind == GgmlBlock::Q5_0 { 2 } else { 4 };
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    for (j, &q) in b[at + 4..at + 20].iter().enumerate() {
        codes[j] = (q & 0xF) | ((((qh >> j) << 4) & 0x10) as u8);
        codes[j + 16] = (q >> 4) | (((qh >> (j + 12)) & 0x10) as u8);
    }
}

/// Dequantizes whole blocks: `bytes` holds `out.len() / per_block` blocks of `kind`.
pub fn dequantize(kind: GgmlBlock, bytes: &[u8], out: &mut [f32]) {
    let (per, bb) = kind.block();
    assert_eq!(bytes.len() / bb * per, out.len(), "block count");
    for (b, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(per)) {
        dequantize_block(kind, b, y);
    }
}

fn dequantize_block(kind: GgmlBlock, b: &[u8], y: &mut [f32]) {
    match kind {
        GgmlBlock::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlBlock::F16 => y[0] = f16_at(b, 0),
        GgmlBlock::Bf16 => y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlBlock::Q4_0 => {
            let d = f16_at(b, 0);
            for (j, &q) in b[2..18].iter().enumerate() {
                y[j] = ((q & 0xF) as i32 - 8) as f32 * d;
                y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
            }
        }
        GgmlBlock::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for (j, &q) in b[4..20].iter().enumerate() {
                y[j] = (q & 0xF) as f32 * d + m;
                y[j + 16] = (q >> 4) as f32 * d + m;
            }
        }
        GgmlBlock::Q5_0 | GgmlBlock::Q5_1 => {
            // `dequantize_row_q5_0` / `_q5_1`
            let mut codes = [0u8; 32];
            q5_codes(kind, b, &mut codes);
            let d = f16_at(b, 0);
            if kind == GgmlBlock::Q5_0 {
                for (o, &q) in y.iter_mut().zip(&codes) {
                    *o = (q as i32 - 16) as f32 * d;
                }
            } else {
                let m = f16_at(b, 2);
                for (o, &q) in y.iter_mut().zip(&codes) {
                    *o = q as f32 * d + m;
                }
            }
        }
        GgmlBlock::Q8_0 => {
            let d = f16_at(b, 0);
            for (o, &q) in y.iter_mut().zip(&b[2..34]) {
                *o = q as i8 as f32 * d;
            }
        }
        GgmlBlock::Q4K | GgmlBlock::Q5K => {
            let (d, min) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let (qh, ql) = if kind == GgmlBlock::Q5K {
                (&b[16..48], &b[48..176])
            } else {
                (&b[0..0], &b[16..144])
            };
            for c in 0..4 {
                let q = &ql[c * 32..c * 32 + 32];
                for half in 0..2 {
                    let (sc, m) = scale_min_k4(2 * c + half, scales);
                    let (d1, m1) = (d * sc as f32, min * m as f32);
                    let bit = 1u8 << (2 * c + half);
                    for l in 0..32 {
                        let mut v = if half == 0 { q[l] & 0xF } else { q[l] >> 4 };
                        if !qh.is_empty() && qh[l] & bit != 0 {
                            v += 16;
                        }
                        y[c * 64 + half * 32 + l] = d1 * v as f32 - m1;
                    }
                }
            }
        }
        GgmlBlock::Q6K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            for n in 0..2 {
                let (ql, qh, sc) = (&ql[n * 64..], &qh[n * 32..], &sc[n * 8..]);
                let y = &mut y[n * 128..];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    let s = |i: usize| d * sc[is + i] as i8 as f32;
                    y[l] = s(0) * q1 as f32;
                    y[l + 32] = s(2) * q2 as f32;
                    y[l + 64] = s(4) * q3 as f32;
                    y[l + 96] = s(6) * q4 as f32;
                }
            }
        }
    }
}

/// Inputs per scale group of the packed int format that keeps `kind`'s codes: 32 for Q4_0, Q4_1, Q8_0,
/// Q4_K and Q5_K (sub-blocks of 32), 16 for Q6_K (sub-blocks of 16); `None` for F16 / BF16 / F32
/// (not codes).
pub(crate) fn code_group(kind: GgmlBlock) -> Option<usize> {
    match kind {
        GgmlBlock::Q4_0
        | GgmlBlock::Q4_1
        | GgmlBlock::Q5_0
        | GgmlBlock::Q5_1
        | GgmlBlock::Q8_0
        | GgmlBlock::Q4K
        | GgmlBlock::Q5K => Some(32),
        GgmlBlock::Q6K => Some(16),
        _ => None,
    }
}

/// Calls `f(g, codes, d, m)` for each scale group `g` of one block of `kind` (one group for Q4_0 /
/// Q4_1 / Q5_0 / Q5_1 / Q8_0, 8 for Q4_K / Q5_K, 16 for Q6_K; [`code_group`] inputs each), in the form
/// the packed int formats store: unsigned codes with value `(u − offset)·d` (Q4_0: offset 8; Q5_0,
/// Q8_0 and Q6_K: codes `q + 128`, offset 128) or `u·d + m` (Q4_1, Q5_1, Q4_K, Q5_K), `d` and `m` as f16
/// bits.
///
/// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 keep their f16 `d` and `m` as stored: bit for bit. The K-quants keep every code;
/// their sub-block scale `d·sc` (and Q4_K's min `−dmin·m`), computed in f32 as llama.cpp does, is
/// rounded to f16 once: a relative change of at most 2⁻¹¹ while it stays in f16's normal range
/// (|x| ≥ 6.1e-5), which is what a packed format with f16 group scales can hold. Does nothing for
/// types without codes.
pub(crate) fn block_groups(kind: GgmlBlock, b: &[u8], mut f: impl FnMut(usize, &[u8], u16, u16)) {
    let bits = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
    let h = |x: f32| f16::from_f32(x).to_bits();
    let mut codes = [0u8; 32];
    let nibbles = |codes: &mut [u8; 32], qs: &[u8]| {
        for (j, &q) in qs.iter().enumerate() {
            codes[j] = q & 0xF;
            codes[j + 16] = q >> 4;
        }
    };
    match kind {
        GgmlBlock::Q4_0 => {
            nibbles(&mut codes, &b[2..18]);
            f(0, &codes, bits(0), 0);
        }
        GgmlBlock::Q4_1 => {
            nibbles(&mut codes, &b[4..20]);
            f(0, &codes, bits(0), bits(2));
        }
        GgmlBlock::Q5_0 => {
            q5_codes(kind, b, &mut codes);
            for c in codes.iter_mut() {
                *c += 112; // q − 16 + 128
            }
            f(0, &codes, bits(0), 0);
        }
        GgmlBlock::Q5_1 => {
            q5_codes(kind, b, &mut codes);
            f(0, &codes, bits(0), bits(2));
        }
        GgmlBlock::Q8_0 => {
            for (c, &q) in codes.iter_mut().zip(&b[2..34]) {
                *c = (q as i8 as i32 + 128) as u8;
            }
            f(0, &codes, bits(0), 0);
        }
        GgmlBlock::Q4K | GgmlBlock::Q5K => {
            let (d, min) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let (qh, ql) = if kind == GgmlBlock::Q5K {
                (&b[16..48], &b[48..176])
            } else {
                (&b[0..0], &b[16..144])
            };
            for c in 0..4 {
                for half in 0..2 {
                    let (sc, m) = scale_min_k4(2 * c + half, scales);
                    let bit = 1u8 << (2 * c + half);
                    for (l, (o, &q)) in codes.iter_mut().zip(&ql[c * 32..c * 32 + 32]).enumerate() {
                        *o = if half == 0 { q & 0xF } else { q >> 4 };
                        if !qh.is_empty() && qh[l] & bit != 0 {
                            *o += 16;
                        }
                    }
                    f(2 * c + half, &codes, h(d * sc as f32), h(-(min * m as f32)));
                }
            }
        }
        GgmlBlock::Q6K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            // Element e of the block: half n = e / 128, quarter i = (e % 128) / 32, lane l = e % 32;
            // its scale is sc[8n + 2i + l / 16] (one per 16 elements).
            for g in 0..16 {
                let (n, i, l0) = (g / 8, (g % 8) / 2, (g % 2) * 16);
                let (ql, qh) = (&ql[n * 64..], &qh[n * 32..]);
                for (j, o) in codes[..16].iter_mut().enumerate() {
                    let l = l0 + j;
                    let q = ql[l + 32 * (i % 2)];
                    let lo = if i < 2 { q & 0xF } else { q >> 4 };
                    let hi = (qh[l] >> (2 * i)) & 3;
                    *o = (lo | (hi << 4)) + 96; // q − 32 + 128
                }
                f(
                    g,
                    &codes[..16],
                    h(d * sc[8 * n + 2 * i + l0 / 16] as i8 as f32),
                    0,
                );
            }
        }
        GgmlBlock::F32 | GgmlBlock::F16 | GgmlBlock::Bf16 => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's `dequantize_row_q4_K` transcribed literally (pointer walk and all), to check the
    /// loop above against the reference's own control flow.
    fn q4k_reference(x: &[u8], y: &mut Vec<f32>) {
        let d = f16_at(x, 0);
        let min = f16_at(x, 2);
        let scales = &x[4..16];
        let mut q = &x[16..144];
        let mut is = 0;
        let mut j = 0;
        while j < 256 {
            let (sc, m) = scale_min_k4(is, scales);
            let d1 = d * sc as f32;
            let m1 = min * m as f32;
            let (sc, m) = scale_min_k4(is + 1, scales);
            let d2 = d * sc as f32;
            let m2 = min * m as f32;
            for l in 0..32 {
                y.push(d1 * (q[l] & 0xF) as f32 - m1);
            }
            for l in 0..32 {
                y.push(d2 * (q[l] >> 4) as f32 - m2);
            }
            q = &q[32..];
            is += 2;
            j += 64;
        }
    }

    fn bytes(n: usize, seed: u32) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s >> 8) as u8
            })
            .collect()
    }

    /// Keeps f16 scales finite (exponent bits not all ones) so comparisons are numeric.
    fn finite_f16(b: &mut [u8], at: usize) {
        b[at + 1] &= 0x3B;
    }

    #[test]
    fn q4k_matches_the_reference_loop() {
        for seed in 1..20 {
            let mut b = bytes(144, seed);
            finite_f16(&mut b, 0);
            finite_f16(&mut b, 2);
            let mut want = Vec::new();
            q4k_reference(&b, &mut want);
            let mut got = vec![0f32; 256];
            dequantize(GgmlBlock::Q4K, &b, &mut got);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn hand_built_blocks_decode_to_known_values() {
        // Q4_0: d = 0.5, nibble j = j → (j − 8)/2, high nibble 15 − j.
        let mut b = vec![0u8; 18];
        b[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        for j in 0..16 {
            b[2 + j] = (j as u8) | (((15 - j) as u8) << 4);
        }
        let mut y = vec![0f32; 32];
        dequantize(GgmlBlock::Q4_0, &b, &mut y);
        assert_eq!(y[3], -2.5);
        assert_eq!(y[16 + 3], 2.0);
        // Q6_K: d = 1, scale 2 everywhere, all quants 0x3F → (63 − 32)·2 = 62.
        let mut b = vec![0xFFu8; 210];
        b[192..208].fill(2);
        b[208..210].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        let mut y = vec![0f32; 256];
        dequantize(GgmlBlock::Q6K, &b, &mut y);
        assert!(y.iter().all(|&v| v == 62.0));
        // Q5_K: d = 1, dmin = 0.5, scale/min of sub-block 0 = 3/4, fifth bit set for l = 0.
        let mut b = vec![0u8; 176];
        b[0..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[4] = 3;
        b[8] = 4;
        b[16] = 1; // qh[0] bit 0
        b[48] = 0x25; // ql[0]: low nibble 5
        let mut y = vec![0f32; 256];
        dequantize(GgmlBlock::Q5K, &b, &mut y);
        assert_eq!(y[0], 3.0 * 21.0 - 2.0);
        assert_eq!(y[1], -2.0);
    }

    /// Q5_0 / Q5_1 against llama.cpp's own Python reader (gguf-py 0.19's `quants.dequantize`) on one
    /// hand-built block each: d = 0.5 (Q5_1: m = −1.25), qh = 0xA5C30F96, nibbles j | (15 − j) << 4.
    #[test]
    fn q5_blocks_decode_as_gguf_py_does() {
        let head = |m: Option<f32>| {
            let mut b = f16::from_f32(0.5).to_le_bytes().to_vec();
            if let Some(m) = m {
                b.extend(f16::from_f32(m).to_le_bytes());
            }
            b.extend(0xA5C3_0F96u32.to_le_bytes());
            b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
            b
        };
        let q5_0: [f32; 32] = [
            -8.0, 0.5, 1.0, -6.5, 2.0, -5.5, -5.0, 3.5, 4.0, 4.5, 5.0, 5.5, -2.0, -1.5, -1.0, -0.5,
            7.5, 7.0, -1.5, -2.0, -2.5, -3.0, 4.5, 4.0, 3.5, -5.0, 2.5, -6.0, -6.5, 1.0, -7.5, 0.0,
        ];
        let q5_1: [f32; 32] = [
            -1.25, 7.25, 7.75, 0.25, 8.75, 1.25, 1.75, 10.25, 10.75, 11.25, 11.75, 12.25, 4.75,
            5.25, 5.75, 6.25, 14.25, 13.75, 5.25, 4.75, 4.25, 3.75, 11.25, 10.75, 10.25, 1.75,
            9.25, 0.75, 0.25, 7.75, -0.75, 6.75,
        ];
        for (kind, b, want) in [
            (GgmlBlock::Q5_0, head(None), q5_0),
            (GgmlBlock::Q5_1, head(Some(-1.25)), q5_1),
        ] {
            assert_eq!(b.len(), kind.block().1);
            let mut y = [0f32; 32];
            dequantize(kind, &b, &mut y);
            assert_eq!(y, want, "{kind:?}");
        }
        assert_eq!(GgmlBlock::from_ggml_id(6), Some(GgmlBlock::Q5_0));
        assert_eq!(GgmlBlock::from_ggml_id(7), Some(GgmlBlock::Q5_1));
    }

    /// The code view against the dequantized values: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 bit for bit; Q4_K / Q6_K with
    /// every value within the one f16 rounding of its scale and min (2⁻¹¹ relative, 2⁻²⁵ absolute
    /// below f16's normal range), on random blocks and on blocks with typical small scales.
    #[test]
    fn block_groups_reproduce_the_values() {
        let kinds = [
            GgmlBlock::Q4_0,
            GgmlBlock::Q4_1,
            GgmlBlock::Q5_0,
            GgmlBlock::Q5_1,
            GgmlBlock::Q8_0,
            GgmlBlock::Q4K,
            GgmlBlock::Q5K,
            GgmlBlock::Q6K,
        ];
        for kind in kinds {
            for seed in 1..6 {
                let (per, bb) = kind.block();
                let mut b = bytes(bb, seed * 7);
                let d_at = if kind == GgmlBlock::Q6K { 208 } else { 0 };
                finite_f16(&mut b, d_at);
                if matches!(
                    kind,
                    GgmlBlock::Q4_1 | GgmlBlock::Q5_1 | GgmlBlock::Q4K | GgmlBlock::Q5K
                ) {
                    finite_f16(&mut b, 2);
                }
                if seed % 2 == 0 {
                    // a typical super-block scale: d = 3e-4 (dmin 2e-4)
                    b[d_at..d_at + 2].copy_from_slice(&f16::from_f32(3e-4).to_le_bytes());
                    if matches!(kind, GgmlBlock::Q4K | GgmlBlock::Q5K) {
                        b[2..4].copy_from_slice(&f16::from_f32(2e-4).to_le_bytes());
                    }
                }
                let mut want = vec![0f32; per];
                dequantize(kind, &b, &mut want);
                let group = code_group(kind).unwrap();
                let mut seen = 0;
                block_groups(kind, &b, |g, codes, d, m| {
                    assert_eq!(codes.len(), group);
                    seen += group;
                    let (d, m) = (f16::from_bits(d).to_f32(), f16::from_bits(m).to_f32());
                    for (i, &c) in codes.iter().enumerate() {
                        let w = want[g * group + i];
                        let (u, v) = match kind {
                            GgmlBlock::Q4_0 => (c as f32 - 8.0, (c as f32 - 8.0) * d),
                            GgmlBlock::Q4_1 | GgmlBlock::Q5_1 | GgmlBlock::Q4K | GgmlBlock::Q5K => {
                                (c as f32, c as f32 * d + m)
                            }
                            _ => (c as f32 - 128.0, (c as f32 - 128.0) * d),
                        };
                        if matches!(kind, GgmlBlock::Q4K | GgmlBlock::Q5K | GgmlBlock::Q6K) {
                            let err = |x: f32| x.abs() * 2f32.powi(-11) + 2f32.powi(-25);
                            let tol = u.abs() * err(d) + err(m) + w.abs() * 1e-6;
                            assert!((v - w).abs() <= tol, "{kind:?} {g}/{i}: {v} vs {w}");
                        } else {
                            assert_eq!(v.to_bits(), w.to_bits(), "{kind:?} {i}");
                        }
                    }
                });
                assert_eq!(seen, per, "{kind:?}: every element in one group");
            }
        }
    }
}
