//! What a sequence's context costs in memory, by layer kind: attention layers grow with every position
//! (GQA: K and V rows; MLA: the normalised latent and the rotary key; layers with their own
//! sparse-attention indexer also its f32 key rows), linear-attention layers hold a fixed state whatever
//! the length. The accounting is the sizing crate's (`moe_sizing::ContextFootprint`), the one the GPU
//! memory plan and the operator use.
use crate::model::ModelConfig;
pub use moe_sizing::ContextFootprint;

/// The footprint of `cfg` with `value_bytes` per cached K/V or latent value (2 for f16 / bf16 caches,
/// 4 for f32 rows; the CPU backend's element type is `kv::default_dtype` unless the options name one).
/// Indexer rows and recurrent states are f32 in both backends.
pub fn of(cfg: &ModelConfig, value_bytes: usize) -> ContextFootprint {
    let shape =
        crate::engine::gpu::memory::shape_of(cfg, false, moe_sizing::CheckpointFormat::Bf16);
    shape.context_footprint(value_bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GLM-5.3-Flash (the known config): 11 indexed MLA layers, 34 linear layers. The figures
    /// docs/GLM5-NEXT.md quotes.
    #[test]
    fn glm53_flash_context_footprints() {
        let v = crate::cli::synth::config_like("glm-5.3-flash").unwrap();
        let cfg = ModelConfig::from_json(&v).unwrap();
        let f = of(&cfg, 2);
        // MLA latent 512 values × 11 layers × 2 bytes; indexer 2 × 128 f32 × 11 layers.
        assert_eq!(f.kv_per_position, 11 * 512 * 2);
        assert_eq!(f.indexer_per_position, 11 * 256 * 4);
        // 34 layers × (64 heads × 128² + 3 · 8192 · 3) f32.
        assert_eq!(
            f.state_per_sequence,
            34 * (64 * 128 * 128 + 3 * 8192 * 3) * 4
        );
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let k128 = f.bytes(128 << 10, 1);
        let m1 = f.bytes(1 << 20, 1);
        assert!((gib(k128) - 2.89).abs() < 0.01, "{}", gib(k128));
        assert!((gib(m1) - 22.14).abs() < 0.01, "{}", gib(m1));
        assert_eq!(f.state_per_sequence >> 20, 145);
        // The CPU backend's recurrent state is what the footprint counts.
        let la = cfg.linear_attention.unwrap();
        let host = crate::engine::kv::RecurrentState::new(&cfg.mixers, &la);
        assert_eq!(f.state_per_sequence as usize, host.bytes());
    }
}
