//! Well-known MoE checkpoints: their hub `config.json` (the fields the engine reads), the name they
//! are matched by, and how the hub checkpoint stores weights. `moe-daemon bench synth-checkpoint
//! --like NAME` writes random weights in these shapes; the operator sizes deployments of them without
//! reading the model files.
use serde_json::{json, Value};

#[path = "known_glm.rs"]
mod glm;
pub use glm::GLM53_LAYERS;

/// A checkpoint the operator recognises by name.
pub struct KnownModel {
    /// Matched case-insensitively against repo ids, paths and served names.
    pub key: &'static str,
    /// The hub checkpoint is FP8 with 128×128 block scales (its config.json says so).
    pub hub_fp8: bool,
}

pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        key: "qwen3-30b-a3b",
        hub_fp8: false,
    },
    KnownModel {
        key: "glm-4.5-air",
        hub_fp8: false,
    },
    KnownModel {
        key: "deepseek-v3",
        hub_fp8: true,
    },
    KnownModel {
        key: "smallthinker-21b",
        hub_fp8: false,
    },
    KnownModel {
        key: "smallthinker-4b",
        hub_fp8: false,
    },
    // Before `glm-5`, whose key is part of this one's.
    KnownModel {
        key: "glm-5.3-flash",
        hub_fp8: true,
    },
    KnownModel {
        key: "glm-5",
        hub_fp8: false,
    },
    KnownModel {
        key: "glm-4.7-flash",
        hub_fp8: false,
    },
];

/// The `quantization_config` of the hub's FP8 checkpoints.
pub fn fp8_quantization_config() -> Value {
    json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
           "weight_block_size": [128, 128]})
}

/// The bf16 `config.json` of a known shape (no `quantization_config`), or `None`.
pub fn config_json(name: &str) -> Option<Value> {
    Some(match name {
        "qwen3-30b-a3b" => json!({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
            "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
            "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": null, "max_position_embeddings": 40960,
            "tie_word_embeddings": false, "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645,
            "torch_dtype": "bfloat16"}),
        "glm-4.5-air" => json!({
            "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 4096,
            "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 128,
            "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
            "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": true, "partial_rotary_factor": 0.5,
            "attention_bias": true, "use_qk_norm": false, "vocab_size": 151552, "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0, "rope_scaling": null, "max_position_embeddings": 131072,
            "tie_word_embeddings": false, "hidden_act": "silu", "eos_token_id": [151329, 151336, 151338],
            "torch_dtype": "bfloat16"}),
        "deepseek-v3" => json!({
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
            "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3,
            "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": true,
            "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "vocab_size": 129280,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_interleave": true,
            "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            "max_position_embeddings": 163840, "tie_word_embeddings": false, "hidden_act": "silu",
            "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16"}),
        // PowerInfer/SmallThinker-21BA3B-Instruct: shapes from its model card; every 4th layer (from
        // layer 0) global NoPE attention, the others RoPE with a 4096-position sliding window, as
        // llama.cpp's SMALLTHINKER loader lays it out (swa pattern 4, dense first; NoPE step 4).
        "smallthinker-21b" => json!({
            "architectures": ["SmallThinkerForCausalLM"], "model_type": "smallthinker",
            "hidden_size": 2560, "num_hidden_layers": 52, "num_attention_heads": 28,
            "num_key_value_heads": 4, "head_dim": 128, "moe_num_primary_experts": 64,
            "moe_num_active_primary_experts": 6, "moe_ffn_hidden_size": 768,
            "moe_primary_router_apply_softmax": true, "rope_layout": every_fourth_off(52),
            "sliding_window_layout": every_fourth_off(52), "sliding_window_size": 4096,
            "rope_theta": 1.5e6, "rope_scaling": null, "max_position_embeddings": 16384,
            "vocab_size": 151936, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
            "bos_token_id": 151643, "eos_token_id": [151643, 151645], "torch_dtype": "bfloat16"}),
        // PowerInfer/SmallThinker-4BA0.6B-Instruct config.json: every layer RoPE and full attention,
        // sigmoid-normalised router (no `moe_primary_router_apply_softmax`), tied embeddings.
        "smallthinker-4b" => json!({
            "architectures": ["SmallThinkerForCausalLM"], "model_type": "smallthinker",
            "hidden_size": 1536, "num_hidden_layers": 32, "num_attention_heads": 12,
            "num_key_value_heads": 2, "head_dim": 128, "moe_num_primary_experts": 32,
            "moe_num_active_primary_experts": 4, "moe_ffn_hidden_size": 768, "norm_topk_prob": true,
            "rope_layout": vec![1; 32], "sliding_window_layout": vec![0; 32],
            "sliding_window_size": 4096, "rope_theta": 1.5e6, "rope_scaling": null,
            "max_position_embeddings": 32768, "vocab_size": 151936, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": true, "bos_token_id": 151643, "eos_token_id": [151643, 151645],
            "torch_dtype": "bfloat16"}),
        _ => return glm::config_json(name),
    })
}

/// The known model whose key appears in any of `names` (lower-cased), with its config.json: FP8 when
/// the hub checkpoint is, or when a name says `fp8` (e.g. `Qwen/Qwen3-30B-A3B-FP8`).
pub fn match_known<'a>(
    names: impl IntoIterator<Item = &'a str> + Clone,
) -> Option<(&'static KnownModel, Value)> {
    let lower: Vec<String> = names.into_iter().map(str::to_lowercase).collect();
    let known = KNOWN_MODELS
        .iter()
        .find(|k| lower.iter().any(|n| n.contains(k.key)))?;
    let mut cfg = config_json(known.key)?;
    if known.hub_fp8 || lower.iter().any(|n| n.contains("fp8")) {
        cfg["quantization_config"] = fp8_quantization_config();
    }
    Some((known, cfg))
}

/// `[0, 1, 1, 1, 0, 1, 1, 1, …]` over `layers` layers.
fn every_fourth_off(layers: usize) -> Vec<u8> {
    (0..layers).map(|l| u8::from(l % 4 != 0)).collect()
}
