//! AMX kernels for experts that receive many tokens (prefill chunks): bf16 (`tdpbf16ps`) and int8
//! (`tdpbsud`: signed activations × unsigned weight codes). The packed weight K-tile *is* the AMX B
//! tile (16 rows of 64 bytes), so B tiles load straight from expert memory; A tiles are 16 consecutive
//! activation rows. A 2×2 block of C tiles (32 tokens × 32 outputs) keeps all 8 tile registers busy:
//! per K step 2 A + 2 B loads feed 4 tile products.
//!
//! The AMX intrinsics are not stable in Rust 1.95, so the instructions are written with `asm!`; tile
//! registers are invisible to the compiler, which is why every asm block keeps its side effects (not
//! `pure`) and stays in program order.

use std::arch::asm;
use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};

use super::act::{ActKind, ActRef};
use super::amx_config::{use_config, TileConfig};
use super::pack::MatRef;

/// Palette 1, all 8 tiles 16 rows × 64 bytes.
static CONFIG: TileConfig = TileConfig::new(&[
    (0, 16, 64),
    (1, 16, 64),
    (2, 16, 64),
    (3, 16, 64),
    (4, 16, 64),
    (5, 16, 64),
    (6, 16, 64),
    (7, 16, 64),
]);

macro_rules! tile_load {
    ($t:literal, $ptr:expr, $stride:expr) => {
        asm!(concat!("tileloadd tmm", $t, ", [{0} + {1}*1]"), in(reg) $ptr, in(reg) $stride,
             options(nostack, readonly, preserves_flags))
    };
}
macro_rules! tile_store {
    ($t:literal, $ptr:expr) => {
        asm!(concat!("tilestored [{0} + {1}*1], tmm", $t), in(reg) $ptr, in(reg) 64usize,
             options(nostack, preserves_flags))
    };
}
macro_rules! tile_zero {
    ($t:literal) => {
        asm!(
            concat!("tilezero tmm", $t),
            options(nostack, nomem, preserves_flags)
        )
    };
}
macro_rules! tile_dp {
    ($op:literal, $c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!($op, " tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem, preserves_flags)
        )
    };
}

/// K steps (1 KiB B tiles) prefetched ahead on the first pass.
const PREFETCH_STEPS: usize = 4;

#[inline(always)]
fn prefetch(p: *const u8) {
    // SAFETY: a prefetch never faults.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
}

#[repr(C, align(64))]
struct CTiles([[u32; 256]; 4]);

/// AMX gemm over consecutive activation rows (storage padded to a multiple of 16 rows).
///
/// # Safety
/// The CPU has AMX-TILE/BF16/INT8 and this process got the XTILEDATA permission (tier `Amx`);
/// `a.rows` are consecutive and their storage extends to a multiple of 16 rows; the activation kind is
/// Bf16 for bf16 weights and I8 (one group) for int8 weights; shapes checked by `gemm::gemm`.
pub(crate) unsafe fn gemm(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
) {
    let m = a.rows.len();
    let r0 = a.rows[0] as usize;
    debug_assert!(a.rows.windows(2).all(|p| p[1] == p[0] + 1));
    let int = matches!(a.kind, ActKind::I8 { .. });
    // SAFETY: row r0 onwards lies inside the buffer (caller).
    let (a_base, a_stride, k_steps): (*const u8, usize, usize) = unsafe {
        if int {
            (a.q.as_ptr().add(r0 * a.k_pad).cast(), a.k_pad, a.k_pad / 64)
        } else {
            (
                a.b.as_ptr().add(r0 * a.k_pad).cast(),
                a.k_pad * 2,
                a.k_pad / 32,
            )
        }
    };
    let m_tiles = m.div_ceil(16);
    let mut c = CTiles([[0; 256]; 4]);
    // SAFETY: (caller) AMX usable; all tile loads stay inside the packed matrix and padded rows.
    unsafe {
        use_config(&CONFIG);
        let mut nb = 0;
        while nb < nts {
            let two_n = nb + 1 < nts;
            let b0 = w.ntile(nt0 + nb).as_ptr();
            let b1 = if two_n {
                w.ntile(nt0 + nb + 1).as_ptr()
            } else {
                b0
            };
            for line in 0..16 * PREFETCH_STEPS {
                prefetch(b0.wrapping_add(line * 64));
                prefetch(b1.wrapping_add(line * 64));
            }
            let mut mb = 0;
            while mb < m_tiles {
                let two_m = mb + 1 < m_tiles;
                let a0 = a_base.add(mb * 16 * a_stride);
                let a1 = if two_m { a0.add(16 * a_stride) } else { a0 };
                tile_zero!("0");
                tile_zero!("1");
                tile_zero!("2");
                tile_zero!("3");
                for s in 0..k_steps {
                    if mb == 0 {
                        // First pass over these B tiles: they come from DRAM; fetch a few steps ahead.
                        for line in 0..16 {
                            prefetch(b0.wrapping_add((s + PREFETCH_STEPS) * 1024 + line * 64));
                            prefetch(b1.wrapping_add((s + PREFETCH_STEPS) * 1024 + line * 64));
                        }
                    }
                    tile_load!("4", a0.add(s * 64), a_stride);
                    tile_load!("6", b0.add(s * 1024), 64usize);
                    if int {
                        tile_dp!("tdpbsud", "0", "4", "6");
                    } else {
                        tile_dp!("tdpbf16ps", "0", "4", "6");
                    }
                    if two_n {
                        tile_load!("7", b1.add(s * 1024), 64usize);
                        if int {
                            tile_dp!("tdpbsud", "1", "4", "7");
                        } else {
                            tile_dp!("tdpbf16ps", "1", "4", "7");
                        }
                    }
                    if two_m {
                        tile_load!("5", a1.add(s * 64), a_stride);
                        if int {
                            tile_dp!("tdpbsud", "2", "5", "6");
                        } else {
                            tile_dp!("tdpbf16ps", "2", "5", "6");
                        }
                        if two_n {
                            if int {
                                tile_dp!("tdpbsud", "3", "5", "7");
                            } else {
                                tile_dp!("tdpbf16ps", "3", "5", "7");
                            }
                        }
                    }
                }
                tile_store!("0", c.0[0].as_mut_ptr());
                tile_store!("1", c.0[1].as_mut_ptr());
                tile_store!("2", c.0[2].as_mut_ptr());
                tile_store!("3", c.0[3].as_mut_ptr());
                for (ci, (dm, dn)) in [(0, 0), (0, 1), (1, 0), (1, 1)].into_iter().enumerate() {
                    if (dn == 1 && !two_n) || (dm == 1 && !two_m) {
                        continue;
                    }
                    let nt = nb + dn;
                    for i in 0..16 {
                        let r = (mb + dm) * 16 + i;
                        if r >= m {
                            break;
                        }
                        let dst = &mut y[r * ldy + nt * 16..r * ldy + nt * 16 + 16];
                        let src = &c.0[ci][i * 16..i * 16 + 16];
                        if int {
                            let row = r0 + r;
                            let corr = 128 * a.gsum[row];
                            let xs = a.scale[row]; // one group: the whole row
                            let ws = &w.s[(nt0 + nt) * 16..(nt0 + nt) * 16 + 16];
                            for j in 0..16 {
                                dst[j] = (src[j] as i32 - corr) as f32 * xs * ws[j];
                            }
                        } else {
                            for j in 0..16 {
                                dst[j] = f32::from_bits(src[j]);
                            }
                        }
                    }
                }
                mb += 2;
            }
            nb += 2;
        }
    }
}
