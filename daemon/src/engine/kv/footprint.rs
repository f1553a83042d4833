//! What a sequence's context costs in memory, by layer kind: attention layers grow with every position
//! (GQA: K and V rows; MLA: the normalised latent and the rotary key; sparse-attention layers also the
//! indexer's keys), linear-attention layers hold a fixed state whatever the length.
use crate::model::config::IndexerLayer;
use crate::model::hybrid::Mixer;
use crate::model::ModelConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextFootprint {
    /// Bytes per position over all attention layers: K/V rows or MLA latent + rotary key.
    pub kv_per_position: usize,
    /// Bytes per position of the sparse-attention indexer over indexed layers: its key and the k-pool
    /// gate score per channel (what transformers' indexer cache holds), at the same value width.
    pub indexer_per_position: usize,
    /// Bytes per sequence of linear-attention state (f32: delta-rule matrices and convolution tails).
    pub state_per_sequence: usize,
}

impl ContextFootprint {
    /// `value_bytes`: bytes of one cached K/V or latent value (2 for f16 / bf16 caches, 4 for f32
    /// rows; the CPU backend's element type is `kv::default_dtype` unless the options name one).
    pub fn of(cfg: &ModelConfig, value_bytes: usize) -> Self {
        let attention_layers = cfg
            .mixers
            .iter()
            .filter(|m| **m == Mixer::Attention)
            .count();
        let per_layer = match &cfg.mla {
            Some(m) => m.kv_lora_rank + m.qk_rope_head_dim,
            None => 2 * cfg.num_kv_heads * cfg.head_dim,
        };
        // Layers running their own indexer keep its rows (`IndexerConfig::row_width`) per position.
        let indexer_floats: usize = cfg.indexer.as_ref().map_or(0, |ix| {
            let own = (0..cfg.num_layers).filter(|&l| {
                cfg.mixers.get(l) == Some(&Mixer::Attention)
                    && ix.layers.get(l) == Some(&IndexerLayer::Own)
            });
            own.count() * ix.row_width()
        });
        let state = cfg.linear_attention.map_or(0, |la| {
            let linear = cfg.num_layers - attention_layers;
            linear * la.state_floats() * 4
        });
        Self {
            kv_per_position: attention_layers * per_layer * value_bytes,
            indexer_per_position: indexer_floats * value_bytes,
            state_per_sequence: state,
        }
    }

    /// Bytes for `sequences` sequences of `positions` positions each.
    pub fn bytes(&self, positions: usize, sequences: usize) -> usize {
        sequences
            * (positions * (self.kv_per_position + self.indexer_per_position)
                + self.state_per_sequence)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GLM-5.3-Flash (the synth-checkpoint config): 11 indexed MLA layers, 34 linear layers. The
    /// figures docs/MODELS-GLM5.md quotes.
    #[test]
    fn glm53_flash_context_footprints() {
        let v = crate::cli::synth::config_like("glm-5.3-flash").unwrap();
        let cfg = ModelConfig::from_json(&v).unwrap();
        let f = ContextFootprint::of(&cfg, 2);
        // MLA latent 512 values × 11 layers × 2 bytes; indexer 2 × 128 values × 11 layers × 2 bytes.
        assert_eq!(f.kv_per_position, 11 * 512 * 2);
        assert_eq!(f.indexer_per_position, 11 * 256 * 2);
        // 34 layers × (64 heads × 128² + 3 · 8192 · 3) f32.
        assert_eq!(
            f.state_per_sequence,
            34 * (64 * 128 * 128 + 3 * 8192 * 3) * 4
        );
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let k128 = f.bytes(128 << 10, 1);
        let m1 = f.bytes(1 << 20, 1);
        assert!((gib(k128) - 2.20).abs() < 0.01, "{}", gib(k128));
        assert!((gib(m1) - 16.64).abs() < 0.01, "{}", gib(m1));
        // A model of the same attention with every layer MLA would hold 45/11 as much per position.
        assert_eq!(f.state_per_sequence / (1 << 20), 145);
    }
}
