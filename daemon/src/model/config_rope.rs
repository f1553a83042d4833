//! RoPE and per-layer attention layout of `config.json` (part of [`super`]'s parsing): the classic
//! top-level fields or the `rope_parameters` object, scaling variants, NoPE / sliding-window layouts.
use super::*;

pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

pub(super) fn parse_rope(
    v: &Value,
    arch: Arch,
    head_dim: usize,
    mla: Option<&MlaConfig>,
) -> Result<RopeConfig, ConfigError> {
    // Newer form: everything inside `rope_parameters`; classic: top-level theta + `rope_scaling`.
    let params = v.get("rope_parameters").filter(|p| p.is_object());
    let scaling_obj = params.or_else(|| v.get("rope_scaling").filter(|p| p.is_object()));
    let theta = params
        .and_then(|p| opt_f64(p, "rope_theta"))
        .or_else(|| opt_f64(v, "rope_theta"))
        .unwrap_or(if arch == Arch::SmallThinker {
            1e6
        } else {
            10000.0
        });
    let partial = params
        .and_then(|p| opt_f64(p, "partial_rotary_factor"))
        .or_else(|| opt_f64(v, "partial_rotary_factor"))
        .unwrap_or(1.0);
    let rotary_dim = match mla {
        Some(m) => m.qk_rope_head_dim,
        None => (head_dim as f64 * partial) as usize,
    };
    let interleave = match arch {
        Arch::DeepseekV3 | Arch::Glm4MoeLite => opt_bool(v, "rope_interleave").unwrap_or(true),
        // glm_moe_dsa's attention and indexer always rotate interleaved pairs (no `rope_interleave`).
        Arch::GlmMoeDsa => true,
        _ => false,
    };
    let style = if interleave {
        RopeStyle::Interleaved
    } else {
        RopeStyle::Neox
    };
    let max_pos = opt_f64(v, "max_position_embeddings").unwrap_or(4096.0);
    let scaling = match scaling_obj {
        None => RopeScaling::None,
        Some(s) => {
            let kind = s
                .get("rope_type")
                .or_else(|| s.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            let factor = opt_f64(s, "factor");
            let need_factor = || factor.ok_or(ConfigError::Field("rope_scaling.factor"));
            match kind {
                "default" => RopeScaling::None,
                "linear" => RopeScaling::Linear {
                    factor: need_factor()?,
                },
                "llama3" => RopeScaling::Llama3 {
                    factor: need_factor()?,
                    low_freq_factor: opt_f64(s, "low_freq_factor").unwrap_or(1.0),
                    high_freq_factor: opt_f64(s, "high_freq_factor").unwrap_or(4.0),
                    original_max_position_embeddings: opt_f64(
                        s,
                        "original_max_position_embeddings",
                    )
                    .ok_or(ConfigError::Field(
                        "rope_scaling.original_max_position_embeddings",
                    ))?,
                },
                "yarn" => {
                    let orig = opt_f64(s, "original_max_position_embeddings").unwrap_or(max_pos);
                    RopeScaling::Yarn {
                        factor: factor.unwrap_or(max_pos / orig),
                        original_max_position_embeddings: orig,
                        beta_fast: opt_f64(s, "beta_fast")
                            .filter(|x| *x != 0.0)
                            .unwrap_or(32.0),
                        beta_slow: opt_f64(s, "beta_slow").filter(|x| *x != 0.0).unwrap_or(1.0),
                        mscale: opt_f64(s, "mscale"),
                        mscale_all_dim: opt_f64(s, "mscale_all_dim"),
                        attention_factor: opt_f64(s, "attention_factor"),
                        truncate: opt_bool(s, "truncate").unwrap_or(true),
                    }
                }
                other => {
                    return Err(ConfigError::Invalid(format!(
                        "rope type `{other}` is not supported (default, linear, llama3, yarn)"
                    )))
                }
            }
        }
    };
    // GLM-5.3's MLA has no rotary part at all (rotary_dim 0).
    let nope_allowed = arch == Arch::Glm5Next && rotary_dim == 0;
    if !nope_allowed && (rotary_dim == 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim) {
        return Err(ConfigError::Invalid(format!(
            "rotary dimension {rotary_dim} must be even and within head_dim {head_dim}"
        )));
    }
    Ok(RopeConfig {
        theta,
        rotary_dim,
        style,
        scaling,
    })
}

/// Per-layer RoPE / NoPE and sliding-window layout (SmallThinker's `rope_layout`,
/// `sliding_window_layout`: one 0 or 1 per layer; `sliding_window_size`). Other architectures: every
/// layer rotates and attends to every earlier position. llama.cpp's SMALLTHINKER loader does not read the
/// layouts (it fixes a 4096 window on three layers of every four and NoPE on the fourth whenever a window
/// is present); the model repository's file reads them per layer, and it decides here.
pub(super) fn parse_layer_attention(
    v: &Value,
    arch: Arch,
    num_layers: usize,
) -> Result<Vec<LayerAttention>, ConfigError> {
    if arch == Arch::Glm5Next {
        // Its indexed layers are NoPE MLA (linear-attention layers do not read a layout).
        return Ok(vec![
            LayerAttention {
                rope: false,
                window: None
            };
            num_layers
        ]);
    }
    if arch != Arch::SmallThinker {
        return Ok(vec![LayerAttention::FULL; num_layers]);
    }
    let layout = |key: &'static str, absent: bool| -> Result<Vec<bool>, ConfigError> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(vec![absent; num_layers]),
            Some(Value::Array(a)) if a.len() == num_layers => a
                .iter()
                .map(|x| match x.as_u64() {
                    Some(0) => Ok(false),
                    Some(1) => Ok(true),
                    _ => Err(ConfigError::Invalid(format!(
                        "`{key}` holds {x}; each entry must be 0 or 1"
                    ))),
                })
                .collect(),
            Some(_) => Err(ConfigError::Invalid(format!(
                "`{key}` must be a list of {num_layers} entries (one per layer)"
            ))),
        }
    };
    let rope = layout("rope_layout", true)?;
    let sliding = layout("sliding_window_layout", false)?;
    let size = opt_usize(v, "sliding_window_size").unwrap_or(4096);
    if size == 0 && sliding.iter().any(|&s| s) {
        return Err(ConfigError::Invalid(
            "sliding_window_size must be positive when sliding_window_layout marks a layer".into(),
        ));
    }
    Ok(rope
        .into_iter()
        .zip(sliding)
        .map(|(rope, sliding)| LayerAttention {
            rope,
            window: sliding.then_some(size),
        })
        .collect())
}
