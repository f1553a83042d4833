//! The decode segment's ops on the GPU at a model's decode shapes: each op captured alone in a CUDA
//! graph (`REPS` copies back to back) and replayed, so µs per op include the gap a graph leaves between
//! two kernels, and then the whole segment as one graph, the cuBLAS + separate-kernel path ("old", as
//! the engine ran it before `segment.cu`), the fused one ("new", o projection on cuBLAS as the engine
//! runs it) and the fused one with both RMSNorms folded into the q/k/v and router launches
//! ("folded"), so the sum of the ops and the whole can be compared. The segment: attention norm, q/k/v, q/k norm + RoPE, K/V append, paged
//! attention over `ctx` cached positions, o projection (added into the residual), FFN norm, router,
//! top-k, the hand-off publish (routing and rows into mapped host memory; the fused router does it in
//! its own launch). Random weights; the two
//! paths' outputs are compared once (rel-L2, same experts) before timing.
//!
//! With `--handoff ROUNDS` it times the hand-off's round trip instead: the host raises the CPU sum's
//! flag, the GPU's wait sees it and adds the sum, the publish raises the routing's flag, the host
//! sees it (the two kernels replayed from a graph, as in a decode step), split by the GPU's clock
//! stamps into the GPU's time and the flags' travel.
//!
//!     gpu_segment_bench [--shape qwen3|smallthinker] [--ctx 64,512,2048] [--rows 1] [--iters 400]
//!                       [--handoff ROUNDS]
use half::bf16;
use moe_kernels::cuda::ops::{
    CacheAppend, CacheRows, FusedRouter, GemvMat, HandoffPort, NormRows, PagedIndex, RotaryStyle,
    Rotation, RouterKind,
};
use moe_kernels::cuda::{GpuDevice, GpuError};
use std::time::Instant;

type Error = Box<dyn std::error::Error>;

/// Copies of one op per captured graph.
const REPS: usize = 20;
/// Positions per cache block (the engine's `BLOCK`).
const BLOCK: usize = 16;

#[derive(Clone, Copy)]
struct Shape {
    name: &'static str,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    experts: usize,
    top_k: usize,
}

const QWEN3: Shape = Shape {
    name: "Qwen3-30B-A3B",
    hidden: 2048,
    heads: 32,
    kv_heads: 4,
    head_dim: 128,
    experts: 128,
    top_k: 8,
};
const SMALLTHINKER: Shape = Shape {
    name: "SmallThinker-21B",
    hidden: 2560,
    heads: 28,
    kv_heads: 4,
    head_dim: 128,
    experts: 64,
    top_k: 6,
};

type R = Result<(), GpuError>;
type Slice<T> = cudarc::driver::CudaSlice<T>;

/// The layer's weights.
struct Weights {
    attn_norm: Slice<f32>,
    ffn_norm: Slice<f32>,
    wq: Slice<bf16>,
    wk: Slice<bf16>,
    wv: Slice<bf16>,
    wo: Slice<bf16>,
    q_norm: Slice<f32>,
    k_norm: Slice<f32>,
    router: Slice<f32>,
    inv_freq: Slice<f32>,
}

/// The step's buffers and index.
struct Bufs {
    x: Slice<f32>,
    hb: Slice<bf16>,
    hf: Slice<f32>,
    q: Slice<f32>,
    k: Slice<f32>,
    v: Slice<f32>,
    attn: Slice<bf16>,
    logits: Slice<f32>,
    ids: Slice<i32>,
    w: Slice<f32>,
    k_cache: Slice<bf16>,
    v_cache: Slice<bf16>,
    pos: Slice<i32>,
    seq: Slice<i32>,
    slots: Slice<i32>,
    tables: Slice<i32>,
    max_blocks: usize,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    AttnNorm,
    QCublas,
    KCublas,
    VCublas,
    QNormRope,
    KNormRope,
    KvAppend,
    AttentionTiles,
    OCublas,
    FfnNorm,
    RouterCublas,
    TopK,
    Publish,
    QkvGemv,
    NormRopeAppend,
    AttentionWarps,
    RouterFusedPublish,
    QkvGemvNorm,
    RouterNormFusedPublish,
    OGemv,
}

const OLD: [Op; 13] = [
    Op::AttnNorm,
    Op::QCublas,
    Op::KCublas,
    Op::VCublas,
    Op::QNormRope,
    Op::KNormRope,
    Op::KvAppend,
    Op::AttentionTiles,
    Op::OCublas,
    Op::FfnNorm,
    Op::RouterCublas,
    Op::TopK,
    Op::Publish,
];
const NEW: [Op; 7] = [
    Op::AttnNorm,
    Op::QkvGemv,
    Op::NormRopeAppend,
    Op::AttentionWarps,
    Op::OCublas,
    Op::FfnNorm,
    Op::RouterFusedPublish,
];
const FOLDED: [Op; 5] = [
    Op::QkvGemvNorm,
    Op::NormRopeAppend,
    Op::AttentionWarps,
    Op::OCublas,
    Op::RouterNormFusedPublish,
];
const FOLDED_O_GEMV: [Op; 5] = [
    Op::QkvGemvNorm,
    Op::NormRopeAppend,
    Op::AttentionWarps,
    Op::OGemv,
    Op::RouterNormFusedPublish,
];
/// The paths compared, by name.
const PATHS: [(&str, &[Op]); 4] = [
    ("old", &OLD),
    ("new", &NEW),
    ("folded", &FOLDED),
    ("folded+oGemv", &FOLDED_O_GEMV),
];

struct Bench<'a> {
    dev: &'a GpuDevice,
    s: Shape,
    rows: usize,
    w: Weights,
    port: HandoffPort,
}

impl Bench<'_> {
    fn rotation<'b>(&'b self, positions: &'b Slice<i32>) -> Rotation<'b> {
        Rotation {
            positions,
            inv_freq: &self.w.inv_freq,
            attn_factor: 1.0,
            rotary_dim: self.s.head_dim,
            offset: 0,
            style: RotaryStyle::Neox,
        }
    }

    fn index<'b>(
        (tables, seq, pos): (&'b Slice<i32>, &'b Slice<i32>, &'b Slice<i32>),
        max_blocks: usize,
    ) -> PagedIndex<'b> {
        PagedIndex {
            block_tables: tables,
            max_blocks,
            seq_of_row: seq,
            pos_of_row: pos,
            block_size: BLOCK,
        }
    }

    fn run(&self, op: Op, b: &mut Bufs) -> R {
        let (d, s, n, w) = (self.dev, self.s, self.rows, &self.w);
        let (hd, qo, kvo) = (s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let eps = 1e-6;
        let kind = RouterKind::Softmax { renormalize: true };
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        match op {
            Op::AttnNorm => d.rms_norm(&b.x, &w.attn_norm, eps, (n, hd), &mut b.hb, None),
            Op::QCublas => d.gemm_bf16(&b.hb, &w.wq, &mut b.q, n, qo, hd, false),
            Op::KCublas => d.gemm_bf16(&b.hb, &w.wk, &mut b.k, n, kvo, hd, false),
            Op::VCublas => d.gemm_bf16(&b.hb, &w.wv, &mut b.v, n, kvo, hd, false),
            Op::QNormRope => {
                let r = self.rotation(&b.pos);
                let shape = (n, s.heads, s.head_dim);
                d.qk_norm_rope(&mut b.q, shape, Some((&w.q_norm, eps)), Some(&r))
            }
            Op::KNormRope => {
                let r = self.rotation(&b.pos);
                let shape = (n, s.kv_heads, s.head_dim);
                d.qk_norm_rope(&mut b.k, shape, Some((&w.k_norm, eps)), Some(&r))
            }
            Op::KvAppend => d.kv_append(
                &b.k,
                &b.v,
                (n, kvo, kvo),
                &mut b.k_cache,
                &mut b.v_cache,
                &b.slots,
                BLOCK,
            ),
            Op::AttentionTiles | Op::AttentionWarps => {
                let caches = (CacheRows::Bf16(&b.k_cache), CacheRows::Bf16(&b.v_cache));
                let idx = Self::index((&b.tables, &b.seq, &b.pos), b.max_blocks);
                let heads = (s.heads, s.kv_heads, s.head_dim);
                let out = &mut b.attn;
                if op == Op::AttentionTiles {
                    d.paged_attention(&b.q, caches, &idx, heads, (scale, None), 0..n, out)
                } else {
                    d.paged_attention_warps(&b.q, caches, &idx, heads, (scale, None), 0..n, out)
                }
            }
            Op::OCublas => d.gemm_bf16(&b.attn, &w.wo, &mut b.x, n, hd, qo, true),
            Op::FfnNorm => d.rms_norm(&b.x, &w.ffn_norm, eps, (n, hd), &mut b.hb, Some(&mut b.hf)),
            Op::RouterCublas => d.gemm_f32(&b.hf, &w.router, &mut b.logits, n, s.experts, hd),
            Op::TopK => d.router_topk(
                &b.logits,
                (n, s.experts, s.top_k),
                &kind,
                None,
                &mut b.ids,
                &mut b.w,
            ),
            Op::Publish => {
                d.handoff_publish(&b.ids, &b.w, n * s.top_k, Some((&b.hf, n * hd)), &self.port)
            }
            Op::QkvGemv => {
                let mut mats = [
                    GemvMat {
                        w: &w.wq,
                        y: &mut b.q,
                        out: qo,
                    },
                    GemvMat {
                        w: &w.wk,
                        y: &mut b.k,
                        out: kvo,
                    },
                    GemvMat {
                        w: &w.wv,
                        y: &mut b.v,
                        out: kvo,
                    },
                ];
                d.gemv_bf16(&b.hb, (n, hd), &mut mats, false)
            }
            Op::NormRopeAppend => {
                let r = self.rotation(&b.pos);
                let cache = CacheAppend {
                    k_cache: &mut b.k_cache,
                    v_cache: &mut b.v_cache,
                    slot_of_row: &b.slots,
                };
                d.qk_norm_rope_append(
                    (&mut b.q, &mut b.k, &b.v),
                    (n, s.heads, s.kv_heads, s.head_dim),
                    (Some(&w.q_norm), Some(&w.k_norm), eps),
                    Some(&r),
                    cache,
                )
            }
            Op::RouterFusedPublish | Op::RouterNormFusedPublish => {
                let router = FusedRouter {
                    w: &w.router,
                    experts: s.experts,
                    k: s.top_k,
                    kind: &kind,
                    bias: None,
                };
                let routing = (&mut b.ids, &mut b.w);
                let publish = Some((&self.port, true));
                if op == Op::RouterFusedPublish {
                    d.router_gemv_topk(&b.hf, (n, hd), &router, &mut b.logits, routing, publish)
                } else {
                    let norm = NormRows {
                        x: &b.x,
                        w: &w.ffn_norm,
                        eps,
                    };
                    let out = (&mut b.hb, &mut b.hf);
                    let logits = &mut b.logits;
                    d.router_gemv_topk_norm(&norm, out, (n, hd), &router, logits, routing, publish)
                }
            }
            Op::OGemv => {
                let mut mats = [GemvMat {
                    w: &w.wo,
                    y: &mut b.x,
                    out: hd,
                }];
                d.gemv_bf16(&b.attn, (n, qo), &mut mats, true)
            }
            Op::QkvGemvNorm => {
                let norm = NormRows {
                    x: &b.x,
                    w: &w.attn_norm,
                    eps,
                };
                let mut mats = [
                    GemvMat {
                        w: &w.wq,
                        y: &mut b.q,
                        out: qo,
                    },
                    GemvMat {
                        w: &w.wk,
                        y: &mut b.k,
                        out: kvo,
                    },
                    GemvMat {
                        w: &w.wv,
                        y: &mut b.v,
                        out: kvo,
                    },
                ];
                d.gemv_bf16_norm(&norm, (n, hd), &mut b.hb, &mut mats)
            }
        }
    }

    /// µs per replayed run of `ops` (each graph holds `reps` copies of the run).
    fn time(&self, b: &mut Bufs, ops: &[Op], reps: usize, iters: usize) -> Result<f64, Error> {
        let (r, g) = self.dev.capture(|| -> R {
            for _ in 0..reps {
                for &op in ops {
                    self.run(op, b)?;
                }
            }
            Ok(())
        })?;
        r?;
        let g = g?.ok_or_else(|| Error::from("nothing captured"))?;
        for _ in 0..10 {
            g.replay()?;
        }
        self.dev.stream.synchronize()?;
        let t = Instant::now();
        for _ in 0..iters {
            g.replay()?;
        }
        self.dev.stream.synchronize()?;
        Ok(t.elapsed().as_secs_f64() * 1e6 / (iters * reps) as f64)
    }
}

/// Uniform values in [-a, a).
fn random(n: usize, a: f32, seed: &mut u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            ((*seed >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0) * a
        })
        .collect()
}

fn upload_bf16(dev: &GpuDevice, v: &[f32]) -> Result<Slice<bf16>, Error> {
    let b: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
    Ok(dev.stream.clone_htod(&b)?)
}

fn weights(dev: &GpuDevice, s: Shape, seed: &mut u64) -> Result<Weights, Error> {
    let (hd, qo, kvo) = (s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let st = &dev.stream;
    let inv_freq: Vec<f32> = (0..s.head_dim / 2)
        .map(|i| 1e6f32.powf(-2.0 * i as f32 / s.head_dim as f32))
        .collect();
    let ones = |n: usize, seed: &mut u64| -> Vec<f32> {
        random(n, 0.2, seed).iter().map(|v| 1.0 + v).collect()
    };
    Ok(Weights {
        attn_norm: st.clone_htod(&ones(hd, seed))?,
        ffn_norm: st.clone_htod(&ones(hd, seed))?,
        wq: upload_bf16(dev, &random(qo * hd, 0.03, seed))?,
        wk: upload_bf16(dev, &random(kvo * hd, 0.03, seed))?,
        wv: upload_bf16(dev, &random(kvo * hd, 0.03, seed))?,
        wo: upload_bf16(dev, &random(hd * qo, 0.02, seed))?,
        q_norm: st.clone_htod(&ones(s.head_dim, seed))?,
        k_norm: st.clone_htod(&ones(s.head_dim, seed))?,
        router: st.clone_htod(&random(s.experts * hd, 0.05, seed))?,
        inv_freq: st.clone_htod(&inv_freq)?,
    })
}

/// Buffers for `rows` decode rows of one sequence each, at positions ctx.. (the caches hold `ctx`
/// random positions before them), blocks scattered over the pool.
fn buffers(
    dev: &GpuDevice,
    s: Shape,
    rows: usize,
    ctx: usize,
    seed: &mut u64,
) -> Result<Bufs, Error> {
    let (hd, qo, kvo) = (s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let st = &dev.stream;
    let per_seq = (ctx + 1).div_ceil(BLOCK);
    let blocks = per_seq * rows;
    // block j of sequence r is pool block (j * rows + r) reversed: not contiguous
    let tables: Vec<i32> = (0..rows)
        .flat_map(|r| (0..per_seq).map(move |j| (blocks - 1 - (j * rows + r)) as i32))
        .collect();
    let slot = |r: usize, p: usize| tables[r * per_seq + p / BLOCK] as usize * BLOCK + p % BLOCK;
    let slots: Vec<i32> = (0..rows).map(|r| slot(r, ctx) as i32).collect();
    let kv = random(blocks * BLOCK * kvo, 1.0, seed);
    Ok(Bufs {
        x: st.clone_htod(&random(rows * hd, 1.0, seed))?,
        hb: st.alloc_zeros(rows * hd)?,
        hf: st.alloc_zeros(rows * hd)?,
        q: st.alloc_zeros(rows * qo)?,
        k: st.alloc_zeros(rows * kvo)?,
        v: st.alloc_zeros(rows * kvo)?,
        attn: st.alloc_zeros(rows * qo)?,
        logits: st.alloc_zeros(rows * s.experts)?,
        ids: st.alloc_zeros(rows * s.top_k)?,
        w: st.alloc_zeros(rows * s.top_k)?,
        k_cache: upload_bf16(dev, &kv)?,
        v_cache: upload_bf16(dev, &random(blocks * BLOCK * kvo, 1.0, seed))?,
        pos: st.clone_htod(&vec![ctx as i32; rows])?,
        seq: st.clone_htod(&(0..rows as i32).collect::<Vec<_>>())?,
        slots: st.clone_htod(&slots)?,
        tables: st.clone_htod(&tables)?,
        max_blocks: per_seq,
    })
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        d += (x as f64 - y as f64).powi(2);
        n += (y as f64).powi(2);
    }
    (d / n.max(1e-30)).sqrt()
}

/// One run of each path from the same residual rows and caches: rel-L2 of q, attention, residual,
/// the FFN norm's f32 rows and logits against the old path, and whether the experts agree.
fn compare(bench: &Bench, ctx: usize, seed: u64) -> Result<String, Error> {
    let st = &bench.dev.stream;
    let mut out = Vec::new();
    for (_, ops) in PATHS {
        let mut s = seed;
        let mut b = buffers(bench.dev, bench.s, bench.rows, ctx, &mut s)?;
        for &op in ops {
            bench.run(op, &mut b)?;
        }
        let attn: Vec<f32> = st.clone_dtoh(&b.attn)?.iter().map(|v| v.to_f32()).collect();
        out.push((
            [
                st.clone_dtoh(&b.q)?,
                attn,
                st.clone_dtoh(&b.x)?,
                st.clone_dtoh(&b.hf)?,
                st.clone_dtoh(&b.logits)?,
            ],
            st.clone_dtoh(&b.ids)?,
        ));
    }
    let o = &out[0];
    let mut lines = Vec::new();
    for ((name, _), p) in PATHS.iter().zip(&out).skip(1) {
        let r: Vec<f64> = (0..5).map(|i| rel_l2(&p.0[i], &o.0[i])).collect();
        lines.push(format!(
            "{name} against old: rel-L2 q {:.1e}, attention {:.1e}, residual {:.1e}, FFN norm rows {:.1e}, router logits {:.1e}; same experts: {}",
            r[0], r[1], r[2], r[3], r[4], p.1 == o.1
        ));
    }
    let (new, folded) = (&out[1], &out[2]);
    lines.push(format!(
        "folded+oGemv against folded: residual rel-L2 {:.1e}",
        rel_l2(&out[3].0[2], &folded.0[2])
    ));
    lines.push(format!(
        "folded against new: q identical {}, FFN norm rows identical {}, router logits rel-L2 {:.1e}",
        new.0[0] == folded.0[0],
        new.0[3] == folded.0[3],
        rel_l2(&folded.0[4], &new.0[4])
    ));
    Ok(lines.join("\n"))
}

/// The hand-off's round trip, `rounds` graph replays of `REPS` (wait-and-add, publish) pairs: the
/// median and 90th percentile of the round trip (host raises the sum's flag → host sees the
/// routing's), of the GPU's wait seeing the flag → its add done, of the add done → the publish's
/// flag, and the flags' travel (the round trip less the GPU's time between seeing one flag and
/// raising the other). (The GPU's global timer is ~215 µs off the host's realtime clock on the H200,
/// so the travel cannot be split by direction from the two clocks.)
fn handoff(dev: &GpuDevice, s: Shape, rows: usize, rounds: usize) -> Result<(), Error> {
    let (nk, nx) = (rows * s.top_k, rows * s.hidden);
    let st = &dev.stream;
    let port = HandoffPort::new(dev, nk, nx)?;
    let mut x = st.alloc_zeros::<f32>(nx)?;
    let (ids, w, hf) = (
        st.alloc_zeros::<i32>(nk)?,
        st.alloc_zeros::<f32>(nk)?,
        st.alloc_zeros::<f32>(nx)?,
    );
    let (r, g) = dev.capture(|| -> R {
        for _ in 0..REPS {
            dev.handoff_wait_add(&mut x, nx, &port)?;
            dev.handoff_publish(&ids, &w, nk, Some((&hf, nx)), &port)?;
        }
        Ok(())
    })?;
    r?;
    let g = g?.ok_or_else(|| Error::from("nothing captured"))?;
    // round trip, seen → added, added → published (µs)
    let mut tm: [Vec<f64>; 3] = Default::default();
    for round in 0..rounds + 1 {
        port.reset();
        g.replay()?;
        for _ in 0..REPS {
            // the next wait is spinning (as in a decode step, where it is enqueued long before)
            let idle = Instant::now();
            while idle.elapsed().as_micros() < 30 {}
            port.raise_sum();
            let t = Instant::now();
            while !port.take_published() {
                if t.elapsed().as_secs() > 2 {
                    return Err("the hand-off's publish never came".into());
                }
            }
            let rt = t.elapsed().as_secs_f64() * 1e6;
            let stamp = port.stamps();
            let us = |a: u64, b: u64| b.saturating_sub(a) as f64 * 1e-3;
            if round > 0 {
                tm[0].push(rt);
                tm[1].push(us(stamp.seen_ns, stamp.added_ns));
                tm[2].push(us(stamp.added_ns, stamp.published_ns));
            }
        }
        st.synchronize()?;
    }
    let [rt, add, publish] = tm.map(|mut v| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[v.len() * 9 / 10])
    });
    println!(
        "HANDOFF rows={rows}: round trip {:.2} µs (p90 {:.2}) = GPU add {:.2} (p90 {:.2}) + add → published {:.2} (p90 {:.2}) + flags' travel {:.2}",
        rt.0, rt.1, add.0, add.1, publish.0, publish.1, rt.0 - add.0 - publish.0
    );
    Ok(())
}

fn list(arg: &str) -> Result<Vec<usize>, Error> {
    arg.split(',')
        .map(|v| {
            v.trim()
                .parse()
                .map_err(|e| Error::from(format!("{v:?}: {e}")))
        })
        .collect()
}

fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let (mut shape, mut ctxs, mut rows, mut iters) = (QWEN3, vec![64, 512, 2048], vec![1], 400);
    let mut handoff_rounds = 0;
    while let Some(a) = args.next() {
        let mut val = || {
            args.next()
                .ok_or_else(|| Error::from(format!("{a} needs a value")))
        };
        match a.as_str() {
            "--shape" => {
                shape = match val()?.as_str() {
                    "qwen3" => QWEN3,
                    "smallthinker" => SMALLTHINKER,
                    s => return Err(format!("unknown shape {s} (qwen3, smallthinker)").into()),
                }
            }
            "--ctx" => ctxs = list(&val()?)?,
            "--rows" => rows = list(&val()?)?,
            "--iters" => iters = val()?.parse()?,
            "--handoff" => handoff_rounds = val()?.parse()?,
            _ => return Err(format!("unknown argument {a}").into()),
        }
    }
    let dev = GpuDevice::open(0)?;
    println!(
        "{} ({}), shape {}",
        dev.name,
        std::env::var("HOSTNAME").unwrap_or_default(),
        shape.name
    );
    if handoff_rounds > 0 {
        for &n in &rows {
            handoff(&dev, shape, n, handoff_rounds)?;
        }
        return Ok(());
    }
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for &n in &rows {
        let bench = Bench {
            dev: &dev,
            s: shape,
            rows: n,
            w: weights(&dev, shape, &mut seed)?,
            port: HandoffPort::new(&dev, n * shape.top_k, n * shape.hidden)?,
        };
        for &ctx in &ctxs {
            let mut b = buffers(&dev, shape, n, ctx, &mut seed)?;
            println!("\n### rows {n}, context {ctx} (µs per op, graph of {REPS} copies replayed {iters}×)\n");
            println!("| op | µs |\n|---|---|");
            let mut sums = [0f64; PATHS.len()];
            for (i, (name, ops)) in PATHS.iter().enumerate() {
                for &op in *ops {
                    let us = bench.time(&mut b, &[op], REPS, iters)?;
                    sums[i] += us;
                    println!("| {name} {op:?} | {us:.2} |");
                }
            }
            let mut whole = [0f64; PATHS.len()];
            for (i, (name, ops)) in PATHS.iter().enumerate() {
                whole[i] = bench.time(&mut b, ops, 1, iters * 4)?;
                println!(
                    "| {name}: sum of ops | {:.2} |\n| {name}: whole segment | {:.2} |",
                    sums[i], whole[i]
                );
            }
            println!(
                "SEGMENT rows={n} ctx={ctx} old={:.1}us new={:.1}us folded={:.1}us folded+oGemv={:.1}us (sum of ops old {:.1} new {:.1} folded {:.1} folded+oGemv {:.1})",
                whole[0], whole[1], whole[2], whole[3], sums[0], sums[1], sums[2], sums[3]
            );
            println!("{}", compare(&bench, ctx, 42 + ctx as u64)?);
        }
    }
    Ok(())
}
