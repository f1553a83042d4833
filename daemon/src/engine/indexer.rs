//! The lightning indexer of DeepSeek sparse attention (DSA): for every query token it picks which
//! earlier positions the layer's MLA attention reads. Two variants, as transformers 5.24 has them:
//!
//! - **per token** (GLM-5, `GlmMoeDsaIndexer`): each position's key is `LayerNorm(wk · h)` with
//!   interleaved RoPE on its first `rope_dim` dims; a query scores position p as
//!   `Σ_h w_h · relu(q_h · k_p / √D)` with `q = wq_b · q_resid` (roped likewise) and
//!   `w = weights_proj · h / √H`; the `topk` best of positions `0..=pos` are attended.
//! - **key pool** (GLM-5.3-Flash, `Glm5NextTextIndexer` with `index_kpool`): keys are not roped; each
//!   complete pool of `pool` consecutive positions becomes one key, a per-channel softmax-weighted sum
//!   of its keys with weights from `gate · h` plus a learned per-slot bias (`compress_ape`); the
//!   `topk / pool` best complete pools whose last position is ≤ the query are attended, plus the
//!   incomplete pool that holds the query (always selected).
//!
//! Public interface (all a model needs):
//! - [`IndexerWeights`] (loaded by `model::build`, one per layer with its own indexer),
//! - [`select`]: projects a step's tokens, stores their indexer rows in the layer's KV blocks
//!   ([`LayerRows::c`](super::kv::LayerRows), `IndexerConfig::row_width` floats per position, so they
//!   are shared, copied on write and freed with the MLA latent of the same blocks), and returns a
//!   [`Selection`]; with key pools, a pool's key is computed once, by the step that writes the pool's
//!   last position, and kept in place of that position's (no longer needed) gate logits,
//! - [`Selection::positions`]: what one token attends; layers marked `"shared"` reuse the previous
//!   selection for the same tokens.
//!
//! Wiring a model to it (what GLM-5 and GLM-5.3-Flash do): an [`IndexerConfig`] in
//! `ModelConfig::indexer` (`pooling: KeyPool { pool }` and `rope_dim: 0` for the pooled variant; the
//! pooled variant assumes `index_kpool_always_select_tail`, its config default: reject `false`), an
//! `indexer: Some(SparseAttention::Own(..) | Shared)` on each MLA layer (built by `model::build` from
//! `indexer.layers`), and `engine::cpu::attention::mla_forward`, which runs [`select`] and attends only the
//! selected positions (`layout.rope == false` gives NoPE MLA). `engine::kv::row_widths` sizes the rows.
//!
//! Cost: scoring is `n_heads × head_dim` multiply-adds per (query, earlier position) plus a linear-time
//! top-k; for 128K-token contexts this, not the sparse attention, dominates a decode step's attention.
use super::kv::{slot, BlockId, LayerRows};
use super::linear::{dot, Linear};
use super::rope::Rope;
use super::Segment;
use crate::model::config::{IndexerConfig, IndexerPooling};
use rayon::prelude::*;

/// LayerNorm eps of the indexer's key norm (`nn.LayerNorm(head_dim, eps=1e-6)` in both variants).
const K_NORM_EPS: f32 = 1e-6;

/// The weights of one layer's indexer.
pub struct IndexerWeights {
    /// `[n_heads × head_dim, q_lora_rank]`
    pub wq_b: Linear,
    /// `[head_dim, hidden]`
    pub wk: Linear,
    pub k_norm_weight: Vec<f32>,
    pub k_norm_bias: Vec<f32>,
    /// `[n_heads, hidden]`
    pub weights_proj: Linear,
    /// The key-pool variant's parameters.
    pub pool: Option<KeyPoolWeights>,
}

pub struct KeyPoolWeights {
    /// `index_kpool_compress_ape`: `[pool, head_dim]`, added to the gate logits of each pool slot.
    pub ape: Vec<f32>,
    /// `index_kpool_compress_gate`: `[head_dim, hidden]`, the per-channel gate logits of a position.
    pub gate: Linear,
}

/// Attended positions of every token of a step, in step row order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Selection {
    /// Per token: None = every position `0..=pos`; otherwise the positions, ascending.
    tokens: Vec<Option<Vec<u32>>>,
}

impl Selection {
    /// Every token attends every earlier position (dense attention).
    pub fn all(tokens: usize) -> Self {
        Self {
            tokens: vec![None; tokens],
        }
    }

    /// From explicit per-token lists (None = all positions up to the token's own).
    pub fn from_lists(tokens: Vec<Option<Vec<u32>>>) -> Self {
        Self { tokens }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The positions token `t` (row in the step, at absolute position `pos`) attends, ascending.
    pub fn positions(&self, t: usize, pos: usize) -> Positions<'_> {
        match self.tokens.get(t).and_then(Option::as_ref) {
            Some(list) => Positions::List(list.iter()),
            None => Positions::All(0..=pos),
        }
    }
}

/// Iterator over the positions one token attends ([`Selection::positions`]).
#[derive(Clone)]
pub enum Positions<'a> {
    All(std::ops::RangeInclusive<usize>),
    List(std::slice::Iter<'a, u32>),
}

impl Iterator for Positions<'_> {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        match self {
            Self::All(r) => r.next(),
            Self::List(l) => l.next().map(|&p| p as usize),
        }
    }
}

/// In place LayerNorm of one row.
fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    for ((v, w), b) in x.iter_mut().zip(w).zip(b) {
        *v = (*v - mean) * inv * w + b;
    }
}

/// Indices of the `k` largest scores, ties to the lower index, returned ascending. Linear time.
fn top_k_ascending(scores: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..scores.len() as u32).collect();
    if k < idx.len() {
        let cmp = |a: &u32, b: &u32| {
            scores[*b as usize]
                .total_cmp(&scores[*a as usize])
                .then(a.cmp(b))
        };
        idx.select_nth_unstable_by(k, cmp);
        idx.truncate(k);
    }
    idx.sort_unstable();
    idx
}

/// Runs the indexer of one layer over a step: `h` the normalised layer input `[n, hidden]`, `q_resid`
/// the q-LoRA output after its norm `[n, q_lora_rank]`. Writes each token's indexer row at its slot
/// (the blocks must be reserved) and returns what each token attends.
#[allow(clippy::too_many_arguments)]
pub fn select(
    w: &IndexerWeights,
    cfg: &IndexerConfig,
    rope: &Rope,
    h: &[f32],
    q_resid: &[f32],
    segments: &[Segment],
    tables: &[&[BlockId]],
    rows: &mut LayerRows,
) -> Selection {
    let n = segments.iter().map(|s| s.len).sum::<usize>();
    let (nh, d) = (cfg.n_heads, cfg.head_dim);
    let mut q = w.wq_b.forward(q_resid, n);
    let mut k = w.wk.forward(h, n);
    let mut weights = w.weights_proj.forward(h, n);
    let head_weight = (nh as f32).powf(-0.5);
    weights.iter_mut().for_each(|x| *x *= head_weight);
    let gate = w.pool.as_ref().map(|p| p.gate.forward(h, n));
    let width = cfg.row_width();
    let mut row = vec![0f32; width];
    for (seg, table) in segments.iter().zip(tables) {
        for i in 0..seg.len {
            let (t, pos) = (seg.row0 + i, seg.pos0 + i);
            let kt = &mut k[t * d..(t + 1) * d];
            layer_norm(kt, &w.k_norm_weight, &w.k_norm_bias, K_NORM_EPS);
            if cfg.rope_dim > 0 {
                let (cos, sin) = rope.cos_sin(pos);
                rope.apply(kt, d, &cos, &sin);
                rope.apply(&mut q[t * nh * d..(t + 1) * nh * d], d, &cos, &sin);
            }
            row[..d].copy_from_slice(kt);
            if let Some(g) = &gate {
                row[d..].copy_from_slice(&g[t * d..(t + 1) * d]);
            }
            rows.write_c(slot(table, pos), &row);
        }
    }
    if let (IndexerPooling::KeyPool { pool }, Some(pw)) = (cfg.pooling, &w.pool) {
        for (seg, table) in segments.iter().zip(tables) {
            complete_pools(rows, table, seg.pos0..seg.pos0 + seg.len, pool, d, &pw.ape);
        }
    }
    let rows = &*rows;
    let scale = (d as f32).powf(-0.5);
    // Σ_h w_h · relu(q_h · key · scale) for token t.
    let score = |t: usize, key: &[f32]| -> f32 {
        (0..nh)
            .map(|hh| {
                let s = dot(&q[(t * nh + hh) * d..(t * nh + hh + 1) * d], key) * scale;
                weights[t * nh + hh] * s.max(0.0)
            })
            .sum()
    };
    let mut out = Vec::with_capacity(n);
    for (s, seg) in segments.iter().enumerate() {
        let table = tables[s];
        let per_token: Vec<Option<Vec<u32>>> = match (cfg.pooling, &w.pool) {
            (IndexerPooling::KeyPool { pool }, Some(_)) => {
                // each complete pool's key, in its last slot's gate columns
                let key = |j: usize| &rows.c_row(slot(table, j * pool + pool - 1))[d..2 * d];
                (0..seg.len)
                    .into_par_iter()
                    .map(|i| {
                        let (t, pos) = (seg.row0 + i, seg.pos0 + i);
                        let visible = (pos + 1) / pool;
                        let scores: Vec<f32> = (0..visible).map(|j| score(t, key(j))).collect();
                        let chosen = top_k_ascending(&scores, (cfg.topk / pool).min(visible));
                        let mut list: Vec<u32> = chosen
                            .iter()
                            .flat_map(|&j| j as usize * pool..(j as usize + 1) * pool)
                            .map(|p| p as u32)
                            .collect();
                        // the query's own, incomplete pool
                        list.extend((visible * pool..=pos).map(|p| p as u32));
                        Some(list)
                    })
                    .collect()
            }
            _ => (0..seg.len)
                .into_par_iter()
                .map(|i| {
                    let (t, pos) = (seg.row0 + i, seg.pos0 + i);
                    if pos < cfg.topk {
                        return None; // every earlier position fits the budget
                    }
                    let scores: Vec<f32> = (0..=pos)
                        .map(|p| score(t, &rows.c_row(slot(table, p))[..d]))
                        .collect();
                    Some(top_k_ascending(&scores, cfg.topk))
                })
                .collect(),
        };
        out.extend(per_token);
    }
    Selection { tokens: out }
}

/// For each position of `written` that ends a pool (`(p + 1) % pool == 0`): that pool's key, per
/// channel the softmax over the pool's slots of `gate + ape[slot]` weighing the slots' keys, stored in
/// the gate columns (`d..2d`) of the pool's last slot. A complete pool's gate logits are not read again,
/// so each pooled key is computed once per sequence, when its pool gains its last key (the GPU's
/// `idx_pool_complete` does the same). Every slot of the pool must be written already.
fn complete_pools(
    rows: &mut LayerRows,
    table: &[BlockId],
    written: std::ops::Range<usize>,
    pool: usize,
    d: usize,
    ape: &[f32],
) {
    let mut logits = vec![0f32; pool];
    for last in written.filter(|p| (p + 1) % pool == 0) {
        let first = last + 1 - pool;
        let mut key = vec![0f32; d];
        {
            let slots: Vec<&[f32]> = (first..=last).map(|p| rows.c_row(slot(table, p))).collect();
            for (c, out) in key.iter_mut().enumerate() {
                for (i, r) in slots.iter().enumerate() {
                    logits[i] = r[d + c] + ape[i * d + c];
                }
                super::ops::softmax(&mut logits);
                *out = slots.iter().zip(&logits).map(|(r, p)| p * r[c]).sum();
            }
        }
        let at = slot(table, last);
        let mut row = rows.c_row(at).to_vec();
        row[d..2 * d].copy_from_slice(&key);
        rows.write_c(at, &row);
    }
}

#[cfg(test)]
#[path = "indexer_tests.rs"]
mod tests;
