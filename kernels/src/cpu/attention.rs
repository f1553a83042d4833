//! The inner step of CPU attention, flash style: one tile of up to [`TILE`] cached positions against
//! the query heads that share one KV head, folded into each head's running softmax state
//! (max, sum, accumulator). K and V are read where the paged cache keeps them, as stored (f32, f16
//! or bf16 rows `stride` apart): each row is widened in registers, once for all the group's heads,
//! and never copied.
//!
//! Where the time goes (AVX-512): per position and head `head_dim / 16` FMAs for the score and as
//! many for the value sum; the 16 partial vectors of a head's scores are summed across lanes in one
//! transpose-add tree (15 steps for 16 scores instead of a horizontal sum per score), and the softmax
//! weights of a tile are computed 16 at a time. A step of a small model (SmolLM2: 3 heads of 64 per
//! KV head, ~100 positions) spent more in per-tile copies, calls and horizontal sums than in FMAs.

use super::features::{detected_tier, CpuTier};
use super::moe::act::exp_fast;

/// Positions per tile (one KV block of the daemon's paged cache).
pub const TILE: usize = 16;

/// Most query heads per KV head the SIMD kernel takes (more run on the scalar twin).
const MAX_GROUP: usize = 16;

/// Cached K or V rows as stored: row `i` of the tile starts at element `i · stride`.
#[derive(Clone, Copy, Debug)]
pub enum KvRows<'a> {
    F32(&'a [f32]),
    /// IEEE f16 bits.
    F16(&'a [u16]),
    /// bf16 bits.
    Bf16(&'a [u16]),
}

impl<'a> KvRows<'a> {
    /// The rows from element `off` on.
    pub fn from(self, off: usize) -> KvRows<'a> {
        match self {
            KvRows::F32(v) => KvRows::F32(&v[off..]),
            KvRows::F16(v) => KvRows::F16(&v[off..]),
            KvRows::Bf16(v) => KvRows::Bf16(&v[off..]),
        }
    }

    fn len(&self) -> usize {
        match self {
            KvRows::F32(v) => v.len(),
            KvRows::F16(v) | KvRows::Bf16(v) => v.len(),
        }
    }

    fn get(&self, i: usize) -> f32 {
        match self {
            KvRows::F32(v) => v[i],
            KvRows::F16(v) => half::f16::from_bits(v[i]).to_f32(),
            KvRows::Bf16(v) => f32::from_bits((v[i] as u32) << 16),
        }
    }
}

/// One tile: `n` positions (1 ..= [`TILE`]) of `head_dim` values, rows `stride` elements apart.
#[derive(Clone, Copy, Debug)]
pub struct Tile<'a> {
    pub k: KvRows<'a>,
    pub v: KvRows<'a>,
    pub n: usize,
    pub stride: usize,
}

/// Folds `tile` into the softmax state of the `q.len() / head_dim` query heads of one KV head.
/// `q`: the heads' query rows, already multiplied by the softmax scale. `state`: per head
/// `head_dim + 2` values, `[max, sum, acc…]` (start: `[-inf, 0, 0…]`); the head's output is
/// `acc / sum` once every tile is folded in.
pub fn attend_tile(q: &[f32], head_dim: usize, tile: Tile<'_>, state: &mut [f32]) {
    let group = q.len() / head_dim;
    let Tile { k, v, n, stride } = tile;
    assert!((1..=TILE).contains(&n) && head_dim <= stride);
    assert_eq!(q.len(), group * head_dim);
    assert_eq!(state.len(), group * (head_dim + 2));
    let need = (n - 1) * stride + head_dim;
    assert!(
        k.len() >= need && v.len() >= need,
        "tile rows out of bounds"
    );
    #[cfg(target_arch = "x86_64")]
    if detected_tier() >= CpuTier::Avx512 && head_dim.is_multiple_of(16) && group <= MAX_GROUP {
        // SAFETY: the tier was detected on this CPU; shapes and bounds checked above.
        unsafe {
            match (k, v) {
                (KvRows::F32(k), KvRows::F32(v)) => {
                    return simd::tile::<simd::F32>(q, head_dim, (k, v, n, stride), state)
                }
                (KvRows::F16(k), KvRows::F16(v)) => {
                    return simd::tile::<simd::F16>(q, head_dim, (k, v, n, stride), state)
                }
                (KvRows::Bf16(k), KvRows::Bf16(v)) => {
                    return simd::tile::<simd::Bf16>(q, head_dim, (k, v, n, stride), state)
                }
                _ => {}
            }
        }
    }
    attend_tile_twin(q, head_dim, tile, state)
}

/// Asks the caches for a tile's K and V rows ahead of [`attend_tile`] (the next tile of a scattered
/// block table while the current one is computed): hints only, nothing is read. Without it, the
/// first use of each row of a tile waited for it: a step's attention over a small model's short
/// contexts spent most of its time there.
pub fn prefetch_tile(head_dim: usize, tile: Tile<'_>) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let (bytes, k, v): (usize, *const u8, *const u8) = match (tile.k, tile.v) {
            (KvRows::F32(k), KvRows::F32(v)) => (4, k.as_ptr().cast(), v.as_ptr().cast()),
            (KvRows::F16(k) | KvRows::Bf16(k), KvRows::F16(v) | KvRows::Bf16(v)) => {
                (2, k.as_ptr().cast(), v.as_ptr().cast())
            }
            _ => return,
        };
        for i in 0..tile.n.min(TILE) {
            let mut off = 0;
            while off < head_dim * bytes {
                let at = (i * tile.stride) * bytes + off;
                // SAFETY: a prefetch never faults; the addresses are only computed (wrapping).
                unsafe {
                    _mm_prefetch::<_MM_HINT_T0>(k.wrapping_add(at).cast());
                    _mm_prefetch::<_MM_HINT_T0>(v.wrapping_add(at).cast());
                }
                off += 64;
            }
        }
    }
}

/// The scalar twin of [`attend_tile`]'s SIMD kernel: the same steps in f32, one value at a time.
pub(crate) fn attend_tile_twin(q: &[f32], hd: usize, tile: Tile<'_>, state: &mut [f32]) {
    let Tile { k, v, n, stride } = tile;
    for (j, qj) in q.chunks_exact(hd).enumerate() {
        let st = &mut state[j * (hd + 2)..(j + 1) * (hd + 2)];
        let mut w = [0f32; TILE];
        for (i, s) in w.iter_mut().enumerate().take(n) {
            *s = (0..hd).map(|d| qj[d] * k.get(i * stride + d)).sum();
        }
        let m = w[..n].iter().copied().fold(st[0], f32::max);
        let c = rescale(st[0], m);
        let mut sum = 0.0;
        for s in w.iter_mut().take(n) {
            *s = exp_fast(*s - m);
            sum += *s;
        }
        st[0] = m;
        st[1] = st[1] * c + sum;
        for d in 0..hd {
            let add: f32 = (0..n).map(|i| w[i] * v.get(i * stride + d)).sum();
            st[2 + d] = st[2 + d] * c + add;
        }
    }
}

/// The factor a head's sum and accumulator are scaled by when its max moves from `old` to `new`
/// (0 before the first tile: the state is empty). The one rescale step of every online softmax here
/// and in its callers ([`OnlineSoftmax`], the merge of split ranges).
#[inline(always)]
pub fn rescale(old: f32, new: f32) -> f32 {
    if old == f32::NEG_INFINITY {
        0.0
    } else {
        exp_fast(old - new)
    }
}

/// Online softmax over a stream of scores, one at a time (no score row): `push(s)` returns the factor
/// the accumulator must be scaled by before adding `weight · value` for this score. For callers that
/// walk positions one by one (MLA's latent rows); tiles of GQA go through [`attend_tile`].
#[derive(Clone, Copy, Debug)]
pub struct OnlineSoftmax {
    pub max: f32,
    pub sum: f32,
}

impl Default for OnlineSoftmax {
    fn default() -> Self {
        Self {
            max: f32::NEG_INFINITY,
            sum: 0.0,
        }
    }
}

impl OnlineSoftmax {
    /// `(rescale, weight)` for score `s`.
    #[inline]
    pub fn push(&mut self, s: f32) -> (f32, f32) {
        let m = self.max.max(s);
        let c = rescale(self.max, m);
        let w = exp_fast(s - m);
        self.max = m;
        self.sum = self.sum * c + w;
        (c, w)
    }

    /// Folds another state's `(max, sum)` over other positions into this one: returns the factors
    /// this state's accumulator and the other's are scaled by before they are added.
    #[inline]
    pub fn merge(&mut self, other: OnlineSoftmax) -> (f32, f32) {
        let m = self.max.max(other.max);
        let (c_self, c_other) = (rescale(self.max, m), rescale(other.max, m));
        self.max = m;
        self.sum = self.sum * c_self + other.sum * c_other;
        (c_self, c_other)
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{rescale, MAX_GROUP, TILE};
    use std::arch::x86_64::*;

    /// How one stored element type widens 16 values to f32 lanes.
    pub(super) trait Elem {
        type T: Copy;
        /// # Safety
        /// 16 values from `p` are readable; AVX-512F present.
        unsafe fn load16(p: *const Self::T) -> __m512;
    }

    pub(super) struct F32;
    pub(super) struct F16;
    pub(super) struct Bf16;

    impl Elem for F32 {
        type T = f32;
        #[inline(always)]
        unsafe fn load16(p: *const f32) -> __m512 {
            // SAFETY: (caller).
            unsafe { _mm512_loadu_ps(p) }
        }
    }
    impl Elem for F16 {
        type T = u16;
        #[inline(always)]
        unsafe fn load16(p: *const u16) -> __m512 {
            // SAFETY: (caller).
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
        }
    }
    impl Elem for Bf16 {
        type T = u16;
        #[inline(always)]
        unsafe fn load16(p: *const u16) -> __m512 {
            // SAFETY: (caller).
            unsafe {
                let h = _mm256_loadu_si256(p.cast());
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
        }
    }

    /// Lane indices of the four levels of [`sum_lanes16`], (low half, high half) of each: level L
    /// pairs two vectors that hold `16 / 2^(L-1)` partial lanes per position and keeps, per position,
    /// the first half of its lanes in one permute and the second half in the other.
    const fn level(width: i32) -> ([i32; 16], [i32; 16]) {
        // `width`: partial lanes per position after this level
        let (mut lo, mut hi) = ([0; 16], [0; 16]);
        let mut l = 0;
        while l < 16 {
            let li = l as i32;
            lo[l] = li % width + 2 * width * (li / width);
            hi[l] = lo[l] + width;
            l += 1;
        }
        (lo, hi)
    }
    const LEVELS: [([i32; 16], [i32; 16]); 4] = [level(8), level(4), level(2), level(1)];

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn add_halves(a: __m512, b: __m512, (lo, hi): &([i32; 16], [i32; 16])) -> __m512 {
        // SAFETY: 64 bytes read from each 16-lane index array.
        unsafe {
            let lo = _mm512_loadu_si512(lo.as_ptr().cast());
            let hi = _mm512_loadu_si512(hi.as_ptr().cast());
            _mm512_add_ps(
                _mm512_permutex2var_ps(a, lo, b),
                _mm512_permutex2var_ps(a, hi, b),
            )
        }
    }

    /// `r[i] = Σ_lanes v[i]`: sixteen vectors summed across their lanes into one by a transpose-add
    /// tree (8 + 4 + 2 + 1 outputs of two permutes and an add each) instead of 16 horizontal sums.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn sum_lanes16(v: &[__m512; 16]) -> __m512 {
        // SAFETY: AVX-512F (this function's feature).
        unsafe {
            let mut c = [_mm512_setzero_ps(); 8];
            for p in 0..8 {
                c[p] = add_halves(v[2 * p], v[2 * p + 1], &LEVELS[0]);
            }
            let mut e = [_mm512_setzero_ps(); 4];
            for p in 0..4 {
                e[p] = add_halves(c[2 * p], c[2 * p + 1], &LEVELS[1]);
            }
            let g0 = add_halves(e[0], e[1], &LEVELS[2]);
            let g1 = add_halves(e[2], e[3], &LEVELS[2]);
            add_halves(g0, g1, &LEVELS[3])
        }
    }

    /// `exp_fast` in 16 lanes (the same steps, the polynomial with fused multiply-adds).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn exp16(x: __m512) -> __m512 {
        let t = _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E));
        let t = _mm512_min_ps(
            _mm512_max_ps(t, _mm512_set1_ps(-126.0)),
            _mm512_set1_ps(126.0),
        );
        let round = _mm512_set1_ps(12_582_912.0);
        let n = _mm512_sub_ps(_mm512_add_ps(t, round), round);
        let f = _mm512_sub_ps(t, n);
        let mut p = _mm512_set1_ps(0.000_154_035_3);
        for c in [
            0.001_333_355,
            0.009_618_129,
            0.055_504_11,
            0.240_226_5,
            std::f32::consts::LN_2,
            1.0,
        ] {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
        }
        let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        _mm512_mul_ps(p, _mm512_castsi512_ps(bits))
    }

    /// The 16 partial score vectors of each head (`pp[j · TILE + i]`, row `i` of the tile against
    /// head `j`) for a head size of `CH` × 16: each K row widened once into registers for every
    /// head of the group (widening it per head cost a third of a small model's attention).
    ///
    /// # Safety
    /// As [`tile`]; `hd = 16 · CH`; `pp` holds `group · TILE` vectors.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn scores<E: Elem, const CH: usize>(
        qp: *const f32,
        kp: *const E::T,
        (n, stride): (usize, usize),
        group: usize,
        pp: *mut __m512,
    ) {
        // SAFETY: (caller) rows below `n` in bounds, q holds `group · 16 · CH` values.
        unsafe {
            for i in 0..n {
                let row = kp.add(i * stride);
                let mut k = [_mm512_setzero_ps(); CH];
                for (c, kc) in k.iter_mut().enumerate() {
                    *kc = E::load16(row.add(16 * c));
                }
                for j in 0..group {
                    let qj = qp.add(j * 16 * CH);
                    let mut acc = _mm512_mul_ps(_mm512_loadu_ps(qj), k[0]);
                    for (c, kc) in k.iter().enumerate().skip(1) {
                        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qj.add(16 * c)), *kc, acc);
                    }
                    pp.add(j * TILE + i).write(acc);
                }
            }
        }
    }

    /// [`super::attend_tile`] on AVX-512.
    ///
    /// # Safety
    /// AVX-512F/BW/VL present; `hd % 16 == 0`, `q.len() = group · hd` with `group ≤ MAX_GROUP`,
    /// `state.len() = group · (hd + 2)`; `k` and `v` hold `(n − 1) · stride + hd` values, `1 ≤ n ≤ 16`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn tile<E: Elem>(
        q: &[f32],
        hd: usize,
        (k, v, n, stride): (&[E::T], &[E::T], usize, usize),
        state: &mut [f32],
    ) {
        let group = q.len() / hd;
        let chunks = hd / 16;
        let (qp, kp, vp) = (q.as_ptr(), k.as_ptr(), v.as_ptr());
        // Scores: per head, 16 partial vectors (zero past `n`), summed across lanes per head.
        // Only the group's heads are written: a zeroed `[[__m512; 16]; 16]` was a 16 KiB memset
        // per tile, more than a small group's FMAs.
        let mut part = std::mem::MaybeUninit::<[[__m512; TILE]; MAX_GROUP]>::uninit();
        let pp = part.as_mut_ptr().cast::<__m512>();
        // SAFETY: every row read is below `n` (caller: in bounds); q and state by their lengths;
        // `part` rows `j < group` are written in full (lanes `n..` zeroed) before they are read.
        unsafe {
            for j in 0..group {
                for i in n..TILE {
                    pp.add(j * TILE + i).write(_mm512_setzero_ps());
                }
            }
            match chunks {
                4 => scores::<E, 4>(qp, kp, (n, stride), group, pp),
                8 => scores::<E, 8>(qp, kp, (n, stride), group, pp),
                _ => {
                    for i in 0..n {
                        let row = kp.add(i * stride);
                        for j in 0..group {
                            let qj = qp.add(j * hd);
                            let mut acc = _mm512_mul_ps(_mm512_loadu_ps(qj), E::load16(row));
                            for c in 1..chunks {
                                acc = _mm512_fmadd_ps(
                                    _mm512_loadu_ps(qj.add(16 * c)),
                                    E::load16(row.add(16 * c)),
                                    acc,
                                );
                            }
                            pp.add(j * TILE + i).write(acc);
                        }
                    }
                }
            }
            // Softmax weights of the tile per head, and the factor its old state is scaled by.
            let mut w = [[0f32; TILE]; MAX_GROUP];
            let mut scale = [0f32; MAX_GROUP];
            for j in 0..group {
                let st = state.as_mut_ptr().add(j * (hd + 2));
                let s = sum_lanes16(&*pp.add(j * TILE).cast::<[__m512; TILE]>());
                let valid = ((1u32 << n) - 1) as u16;
                let tile_max = _mm512_mask_reduce_max_ps(valid, s);
                let m = (*st).max(tile_max);
                let c = rescale(*st, m);
                let e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m))));
                _mm512_storeu_ps(w[j].as_mut_ptr(), e);
                let sum = _mm512_reduce_add_ps(e);
                *st = m;
                *st.add(1) = *st.add(1) * c + sum;
                scale[j] = c;
            }
            // Values: per 16 columns, the group's accumulators (rescaled) plus each row's weighted
            // value, the row widened once for every head.
            // (The accumulators start from the rescaled state, `group` of them: no zeroed array.)
            let mut acc = std::mem::MaybeUninit::<[__m512; MAX_GROUP]>::uninit();
            let ap = acc.as_mut_ptr().cast::<__m512>();
            for c in 0..chunks {
                for j in 0..group {
                    let at = state.as_ptr().add(j * (hd + 2) + 2 + 16 * c);
                    ap.add(j)
                        .write(_mm512_mul_ps(_mm512_loadu_ps(at), _mm512_set1_ps(scale[j])));
                }
                for i in 0..n {
                    let x = E::load16(vp.add(i * stride + 16 * c));
                    for j in 0..group {
                        let a = ap.add(j);
                        a.write(_mm512_fmadd_ps(_mm512_set1_ps(w[j][i]), x, a.read()));
                    }
                }
                for j in 0..group {
                    let out = state.as_mut_ptr().add(j * (hd + 2) + 2 + 16 * c);
                    _mm512_storeu_ps(out, ap.add(j).read());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    /// The kernel this CPU runs against the scalar twin, over several tiles folded in turn (the
    /// rescaling of an existing state included), for every stored type, tile lengths 1..=16, group
    /// sizes 1, 3 and 8 and head sizes 64 and 128: equal to 2e-5 relative (summation order only;
    /// a wrong row, lane or rescale is off by O(1)).
    /// On a CPU without AVX-512 both sides are the twin.
    #[test]
    fn simd_tile_matches_its_twin() {
        for (group, hd) in [(1, 64), (3, 64), (8, 128)] {
            let stride = 3 * hd; // rows of 3 KV heads, this one in the middle
            for n in 1..=TILE {
                let rows = 3 * TILE;
                let kf = values(rows * stride, 7 * n as u32 + group as u32);
                let vf = values(rows * stride, 11 * n as u32 + hd as u32);
                let q: Vec<f32> = values(group * hd, n as u32)
                    .iter()
                    .map(|x| x * 3.0)
                    .collect();
                let k16: Vec<u16> = kf
                    .iter()
                    .map(|&x| half::f16::from_f32(x).to_bits())
                    .collect();
                let v16: Vec<u16> = vf
                    .iter()
                    .map(|&x| half::f16::from_f32(x).to_bits())
                    .collect();
                let kb: Vec<u16> = kf
                    .iter()
                    .map(|&x| half::bf16::from_f32(x).to_bits())
                    .collect();
                let vb: Vec<u16> = vf
                    .iter()
                    .map(|&x| half::bf16::from_f32(x).to_bits())
                    .collect();
                let kinds: [(KvRows, KvRows); 3] = [
                    (KvRows::F32(&kf), KvRows::F32(&vf)),
                    (KvRows::F16(&k16), KvRows::F16(&v16)),
                    (KvRows::Bf16(&kb), KvRows::Bf16(&vb)),
                ];
                for ((k, v), kind) in kinds.into_iter().zip(["f32", "f16", "bf16"]) {
                    let mut init = vec![0f32; group * (hd + 2)];
                    init.chunks_mut(hd + 2)
                        .for_each(|s| s[0] = f32::NEG_INFINITY);
                    let (mut got, mut want) = (init.clone(), init);
                    for t in 0..3 {
                        let off = t * TILE * stride + hd;
                        let tl = Tile {
                            k: k.from(off),
                            v: v.from(off),
                            n,
                            stride,
                        };
                        attend_tile(&q, hd, tl, &mut got);
                        attend_tile_twin(&q, hd, tl, &mut want);
                    }
                    for (a, b) in got.iter().zip(&want) {
                        assert!(
                            (a - b).abs() <= 2e-5 * b.abs().max(1.0),
                            "group {group} hd {hd} n {n} {kind}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    /// Scores pushed one at a time, and two halves pushed apart then merged, against the two-pass
    /// softmax in f64: weights and sums to 1e-6 relative (`exp_fast` is good to ~2e-7). A wrong
    /// rescale (the first score, a new max, a merge) is off by O(1).
    #[test]
    fn online_softmax_matches_two_pass() {
        let s: Vec<f32> = values(40, 5).iter().map(|x| x * 6.0).collect();
        let v = values(40, 9);
        let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let e: Vec<f64> = s.iter().map(|&x| (x as f64 - m).exp()).collect();
        let want =
            e.iter().zip(&v).map(|(e, &v)| e * v as f64).sum::<f64>() / e.iter().sum::<f64>();
        let fold = |sc: &[f32], vs: &[f32]| {
            let (mut st, mut acc) = (OnlineSoftmax::default(), 0f32);
            for (&x, &y) in sc.iter().zip(vs) {
                let (c, w) = st.push(x);
                acc = acc * c + w * y;
            }
            (st, acc)
        };
        let (whole, acc) = fold(&s, &v);
        let (mut a, acc_a) = fold(&s[..17], &v[..17]);
        let (b, acc_b) = fold(&s[17..], &v[17..]);
        let (ca, cb) = a.merge(b);
        let merged = (acc_a * ca + acc_b * cb) / a.sum;
        for (got, what) in [(acc / whole.sum, "pushed"), (merged, "merged")] {
            let err = (got as f64 - want).abs() / want.abs().max(1e-3);
            assert!(err <= 1e-6, "{what}: {got} vs {want} ({err})");
        }
        assert_eq!(whole.max as f64, m);
        assert!(((a.sum - whole.sum) / whole.sum).abs() <= 1e-6);
    }
}
