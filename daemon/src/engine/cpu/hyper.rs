//! The residual stream of a step: one `[n, hidden]` stream, or (GLM-5.3-Flash's manifold-constrained
//! hyper-connections) `m` streams per token, `[n, m, hidden]`.
//!
//! With hyper-connections each block (attention, FFN) reads a weighted sum of the streams (`pre`) and
//! its output is spread back over them (`post`) on top of a mix of the old streams (`comb`, made doubly
//! stochastic by Sinkhorn iterations so the streams' norm cannot grow). The weights come from the
//! streams themselves through a small projection, per token. After the last layer the streams are
//! averaged (the hyper head) before the final norm. transformers: `Glm5NextTextHyperConnection`.
//!
//! Cost per token and block: one `[(2 + m)·m, m·hidden]` projection (24 × 16384 for GLM-5.3-Flash)
//! plus `m`² stream mixing; small beside attention and the experts.
use crate::engine::linear::dot;
use crate::engine::ops::{add_assign, sigmoid, softmax};
use crate::model::hybrid::HyperConfig;
use crate::model::HyperConnection;
use rayon::prelude::*;
use std::borrow::Cow;

/// How one block's output goes back into the streams (per token: `post` `[m]`, `comb` `[m, m]`).
pub struct StreamMix {
    post: Vec<f32>,
    comb: Vec<f32>,
}

pub enum Residual {
    Plain(Vec<f32>),
    Hyper {
        cfg: HyperConfig,
        /// `[n, m, hidden]`
        streams: Vec<f32>,
        /// Unweighted RMSNorm epsilon of the mixing projection's input (the model's rms_norm_eps).
        eps: f32,
    },
}

impl Residual {
    /// The embeddings as the residual: copied into every stream with hyper-connections.
    pub fn new(x: Vec<f32>, hidden: usize, hyper: Option<HyperConfig>, eps: f32) -> Self {
        match hyper {
            None => Self::Plain(x),
            Some(cfg) => {
                let mut streams = Vec::with_capacity(x.len() * cfg.mult);
                for row in x.chunks(hidden) {
                    for _ in 0..cfg.mult {
                        streams.extend_from_slice(row);
                    }
                }
                Self::Hyper { cfg, streams, eps }
            }
        }
    }

    /// The plain stream (the layer input of models without hyper-connections).
    pub fn plain(&self) -> Option<&[f32]> {
        match self {
            Self::Plain(x) => Some(x),
            Self::Hyper { .. } => None,
        }
    }

    /// A block's input `[n, hidden]` (the plain stream itself, borrowed), and how to fold its output
    /// back in. `hc` must be given exactly when the residual has hyper-connections (the model builder
    /// loads one per block).
    pub fn block_input(
        &self,
        hc: Option<&HyperConnection>,
        hidden: usize,
    ) -> (Cow<'_, [f32]>, Option<Vec<StreamMix>>) {
        match (self, hc) {
            (Self::Plain(x), _) => (Cow::Borrowed(x), None),
            (Self::Hyper { cfg, streams, eps }, Some(hc)) => {
                let m = cfg.mult;
                let per_token: Vec<(Vec<f32>, StreamMix)> = streams
                    .par_chunks(m * hidden)
                    .map(|s| collapse(hc, cfg, *eps, s, hidden))
                    .collect();
                let mut input = Vec::with_capacity(per_token.len() * hidden);
                let mut mixes = Vec::with_capacity(per_token.len());
                for (x, mix) in per_token {
                    input.extend(x);
                    mixes.push(mix);
                }
                (Cow::Owned(input), Some(mixes))
            }
            (Self::Hyper { .. }, None) => {
                unreachable!("hyper-connection weights are loaded per layer")
            }
        }
    }

    /// Adds a block's output `y` `[n, hidden]`.
    pub fn add_block_output(&mut self, mix: Option<Vec<StreamMix>>, y: &[f32], hidden: usize) {
        match (self, mix) {
            (Self::Plain(x), _) => add_assign(x, y),
            (Self::Hyper { cfg, streams, .. }, Some(mix)) => {
                let m = cfg.mult;
                streams
                    .par_chunks_mut(m * hidden)
                    .zip(y.par_chunks(hidden))
                    .zip(mix.par_iter())
                    .for_each(|((s, yt), mx)| expand(mx, m, s, yt, hidden));
            }
            (Self::Hyper { .. }, None) => {
                unreachable!("block_input returns a mix for hyper residuals")
            }
        }
    }

    /// The final hidden states `[n, hidden]` (the streams' mean with hyper-connections).
    pub fn into_hidden(self, hidden: usize) -> Vec<f32> {
        match self {
            Self::Plain(x) => x,
            Self::Hyper { cfg, streams, .. } => {
                let m = cfg.mult;
                let mut out = vec![0f32; streams.len() / m];
                for (o, s) in out.chunks_mut(hidden).zip(streams.chunks(m * hidden)) {
                    for stream in s.chunks(hidden) {
                        add_assign(o, stream);
                    }
                    o.iter_mut().for_each(|v| *v /= m as f32);
                }
                out
            }
        }
    }
}

/// One token's streams `s` `[m, hidden]` → the block input and the weights for its output.
fn collapse(
    hc: &HyperConnection,
    cfg: &HyperConfig,
    eps: f32,
    s: &[f32],
    hidden: usize,
) -> (Vec<f32>, StreamMix) {
    let m = cfg.mult;
    let inv = 1.0 / (dot(s, s) / s.len() as f32 + eps).sqrt();
    let width = m * hidden;
    let mixed: Vec<f32> = hc.proj.chunks(width).map(|row| dot(row, s) * inv).collect();
    let (pre_w, rest) = mixed.split_at(m);
    let (post_w, comb_w) = rest.split_at(m);
    let [ps, qs, cs] = hc.scale;
    let pre: Vec<f32> = (0..m)
        .map(|i| sigmoid(pre_w[i] * ps + hc.base[i]) + cfg.eps)
        .collect();
    let post: Vec<f32> = (0..m)
        .map(|i| 2.0 * sigmoid(post_w[i] * qs + hc.base[m + i]))
        .collect();
    let mut comb: Vec<f32> = (0..m * m)
        .map(|i| comb_w[i] * cs + hc.base[2 * m + i])
        .collect();
    for row in comb.chunks_mut(m) {
        softmax(row);
        row.iter_mut().for_each(|v| *v += cfg.eps);
    }
    sinkhorn(&mut comb, m, cfg.sinkhorn_iters, cfg.eps);
    let mut x = vec![0f32; hidden];
    for (i, stream) in s.chunks(hidden).enumerate() {
        for (o, v) in x.iter_mut().zip(stream) {
            *o += pre[i] * v;
        }
    }
    (x, StreamMix { post, comb })
}

/// Column normalisation, then `iters - 1` rounds of row and column normalisation (transformers' order).
fn sinkhorn(c: &mut [f32], m: usize, iters: usize, eps: f32) {
    let cols = |c: &mut [f32]| {
        for j in 0..m {
            let s: f32 = (0..m).map(|i| c[i * m + j]).sum::<f32>() + eps;
            (0..m).for_each(|i| c[i * m + j] /= s);
        }
    };
    cols(c);
    for _ in 1..iters {
        for row in c.chunks_mut(m) {
            let s: f32 = row.iter().sum::<f32>() + eps;
            row.iter_mut().for_each(|v| *v /= s);
        }
        cols(c);
    }
}

/// New streams of one token: `s'[j] = post[j] · y + Σ_i comb[i][j] · s[i]`.
fn expand(mx: &StreamMix, m: usize, s: &mut [f32], y: &[f32], hidden: usize) {
    let old = s.to_vec();
    for j in 0..m {
        let out = &mut s[j * hidden..(j + 1) * hidden];
        for (o, v) in out.iter_mut().zip(y) {
            *o = mx.post[j] * v;
        }
        for i in 0..m {
            let w = mx.comb[i * m + j];
            for (o, v) in out.iter_mut().zip(&old[i * hidden..(i + 1) * hidden]) {
                *o += w * v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinkhorn_makes_rows_and_columns_sum_to_one() {
        let m = 4;
        let mut c: Vec<f32> = (0..m * m)
            .map(|i| ((i * 7 % 5) as f32 + 0.5).exp())
            .collect();
        sinkhorn(&mut c, m, 20, 1e-6);
        for i in 0..m {
            let row: f32 = c[i * m..(i + 1) * m].iter().sum();
            let col: f32 = (0..m).map(|r| c[r * m + i]).sum();
            assert!(
                (row - 1.0).abs() < 1e-3 && (col - 1.0).abs() < 1e-5,
                "{row} {col}"
            );
        }
    }

    #[test]
    fn identity_mixing_adds_post_weighted_output() {
        let (m, hidden) = (2, 3);
        let mix = StreamMix {
            post: vec![1.0, 0.5],
            comb: vec![1.0, 0.0, 0.0, 1.0],
        };
        let mut s = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        expand(&mix, m, &mut s, &[1.0, 1.0, 1.0], hidden);
        assert_eq!(s, vec![2.0, 3.0, 4.0, 4.5, 5.5, 6.5]);
        let r = Residual::Hyper {
            cfg: HyperConfig {
                mult: m,
                sinkhorn_iters: 1,
                eps: 0.0,
            },
            streams: s,
            eps: 1e-6,
        };
        assert_eq!(r.into_hidden(hidden), vec![3.25, 4.25, 5.25]);
    }
}
