//! The decode segment's ops on the GPU at a model's decode shapes (Qwen3-30B-A3B, SmallThinker-21B,
//! GLM-4.5-Air): each op captured alone in a CUDA graph (`REPS` copies back to back) and replayed, so
//! µs per op include the gap a graph leaves between two kernels, with the bytes the op must read or
//! write and the rate that makes; then each path of the segment as one graph, so the sum of its ops
//! and the whole can be compared, against the path's bytes at the HBM peak. The segment: attention
//! norm, q/k/v (with GLM's biases), q/k norm + RoPE (partial for GLM), K/V append, paged attention
//! over `ctx` cached positions, o projection (added into the residual), FFN norm, router, top-k, the
//! hand-off publish (routing and rows into mapped host memory); SmallThinker routes the layer input
//! before attention. Paths:
//! - `old`: cuBLAS and the separate kernels, as the engine ran before `segment.cu`;
//! - `fused`: the fused kernels with separate norms (`fold-norms` off);
//! - `shipped`: the norms folded into the q/k/v and router launches, biases added by `add_bias`, the
//!   q/k/v GEMV on a block per rows, the o projection on cuBLAS (the engine's path before seg11);
//! - `resident`: the biases added by the q/k/v launch, on a resident grid (`GemvGrid::Resident`;
//!   the engine's path since);
//! - `resident+oGemv`: the same with the o projection by the segment's GEMV on a resident grid.
//!
//! Off the paths: the shared expert at one row (cuBLAS or the GEMV; it runs after the publish) and the
//! lm_head (the step's tail). Random weights; the paths' outputs are compared once (rel-L2, same
//! experts, which are bit-identical) before timing.
//!
//! Replayed back to back, a shape whose segment weights fit in L2 (Qwen3: ~30 MB of a 50 MB L2)
//! reads them from L2, which a decode step's segment does not (the layers between evict them). So each
//! path is also timed cold, after a GEMV over 192 MB that evicts L2 (and a few empty launches), and
//! prefetched: the same with the first `--prefetch-mb` MB of its weights (q, k, v, o, router in that
//! order) fetched into L2 by `l2_prefetch` before the empty launches, as the engine could while it
//! waits for the CPU experts.
//!
//! With `--handoff ROUNDS` it times the hand-off's round trip instead: the host raises the CPU sum's
//! flag, the GPU's wait sees it and adds the sum, the publish raises the routing's flag, the host
//! sees it (the two kernels replayed from a graph, as in a decode step), split by the GPU's clock
//! stamps into the GPU's time and the flags' travel.
//!
//!     gpu_segment_bench [--shape qwen3|smallthinker|glm45air] [--ctx 64,512,2048] [--rows 1]
//!                       [--iters 400] [--prefetch-mb 32] [--handoff ROUNDS]
use half::bf16;
use moe_kernels::cuda::ops::{
    CacheAppend, CacheRows, FusedRouter, GateActivation, GemvGrid, GemvMat, HandoffPort, NormRows,
    PagedIndex, RotaryStyle, Rotation, RouterKind,
};
use moe_kernels::cuda::{GpuDevice, GpuError};
use std::time::Instant;

type Error = Box<dyn std::error::Error>;

/// Copies of one op per captured graph.
const REPS: usize = 20;
/// Positions per cache block (the engine's `BLOCK`).
const BLOCK: usize = 16;
/// The H200's HBM3e peak (bytes per second), the bound each path is set against.
const HBM_PEAK: f64 = 4.8e12;
/// Seconds of replays one op's timing aims at (fewer replays for slow ops).
const TIMING_S: f64 = 0.12;

#[derive(Clone, Copy)]
struct Shape {
    name: &'static str,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    experts: usize,
    top_k: usize,
    router: RouterKind,
    /// The router's selection-only correction bias (sigmoid routers).
    correction_bias: bool,
    /// Biases on q, k and v (GLM-4.5).
    qkv_bias: bool,
    /// Per-head RMSNorm on q and k (Qwen3).
    qk_norm: bool,
    /// Dims of a head that RoPE rotates (GLM-4.5: half).
    rotary_dim: usize,
    /// The router reads the layer input, before attention (SmallThinker).
    router_on_input: bool,
    /// The shared expert's width (GLM-4.5: one of 1408).
    shared_inter: Option<usize>,
    vocab: usize,
    eps: f32,
}

const QWEN3: Shape = Shape {
    name: "Qwen3-30B-A3B",
    hidden: 2048,
    heads: 32,
    kv_heads: 4,
    head_dim: 128,
    experts: 128,
    top_k: 8,
    router: RouterKind::Softmax { renormalize: true },
    correction_bias: false,
    qkv_bias: false,
    qk_norm: true,
    rotary_dim: 128,
    router_on_input: false,
    shared_inter: None,
    vocab: 151936,
    eps: 1e-6,
};
const SMALLTHINKER: Shape = Shape {
    name: "SmallThinker-21B",
    hidden: 2560,
    heads: 28,
    kv_heads: 4,
    head_dim: 128,
    experts: 64,
    top_k: 6,
    router: RouterKind::Softmax { renormalize: true },
    correction_bias: false,
    qkv_bias: false,
    qk_norm: false,
    rotary_dim: 128,
    router_on_input: true,
    shared_inter: None,
    vocab: 151936,
    eps: 1e-6,
};
const GLM45_AIR: Shape = Shape {
    name: "GLM-4.5-Air",
    hidden: 4096,
    heads: 96,
    kv_heads: 8,
    head_dim: 128,
    experts: 128,
    top_k: 8,
    router: RouterKind::SigmoidGrouped {
        n_group: 1,
        topk_group: 1,
        renormalize: true,
        scaling: 1.0,
    },
    correction_bias: true,
    qkv_bias: true,
    qk_norm: false,
    rotary_dim: 64,
    router_on_input: false,
    shared_inter: Some(1408),
    vocab: 151552,
    eps: 1e-5,
};

impl Shape {
    fn q_out(&self) -> usize {
        self.heads * self.head_dim
    }

    fn kv_out(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

type R = Result<(), GpuError>;
type Slice<T> = cudarc::driver::CudaSlice<T>;

/// The layer's weights (and the model's lm_head).
struct Weights {
    attn_norm: Slice<f32>,
    ffn_norm: Slice<f32>,
    wq: Slice<bf16>,
    wk: Slice<bf16>,
    wv: Slice<bf16>,
    /// q, k and v biases (zero-length without them).
    bq: Option<Slice<f32>>,
    bk: Option<Slice<f32>>,
    bv: Option<Slice<f32>>,
    wo: Slice<bf16>,
    q_norm: Slice<f32>,
    k_norm: Slice<f32>,
    router: Slice<f32>,
    correction: Option<Slice<f32>>,
    inv_freq: Slice<f32>,
    /// Shared expert: gate_up `[2I, H]`, down `[H, I]`.
    shared: Option<(Slice<bf16>, Slice<bf16>)>,
    lm_head: Slice<bf16>,
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
    /// Shared expert's gate_up rows (f32) and activations (bf16); lm_head's logits.
    gate_up: Slice<f32>,
    act: Slice<bf16>,
    vocab_logits: Slice<f32>,
    /// `Op::Flush`'s weights (`FLUSH_ELEMS`) and output rows; `Op::Idle`'s buffers.
    flush: (Slice<bf16>, Slice<f32>),
    idle: (Slice<f32>, Slice<f32>),
}

/// bf16 weights `Op::Flush` reads (192 MB, ~4 L2s).
const FLUSH_ELEMS: usize = 96_000_000;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    AttnNorm,
    QCublas,
    KCublas,
    VCublas,
    /// q, k and v biases by `add_bias` (three launches).
    QkvBiasAdds,
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
    /// The router over the layer input before attention (SmallThinker), its top-k in the launch.
    RouterEarly,
    QkvGemvNorm,
    /// The same launch adding the q/k/v biases, on a resident grid.
    QkvGemvNormBiasResident,
    RouterNormFusedPublish,
    /// The o projection by the segment's GEMV on a resident grid.
    OGemvResident,
    SharedCublas,
    SharedGemv,
    LmHeadCublas,
    LmHeadGemv,
    /// A GEMV over 192 MB of other weights, which evicts L2 (clean lines, as other layers leave it).
    Flush,
    /// Eight launches of one element: time for the prefetches to land.
    Idle,
    /// The segment's weights fetched into L2 (`l2_prefetch`), up to the bench's budget.
    Prefetch,
}

/// The paths compared for `s`, by name (see the module docs).
fn paths(s: &Shape) -> Vec<(&'static str, Vec<Op>)> {
    use Op::*;
    let early: &[Op] = if s.router_on_input {
        &[RouterEarly]
    } else {
        &[]
    };
    let biases: &[Op] = if s.qkv_bias { &[QkvBiasAdds] } else { &[] };
    let mut old = Vec::new();
    if s.router_on_input {
        old.extend([RouterCublas, TopK]);
    }
    old.extend([AttnNorm, QCublas, KCublas, VCublas]);
    old.extend(biases);
    old.extend([
        QNormRope,
        KNormRope,
        KvAppend,
        AttentionTiles,
        OCublas,
        FfnNorm,
    ]);
    if !s.router_on_input {
        old.extend([RouterCublas, TopK]);
    }
    old.push(Publish);
    // the end of the fused paths: FFN norm, router (unless it went first), publish
    let tail = |folded: bool| -> Vec<Op> {
        match (s.router_on_input, folded) {
            (true, _) => vec![FfnNorm, Publish],
            (false, false) => vec![FfnNorm, RouterFusedPublish],
            (false, true) => vec![RouterNormFusedPublish],
        }
    };
    let path = |head: &[Op], o: Op, folded: bool| -> Vec<Op> {
        let mut p = early.to_vec();
        p.extend(head);
        p.extend([NormRopeAppend, AttentionWarps, o]);
        p.extend(tail(folded));
        p
    };
    let fused_head: Vec<Op> = [AttnNorm, QkvGemv].iter().chain(biases).copied().collect();
    let shipped_head: Vec<Op> = [QkvGemvNorm].iter().chain(biases).copied().collect();
    vec![
        ("old", old),
        ("fused", path(&fused_head, OCublas, false)),
        ("shipped", path(&shipped_head, OCublas, true)),
        ("resident", path(&[QkvGemvNormBiasResident], OCublas, true)),
        (
            "resident+oGemv",
            path(&[QkvGemvNormBiasResident], OGemvResident, true),
        ),
    ]
}

struct Bench<'a> {
    dev: &'a GpuDevice,
    s: Shape,
    rows: usize,
    w: Weights,
    port: HandoffPort,
    /// Bytes of the segment's weights `Op::Prefetch` fetches.
    prefetch_bytes: usize,
}

impl Bench<'_> {
    fn rotation<'b>(&'b self, positions: &'b Slice<i32>) -> Rotation<'b> {
        Rotation {
            positions,
            inv_freq: &self.w.inv_freq,
            attn_factor: 1.0,
            rotary_dim: self.s.rotary_dim,
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

    fn router(&self) -> FusedRouter<'_> {
        FusedRouter {
            w: &self.w.router,
            experts: self.s.experts,
            k: self.s.top_k,
            kind: &self.s.router,
            bias: self.w.correction.as_ref(),
        }
    }

    /// Bytes `op` must move at least once (weights, caches, activations), for its rate.
    fn bytes(&self, op: Op, ctx: usize) -> usize {
        let (s, n) = (&self.s, self.rows);
        let (hd, qo, kvo) = (s.hidden, s.q_out(), s.kv_out());
        let qkv_w = (qo + 2 * kvo) * hd * 2;
        let qkv_b = if s.qkv_bias { (qo + 2 * kvo) * 4 } else { 0 };
        let norm = n * hd * (4 + 2 + 4) + hd * 4;
        let router = s.experts * hd * 4 + n * hd * 4;
        match op {
            Op::AttnNorm | Op::FfnNorm => norm,
            Op::QCublas => qo * hd * 2,
            Op::KCublas | Op::VCublas => kvo * hd * 2,
            Op::QkvBiasAdds => qkv_b + n * (qo + 2 * kvo) * 8,
            Op::QkvGemv | Op::QkvGemvNorm => qkv_w,
            Op::QkvGemvNormBiasResident => qkv_w + qkv_b,
            Op::QNormRope => n * qo * 8,
            Op::KNormRope => n * kvo * 8,
            Op::KvAppend => n * kvo * 8,
            Op::NormRopeAppend => n * (qo + kvo) * 8 + n * kvo * 8,
            Op::AttentionTiles | Op::AttentionWarps => n * ((ctx + 1) * kvo * 4 + qo * 6),
            Op::OCublas | Op::OGemvResident => hd * qo * 2,
            Op::RouterCublas | Op::RouterEarly | Op::RouterFusedPublish => router,
            Op::RouterNormFusedPublish => router + norm,
            Op::TopK | Op::Publish => n * (s.experts * 4 + hd * 4),
            Op::SharedCublas | Op::SharedGemv => 3 * s.shared_inter.unwrap_or(0) * hd * 2,
            Op::LmHeadCublas | Op::LmHeadGemv => s.vocab * hd * 2,
            Op::Flush => FLUSH_ELEMS * 2,
            Op::Idle => 0,
            Op::Prefetch => self.prefetch_bytes,
        }
    }

    /// `Op::Prefetch`: q, k, v, o and the router, in the segment's order, up to the budget.
    fn prefetch(&self) -> R {
        let (d, w) = (self.dev, &self.w);
        let mut left = self.prefetch_bytes;
        let bf16s = [&w.wq, &w.wk, &w.wv, &w.wo];
        for m in bf16s {
            let len = m.len().min(left / 2);
            d.l2_prefetch(m, len)?;
            left -= len * 2;
        }
        let len = w.router.len().min(left / 4);
        d.l2_prefetch(&w.router, len)
    }

    fn run(&self, op: Op, b: &mut Bufs) -> R {
        let (d, s, n, w) = (self.dev, self.s, self.rows, &self.w);
        let (hd, qo, kvo) = (s.hidden, s.q_out(), s.kv_out());
        let eps = s.eps;
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        let qk_norm = |nw| s.qk_norm.then_some((nw, eps));
        let grid = |resident: bool| {
            if resident {
                GemvGrid::Resident
            } else {
                GemvGrid::PerRows
            }
        };
        match op {
            Op::AttnNorm => d.rms_norm(&b.x, &w.attn_norm, eps, (n, hd), &mut b.hb, None),
            Op::QCublas => d.gemm_bf16(&b.hb, &w.wq, &mut b.q, n, qo, hd, false),
            Op::KCublas => d.gemm_bf16(&b.hb, &w.wk, &mut b.k, n, kvo, hd, false),
            Op::VCublas => d.gemm_bf16(&b.hb, &w.wv, &mut b.v, n, kvo, hd, false),
            Op::QkvBiasAdds => {
                let ys = [
                    (&mut b.q, &w.bq, qo),
                    (&mut b.k, &w.bk, kvo),
                    (&mut b.v, &w.bv, kvo),
                ];
                for (y, bias, out) in ys {
                    if let Some(bias) = bias {
                        d.add_bias(y, bias, (n, out))?;
                    }
                }
                Ok(())
            }
            Op::QNormRope => {
                let r = self.rotation(&b.pos);
                d.qk_norm_rope(
                    &mut b.q,
                    (n, s.heads, s.head_dim),
                    qk_norm(&w.q_norm),
                    Some(&r),
                )
            }
            Op::KNormRope => {
                let r = self.rotation(&b.pos);
                let shape = (n, s.kv_heads, s.head_dim);
                d.qk_norm_rope(&mut b.k, shape, qk_norm(&w.k_norm), Some(&r))
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
            Op::RouterCublas => {
                let input = if s.router_on_input { &b.x } else { &b.hf };
                d.gemm_f32(input, &w.router, &mut b.logits, n, s.experts, hd)
            }
            Op::TopK => d.router_topk(
                &b.logits,
                (n, s.experts, s.top_k),
                &s.router,
                w.correction.as_ref(),
                &mut b.ids,
                &mut b.w,
            ),
            Op::Publish => {
                d.handoff_publish(&b.ids, &b.w, n * s.top_k, Some((&b.hf, n * hd)), &self.port)
            }
            Op::QkvGemv => {
                let Bufs { q, k, v, hb, .. } = b;
                let mut mats = self.qkv_mats((q, k, v), false);
                d.gemv_bf16(&*hb, (n, hd), &mut mats, false)
            }
            Op::NormRopeAppend => {
                let r = self.rotation(&b.pos);
                let cache = CacheAppend {
                    k_cache: &mut b.k_cache,
                    v_cache: &mut b.v_cache,
                    slot_of_row: &b.slots,
                };
                let norms = if s.qk_norm {
                    (Some(&w.q_norm), Some(&w.k_norm), eps)
                } else {
                    (None, None, eps)
                };
                d.qk_norm_rope_append(
                    (&mut b.q, &mut b.k, &b.v),
                    (n, s.heads, s.kv_heads, s.head_dim),
                    norms,
                    Some(&r),
                    cache,
                )
            }
            Op::RouterEarly => {
                let router = self.router();
                let routing = (&mut b.ids, &mut b.w);
                d.router_gemv_topk(&b.x, (n, hd), &router, &mut b.logits, routing, None)
            }
            Op::RouterFusedPublish => {
                let router = self.router();
                let routing = (&mut b.ids, &mut b.w);
                let publish = Some((&self.port, true));
                d.router_gemv_topk(&b.hf, (n, hd), &router, &mut b.logits, routing, publish)
            }
            Op::RouterNormFusedPublish => {
                let router = self.router();
                let norm = NormRows {
                    x: &b.x,
                    w: &w.ffn_norm,
                    eps,
                };
                let (out, logits) = ((&mut b.hb, &mut b.hf), &mut b.logits);
                let routing = (&mut b.ids, &mut b.w);
                let publish = Some((&self.port, true));
                d.router_gemv_topk_norm(&norm, out, (n, hd), &router, logits, routing, publish)
            }
            Op::OGemvResident => {
                let mut mats = [GemvMat {
                    w: &w.wo,
                    y: &mut b.x,
                    out: hd,
                    bias: None,
                }];
                d.gemv_bf16_grid(&b.attn, (n, qo), &mut mats, true, GemvGrid::Resident)
            }
            Op::QkvGemvNorm | Op::QkvGemvNormBiasResident => {
                let Bufs { x, q, k, v, hb, .. } = b;
                let norm = NormRows {
                    x: &*x,
                    w: &w.attn_norm,
                    eps,
                };
                let mut mats = self.qkv_mats((q, k, v), op != Op::QkvGemvNorm);
                let g = grid(op == Op::QkvGemvNormBiasResident);
                d.gemv_bf16_norm_grid(&norm, (n, hd), hb, &mut mats, g)
            }
            Op::SharedCublas | Op::SharedGemv => {
                let (Some((gu, down)), Some(inter)) = (&w.shared, s.shared_inter) else {
                    return Ok(());
                };
                if op == Op::SharedCublas {
                    d.gemm_bf16(&b.hb, gu, &mut b.gate_up, n, 2 * inter, hd, false)?;
                } else {
                    let mut mats = [GemvMat {
                        w: gu,
                        y: &mut b.gate_up,
                        out: 2 * inter,
                        bias: None,
                    }];
                    d.gemv_bf16(&b.hb, (n, hd), &mut mats, false)?;
                }
                d.gated_mul(
                    &b.gate_up,
                    (n, inter),
                    GateActivation::Silu,
                    None,
                    &mut b.act,
                )?;
                if op == Op::SharedCublas {
                    d.gemm_bf16(&b.act, down, &mut b.x, n, hd, inter, true)
                } else {
                    let mut mats = [GemvMat {
                        w: down,
                        y: &mut b.x,
                        out: hd,
                        bias: None,
                    }];
                    d.gemv_bf16(&b.act, (n, inter), &mut mats, true)
                }
            }
            Op::LmHeadCublas => d.gemm_bf16(
                &b.hb,
                &w.lm_head,
                &mut b.vocab_logits,
                n,
                s.vocab,
                hd,
                false,
            ),
            Op::LmHeadGemv => {
                let mut mats = [GemvMat {
                    w: &w.lm_head,
                    y: &mut b.vocab_logits,
                    out: s.vocab,
                    bias: None,
                }];
                d.gemv_bf16(&b.hb, (n, hd), &mut mats, false)
            }
            Op::Flush => {
                let (fw, fy) = &mut b.flush;
                let mut mats = [GemvMat {
                    w: fw,
                    y: fy,
                    out: FLUSH_ELEMS / hd,
                    bias: None,
                }];
                d.gemv_bf16(&b.hb, (n, hd), &mut mats, false)
            }
            Op::Idle => {
                for _ in 0..8 {
                    d.add_inplace(&mut b.idle.0, &b.idle.1, 1)?;
                }
                Ok(())
            }
            Op::Prefetch => self.prefetch(),
        }
    }

    /// The q/k/v matrices of a GEMV launch into the step's `q`, `k`, `v`, with their biases when
    /// `bias`.
    #[allow(clippy::type_complexity)]
    fn qkv_mats<'b>(
        &'b self,
        (q, k, v): (&'b mut Slice<f32>, &'b mut Slice<f32>, &'b mut Slice<f32>),
        bias: bool,
    ) -> [GemvMat<'b>; 3] {
        let (w, s) = (&self.w, &self.s);
        let b_of = |x: &'b Option<Slice<f32>>| if bias { x.as_ref() } else { None };
        [
            GemvMat {
                w: &w.wq,
                y: q,
                out: s.q_out(),
                bias: b_of(&w.bq),
            },
            GemvMat {
                w: &w.wk,
                y: k,
                out: s.kv_out(),
                bias: b_of(&w.bk),
            },
            GemvMat {
                w: &w.wv,
                y: v,
                out: s.kv_out(),
                bias: b_of(&w.bv),
            },
        ]
    }

    /// µs per replayed run of `ops` (each graph holds `reps` copies of the run), over at most `iters`
    /// replays (fewer for slow runs: about `TIMING_S` seconds).
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
        let t = Instant::now();
        for _ in 0..3 {
            g.replay()?;
        }
        self.dev.stream.synchronize()?;
        let per_replay = t.elapsed().as_secs_f64() / 3.0;
        let iters = ((TIMING_S / per_replay) as usize).clamp(10, iters.max(10));
        let t = Instant::now();
        for _ in 0..iters {
            g.replay()?;
        }
        self.dev.stream.synchronize()?;
        Ok(t.elapsed().as_secs_f64() * 1e6 / (iters * reps) as f64)
    }

    /// One path's figures: the sum of its ops' µs (`op_us`), the whole path as one graph, its bytes
    /// and their time at the HBM peak.
    fn profile_path(
        &self,
        b: &mut Bufs,
        (name, ops): (&str, &[Op]),
        op_us: &dyn Fn(Op) -> f64,
        (ctx, iters): (usize, usize),
    ) -> Result<f64, Error> {
        let sum: f64 = ops.iter().map(|&op| op_us(op)).sum();
        let whole = self.time(b, ops, 1, iters * 4)?;
        let bytes: usize = ops.iter().map(|&op| self.bytes(op, ctx)).sum();
        let bound = bytes as f64 / HBM_PEAK * 1e6;
        println!(
            "| {name}: whole segment (sum of ops {sum:.2}) | {whole:.2} | {:.1} | {:.0} (bound {bound:.1} µs) |",
            bytes as f64 / 1e6,
            bytes as f64 / whole * 1e-3
        );
        // the path after L2 was evicted, without and with its weights prefetched: each less its
        // preamble alone
        let mut after = |pre: &[Op]| -> Result<f64, Error> {
            let with: Vec<Op> = pre.iter().chain(ops).copied().collect();
            Ok(self.time(b, &with, 1, iters)? - self.time(b, pre, 1, iters)?)
        };
        let cold = after(&[Op::Flush, Op::Idle])?;
        let prefetched = after(&[Op::Flush, Op::Prefetch, Op::Idle])?;
        println!(
            "| {name}: cold (L2 evicted) / prefetched ({:.0} MB) | {cold:.2} / {prefetched:.2} | | |",
            self.prefetch_bytes as f64 / 1e6
        );
        Ok(whole)
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
    let (hd, qo, kvo) = (s.hidden, s.q_out(), s.kv_out());
    let st = &dev.stream;
    let inv_freq: Vec<f32> = (0..s.rotary_dim / 2)
        .map(|i| 1e6f32.powf(-2.0 * i as f32 / s.rotary_dim as f32))
        .collect();
    let ones = |n: usize, seed: &mut u64| -> Vec<f32> {
        random(n, 0.2, seed).iter().map(|v| 1.0 + v).collect()
    };
    let mut bias = |n: usize, on: bool| -> Result<Option<Slice<f32>>, Error> {
        Ok(if on {
            Some(st.clone_htod(&random(n, 0.1, seed))?)
        } else {
            None
        })
    };
    let (bq, bk, bv) = (
        bias(qo, s.qkv_bias)?,
        bias(kvo, s.qkv_bias)?,
        bias(kvo, s.qkv_bias)?,
    );
    let correction = bias(s.experts, s.correction_bias)?;
    let shared = match s.shared_inter {
        Some(inter) => Some((
            upload_bf16(dev, &random(2 * inter * hd, 0.03, seed))?,
            upload_bf16(dev, &random(hd * inter, 0.03, seed))?,
        )),
        None => None,
    };
    Ok(Weights {
        attn_norm: st.clone_htod(&ones(hd, seed))?,
        ffn_norm: st.clone_htod(&ones(hd, seed))?,
        wq: upload_bf16(dev, &random(qo * hd, 0.03, seed))?,
        wk: upload_bf16(dev, &random(kvo * hd, 0.03, seed))?,
        wv: upload_bf16(dev, &random(kvo * hd, 0.03, seed))?,
        bq,
        bk,
        bv,
        wo: upload_bf16(dev, &random(hd * qo, 0.02, seed))?,
        q_norm: st.clone_htod(&ones(s.head_dim, seed))?,
        k_norm: st.clone_htod(&ones(s.head_dim, seed))?,
        router: st.clone_htod(&random(s.experts * hd, 0.05, seed))?,
        correction,
        inv_freq: st.clone_htod(&inv_freq)?,
        shared,
        // (zeros: the GEMVs read the same bytes whatever the values)
        lm_head: st.alloc_zeros(s.vocab * hd)?,
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
    let (hd, qo, kvo) = (s.hidden, s.q_out(), s.kv_out());
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
    let inter = s.shared_inter.unwrap_or(1);
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
        gate_up: st.alloc_zeros(rows * 2 * inter)?,
        act: st.alloc_zeros(rows * inter)?,
        vocab_logits: st.alloc_zeros(rows * s.vocab)?,
        flush: (
            st.alloc_zeros(FLUSH_ELEMS)?,
            st.alloc_zeros(rows * FLUSH_ELEMS / hd)?,
        ),
        idle: (st.alloc_zeros(1)?, st.alloc_zeros(1)?),
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

/// What a path leaves: q, attention, residual, the FFN norm's f32 rows, router logits; experts.
type PathOut = ([Vec<f32>; 5], Vec<i32>);

/// One run of each path from the same residual rows and caches: rel-L2 of q, attention, residual,
/// the FFN norm's f32 rows and logits against the old path, whether the experts agree, and which
/// outputs are bit-identical to the shipped path's.
fn compare(bench: &Bench, ctx: usize, seed: u64) -> Result<String, Error> {
    let st = &bench.dev.stream;
    let paths = paths(&bench.s);
    let mut out: Vec<PathOut> = Vec::new();
    for (_, ops) in &paths {
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
    const NAMES: [&str; 5] = [
        "q",
        "attention",
        "residual",
        "FFN norm rows",
        "router logits",
    ];
    let (old, shipped) = (&out[0], &out[2]);
    let mut lines = Vec::new();
    for ((name, _), p) in paths.iter().zip(&out).skip(1) {
        let errs: Vec<String> = (0..5)
            .map(|i| format!("{} {:.1e}", NAMES[i], rel_l2(&p.0[i], &old.0[i])))
            .collect();
        let same: Vec<&str> = (0..5)
            .filter(|&i| p.0[i] == shipped.0[i])
            .map(|i| NAMES[i])
            .collect();
        lines.push(format!(
            "{name} against old: rel-L2 {}; same experts: {}; identical to shipped: {}",
            errs.join(", "),
            p.1 == old.1,
            same.join(", ")
        ));
    }
    Ok(lines.join("\n"))
}

/// The per-op table and each path's whole segment at `rows` rows and context `ctx`.
fn profile(bench: &Bench, ctx: usize, iters: usize, seed: &mut u64) -> Result<(), Error> {
    let (s, n) = (bench.s, bench.rows);
    let mut b = buffers(bench.dev, s, n, ctx, seed)?;
    println!(
        "\n### {} rows {n}, context {ctx} (µs per op, graphs of {REPS} copies)\n",
        s.name
    );
    println!("| op | µs | MB | GB/s |\n|---|---|---|---|");
    let paths = paths(&s);
    let mut ops: Vec<Op> = Vec::new();
    let extra = [Op::LmHeadCublas, Op::LmHeadGemv, Op::Flush, Op::Prefetch];
    let shared: &[Op] = if s.shared_inter.is_some() {
        &[Op::SharedCublas, Op::SharedGemv]
    } else {
        &[]
    };
    for op in paths
        .iter()
        .flat_map(|(_, p)| p.iter())
        .chain(shared)
        .chain(&extra)
    {
        if !ops.contains(op) {
            ops.push(*op);
        }
    }
    let mut times = Vec::new();
    for &op in &ops {
        let us = bench.time(&mut b, &[op], REPS, iters)?;
        let bytes = bench.bytes(op, ctx) as f64;
        println!(
            "| {op:?} | {us:.2} | {:.2} | {:.0} |",
            bytes / 1e6,
            bytes / us * 1e-3
        );
        times.push((op, us));
    }
    let op_us = |op: Op| times.iter().find(|(o, _)| *o == op).map_or(0.0, |t| t.1);
    let mut line = format!("SEGMENT {} rows={n} ctx={ctx}", s.name);
    for (name, p) in &paths {
        let whole = bench.profile_path(&mut b, (name, p), &op_us, (ctx, iters))?;
        line += &format!(" {name}={whole:.1}us");
    }
    println!("{line}");
    println!("{}", compare(bench, ctx, 42 + ctx as u64)?);
    Ok(())
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
    let (mut handoff_rounds, mut prefetch_mb) = (0, 32);
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
                    "glm45air" => GLM45_AIR,
                    s => {
                        return Err(
                            format!("unknown shape {s} (qwen3, smallthinker, glm45air)").into()
                        )
                    }
                }
            }
            "--ctx" => ctxs = list(&val()?)?,
            "--rows" => rows = list(&val()?)?,
            "--iters" => iters = val()?.parse()?,
            "--handoff" => handoff_rounds = val()?.parse()?,
            "--prefetch-mb" => prefetch_mb = val()?.parse()?,
            _ => return Err(format!("unknown argument {a}").into()),
        }
    }
    let dev = GpuDevice::open(0)?;
    println!(
        "{} ({}, {} SMs), shape {}",
        dev.name,
        std::env::var("HOSTNAME").unwrap_or_default(),
        dev.sm_count,
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
            prefetch_bytes: prefetch_mb * 1_000_000,
        };
        for &ctx in &ctxs {
            profile(&bench, ctx, iters, &mut seed)?;
        }
    }
    Ok(())
}
