//! Long-prefill fused attention (`flash_prefill`) on the device (part of `gpu_tests`, feature
//! `gpu-tests`).
//!
//! - Against the op layer's f64 host reference (`reference::causal_attention`, on the same bf16 Q, K
//!   and V) on shapes the engine never sees together: 1, 17, 128, 1000 and 4100 query rows; group
//!   sizes 1, 4, 7 (not a divisor of the 64-row tile) and 8; head dims 32, 64 and 128; a cached prefix
//!   (queries at positions p0.. over keys 0..p0 + rows, p0 not a multiple of the 64-key tile); a sliding
//!   window. Tolerance: rel-L2 ≤ 1e-2 per (query row, head): the kernel rounds Q and the
//!   probabilities to bf16 before its products (as the GEMM path does) and writes bf16, ~3e-3 expected.
//!   Rows outside the call's are left as they were.
//! - Against the GEMM path it replaces (strided-batched Q·Kᵀ, `causal_softmax_rows`, P·V), on the
//!   Qwen3-30B-A3B head shape (32 query heads over 4 KV heads of 128) for 8192 rows, same bound; the
//!   time of both per call is printed (one layer's attention of an 8192-token prompt).
use crate::common::rel_l2;
use half::bf16;
use moe_kernels::cuda::ops::{reference, FlashBlock, FlashShape, QueryRows};
use moe_kernels::cuda::GpuDevice;

/// One call's shape: (heads, kv_heads, head_dim), query rows, first query position, window.
struct Case {
    heads: (usize, usize, usize),
    rows: usize,
    pos0: usize,
    window: Option<usize>,
}

const fn case(heads: (usize, usize, usize), rows: usize, pos0: usize) -> Case {
    Case {
        heads,
        rows,
        pos0,
        window: None,
    }
}

/// Step rows before the call's (its `row0`) and after, which it must not write.
const ROW0: usize = 2;
const AFTER: usize = 1;

struct Inputs {
    /// f32 `[ROW0 + rows + AFTER, heads · dh]`, bf16-exact.
    q: Vec<f32>,
    /// bf16 `[keys, kv_heads · dh]`.
    k: Vec<bf16>,
    v: Vec<bf16>,
}

fn inputs(c: &Case, seed: u64) -> Inputs {
    let (heads, kv_heads, dh) = c.heads;
    let mut next = crate::xorshift(seed);
    let mut uniform = move || (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
    let keys = c.pos0 + c.rows;
    let width = heads * dh;
    // rows of different sharpness: scores of standard deviation ~1 to ~5
    let q = (0..(ROW0 + c.rows + AFTER) * width)
        .map(|i| bf16::from_f32(uniform() * 3.0 * (1 + (i / width) % 5) as f32).to_f32())
        .collect();
    let mut kv = |n| (0..n).map(|_| bf16::from_f32(uniform())).collect();
    Inputs {
        q,
        k: kv(keys * kv_heads * dh),
        v: kv(keys * kv_heads * dh),
    }
}

/// Query rows (of the call) the host reference is computed for: all of a short call, a spread of a
/// long one including both ends of the first tiles and the last rows.
fn checked_rows(rows: usize) -> Vec<usize> {
    if rows <= 256 {
        return (0..rows).collect();
    }
    let mut r: Vec<usize> = [0, 1, 7, 8, 9, 15, 16, 63, 64, 65, rows - 2, rows - 1].to_vec();
    r.extend((1..24).map(|i| i * rows / 24));
    r.sort_unstable();
    r.dedup();
    r
}

fn run_flash(dev: &GpuDevice, c: &Case, x: &Inputs, block: FlashBlock) -> Vec<bf16> {
    let s = &dev.stream;
    let (heads, kv_heads, dh) = c.heads;
    let (dq, dk, dv) = (
        s.clone_htod(&x.q).unwrap(),
        s.clone_htod(&x.k).unwrap(),
        s.clone_htod(&x.v).unwrap(),
    );
    let sentinel = vec![bf16::from_f32(7.0); x.q.len()];
    let mut out = s.clone_htod(&sentinel).unwrap();
    let at = QueryRows {
        row0: ROW0,
        rows: c.rows,
        pos0: c.pos0,
    };
    let shape = FlashShape {
        heads,
        kv_heads,
        head_dim: dh,
        scale: (dh as f32).powf(-0.5),
        window: c.window,
        block,
    };
    let kw = kv_heads * dh;
    dev.flash_prefill(&dq, at, (&dk, &dv), (kw, kw), shape, &mut out)
        .unwrap();
    s.clone_dtoh(&out).unwrap()
}

#[test]
fn flash_prefill_matches_host_reference() {
    let dev = GpuDevice::open(0).unwrap();
    let mut win = case((4, 1, 32), 200, 50);
    win.window = Some(37);
    let cases = [
        case((4, 4, 64), 1, 0),
        case((8, 2, 128), 17, 0),
        case((32, 4, 128), 128, 0),
        case((28, 4, 64), 1000, 0),
        case((32, 4, 128), 4100, 0),
        // cached prefixes: a long chunk after 3000 positions, short chunks after 300 and 511
        case((8, 2, 128), 1000, 3000),
        case((16, 2, 64), 17, 300),
        case((8, 8, 32), 1, 511),
        win,
    ];
    for (i, c) in cases.iter().enumerate() {
        let (heads, kv_heads, dh) = c.heads;
        let x = inputs(c, 11 + i as u64);
        let blocks = [FlashBlock::Warps4, FlashBlock::Warps8];
        let gots = blocks.map(|b| run_flash(&dev, c, &x, b));
        let width = heads * dh;
        let name = format!(
            "{heads}/{kv_heads} heads of {dh}, {} rows at {}, window {:?}",
            c.rows, c.pos0, c.window
        );
        // rows outside the call's keep the sentinel
        for (got, block) in gots.iter().zip(blocks) {
            for r in (0..ROW0).chain(ROW0 + c.rows..ROW0 + c.rows + AFTER) {
                assert!(
                    got[r * width..(r + 1) * width]
                        .iter()
                        .all(|v| v.to_f32() == 7.0),
                    "{name} {block:?}: step row {r} written"
                );
            }
        }
        let (k, v): (Vec<f32>, Vec<f32>) = (
            x.k.iter().map(|v| v.to_f32()).collect(),
            x.v.iter().map(|v| v.to_f32()).collect(),
        );
        let mut worst = 0f32;
        for r in checked_rows(c.rows) {
            let pos = c.pos0 + r;
            let q = &x.q[(ROW0 + r) * width..(ROW0 + r + 1) * width];
            let kv = (pos + 1) * kv_heads * dh;
            let want = reference::causal_attention(
                q,
                &k[..kv],
                &v[..kv],
                (1, pos),
                c.heads,
                (dh as f32).powf(-0.5),
                c.window,
            );
            for (got, block) in gots.iter().zip(blocks) {
                for h in 0..heads {
                    let g: Vec<f32> = got[(ROW0 + r) * width + h * dh..][..dh]
                        .iter()
                        .map(|v| v.to_f32())
                        .collect();
                    let err = rel_l2(&g, &want[h * dh..(h + 1) * dh]);
                    worst = worst.max(err);
                    assert!(
                        err <= 1e-2,
                        "{name} {block:?}: row {r} head {h}: rel-L2 {err}"
                    );
                }
            }
        }
        println!("flash_prefill {name}: worst rel-L2 vs host {worst:.2e}");
    }
}

/// The GEMM path of long-prefill attention (as the engine runs it with `MOE_FLASH_PREFILL=0`): per
/// block of query rows and KV head, `S = scale · Q Kᵀ` batched over the group, `causal_softmax_rows`,
/// `O = P V` into the heads' columns.
#[allow(clippy::too_many_arguments)]
fn gemm_path(
    dev: &GpuDevice,
    c: &Case,
    qb: &cudarc::driver::CudaSlice<bf16>,
    (kb, vb): (
        &cudarc::driver::CudaSlice<bf16>,
        &cudarc::driver::CudaSlice<bf16>,
    ),
    (scores, probs): (
        &mut cudarc::driver::CudaSlice<f32>,
        &mut cudarc::driver::CudaSlice<bf16>,
    ),
    block_rows: usize,
    out: &mut cudarc::driver::CudaSlice<bf16>,
) {
    let (nh, nkv, dh) = c.heads;
    let (hq, kw) = (nh / nkv, nkv * dh);
    let scale = (dh as f32).powf(-0.5);
    let (qa, ka, va) = (dev.addr(qb), dev.addr(kb), dev.addr(vb));
    let (sa, pa, oa) = (dev.addr(&*scores), dev.addr(&*probs), dev.addr(&*out));
    const B16: u64 = 2;
    let mut r0 = 0;
    while r0 < c.rows {
        let rows = block_rows.min(c.rows - r0);
        let lk = c.pos0 + r0 + rows;
        for g in 0..nkv {
            let h0 = g * hq;
            // SAFETY: the views lie inside q (rows × nh·dh), K/V (keys × kw), the score and probability
            // buffers (hq × block_rows × keys) and out (rows × nh·dh), all alive until the sync below.
            unsafe {
                dev.gemm_bf16_batched_raw(
                    true,
                    false,
                    (lk, rows, dh),
                    scale,
                    (ka + B16 * (g * dh) as u64, kw, 0),
                    (qa + B16 * ((r0 * nh + h0) * dh) as u64, nh * dh, dh),
                    (sa, lk, rows * lk),
                    hq,
                    false,
                )
                .unwrap();
            }
            dev.causal_softmax_rows(
                &*scores,
                (hq * rows, lk),
                rows,
                c.pos0 + r0,
                c.window,
                &mut *probs,
            )
            .unwrap();
            // SAFETY: as above.
            unsafe {
                dev.gemm_bf16_batched_raw(
                    false,
                    false,
                    (dh, rows, lk),
                    1.0,
                    (va + B16 * (g * dh) as u64, kw, 0),
                    (pa, lk, rows * lk),
                    (oa + B16 * ((r0 * nh + h0) * dh) as u64, nh * dh, dh),
                    hq,
                    true,
                )
                .unwrap();
            }
        }
        r0 += rows;
    }
}

#[test]
fn flash_prefill_matches_the_gemm_path_on_the_qwen3_shape() {
    let dev = GpuDevice::open(0).unwrap();
    let s = &dev.stream;
    let c = case((32, 4, 128), 8192, 0);
    let (nh, nkv, dh) = c.heads;
    let width = nh * dh;
    let x = inputs(&c, 99);
    // the call's rows only: q and out of `rows` rows
    let q = &x.q[ROW0 * width..(ROW0 + c.rows) * width];
    let (dq, dk, dv) = (
        s.clone_htod(q).unwrap(),
        s.clone_htod(&x.k).unwrap(),
        s.clone_htod(&x.v).unwrap(),
    );
    let mut qb = s.alloc_zeros::<bf16>(q.len()).unwrap();
    dev.f32_to_bf16(&dq, q.len(), &mut qb).unwrap();
    // the engine's query block: 512 MiB of scores and probabilities
    let block_rows = ((512usize << 20) / (nh / nkv * c.rows * 6)).min(c.rows);
    let n_sp = nh / nkv * block_rows * c.rows;
    let mut scores = s.alloc_zeros::<f32>(n_sp).unwrap();
    let mut probs = s.alloc_zeros::<bf16>(n_sp).unwrap();
    let (mut out_gemm, mut out_flash) = (
        s.alloc_zeros::<bf16>(q.len()).unwrap(),
        s.alloc_zeros::<bf16>(q.len()).unwrap(),
    );
    let at = QueryRows {
        row0: 0,
        rows: c.rows,
        pos0: 0,
    };
    let kw = nkv * dh;
    let time = |f: &mut dyn FnMut()| {
        f(); // warm: cuBLAS heuristics, module load
        s.synchronize().unwrap();
        let t = std::time::Instant::now();
        const REPS: u32 = 3;
        for _ in 0..REPS {
            f();
        }
        s.synchronize().unwrap();
        t.elapsed().as_secs_f64() * 1e3 / REPS as f64
    };
    let gemm_ms = time(&mut || {
        gemm_path(
            &dev,
            &c,
            &qb,
            (&dk, &dv),
            (&mut scores, &mut probs),
            block_rows,
            &mut out_gemm,
        )
    });
    let want = s.clone_dtoh(&out_gemm).unwrap();
    for block in [FlashBlock::Warps4, FlashBlock::Warps8] {
        let shape = FlashShape {
            heads: nh,
            kv_heads: nkv,
            head_dim: dh,
            scale: (dh as f32).powf(-0.5),
            window: None,
            block,
        };
        let flash_ms = time(&mut || {
            dev.flash_prefill(&dq, at, (&dk, &dv), (kw, kw), shape, &mut out_flash)
                .unwrap()
        });
        let got = s.clone_dtoh(&out_flash).unwrap();
        let mut worst = 0f32;
        for r in checked_rows(c.rows) {
            for h in 0..nh {
                let at = |o: &[bf16]| -> Vec<f32> {
                    o[r * width + h * dh..][..dh]
                        .iter()
                        .map(|v| v.to_f32())
                        .collect()
                };
                let err = rel_l2(&at(&got), &at(&want));
                worst = worst.max(err);
                assert!(
                    err <= 1e-2,
                    "{block:?} row {r} head {h}: flash vs GEMM path {err}"
                );
            }
        }
        println!(
            "Qwen3 attention shape, 8192 rows: flash_prefill {block:?} {flash_ms:.2} ms, GEMM path \
             {gemm_ms:.2} ms per layer; worst rel-L2 between them {worst:.2e}"
        );
    }
}
