//! `bench synth-checkpoint` tensors only the GLM MLA family has (the sparse-attention indexer); their
//! config.json files (and where each number comes from) are `moe_sizing::known`'s `glm-4.7-flash` and
//! `glm-5`.
use super::synth::{Kind, Spec};
use crate::model::config::{IndexerLayer, ModelConfig};
use serde_json::Value;

/// `--layers` for the per-layer lists these configs may carry.
pub fn set_layers(cfg: &mut Value, layers: usize) {
    for key in ["mlp_layer_types", "indexer_types"] {
        if let Some(a) = cfg.get_mut(key).and_then(Value::as_array_mut) {
            a.truncate(layers);
        }
    }
}

/// Layer `l`'s indexer tensors, where it runs its own indexer.
pub fn indexer_specs(c: &ModelConfig, l: usize, out: &mut Vec<Spec>) {
    let (Some(ix), Some(m)) = (&c.indexer, &c.mla) else {
        return;
    };
    if ix.layers.get(l) != Some(&IndexerLayer::Own) {
        return;
    }
    let (Some(rank), h, d) = (m.q_lora_rank, c.hidden_size, ix.head_dim) else {
        return;
    };
    let p = crate::model::names::indexer(&crate::model::names::layer(l));
    for (name, shape, kind) in [
        ("wq_b.weight", vec![ix.n_heads * d, rank], Kind::Proj),
        ("wk.weight", vec![d, h], Kind::Proj),
        ("k_norm.weight", vec![d], Kind::Norm),
        ("k_norm.bias", vec![d], Kind::VecF32),
        ("weights_proj.weight", vec![ix.n_heads, h], Kind::Proj),
    ] {
        out.push(Spec {
            name: format!("{p}.{name}"),
            shape,
            kind,
        });
    }
}
