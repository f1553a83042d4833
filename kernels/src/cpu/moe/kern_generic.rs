//! Portable kernels: the scalar reference tier (also compiled with AVX2+FMA enabled as the AVX2 tier, where
//! the compiler vectorizes the same loops over the 16 outputs of a tile), and the scalar twins of the
//! AVX-512 kernels (same inputs: bf16 or int8 activations), which tests compare them against.
//!
//! All kernels compute `y[r][c] = Σ_k W[16·nt + j][k] · a_r[k]` for the N-tiles `nt0 .. nt0 + nts`,
//! row `r` of the activation view, `c = 16·(nt − nt0) + j`, `y` rows `ldy` apart.

use super::act::{ActKind, ActRef};
use super::pack::{bf16_to_f32, fp8_e4m3_to_f32, GroupedCodes, MatRef, WeightFormat};

/// Decodes K-tile `ti` of N-tile `nt` to f32, as `out[k][j]` (k < KT, j < 16).
#[inline(always)]
fn decode_tile(w: &MatRef<'_>, nt: usize, ti: usize, out: &mut [f32]) {
    let l = &w.l;
    let (p, kt, tb) = l.format.tile_geometry();
    let tile = &w.ntile(nt)[ti * tb..(ti + 1) * tb];
    match l.format {
        WeightFormat::Bf16 | WeightFormat::F16 => {
            let f16 = l.format == WeightFormat::F16;
            for kk in 0..kt / p {
                for j in 0..16 {
                    for q in 0..2 {
                        let o = (kk * 32 + j * 2 + q) * 2;
                        let bits = u16::from_le_bytes([tile[o], tile[o + 1]]);
                        out[(kk * 2 + q) * 16 + j] = if f16 {
                            half::f16::from_bits(bits).to_f32()
                        } else {
                            bf16_to_f32(bits)
                        };
                    }
                }
            }
        }
        WeightFormat::Fp8Block => {
            let s = w.s[(nt * 16 / 128) * l.k.div_ceil(128) + ti * kt / 128];
            for kk in 0..kt / p {
                for j in 0..16 {
                    for q in 0..2 {
                        out[(kk * 2 + q) * 16 + j] = fp8_e4m3_to_f32(tile[kk * 32 + j * 2 + q]) * s;
                    }
                }
            }
        }
        WeightFormat::Int8 => {
            let s = &w.s[nt * 16..nt * 16 + 16];
            for kk in 0..kt / p {
                for j in 0..16 {
                    for q in 0..4 {
                        out[(kk * 4 + q) * 16 + j] =
                            (tile[kk * 64 + j * 4 + q] as i32 - 128) as f32 * s[j];
                    }
                }
            }
        }
        WeightFormat::Int4 { .. }
        | WeightFormat::Int4Min { .. }
        | WeightFormat::Int8Group { .. }
        | WeightFormat::Int8Min { .. } => {
            let c = GroupedCodes::of(l.format).expect("a grouped int format");
            for kk in 0..kt / p {
                for j in 0..16 {
                    for q in 0..4 {
                        let k = ti * kt + kk * 4 + q;
                        out[(kk * 4 + q) * 16 + j] = w.grouped_weight(c, tile, (nt, j), (k, kk, q));
                    }
                }
            }
        }
    }
}

/// f32 arithmetic on decoded weights; activations F32 or Bf16 (taken as their f32 values).
#[inline(always)]
fn gemm_f32_body(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
) {
    let (_, kt, _) = w.l.format.tile_geometry();
    let mut wt = [0f32; 64 * 16];
    let mut xt = [0f32; 64];
    for nt in nt0..nt0 + nts {
        let col = (nt - nt0) * 16;
        for r in 0..a.rows.len() {
            y[r * ldy + col..r * ldy + col + 16].fill(0.0);
        }
        for ti in 0..w.l.k_tiles {
            decode_tile(w, nt, ti, &mut wt);
            for (r, &row) in a.rows.iter().enumerate() {
                let base = row as usize * a.k_pad + ti * kt;
                match a.kind {
                    ActKind::F32 => xt[..kt].copy_from_slice(&a.f[base..base + kt]),
                    ActKind::Bf16 => {
                        for (x, &b) in xt.iter_mut().zip(&a.b[base..base + kt]) {
                            *x = bf16_to_f32(b);
                        }
                    }
                    ActKind::I8 { .. } => unreachable!("int8 activations go to gemm_i8_twin"),
                }
                let mut acc = [0f32; 16];
                acc.copy_from_slice(&y[r * ldy + col..r * ldy + col + 16]);
                for k in 0..kt {
                    let xv = xt[k];
                    for j in 0..16 {
                        acc[j] += wt[k * 16 + j] * xv;
                    }
                }
                y[r * ldy + col..r * ldy + col + 16].copy_from_slice(&acc);
            }
        }
    }
}

/// Scalar reference tier.
pub(crate) fn gemm_scalar(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
) {
    gemm_f32_body(w, nt0, nts, a, y, ldy)
}

/// AVX2 tier: the same loops, vectorized by the compiler for AVX2 + FMA.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn gemm_avx2(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
) {
    gemm_f32_body(w, nt0, nts, a, y, ldy)
}

/// Twin of the VNNI kernels: integer dot products of unsigned weight codes with int8 activations per
/// group, offset-corrected with the group sums, scaled by weight and activation scales.
pub(crate) fn gemm_i8_twin(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
) {
    let l = &w.l;
    // Int8 is one group of the whole row with a per-output f32 scale; the min term of the grouped
    // formats replaces the offset: Σ (u·d + m)·x = d·Σ u·x + m·Σ x.
    let codes = GroupedCodes::of(l.format);
    let (group, off) = match (l.format, codes) {
        (WeightFormat::Int8, _) => (l.k_pad, 128),
        (_, Some(c)) => (c.group, c.off),
        (f, None) => unreachable!("{f:?} has no int8 kernel"),
    };
    let groups = l.k_pad / group;
    for nt in nt0..nt0 + nts {
        let tiles = w.ntile(nt);
        for (r, &row) in a.rows.iter().enumerate() {
            let row = row as usize;
            let x = &a.q[row * a.k_pad..(row + 1) * a.k_pad];
            for j in 0..16 {
                let mut total = 0f32;
                for g in 0..groups {
                    let mut acc = 0i32;
                    for k in g * group..(g + 1) * group {
                        let (kk, q) = (k / 4, k % 4);
                        let u = match codes {
                            Some(c) => MatRef::grouped_code(c, tiles, kk, j, q) as i32,
                            None => tiles[kk * 64 + j * 4 + q] as i32,
                        };
                        acc += u * x[k] as i32;
                    }
                    let gsum = a.gsum[row * groups + g];
                    let acc = acc - off * gsum;
                    total += match codes {
                        None => acc as f32 * w.s[nt * 16 + j],
                        Some(c) => {
                            let at = c.scale_at(groups, nt, g) + j;
                            let min = if c.with_min {
                                gsum as f32 * w.int4_scale(at + 16)
                            } else {
                                0.0
                            };
                            acc as f32 * w.int4_scale(at) + min
                        }
                    } * a.scale[row * groups + g];
                }
                y[r * ldy + (nt - nt0) * 16 + j] = total;
            }
        }
    }
}
