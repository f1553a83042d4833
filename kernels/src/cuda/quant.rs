//! Dense weights for the GPU in 4-bit and 8-bit, built on the host at load (the layouts the
//! `gemv_w4a16` / `gemv_w8a16` / `dense_dequant_*` kernels of `dense_quant.cu` read).
//!
//! - int4 (W4A16): one f16 scale per row and group of 128 (or 64 / 32) inputs. Quantized at load it is
//!   symmetric: the scale is the group's largest-magnitude value over -8 (as GGML's Q4_0), so all 16
//!   levels are used, and a code u reads as (u − 8)·d. GGUF Q4_1 and Q4_K tensors keep their codes
//!   with a per-group f16 minimum as well (asymmetric, u·d + m: llama.cpp's Q4_1, and Q4_K's 6-bit
//!   sub-block scales and mins rounded once to f16, as the CPU kernels keep them), so the GPU computes
//!   with the checkpoint's own weights ([`QuantizedMatrix::from_ggml_blocks`]).
//!   Row-major `[out, in/8]` u32 words, input `8j+i` in bits `4i..4i+3` of word j, as the code u.
//!   (Marlin permutes the same group-wise format for tensor-core tiles; decode here is a CUDA-core
//!   GEMV, for which plain row order reads contiguously.)
//! - fp8 (W8A16): E4M3 bytes, row-major `[out, in]`, one f32 scale per row and group. FP8 checkpoints
//!   with 128×128 block scales keep their bytes and scales exactly (see [`QuantizedMatrix::from_fp8_blocks`]);
//!   bf16 ones get scale = group absmax / 448.
//! - int8 (W8A16, the fp8 kernels with int8 codes): GGUF tensors stored in more than 4 bits (Q8_0 and
//!   Q6_K codes kept as int8 groups of 32 / 16; Q5_K quantized to int8 groups of 32) when the GPU is
//!   asked for int4 or fp8, so a file's 8-bit lm_head is not rounded to 4 bits or E4M3.
//!
//! [`QuantizedMatrix::dequantize_row`] is the slow reference the tests (and the GPU tests) compare with.
use crate::cpu::GgmlBlock;
use half::f16;
use rayon::prelude::*;

/// Precision of the dense projections on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DenseFormat {
    #[default]
    Bf16,
    Fp8,
    Int4,
    /// int8 codes with f32 group scales (GGUF tensors of more than 4 bits, see the module doc).
    Int8,
}

/// How a W8A16 matrix's bytes read: E4M3 or two's-complement int8 (`code` of the `*_w8*` kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum W8Code {
    E4m3 = 0,
    Int8 = 1,
}

// SAFETY: a repr(i32) enum is passed as the kernels' `int code` (0 or 1), a plain 4-byte value.
unsafe impl cudarc::driver::DeviceRepr for W8Code {}

impl W8Code {
    pub fn decode(self, b: u8) -> f32 {
        match self {
            W8Code::E4m3 => e4m3_to_f32(b),
            W8Code::Int8 => b as i8 as f32,
        }
    }
}

impl DenseFormat {
    /// Bytes per weight on the GPU, scales included (groups of 128).
    pub fn bytes_per_weight(self) -> f64 {
        match self {
            DenseFormat::Bf16 => 2.0,
            DenseFormat::Fp8 => 1.0 + 4.0 / 128.0,
            DenseFormat::Int4 => 0.5 + 2.0 / 128.0,
            DenseFormat::Int8 => 1.0 + 4.0 / 32.0,
        }
    }
}

impl std::fmt::Display for DenseFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DenseFormat::Bf16 => "bf16",
            DenseFormat::Fp8 => "fp8",
            DenseFormat::Int4 => "int4",
            DenseFormat::Int8 => "int8",
        })
    }
}

/// Largest E4M3 magnitude (0x7E; 0x7F is NaN).
pub const E4M3_MAX: f32 = 448.0;

/// f32 → E4M3 (fn), round to nearest even, saturating at ±448 (as the FP8 checkpoints' quantizers).
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return 0x7f | sign;
    }
    if a >= E4M3_MAX {
        return 0x7e | sign;
    }
    let code = if a < 2f32.powi(-6) {
        // subnormal: m × 2^-9, m = 0..=8 (8 is the smallest normal, the next code)
        let m = a * 512.0;
        let r = m.round_ties_even();
        r as u32
    } else {
        let bits = a.to_bits();
        let exp = (bits >> 23) as i32 - 127; // -6..=8
        let mant = bits & 0x7f_ffff;
        let (q, rem) = (mant >> 20, mant & 0xf_ffff);
        let half = 0x8_0000;
        let up = rem > half || (rem == half && q & 1 == 1);
        (((exp + 7) as u32) << 3) + q + up as u32
    };
    (code.min(0x7e) as u8) | sign
}

/// E4M3 (fn) → f32, exact.
pub fn e4m3_to_f32(b: u8) -> f32 {
    crate::cpu::moe::fp8_e4m3_to_f32(b)
}

/// A dense `[rows, cols]` weight in the GPU's 4-bit or 8-bit layout.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantizedMatrix {
    Int4 {
        rows: usize,
        cols: usize,
        group: usize,
        /// `[rows, cols / 8]`
        packed: Vec<u32>,
        /// f16 bits, `[rows, cols / group]`
        scales: Vec<u16>,
        /// f16 bits, `[rows, cols / group]`: the group minimum `m` of asymmetric codes (u·d + m);
        /// `None`: symmetric codes ((u − 8)·d).
        mins: Option<Vec<u16>>,
    },
    /// 8-bit codes (E4M3: `--dense-dtype fp8`; int8: kept GGUF codes).
    W8 {
        rows: usize,
        cols: usize,
        group: usize,
        code: W8Code,
        /// `[rows, cols]` codes
        bytes: Vec<u8>,
        /// `[rows, cols / group]`
        scales: Vec<f32>,
    },
}

/// Largest of 128, 64, 32 (int4) or also 16 (fp8) dividing `cols`; `None`: the kernels' alignment
/// cannot be met and the matrix stays bf16.
pub fn group_for(format: DenseFormat, cols: usize) -> Option<usize> {
    let candidates: &[usize] = match format {
        DenseFormat::Bf16 => return None,
        DenseFormat::Int4 => &[128, 64, 32],
        DenseFormat::Fp8 => &[128, 64, 32, 16],
        DenseFormat::Int8 => &[32, 16],
    };
    candidates
        .iter()
        .copied()
        .find(|&g| cols > 0 && cols.is_multiple_of(g))
}

impl QuantizedMatrix {
    /// Quantizes rows produced by `row(r, buf)` (f32, `cols` each); `None` when `cols` does not fit
    /// the kernels' alignment (see [`group_for`]) or `format` is bf16. Rows run in parallel (rayon).
    pub fn quantize(
        format: DenseFormat,
        rows: usize,
        cols: usize,
        row: impl Fn(usize, &mut [f32]) + Sync,
    ) -> Option<Self> {
        let group = group_for(format, cols)?;
        let groups = cols / group;
        Some(match format {
            DenseFormat::Bf16 => return None,
            DenseFormat::Int4 => {
                let mut packed = vec![0u32; rows * cols / 8];
                let mut scales = vec![0u16; rows * groups];
                packed
                    .par_chunks_mut(cols / 8)
                    .zip(scales.par_chunks_mut(groups))
                    .enumerate()
                    .for_each_init(
                        || vec![0f32; cols],
                        |buf, (r, (words, sc))| {
                            row(r, buf);
                            quantize_int4_row(buf, group, words, sc);
                        },
                    );
                QuantizedMatrix::Int4 {
                    rows,
                    cols,
                    group,
                    packed,
                    scales,
                    mins: None,
                }
            }
            DenseFormat::Fp8 | DenseFormat::Int8 => {
                let code = if format == DenseFormat::Int8 {
                    W8Code::Int8
                } else {
                    W8Code::E4m3
                };
                let mut bytes = vec![0u8; rows * cols];
                let mut scales = vec![0f32; rows * groups];
                bytes
                    .par_chunks_mut(cols)
                    .zip(scales.par_chunks_mut(groups))
                    .enumerate()
                    .for_each_init(
                        || vec![0f32; cols],
                        |buf, (r, (out, sc))| {
                            row(r, buf);
                            quantize_w8_row(buf, (group, code), out, sc);
                        },
                    );
                QuantizedMatrix::W8 {
                    rows,
                    cols,
                    group,
                    code,
                    bytes,
                    scales,
                }
            }
        })
    }

    /// An FP8 checkpoint's weight as is: E4M3 bytes with `scale_inv` per `block × block` tile
    /// (`[ceil(rows/block), ceil(cols/block)]`). `None` when `cols` is not a multiple of `block` or
    /// `block` is not a group the kernels take (then quantize from the dequantized rows).
    pub fn from_fp8_blocks(
        rows: usize,
        cols: usize,
        bytes: Vec<u8>,
        scale_inv: &[f32],
        block: usize,
    ) -> Option<Self> {
        if block == 0
            || !cols.is_multiple_of(block)
            || !block.is_multiple_of(16)
            || bytes.len() != rows * cols
        {
            return None;
        }
        let groups = cols / block;
        if scale_inv.len() < rows.div_ceil(block) * groups {
            return None;
        }
        let scales = (0..rows)
            .flat_map(|r| scale_inv[(r / block) * groups..(r / block + 1) * groups].iter())
            .copied()
            .collect();
        Some(QuantizedMatrix::W8 {
            rows,
            cols,
            group: block,
            code: W8Code::E4m3,
            bytes,
            scales,
        })
    }

    pub fn format(&self) -> DenseFormat {
        match self {
            QuantizedMatrix::Int4 { .. } => DenseFormat::Int4,
            QuantizedMatrix::W8 {
                code: W8Code::E4m3, ..
            } => DenseFormat::Fp8,
            QuantizedMatrix::W8 {
                code: W8Code::Int8, ..
            } => DenseFormat::Int8,
        }
    }

    pub fn rows(&self) -> usize {
        match self {
            QuantizedMatrix::Int4 { rows, .. } | QuantizedMatrix::W8 { rows, .. } => *rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            QuantizedMatrix::Int4 { cols, .. } | QuantizedMatrix::W8 { cols, .. } => *cols,
        }
    }

    /// Bytes on the GPU (weights and scales).
    pub fn device_bytes(&self) -> usize {
        match self {
            QuantizedMatrix::Int4 {
                packed,
                scales,
                mins,
                ..
            } => packed.len() * 4 + (scales.len() + mins.as_ref().map_or(0, Vec::len)) * 2,
            QuantizedMatrix::W8 { bytes, scales, .. } => bytes.len() + scales.len() * 4,
        }
    }

    /// `self`'s rows followed by `below`'s, when both have one format, width and group (the
    /// gate and up projections stored as one matrix); `None` otherwise.
    pub fn stack_rows(self, below: Self) -> Option<Self> {
        match (self, below) {
            (
                QuantizedMatrix::Int4 {
                    rows,
                    cols,
                    group,
                    mut packed,
                    mut scales,
                    mins,
                },
                QuantizedMatrix::Int4 {
                    rows: rows_b,
                    cols: cols_b,
                    group: group_b,
                    packed: packed_b,
                    scales: scales_b,
                    mins: mins_b,
                },
            ) if cols == cols_b && group == group_b && mins.is_some() == mins_b.is_some() => {
                packed.extend(packed_b);
                scales.extend(scales_b);
                let mins = mins.zip(mins_b).map(|(mut a, b)| {
                    a.extend(b);
                    a
                });
                Some(QuantizedMatrix::Int4 {
                    rows: rows + rows_b,
                    cols,
                    group,
                    packed,
                    scales,
                    mins,
                })
            }
            (
                QuantizedMatrix::W8 {
                    rows,
                    cols,
                    group,
                    code,
                    mut bytes,
                    mut scales,
                },
                QuantizedMatrix::W8 {
                    rows: rows_b,
                    cols: cols_b,
                    group: group_b,
                    code: code_b,
                    bytes: bytes_b,
                    scales: scales_b,
                },
            ) if cols == cols_b && group == group_b && code == code_b => {
                bytes.extend(bytes_b);
                scales.extend(scales_b);
                Some(QuantizedMatrix::W8 {
                    rows: rows + rows_b,
                    cols,
                    group,
                    code,
                    bytes,
                    scales,
                })
            }
            _ => None,
        }
    }

    /// GGML blocks with the blocks' own codes, where a GPU layout holds them: Q4_0 as symmetric int4
    /// groups of 32 (its f16 `d`, value d·(u − 8)) and Q4_1 with its f16 `d` and `m` (u·d + m), both
    /// bit for bit; Q4_K's sub-blocks of 32 with d·sc and −dmin·m rounded once to f16 (as the CPU
    /// kernels pack them, `cpu::ggml::block_groups`); Q8_0 as int8 groups of 32 (bit for bit) and
    /// Q6_K as int8 groups of 16 (its codes q − 32, scale d·sc rounded once to f16). `None` for other
    /// types or unless `blocks` is `rows` rows of whole blocks.
    pub fn from_ggml_blocks(
        kind: GgmlBlock,
        rows: usize,
        cols: usize,
        blocks: &[u8],
    ) -> Option<Self> {
        let int4 = matches!(kind, GgmlBlock::Q4_0 | GgmlBlock::Q4_1 | GgmlBlock::Q4K);
        if !int4 && !matches!(kind, GgmlBlock::Q8_0 | GgmlBlock::Q5_0 | GgmlBlock::Q6K) {
            return None;
        }
        let group = crate::cpu::ggml::code_group(kind)?;
        let (block_elems, block_bytes) = kind.block();
        if cols == 0
            || !cols.is_multiple_of(block_elems)
            || blocks.len() != rows * cols / block_elems * block_bytes
        {
            return None;
        }
        let groups = rows * cols / group;
        let per_block = block_elems / group;
        let with_min = matches!(kind, GgmlBlock::Q4_1 | GgmlBlock::Q4K);
        let mut scales16 = vec![0u16; groups];
        let mut mins = vec![0u16; if with_min { groups } else { 0 }];
        // int4: 4-bit codes in u32 words; int8: the codes as bytes (two's complement)
        let mut packed = vec![0u32; if int4 { rows * cols / 8 } else { 0 }];
        let mut bytes = vec![0u8; if int4 { 0 } else { rows * cols }];
        for (b, block) in blocks.chunks_exact(block_bytes).enumerate() {
            crate::cpu::ggml::block_groups(kind, block, |g, codes, d, m| {
                let gi = b * per_block + g;
                scales16[gi] = d;
                if with_min {
                    mins[gi] = m;
                }
                if int4 {
                    let words = &mut packed[gi * group / 8..(gi + 1) * group / 8];
                    for (i, &u) in codes.iter().enumerate() {
                        words[i / 8] |= ((u & 15) as u32) << (4 * (i % 8));
                    }
                } else {
                    // unsigned codes u = q + 128 (`block_groups`' offset form)
                    for (o, &u) in bytes[gi * group..(gi + 1) * group].iter_mut().zip(codes) {
                        *o = (u as i32 - 128) as i8 as u8;
                    }
                }
            });
        }
        Some(if int4 {
            QuantizedMatrix::Int4 {
                rows,
                cols,
                group,
                packed,
                scales: scales16,
                mins: with_min.then_some(mins),
            }
        } else {
            QuantizedMatrix::W8 {
                rows,
                cols,
                group,
                code: W8Code::Int8,
                bytes,
                scales: scales16
                    .iter()
                    .map(|&d| f16::from_bits(d).to_f32())
                    .collect(),
            }
        })
    }

    /// Row `r` as f32 (the slow reference of the GPU kernels).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        match self {
            QuantizedMatrix::Int4 {
                cols,
                group,
                packed,
                scales,
                mins,
                ..
            } => {
                let words = &packed[r * cols / 8..(r + 1) * cols / 8];
                let first = r * (cols / group);
                let f = |bits: u16| f16::from_bits(bits).to_f32();
                for (c, o) in out[..*cols].iter_mut().enumerate() {
                    let u = ((words[c / 8] >> (4 * (c % 8))) & 15) as i32;
                    let d = f(scales[first + c / group]);
                    *o = match mins {
                        Some(m) => u as f32 * d + f(m[first + c / group]),
                        None => (u - 8) as f32 * d,
                    };
                }
            }
            QuantizedMatrix::W8 {
                cols,
                group,
                code,
                bytes,
                scales,
                ..
            } => {
                let row = &bytes[r * cols..(r + 1) * cols];
                let sc = &scales[r * (cols / group)..];
                for (c, o) in out[..*cols].iter_mut().enumerate() {
                    *o = code.decode(row[c]) * sc[c / group];
                }
            }
        }
    }
}

/// One row to int4: per group, scale = (signed value of largest magnitude) / -8, stored as f16, and
/// q = clamp(round(w / scale), -8, 7) computed with the rounded scale.
fn quantize_int4_row(row: &[f32], group: usize, words: &mut [u32], scales: &mut [u16]) {
    for (g, chunk) in row.chunks(group).enumerate() {
        let peak = chunk
            .iter()
            .copied()
            .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
        let scale = f16::from_f32(peak / -8.0);
        scales[g] = scale.to_bits();
        let s = scale.to_f32();
        let inv = if s != 0.0 { 1.0 / s } else { 0.0 };
        for (i, &v) in chunk.iter().enumerate() {
            let q = (v * inv).round().clamp(-8.0, 7.0) as i32;
            let c = g * group + i;
            words[c / 8] |= ((q + 8) as u32) << (4 * (c % 8));
        }
    }
}

/// One row to 8-bit codes: E4M3 with scale = group absmax / 448, or int8 with scale = group absmax /
/// 127 (llama.cpp's Q8_0 rounding).
fn quantize_w8_row(
    row: &[f32],
    (group, code): (usize, W8Code),
    out: &mut [u8],
    scales: &mut [f32],
) {
    let peak = match code {
        W8Code::E4m3 => E4M3_MAX,
        W8Code::Int8 => 127.0,
    };
    for (g, chunk) in row.chunks(group).enumerate() {
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = if amax > 0.0 { amax / peak } else { 1.0 };
        scales[g] = s;
        for (i, &v) in chunk.iter().enumerate() {
            out[g * group + i] = match code {
                W8Code::E4m3 => f32_to_e4m3(v / s),
                W8Code::Int8 => (v / s).round().clamp(-127.0, 127.0) as i8 as u8,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_rows(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..rows * cols)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
            })
            .collect()
    }

    fn rel_err(a: &[f32], b: &[f32]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (num / den).sqrt()
    }

    /// Q4_0, Q4_1 and Q8_0 blocks read back exactly as GGML dequantizes them; Q4_K and Q6_K within the
    /// one f16 rounding of each sub-block's d·sc (and −dmin·m) (≤ 2⁻¹¹ relative each).
    #[test]
    fn ggml_q4_blocks_become_int4_groups_with_their_codes() {
        use crate::cpu::ggml;
        let (rows, cols) = (3, 512);
        let mut s = 11u64;
        let mut byte = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        };
        let f16_bytes = |x: f32| half::f16::from_f32(x).to_bits().to_le_bytes();
        for kind in [
            GgmlBlock::Q4_0,
            GgmlBlock::Q4_1,
            GgmlBlock::Q4K,
            GgmlBlock::Q8_0,
            GgmlBlock::Q6K,
        ] {
            let (elems, bytes) = kind.block();
            let mut blocks = Vec::new();
            for b in 0..rows * cols / elems {
                let sign = if b % 2 == 0 { 1.0 } else { -1.0 };
                // f16 header fields (d; Q4_1's m, Q4_K's dmin), then random codes and 6-bit scales
                let header: Vec<u8> = match kind {
                    GgmlBlock::Q4_0 | GgmlBlock::Q8_0 => {
                        f16_bytes(0.01 + 0.003 * b as f32 * sign).to_vec()
                    }
                    GgmlBlock::Q6K => Vec::new(),
                    _ => [f16_bytes(0.004 + 0.001 * b as f32), f16_bytes(-0.05 * sign)].concat(),
                };
                blocks.extend(&header);
                for _ in header.len()..bytes {
                    blocks.push(byte());
                }
                if kind == GgmlBlock::Q6K {
                    // Q6_K's f16 super-block scale is its last two bytes
                    blocks.truncate(blocks.len() - 2);
                    blocks.extend(f16_bytes(0.002 + 0.0005 * b as f32));
                }
            }
            let mut want = vec![0f32; rows * cols];
            ggml::dequantize(kind, &blocks, &mut want);
            let q = QuantizedMatrix::from_ggml_blocks(kind, rows, cols, &blocks).unwrap();
            let (format, with_min) = match kind {
                GgmlBlock::Q4_0 => (DenseFormat::Int4, false),
                GgmlBlock::Q4_1 | GgmlBlock::Q4K => (DenseFormat::Int4, true),
                _ => (DenseFormat::Int8, false),
            };
            assert_eq!(q.format(), format, "{kind:?}");
            assert_eq!(
                matches!(q, QuantizedMatrix::Int4 { mins: Some(_), .. }),
                with_min
            );
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                q.dequantize_row(r, &mut row);
                let want = &want[r * cols..(r + 1) * cols];
                if matches!(kind, GgmlBlock::Q4K | GgmlBlock::Q6K) {
                    let peak = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                    for (c, (g, w)) in row.iter().zip(want).enumerate() {
                        assert!(
                            (g - w).abs() <= peak * 2f32.powi(-8),
                            "{kind:?} ({r},{c}) {g} {w}"
                        );
                    }
                } else {
                    assert_eq!(row, want, "{kind:?} row {r}");
                }
            }
            assert!(QuantizedMatrix::from_ggml_blocks(kind, rows, cols, &blocks[1..]).is_none());
            assert!(QuantizedMatrix::from_ggml_blocks(kind, rows, cols / 2, &blocks).is_none());
        }
        assert!(QuantizedMatrix::from_ggml_blocks(GgmlBlock::Q5K, 1, 256, &[0; 176]).is_none());
    }

    #[test]
    fn stacking_quantized_rows_equals_quantizing_the_stack() {
        let (rows, cols) = (6, 256);
        let w = random_rows(2 * rows, cols, 7);
        for format in [DenseFormat::Int4, DenseFormat::Fp8] {
            let part = |r0: usize| {
                QuantizedMatrix::quantize(format, rows, cols, |r, buf| {
                    buf.copy_from_slice(&w[(r0 + r) * cols..(r0 + r + 1) * cols])
                })
                .unwrap()
            };
            let whole = QuantizedMatrix::quantize(format, 2 * rows, cols, |r, buf| {
                buf.copy_from_slice(&w[r * cols..(r + 1) * cols])
            })
            .unwrap();
            assert_eq!(part(0).stack_rows(part(rows)), Some(whole), "{format}");
        }
        // different groups do not stack
        let narrow =
            QuantizedMatrix::quantize(DenseFormat::Fp8, 1, 48, |_, b| b.fill(1.0)).unwrap();
        let wide = QuantizedMatrix::quantize(DenseFormat::Fp8, 1, 64, |_, b| b.fill(1.0)).unwrap();
        assert_eq!(narrow.stack_rows(wide), None);
    }

    #[test]
    fn e4m3_encoding_inverts_decoding_and_rounds_to_even() {
        for code in 0u8..=255 {
            if code & 0x7f == 0x7f {
                continue; // NaN
            }
            let v = e4m3_to_f32(code);
            let back = f32_to_e4m3(v);
            // +0 and -0 both decode to 0.0 / -0.0 and keep their sign bit
            assert_eq!(back, code, "code {code:#x} value {v}");
        }
        // midpoints between neighbours go to the even code; just above goes up
        for code in 0u8..0x7e {
            let (lo, hi) = (e4m3_to_f32(code), e4m3_to_f32(code + 1));
            let mid = (lo + hi) / 2.0;
            let even = if code % 2 == 0 { code } else { code + 1 };
            assert_eq!(f32_to_e4m3(mid), even, "midpoint of {code:#x}");
            assert_eq!(f32_to_e4m3(mid + (hi - lo) * 0.01), code + 1);
        }
        assert_eq!(f32_to_e4m3(1e9), 0x7e);
        assert_eq!(f32_to_e4m3(-1e9), 0xfe);
    }

    #[test]
    fn int4_round_trip_error_is_that_of_16_levels() {
        let (rows, cols) = (7, 256);
        let w = random_rows(rows, cols, 3);
        let q = QuantizedMatrix::quantize(DenseFormat::Int4, rows, cols, |r, buf| {
            buf.copy_from_slice(&w[r * cols..(r + 1) * cols])
        })
        .unwrap();
        assert!(matches!(q, QuantizedMatrix::Int4 { group: 128, .. }));
        let mut back = vec![0f32; rows * cols];
        for r in 0..rows {
            q.dequantize_row(r, &mut back[r * cols..(r + 1) * cols]);
        }
        // uniform weights, step = range / 15: relative RMS error ≈ 1/(15·√3)·√3 ≈ 0.07
        let e = rel_err(&back, &w);
        assert!(e < 0.1 && e > 0.01, "{e}");
        // the peak of each group is exact (it defines the scale, up to f16 rounding)
        assert_eq!(q.device_bytes(), rows * cols / 2 + rows * 2 * 2);
    }

    #[test]
    fn fp8_round_trip_is_within_e4m3_precision() {
        let (rows, cols) = (5, 96);
        let w = random_rows(rows, cols, 9);
        let q = QuantizedMatrix::quantize(DenseFormat::Fp8, rows, cols, |r, buf| {
            buf.copy_from_slice(&w[r * cols..(r + 1) * cols])
        })
        .unwrap();
        assert!(matches!(q, QuantizedMatrix::W8 { group: 32, .. }));
        let mut back = vec![0f32; cols];
        for r in 0..rows {
            q.dequantize_row(r, &mut back);
            for (c, (&b, &x)) in back.iter().zip(&w[r * cols..]).enumerate() {
                // 3 mantissa bits: ≤ 2^-4 relative, or the subnormal step (scale × 2^-9) near zero
                let tol = x.abs() / 16.0 + 1e-6;
                assert!((b - x).abs() <= tol, "({r}, {c}): {b} vs {x}");
            }
        }
    }

    #[test]
    fn fp8_checkpoint_blocks_are_kept_exactly() {
        let (rows, cols, block) = (3, 256, 128);
        let bytes: Vec<u8> = (0..rows * cols).map(|i| (i * 7 % 0x7e) as u8).collect();
        let scale_inv = vec![0.5f32, 0.25];
        let q =
            QuantizedMatrix::from_fp8_blocks(rows, cols, bytes.clone(), &scale_inv, block).unwrap();
        let mut row = vec![0f32; cols];
        q.dequantize_row(2, &mut row);
        assert_eq!(row[5], e4m3_to_f32(bytes[2 * cols + 5]) * 0.5);
        assert_eq!(row[200], e4m3_to_f32(bytes[2 * cols + 200]) * 0.25);
        assert!(
            QuantizedMatrix::from_fp8_blocks(rows, 100, vec![0; 300], &scale_inv, 128).is_none()
        );
    }

    #[test]
    fn unaligned_widths_stay_bf16() {
        assert_eq!(group_for(DenseFormat::Int4, 48), None);
        assert_eq!(group_for(DenseFormat::Fp8, 48), Some(16));
        assert_eq!(group_for(DenseFormat::Int4, 10944), Some(64));
        assert!(QuantizedMatrix::quantize(DenseFormat::Int4, 2, 40, |_, _| ()).is_none());
    }
}
