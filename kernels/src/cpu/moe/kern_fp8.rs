//! AVX-512 kernels for FP8 E4M3 weights with 128×128 block scales: widen the bytes to bf16 in
//! registers, `vdpbf16ps` against bf16 activations, the block scale applied once per 128 inputs after
//! the dot (E4M3 fits bf16 exactly, so the only rounding is the activation's, as for bf16 weights).
//!
//! Where the time goes at one token: the widening, not the dot. Two decoders:
//! - VBMI (Ice Lake / Sapphire Rapids, Zen 4 and later): one 64-byte load (two pair-rows of an N-tile)
//!   goes through two 128-entry byte tables (`vpermt2b`: the bf16 high byte, sign or-ed back in, and
//!   the low byte) and two byte interleaves: 5 shuffle-class instructions per 64 weight bytes.
//! - 16-bit LUT (AVX-512 BF16 without VBMI, Cooper Lake): bytes zero-extended to words, two 64-entry
//!   `vpermt2w` halves blended on bit 6, sign shifted in: ~9 per 32 bytes, about 3.5× the work, which
//!   kept one decode token at 35–46% of the DRAM bandwidth on a 16-core AMX host.
//!
//! The tables are exact for every byte: ±0, subnormals, normals, and NaN for 0x7F / 0xFF.
//!
//! Safety contract of every `pub(crate) unsafe fn` here: as `kern_avx512`'s (tier `Avx512`, `y` holds
//! `rows × ldy` values with `16·nts ≤ ldy`, activation rows hold `k_pad` bf16 values, `w` is FP8),
//! and the `_vbmi` functions additionally need AVX-512 VBMI ([`has_vbmi`]).

use std::arch::x86_64::*;
use std::mem::transmute;
use std::sync::OnceLock;

use super::act::ActRef;
use super::kern_avx512::{bh, for_tiles, prefetch, Pf, MAX_ROWS};
use super::pack::{f32_to_bf16, fp8_e4m3_to_f32, MatRef};

/// Whether the fast FP8 decoder runs: this CPU has AVX-512 VBMI (byte permutes) and the environment
/// does not set `MOE_CPU_FP8_LUT16=1` (which forces the 16-bit table, for A/B benchmarks). Read once.
pub(crate) fn has_vbmi() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| {
        is_x86_feature_detected!("avx512vbmi")
            && std::env::var("MOE_CPU_FP8_LUT16")
                .is_err_and(|e| e == std::env::VarError::NotPresent)
    })
}

/// FP8 E4M3 magnitudes (7 bits) as bf16 bit patterns (exact: E4M3 fits in bf16), NaN for 0x7F.
fn fp8_lut() -> &'static [u16; 128] {
    static LUT: OnceLock<[u16; 128]> = OnceLock::new();
    LUT.get_or_init(|| std::array::from_fn(|i| f32_to_bf16(fp8_e4m3_to_f32(i as u8))))
}

/// [`fp8_lut`] split into its high bytes and low bytes, each 128 entries (two `__m512i`).
fn fp8_byte_luts() -> &'static [[u8; 128]; 2] {
    static T: OnceLock<[[u8; 128]; 2]> = OnceLock::new();
    T.get_or_init(|| {
        let l = fp8_lut();
        [
            std::array::from_fn(|i| (l[i] >> 8) as u8),
            std::array::from_fn(|i| l[i] as u8),
        ]
    })
}

/// An FP8 → bf16 decoder: 64 weight bytes (pair-rows i and i+1 of an N-tile) to the two bf16 pair-rows.
trait Decode: Sized {
    /// # Safety
    /// The CPU has the decoder's features; `p` points at 64 readable bytes.
    unsafe fn pair_rows(&self, p: *const u8) -> (__m512bh, __m512bh);

    /// The same decoder with tables that give `bf16(value · s)` (the magnitude scaled and rounded as
    /// [`scale_bf16x32`] rounds, the sign or-ed in): bit for bit what decoding and then scaling gives,
    /// for a scale whose sign bit is clear and that is not NaN ([`folds_into_tables`]).
    ///
    /// # Safety
    /// The CPU has the decoder's features and AVX-512 BF16.
    unsafe fn scaled(&self, t: &ScaleTables, s: __m512) -> Self;

    /// `n` (1..=[`FP8_ROWS`]) token rows × one N-tile ([`fp8_block`]).
    ///
    /// # Safety
    /// As [`fp8_block`]; the CPU has the decoder's features.
    #[allow(clippy::too_many_arguments)]
    unsafe fn rows(
        &self,
        n: usize,
        wp: *const u8,
        pairs: usize,
        pf: Pf,
        scales: &[f32],
        x: &[*const u32; MAX_ROWS],
        out: &[*mut f32; MAX_ROWS],
    );
}

/// Whether a block scale can be folded into the decoder's tables: with its sign bit clear and not NaN,
/// `bf16(-v · s) = -bf16(v · s)` for every FP8 value, so the sign can still be or-ed in after the table.
fn folds_into_tables(s: f32) -> bool {
    s.is_sign_positive() && !s.is_nan()
}

/// A 128-entry 16-bit table as four vectors of 32 (loads written out rather than through a closure,
/// which would not carry the caller's target features into the intrinsic).
///
/// # Safety
/// The CPU has AVX-512F.
#[inline(always)]
unsafe fn lut_vectors(table: &[u16; 128]) -> [__m512i; 4] {
    let p = table.as_ptr();
    // SAFETY: 128 u16 = four 64-byte vectors; (caller) AVX-512F present.
    unsafe {
        [
            _mm512_loadu_si512(p.cast()),
            _mm512_loadu_si512(p.add(32).cast()),
            _mm512_loadu_si512(p.add(64).cast()),
            _mm512_loadu_si512(p.add(96).cast()),
        ]
    }
}

/// What scaling a decoder's tables needs: the 128 magnitudes' bf16 patterns (four vectors of 32) and
/// the byte interleaves that split 16-bit patterns into high and low bytes.
struct ScaleTables {
    base: [__m512i; 4],
    high_bytes: __m512i,
    low_bytes: __m512i,
}

impl ScaleTables {
    /// # Safety
    /// The CPU has AVX-512F.
    #[inline(always)]
    unsafe fn new() -> ScaleTables {
        let table = fp8_lut();
        let pick = |odd: u8| -> [u8; 64] { std::array::from_fn(|t| 2 * t as u8 + odd) };
        let (high, low) = (pick(1), pick(0));
        // SAFETY: 128 u16 = four 64-byte vectors; 64-byte index arrays; (caller) AVX-512F present.
        unsafe {
            ScaleTables {
                base: lut_vectors(table),
                high_bytes: _mm512_loadu_si512(high.as_ptr().cast()),
                low_bytes: _mm512_loadu_si512(low.as_ptr().cast()),
            }
        }
    }

    /// `bf16(magnitude · s)` for the 128 magnitudes, in [`fp8_lut`]'s layout.
    ///
    /// # Safety
    /// The CPU has AVX-512 BF16.
    #[inline(always)]
    unsafe fn scaled(&self, s: __m512) -> [__m512i; 4] {
        let b = &self.base;
        // SAFETY: register-only operations (caller has the features). Written out, not through a
        // closure: a closure would not carry the caller's target features into the intrinsics.
        unsafe {
            [
                scale_bf16x32(bh(b[0]), s),
                scale_bf16x32(bh(b[1]), s),
                scale_bf16x32(bh(b[2]), s),
                scale_bf16x32(bh(b[3]), s),
            ]
        }
    }
}

/// Registers of the VBMI decoder: byte tables, the sign mask and the two interleave patterns.
#[derive(Clone, Copy)]
struct Vbmi {
    hi: [__m512i; 2],
    lo: [__m512i; 2],
    sign: __m512i,
    /// Output byte 2t ← lo[t], 2t+1 ← hi[t] for t in 0..32 (the first pair-row), and the same for
    /// t in 32..64 (the second).
    first: __m512i,
    second: __m512i,
}

impl Vbmi {
    /// # Safety
    /// The CPU has AVX-512F.
    #[inline(always)]
    unsafe fn new() -> Vbmi {
        let [hi, lo] = fp8_byte_luts();
        let idx = |base: u8| -> [u8; 64] {
            std::array::from_fn(|p| {
                let t = base + (p / 2) as u8;
                if p % 2 == 0 {
                    t
                } else {
                    64 + t
                }
            })
        };
        let (first, second) = (idx(0), idx(32));
        // SAFETY: 64-byte reads of 128- and 64-byte arrays; (caller) AVX-512F present.
        unsafe {
            let v = |p: *const u8| _mm512_loadu_si512(p.cast());
            Vbmi {
                hi: [v(hi.as_ptr()), v(hi.as_ptr().add(64))],
                lo: [v(lo.as_ptr()), v(lo.as_ptr().add(64))],
                sign: _mm512_set1_epi8(0x80u8 as i8),
                first: v(first.as_ptr()),
                second: v(second.as_ptr()),
            }
        }
    }
}

impl Decode for Vbmi {
    #[inline(always)]
    unsafe fn rows(
        &self,
        n: usize,
        wp: *const u8,
        pairs: usize,
        pf: Pf,
        scales: &[f32],
        x: &[*const u32; MAX_ROWS],
        out: &[*mut f32; MAX_ROWS],
    ) {
        // SAFETY: (caller) the contract and VBMI.
        unsafe { rows_vbmi(self, n, wp, pairs, pf, scales, x, out) }
    }

    #[inline(always)]
    unsafe fn scaled(&self, t: &ScaleTables, s: __m512) -> Vbmi {
        // SAFETY: register-only operations (caller has the features).
        unsafe {
            let v = t.scaled(s);
            let (h, l) = (t.high_bytes, t.low_bytes);
            Vbmi {
                hi: [
                    _mm512_permutex2var_epi8(v[0], h, v[1]),
                    _mm512_permutex2var_epi8(v[2], h, v[3]),
                ],
                lo: [
                    _mm512_permutex2var_epi8(v[0], l, v[1]),
                    _mm512_permutex2var_epi8(v[2], l, v[3]),
                ],
                ..*self
            }
        }
    }

    #[inline(always)]
    unsafe fn pair_rows(&self, p: *const u8) -> (__m512bh, __m512bh) {
        // SAFETY: (caller) 64 readable bytes, AVX-512 VBMI/F present. The byte permutes read index
        // bits 0..6, the magnitude; the sign (bit 7) is or-ed into the high byte.
        unsafe {
            let v = _mm512_loadu_si512(p.cast());
            let hi = _mm512_permutex2var_epi8(self.hi[0], v, self.hi[1]);
            let hi = _mm512_ternarylogic_epi32::<0xF8>(hi, v, self.sign); // hi | (v & 0x80)
            let lo = _mm512_permutex2var_epi8(self.lo[0], v, self.lo[1]);
            (
                bh(_mm512_permutex2var_epi8(lo, self.first, hi)),
                bh(_mm512_permutex2var_epi8(lo, self.second, hi)),
            )
        }
    }
}

/// The 16-bit table decoder (no VBMI): the 128 bf16 patterns in four registers.
struct Lut16([__m512i; 4]);

impl Lut16 {
    /// # Safety
    /// The CPU has AVX-512F.
    #[inline(always)]
    unsafe fn new() -> Lut16 {
        // SAFETY: (caller) AVX-512F present.
        Lut16(unsafe { lut_vectors(fp8_lut()) })
    }

    /// 32 FP8 bytes → 32 bf16.
    #[inline(always)]
    unsafe fn row(&self, v: __m256i) -> __m512bh {
        let lut = &self.0;
        // SAFETY: register-only AVX-512BW operations (caller has the features).
        unsafe {
            let w = _mm512_cvtepu8_epi16(v);
            let mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7F));
            let lo = _mm512_permutex2var_epi16(lut[0], mag, lut[1]);
            let hi = _mm512_permutex2var_epi16(lut[2], mag, lut[3]);
            let upper = _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40));
            let r = _mm512_mask_blend_epi16(upper, lo, hi);
            let sign = _mm512_slli_epi16::<8>(_mm512_and_si512(w, _mm512_set1_epi16(0x80)));
            bh(_mm512_or_si512(r, sign))
        }
    }
}

impl Decode for Lut16 {
    #[inline(always)]
    unsafe fn rows(
        &self,
        n: usize,
        wp: *const u8,
        pairs: usize,
        pf: Pf,
        scales: &[f32],
        x: &[*const u32; MAX_ROWS],
        out: &[*mut f32; MAX_ROWS],
    ) {
        // SAFETY: (caller) the contract.
        unsafe { rows_lut16(self, n, wp, pairs, pf, scales, x, out) }
    }

    #[inline(always)]
    unsafe fn scaled(&self, t: &ScaleTables, s: __m512) -> Lut16 {
        // SAFETY: (caller) the features present.
        Lut16(unsafe { t.scaled(s) })
    }

    #[inline(always)]
    unsafe fn pair_rows(&self, p: *const u8) -> (__m512bh, __m512bh) {
        // SAFETY: (caller) 64 readable bytes, AVX-512 BW present.
        unsafe {
            (
                self.row(_mm256_loadu_si256(p.cast())),
                self.row(_mm256_loadu_si256(p.add(32).cast())),
            )
        }
    }
}

/// The block scales of N-tile `nt`: one per 128 inputs.
#[inline(always)]
fn tile_scales<'a>(w: &MatRef<'a>, nt: usize) -> &'a [f32] {
    let kb = w.l.k.div_ceil(128);
    &w.s[(nt * 16 / 128) * kb..][..kb]
}

/// FP8 weights × bf16 activations for few tokens: the VBMI decoder when the CPU has it.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn gemm_fp8(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: *mut f32,
    ldy: usize,
) {
    // SAFETY: (contract); VBMI checked.
    unsafe {
        if has_vbmi() {
            gemm_fp8_vbmi(w, nt0, nts, a, y, ldy)
        } else {
            gemm_fp8_lut16(w, nt0, nts, a, y, ldy)
        }
    }
}

/// [`gemm_fp8`] with the VBMI byte-table decoder.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")]
pub(crate) unsafe fn gemm_fp8_vbmi(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: *mut f32,
    ldy: usize,
) {
    // SAFETY: (contract) features present.
    unsafe { gemm_with(&Vbmi::new(), w, nt0, nts, a, y, ldy) }
}

/// [`gemm_fp8`] with the 16-bit table decoder (CPUs without VBMI).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn gemm_fp8_lut16(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: *mut f32,
    ldy: usize,
) {
    // SAFETY: (contract) features present.
    unsafe { gemm_with(&Lut16::new(), w, nt0, nts, a, y, ldy) }
}

/// Rows per token block, so each weight byte is decoded once for up to 8 tokens (an expert's share of
/// a 64-token step is ~8 rows). Up to 4 rows keep two accumulator chains per row; 5 to 8 one chain
/// per row (8 chains hide the dot's latency), so accumulators, running sums, tables and temporaries
/// still fit the 32 vector registers.
const FP8_ROWS: usize = 8;

/// Calls `$f::<R>(args)` for the block size `$n` (1..=8).
macro_rules! by_rows8 {
    ($n:expr, $f:ident($($a:expr),*)) => {
        match $n {
            8 => $f::<8, _>($($a),*), 7 => $f::<7, _>($($a),*), 6 => $f::<6, _>($($a),*),
            5 => $f::<5, _>($($a),*), 4 => $f::<4, _>($($a),*), 3 => $f::<3, _>($($a),*),
            2 => $f::<2, _>($($a),*), _ => $f::<1, _>($($a),*),
        }
    };
}

/// [`Decode::rows`] of the VBMI decoder: a target-feature function of its own, so the block kernels
/// compile with these features whether or not the tile loop's closure that calls it is inlined (a
/// closure does not carry its enclosing function's target features).
///
/// # Safety
/// As [`fp8_block`]; the CPU has AVX-512 VBMI.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")]
unsafe fn rows_vbmi(
    dec: &Vbmi,
    n: usize,
    wp: *const u8,
    pairs: usize,
    pf: Pf,
    scales: &[f32],
    x: &[*const u32; MAX_ROWS],
    out: &[*mut f32; MAX_ROWS],
) {
    // SAFETY: (caller).
    unsafe { by_rows8!(n, fp8_block(wp, pairs, pf, scales, dec, x, out)) }
}

/// [`Decode::rows`] of the 16-bit table decoder (see [`rows_vbmi`]).
///
/// # Safety
/// As [`fp8_block`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn rows_lut16(
    dec: &Lut16,
    n: usize,
    wp: *const u8,
    pairs: usize,
    pf: Pf,
    scales: &[f32],
    x: &[*const u32; MAX_ROWS],
    out: &[*mut f32; MAX_ROWS],
) {
    // SAFETY: (caller).
    unsafe { by_rows8!(n, fp8_block(wp, pairs, pf, scales, dec, x, out)) }
}

/// The few-token kernel body, inlined into each decoder's `#[target_feature]` entry point.
#[inline(always)]
unsafe fn gemm_with<D: Decode>(
    dec: &D,
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: *mut f32,
    ldy: usize,
) {
    let pairs = w.l.k_pad / 2;
    let pf = Pf::for_call(w, nt0, nts);
    let act = (a.b.as_ptr().cast(), 2);
    // SAFETY: (contract).
    unsafe {
        for_tiles::<u32>(w, nt0, nts, a, act, (y, ldy), FP8_ROWS, |nt, wp, b, n| {
            dec.rows(n, wp, pairs, pf, tile_scales(w, nt), &b.x, &b.out)
        })
    }
}

/// `R` tokens × one N-tile: per 128 inputs, one or two accumulator chains per token over the decoded
/// pair-rows, then the block scale once.
#[inline(always)]
unsafe fn fp8_block<const R: usize, D: Decode>(
    wp: *const u8,
    pairs: usize,
    pf: Pf,
    scales: &[f32],
    dec: &D,
    x: &[*const u32; MAX_ROWS],
    out: &[*mut f32; MAX_ROWS],
) {
    // SAFETY: (caller) `pairs` (even) rows of 32 bytes; x rows hold `pairs` u32.
    unsafe {
        let mut total = [_mm512_setzero_ps(); R];
        for (b, &s) in scales.iter().enumerate() {
            let (start, end) = (b * 64, ((b + 1) * 64).min(pairs));
            if start >= end {
                break;
            }
            let two_chains = R <= 4;
            let mut acc0 = [_mm512_setzero_ps(); R];
            let mut acc1 = [_mm512_setzero_ps(); R];
            let mut i = start;
            while i < end {
                prefetch(wp.add(i * 32), pf);
                let (w0, w1) = dec.pair_rows(wp.add(i * 32));
                for r in 0..R {
                    let x0 = bh(_mm512_set1_epi32(x[r].add(i).read_unaligned() as i32));
                    let x1 = bh(_mm512_set1_epi32(x[r].add(i + 1).read_unaligned() as i32));
                    if two_chains {
                        acc0[r] = _mm512_dpbf16_ps(acc0[r], w0, x0);
                        acc1[r] = _mm512_dpbf16_ps(acc1[r], w1, x1);
                    } else {
                        acc0[r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc0[r], w0, x0), w1, x1);
                    }
                }
                i += 2;
            }
            let sv = _mm512_set1_ps(s);
            for r in 0..R {
                let sum = if two_chains {
                    _mm512_add_ps(acc0[r], acc1[r])
                } else {
                    acc0[r]
                };
                total[r] = _mm512_fmadd_ps(sum, sv, total[r]);
            }
        }
        for r in 0..R {
            _mm512_storeu_ps(out[r], total[r]);
        }
    }
}

/// 32 bf16 (exact FP8 values) times the block scale, rounded once to bf16.
#[inline(always)]
unsafe fn scale_bf16x32(b: __m512bh, s: __m512) -> __m512i {
    // SAFETY: register-only AVX-512 BF16 operations (caller has the features).
    unsafe {
        let b = transmute::<__m512bh, __m512i>(b);
        let lo = _mm512_cvtpbh_ps(transmute::<__m256i, __m256bh>(
            _mm512_extracti64x4_epi64::<0>(b),
        ));
        let hi = _mm512_cvtpbh_ps(transmute::<__m256i, __m256bh>(
            _mm512_extracti64x4_epi64::<1>(b),
        ));
        transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(
            _mm512_mul_ps(hi, s),
            _mm512_mul_ps(lo, s),
        ))
    }
}

/// Widens FP8 N-tiles `nt0 .. nt0 + nts` to the bf16 tile layout with each 128×128 block scale
/// folded in (one bf16 rounding of `fp8 · scale`), into `out` (`nts · k_pad · 16` bf16 values). Lets
/// experts with many tokens run the bf16 kernels (AMX or AVX-512) instead of re-widening per token
/// block. Both decoders give the same bits.
///
/// # Safety
/// As the module contract; `w` is FP8 and `out` holds `nts * w.l.k_pad * 16` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn fp8_to_bf16_tiles(w: &MatRef<'_>, nt0: usize, nts: usize, out: &mut [u16]) {
    // SAFETY: (contract); VBMI checked.
    unsafe {
        if has_vbmi() {
            fp8_to_bf16_tiles_vbmi(w, nt0, nts, out)
        } else {
            fp8_to_bf16_tiles_lut16(w, nt0, nts, out)
        }
    }
}

/// [`fp8_to_bf16_tiles`] with the VBMI decoder.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")]
pub(crate) unsafe fn fp8_to_bf16_tiles_vbmi(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    out: &mut [u16],
) {
    // SAFETY: (contract) features present.
    unsafe { widen_with(&Vbmi::new(), w, nt0, nts, out) }
}

/// [`fp8_to_bf16_tiles`] with the 16-bit table decoder.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn fp8_to_bf16_tiles_lut16(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    out: &mut [u16],
) {
    // SAFETY: (contract) features present.
    unsafe { widen_with(&Lut16::new(), w, nt0, nts, out) }
}

/// Per 128×128 block the scale is folded into the decoder's tables once (~30 instructions), so each 64
/// weight bytes cost the decode and two stores; a scale that cannot be folded (negative, NaN) is
/// applied to the decoded values instead (two bf16 → f32 → bf16 round trips per 64 bytes).
#[inline(always)]
unsafe fn widen_with<D: Decode>(dec: &D, w: &MatRef<'_>, nt0: usize, nts: usize, out: &mut [u16]) {
    let pairs = w.l.k_pad / 2;
    let pf = Pf::plain();
    assert!(out.len() >= nts * pairs * 32);
    // SAFETY: (caller) AVX-512F present.
    let tables = unsafe { ScaleTables::new() };
    for t in 0..nts {
        let nt = nt0 + t;
        let wp = w.ntile(nt).as_ptr();
        let dst = out[t * pairs * 32..].as_mut_ptr();
        for (b, &scale) in tile_scales(w, nt).iter().enumerate() {
            let (start, end) = (b * 64, ((b + 1) * 64).min(pairs));
            // SAFETY: register-only (caller has the features).
            let s = unsafe { _mm512_set1_ps(scale) };
            // SAFETY: (caller) the features present; the rows of block b lie inside the tile and
            // `dst`.
            unsafe {
                if folds_into_tables(scale) {
                    widen_rows(&dec.scaled(&tables, s), wp, dst, start..end, pf, None);
                } else {
                    widen_rows(dec, wp, dst, start..end, pf, Some(s));
                }
            }
        }
    }
}

/// Pair-rows `rows` of one N-tile (`wp`, 32 bytes each) decoded by `dec`, times `scale` where given
/// (else as decoded), into the same rows of `dst` (32 bf16 each).
///
/// # Safety
/// The CPU has the decoder's features and AVX-512 BF16; `rows` is an even range of pair-rows inside
/// the tile and `dst`.
#[inline(always)]
unsafe fn widen_rows<D: Decode>(
    dec: &D,
    wp: *const u8,
    dst: *mut u16,
    rows: std::ops::Range<usize>,
    pf: Pf,
    scale: Option<__m512>,
) {
    for i in rows.step_by(2) {
        // SAFETY: rows i, i+1 of the N-tile (64 bytes) and of the output (128 bytes) are in bounds
        // (caller); the decoder's features are present.
        unsafe {
            prefetch(wp.add(i * 32), pf);
            let (w0, w1) = dec.pair_rows(wp.add(i * 32));
            let (w0, w1) = match scale {
                Some(s) => (scale_bf16x32(w0, s), scale_bf16x32(w1, s)),
                None => (
                    transmute::<__m512bh, __m512i>(w0),
                    transmute::<__m512bh, __m512i>(w1),
                ),
            };
            _mm512_storeu_si512(dst.add(i * 32).cast(), w0);
            _mm512_storeu_si512(dst.add(i * 32 + 32).cast(), w1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::moe::pack::bf16_to_f32;

    /// Both decoders against the scalar E4M3 definition for all 256 bytes, bit for bit (the NaN bytes
    /// 0x7F and 0xFF keep their sign: a NaN either way).
    #[test]
    fn decoders_are_exact_for_every_byte() {
        if crate::cpu::detected_tier() < crate::cpu::CpuTier::Avx512 {
            return;
        }
        let bytes: Vec<u8> = (0..=255u8).collect();
        let want: Vec<u16> = bytes
            .iter()
            .map(|&b| f32_to_bf16(fp8_e4m3_to_f32(b)) | (b as u16 & 0x80) << 8)
            .collect();
        assert!(bf16_to_f32(want[0xFF]).is_nan() && bf16_to_f32(want[0x7F]).is_nan());
        // SAFETY: AVX-512 (F, BW) checked above, VBMI where used.
        unsafe {
            check_decoder(&Lut16::new(), &bytes, &want);
            if has_vbmi() {
                check_decoder(&Vbmi::new(), &bytes, &want);
            }
        }
    }

    /// Folding a block scale into the tables gives, for all 256 bytes, the bits of decoding and then
    /// scaling (what the widening did per value before): ordinary scales, ones whose products round,
    /// overflow to infinity or fall below f32's normal range (flushed by the bf16 conversion), +0 and
    /// +∞; and `folds_into_tables` refuses the scales for which or-ing the sign in would be wrong.
    #[test]
    fn scaled_tables_equal_scaling_after_decoding() {
        if crate::cpu::detected_tier() < crate::cpu::CpuTier::Avx512 {
            return;
        }
        let bytes: Vec<u8> = (0..=255u8).collect();
        let scales = [
            1.0f32,
            0.5,
            3.7e-3,
            1.0 / 448.0,
            0.123_456_79,
            6.0e37,
            f32::MAX,
            f32::INFINITY,
            1e-30,
            f32::MIN_POSITIVE,
            1e-40,
            0.0,
        ];
        // SAFETY: AVX-512 (F, BW, BF16) checked above, VBMI where used.
        unsafe {
            let t = ScaleTables::new();
            for &sc in &scales {
                assert!(folds_into_tables(sc), "{sc}");
                let s = _mm512_set1_ps(sc);
                check_scaled(&Lut16::new(), &t, s, &bytes, sc);
                if has_vbmi() {
                    check_scaled(&Vbmi::new(), &t, s, &bytes, sc);
                }
            }
        }
        for sc in [-1.5f32, -0.0, f32::NAN, -f32::INFINITY] {
            assert!(!folds_into_tables(sc), "{sc}");
        }
    }

    /// # Safety
    /// The CPU has the decoder's features and AVX-512 BF16.
    unsafe fn check_scaled<D: Decode>(dec: &D, t: &ScaleTables, s: __m512, bytes: &[u8], sc: f32) {
        // SAFETY: (caller) features present; 64-byte chunks of a 256-byte vector.
        unsafe {
            let folded = dec.scaled(t, s);
            for c in bytes.chunks(64) {
                let (a, b) = dec.pair_rows(c.as_ptr());
                let want: [[u16; 32]; 2] = [
                    transmute::<__m512i, [u16; 32]>(scale_bf16x32(a, s)),
                    transmute::<__m512i, [u16; 32]>(scale_bf16x32(b, s)),
                ];
                let (a, b) = folded.pair_rows(c.as_ptr());
                let got = [
                    transmute::<__m512bh, [u16; 32]>(a),
                    transmute::<__m512bh, [u16; 32]>(b),
                ];
                assert_eq!(got, want, "scale {sc}, bytes from {}", c[0]);
            }
        }
    }

    /// # Safety
    /// The CPU has the decoder's features.
    unsafe fn check_decoder(dec: &impl Decode, bytes: &[u8], want: &[u16]) {
        // SAFETY: (caller) the decoder's features present; 64-byte chunks of a 256-byte vector.
        unsafe {
            for c in bytes.chunks(64) {
                let (a, b) = dec.pair_rows(c.as_ptr());
                let (a, b): ([u16; 32], [u16; 32]) = (
                    transmute::<__m512bh, [u16; 32]>(a),
                    transmute::<__m512bh, [u16; 32]>(b),
                );
                let at = c[0] as usize;
                assert_eq!(&a[..], &want[at..at + 32], "first pair-row at {at}");
                assert_eq!(&b[..], &want[at + 32..at + 64], "second pair-row at {at}");
            }
        }
    }
}
