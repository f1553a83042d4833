//! Activations: the gating nonlinearity, and activation rows converted to what a kernel family reads
//! (f32 for scalar/AVX2, bf16 pairs for `vdpbf16ps`/AMX-BF16, int8 per row for VNNI/AMX-INT8).

use super::act_i8::{quantize_row, quantize_row_split, I8Row};
#[cfg(test)]
use super::pack::bf16_to_f32;
use super::pack::f32_to_bf16;
#[cfg(target_arch = "x86_64")]
use crate::cpu::features::CpuTier;

/// The gate nonlinearity of the expert FFN: `down(act(gate(x)) ⊙ up(x))`.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum Activation {
    #[default]
    Silu,
    /// GELU, tanh approximation.
    GeluTanh,
    /// ReLU: the gated MLP is ReGLU, `relu(gate) ⊙ up` (SmallThinker).
    Relu,
}

impl Activation {
    #[inline(always)]
    pub fn apply(self, g: f32) -> f32 {
        match self {
            Activation::Silu => g / (1.0 + exp_fast(-g)),
            Activation::GeluTanh => {
                let z = 0.797_884_6_f32 * (g + 0.044_715 * g * g * g); // sqrt(2/pi)
                let tanh = 1.0 - 2.0 / (exp_fast(2.0 * z) + 1.0);
                0.5 * g * (1.0 + tanh)
            }
            Activation::Relu => g.max(0.0),
        }
    }
}

/// e^x to ~2e-7 relative, branch-free so loops over it vectorize (libm `exp` does not): 2^t with
/// t = x·log2(e) split into round(t) (exponent bits) and a degree-6 polynomial of the rest.
///
/// The integer n = round(t) is read from the bits of `t + 1.5·2^23` (whose mantissa holds
/// `2^22 + n` for |n| < 2^22), not converted with `as i32`: Rust's saturating float → int cast
/// compiled to per-lane scalar code inside the vectorized loops (`gated_row`), a quarter of an
/// 8-stream SmolLM2 step's SiLU time. Same value as the cast for every input (NaN stays NaN).
#[inline(always)]
pub fn exp_fast(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5·2^23: adding it rounds to an integer
    let t = (x * std::f32::consts::LOG2_E).clamp(-126.0, 126.0);
    let r = t + ROUND;
    let n = r - ROUND;
    let f = t - n;
    let p = 1.0
        + f * (std::f32::consts::LN_2
            + f * (0.240_226_5
                + f * (0.055_504_11
                    + f * (0.009_618_129 + f * (0.001_333_355 + f * 0.000_154_035_3)))));
    // bits(r) = bits(ROUND) + n, so the biased exponent n + 127 is an integer add away.
    let biased = r.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127);
    p * f32::from_bits(biased << 23)
}

/// `act(gate) * up`, with GLM-style `swiglu_limit` (gate clamped to ≤ limit, up to [-limit, limit]).
#[inline(always)]
pub fn gated(act: Activation, limit: Option<f32>, g: f32, u: f32) -> f32 {
    match limit {
        Some(l) => act.apply(g.min(l)) * u.clamp(-l, l),
        None => act.apply(g) * u,
    }
}

/// `out[i] = gated(g[i], u[i]) · w`, with the variant chosen outside the loop so it vectorizes
/// (16 lanes with AVX-512: at 1024 tokens this loop runs 6 M times per layer).
pub(crate) fn gated_row(
    act: Activation,
    limit: Option<f32>,
    g: &[f32],
    u: &[f32],
    w: f32,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    match crate::cpu::features::detected_tier() {
        // SAFETY: AVX-512F/BW/VL present (checked once at detection).
        CpuTier::Avx512 | CpuTier::Amx => {
            return unsafe { gated_row_avx512(act, limit, g, u, w, out) }
        }
        // SAFETY: AVX2 and FMA present (the tier's definition).
        CpuTier::Avx2 => return unsafe { gated_row_avx2(act, limit, g, u, w, out) },
        CpuTier::Scalar => {}
    }
    gated_row_body(act, limit, g, u, w, out)
}

/// `out[i] = act(g[i]) · u[i]` (with the `limit` clamp) over whole rows, vectorized with AVX-512 when
/// present: the dense MLP's gate, where libm's scalar `exp` per element cost as much as the projections
/// of a small model.
pub fn gated_rows(act: Activation, limit: Option<f32>, g: &[f32], u: &[f32], out: &mut [f32]) {
    gated_row(act, limit, g, u, 1.0, out)
}

/// Whether the elementwise helpers may use their AVX-512 builds.
#[cfg(target_arch = "x86_64")]
#[inline]
fn wide_simd() -> bool {
    crate::cpu::features::detected_tier() >= crate::cpu::features::CpuTier::Avx512
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn gated_row_avx512(
    act: Activation,
    limit: Option<f32>,
    g: &[f32],
    u: &[f32],
    w: f32,
    out: &mut [f32],
) {
    gated_row_body(act, limit, g, u, w, out)
}

/// [`gated_row_body`] in 8 lanes. Rust does not contract `a·b + c` into FMAs, so every tier computes
/// the scalar body's values bit for bit.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gated_row_avx2(
    act: Activation,
    limit: Option<f32>,
    g: &[f32],
    u: &[f32],
    w: f32,
    out: &mut [f32],
) {
    gated_row_body(act, limit, g, u, w, out)
}

#[inline(always)]
fn gated_row_body(
    act: Activation,
    limit: Option<f32>,
    g: &[f32],
    u: &[f32],
    w: f32,
    out: &mut [f32],
) {
    let n = out.len();
    let (g, u) = (&g[..n], &u[..n]);
    match (act, limit) {
        (Activation::Silu, None) => {
            for i in 0..n {
                out[i] = gated(Activation::Silu, None, g[i], u[i]) * w;
            }
        }
        (Activation::Silu, Some(l)) => {
            for i in 0..n {
                out[i] = gated(Activation::Silu, Some(l), g[i], u[i]) * w;
            }
        }
        (Activation::Relu, None) => {
            for i in 0..n {
                out[i] = gated(Activation::Relu, None, g[i], u[i]) * w;
            }
        }
        (a, l) => {
            for i in 0..n {
                out[i] = gated(a, l, g[i], u[i]) * w;
            }
        }
    }
}

/// f32 → bf16 over a row (vectorized with AVX-512 when present).
fn to_bf16_row(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if wide_simd() {
        // SAFETY: AVX-512F/BW/VL present.
        return unsafe { to_bf16_row_avx512(src, dst) };
    }
    to_bf16_row_body(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn to_bf16_row_avx512(src: &[f32], dst: &mut [u16]) {
    to_bf16_row_body(src, dst)
}

#[inline(always)]
fn to_bf16_row_body(src: &[f32], dst: &mut [u16]) {
    for (o, &x) in dst.iter_mut().zip(src) {
        *o = f32_to_bf16(x);
    }
}

/// In-memory form of activation rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActKind {
    F32,
    Bf16,
    /// Symmetric int8 per group of `group` inputs (scale = amax / 127, as llama.cpp's Q8_0
    /// activations: a per-row scale lets outlier channels drown the rest), plus per-group sums of the
    /// codes (for the unsigned weight offset: Σ (q + off)·x = Σ q·x + off·Σ x).
    I8 {
        group: usize,
    },
}

/// Owned activation rows, `rows × k_pad`, reused across calls.
#[derive(Default)]
pub(crate) struct ActBuf {
    pub f: Vec<f32>,
    pub b: Vec<u16>,
    pub q: Vec<i8>,
    pub scale: Vec<f32>,
    pub gsum: Vec<i32>,
}

/// Read-only view of some rows of an [`ActBuf`].
#[derive(Clone, Copy)]
pub(crate) struct ActRef<'a> {
    pub kind: ActKind,
    pub k_pad: usize,
    /// Row indices into the buffer. AMX kernels need them consecutive with 16-row-padded storage.
    pub rows: &'a [u32],
    pub f: &'a [f32],
    pub b: &'a [u16],
    pub q: &'a [i8],
    pub scale: &'a [f32],
    pub gsum: &'a [i32],
    /// Int8 kinds: the only groups any row of the view has codes in, ascending (empty: every group).
    /// The residual rows of int8 pairs have a few; the VNNI kernels then visit only those.
    pub live: &'a [u16],
}

impl<'a> ActRef<'a> {
    /// The view restricted to the groups in `live` (see the field).
    pub fn with_live(self, live: &'a [u16]) -> ActRef<'a> {
        ActRef { live, ..self }
    }

    pub fn groups(&self) -> usize {
        match self.kind {
            ActKind::I8 { group } => self.k_pad / group,
            _ => 0,
        }
    }
}

impl ActBuf {
    /// Makes room for `rows` rows of `kind` (contents unspecified).
    pub fn reserve(&mut self, kind: ActKind, rows: usize, k_pad: usize) {
        fn grow<T: Default + Clone>(v: &mut Vec<T>, n: usize) {
            if v.len() < n {
                v.resize(n, T::default());
            }
        }
        match kind {
            ActKind::F32 => grow(&mut self.f, rows * k_pad),
            ActKind::Bf16 => grow(&mut self.b, rows * k_pad),
            ActKind::I8 { group } => {
                grow(&mut self.q, rows * k_pad);
                grow(&mut self.scale, rows * (k_pad / group));
                grow(&mut self.gsum, rows * (k_pad / group));
            }
        }
    }

    pub fn view<'a>(&'a self, kind: ActKind, k_pad: usize, rows: &'a [u32]) -> ActRef<'a> {
        ActRef {
            kind,
            k_pad,
            rows,
            f: &self.f,
            b: &self.b,
            q: &self.q,
            scale: &self.scale,
            gsum: &self.gsum,
            live: &[],
        }
    }

    /// Raw handle for filling disjoint rows from several threads.
    pub fn writer(&mut self, kind: ActKind, k_pad: usize) -> ActWriter {
        ActWriter {
            kind,
            k_pad,
            f: self.f.as_mut_ptr(),
            b: self.b.as_mut_ptr(),
            q: self.q.as_mut_ptr(),
            scale: self.scale.as_mut_ptr(),
            gsum: self.gsum.as_mut_ptr(),
        }
    }
}

/// Writes rows of an [`ActBuf`]; each row must be written by one thread at a time.
#[derive(Clone, Copy)]
pub(crate) struct ActWriter {
    kind: ActKind,
    k_pad: usize,
    f: *mut f32,
    b: *mut u16,
    q: *mut i8,
    scale: *mut f32,
    gsum: *mut i32,
}

// SAFETY: used only to write disjoint rows from pool threads while the ActBuf is borrowed mutably.
unsafe impl Send for ActWriter {}
unsafe impl Sync for ActWriter {}

impl ActWriter {
    /// Converts `src` (≤ k_pad values, rest zero-padded) into row `row`.
    ///
    /// # Safety
    /// `row` is within the reserved rows and no other thread accesses it concurrently.
    pub unsafe fn write_row(&self, row: usize, src: &[f32]) {
        let k = self.k_pad;
        debug_assert!(src.len() <= k);
        // SAFETY: (caller) the row range is reserved and exclusively ours.
        unsafe {
            match self.kind {
                ActKind::F32 => {
                    let d = std::slice::from_raw_parts_mut(self.f.add(row * k), k);
                    d[..src.len()].copy_from_slice(src);
                    d[src.len()..].fill(0.0);
                }
                ActKind::Bf16 => {
                    let d = std::slice::from_raw_parts_mut(self.b.add(row * k), k);
                    to_bf16_row(src, d);
                    d[src.len()..].fill(0);
                }
                ActKind::I8 { group } => quantize_row(src, group, self.i8_row(row, group)),
            }
        }
    }

    /// Converts `src` into int8 row `hi`, and into row `lo` what those codes leave over (`src − code·scale`,
    /// quantized with its own group scales) in the groups whose amax is above `ratio` times the row's
    /// RMS (`act_i8::quantize_row_split`); the other groups of `lo` get zero codes and a zero scale,
    /// which the kernels skip. The two rows' dots sum to `W·src` within ~amax/32000 per value in the
    /// groups with a residual (amax/254 with one row: an outlier coarsens the other values of its
    /// group) and amax/254 elsewhere, as llama.cpp's int8 activations.
    ///
    /// # Safety
    /// As [`write_row`](Self::write_row), for both rows; the kind is int8.
    pub unsafe fn write_row_split(&self, hi: usize, lo: usize, src: &[f32], ratio: f32) {
        let ActKind::I8 { group } = self.kind else {
            unreachable!("only int8 rows split")
        };
        // SAFETY: (caller) both rows are reserved and exclusively ours.
        unsafe {
            quantize_row_split(
                src,
                group,
                ratio,
                self.i8_row(hi, group),
                self.i8_row(lo, group),
            )
        }
    }

    /// Int8 row `row`'s codes, scales and group sums.
    ///
    /// # Safety
    /// As [`write_row`](Self::write_row); the kind is int8 with this group.
    unsafe fn i8_row(&self, row: usize, group: usize) -> I8Row<'_> {
        let (k, groups) = (self.k_pad, self.k_pad / group);
        // SAFETY: (caller) the row is reserved and exclusively ours.
        unsafe {
            I8Row {
                codes: std::slice::from_raw_parts_mut(self.q.add(row * k), k),
                scale: std::slice::from_raw_parts_mut(self.scale.add(row * groups), groups),
                gsum: std::slice::from_raw_parts_mut(self.gsum.add(row * groups), groups),
            }
        }
    }

    /// Converts `src` into columns `col0 ..` of row `row` (F32 and Bf16 kinds: elementwise); with
    /// `zero_tail` the padding after it up to `k_pad` is zeroed.
    ///
    /// # Safety
    /// As [`write_row`](Self::write_row), for those columns.
    pub unsafe fn write_cols(&self, row: usize, col0: usize, src: &[f32], zero_tail: bool) {
        let k = self.k_pad;
        let end = if zero_tail { k } else { col0 + src.len() };
        // SAFETY: (caller) the columns are reserved and exclusively ours.
        unsafe {
            match self.kind {
                ActKind::F32 => {
                    let d = std::slice::from_raw_parts_mut(self.f.add(row * k + col0), end - col0);
                    d[..src.len()].copy_from_slice(src);
                    d[src.len()..].fill(0.0);
                }
                ActKind::Bf16 => {
                    let d = std::slice::from_raw_parts_mut(self.b.add(row * k + col0), end - col0);
                    to_bf16_row(src, d);
                    d[src.len()..].fill(0);
                }
                ActKind::I8 { .. } => unreachable!("int8 rows need the whole row for their scale"),
            }
        }
    }

    /// Copies row `from` of `src` (same kind and width) into row `to`.
    ///
    /// # Safety
    /// As [`write_row`](Self::write_row) for `to`; `src` is not being written.
    pub unsafe fn copy_row(&self, to: usize, src: &ActRef<'_>, from: usize) {
        let k = self.k_pad;
        // SAFETY: (caller) disjoint reserved rows.
        unsafe {
            match self.kind {
                ActKind::F32 => std::ptr::copy_nonoverlapping(
                    src.f.as_ptr().add(from * k),
                    self.f.add(to * k),
                    k,
                ),
                ActKind::Bf16 => std::ptr::copy_nonoverlapping(
                    src.b.as_ptr().add(from * k),
                    self.b.add(to * k),
                    k,
                ),
                ActKind::I8 { group } => {
                    std::ptr::copy_nonoverlapping(
                        src.q.as_ptr().add(from * k),
                        self.q.add(to * k),
                        k,
                    );
                    let g = k / group;
                    std::ptr::copy_nonoverlapping(
                        src.scale.as_ptr().add(from * g),
                        self.scale.add(to * g),
                        g,
                    );
                    std::ptr::copy_nonoverlapping(
                        src.gsum.as_ptr().add(from * g),
                        self.gsum.add(to * g),
                        g,
                    );
                }
            }
        }
    }
}

/// The f32 value a kernel effectively sees for element `i` of view row `r` (tests).
#[cfg(test)]
pub(crate) fn act_value(a: &ActRef<'_>, r: usize, i: usize) -> f32 {
    let row = a.rows[r] as usize;
    match a.kind {
        ActKind::F32 => a.f[row * a.k_pad + i],
        ActKind::Bf16 => bf16_to_f32(a.b[row * a.k_pad + i]),
        ActKind::I8 { group } => {
            a.q[row * a.k_pad + i] as f32 * a.scale[row * a.groups() + i / group]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_fast_is_accurate() {
        for i in -1600..1600 {
            let x = i as f32 / 20.0;
            let (a, b) = (exp_fast(x), x.exp());
            // x·log2(e) is rounded to f32 first: relative error grows by ~1e-7 per unit of |x|.
            assert!(
                (a - b).abs() <= (4e-7 + 1e-7 * x.abs()) * b,
                "exp({x}): {a} vs {b}"
            );
        }
        assert!(exp_fast(-1000.0) >= 0.0 && exp_fast(1000.0).is_finite());
    }

    /// The vectorized builds give the scalar body's values bit for bit (no FMA contraction, the same
    /// exponent bits as the old `as i32` cast), at every activation, with and without the clamp, over
    /// lengths that leave a remainder after the vector loop.
    #[test]
    fn gated_row_builds_equal_the_scalar_body() {
        let n = 16 * 37 + 5;
        let g: Vec<f32> = (0..n).map(|i| (i as f32 - 300.0) * 0.37).collect();
        let u: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 29) as f32 * 0.25 - 3.5)
            .collect();
        for act in [Activation::Silu, Activation::GeluTanh, Activation::Relu] {
            for limit in [None, Some(7.0)] {
                let mut want = vec![0f32; n];
                gated_row_body(act, limit, &g, &u, 0.75, &mut want);
                let mut got = vec![0f32; n];
                gated_row(act, limit, &g, &u, 0.75, &mut got);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{act:?} {limit:?}, detected tier");
                #[cfg(target_arch = "x86_64")]
                if crate::cpu::features::detected_tier() >= CpuTier::Avx2 {
                    got.fill(0.0);
                    // SAFETY: AVX2 and FMA present (checked above).
                    unsafe { gated_row_avx2(act, limit, &g, &u, 0.75, &mut got) };
                    assert_eq!(bits(&got), bits(&want), "{act:?} {limit:?}, AVX2");
                }
            }
        }
        // The exponent bits are those of the saturating cast they replace, over the whole range.
        for i in -2600..2600 {
            let x = i as f32 * 0.05;
            let t = (x * std::f32::consts::LOG2_E).clamp(-126.0, 126.0);
            let n = (t + 12_582_912.0) - 12_582_912.0;
            let r = t + 12_582_912.0;
            let biased = r
                .to_bits()
                .wrapping_sub(12_582_912f32.to_bits())
                .wrapping_add(127);
            assert_eq!(biased, (n as i32 + 127) as u32, "x = {x}");
        }
        assert!(exp_fast(f32::NAN).is_nan());
    }

    #[test]
    fn activations_match_definitions() {
        assert!((Activation::Silu.apply(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((Activation::GeluTanh.apply(1.0) - 0.841_192).abs() < 1e-5);
        assert_eq!(Activation::Relu.apply(1.5), 1.5);
        assert_eq!(Activation::Relu.apply(-1.5), 0.0);
        assert_eq!(gated(Activation::Relu, None, -2.0, 3.0), 0.0);
        assert_eq!(gated(Activation::Relu, None, 2.0, -3.0), -6.0);
        // GLM-5 swiglu_limit: gate clamped above only, up on both sides.
        let l = Some(7.0);
        assert_eq!(
            gated(Activation::Silu, l, 10.0, 1.0),
            Activation::Silu.apply(7.0)
        );
        assert_eq!(
            gated(Activation::Silu, l, -10.0, 1.0),
            Activation::Silu.apply(-10.0)
        );
        assert_eq!(
            gated(Activation::Silu, l, 1.0, -9.0),
            Activation::Silu.apply(1.0) * -7.0
        );
    }

    #[test]
    fn int8_rows_round_trip_with_group_sums() {
        let mut buf = ActBuf::default();
        let kind = ActKind::I8 { group: 32 };
        buf.reserve(kind, 2, 64);
        let src: Vec<f32> = (0..50).map(|i| (i as f32 - 20.0) / 7.0).collect();
        let w = buf.writer(kind, 64);
        unsafe { w.write_row(1, &src) };
        let rows = [1u32];
        let v = buf.view(kind, 64, &rows);
        for (i, &x) in src.iter().enumerate() {
            assert!((act_value(&v, 0, i) - x).abs() <= v.scale[2 + i / 32] / 2.0 + 1e-6);
        }
        assert_eq!(act_value(&v, 0, 60), 0.0);
        let s0: i32 = v.q[64..96].iter().map(|&q| q as i32).sum();
        assert_eq!(v.gsum[2], s0);
    }
}
