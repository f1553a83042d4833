//! GGUF MoE architectures (`qwen3moe`, `glm4moe`, `deepseek2` with MLA, `smallthinker`): llama.cpp's
//! metadata turned into the Hugging Face
//! `config.json` the engine reads, and HF tensor names mapped to GGUF ones. llama.cpp stores each
//! layer's routed experts merged (`blk.N.ffn_gate_exps` `[E, I, H]`); an HF expert name maps to one
//! slice of it. None of these converters permutes Q/K rows (only `llama`'s does). `deepseek2` files
//! must carry the combined `attn_kv_b` (files that only have the split `attn_k_b` / `attn_v_b` are
//! refused at load with the missing tensor's name).
use super::gguf::{GgufFile, GgufValue};
use super::WeightError;
use serde_json::{json, Value};

/// Where an HF tensor lives in a GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufRef {
    pub name: String,
    /// Rotary heads to un-permute the rows of (llama's Q/K).
    pub permute: Option<usize>,
    /// Slice of a merged expert tensor (outermost dimension).
    pub expert: Option<usize>,
}

impl GgufRef {
    fn plain(name: String) -> GgufRef {
        GgufRef {
            name,
            permute: None,
            expert: None,
        }
    }
}

/// The MoE architectures mapped here.
pub fn is_moe_arch(arch: &str) -> bool {
    matches!(arch, "qwen3moe" | "glm4moe" | "deepseek2" | "smallthinker")
}

fn meta_u64(g: &GgufFile, arch: &str, key: &str) -> Option<u64> {
    g.get(&format!("{arch}.{key}")).and_then(GgufValue::as_u64)
}

fn meta_f64(g: &GgufFile, arch: &str, key: &str) -> Option<f64> {
    g.get(&format!("{arch}.{key}")).and_then(GgufValue::as_f64)
}

fn need(g: &GgufFile, arch: &str, key: &str) -> Result<u64, WeightError> {
    meta_u64(g, arch, key).ok_or_else(|| WeightError::Invalid {
        path: g.path().to_path_buf(),
        message: format!("metadata `{arch}.{key}` missing or not an integer"),
    })
}

/// HF-style config for a `qwen3moe` or `glm4moe` file.
pub fn hf_config(g: &GgufFile, arch: &str) -> Result<Value, WeightError> {
    let layers = need(g, arch, "block_count")?;
    let hidden = need(g, arch, "embedding_length")?;
    let heads = need(g, arch, "attention.head_count")?;
    let kv_heads = meta_u64(g, arch, "attention.head_count_kv").unwrap_or(heads);
    let head_dim = meta_u64(g, arch, "attention.key_length").unwrap_or(hidden / heads.max(1));
    let experts = need(g, arch, "expert_count")?;
    let expert_ff = need(g, arch, "expert_feed_forward_length")?;
    let vocab = match meta_u64(g, arch, "vocab_size") {
        Some(v) => v,
        None => g
            .get("tokenizer.ggml.tokens")
            .and_then(GgufValue::as_array)
            .map(|a| a.len() as u64)
            .ok_or_else(|| WeightError::Invalid {
                path: g.path().to_path_buf(),
                message: "no vocab_size and no tokenizer.ggml.tokens".into(),
            })?,
    };
    let has = |name: String| g.tensors.contains_key(&name);
    // Layers without a router are dense (Qwen3's mlp_only_layers, GLM's leading dense blocks).
    let dense_layers: Vec<u64> = (0..layers)
        .filter(|i| !has(format!("blk.{i}.ffn_gate_inp.weight")))
        .collect();
    let tok_id = |k: &str| g.get(k).and_then(GgufValue::as_u64);
    let mut cfg = json!({
        "hidden_size": hidden,
        "intermediate_size": meta_u64(g, arch, "feed_forward_length").unwrap_or(expert_ff),
        "moe_intermediate_size": expert_ff,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_experts_per_tok": need(g, arch, "expert_used_count")?,
        "norm_topk_prob": g.get(&format!("{arch}.expert_weights_norm"))
            .and_then(GgufValue::as_bool).unwrap_or(true),
        "rms_norm_eps": meta_f64(g, arch, "attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
        "rope_theta": meta_f64(g, arch, "rope.freq_base").unwrap_or(1e6),
        "max_position_embeddings": meta_u64(g, arch, "context_length").unwrap_or(4096),
        "vocab_size": vocab,
        "tie_word_embeddings": !has("output.weight".into()),
        "bos_token_id": tok_id("tokenizer.ggml.bos_token_id"),
        "eos_token_id": tok_id("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    });
    let extra = match arch {
        "qwen3moe" => json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": experts,
            "decoder_sparse_step": 1,
            "mlp_only_layers": dense_layers,
        }),
        "deepseek2" => deepseek2_config(g, arch, experts, head_dim, &dense_layers)?,
        "smallthinker" => smallthinker_config(g, arch, layers, experts, expert_ff),
        _ => {
            // GLM: dense layers lead; rotary over `rope.dimension_count` of each head.
            let leading = dense_layers
                .iter()
                .take_while(|&&l| l == dense_layers[0])
                .count();
            let rot = meta_u64(g, arch, "rope.dimension_count").unwrap_or(head_dim / 2);
            let mut glm = json!({
                "architectures": ["Glm4MoeForCausalLM"],
                "model_type": "glm4_moe",
                "partial_rotary_factor": rot as f64 / head_dim.max(1) as f64,
                "attention_bias": has("blk.0.attn_q.bias".into()),
                "use_qk_norm": has("blk.0.attn_q_norm.weight".into()),
            });
            merge(&mut glm, grouped_routing(g, arch, experts, leading));
            glm
        }
    };
    merge(&mut cfg, extra);
    Ok(cfg)
}

/// Copies every key of the object `from` into the object `into`.
fn merge(into: &mut Value, from: Value) {
    if let Value::Object(m) = from {
        for (k, v) in m {
            into[k] = v;
        }
    }
}

/// The routing keys GLM-4.5 and DeepSeek share, from `expert_*` metadata: routed and shared experts,
/// leading dense layers (metadata, else `leading` as counted from the tensors), routed scaling and
/// group-limited top-k.
fn grouped_routing(g: &GgufFile, arch: &str, experts: u64, leading: usize) -> Value {
    json!({
        "n_routed_experts": experts,
        "n_shared_experts": meta_u64(g, arch, "expert_shared_count").unwrap_or(0),
        "first_k_dense_replace": meta_u64(g, arch, "leading_dense_block_count")
            .unwrap_or(leading as u64),
        "routed_scaling_factor": meta_f64(g, arch, "expert_weights_scale").unwrap_or(1.0),
        "n_group": meta_u64(g, arch, "expert_group_count").unwrap_or(1),
        "topk_group": meta_u64(g, arch, "expert_group_used_count").unwrap_or(1),
    })
}

/// SmallThinker from `smallthinker.*` metadata. llama.cpp's converter keeps no per-layer layouts, only
/// `attention.sliding_window` when some layer slides; its loader then makes every fourth layer, from
/// layer 0, a full-attention NoPE layer and the others RoPE layers over the window (the layout of both
/// released models), and without a window every layer full attention with RoPE. Those layouts are
/// written here. One difference: llama.cpp fixes that window at 4096 whatever the file says; the value
/// in the file (what the converter copied from `sliding_window_size`, 4096 for both models) is used
/// here. Routing: `expert_gating_func` 1 is the softmax router, otherwise sigmoid.
fn smallthinker_config(
    g: &GgufFile,
    arch: &str,
    layers: u64,
    experts: u64,
    expert_ff: u64,
) -> Value {
    let window = meta_u64(g, arch, "attention.sliding_window").filter(|&w| w > 0);
    let layout: Vec<u8> = (0..layers)
        .map(|l| u8::from(window.is_none() || l % 4 != 0))
        .collect();
    let sliding: Vec<u8> = (0..layers)
        .map(|l| u8::from(window.is_some() && l % 4 != 0))
        .collect();
    let gating = meta_u64(g, arch, "expert_gating_func").unwrap_or(2);
    json!({
        "architectures": ["SmallThinkerForCausalLM"],
        "model_type": "smallthinker",
        "hidden_act": "relu",
        "moe_num_primary_experts": experts,
        "moe_num_active_primary_experts": meta_u64(g, arch, "expert_used_count"),
        "moe_ffn_hidden_size": expert_ff,
        "moe_primary_router_apply_softmax": gating == 1,
        "rope_layout": layout,
        "sliding_window_layout": sliding,
        "sliding_window_size": window.unwrap_or(4096),
    })
}

/// DeepSeek-V2/V3 (MLA, sigmoid group-limited routing, YaRN) from `deepseek2.*` metadata.
fn deepseek2_config(
    g: &GgufFile,
    arch: &str,
    experts: u64,
    key_length: u64,
    dense_layers: &[u64],
) -> Result<Value, WeightError> {
    let rope_dim = need(g, arch, "rope.dimension_count")?;
    let v_dim = need(g, arch, "attention.value_length")?;
    let leading = dense_layers
        .iter()
        .enumerate()
        .take_while(|(i, &l)| *i as u64 == l)
        .count();
    let gating = meta_u64(g, arch, "expert_gating_func").unwrap_or(2);
    let mut cfg = json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "scoring_func": if gating == 1 { "softmax" } else { "sigmoid" },
        "topk_method": "noaux_tc",
        "q_lora_rank": meta_u64(g, arch, "attention.q_lora_rank").filter(|&r| r > 0),
        "kv_lora_rank": need(g, arch, "attention.kv_lora_rank")?,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": key_length.saturating_sub(rope_dim),
        "v_head_dim": v_dim,
        "rope_interleave": true,
    });
    merge(&mut cfg, grouped_routing(g, arch, experts, leading));
    let scaling = g
        .get(&format!("{arch}.rope.scaling.type"))
        .and_then(GgufValue::as_str);
    if scaling == Some("yarn") {
        // llama.cpp's converter stores 0.1 · mscale_all_dim as the YaRN log multiplier.
        let mscale = meta_f64(g, arch, "rope.scaling.yarn_log_multiplier").unwrap_or(0.0) / 0.1;
        cfg["rope_scaling"] = json!({
            "type": "yarn",
            "factor": meta_f64(g, arch, "rope.scaling.factor").unwrap_or(1.0),
            "original_max_position_embeddings":
                meta_u64(g, arch, "rope.scaling.original_context_length").unwrap_or(4096),
            "beta_fast": meta_f64(g, arch, "rope.scaling.yarn_beta_fast").unwrap_or(32.0),
            "beta_slow": meta_f64(g, arch, "rope.scaling.yarn_beta_slow").unwrap_or(1.0),
            "mscale": mscale,
            "mscale_all_dim": mscale,
        });
    }
    Ok(cfg)
}

/// The GGUF tensor behind an HF name, for the MoE architectures.
pub fn tensor_ref(arch: &str, hf: &str) -> Option<GgufRef> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let blk = |n: &str| Some(GgufRef::plain(format!("blk.{layer}.{n}")));
    // SmallThinker's experts are `block_sparse_moe.experts.E.{gate,up,down}.weight`.
    let experts = suffix
        .strip_prefix("mlp.experts.")
        .or_else(|| suffix.strip_prefix("block_sparse_moe.experts."));
    if let Some(e) = experts {
        let (e, proj) = e.split_once('.')?;
        let merged = match proj {
            "gate_proj.weight" | "gate.weight" => "ffn_gate_exps.weight",
            "up_proj.weight" | "up.weight" => "ffn_up_exps.weight",
            "down_proj.weight" | "down.weight" => "ffn_down_exps.weight",
            _ => return None,
        };
        return Some(GgufRef {
            name: format!("blk.{layer}.{merged}"),
            permute: None,
            expert: Some(e.parse().ok()?),
        });
    }
    let ffn_norm = if arch == "glm4moe" {
        "post_attention_norm.weight"
    } else {
        "ffn_norm.weight"
    };
    match suffix {
        "input_layernorm.weight" => blk("attn_norm.weight"),
        "post_attention_layernorm.weight" => blk(ffn_norm),
        "self_attn.q_proj.weight" => blk("attn_q.weight"),
        "self_attn.q_proj.bias" => blk("attn_q.bias"),
        "self_attn.k_proj.weight" => blk("attn_k.weight"),
        "self_attn.k_proj.bias" => blk("attn_k.bias"),
        "self_attn.v_proj.weight" => blk("attn_v.weight"),
        "self_attn.v_proj.bias" => blk("attn_v.bias"),
        "self_attn.o_proj.weight" => blk("attn_output.weight"),
        "self_attn.q_a_proj.weight" => blk("attn_q_a.weight"),
        "self_attn.q_a_layernorm.weight" => blk("attn_q_a_norm.weight"),
        "self_attn.q_b_proj.weight" => blk("attn_q_b.weight"),
        "self_attn.kv_a_proj_with_mqa.weight" => blk("attn_kv_a_mqa.weight"),
        "self_attn.kv_a_layernorm.weight" => blk("attn_kv_a_norm.weight"),
        "self_attn.kv_b_proj.weight" => blk("attn_kv_b.weight"),
        "self_attn.q_norm.weight" => blk("attn_q_norm.weight"),
        "self_attn.k_norm.weight" => blk("attn_k_norm.weight"),
        "mlp.gate.weight" | "block_sparse_moe.primary_router.weight" => blk("ffn_gate_inp.weight"),
        "mlp.gate.e_score_correction_bias" => blk("exp_probs_b.bias"),
        "mlp.gate_proj.weight" => blk("ffn_gate.weight"),
        "mlp.up_proj.weight" => blk("ffn_up.weight"),
        "mlp.down_proj.weight" => blk("ffn_down.weight"),
        "mlp.shared_experts.gate_proj.weight" => blk("ffn_gate_shexp.weight"),
        "mlp.shared_experts.up_proj.weight" => blk("ffn_up_shexp.weight"),
        "mlp.shared_experts.down_proj.weight" => blk("ffn_down_shexp.weight"),
        _ => None,
    }
}

#[cfg(test)]
#[path = "gguf_arch_tests.rs"]
mod tests;
