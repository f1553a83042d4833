//! Bounds on `config.json` values, checked before anything is sized from them.
//!
//! A config is a file a user hands the daemon: `num_hidden_layers: 1e15` must be an error naming the
//! field, not an allocation abort, and `rope_theta: 0` must not turn every position into NaN. The
//! limits are far above every released model (DeepSeek-V3: hidden 7168, 61 layers, 128 heads, 256
//! experts, vocabulary 129k; Llama 4: 10M context; Gemma: vocabulary 262k) and low enough that the
//! buffers sized from them fit in memory.
//!
//! Two passes: [`check_raw_sizes`] on the JSON before parsing (parsing already allocates per-layer
//! lists), [`check_parsed`] on the parsed [`ModelConfig`] (floats, derived sizes, products).
use super::{ConfigError, ModelConfig, RopeScaling};
use serde_json::Value;

/// (field, largest accepted value) for integer sizes read from the top level of config.json.
const SIZE_LIMITS: &[(&str, u64)] = &[
    ("hidden_size", 1 << 16),
    ("num_hidden_layers", 1024),
    ("num_attention_heads", 1024),
    ("num_key_value_heads", 1024),
    ("head_dim", 4096),
    ("intermediate_size", 1 << 20),
    ("moe_intermediate_size", 1 << 20),
    ("shared_expert_intermediate_size", 1 << 20),
    ("vocab_size", 1 << 22),
    ("max_position_embeddings", 1 << 24),
    ("num_experts", 1 << 14),
    ("num_local_experts", 1 << 14),
    ("n_routed_experts", 1 << 14),
    ("num_experts_per_tok", 1 << 14),
    ("n_shared_experts", 64),
    ("n_group", 1 << 14),
    ("topk_group", 1 << 14),
    ("first_k_dense_replace", 1024),
    ("moe_layer_freq", 1024),
    ("decoder_sparse_step", 1024),
    ("q_lora_rank", 1 << 16),
    ("kv_lora_rank", 1 << 16),
    ("qk_nope_head_dim", 4096),
    ("qk_rope_head_dim", 4096),
    ("v_head_dim", 4096),
];

/// Size fields that must be at least 1 when present (a zero would divide by zero or build nothing).
const POSITIVE: &[&str] = &[
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
];

/// Checks every known integer size field of the raw JSON against [`SIZE_LIMITS`].
pub fn check_raw_sizes(v: &Value) -> Result<(), ConfigError> {
    for &(key, max) in SIZE_LIMITS {
        let Some(raw) = v.get(key).filter(|x| !x.is_null()) else {
            continue;
        };
        let ok = raw.as_u64().is_some_and(|x| x <= max)
            && (!POSITIVE.contains(&key) || raw.as_u64() != Some(0));
        if !ok {
            let low = if POSITIVE.contains(&key) { 1 } else { 0 };
            return Err(ConfigError::Invalid(format!(
                "`{key}` is {raw}; expected an integer in {low}..={max}"
            )));
        }
    }
    Ok(())
}

fn finite_positive(name: &str, x: f64) -> Result<(), ConfigError> {
    if x.is_finite() && x > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::Invalid(format!(
            "`{name}` is {x}; expected a finite number > 0"
        )))
    }
}

/// Checks the parsed config: floats finite and in range, derived sizes within the same limits.
pub fn check_parsed(cfg: &ModelConfig) -> Result<(), ConfigError> {
    finite_positive("rope_theta", cfg.rope.theta)?;
    let eps = cfg.rms_norm_eps as f64;
    if !(eps.is_finite() && eps > 0.0 && eps < 1.0) {
        return Err(ConfigError::Invalid(format!(
            "`rms_norm_eps` is {eps}; expected a number in (0, 1)"
        )));
    }
    if cfg.head_dim == 0 || cfg.head_dim > 4096 {
        return Err(ConfigError::Invalid(format!(
            "head dimension {} must be within 1..=4096",
            cfg.head_dim
        )));
    }
    match &cfg.rope.scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => finite_positive("rope_scaling.factor", *factor)?,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            finite_positive("rope_scaling.factor", *factor)?;
            finite_positive("rope_scaling.low_freq_factor", *low_freq_factor)?;
            finite_positive("rope_scaling.high_freq_factor", *high_freq_factor)?;
            finite_positive(
                "rope_scaling.original_max_position_embeddings",
                *original_max_position_embeddings,
            )?;
            // The smoothing ramp divides by (high - low).
            if high_freq_factor <= low_freq_factor {
                return Err(ConfigError::Invalid(format!(
                    "rope_scaling.high_freq_factor ({high_freq_factor}) must exceed low_freq_factor ({low_freq_factor})"
                )));
            }
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            attention_factor,
            ..
        } => {
            finite_positive("rope_scaling.factor", *factor)?;
            finite_positive(
                "rope_scaling.original_max_position_embeddings",
                *original_max_position_embeddings,
            )?;
            finite_positive("rope_scaling.beta_fast", *beta_fast)?;
            finite_positive("rope_scaling.beta_slow", *beta_slow)?;
            for (name, x) in [
                ("rope_scaling.mscale", mscale),
                ("rope_scaling.mscale_all_dim", mscale_all_dim),
                ("rope_scaling.attention_factor", attention_factor),
            ] {
                if let Some(x) = x.filter(|x| !x.is_finite()) {
                    return Err(ConfigError::Invalid(format!(
                        "`{name}` is {x}; expected a finite number"
                    )));
                }
            }
        }
    }
    if let Some(moe) = &cfg.moe {
        let f = moe.routed_scaling_factor as f64;
        if !(f.is_finite() && f >= 0.0) {
            return Err(ConfigError::Invalid(format!(
                "`routed_scaling_factor` is {f}; expected a finite number >= 0"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::ModelConfig;
    use serde_json::{json, Value};

    fn llama() -> Value {
        json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100,
               "intermediate_size": 128, "rope_theta": 10000.0})
    }

    fn err_with(edit: impl FnOnce(&mut Value)) -> String {
        let mut v = llama();
        edit(&mut v);
        match ModelConfig::from_json(&v) {
            Ok(_) => panic!("config should be refused: {v}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn the_base_config_is_accepted() {
        ModelConfig::from_json(&llama()).unwrap();
    }

    #[test]
    fn huge_sizes_are_refused_before_allocation() {
        // 1e15 layers aborted the process allocating the per-layer list; 2^40 / 2^29 head_dim
        // allocated the rotary table before any shape check.
        for (key, value) in [
            ("num_hidden_layers", json!(1_000_000_000_000_000u64)),
            ("head_dim", json!(1u64 << 40)),
            ("head_dim", json!(1u64 << 29)),
            ("vocab_size", json!(1u64 << 40)),
            ("hidden_size", json!(u64::MAX)),
            ("max_position_embeddings", json!(1u64 << 40)),
            ("num_hidden_layers", json!(0)),
            ("hidden_size", json!(-4)),
            ("head_dim", json!(64.5)),
        ] {
            let e = err_with(|v| v[key] = value.clone());
            assert!(e.contains(key), "{key}={value}: {e}");
        }
    }

    #[test]
    fn degenerate_floats_are_refused() {
        let e = err_with(|v| v["rope_theta"] = json!(0.0));
        assert!(e.contains("rope_theta"), "{e}");
        let e = err_with(|v| v["rope_theta"] = json!(-1.0));
        assert!(e.contains("rope_theta"), "{e}");
        let e = err_with(|v| v["rms_norm_eps"] = json!(0.0));
        assert!(e.contains("rms_norm_eps"), "{e}");
        let e = err_with(|v| {
            v["rope_scaling"] = json!({"rope_type": "linear", "factor": 0.0});
        });
        assert!(e.contains("factor"), "{e}");
        let e = err_with(|v| {
            v["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        });
        assert!(e.contains("high_freq_factor"), "{e}");
        let e = err_with(|v| {
            v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 0});
        });
        assert!(e.contains("original_max_position_embeddings"), "{e}");
    }
}
