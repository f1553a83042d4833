//! AMX-INT8 for group-scaled int weights (Int4 / Int4Min / Int8Group / Int8Min: llama.cpp's Q4_0 /
//! Q4_1 / Q8_0 / Q6_K / Q5_K codes) × int8 activations with a scale per group: the few-to-many-row
//! path (batched decode) that reads each weight once for all rows with the activations the VNNI
//! kernels use, so a batch gives the same numbers as its rows one by one.
//!
//! Per group of K = 16, 32 or 64 inputs (one scale per weight column and per activation row), one
//! `tdpbsud` per (16 activation rows × N-tile) on the group's codes, then the integer dots are scaled
//! in f32: `Σ_g x_s · (d · Σ u·q + m · Σ q)` (`m = −off · d` without a min). The packed Int8 codes
//! of a group *are* the B tile (group/4 rows of 64 bytes); 4-bit codes are split into their low and
//! high nibbles first (one pass per group, shared by every row).
//!
//! Two stages per pair of N-tiles, so the tile unit and the vector unit do not wait for each other:
//! (1) the integer dots of every group, stored as i32 tiles (consecutive groups alternate between two
//! pairs of C tiles and two A tiles, so a group's products never wait for the previous group's store);
//! (2) per activation row, the f32 scaling summed over the groups in registers, one store per row.
//! Where the time goes: stage 2, ~5 instructions per (row, group, N-tile) against 8 `vpdpbusd` per
//! (row, group, N-tile) of 4-bit codes on VNNI.

use std::arch::asm;
use std::arch::x86_64::*;

use super::act::ActRef;
use super::amx_config::{use_config, TileConfig};
use super::pack::{GroupedCodes, MatRef, WeightFormat};

/// Palette 1: C tiles 0–3 (16 rows × 64 bytes), A tiles 4 and 5 (16 rows × `group` bytes), B tiles 6
/// and 7 (`group / 4` rows × 64 bytes).
const fn config(group: usize) -> TileConfig {
    TileConfig::new(&[
        (0, 16, 64),
        (1, 16, 64),
        (2, 16, 64),
        (3, 16, 64),
        (4, 16, group),
        (5, 16, group),
        (6, group / 4, 64),
        (7, group / 4, 64),
    ])
}

/// The configurations of the group sizes [`amx_int_supports`] accepts.
static CONFIGS: [TileConfig; 3] = [config(16), config(32), config(64)];

fn config_of(group: usize) -> &'static TileConfig {
    &CONFIGS[match group {
        16 => 0,
        32 => 1,
        _ => 2,
    }]
}

/// Whether [`gemm_grouped`] runs this format (group sizes a tile's K can hold).
pub(crate) fn amx_int_supports(format: WeightFormat) -> bool {
    match format {
        WeightFormat::Int4 { group }
        | WeightFormat::Int4Min { group }
        | WeightFormat::Int8Group { group }
        | WeightFormat::Int8Min { group } => matches!(group, 16 | 32 | 64),
        _ => false,
    }
}

#[repr(C, align(64))]
struct Unpacked([[u8; 1024]; 2]);

/// Per thread: the integer dots of every (16-row block, group, N-tile of the pair), 256 i32 each,
/// and the f32 scales and mins (or offset terms) of every (group, N-tile of the pair), 16 each.
#[derive(Default)]
struct Stages {
    dots: Vec<i32>,
    dm: Vec<f32>,
}

thread_local! {
    static STAGES: std::cell::RefCell<Stages> = std::cell::RefCell::new(Stages::default());
}

/// `y[r][16·(nt − nt0) + j] = Σ_k W[16·nt + j][k] · a_r[k]` for N-tiles `nt0 .. nt0 + nts` and the
/// view's rows.
///
/// # Safety
/// The CPU has AMX-TILE/INT8 and this process got the XTILEDATA permission (tier `Amx`); `w` has an
/// [`amx_int_supports`] format; `a` has int8 kind with `w`'s group, its rows are consecutive and
/// their storage extends 16 rows past the first; `y` holds `rows × ldy` values, `16·nts ≤ ldy`.
pub(crate) unsafe fn gemm_grouped(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
) {
    STAGES.with(|st| {
        let mut st = st.borrow_mut();
        let groups = w.l.k_pad / GroupedCodes::of(w.l.format).map_or(1, |c| c.group);
        let m_tiles = a.rows.len().div_ceil(16);
        let st = &mut *st;
        st.dots.resize(m_tiles * groups * 2 * 256, 0);
        st.dm.resize(groups * 2 * 32, 0.0);
        // SAFETY: (caller); the stage buffers are sized for this call above.
        unsafe { gemm_grouped_in(w, nt0, nts, a, y, ldy, st) }
    })
}

/// One group's products of one 16-row block for both N-tiles of the pair: A tile `$a`, C tiles `$c0`
/// and `$c1`, B tiles 6 and 7 (loaded by the caller), stored to `$out0` / `$out1` (1 KiB each).
macro_rules! group_dots {
    ($a:literal, $c0:literal, $c1:literal, $ap:expr, $lda:expr, $out0:expr, $out1:expr) => {
        asm!(concat!("tileloadd tmm", $a, ", [{0} + {1}*1]"), in(reg) $ap, in(reg) $lda,
             options(nostack, readonly, preserves_flags));
        asm!(concat!("tilezero tmm", $c0), options(nostack, nomem, preserves_flags));
        asm!(concat!("tilezero tmm", $c1), options(nostack, nomem, preserves_flags));
        asm!(concat!("tdpbsud tmm", $c0, ", tmm", $a, ", tmm6"), options(nostack, nomem, preserves_flags));
        asm!(concat!("tdpbsud tmm", $c1, ", tmm", $a, ", tmm7"), options(nostack, nomem, preserves_flags));
        asm!(concat!("tilestored [{0} + {1}*1], tmm", $c0), in(reg) $out0, in(reg) 64usize,
             options(nostack, preserves_flags));
        asm!(concat!("tilestored [{0} + {1}*1], tmm", $c1), in(reg) $out1, in(reg) 64usize,
             options(nostack, preserves_flags));
    };
}

/// [`gemm_grouped`] with its stage buffers.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn gemm_grouped_in(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
    st: &mut Stages,
) {
    let codes = GroupedCodes::of(w.l.format).expect("a grouped int format (caller)");
    let (group, int4, with_min, off) = (codes.group, codes.int4, codes.with_min, codes.off);
    let m = a.rows.len();
    let r0 = a.rows[0] as usize;
    debug_assert!(a.rows.windows(2).all(|p| p[1] == p[0] + 1));
    debug_assert_eq!(a.groups(), w.l.k_pad / group);
    let (k_pad, groups) = (w.l.k_pad, w.l.k_pad / group);
    let m_tiles = m.div_ceil(16);
    let s16 = w.s16();
    let mut unpacked = Unpacked([[0; 1024]; 2]);
    let (dots, dm) = (st.dots.as_mut_ptr(), st.dm.as_mut_ptr());
    // Stage 1's output for (16-row block mb, group g, N-tile n of the pair).
    let dot_at = |mb: usize, g: usize, n: usize| (mb * groups + g) * 2 * 256 + n * 256;
    // SAFETY: (caller) AMX usable; tile loads stay inside the packed matrix, the unpacked codes and
    // the activation rows' storage; stage buffers were sized by `gemm_grouped`; every pointer below
    // is in bounds by the shapes checked in `gemm`.
    unsafe {
        use_config(config_of(group));
        let mut nb = 0;
        while nb < nts {
            let two = nb + 1 < nts;
            let tiles = [nt0 + nb, nt0 + nb + usize::from(two)];
            // Stage 1: integer dots of every group; the group's scales beside them.
            for g in 0..groups {
                let mut b_ptr = [std::ptr::null::<u8>(); 2];
                for (i, &nt) in tiles.iter().enumerate() {
                    let wp = w.ntile(nt).as_ptr();
                    b_ptr[i] = if int4 {
                        unpack_nibbles(wp.add(g * group * 8), group, unpacked.0[i].as_mut_ptr());
                        unpacked.0[i].as_ptr()
                    } else {
                        wp.add(g * group * 16)
                    };
                    let at = s16.as_ptr().add(codes.scale_at(groups, nt, g));
                    let d = _mm512_cvtph_ps(_mm256_loadu_si256(at.cast()));
                    let mn = if with_min {
                        _mm512_cvtph_ps(_mm256_loadu_si256(at.add(16).cast()))
                    } else {
                        _mm512_mul_ps(_mm512_set1_ps(-(off as f32)), d)
                    };
                    _mm512_storeu_ps(dm.add((g * 2 + i) * 32), d);
                    _mm512_storeu_ps(dm.add((g * 2 + i) * 32 + 16), mn);
                }
                asm!("tileloadd tmm6, [{0} + {1}*1]", in(reg) b_ptr[0], in(reg) 64usize, options(nostack, readonly, preserves_flags));
                asm!("tileloadd tmm7, [{0} + {1}*1]", in(reg) b_ptr[1], in(reg) 64usize, options(nostack, readonly, preserves_flags));
                for mb in 0..m_tiles {
                    let ap = a.q.as_ptr().add((r0 + mb * 16) * k_pad + g * group);
                    let (o0, o1) = (dots.add(dot_at(mb, g, 0)), dots.add(dot_at(mb, g, 1)));
                    if (g * m_tiles + mb).is_multiple_of(2) {
                        group_dots!("4", "0", "1", ap, k_pad, o0, o1);
                    } else {
                        group_dots!("5", "2", "3", ap, k_pad, o0, o1);
                    }
                }
            }
            // Stage 2: per row, Σ_g x_s · (d · dot + m · Σ q) for both N-tiles, in registers.
            for r in 0..m {
                let (mb, i, row) = (r / 16, r % 16, r0 + r);
                let mut acc = [_mm512_setzero_ps(); 2];
                for g in 0..groups {
                    let xs = *a.scale.get_unchecked(row * groups + g);
                    if xs == 0.0 {
                        continue; // a residual row's group without outliers: zero codes
                    }
                    let gs = _mm512_set1_ps(*a.gsum.get_unchecked(row * groups + g) as f32 * xs);
                    let xs = _mm512_set1_ps(xs);
                    for (n, acc) in acc.iter_mut().enumerate() {
                        let dot = _mm512_cvtepi32_ps(_mm512_loadu_si512(
                            dots.add(dot_at(mb, g, n) + i * 16).cast(),
                        ));
                        let d = _mm512_loadu_ps(dm.add((g * 2 + n) * 32));
                        let mn = _mm512_loadu_ps(dm.add((g * 2 + n) * 32 + 16));
                        let v = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, xs), *acc);
                        *acc = _mm512_fmadd_ps(gs, mn, v);
                    }
                }
                let out = y.as_mut_ptr().add(r * ldy + nb * 16);
                _mm512_storeu_ps(out, acc[0]);
                if two {
                    _mm512_storeu_ps(out.add(16), acc[1]);
                }
            }
            nb += 2;
        }
    }
}

/// Bytes of one group's 4-bit codes (`group / 8` packed rows of 64 bytes: low nibbles inputs 8p..8p+3,
/// high nibbles 8p+4..8p+7 of each output) as the B tile's `group / 4` rows of codes.
///
/// # Safety
/// `src` holds `group · 8` bytes, `dst` `group · 16`; AVX-512 F/BW present.
#[inline(always)]
unsafe fn unpack_nibbles(src: *const u8, group: usize, dst: *mut u8) {
    // SAFETY: (caller) bounds as above.
    unsafe {
        let nib = _mm512_set1_epi8(0x0F);
        for p in 0..group / 8 {
            let v = _mm512_loadu_si512(src.add(p * 64).cast());
            _mm512_store_si512(dst.add(2 * p * 64).cast(), _mm512_and_si512(v, nib));
            _mm512_store_si512(
                dst.add((2 * p + 1) * 64).cast(),
                _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib),
            );
        }
    }
}
