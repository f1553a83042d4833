//! `bench synth-checkpoint` shapes of the GLM MLA family, and the tensors only they have (the
//! sparse-attention indexer). Where each number comes from:
//!
//! - `glm-4.7-flash` (zai-org/GLM-4.7-Flash): vLLM's `tests/transformers_utils/test_glm4_moe_lite.py`
//!   writes the checkpoint's config.json fields verbatim (hidden 2048, 47 layers, 20 heads, q-LoRA 768,
//!   kv-LoRA 512, nope/rope/v 192/64/256, 64 experts top-4 of width 1536, one shared, scaling 1.8,
//!   first layer dense, rope θ 1e6, eos [154820, 154827, 154829]); the same values are transformers 5.24's
//!   `Glm4MoeLiteConfig` defaults.
//! - `glm-5` (zai-org/GLM-5): xLLM's `xllm/models/llm/glm5.h` loads config.json with the hub values as
//!   defaults (hidden 6144, 78 layers, 64 heads, q-LoRA 2048, kv-LoRA 512, nope/rope/v 192/64/256,
//!   256 experts top-8 of width 2048, one shared, scaling 2.5, 3 dense layers, indexer 32 heads × 128
//!   with top-2048, rope θ 1e6, eos [154820, 154827, 154829]); transformers 5.24's `GlmMoeDsaConfig`
//!   defaults agree. Every layer runs its own indexer (`indexer_types` all "full", the class default).
use super::synth::{Kind, Spec};
use crate::model::config::{IndexerLayer, ModelConfig};
use serde_json::{json, Value};

/// Shape names this file adds to `--like`.
pub const NAMES: &str = "glm-4.7-flash, glm-5";

/// Hub config.json of a GLM MLA shape, None for other names.
pub fn config_like(name: &str) -> Option<Value> {
    Some(match name {
        "glm-4.7-flash" => json!({
            "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite",
            "vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240,
            "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20,
            "num_key_value_heads": 20, "hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_bias": false,
            "max_position_embeddings": 202752, "rope_theta": 1000000.0, "rope_scaling": null,
            "partial_rotary_factor": 1.0, "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
            "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 64, "n_shared_experts": 1,
            "num_experts_per_tok": 4, "norm_topk_prob": true, "routed_scaling_factor": 1.8, "n_group": 1,
            "topk_group": 1, "topk_method": "noaux_tc", "first_k_dense_replace": 1,
            "tie_word_embeddings": false, "pad_token_id": 154820,
            "eos_token_id": [154820, 154827, 154829], "torch_dtype": "bfloat16"}),
        "glm-5" => json!({
            "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
            "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
            "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
            "num_key_value_heads": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_bias": false,
            "max_position_embeddings": 202752,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
            "v_head_dim": 256, "head_dim": 64, "n_routed_experts": 256, "n_shared_experts": 1,
            "num_experts_per_tok": 8, "norm_topk_prob": true, "routed_scaling_factor": 2.5, "n_group": 1,
            "topk_group": 1, "first_k_dense_replace": 3, "index_topk": 2048, "index_head_dim": 128,
            "index_n_heads": 32, "tie_word_embeddings": false, "bos_token_id": 0,
            "eos_token_id": [154820, 154827, 154829], "torch_dtype": "bfloat16"}),
        _ => return None,
    })
}

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
