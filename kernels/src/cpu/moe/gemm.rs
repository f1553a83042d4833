//! Picks the kernel for (tier, weight format, activation kind). Every tier computes the same thing:
//! `y[r][16·(nt − nt0) + j] = Σ_k W[16·nt + j][k] · a_r[k]`, see `kern_generic`.

use super::act::{ActKind, ActRef};
use super::pack::{GroupedCodes, MatRef, WeightFormat};
use crate::cpu::features::CpuTier;

/// Activation kind the kernels of `tier` read for weights of `format` over `k_pad` inputs.
pub(crate) fn act_kind(tier: CpuTier, format: WeightFormat, k_pad: usize) -> ActKind {
    match (tier, format) {
        // F16 weights meet f32 activations on every tier (no f16 dot instruction before AVX-512 FP16).
        (CpuTier::Scalar | CpuTier::Avx2, _) | (_, WeightFormat::F16) => ActKind::F32,
        (_, WeightFormat::Bf16 | WeightFormat::Fp8Block) => ActKind::Bf16,
        (_, WeightFormat::Int8) => ActKind::I8 { group: k_pad },
        (
            _,
            WeightFormat::Int4 { group }
            | WeightFormat::Int4Min { group }
            | WeightFormat::Int8Group { group }
            | WeightFormat::Int8Min { group },
        ) => ActKind::I8 { group },
    }
}

/// Whether the AMX kernels handle this format: bf16 and int8 as tiles; FP8 and the grouped int
/// formats (Q4_0 / Q4_1 / Q8_0 / Q6_K codes) widened to bf16 tiles first (their per-group scales fit
/// no AMX-INT8 accumulation of 64 inputs).
pub(crate) fn amx_supports(format: WeightFormat) -> bool {
    matches!(
        format,
        WeightFormat::Bf16
            | WeightFormat::Int8
            | WeightFormat::Fp8Block
            | WeightFormat::Int4 { .. }
            | WeightFormat::Int4Min { .. }
            | WeightFormat::Int8Group { .. }
            | WeightFormat::Int8Min { .. }
    )
}

/// Without AMX, from this many tokens on FP8 tiles are widened to bf16 once per call (then the bf16
/// kernel) instead of decoded once per block of 8 tokens inside the FP8 kernel.
pub(crate) const FP8_WIDEN_MIN_ROWS: usize = 16;

/// Whether a call on FP8 weights widens them to bf16 tiles first: always when it runs on AMX (the
/// widening, shared by all rows, is then most of the cost), else from [`FP8_WIDEN_MIN_ROWS`] rows.
pub(crate) fn fp8_widens(tier: CpuTier, amx: bool, m: usize) -> bool {
    (tier == CpuTier::Amx && amx) || m >= FP8_WIDEN_MIN_ROWS
}

thread_local! {
    static WIDE: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
    static WIDE_ACT: std::cell::RefCell<(Vec<u16>, Vec<u32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Writes N-tiles `nt0 .. nt0 + count` of a packed matrix as bf16 tiles (`k_pad · 16` values each).
#[cfg(target_arch = "x86_64")]
pub(crate) type Widen = unsafe fn(&MatRef<'_>, usize, usize, &mut [u16]);

/// Runs N-tiles `nt0 .. nt0 + nts` of `w` through the bf16 kernel of `tier` (AMX when `amx`): two
/// N-tiles at a time widened by `widen` into a thread-local buffer (128 KiB of bf16 for k = 2048, stays
/// in L2), reused by every row of the call.
///
/// # Safety
/// The CPU has what `widen` needs for `w` (at least AVX-512 BF16); `a` has bf16 kind; shapes as for
/// [`gemm`]; for `amx`, the view's rows are consecutive with 16-row-padded storage.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn gemm_widened(
    tier: CpuTier,
    amx: bool,
    widen: Widen,
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
) {
    use super::pack::MatLayout;
    let k_pad = w.l.k_pad;
    WIDE.with(|buf| {
        let mut buf = buf.borrow_mut();
        buf.resize(2 * 16 * k_pad, 0);
        let mut t = 0;
        while t < nts {
            let c = (nts - t).min(2);
            // SAFETY: (caller) the CPU has what `widen` needs; the buffer holds two N-tiles.
            unsafe { widen(w, nt0 + t, c, &mut buf) };
            // SAFETY: u16 storage viewed as bytes.
            let bytes = unsafe {
                std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), 2 * 16 * k_pad * c)
            };
            let wide = MatRef {
                l: MatLayout::new(WeightFormat::Bf16, 16 * c, k_pad),
                w: bytes,
                s: &[],
            };
            gemm(tier, amx, &wide, 0, c, a, &mut y[16 * t..], ldy);
            t += c;
        }
    })
}

/// Grouped int weights (Int4 / Int4Min / Int8Group / Int8Min) with many tokens: int8 activation rows → bf16
/// (code · scale), then [`gemm_widened`] with the group scales folded into the weights (AMX when
/// `amx`). Costs one more bf16 rounding of weights and activations than the VNNI kernel, buys AMX
/// throughput (the widening, ~20 instructions per 64 weight bytes, is shared by all rows).
///
/// # Safety
/// Tier Avx512 (Amx when `amx`) on this CPU; shapes checked by `gemm`; `a` has int8 kind.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn int_widened(
    tier: CpuTier,
    amx: bool,
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
) {
    use super::kern_avx512;
    let (k_pad, m) = (w.l.k_pad, a.rows.len());
    let m_pad = m.div_ceil(16) * 16;
    WIDE_ACT.with(|cell| {
        let mut cell = cell.borrow_mut();
        let (xb, seq) = &mut *cell;
        if xb.len() < m_pad * k_pad {
            xb.resize(m_pad * k_pad, 0);
        }
        if seq.len() < m {
            *seq = (0..m as u32).collect();
        }
        // SAFETY: (caller) tier present; buffer sized above.
        unsafe { kern_avx512::i8_rows_to_bf16(a, m_pad, xb) };
        let ab = ActRef {
            kind: ActKind::Bf16,
            k_pad,
            rows: &seq[..m],
            f: &[],
            b: xb,
            q: &[],
            scale: &[],
            gsum: &[],
            live: &[],
        };
        // SAFETY: (caller) tier present; int4 is a format `widen_tiles` reads; the rows of `ab` are
        // consecutive with 16-row-padded storage.
        unsafe {
            gemm_widened(
                tier,
                amx,
                crate::cpu::dense_widen::widen_tiles,
                w,
                nt0,
                nts,
                &ab,
                y,
                ldy,
            )
        }
    })
}

/// The shape contract of every kernel call: the view's row count, `None` when there is nothing to do.
/// Panics on shapes no kernel may see (N-tiles past the matrix, `y` too short, another K).
fn checked_rows(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &[f32],
    ldy: usize,
) -> Option<usize> {
    let m = a.rows.len();
    if m == 0 || nts == 0 {
        return None;
    }
    assert!(nt0 + nts <= w.l.n_tiles && 16 * nts <= ldy && y.len() >= (m - 1) * ldy + 16 * nts);
    assert_eq!(a.k_pad, w.l.k_pad);
    Some(m)
}

/// Whether [`gemm_amx_int`] runs this format on AMX-INT8.
pub(crate) fn amx_int_supports(format: WeightFormat) -> bool {
    #[cfg(target_arch = "x86_64")]
    return super::kern_amx_int::amx_int_supports(format);
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

/// Grouped int weights × int8 activations on AMX-INT8 (`kern_amx_int`) when this CPU has AMX, the
/// format has the kernel and the view's rows are consecutive; else [`gemm`] on the best tier.
/// Same contract as [`gemm`]; the rows' storage extends 16 rows past the view's first row.
pub(crate) fn gemm_amx_int(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
) {
    let Some(m) = checked_rows(w, nt0, nts, a, y, ldy) else {
        return;
    };
    #[cfg(target_arch = "x86_64")]
    {
        let grouped = matches!(
            (a.kind, GroupedCodes::of(w.l.format)),
            (ActKind::I8 { group }, Some(c)) if group == c.group
        );
        let r0 = a.rows[0] as usize;
        let consecutive = a
            .rows
            .iter()
            .enumerate()
            .all(|(i, &r)| r as usize == r0 + i);
        let stored = a.q.len() >= (r0 + m.div_ceil(16) * 16) * a.k_pad;
        if CpuTier::Amx.clamp_to_cpu() == CpuTier::Amx
            && amx_int_supports(w.l.format)
            && grouped
            && consecutive
            && stored
        {
            // SAFETY: AMX present (tier detected, permission taken by the detection); format,
            // activation kind, group, row order and storage checked above; shapes as for `gemm`.
            return unsafe { super::kern_amx_int::gemm_grouped(w, nt0, nts, a, y, ldy) };
        }
    }
    gemm(CpuTier::Amx, false, w, nt0, nts, a, y, ldy)
}

/// Runs the kernel of `tier` (clamped to the CPU). `amx` requests the AMX kernel, which needs the
/// view's rows consecutive and storage for the rows rounded up to 16.
pub(crate) fn gemm(
    tier: CpuTier,
    amx: bool,
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
) {
    let Some(m) = checked_rows(w, nt0, nts, a, y, ldy) else {
        return;
    };
    let tier = tier.clamp_to_cpu();
    #[cfg(target_arch = "x86_64")]
    {
        use super::kern_generic::gemm_avx2;
        use super::{kern_amx, kern_avx512, kern_fp8};
        // SAFETY: the tier was detected on this CPU; shapes were checked above; activation kinds are
        // matched to the kernels below.
        unsafe {
            match (tier, a.kind, w.l.format) {
                // FP8 is not an AMX tile format: it reaches AMX through the widening arm below.
                (CpuTier::Amx, _, WeightFormat::Bf16 | WeightFormat::Int8) if amx => {
                    return kern_amx::gemm(w, nt0, nts, a, y, ldy)
                }
                (CpuTier::Avx512 | CpuTier::Amx, ActKind::Bf16, WeightFormat::Bf16) => {
                    return kern_avx512::gemm_bf16(w, nt0, nts, a, y.as_mut_ptr(), ldy)
                }
                (CpuTier::Avx512 | CpuTier::Amx, ActKind::F32, WeightFormat::F16) => {
                    return kern_avx512::gemm_f16(w, nt0, nts, a, y.as_mut_ptr(), ldy)
                }
                (
                    CpuTier::Amx,
                    ActKind::I8 { .. },
                    WeightFormat::Int4 { .. }
                    | WeightFormat::Int4Min { .. }
                    | WeightFormat::Int8Group { .. }
                    | WeightFormat::Int8Min { .. },
                ) if amx => return int_widened(tier, true, w, nt0, nts, a, y, ldy),
                (CpuTier::Avx512 | CpuTier::Amx, ActKind::Bf16, WeightFormat::Fp8Block)
                    if fp8_widens(tier, amx, m) =>
                {
                    return gemm_widened(
                        tier,
                        tier == CpuTier::Amx && amx,
                        kern_fp8::fp8_to_bf16_tiles,
                        w,
                        nt0,
                        nts,
                        a,
                        y,
                        ldy,
                    )
                }
                (CpuTier::Avx512 | CpuTier::Amx, ActKind::Bf16, WeightFormat::Fp8Block) => {
                    return kern_fp8::gemm_fp8(w, nt0, nts, a, y.as_mut_ptr(), ldy)
                }
                (
                    CpuTier::Avx512 | CpuTier::Amx,
                    ActKind::I8 { .. },
                    WeightFormat::Int8
                    | WeightFormat::Int4 { .. }
                    | WeightFormat::Int4Min { .. }
                    | WeightFormat::Int8Group { .. }
                    | WeightFormat::Int8Min { .. },
                ) => return kern_avx512::gemm_int(w, nt0, nts, a, y.as_mut_ptr(), ldy),
                (CpuTier::Avx2, ActKind::F32 | ActKind::Bf16, _) => {
                    return gemm_avx2(w, nt0, nts, a, y, ldy)
                }
                _ => {}
            }
        }
    }
    let _ = amx;
    match a.kind {
        ActKind::I8 { .. } => super::kern_generic::gemm_i8_twin(w, nt0, nts, a, y, ldy),
        _ => super::kern_generic::gemm_scalar(w, nt0, nts, a, y, ldy),
    }
}
