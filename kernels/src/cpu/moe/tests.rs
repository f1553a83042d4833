//! Every tier on this CPU against references: kernels against their scalar twins (same inputs), whole
//! forward passes against a naive f32 evaluation on the dequantized weights, quantized formats against
//! the bf16 result (error reported and bounded).

use std::time::Duration;

use super::act::{act_value, ActBuf, ActKind};
use super::gemm::{act_kind, fp8_widens, gemm};
use super::kern_generic::{gemm_i8_twin, gemm_scalar};
use super::pack::{pack_matrix, MatLayout, MatRef};
use super::*;
use crate::cpu::features::CpuTier;

/// Small deterministic generator (xorshift64*), normal-ish values from a sum of uniforms.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        (0..4).map(|_| self.unit()).sum::<f32>() - 2.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn rel_l2(got: &[f32], want: &[f32]) -> f32 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt() as f32
}

const FORMATS: [WeightFormat; 11] = [
    WeightFormat::Bf16,
    WeightFormat::F16,
    WeightFormat::Fp8Block,
    WeightFormat::Int8,
    WeightFormat::Int4 { group: 32 },
    WeightFormat::Int4 { group: 64 },
    WeightFormat::Int4 { group: 128 },
    WeightFormat::Int4Min { group: 32 },
    WeightFormat::Int8Group { group: 32 },
    WeightFormat::Int8Group { group: 16 },
    WeightFormat::Int8Min { group: 32 },
];

/// Random source tensor in the natural source dtype of `fmt` (FP8 bytes for Fp8Block, bf16 otherwise).
struct Src {
    bf16: Vec<u16>,
    fp8: Vec<u8>,
    scales: Vec<f32>,
}
impl Src {
    fn new(rng: &mut Rng, fmt: WeightFormat, rows: usize, cols: usize, amp: f32) -> Src {
        if fmt == WeightFormat::Fp8Block {
            let fp8 = (0..rows * cols)
                .map(|_| {
                    let b = rng.below(256) as u8;
                    if b & 0x7F == 0x7F {
                        0x3F
                    } else {
                        b
                    } // no NaN codes
                })
                .collect();
            let scales = (0..rows.div_ceil(128) * cols.div_ceil(128))
                .map(|_| amp * (0.002 + 0.004 * rng.unit()))
                .collect();
            Src {
                bf16: vec![],
                fp8,
                scales,
            }
        } else {
            let bf16 = (0..rows * cols)
                .map(|_| f32_to_bf16(rng.normal() * amp))
                .collect();
            Src {
                bf16,
                fp8: vec![],
                scales: vec![],
            }
        }
    }
    fn tensor(&self) -> SourceTensor<'_> {
        if self.fp8.is_empty() {
            SourceTensor::Bf16(&self.bf16)
        } else {
            SourceTensor::Fp8E4M3 {
                data: &self.fp8,
                scale_inv: &self.scales,
            }
        }
    }
}

/// A random `[n, k]` matrix of `fmt` (source as [`Src::new`] with amplitude 0.05), packed.
fn packed(rng: &mut Rng, fmt: WeightFormat, n: usize, k: usize) -> (MatLayout, Vec<u8>, Vec<f32>) {
    let src = Src::new(rng, fmt, n, k, 0.05);
    let l = MatLayout::new(fmt, n, k);
    let (mut w, mut s) = (vec![0u8; l.w_bytes], vec![0f32; l.s_len]);
    pack_matrix(&l, &src.tensor(), &mut w, &mut s);
    (l, w, s)
}

/// `rows` activation rows of `kind` from standard normal values (`k` of `k_pad` per row).
fn random_rows(rng: &mut Rng, kind: ActKind, rows: usize, k: usize, k_pad: usize) -> ActBuf {
    let mut buf = ActBuf::default();
    buf.reserve(kind, rows, k_pad);
    let wr = buf.writer(kind, k_pad);
    for r in 0..rows {
        let x: Vec<f32> = (0..k).map(|_| rng.normal()).collect();
        // SAFETY: row r is reserved and written by this thread only.
        unsafe { wr.write_row(r, &x) };
    }
    buf
}

#[test]
fn kernels_match_their_scalar_twins() {
    let mut rng = Rng(0x1234_5678);
    for fmt in FORMATS {
        for &(n, k) in &[(40usize, 256usize), (130, 384), (16, 128)] {
            let (l, w, s) = packed(&mut rng, fmt, n, k);
            let mat = MatRef { l, w: &w, s: &s };
            for tier in CpuTier::available() {
                let kind = act_kind(tier, fmt, l.k_pad);
                for m in [1usize, 3, 5, 17, 33] {
                    let total = 40;
                    let buf = random_rows(&mut rng, kind, total + 16, k, l.k_pad);
                    // Indexed rows for the SIMD paths; consecutive rows (padded storage) for AMX.
                    let amx = tier == CpuTier::Amx && m >= 16;
                    let rows: Vec<u32> = if amx {
                        (3..3 + m as u32).collect()
                    } else {
                        (0..m).map(|_| rng.below(total) as u32).collect()
                    };
                    let a = buf.view(kind, l.k_pad, &rows);
                    let (nt0, nts) = (l.n_tiles / 3, l.n_tiles - l.n_tiles / 3);
                    let ld = 16 * nts + 5;
                    let mut got = vec![0f32; m * ld];
                    let mut want = vec![0f32; m * ld];
                    gemm(tier, amx, &mat, nt0, nts, &a, &mut got, ld);
                    match kind {
                        ActKind::I8 { .. } => gemm_i8_twin(&mat, nt0, nts, &a, &mut want, ld),
                        _ => gemm_scalar(&mat, nt0, nts, &a, &mut want, ld),
                    }
                    // Independent check of the twin itself on a few entries.
                    let (r, j) = (m - 1, 16 * nts - 1);
                    let direct: f32 = (0..l.k_pad)
                        .map(|c| mat.weight(16 * nt0 + j, c) * act_value(&a, r, c))
                        .sum();
                    assert!(
                        (want[r * ld + j] - direct).abs() <= 1e-3 * (1.0 + direct.abs()),
                        "{fmt:?} twin"
                    );
                    let e = rel_l2(&got, &want);
                    // Widened FP8 and grouped int formats (many tokens; the grouped ones on AMX)
                    // round each scaled weight (and the grouped ones each activation) to bf16 once:
                    // ≤ 2⁻⁹ relative per value, 2e-3 measured (Int4Min on AMX).
                    let widened = (fmt == WeightFormat::Fp8Block
                        && tier >= CpuTier::Avx512
                        && fp8_widens(tier.clamp_to_cpu(), amx, m))
                        || (fmt.group().is_some() && amx);
                    let tol = if widened { 4e-3 } else { 2e-5 };
                    assert!(e < tol, "{fmt:?} {tier} m={m} n={n} k={k}: rel err {e}");
                }
            }
        }
    }
}

/// Naive f32 evaluation of the layer on the set's own dequantized weights.
fn reference(set: &CpuExpertSet, x: &[f32], ids: &[u32], wts: &[f32], k: usize) -> Vec<f32> {
    let (h, i) = (set.cfg.hidden, set.cfg.inter);
    let t = x.len() / h;
    let mut out = vec![0f32; t * h];
    for tk in 0..t {
        for j in 0..k {
            let Some(l) = set.local.get(ids[tk * k + j] as usize).copied().flatten() else {
                continue;
            };
            let [g, u, d] = set.mats(l as usize);
            let xr = &x[tk * h..(tk + 1) * h];
            let hid: Vec<f32> = (0..i)
                .map(|n| {
                    let gv: f32 = (0..h).map(|c| g.weight(n, c) * xr[c]).sum();
                    let uv: f32 = (0..h).map(|c| u.weight(n, c) * xr[c]).sum();
                    act::gated(set.cfg.activation, set.cfg.swiglu_limit, gv, uv)
                })
                .collect();
            for n in 0..h {
                let y: f32 = (0..i).map(|c| d.weight(n, c) * hid[c]).sum();
                out[tk * h + n] += wts[tk * k + j] * y;
            }
        }
    }
    out
}

struct Layer {
    ids: Vec<u32>,
    srcs: Vec<[Src; 3]>,
}
impl Layer {
    /// Experts `0..total` with every third missing (as if on the GPU).
    fn new(rng: &mut Rng, fmt: WeightFormat, total: u32, h: usize, i: usize) -> Layer {
        let ids: Vec<u32> = (0..total).filter(|e| e % 3 != 1).collect();
        let srcs = ids
            .iter()
            .map(|_| {
                [
                    Src::new(rng, fmt, i, h, 0.08),
                    Src::new(rng, fmt, i, h, 0.08),
                    Src::new(rng, fmt, h, i, 0.08),
                ]
            })
            .collect();
        Layer { ids, srcs }
    }
    fn sources(&self) -> Vec<ExpertSource<'_>> {
        self.srcs
            .iter()
            .map(|[g, u, d]| ExpertSource {
                gate: g.tensor(),
                up: u.tensor(),
                down: d.tensor(),
            })
            .collect()
    }
}

fn batch(
    rng: &mut Rng,
    t: usize,
    h: usize,
    k: usize,
    total: u32,
) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let x: Vec<f32> = (0..t * h).map(|_| rng.normal()).collect();
    let mut ids = Vec::new();
    for _ in 0..t {
        let mut chosen: Vec<u32> = Vec::new();
        while chosen.len() < k {
            let e = rng.below(total as usize) as u32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        ids.extend(chosen);
    }
    let wts = (0..t * k).map(|_| rng.unit()).collect();
    (x, ids, wts)
}

fn pool(groups: &[usize]) -> WorkerPool {
    let cpus: Vec<Vec<usize>> = groups.iter().map(|&n| vec![0; n]).collect();
    WorkerPool::new(&cpus, false, Duration::from_micros(200))
}

#[test]
fn forward_every_tier_matches_reference() {
    every_tier_against_reference(42, Activation::Silu, Some(3.0));
}

/// ReGLU (SmallThinker's experts): relu(gate) ⊙ up in every tier and weight format.
#[test]
fn reglu_every_tier_matches_reference() {
    every_tier_against_reference(43, Activation::Relu, None);
}

fn every_tier_against_reference(seed: u64, act: Activation, limit: Option<f32>) {
    let mut rng = Rng(seed);
    let pool = pool(&[3]);
    let (h, i, total) = (96, 80, 7u32);
    for fmt in FORMATS {
        let layer = Layer::new(&mut rng, fmt, total, h, i);
        let mut cfg = ExpertSetConfig::new(h, i, fmt).with_activation(act, limit);
        cfg.amx_min_tokens = 4;
        let mut set = CpuExpertSet::new(&cfg, &layer.ids, &layer.sources(), &pool).unwrap();
        for &(t, k) in &[(1usize, 2usize), (5, 3), (21, 4), (3, 1)] {
            let (x, ids, wts) = batch(&mut rng, t, h, k, total);
            let want = reference(&set, &x, &ids, &wts, k);
            for tier in CpuTier::available() {
                set.set_max_tier(tier);
                // forward adds into out: start from a small offset (its own f32 rounding, 2^-31
                // absolute, stays far below the f32 tiers' tolerance) and take it off again
                let offset = 1.0 / 128.0;
                let mut got = vec![offset; t * h];
                set.forward(&pool, &x, &ids, &wts, k, &mut got).unwrap();
                got.iter_mut().for_each(|v| *v -= offset);
                let e = rel_l2(&got, &want);
                // f32 tiers: rounding only; bf16 activations: bf16 rounding of x and of the
                // intermediate (2^-9 relative each); int8 activations: 1/254 of each row's range.
                let tol = match act_kind(tier, fmt, 64) {
                    ActKind::F32 => 2e-5,
                    ActKind::Bf16 => 6e-3,
                    ActKind::I8 { .. } => 2.5e-2,
                };
                assert!(
                    e < tol,
                    "{act:?} {fmt:?} {tier} T={t} k={k}: rel err {e} (tol {tol})"
                );
            }
        }
    }
}

#[test]
fn gelu_and_forced_scalar_tier() {
    let mut rng = Rng(7);
    let pool = pool(&[2]);
    let (h, i, total) = (64, 48, 4u32);
    let layer = Layer::new(&mut rng, WeightFormat::Bf16, total, h, i);
    let cfg = ExpertSetConfig::new(h, i, WeightFormat::Bf16)
        .with_activation(Activation::GeluTanh, None)
        .with_max_tier(Some(CpuTier::Scalar));
    let set = CpuExpertSet::new(&cfg, &layer.ids, &layer.sources(), &pool).unwrap();
    assert_eq!(set.tier(), CpuTier::Scalar);
    let (x, ids, wts) = batch(&mut rng, 6, h, 2, total);
    let want = reference(&set, &x, &ids, &wts, 2);
    let mut got = vec![0f32; 6 * h];
    set.forward(&pool, &x, &ids, &wts, 2, &mut got).unwrap();
    // Only the f32 path reaches this accuracy (bf16 activations give ~1e-3).
    assert!(rel_l2(&got, &want) < 1e-6);
}

#[test]
fn numa_groups_partition_experts_and_agree() {
    let mut rng = Rng(99);
    let (h, i, total) = (64, 64, 10u32);
    let layer = Layer::new(&mut rng, WeightFormat::Int8, total, h, i);
    let cfg = ExpertSetConfig::new(h, i, WeightFormat::Int8);
    let one = pool(&[2]);
    let two = pool(&[2, 1]);
    let a = CpuExpertSet::new(&cfg, &layer.ids, &layer.sources(), &one).unwrap();
    let b = CpuExpertSet::new(&cfg, &layer.ids, &layer.sources(), &two).unwrap();
    assert_eq!(b.page_kinds().len(), 2);
    assert_eq!(a.bytes(), b.bytes(), "partitioned, not replicated");
    let (x, ids, wts) = batch(&mut rng, 9, h, 3, total);
    let mut ya = vec![0f32; 9 * h];
    let mut yb = vec![0f32; 9 * h];
    a.forward(&one, &x, &ids, &wts, 3, &mut ya).unwrap();
    b.forward(&two, &x, &ids, &wts, 3, &mut yb).unwrap();
    assert!(rel_l2(&yb, &ya) < 1e-5);
    assert!(matches!(
        b.forward(&one, &x, &ids, &wts, 3, &mut yb),
        Err(MoeError::Pool { .. })
    ));
}

#[test]
fn quantized_formats_error_vs_bf16() {
    let mut rng = Rng(5);
    let pool = pool(&[2]);
    let (h, i, total, t, k) = (256, 128, 6u32, 8, 2);
    let layer = Layer::new(&mut rng, WeightFormat::Bf16, total, h, i);
    let (x, ids, wts) = batch(&mut rng, t, h, k, total);
    let run = |fmt| {
        let set = CpuExpertSet::new(
            &ExpertSetConfig::new(h, i, fmt),
            &layer.ids,
            &layer.sources(),
            &pool,
        )
        .unwrap();
        let mut y = vec![0f32; t * h];
        set.forward(&pool, &x, &ids, &wts, k, &mut y).unwrap();
        y
    };
    let base = run(WeightFormat::Bf16);
    // Bounds ~2x the errors of these schemes on Gaussian weights (int8 per channel ~1%,
    // Q4_0-style int4 ~10-12%, growing with the group size).
    for (fmt, bound) in [
        (WeightFormat::Int8, 0.03),
        (WeightFormat::Int4 { group: 32 }, 0.20),
        (WeightFormat::Int4 { group: 64 }, 0.22),
        (WeightFormat::Int4 { group: 128 }, 0.25),
    ] {
        let e = rel_l2(&run(fmt), &base);
        println!("{fmt:?}: relative L2 error vs bf16 = {e:.4}");
        assert!(e > 1e-4 && e < bound, "{fmt:?}: {e}");
    }
}

#[test]
fn fp8_matches_dequantized_source() {
    let mut rng = Rng(11);
    let pool = pool(&[2]);
    let (h, i, total) = (200, 136, 3u32); // not multiples of 128: partial scale blocks
    let layer = Layer::new(&mut rng, WeightFormat::Fp8Block, total, h, i);
    let set = CpuExpertSet::new(
        &ExpertSetConfig::new(h, i, WeightFormat::Fp8Block),
        &layer.ids,
        &layer.sources(),
        &pool,
    )
    .unwrap();
    // The reference from the source bytes, independent of packing.
    let deq = |s: &Src, rows: usize, cols: usize| -> Vec<f32> {
        (0..rows * cols)
            .map(|p| {
                fp8_e4m3_to_f32(s.fp8[p])
                    * s.scales[(p / cols / 128) * cols.div_ceil(128) + (p % cols) / 128]
            })
            .collect()
    };
    let (x, ids, wts) = batch(&mut rng, 4, h, 2, total);
    let mut want = vec![0f32; 4 * h];
    for tk in 0..4 {
        for j in 0..2 {
            let Some(e) = layer.ids.iter().position(|&g| g == ids[tk * 2 + j]) else {
                continue;
            };
            let [g, u, d] = &layer.srcs[e];
            let (g, u, d) = (deq(g, i, h), deq(u, i, h), deq(d, h, i));
            let xr = &x[tk * h..(tk + 1) * h];
            let hid: Vec<f32> = (0..i)
                .map(|n| {
                    let gv: f32 = (0..h).map(|c| g[n * h + c] * xr[c]).sum();
                    let uv: f32 = (0..h).map(|c| u[n * h + c] * xr[c]).sum();
                    Activation::Silu.apply(gv) * uv
                })
                .collect();
            for n in 0..h {
                want[tk * h + n] +=
                    wts[tk * 2 + j] * (0..i).map(|c| d[n * i + c] * hid[c]).sum::<f32>();
            }
        }
    }
    let mut got = vec![0f32; 4 * h];
    set.forward(&pool, &x, &ids, &wts, 2, &mut got).unwrap();
    let e = rel_l2(&got, &want);
    assert!(e < 6e-3, "fp8 rel err {e}");
}

#[test]
fn bad_inputs_are_errors() {
    let pool = pool(&[1]);
    let (h, i) = (32, 32);
    let g = vec![0u16; h * i];
    let src = ExpertSource {
        gate: SourceTensor::Bf16(&g),
        up: SourceTensor::Bf16(&g),
        down: SourceTensor::Bf16(&g),
    };
    let cfg = ExpertSetConfig::new(h, i, WeightFormat::Bf16);
    assert!(matches!(
        CpuExpertSet::new(&cfg, &[1, 1], &[src, src], &pool),
        Err(MoeError::Duplicate(1))
    ));
    assert!(matches!(
        CpuExpertSet::new(&cfg, &[1], &[src, src], &pool),
        Err(MoeError::Count { .. })
    ));
    let fp8 = ExpertSetConfig::new(h, i, WeightFormat::Fp8Block);
    assert!(matches!(
        CpuExpertSet::new(&fp8, &[0], &[src], &pool),
        Err(MoeError::Expert { id: 0, .. })
    ));
    let short = ExpertSource {
        down: SourceTensor::Bf16(&g[1..]),
        ..src
    };
    assert!(matches!(
        CpuExpertSet::new(&cfg, &[0], &[short], &pool),
        Err(MoeError::Expert { .. })
    ));
    let set = CpuExpertSet::new(&cfg, &[2], &[src], &pool).unwrap();
    assert!(set.holds(2) && !set.holds(0) && !set.holds(100));
    let mut out = vec![0f32; h];
    assert!(set
        .forward(&pool, &[0.0; 33], &[2], &[1.0], 1, &mut out)
        .is_err());
    assert!(set
        .forward(&pool, &[0.0; 32], &[2, 3], &[1.0], 1, &mut out)
        .is_err());
    // Experts absent from the set contribute nothing.
    set.forward(&pool, &[1.0; 32], &[7], &[1.0], 1, &mut out)
        .unwrap();
    assert!(out.iter().all(|&v| v == 0.0));
}

/// The grouped int → bf16 widening used for AMX, checked here through the AVX-512 bf16 kernel.
#[cfg(target_arch = "x86_64")]
#[test]
fn int_widening_matches_twin() {
    if CpuTier::Avx512.clamp_to_cpu() != CpuTier::Avx512 {
        return; // needs AVX-512 BF16; the AMX machine also runs it through `gemm` above
    }
    let mut rng = Rng(77);
    // the grouped int formats: the ones widened to bf16 for AMX
    for fmt in FORMATS.into_iter().filter(|f| f.group().is_some()) {
        let group = fmt.group().unwrap();
        let (n, k) = (48, 256);
        let (l, w, s) = packed(&mut rng, fmt, n, k);
        let mat = MatRef { l, w: &w, s: &s };
        let kind = ActKind::I8 { group };
        let buf = random_rows(&mut rng, kind, 30, k, l.k_pad);
        let rows: Vec<u32> = vec![4, 9, 2, 29, 0, 17, 3];
        let a = buf.view(kind, l.k_pad, &rows);
        let ld = 16 * 3;
        let (mut got, mut want) = (vec![0f32; rows.len() * ld], vec![0f32; rows.len() * ld]);
        unsafe { super::gemm::int_widened(CpuTier::Avx512, false, &mat, 0, 3, &a, &mut got, ld) };
        gemm_i8_twin(&mat, 0, 3, &a, &mut want, ld);
        let e = rel_l2(&got, &want);
        assert!(e > 0.0 && e < 4e-3, "{fmt:?}: rel err {e}");
    }
}

#[test]
fn engine_facing_types_are_thread_safe() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<CpuExpertSet>();
    send_sync::<WorkerPool>();
    send_sync::<ExpertSetConfig>();
}

/// What the GPU's layerwise prefill reads: each held expert's packed bytes (`packed_expert`, laid out
/// as `packed_geometry` says, inside `packed_regions`) unpack (`unpack_bf16`) to the checkpoint's
/// weights: bf16 bit for bit, FP8 as value × block scale rounded to bf16 bit for bit, int8 within its
/// quantization error (rel-L2 ≤ 2e-2); shapes that are not multiples of any tile.
#[test]
fn packed_experts_unpack_to_their_source_weights() {
    let mut rng = Rng(7);
    let pool = pool(&[2]);
    let (h, i, total) = (200, 144, 4u32);
    for fmt in [
        WeightFormat::Bf16,
        WeightFormat::Fp8Block,
        WeightFormat::Int8,
    ] {
        let layer = Layer::new(&mut rng, fmt, total, h, i);
        let cfg = ExpertSetConfig::new(h, i, fmt);
        let set = CpuExpertSet::new(&cfg, &layer.ids, &layer.sources(), &pool).unwrap();
        let g = set.packed_geometry();
        assert!(g.gpu_format_code().is_some());
        assert_eq!(g.expert_bytes, set.bytes_per_expert());
        let regions: usize = set.packed_regions().iter().map(|r| r.len()).sum();
        assert_eq!(regions, layer.ids.len() * g.expert_bytes);
        for (&id, srcs) in layer.ids.iter().zip(&layer.srcs) {
            let dense = unpack_bf16(&g, set.packed_expert(id).unwrap());
            // the source, in the same [gate; up; down] order, as bf16 bits
            let mut want = Vec::with_capacity(dense.len());
            for (src, cols) in srcs.iter().zip([h, h, i]) {
                want.extend_from_slice(&src.bf16);
                for (j, &b) in src.fp8.iter().enumerate() {
                    let (n, k) = (j / cols, j % cols);
                    let s = src.scales[(n / 128) * cols.div_ceil(128) + k / 128];
                    want.push(f32_to_bf16(fp8_e4m3_to_f32(b) * s));
                }
            }
            if fmt == WeightFormat::Int8 {
                let (got, want): (Vec<f32>, Vec<f32>) = dense
                    .iter()
                    .zip(&want)
                    .map(|(&a, &b)| (bf16_to_f32(a), bf16_to_f32(b)))
                    .unzip();
                let err = rel_l2(&got, &want);
                assert!(err <= 2e-2, "int8 expert {id}: rel-L2 {err}");
            } else {
                assert!(
                    dense == want,
                    "{fmt:?} expert {id}: unpacked weights differ"
                );
            }
            let (gate_up, down) = set.export_bf16(id).unwrap();
            assert_eq!([gate_up, down].concat(), dense, "export_bf16 expert {id}");
        }
        assert!(set.packed_expert(1).is_none(), "expert 1 is not held");
    }
    let int4 = ExpertSetConfig::new(h, i, WeightFormat::Int4 { group: 32 });
    let layer = Layer::new(&mut rng, int4.format, 2, h, i);
    let set = CpuExpertSet::new(&int4, &layer.ids, &layer.sources(), &pool).unwrap();
    assert_eq!(set.packed_geometry().gpu_format_code(), None);
}

/// The two FP8 decoders of the AVX-512 tier (VBMI byte tables, 16-bit table), called directly so both
/// run whichever one `gemm` picks here: the few-token kernel on 1 to 17 rows (blocks of up to 8, with
/// two or one accumulator chains per row) against the scalar twin (rel-L2 ≤ 2e-5, f32 sums in another
/// order), and the widening to scaled bf16 tiles identical bit for bit across decoders and equal to
/// `weight(n, k)` rounded to bf16.
#[test]
fn fp8_decoders_match_the_twin() {
    use super::kern_fp8;
    if CpuTier::Avx512.clamp_to_cpu() < CpuTier::Avx512 {
        return;
    }
    let mut rng = Rng(0xF8);
    let fmt = WeightFormat::Fp8Block;
    for &(n, k) in &[(40usize, 256usize), (144, 416)] {
        let (l, w, s) = packed(&mut rng, fmt, n, k);
        let mat = MatRef { l, w: &w, s: &s };
        let kind = ActKind::Bf16;
        let buf = random_rows(&mut rng, kind, 8, k, l.k_pad);
        let (nt0, nts) = (1, l.n_tiles - 1);
        let ld = 16 * nts + 3;
        for m in 1..=17usize {
            let rows: Vec<u32> = (0..m).map(|_| rng.below(8) as u32).collect();
            let a = buf.view(kind, l.k_pad, &rows);
            let mut want = vec![0f32; m * ld];
            gemm_scalar(&mat, nt0, nts, &a, &mut want, ld);
            let mut got = vec![0f32; m * ld];
            unsafe { kern_fp8::gemm_fp8_lut16(&mat, nt0, nts, &a, got.as_mut_ptr(), ld) };
            let e = rel_l2(&got, &want);
            assert!(e < 2e-5, "16-bit table m={m} n={n} k={k}: rel err {e}");
            if kern_fp8::has_vbmi() {
                let mut got = vec![0f32; m * ld];
                unsafe { kern_fp8::gemm_fp8_vbmi(&mat, nt0, nts, &a, got.as_mut_ptr(), ld) };
                let e = rel_l2(&got, &want);
                assert!(e < 2e-5, "VBMI m={m} n={n} k={k}: rel err {e}");
            }
        }
        let mut wide = vec![0u16; nts * l.k_pad * 16];
        unsafe { kern_fp8::fp8_to_bf16_tiles_lut16(&mat, nt0, nts, &mut wide) };
        for t in 0..nts {
            for kk in 0..l.k_pad / 2 {
                for j in 0..16 {
                    for q in 0..2 {
                        let (row, col) = (16 * (nt0 + t) + j, 2 * kk + q);
                        let at = t * l.k_pad * 16 + kk * 32 + 2 * j + q;
                        assert_eq!(
                            wide[at],
                            f32_to_bf16(mat.weight(row, col)),
                            "W[{row}][{col}]"
                        );
                    }
                }
            }
        }
        if kern_fp8::has_vbmi() {
            let mut wide_vbmi = vec![0u16; nts * l.k_pad * 16];
            unsafe { kern_fp8::fp8_to_bf16_tiles_vbmi(&mat, nt0, nts, &mut wide_vbmi) };
            assert!(wide_vbmi == wide, "widened tiles differ between decoders");
        }
    }
}
