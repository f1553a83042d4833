//! AMX-INT8 for group-scaled int weights (Int4 / Int4Min / Int8Group / Int8Min: llama.cpp's Q4_0 /
//! Q4_1 / Q8_0 / Q6_K / Q5_K codes) × int8 activations with a scale per group: the few-to-many-row
//! path (batched decode) that reads each weight once for all rows with the activations the VNNI
//! kernels use, so a batch gives the same numbers as its rows one by one.
//!
//! Per group of K = 16, 32 or 64 inputs (one scale per weight column and per activation row), one
//! `tdpbsud` per (16 activation rows × N-tile) on the group's codes, then the integer dots are scaled
//! in f32: `Σ_g x_s · (d · Σ u·q + m · Σ q)` (`m = −off · d` without a min). The packed Int8 codes
//! of a group *are* the B tile (group/4 rows of 64 bytes); 4-bit codes are split into their low and
//! high nibbles first (one pass per group, shared by every row). Where the time goes: the f32
//! scaling of each (row, group, N-tile), ~7 instructions per 16 outputs, against 64 `vpdpbusd` per
//! group and N-tile for 8 rows on VNNI; from ~32 rows on the bf16-widened AMX path is cheaper.

use std::arch::asm;
use std::arch::x86_64::*;

use super::act::ActRef;
use super::amx_config::{use_config, TileConfig};
use super::pack::{GroupedCodes, MatRef, WeightFormat};

/// The tiles of the grouped AMX-INT8 kernels, this one and the dense projections' `dense_amx_int`,
/// palette 1, for tiles of `rows` activation rows (16; the dense kernel also runs 8): C tiles 0 and 1
/// (`rows` × 64 bytes of i32), A tiles 4 and 5 (`rows` × `group` bytes), B tiles 6 and 7
/// (`group / 4` rows × 64 bytes). This kernel leaves tile 5 unused. One table for both: a thread
/// that runs both kernels keeps its configuration, and neither can drift from the other's shapes.
const fn grouped_tiles(group: usize, rows: usize) -> [(usize, usize, usize); 6] {
    [
        (0, rows, 64),
        (1, rows, 64),
        (4, rows, group),
        (5, rows, group),
        (6, group / 4, 64),
        (7, group / 4, 64),
    ]
}

/// The configurations of the group sizes [`amx_int_supports`] accepts, for 16 and 8 rows.
static CONFIGS: [[TileConfig; 3]; 2] = [
    [
        TileConfig::new(&grouped_tiles(16, 16)),
        TileConfig::new(&grouped_tiles(32, 16)),
        TileConfig::new(&grouped_tiles(64, 16)),
    ],
    [
        TileConfig::new(&grouped_tiles(16, 8)),
        TileConfig::new(&grouped_tiles(32, 8)),
        TileConfig::new(&grouped_tiles(64, 8)),
    ],
];

/// The tile configuration of the grouped kernels for `group` (16, 32 or 64) and tiles of `rows`
/// activation rows (16, or 8).
pub(crate) fn grouped_config(group: usize, rows: usize) -> &'static TileConfig {
    let by_group = &CONFIGS[usize::from(rows == 8)];
    &by_group[match group {
        16 => 0,
        32 => 1,
        _ => 2,
    }]
}

/// A group's weight terms for one N-tile's 16 outputs from its f16 scales at `at`: the scale `d`,
/// and what multiplies the activations' code sum: the min `m`, or `−off · d` without one.
///
/// # Safety
/// AVX-512F present; `at` holds the group's 16 scales (and 16 mins after them with a min).
#[inline(always)]
pub(crate) unsafe fn group_terms(codes: GroupedCodes, at: *const u16) -> (__m512, __m512) {
    // SAFETY: (caller).
    unsafe {
        let dv = _mm512_cvtph_ps(_mm256_loadu_si256(at.cast()));
        let mv = if codes.with_min {
            _mm512_cvtph_ps(_mm256_loadu_si256(at.add(16).cast()))
        } else {
            _mm512_mul_ps(_mm512_set1_ps(-(codes.off as f32)), dv)
        };
        (dv, mv)
    }
}

/// One row's group added to its total: `tot + acc · (d · x_scale) + (Σx · x_scale) · m`, with `acc`
/// the row's integer dots, `xs` its activation scale and `gs` its code sum times that scale (both
/// broadcast). Both grouped kernels scale through here, in this order: equal bit for bit.
///
/// # Safety
/// AVX-512F present.
#[inline(always)]
pub(crate) unsafe fn scale_group(
    acc: __m512i,
    (dv, mv): (__m512, __m512),
    xs: __m512,
    gs: __m512,
    tot: __m512,
) -> __m512 {
    // SAFETY: (caller).
    unsafe {
        let v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(dv, xs), tot);
        _mm512_fmadd_ps(gs, mv, v)
    }
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
struct Scratch {
    /// The B tiles of two N-tiles (4-bit codes unpacked to bytes).
    b: [[u8; 1024]; 2],
    /// The C tiles of two N-tiles, i32.
    c: [[i32; 256]; 2],
}

thread_local! {
    static TOTALS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
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
    let mut tot = TOTALS.with(|t| std::mem::take(&mut *t.borrow_mut()));
    // SAFETY: (caller).
    unsafe { gemm_grouped_in(w, nt0, nts, a, y, ldy, &mut tot) };
    TOTALS.with(|t| *t.borrow_mut() = tot);
}

/// [`gemm_grouped`] with the per-row totals of two N-tiles in `tot`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn gemm_grouped_in(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
    tot: &mut Vec<f32>,
) {
    let codes = GroupedCodes::of(w.l.format).expect("a grouped int format (caller)");
    let (group, int4) = (codes.group, codes.int4);
    let m = a.rows.len();
    let r0 = a.rows[0] as usize;
    debug_assert!(a.rows.windows(2).all(|p| p[1] == p[0] + 1));
    debug_assert_eq!(a.groups(), w.l.k_pad / group);
    let (k_pad, groups) = (w.l.k_pad, w.l.k_pad / group);
    let m_tiles = m.div_ceil(16);
    let s16 = w.s16();
    let cfg = grouped_config(group, 16);
    let mut sc = Scratch {
        b: [[0; 1024]; 2],
        c: [[0; 256]; 2],
    };
    {
        tot.clear();
        tot.resize(m * 32, 0.0);
        // SAFETY: (caller) AMX usable; tile loads stay inside the packed matrix, the scratch and the
        // activation rows' storage; every pointer below is in bounds by the shapes checked in `gemm`.
        unsafe {
            use_config(cfg);
            let mut nb = 0;
            while nb < nts {
                let two = nb + 1 < nts;
                let tiles = [nt0 + nb, nt0 + nb + usize::from(two)];
                tot.fill(0.0);
                for g in 0..groups {
                    let mut b_ptr = [std::ptr::null::<u8>(); 2];
                    let mut terms = [(_mm512_setzero_ps(), _mm512_setzero_ps()); 2];
                    for (i, &nt) in tiles.iter().enumerate() {
                        let wp = w.ntile(nt).as_ptr();
                        b_ptr[i] = if int4 {
                            unpack_nibbles(wp.add(g * group * 8), group, sc.b[i].as_mut_ptr());
                            sc.b[i].as_ptr()
                        } else {
                            wp.add(g * group * 16)
                        };
                        terms[i] =
                            group_terms(codes, s16.as_ptr().add(codes.scale_at(groups, nt, g)));
                    }
                    asm!("tileloadd tmm6, [{0} + {1}*1]", in(reg) b_ptr[0], in(reg) 64usize, options(nostack, readonly, preserves_flags));
                    asm!("tileloadd tmm7, [{0} + {1}*1]", in(reg) b_ptr[1], in(reg) 64usize, options(nostack, readonly, preserves_flags));
                    for mb in 0..m_tiles {
                        let ap = a.q.as_ptr().add((r0 + mb * 16) * k_pad + g * group);
                        asm!("tileloadd tmm4, [{0} + {1}*1]", in(reg) ap, in(reg) k_pad, options(nostack, readonly, preserves_flags));
                        asm!("tilezero tmm0", options(nostack, nomem, preserves_flags));
                        asm!("tilezero tmm1", options(nostack, nomem, preserves_flags));
                        asm!(
                            "tdpbsud tmm0, tmm4, tmm6",
                            options(nostack, nomem, preserves_flags)
                        );
                        asm!(
                            "tdpbsud tmm1, tmm4, tmm7",
                            options(nostack, nomem, preserves_flags)
                        );
                        asm!("tilestored [{0} + {1}*1], tmm0", in(reg) sc.c[0].as_mut_ptr(), in(reg) 64usize, options(nostack, preserves_flags));
                        asm!("tilestored [{0} + {1}*1], tmm1", in(reg) sc.c[1].as_mut_ptr(), in(reg) 64usize, options(nostack, preserves_flags));
                        for i in 0..16.min(m - mb * 16) {
                            let r = mb * 16 + i;
                            let row = r0 + r;
                            let xs = *a.scale.get_unchecked(row * groups + g);
                            if xs == 0.0 {
                                continue; // a residual row's group without outliers: zero codes
                            }
                            let gs =
                                _mm512_set1_ps(*a.gsum.get_unchecked(row * groups + g) as f32 * xs);
                            let xs = _mm512_set1_ps(xs);
                            for n in 0..2 {
                                let acc = _mm512_load_si512(sc.c[n].as_ptr().add(i * 16).cast());
                                let t = tot.as_mut_ptr().add(r * 32 + n * 16);
                                let v = scale_group(acc, terms[n], xs, gs, _mm512_loadu_ps(t));
                                _mm512_storeu_ps(t, v);
                            }
                        }
                    }
                }
                for r in 0..m {
                    let out = y.as_mut_ptr().add(r * ldy + nb * 16);
                    std::ptr::copy_nonoverlapping(
                        tot.as_ptr().add(r * 32),
                        out,
                        if two { 32 } else { 16 },
                    );
                }
                nb += 2;
            }
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
