//! KDA-style gated delta-rule linear attention (GLM-5.3-Flash's linear layers), CPU backend.
//!
//! Per token: q, k, v projections through a short depthwise causal convolution and SiLU; q and k
//! L2-normalised per head (q also scaled by 1/√d); a per-channel forget gate `g` (log decay, ≤ 0) and a
//! per-head write strength β. Each head keeps a `d × d` state S (keys × values):
//!
//! ```text
//! S ← diag(exp g) · S;   S ← S + k ⊗ β (v − Sᵀk);   o = Sᵀ q
//! ```
//!
//! then a gated RMSNorm per head and the output projection. Decode steps run that recurrence token by
//! token ([`kda_recurrent`]); prefill chunks run the chunked (WY) form ([`kda_chunked`]), which gives the
//! same numbers with matrix products over `CHUNK` tokens, as transformers' `chunk_kimi_delta_attention`.
//! Both carry the state across steps, so chunked prefill and decode continue one another exactly.
//!
//! Cost per token and head: about 4·d² flops for the recurrence (d = 128 in GLM-5.3-Flash: 64k), the
//! projections dominate as in attention layers; the state is 64 KiB per head in f32.
use crate::engine::kv::recurrent::{LinearLayerState, RecurrentState};
use crate::engine::linear::dot;
use crate::engine::moe::activate;
use crate::engine::ops::sigmoid;
use crate::engine::Segment;
use crate::model::config::Activation;
use crate::model::config::ModelConfig;
use crate::model::hybrid::LinearAttentionConfig;
use crate::model::LinearAttention;
use rayon::prelude::*;

/// Tokens per block of the chunked form (transformers' default).
pub const CHUNK: usize = 64;

/// The layer over every segment of a step: `h` holds the normalised layer inputs `[n, hidden]`;
/// `states[s]` is segment `s`'s state (advanced here). Returns `[n, hidden]`.
pub fn linear_attention_forward(
    la: &LinearAttention,
    cfg: &ModelConfig,
    li: usize,
    h: &[f32],
    segments: &[Segment],
    states: &mut [&mut RecurrentState],
) -> Vec<f32> {
    let shape = cfg
        .linear_attention
        .expect("a linear-attention layer has its config");
    let n = h.len() / cfg.hidden_size;
    let qkv = shape.qkv_dim();
    let qkv_rows = crate::engine::linear::forward_many([&la.q, &la.k, &la.v], h, n);
    // the convolution's outputs `[n, 3·qkv]` (q | k | v per row), read straight from the projections
    let mut mixed = vec![0f32; n * 3 * qkv];
    let g = forget_gate(la, &shape, h, n);
    let beta: Vec<f32> = la.b.forward(h, n).into_iter().map(sigmoid).collect();
    let gate = la.g_b.forward(&la.g_a.forward(h, n), n);
    let mut core = vec![0f32; n * qkv];
    for (s, seg) in segments.iter().enumerate() {
        let state = states[s]
            .layer_mut(li)
            .expect("the engine checks every cache has linear-attention state");
        let rows = seg.row0..seg.row0 + seg.len;
        let x = &mut mixed[rows.start * 3 * qkv..rows.end * 3 * qkv];
        let inputs = qkv_rows
            .each_ref()
            .map(|p| &p[rows.start * qkv..rows.end * qkv]);
        short_conv(&la.conv, &shape, cfg.activation, inputs, &mut state.conv, x);
        let out = &mut core[rows.start * qkv..rows.end * qkv];
        let g = &g[rows.start * qkv..rows.end * qkv];
        let beta = &beta[rows.start * shape.num_heads..rows.end * shape.num_heads];
        delta_rule(&shape, x, g, beta, state, out);
    }
    drop(qkv_rows);
    gated_rms_norm(&mut core, &gate, &la.o_norm, cfg.rms_norm_eps);
    la.o.forward(&core, n)
}

/// Log decay per channel `[n, qkv]`: `lower_bound · sigmoid(exp(A_log) · (f + dt_bias))`, or without a
/// bound `-exp(A_log) · softplus(f + dt_bias)` (softplus linear above 20, as transformers).
fn forget_gate(
    la: &LinearAttention,
    shape: &LinearAttentionConfig,
    h: &[f32],
    n: usize,
) -> Vec<f32> {
    let qkv = shape.qkv_dim();
    let mut g = la.f_b.forward(&la.f_a.forward(h, n), n);
    for row in g.chunks_mut(qkv) {
        for (c, x) in row.iter_mut().enumerate() {
            let rate = la.a_log[c / shape.head_dim].exp();
            let raw = *x + la.dt_bias[c];
            *x = match shape.lower_bound {
                Some(lb) => lb * sigmoid(rate * raw),
                None => -rate * if raw > 20.0 { raw } else { raw.exp().ln_1p() },
            };
        }
    }
    g
}

/// Depthwise causal convolution and the model's activation (`hidden_act`: SiLU) over one segment's
/// rows: `inputs` the q, k and v projections `[len, qkv]` each (the channels q | k | v), `out`
/// `[len, 3·qkv]`; `tail` holds the `kernel - 1` input rows before the segment (oldest first,
/// `[kernel - 1, 3·qkv]`) and is advanced to the segment's end. Reads the projections and the tail
/// where they are (a decode step copies nothing but the new tail row).
fn short_conv(
    weight: &[f32],
    shape: &LinearAttentionConfig,
    act: Activation,
    inputs: [&[f32]; 3],
    tail: &mut [f32],
    out: &mut [f32],
) {
    let qkv = shape.qkv_dim();
    let ch = 3 * qkv;
    let kern = shape.conv_kernel;
    let past = kern - 1;
    let len = out.len() / ch;
    // Input row `i` of history-then-segment (`i < past`: the tail), part `p` (q, k, v).
    fn row<'a>(
        tail: &'a [f32],
        inputs: &[&'a [f32]; 3],
        (past, qkv): (usize, usize),
        i: usize,
        p: usize,
    ) -> &'a [f32] {
        if i < past {
            &tail[(i * 3 + p) * qkv..(i * 3 + p + 1) * qkv]
        } else {
            &inputs[p][(i - past) * qkv..(i - past + 1) * qkv]
        }
    }
    let history = &*tail;
    out.par_chunks_mut(ch).enumerate().for_each(|(t, o)| {
        for (p, o) in o.chunks_mut(qkv).enumerate() {
            for (cc, o) in o.iter_mut().enumerate() {
                let c = p * qkv + cc;
                let w = &weight[c * kern..(c + 1) * kern];
                // Output t reads input rows t .. t + kern - 1 (the last is token t itself).
                let acc: f32 = (0..kern)
                    .map(|j| w[j] * row(history, &inputs, (past, qkv), t + j, p)[cc])
                    .sum();
                *o = activate(act, acc);
            }
        }
    });
    // The new tail: the last `past` input rows (some may still come from the old tail).
    let mut next = vec![0f32; past * ch];
    for (r, dst) in next.chunks_mut(ch).enumerate() {
        for (p, d) in dst.chunks_mut(qkv).enumerate() {
            d.copy_from_slice(row(tail, &inputs, (past, qkv), len + r, p));
        }
    }
    tail.copy_from_slice(&next);
}

/// x / sqrt(Σx² + 1e-6), as transformers' `l2norm` (FLA's epsilon convention).
fn l2_normalise(x: &mut [f32]) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Per head, the prepared inputs of one segment: q (normalised, scaled), k (normalised), v, g, β.
struct HeadInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

impl HeadInputs {
    fn seq(&self, d: usize) -> HeadSeq<'_> {
        HeadSeq {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            g: &self.g,
            beta: &self.beta,
            d,
        }
    }
}

/// One head's recurrence inputs over `beta.len()` tokens: `q, k, v, g` `[len, d]` (q normalised and
/// scaled, k normalised, g the log decay), `beta` `[len]`.
#[derive(Clone, Copy)]
pub struct HeadSeq<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
    pub d: usize,
}

impl<'a> HeadSeq<'a> {
    /// Tokens `r` of the sequence.
    fn tokens(&self, r: std::ops::Range<usize>) -> HeadSeq<'a> {
        let d = self.d;
        let rows = r.start * d..r.end * d;
        HeadSeq {
            q: &self.q[rows.clone()],
            k: &self.k[rows.clone()],
            v: &self.v[rows.clone()],
            g: &self.g[rows],
            beta: &self.beta[r],
            d,
        }
    }
}

fn head_inputs(
    shape: &LinearAttentionConfig,
    head: usize,
    x: &[f32],
    g: &[f32],
    beta: &[f32],
) -> HeadInputs {
    let (d, qkv, heads) = (shape.head_dim, shape.qkv_dim(), shape.num_heads);
    let len = x.len() / (3 * qkv);
    let scale = (d as f32).powf(-0.5);
    let mut hi = HeadInputs {
        q: Vec::with_capacity(len * d),
        k: Vec::with_capacity(len * d),
        v: Vec::with_capacity(len * d),
        g: Vec::with_capacity(len * d),
        beta: Vec::with_capacity(len),
    };
    for t in 0..len {
        let row = &x[t * 3 * qkv..(t + 1) * 3 * qkv];
        let at = |part: usize| &row[part * qkv + head * d..part * qkv + (head + 1) * d];
        let mut q = at(0).to_vec();
        l2_normalise(&mut q);
        hi.q.extend(q.iter().map(|v| v * scale));
        let mut k = at(1).to_vec();
        l2_normalise(&mut k);
        hi.k.extend(k);
        hi.v.extend_from_slice(at(2));
        hi.g.extend_from_slice(&g[t * qkv + head * d..t * qkv + (head + 1) * d]);
        hi.beta.push(beta[t * heads + head]);
    }
    hi
}

/// Runs every head of one segment from `state`, writing `[len, qkv]` outputs and the advanced state.
fn delta_rule(
    shape: &LinearAttentionConfig,
    x: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut LinearLayerState,
    out: &mut [f32],
) {
    let (d, qkv) = (shape.head_dim, shape.qkv_dim());
    let len = x.len() / (3 * qkv);
    let per_head: Vec<Vec<f32>> = state
        .matrix
        .par_chunks_mut(d * d)
        .enumerate()
        .map(|(head, s)| {
            let hi = head_inputs(shape, head, x, g, beta);
            if len == 1 {
                kda_recurrent(&hi.seq(d), s)
            } else {
                kda_chunked(&hi.seq(d), s)
            }
        })
        .collect();
    for (head, o) in per_head.iter().enumerate() {
        for t in 0..len {
            out[t * qkv + head * d..t * qkv + (head + 1) * d]
                .copy_from_slice(&o[t * d..(t + 1) * d]);
        }
    }
}

/// The recurrence token by token for one head, `s` the `[d (key), d (value)]` state, advanced in
/// place. Returns `[len, d]`.
pub fn kda_recurrent(x: &HeadSeq<'_>, s: &mut [f32]) -> Vec<f32> {
    let HeadSeq {
        q,
        k,
        v,
        g,
        beta,
        d,
    } = *x;
    let len = beta.len();
    let mut out = vec![0f32; len * d];
    let mut mem = vec![0f32; d];
    for t in 0..len {
        let (qt, kt, vt, gt) = (
            &q[t * d..(t + 1) * d],
            &k[t * d..(t + 1) * d],
            &v[t * d..(t + 1) * d],
            &g[t * d..(t + 1) * d],
        );
        mem.fill(0.0);
        for i in 0..d {
            let row = &mut s[i * d..(i + 1) * d];
            let decay = gt[i].exp();
            row.iter_mut().for_each(|x| *x *= decay);
            for (m, x) in mem.iter_mut().zip(row.iter()) {
                *m += x * kt[i];
            }
        }
        let delta: Vec<f32> = vt
            .iter()
            .zip(&mem)
            .map(|(v, m)| (v - m) * beta[t])
            .collect();
        let o = &mut out[t * d..(t + 1) * d];
        for i in 0..d {
            let row = &mut s[i * d..(i + 1) * d];
            for (x, dl) in row.iter_mut().zip(&delta) {
                *x += kt[i] * dl;
            }
            for (oj, x) in o.iter_mut().zip(row.iter()) {
                *oj += x * qt[i];
            }
        }
    }
    out
}

/// The chunked (WY) form for one head, same contract as [`kda_recurrent`]: within each block of
/// [`CHUNK`] tokens the intra-block interactions are solved as a unit-lower-triangular system and the
/// state is applied and updated once per block.
pub fn kda_chunked(x: &HeadSeq<'_>, s: &mut [f32]) -> Vec<f32> {
    let (len, d) = (x.beta.len(), x.d);
    let mut out = vec![0f32; len * d];
    let mut c0 = 0;
    while c0 < len {
        let c = CHUNK.min(len - c0);
        let o = chunk_step(&x.tokens(c0..c0 + c), s);
        out[c0 * d..(c0 + c) * d].copy_from_slice(&o);
        c0 += c;
    }
    out
}

/// One block of `c` tokens of the chunked form.
fn chunk_step(x: &HeadSeq<'_>, s: &mut [f32]) -> Vec<f32> {
    let HeadSeq {
        q,
        k,
        v,
        g,
        beta,
        d,
    } = *x;
    let c = beta.len();
    // Cumulative log decay within the block, per channel.
    let mut gc = g.to_vec();
    for t in 1..c {
        for i in 0..d {
            gc[t * d + i] += gc[(t - 1) * d + i];
        }
    }
    // decayed dot product: Σ_i a[i] b[i] exp(G[t][i] - G[u][i])  (u ≤ t)
    let ddot = |a: &[f32], t: usize, b: &[f32], u: usize| -> f32 {
        (0..d)
            .map(|i| a[i] * b[i] * (gc[t * d + i] - gc[u * d + i]).exp())
            .sum()
    };
    // A[t][u] (u < t) = -β_t Σ k_t k_u exp(G_t - G_u); then (I - L)⁻¹ by forward substitution.
    let mut a = vec![0f32; c * c];
    for t in 0..c {
        for u in 0..t {
            a[t * c + u] = -beta[t] * ddot(&k[t * d..(t + 1) * d], t, &k[u * d..(u + 1) * d], u);
        }
    }
    for t in 1..c {
        for u in 0..t {
            let mut acc = a[t * c + u];
            for m in u + 1..t {
                acc += a[t * c + m] * a[m * c + u];
            }
            a[t * c + u] = acc;
        }
    }
    for t in 0..c {
        a[t * c + t] = 1.0;
    }
    // U = A · (β v), W = A · (β k exp(G)).
    let mut uu = vec![0f32; c * d];
    let mut w = vec![0f32; c * d];
    for t in 0..c {
        for m in 0..=t {
            let coef = a[t * c + m] * beta[m];
            if coef == 0.0 {
                continue;
            }
            for i in 0..d {
                uu[t * d + i] += coef * v[m * d + i];
                w[t * d + i] += coef * k[m * d + i] * gc[m * d + i].exp();
            }
        }
    }
    // v_new = U - W · S
    let mut v_new = uu;
    for t in 0..c {
        for i in 0..d {
            let wi = w[t * d + i];
            if wi == 0.0 {
                continue;
            }
            for (x, sv) in v_new[t * d..(t + 1) * d]
                .iter_mut()
                .zip(&s[i * d..(i + 1) * d])
            {
                *x -= wi * sv;
            }
        }
    }
    // o_t = (q_t exp(G_t)) · S + Σ_{u ≤ t} (decayed q_t·k_u) v_new_u
    let mut out = vec![0f32; c * d];
    for t in 0..c {
        let o = &mut out[t * d..(t + 1) * d];
        for i in 0..d {
            let qi = q[t * d + i] * gc[t * d + i].exp();
            for (x, sv) in o.iter_mut().zip(&s[i * d..(i + 1) * d]) {
                *x += qi * sv;
            }
        }
        for u in 0..=t {
            let coef = ddot(&q[t * d..(t + 1) * d], t, &k[u * d..(u + 1) * d], u);
            for (x, vn) in o.iter_mut().zip(&v_new[u * d..(u + 1) * d]) {
                *x += coef * vn;
            }
        }
    }
    // S ← diag(exp G_last) S + Σ_u (k_u exp(G_last - G_u)) ⊗ v_new_u
    let last = c - 1;
    for i in 0..d {
        let decay = gc[last * d + i].exp();
        let row = &mut s[i * d..(i + 1) * d];
        row.iter_mut().for_each(|x| *x *= decay);
        for u in 0..c {
            let ku = k[u * d + i] * (gc[last * d + i] - gc[u * d + i]).exp();
            for (x, vn) in row.iter_mut().zip(&v_new[u * d..(u + 1) * d]) {
                *x += ku * vn;
            }
        }
    }
    out
}

/// Per head of `head_dim` = `weight.len()`: RMSNorm · weight, times sigmoid(gate), in place.
fn gated_rms_norm(x: &mut [f32], gate: &[f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    for (row, gr) in x.chunks_mut(d).zip(gate.chunks(d)) {
        let inv = 1.0 / (dot(row, row) / d as f32 + eps).sqrt();
        for ((v, w), g) in row.iter_mut().zip(weight).zip(gr) {
            *v = *v * inv * w * sigmoid(*g);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    /// The chunked form equals the recurrence, over several blocks and from a non-zero state, and both
    /// leave the same state behind.
    #[test]
    fn chunked_form_equals_recurrence() {
        let (d, len) = (8, 2 * CHUNK + 5);
        let mut seed = 7;
        let mut vecs = |n: usize, f: &dyn Fn(f32) -> f32| -> Vec<f32> {
            (0..n).map(|_| f(lcg(&mut seed))).collect()
        };
        let mut q = vecs(len * d, &|x| x);
        let mut k = vecs(len * d, &|x| x);
        for t in 0..len {
            l2_normalise(&mut q[t * d..(t + 1) * d]);
            l2_normalise(&mut k[t * d..(t + 1) * d]);
        }
        let v = vecs(len * d, &|x| 2.0 * x);
        let g = vecs(len * d, &|x| -5.0 * sigmoid(4.0 * x));
        let beta = vecs(len, &|x| sigmoid(4.0 * x));
        let s0 = vecs(d * d, &|x| x);
        let (mut s_rec, mut s_chunk) = (s0.clone(), s0);
        let x = HeadSeq {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
            d,
        };
        let o_rec = kda_recurrent(&x, &mut s_rec);
        let o_chunk = kda_chunked(&x, &mut s_chunk);
        let err = |a: &[f32], b: &[f32]| {
            let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
            let den: f32 = b.iter().map(|y| y * y).sum();
            (num / den).sqrt()
        };
        assert!(err(&o_chunk, &o_rec) < 1e-5, "{}", err(&o_chunk, &o_rec));
        assert!(err(&s_chunk, &s_rec) < 1e-5, "{}", err(&s_chunk, &s_rec));
    }

    /// The convolution over a segment is its definition (zero history before the first token, q, k
    /// and v read from their own projections), and over a split segment equals it over the whole (the
    /// tail carries the history): bit for bit.
    #[test]
    fn short_conv_carries_its_tail() {
        let shape = LinearAttentionConfig {
            num_heads: 1,
            head_dim: 2,
            conv_kernel: 4,
            lower_bound: None,
        };
        let (qkv, ch, len) = (2, 6, 7);
        let mut seed = 3;
        let w: Vec<f32> = (0..ch * 4).map(|_| lcg(&mut seed)).collect();
        let proj: [Vec<f32>; 3] =
            std::array::from_fn(|_| (0..len * qkv).map(|_| lcg(&mut seed)).collect());
        let input = |t: usize, c: usize| proj[c / qkv][t * qkv + c % qkv];
        let parts_of = |rows: std::ops::Range<usize>| {
            proj.each_ref()
                .map(|p| &p[rows.start * qkv..rows.end * qkv])
        };
        let mut whole = vec![0f32; len * ch];
        let mut tail = vec![0f32; 3 * ch];
        short_conv(
            &w,
            &shape,
            Activation::Silu,
            parts_of(0..len),
            &mut tail,
            &mut whole,
        );
        for t in 0..len {
            for c in 0..ch {
                let acc: f32 = (0..4)
                    .filter(|&j| t + j >= 3)
                    .map(|j| w[c * 4 + j] * input(t + j - 3, c))
                    .sum();
                let want = activate(Activation::Silu, acc);
                assert!((whole[t * ch + c] - want).abs() <= 1e-6 * want.abs().max(1.0));
            }
        }
        let mut parts = vec![0f32; len * ch];
        let mut tail2 = vec![0f32; 3 * ch];
        for rows in [0..2, 2..3, 3..len] {
            let out = &mut parts[rows.start * ch..rows.end * ch];
            short_conv(
                &w,
                &shape,
                Activation::Silu,
                parts_of(rows),
                &mut tail2,
                out,
            );
        }
        assert_eq!(tail, tail2);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&parts), bits(&whole));
    }
}
