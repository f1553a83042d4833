//! Config of hybrid-attention models (GLM-5.3-Flash, `Glm5NextForConditionalGeneration`): which token
//! mixer each layer runs, the linear-attention (KDA) shape, hyper-connections and the SwiGLU clamp.
//!
//! Read from transformers' `configuration_glm5_next.py`: the text fields live in `text_config` (flat,
//! text-only checkpoints keep them at the top level); `linear_attn_config` (the original checkpoint
//! spelling) overrides `linear_head_dim`, `linear_num_heads`, `linear_conv_kernel_dim` and
//! `linear_lower_bound`; absent fields take the config class defaults.
use super::config::ConfigError;
use serde_json::Value;

/// The token mixer of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mixer {
    /// Softmax attention over a KV cache (GQA, or MLA; GLM-5.3's indexed layers).
    Attention,
    /// Gated delta-rule linear attention (KDA) over a fixed-size per-sequence recurrent state.
    Linear,
}

/// Shape of the KDA linear-attention layers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearAttentionConfig {
    pub num_heads: usize,
    /// Key and value width per head (the state of one head is `head_dim × head_dim`).
    pub head_dim: usize,
    /// Taps of the depthwise causal convolution over q, k and v.
    pub conv_kernel: usize,
    /// Forget gate `lower_bound · sigmoid(exp(A_log) · g)` when set; `-exp(A_log) · softplus(g)` when not.
    pub lower_bound: Option<f32>,
}

impl LinearAttentionConfig {
    /// Width of q, k and v each (`heads × head_dim`).
    pub fn qkv_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// The memory plan's view of this shape (the sizing crate's accounting, shared with the operator).
    pub fn dims(&self) -> moe_sizing::LinearDims {
        moe_sizing::LinearDims {
            heads: self.num_heads as u64,
            head_dim: self.head_dim as u64,
            conv_kernel: self.conv_kernel as u64,
        }
    }

    /// f32 values of one sequence's state in one layer: the recurrent matrices plus the last
    /// `conv_kernel - 1` inputs of the convolution. Fixed, whatever the context length.
    pub fn state_floats(&self) -> usize {
        self.dims().state_floats() as usize
    }
}

/// Manifold-constrained hyper-connections: `mult` residual streams per token, collapsed into a block's
/// input and expanded from its output with weights computed from the streams (Sinkhorn-normalised mixing).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HyperConfig {
    pub mult: usize,
    pub sinkhorn_iters: usize,
    pub eps: f32,
}

/// Everything GLM-5.3-Flash adds to the shared config fields.
#[derive(Debug, Clone, PartialEq)]
pub struct HybridFields {
    pub mixers: Vec<Mixer>,
    pub linear: LinearAttentionConfig,
    pub hyper: HyperConfig,
    pub swiglu_limit: Option<f32>,
    /// Per layer: true when the FFN is the MoE block (`mlp_layer_types` "sparse").
    pub moe_layers: Vec<bool>,
}

/// The text model's fields: `text_config` over the top level (so `architectures`, quantization and
/// token ids from the top level stay visible); the sizing crate's reading, so both read one config.
pub fn text_fields(v: &Value) -> Value {
    moe_sizing::glm::text_fields(v)
}

fn usize_or(v: &Value, key: &str, default: usize) -> Result<usize, ConfigError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| ConfigError::Invalid(format!("`{key}` must be a non-negative integer"))),
    }
}

fn f64_or(v: &Value, key: &str, default: f64) -> Result<f64, ConfigError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| ConfigError::Invalid(format!("`{key}` must be a finite number"))),
    }
}

/// A per-layer list of strings mapped through `parse`, or `default` when absent: the sizing crate's
/// reading (the operator plans from the same lists), its refusals as this crate's config errors.
fn per_layer<T>(
    v: &Value,
    key: &str,
    layers: usize,
    parse: impl Fn(&str) -> Option<T>,
    default: impl Fn(usize) -> T,
) -> Result<Vec<T>, ConfigError> {
    moe_sizing::glm::per_layer(v, key, layers as u64, parse, |i| default(i as usize)).map_err(|e| {
        match e {
            moe_sizing::ShapeError::Invalid(msg) => ConfigError::Invalid(msg),
            other => ConfigError::Invalid(other.to_string()),
        }
    })
}

/// Parses the GLM-5.3-Flash fields of the (merged) text config.
pub fn parse(v: &Value, layers: usize) -> Result<HybridFields, ConfigError> {
    // Default schedule of the config class: every fourth layer (3, 7, …) indexed attention.
    let mixers = per_layer(
        v,
        "layer_types",
        layers,
        |s| match s {
            "linear_attention" => Some(Mixer::Linear),
            // `full_attention` is renamed to `indexed_attention` by the config class; the original
            // checkpoints say `deepseek_sparse_attention`. All build the same MLA + indexer layer.
            "indexed_attention" | "full_attention" | "deepseek_sparse_attention" => {
                Some(Mixer::Attention)
            }
            _ => None,
        },
        |i| {
            if i % 4 == 3 {
                Mixer::Attention
            } else {
                Mixer::Linear
            }
        },
    )?;
    let moe_layers = per_layer(
        v,
        "mlp_layer_types",
        layers,
        |s| match s {
            "dense" => Some(false),
            "sparse" => Some(true),
            _ => None,
        },
        |i| i >= 3,
    )?;
    let lac = v.get("linear_attn_config").filter(|x| x.is_object());
    // `linear_attn_config.<nested>` when present, else the flat `<own>` field.
    let pick_usize = |own: &str, nested: &str, default: usize| -> Result<usize, ConfigError> {
        match lac.filter(|c| c.get(nested).is_some_and(|x| !x.is_null())) {
            Some(c) => usize_or(c, nested, default),
            None => usize_or(v, own, default),
        }
    };
    let num_heads = pick_usize("linear_num_heads", "num_heads", 64)?;
    let head_dim = pick_usize("linear_head_dim", "head_dim", 128)?;
    let conv_kernel = pick_usize("linear_conv_kernel_dim", "short_conv_kernel_size", 4)?;
    let lower_bound = match lac.and_then(|c| c.get("gate_lower_bound")) {
        Some(Value::Null) | None => match v.get("linear_lower_bound") {
            // The config class: a `linear_attn_config` with `safe_gate` (default on) and no bound
            // gets -5.
            Some(Value::Null)
                if lac.is_some_and(|c| {
                    c.get("safe_gate").and_then(Value::as_bool) != Some(false)
                }) =>
            {
                Some(-5.0)
            }
            Some(Value::Null) => None,
            None => Some(-5.0),
            Some(x) => Some(x.as_f64().filter(|x| x.is_finite()).ok_or_else(|| {
                ConfigError::Invalid("`linear_lower_bound` must be a number or null".into())
            })? as f32),
        },
        Some(x) => Some(x.as_f64().filter(|x| x.is_finite()).ok_or_else(|| {
            ConfigError::Invalid("`linear_attn_config.gate_lower_bound` must be a number".into())
        })? as f32),
    };
    // Far above GLM-5.3-Flash (64 heads of 128, kernel 4) and low enough that one sequence's state
    // per layer (heads × head_dim² f32) stays within 256 MiB.
    for (name, x, max) in [
        ("linear_num_heads", num_heads, 256),
        ("linear_head_dim", head_dim, 512),
        ("linear_conv_kernel_dim", conv_kernel, 64),
    ] {
        if x == 0 || x > max {
            return Err(ConfigError::Invalid(format!(
                "`{name}` is {x}; expected 1..={max}"
            )));
        }
    }
    let mult = usize_or(v, "hc_mult", 4)?;
    let sinkhorn_iters = usize_or(v, "hc_sinkhorn_iters", 20)?;
    let eps = f64_or(v, "hc_eps", 1e-6)? as f32;
    if !(1..=16).contains(&mult) || !(1..=1000).contains(&sinkhorn_iters) || eps < 0.0 {
        return Err(ConfigError::Invalid(format!(
            "hyper-connections: hc_mult {mult} must be within 1..=16, hc_sinkhorn_iters {sinkhorn_iters} within 1..=1000, hc_eps {eps} non-negative"
        )));
    }
    let swiglu_limit = match v.get("swiglu_limit") {
        None => Some(10.0),
        Some(Value::Null) => None,
        Some(x) => Some(
            x.as_f64()
                .filter(|x| *x > 0.0)
                .ok_or_else(|| ConfigError::Invalid("`swiglu_limit` must be positive".into()))?
                as f32,
        ),
    };
    Ok(HybridFields {
        mixers,
        linear: LinearAttentionConfig {
            num_heads,
            head_dim,
            conv_kernel,
            lower_bound,
        },
        hyper: HyperConfig {
            mult,
            sinkhorn_iters,
            eps,
        },
        swiglu_limit,
        moe_layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn defaults_follow_the_config_class() {
        let f = parse(&json!({}), 8).unwrap();
        use Mixer::*;
        assert_eq!(
            f.mixers,
            vec![Linear, Linear, Linear, Attention, Linear, Linear, Linear, Attention]
        );
        assert_eq!(
            f.moe_layers,
            vec![false, false, false, true, true, true, true, true]
        );
        assert_eq!(f.linear.lower_bound, Some(-5.0));
        assert_eq!((f.linear.num_heads, f.linear.head_dim), (64, 128));
        assert_eq!(f.hyper.mult, 4);
        assert_eq!(f.swiglu_limit, Some(10.0));
    }

    #[test]
    fn nested_linear_config_and_spellings() {
        let v = json!({"layer_types": ["linear_attention", "deepseek_sparse_attention", "full_attention"],
                       "linear_attn_config": {"num_heads": 3, "head_dim": 8, "short_conv_kernel_size": 2},
                       "linear_lower_bound": null, "swiglu_limit": null});
        let f = parse(&v, 3).unwrap();
        assert_eq!(
            f.mixers,
            vec![Mixer::Linear, Mixer::Attention, Mixer::Attention]
        );
        assert_eq!(
            (f.linear.num_heads, f.linear.head_dim, f.linear.conv_kernel),
            (3, 8, 2)
        );
        // safe_gate defaults on: a nested config without a bound gets -5
        assert_eq!(f.linear.lower_bound, Some(-5.0));
        assert_eq!(f.swiglu_limit, None);
        let f = parse(&json!({"linear_lower_bound": null}), 3).unwrap();
        assert_eq!(f.linear.lower_bound, None);
    }

    #[test]
    fn bad_values_are_errors() {
        for v in [
            json!({"layer_types": ["linear_attention"]}),
            json!({"layer_types": ["linear_attention", "mamba"]}),
            json!({"mlp_layer_types": ["dense", "moe"]}),
            json!({"hc_mult": 0}),
            json!({"linear_head_dim": 0}),
            json!({"linear_num_heads": 1024}),
            json!({"swiglu_limit": -1.0}),
        ] {
            assert!(parse(&v, 2).is_err(), "{v}");
        }
        // per-layer lists: the sizing crate's refusal, as a config error naming the field
        for (v, key) in [
            (json!({"layer_types": ["linear_attention"]}), "layer_types"),
            (
                json!({"mlp_layer_types": ["dense", "moe"]}),
                "mlp_layer_types",
            ),
        ] {
            match parse(&v, 2) {
                Err(ConfigError::Invalid(msg)) => assert!(msg.contains(key), "{msg}"),
                other => panic!("{v}: {other:?}"),
            }
        }
    }

    #[test]
    fn glm5_next_model_config_from_nested_text_config() {
        use crate::model::config::{Arch, IndexerPooling, ModelConfig};
        let v = json!({"architectures": ["Glm5NextForConditionalGeneration"], "vision_config": {"depth": 2},
            "text_config": {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 0, "q_lora_rank": 32,
                "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 0, "v_head_dim": 8,
                "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                "index_topk": 256, "linear_num_heads": 2, "linear_head_dim": 8}});
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.arch, Arch::Glm5Next);
        assert_eq!(
            c.head_dim, 8,
            "NoPE MLA: the nope width, not the config's 0"
        );
        assert_eq!(c.rope.rotary_dim, 0);
        assert_eq!(c.moe_layers, vec![false, false, false, true]);
        assert_eq!(c.mixers[3], Mixer::Attention);
        assert_eq!(c.max_position_embeddings, 1 << 20, "no cap at index_topk");
        let ix = c.indexer.as_ref().unwrap();
        assert_eq!((ix.n_heads, ix.head_dim, ix.topk), (32, 128, 256));
        assert_eq!(ix.pooling, IndexerPooling::KeyPool { pool: 16 });
        assert_eq!(ix.rope_dim, 0);
        assert!(!c.layer_attention[3].rope, "NoPE MLA");
        assert_eq!(c.mla.as_ref().unwrap().latent_norm_eps, 1e-5);
        assert_eq!(c.moe.as_ref().unwrap().routed_scaling_factor, 2.5);
        assert_eq!(c.rms_norm_eps, 1e-5);
        for (key, value) in [
            ("qk_rope_head_dim", json!(64)),
            ("index_topk", json!(0)),
            ("index_topk", json!(250)), // not a multiple of index_kpool
            ("index_kpool_always_select_tail", json!(false)),
            // layer 3 would reuse the selection of layer 2, a linear-attention layer
            ("indexer_types", json!(["full", "full", "full", "shared"])),
        ] {
            let mut bad = v.clone();
            bad["text_config"][key] = value;
            assert!(ModelConfig::from_json(&bad).is_err(), "{key}");
        }
    }

    #[test]
    fn text_config_overrides_top_level() {
        let v = json!({"architectures": ["X"], "eos_token_id": [5], "vision_config": {"depth": 1},
                       "text_config": {"hidden_size": 64, "eos_token_id": null}});
        let t = text_fields(&v);
        assert_eq!(t["hidden_size"], 64);
        assert_eq!(t["architectures"][0], "X");
        assert_eq!(t["eos_token_id"], json!([5]));
        assert!(t.get("vision_config").is_none());
    }
}
