//! Memory of hybrid-attention models by layer kind, the one accounting the daemon (from its loaded
//! `ModelConfig`) and the operator (from `config.json`, [`crate::glm`]) both use:
//!
//! - linear-attention (KDA) layers keep no rows per position, a fixed recurrent state per sequence
//!   (`heads × head_dim²` f32 matrices plus the convolution's last `kernel − 1` q, k, v inputs);
//! - attention layers keep their K/V (MLA: latent + rope key) rows per position, and those running
//!   their own sparse-attention indexer also the indexer's f32 key row (and the key pool's gate logits);
//! - every step row holds the hybrid step buffers (residual streams, linear-attention intermediates,
//!   indexer projections and selection), counted by [`HybridLayers::step_row_values`].
use crate::shape::HybridShape;

/// Shape of the KDA linear-attention layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearDims {
    pub heads: u64,
    /// Key and value width per head (one head's state is `head_dim × head_dim`).
    pub head_dim: u64,
    /// Taps of the causal convolution over q, k and v.
    pub conv_kernel: u64,
}

impl LinearDims {
    /// Width of q, k and v each.
    pub fn qkv_dim(&self) -> u64 {
        self.heads * self.head_dim
    }

    /// f32 values of one sequence's state in one layer: the recurrent matrices plus the last
    /// `conv_kernel − 1` inputs of the convolution for q, k and v. Fixed, whatever the context length.
    pub fn state_floats(&self) -> u64 {
        self.heads * self.head_dim * self.head_dim
            + 3 * self.qkv_dim() * self.conv_kernel.saturating_sub(1)
    }
}

/// What the indexer's candidates are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexerKeys {
    /// One key per position (DeepSeek sparse attention, GLM-5).
    PerToken,
    /// Keys pooled `pool` positions at a time by a gated softmax (GLM-5.3-Flash's `index_kpool`).
    Pooled { pool: u64 },
}

/// Shape of the lightning indexer of sparse-attention layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexerDims {
    pub heads: u64,
    pub head_dim: u64,
    /// Positions selected per query.
    pub topk: u64,
    pub keys: IndexerKeys,
}

impl IndexerDims {
    /// f32 values per position a layer with its own indexer keeps: the key, plus the pool gate's
    /// logits for pooled keys.
    pub fn row_floats(&self) -> u64 {
        match self.keys {
            IndexerKeys::PerToken => self.head_dim,
            IndexerKeys::Pooled { .. } => 2 * self.head_dim,
        }
    }

    /// Positions per candidate (the pool size, or 1).
    pub fn unit(&self) -> u64 {
        match self.keys {
            IndexerKeys::PerToken => 1,
            IndexerKeys::Pooled { pool } => pool,
        }
    }

    /// Positions one query's selection lists at most: `topk / unit` candidates of `unit` positions,
    /// plus its own incomplete pool.
    pub fn selection_stride(&self) -> u64 {
        let unit = self.unit();
        (self.topk / unit) * unit + unit
    }
}

/// The token mixer of one layer, as far as memory goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Linear attention: recurrent state, no rows per position.
    Linear,
    /// Softmax attention over cached rows; `own_indexer`: runs its own indexer (keeps its key rows)
    /// rather than reusing an earlier layer's selection or having none.
    Attention { own_indexer: bool },
}

/// Values of the hyper-connection mixing weights per row for `m` streams (pre, post and the `m × m`
/// residual mix; the kernels' `mix_width`).
pub fn hyper_mix_width(m: u64) -> u64 {
    2 * m + m * m
}

/// Everything a hybrid-attention model's memory depends on beyond the attention shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HybridLayers {
    pub hidden: u64,
    /// One entry per decoder layer.
    pub kinds: Vec<LayerKind>,
    /// The linear layers' shape (`None` when no layer is linear).
    pub linear: Option<LinearDims>,
    pub indexer: Option<IndexerDims>,
    /// Residual streams of the hyper-connections (`hc_mult`), `None` without them.
    pub hyper_streams: Option<u64>,
    /// Width of the indexer's query input (MLA's q-LoRA rank).
    pub q_rank: u64,
}

impl HybridLayers {
    pub fn linear_layers(&self) -> u64 {
        self.kinds
            .iter()
            .filter(|k| **k == LayerKind::Linear)
            .count() as u64
    }

    /// Layers keeping indexer rows (only where an indexer exists).
    pub fn indexer_layers(&self) -> u64 {
        if self.indexer.is_none() {
            return 0;
        }
        let own = LayerKind::Attention { own_indexer: true };
        self.kinds.iter().filter(|k| **k == own).count() as u64
    }

    /// Values (f32-sized; bf16 ones counted whole, an upper bound) per step row of the GPU's hybrid
    /// step buffers, score rows not included.
    pub fn step_row_values(&self) -> u64 {
        let hd = self.hidden;
        let mut v = 3 + 2; // segment index (row0, len, seg_of_row) and a state-table address per row
        if let Some(m) = self.hyper_streams {
            // streams, mixing weights, the streams' projection onto (2 + m)·m outputs
            v += m * hd + hyper_mix_width(m) + (2 + m) * m;
        }
        if let Some(la) = self.linear_dims() {
            let w = la.qkv_dim();
            // raw, mixed q/k/v; low-rank middle f32 + bf16 (rank = head_dim); g, gate, core, normed; β
            v += 6 * w + 2 * la.head_dim + 4 * w + la.heads;
        }
        if let Some(ix) = &self.indexer {
            let (nh, d) = (ix.heads, ix.head_dim);
            // normalised input f32 + bf16; q, key, head weights, pool gate; selection list and length
            v += 2 * hd + nh * d + 2 * d + nh + ix.selection_stride() + 1;
        }
        v
    }

    /// The linear layers' shape where some layer is linear.
    fn linear_dims(&self) -> Option<LinearDims> {
        self.linear.filter(|_| self.linear_layers() > 0)
    }

    /// f32 weights of one layer's own indexer as the GPU holds them: the query projection from the
    /// q-LoRA rank, the key projection, the head weights, the key norm, and for pooled keys the pool's
    /// position embedding and gate projection.
    pub fn indexer_weight_floats(&self) -> u64 {
        let Some(ix) = &self.indexer else { return 0 };
        let (nh, d, h) = (ix.heads, ix.head_dim, self.hidden);
        let pool = match ix.keys {
            IndexerKeys::PerToken => 0,
            IndexerKeys::Pooled { pool } => pool * d + d * h,
        };
        nh * d * self.q_rank + d * h + nh * h + 2 * d + pool
    }

    /// f32 weights of one layer's two hyper-connections: `[(2 + m)·m, m·hidden]` projections and
    /// `(2 + m)·m` biases each.
    pub fn hyper_weight_floats(&self) -> u64 {
        self.hyper_streams
            .map_or(0, |m| 2 * ((2 + m) * m * m * self.hidden + (2 + m) * m))
    }

    /// The sizing model's summary of these layers.
    pub fn shape(&self) -> HybridShape {
        let la = self.linear_dims();
        HybridShape {
            linear_layers: self.linear_layers(),
            state_floats: la.map_or(0, |l| l.state_floats()),
            indexer_layers: self.indexer_layers(),
            indexer_row_floats: self.indexer.map_or(0, |ix| ix.row_floats()),
            indexer_unit: self.indexer.map_or(0, |ix| ix.unit()),
            step_row_values: self.step_row_values(),
            linear_heads: la.map_or(0, |l| l.heads),
            linear_head_dim: la.map_or(0, |l| l.head_dim),
            conv_kernel: la.map_or(0, |l| l.conv_kernel),
            indexer_weight_floats: self.indexer_weight_floats(),
            hyper_weight_floats: self.hyper_weight_floats(),
        }
    }
}

/// What a sequence's context costs by layer kind: per position over the layers that keep rows, and a
/// fixed recurrent state per sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextFootprint {
    /// K/V rows (MLA: latent + rope key) of the attention layers, per position.
    pub kv_per_position: u64,
    /// Indexer rows of the layers with their own indexer, per position.
    pub indexer_per_position: u64,
    /// Linear-attention state of one sequence (f32).
    pub state_per_sequence: u64,
}

impl ContextFootprint {
    /// Bytes of `sequences` sequences of `positions` positions each.
    pub fn bytes(&self, positions: u64, sequences: u64) -> u64 {
        sequences
            * (positions * (self.kv_per_position + self.indexer_per_position)
                + self.state_per_sequence)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layers() -> HybridLayers {
        use LayerKind::*;
        HybridLayers {
            hidden: 64,
            kinds: vec![
                Linear,
                Attention { own_indexer: true },
                Linear,
                Attention { own_indexer: false },
            ],
            linear: Some(LinearDims {
                heads: 2,
                head_dim: 8,
                conv_kernel: 4,
            }),
            indexer: Some(IndexerDims {
                heads: 2,
                head_dim: 16,
                topk: 8,
                keys: IndexerKeys::Pooled { pool: 4 },
            }),
            hyper_streams: Some(4),
            q_rank: 32,
        }
    }

    #[test]
    fn layer_kinds_are_counted_apart() {
        let l = layers();
        let s = l.shape();
        assert_eq!((s.linear_layers, s.indexer_layers), (2, 1));
        assert_eq!(s.state_floats, 2 * 64 + 3 * 16 * 3);
        assert_eq!((s.indexer_row_floats, s.indexer_unit), (32, 4));
        assert_eq!(l.indexer.unwrap().selection_stride(), 8 + 4);
        // 5 + hyper (4·64 + 24 + 24) + linear (10·16 + 16 + 2) + indexer (128 + 32 + 32 + 2 + 12 + 1)
        assert_eq!(s.step_row_values, 5 + 304 + 178 + 207);
        // wq_b 32·32, wk 16·64, head weights 2·64, k norm 2·16, pool 4·16 + 16·64
        assert_eq!(s.indexer_weight_floats, 1024 + 1024 + 128 + 32 + 64 + 1024);
        assert_eq!(s.hyper_weight_floats, 2 * (24 * 256 + 24));
        let per_token = IndexerDims {
            keys: IndexerKeys::PerToken,
            ..l.indexer.unwrap()
        };
        assert_eq!((per_token.row_floats(), per_token.unit()), (16, 1));
        assert_eq!(per_token.selection_stride(), 9);
        // Without an indexer no layer keeps indexer rows, whatever the kinds say.
        let plain = HybridLayers { indexer: None, ..l };
        assert_eq!(plain.shape().indexer_layers, 0);
    }

    #[test]
    fn footprint_bytes_scale_with_positions_and_sequences() {
        let f = ContextFootprint {
            kv_per_position: 10,
            indexer_per_position: 6,
            state_per_sequence: 1000,
        };
        assert_eq!(f.bytes(100, 1), 2600);
        assert_eq!(f.bytes(100, 3), 7800);
    }
}
