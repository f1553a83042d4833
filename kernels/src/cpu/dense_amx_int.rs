//! AMX-INT8 for the dense projections of batched decode: group-scaled int weights (Int4 / Int4Min /
//! Int8Group / Int8Min: llama.cpp's Q4_0 / Q4_1 / Q8_0 / Q6_K / Q5_K codes) × the int8 activation
//! rows of 2–16 tokens (8 sequences' codes and residual rows fill one 16-row tile), each weight read
//! once for all rows. The same integer dots and the same f32 scaling, in the same order, as the
//! experts' `moe::kern_amx_int`, by construction: one tile table (`grouped_config`) and one
//! scaling step (`group_terms`, `scale_group`) serve both (bit for bit; a row without codes in a
//! group adds +0 here where that kernel skips it, which can only turn an exact −0 output into +0),
//! laid out for throughput:
//! - an N-tile's 4-bit codes are split into bytes once, for all its groups, before any tile reads
//!   them (the per-group split stored and reloaded at once stalled the tile load on the stores);
//! - the group's tile product goes to one of two C tiles in turn, so the product of group g runs
//!   while the f32 scaling of group g − 1 reads the other (the scaling waited on each store);
//! - each row's 16 outputs are summed in a register across the groups (no load and store of a
//!   total per row and group), with the activation terms `x_scale` and `Σx · x_scale` of every
//!   (group, row) laid out once per call for broadcast loads;
//! - a group whose residual rows (int8 pairs) have no codes scales the code rows alone;
//! - the next N-tile's codes and scales are prefetched while this one runs.
//!
//! Per (group, N-tile): two tile loads, one `tdpbsud`, one tile store, then per row four vector ops
//! (`cvt`, `d · x_scale`, two FMAs): the scaling is the cost (~36 cycles for 16 rows on the build
//! machine's Xeon against ~21 for the tile work; they overlap little).

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use super::moe::act::ActRef;
use super::moe::amx_config::use_config;
use super::moe::kern_amx_int::{group_terms, grouped_config, scale_group};
use super::moe::pack::{GroupedCodes, MatRef};

/// Whether [`gemm`] takes weights of these codes.
pub(crate) fn supports(codes: GroupedCodes) -> bool {
    matches!(codes.group, 16 | 32 | 64)
}

/// The two C tiles' stores (16 rows × 16 i32 each).
#[repr(C, align(64))]
struct CTiles([[i32; 256]; 2]);

/// Per thread: an N-tile's 4-bit codes split into bytes, and the activation terms of a call.
#[derive(Default)]
struct Scratch {
    codes: Vec<u8>,
    /// Per (m-tile, group): 16 `x_scale`, then 16 `Σx · x_scale` (0 past the view's rows).
    terms: Vec<f32>,
    /// Per (m-tile, group): the rows with codes in the group (a non-zero `x_scale`) as bits.
    live: Vec<u16>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// `y[r][16·(nt − nt0) + j] = Σ_k W[16·nt + j][k] · a_r[k]` for N-tiles `nt0 .. nt0 + nts` and the
/// view's rows.
///
/// # Safety
/// The CPU has AMX-TILE/INT8 and AVX-512 F/BW/VL and this process got the XTILEDATA permission
/// (tier `Amx`); `w` has grouped int codes that [`supports`] accepts; `a` has int8 kind with `w`'s
/// group, its rows are consecutive and their storage extends to a multiple of 16 rows past the first;
/// `nt0 + nts ≤ n_tiles`; `y` holds `(rows − 1) · ldy + 16 · nts` values, `16 · nts ≤ ldy`.
pub(crate) unsafe fn gemm(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
) {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        // SAFETY: (caller).
        unsafe { gemm_in(w, nt0, nts, a, y, ldy, &mut s) }
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn gemm_in(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
    s: &mut Scratch,
) {
    let codes = GroupedCodes::of(w.l.format).expect("grouped int codes (caller)");
    let (k_pad, group) = (w.l.k_pad, codes.group);
    let groups = k_pad / group;
    let m = a.rows.len();
    let r0 = a.rows[0] as usize;
    debug_assert!(a.rows.windows(2).all(|p| p[1] == p[0] + 1));
    debug_assert_eq!(a.groups(), groups);
    debug_assert!(y.len() >= (m - 1) * ldy + 16 * nts);
    let m_tiles = m.div_ceil(16);
    write_terms(a, r0, m, groups, s);
    if codes.int4 && s.codes.len() < 16 * k_pad {
        s.codes.resize(16 * k_pad, 0);
    }
    let mut c = CTiles([[0; 256]; 2]);
    // SAFETY: (caller) AMX usable; every pointer below stays inside the packed matrix, the scratch
    // and the activation rows' storage by the shapes above.
    unsafe {
        // a view of at most 8 rows (8 tokens' codes, their residual rows in a view of their own)
        // runs 8-row tiles: half the tile product and store of 16 rows (gate/up of SmolLM2-135M at
        // 8 tokens, one thread of the build machine's Xeon: 0.073 ms against 0.078)
        use_config(grouped_config(group, if m <= 8 { 8 } else { 16 }));
        for nt in nt0..nt0 + nts {
            let wp = w.ntile(nt).as_ptr();
            let b_codes = if codes.int4 {
                split_nibbles(wp, k_pad, s.codes.as_mut_ptr());
                s.codes.as_ptr()
            } else {
                wp
            };
            let next = (nt + 1 < nt0 + nts).then(|| w.ntile(nt + 1).as_ptr());
            let scales = w.s16().as_ptr().add(codes.scale_at(groups, nt, 0));
            for mb in 0..m_tiles {
                let tile = Tile {
                    a: a.q.as_ptr().add((r0 + 16 * mb) * k_pad),
                    k_pad,
                    b: b_codes,
                    terms: s.terms.as_ptr().add(mb * groups * 32),
                    live: s.live.as_ptr().add(mb * groups),
                    scales,
                    next: if mb == 0 { next } else { None },
                };
                let rows = (m - 16 * mb).min(16);
                let out = y.as_mut_ptr().add(16 * mb * ldy + 16 * (nt - nt0));
                if rows <= 8 {
                    tile.run::<8>(codes, groups, &mut c, out, ldy, rows);
                } else {
                    tile.run::<16>(codes, groups, &mut c, out, ldy, rows);
                }
            }
        }
    }
}

/// Lays out the activation terms of every (m-tile, group, row): `x_scale` and `Σx · x_scale` (the
/// same f32 product as the experts' kernel), 0 for the rows past the view, and which rows have codes
/// in the group (the residual rows of int8 pairs have none in most groups: their scaling is skipped,
/// as the experts' kernel skips it).
fn write_terms(a: &ActRef<'_>, r0: usize, m: usize, groups: usize, s: &mut Scratch) {
    let m_tiles = m.div_ceil(16);
    s.terms.clear();
    s.terms.resize(m_tiles * groups * 32, 0.0);
    s.live.clear();
    s.live.resize(m_tiles * groups, 0);
    for r in 0..m {
        let row = r0 + r;
        let (mb, i) = (r / 16, r % 16);
        for g in 0..groups {
            let xs = a.scale[row * groups + g];
            let at = (mb * groups + g) * 32 + i;
            s.terms[at] = xs;
            s.terms[at + 16] = a.gsum[row * groups + g] as f32 * xs;
            if xs != 0.0 {
                s.live[mb * groups + g] |= 1 << i;
            }
        }
    }
}

/// Splits an N-tile's 4-bit codes (`k_pad / 8` rows of 64 bytes: low nibbles inputs 8p..8p+3 of
/// each output, high nibbles 8p+4..8p+7) into B tile rows of bytes (`k_pad / 4` rows of 64 bytes).
///
/// # Safety
/// `src` holds `8 · k_pad` bytes, `dst` `16 · k_pad`; AVX-512 F/BW present.
#[inline(always)]
unsafe fn split_nibbles(src: *const u8, k_pad: usize, dst: *mut u8) {
    // SAFETY: (caller) bounds as above.
    unsafe {
        let nib = _mm512_set1_epi8(0x0F);
        for p in 0..k_pad / 8 {
            let v = _mm512_loadu_si512(src.add(p * 64).cast());
            _mm512_storeu_si512(dst.add(2 * p * 64).cast(), _mm512_and_si512(v, nib));
            _mm512_storeu_si512(
                dst.add((2 * p + 1) * 64).cast(),
                _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib),
            );
        }
    }
}

/// One (N-tile, m-tile) of a call.
struct Tile {
    /// The m-tile's first activation row (rows `k_pad` bytes apart).
    a: *const i8,
    k_pad: usize,
    /// The N-tile's codes as B tile rows (group g from `g · group · 16` bytes on).
    b: *const u8,
    /// This m-tile's activation terms and live rows per group (see [`write_terms`]).
    terms: *const f32,
    live: *const u16,
    /// The N-tile's f16 scales (and mins), group after group.
    scales: *const u16,
    /// The next N-tile's packed codes, prefetched group by group (its scales follow this tile's).
    next: Option<*const u8>,
}

impl Tile {
    /// Runs every group for the first `R` rows of the m-tile (16, or 8 when it has no more) and
    /// stores the first `rows` of them to `out` (`ldy` apart).
    ///
    /// # Safety
    /// As [`gemm`]; the tile configuration of the codes' group is loaded.
    #[inline(always)]
    unsafe fn run<const R: usize>(
        &self,
        codes: GroupedCodes,
        groups: usize,
        c: &mut CTiles,
        out: *mut f32,
        ldy: usize,
        rows: usize,
    ) {
        let group = codes.group;
        let stride = codes.scale_stride();
        // bytes of packed codes per group, in the matrix
        let packed = if codes.int4 { group * 8 } else { group * 16 };
        // SAFETY: (caller) pointers in bounds for every group; AVX-512F present.
        unsafe {
            let mut tot = [_mm512_setzero_ps(); R];
            let product_of = |g: usize| {
                let (a, b) = (self.a.add(g * group), self.b.add(g * group * 16));
                product(g % 2, a, self.k_pad, b);
            };
            // Two products in flight: the tile unit runs its instructions in order, so each
            // store is issued after the next group's product, which then runs while the store
            // waits for its own (a store right after its product held the next one back).
            product_of(0);
            if groups > 1 {
                product_of(1);
            }
            store_product(0, c);
            for g in 0..groups {
                if let Some(next) = self.next {
                    let mut off = 0;
                    while off < packed {
                        _mm_prefetch::<_MM_HINT_T0>(next.add(g * packed + off).cast());
                        off += 64;
                    }
                    let next_scales = self.scales.add((groups + g) * stride);
                    _mm_prefetch::<_MM_HINT_T0>(next_scales.cast());
                }
                let w_terms = group_terms(codes, self.scales.add(g * stride));
                let t = self.terms.add(g * 32);
                let ct = c.0[g % 2].as_ptr();
                // Paired rows (codes, residual) whose residuals have no codes in this group (the
                // common case of outlier-only pairs): the code rows alone. Otherwise every row,
                // branch-free (a row without codes has x_scale 0 and adds 0).
                if *self.live.add(g) & 0xAAAA == 0 {
                    scale_rows::<R, 2>(ct, t, w_terms, &mut tot);
                } else {
                    scale_rows::<R, 1>(ct, t, w_terms, &mut tot);
                }
                // group g's tile (parity g % 2) was stored: it takes group g + 2's product
                if g + 2 < groups {
                    product_of(g + 2);
                }
                if g + 1 < groups {
                    store_product((g + 1) % 2, c);
                }
            }
            for (i, tot) in tot.iter().enumerate().take(rows) {
                _mm512_storeu_ps(out.add(i * ldy), *tot);
            }
        }
    }
}

/// Adds group `g`'s scaled dots to the rows' totals: rows `0, STEP, 2·STEP, …` below `R`, from the
/// stored C tile `ct` (i32, 16 per row) and the group's activation terms `t` (see [`write_terms`]):
/// the experts' kernel's `scale_group` with the group's weight terms `w_terms` (`group_terms`).
///
/// # Safety
/// AVX-512F present; `ct` holds `16 · R` i32, `t` 32 f32.
#[inline(always)]
unsafe fn scale_rows<const R: usize, const STEP: usize>(
    ct: *const i32,
    t: *const f32,
    w_terms: (__m512, __m512),
    tot: &mut [__m512; R],
) {
    // SAFETY: (caller).
    unsafe {
        for i in (0..R).step_by(STEP) {
            let acc = _mm512_load_si512(ct.add(16 * i).cast());
            let (xs, gs) = (_mm512_set1_ps(*t.add(i)), _mm512_set1_ps(*t.add(16 + i)));
            tot[i] = scale_group(acc, w_terms, xs, gs, tot[i]);
        }
    }
}

/// The integer dots of one group for the m-tile's 16 rows in the C tile of `parity`: A (the rows'
/// codes of the group, `k_pad` apart) times B (the group's weight codes); [`store_product`] writes
/// them to `c.0[parity]` (after the caller has scaled the other parity's: the scaling's loads then
/// do not wait behind this tile's store).
///
/// # Safety
/// AMX usable with `grouped_config` of the group loaded; `a` and `b` hold the tiles' bytes.
#[inline(always)]
unsafe fn product(parity: usize, a: *const i8, k_pad: usize, b: *const u8) {
    // SAFETY: (caller).
    unsafe {
        if parity == 0 {
            asm!("tileloadd tmm4, [{0} + {1}*1]", in(reg) a, in(reg) k_pad, options(nostack, readonly, preserves_flags));
            asm!("tileloadd tmm6, [{0} + {1}*1]", in(reg) b, in(reg) 64usize, options(nostack, readonly, preserves_flags));
            asm!("tilezero tmm0", options(nostack, nomem, preserves_flags));
            asm!(
                "tdpbsud tmm0, tmm4, tmm6",
                options(nostack, nomem, preserves_flags)
            );
        } else {
            asm!("tileloadd tmm5, [{0} + {1}*1]", in(reg) a, in(reg) k_pad, options(nostack, readonly, preserves_flags));
            asm!("tileloadd tmm7, [{0} + {1}*1]", in(reg) b, in(reg) 64usize, options(nostack, readonly, preserves_flags));
            asm!("tilezero tmm1", options(nostack, nomem, preserves_flags));
            asm!(
                "tdpbsud tmm1, tmm5, tmm7",
                options(nostack, nomem, preserves_flags)
            );
        }
    }
}

/// Stores the C tile of `parity` ([`product`]) to `c.0[parity]`.
///
/// # Safety
/// AMX usable with `grouped_config` loaded.
#[inline(always)]
unsafe fn store_product(parity: usize, c: &mut CTiles) {
    let cp = c.0[parity].as_mut_ptr();
    // SAFETY: (caller); `cp` holds the 16 rows of 64 bytes.
    unsafe {
        if parity == 0 {
            asm!("tilestored [{0} + {1}*1], tmm0", in(reg) cp, in(reg) 64usize, options(nostack, preserves_flags));
        } else {
            asm!("tilestored [{0} + {1}*1], tmm1", in(reg) cp, in(reg) 64usize, options(nostack, preserves_flags));
        }
    }
}
