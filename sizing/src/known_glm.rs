//! The GLM family's hub `config.json` (GLM-4.7-Flash, GLM-5, GLM-5.3-Flash): what the operator sizes
//! and `bench synth-checkpoint --like` writes. Where each number comes from:
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
//! - `glm-5.3-flash` (zai-org/GLM-5.3-Flash, multimodal layout: text fields in `text_config`): the hub's
//!   config.json is not reachable from here. Every field is transformers 5.24's `Glm5NextTextConfig`
//!   default (its docstring names the checkpoint: hidden 4096, 45 layers, 64 heads, 288 experts top-8
//!   plus 1 shared, MLA q-LoRA 1536 / kv-LoRA 512 with NoPE heads of 256, 64 linear heads of 128, hc_mult 4,
//!   index_topk 2048, context 1M), except what public code reading the released config.json states
//!   differently or in addition: `index_kpool` 4 (the class default is 16), `layer_types` spelt
//!   `deepseek_sparse_attention` on layers 3, 7, …, 43, `linear_attn_config`, `first_k_dense_replace` 3,
//!   eos ids 154820 / 154827 / 154829 (omlx's glm5_next tests, a GLM-5.3 mini-checkpoint generator for
//!   sglang). The hub checkpoint stores FP8 128×128 blocks.
use serde_json::{json, Value};

/// The hub config.json of a GLM shape, None for other names.
pub fn config_json(name: &str) -> Option<Value> {
    Some(match name {
        "glm-5.3-flash" => glm53_flash_config(),
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

/// Decoder layers of GLM-5.3-Flash.
pub const GLM53_LAYERS: usize = 45;

/// The text model's config in the multimodal layout (text fields in `text_config`).
fn glm53_flash_config() -> Value {
    let dsa: Vec<usize> = (0..GLM53_LAYERS).filter(|i| i % 4 == 3).collect();
    let kda: Vec<usize> = (0..GLM53_LAYERS).filter(|i| i % 4 != 3).collect();
    let layer_types: Vec<&str> = (0..GLM53_LAYERS)
        .map(|i| {
            if i % 4 == 3 {
                "deepseek_sparse_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    let mlp_types: Vec<&str> = (0..GLM53_LAYERS)
        .map(|i| if i < 3 { "dense" } else { "sparse" })
        .collect();
    let mut text = json!({
        "model_type": "glm5_next_text", "vocab_size": 154880, "hidden_size": 4096,
        "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": GLM53_LAYERS,
        "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 0,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 256, "qk_rope_head_dim": 0,
        "v_head_dim": 256, "n_routed_experts": 288, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": true,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_k_dense_replace": 3,
        "layer_types": layer_types, "mlp_layer_types": mlp_types,
        "indexer_types": vec!["full"; GLM53_LAYERS]
    });
    let more = json!({
        "linear_attn_config": {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "kda_layers": kda, "full_attn_layers": dsa},
        "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "swiglu_limit": 10.0,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "index_kpool": 4,
        "index_kpool_always_select_tail": true, "num_nextn_predict_layers": 1,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576,
        "attention_bias": false, "pad_token_id": 154820,
        "eos_token_id": [154820, 154827, 154829], "torch_dtype": "bfloat16"
    });
    if let (Some(t), Value::Object(m)) = (text.as_object_mut(), more) {
        t.extend(m);
    }
    json!({
        "architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
        "tie_word_embeddings": false, "image_token_id": 154854, "video_token_id": 154855,
        "text_config": text
    })
}
