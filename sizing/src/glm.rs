//! `config.json` of the GLM MLA family as the engine reads it: GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`:
//! MLA), GLM-5 (`GlmMoeDsaForCausalLM`: MLA with q-LoRA and the per-token sparse-attention indexer) and
//! GLM-5.3-Flash (`Glm5NextForConditionalGeneration`: text fields under `text_config`, linear-attention
//! (KDA) layers mixed with NoPE MLA layers running the key-pool indexer, hyper-connections).
//!
//! Defaults are transformers 5.24's config classes' (`Glm4MoeLiteConfig`, `GlmMoeDsaConfig`,
//! `Glm5NextTextConfig`), as the daemon's `ModelConfig` applies them; a daemon test reads every GLM
//! fixture and known config both ways and compares the shapes. The memory of each layer kind is
//! [`crate::hybrid`]'s accounting.
use serde_json::{Map, Value};

use crate::hybrid::{HybridLayers, IndexerDims, IndexerKeys, LayerKind, LinearDims};
use crate::shape::{Attention, Moe, ShapeError};

/// The three architectures this file reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GlmArch {
    Glm47Flash,
    Glm5,
    Glm53Flash,
}

impl GlmArch {
    pub fn from_name(arch: &str) -> Option<Self> {
        Some(match arch {
            "Glm4MoeLiteForCausalLM" => Self::Glm47Flash,
            "GlmMoeDsaForCausalLM" => Self::Glm5,
            "Glm5NextForConditionalGeneration" => Self::Glm53Flash,
            _ => return None,
        })
    }
}

/// The text model's fields: `text_config` over the top level (architectures, quantization and token
/// ids stay visible from the top level). A config without `text_config` is returned as is.
pub fn text_fields(v: &Value) -> Value {
    let Some(text) = v.get("text_config").and_then(Value::as_object) else {
        return v.clone();
    };
    let mut merged: Map<String, Value> = v.as_object().cloned().unwrap_or_default();
    merged.remove("text_config");
    merged.remove("vision_config");
    for (k, x) in text {
        if !x.is_null() || !merged.contains_key(k) {
            merged.insert(k.clone(), x.clone());
        }
    }
    Value::Object(merged)
}

/// What GLM configs add to the shared fields of [`crate::ModelShape`].
pub struct GlmParts {
    pub attention: Attention,
    pub moe: Moe,
    pub hybrid: Option<HybridLayers>,
}

fn invalid(msg: String) -> ShapeError {
    ShapeError::Invalid(msg)
}

/// An optional non-negative integer: `default` when absent or null, an error when something else.
fn size_or(v: &Value, key: &str, default: u64) -> Result<u64, ShapeError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_u64()
            .ok_or_else(|| invalid(format!("`{key}` must be a non-negative integer"))),
    }
}

/// A required positive integer.
fn positive(v: &Value, key: &'static str) -> Result<u64, ShapeError> {
    v.get(key)
        .and_then(Value::as_u64)
        .filter(|&n| n > 0)
        .ok_or(ShapeError::Field(key))
}

/// A per-layer list of words (`layer_types`, `mlp_layer_types`, …) mapped through `word`, or
/// `default` per layer when absent or null. Refuses a list of another length or a word `word` does not
/// know. The daemon's config parser reads the same lists through this function.
pub fn per_layer<T>(
    v: &Value,
    key: &str,
    layers: u64,
    word: impl Fn(&str) -> Option<T>,
    default: impl Fn(u64) -> T,
) -> Result<Vec<T>, ShapeError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok((0..layers).map(default).collect()),
        Some(Value::Array(a)) if a.len() as u64 == layers => a
            .iter()
            .map(|x| {
                x.as_str()
                    .and_then(&word)
                    .ok_or_else(|| invalid(format!("`{key}` holds {x}, not a known layer type")))
            })
            .collect(),
        Some(_) => Err(invalid(format!(
            "`{key}` must be a list of {layers} entries (one per layer)"
        ))),
    }
}

/// Reads the attention, MoE and per-layer-kind fields of a GLM config (`v`: the text fields).
pub fn read(v: &Value, arch: GlmArch, layers: u64) -> Result<GlmParts, ShapeError> {
    let heads = positive(v, "num_attention_heads")?;
    let attention = match arch {
        GlmArch::Glm53Flash => {
            if size_or(v, "qk_rope_head_dim", 0)? != 0 {
                return Err(invalid(
                    "qk_rope_head_dim: GLM-5.3 indexed layers are NoPE (0)".into(),
                ));
            }
            Attention::Mla {
                heads,
                q_lora_rank: Some(size_or(v, "q_lora_rank", 1536)?),
                kv_lora_rank: size_or(v, "kv_lora_rank", 512)?,
                qk_nope_head_dim: size_or(v, "qk_nope_head_dim", 256)?,
                qk_rope_head_dim: 0,
                v_head_dim: size_or(v, "v_head_dim", 256)?,
            }
        }
        GlmArch::Glm47Flash | GlmArch::Glm5 => Attention::Mla {
            heads,
            q_lora_rank: v.get("q_lora_rank").and_then(Value::as_u64),
            kv_lora_rank: positive(v, "kv_lora_rank")?,
            qk_nope_head_dim: positive(v, "qk_nope_head_dim")?,
            qk_rope_head_dim: positive(v, "qk_rope_head_dim")?,
            v_head_dim: positive(v, "v_head_dim")?,
        },
    };
    // Dense / MoE per layer: `mlp_layer_types`, else the class default (GLM-4.7-Flash: first layer
    // dense; GLM-5: `first_k_dense_replace`, 3 by default; GLM-5.3-Flash: 3 dense layers).
    let first_dense = match arch {
        GlmArch::Glm47Flash => 1,
        GlmArch::Glm5 => size_or(v, "first_k_dense_replace", 3)?,
        GlmArch::Glm53Flash => 3,
    };
    let sparse = per_layer(
        v,
        "mlp_layer_types",
        layers,
        |s| match s {
            "dense" => Some(false),
            "sparse" => Some(true),
            _ => None,
        },
        |i| i >= first_dense,
    )?;
    let inter = positive(v, "moe_intermediate_size")?;
    let moe = Moe {
        experts: positive(v, "n_routed_experts")?,
        top_k: positive(v, "num_experts_per_tok")?,
        expert_intermediate: inter,
        shared_intermediate: inter * size_or(v, "n_shared_experts", 0)?,
        shared_gate: false,
        moe_layers: sparse.iter().filter(|&&s| s).count() as u64,
    };
    let hidden = positive(v, "hidden_size")?;
    let hybrid = match arch {
        GlmArch::Glm47Flash => None,
        GlmArch::Glm5 => Some(HybridLayers {
            hidden,
            kinds: own_indexers(v, layers)?
                .into_iter()
                .map(|own_indexer| LayerKind::Attention { own_indexer })
                .collect(),
            linear: None,
            indexer: Some(indexer_dims(v, IndexerKeys::PerToken)?),
            hyper_streams: None,
            q_rank: q_rank(&attention, hidden),
        }),
        GlmArch::Glm53Flash => Some(glm53_layers(v, hidden, layers, q_rank(&attention, hidden))?),
    };
    Ok(GlmParts {
        attention,
        moe,
        hybrid,
    })
}

/// GLM-5.3-Flash: `layer_types` (default: every fourth layer, 3, 7, …, indexed attention), the
/// linear layers' shape (`linear_attn_config` over the flat `linear_*` fields), the key-pool indexer
/// and `hc_mult` streams.
fn glm53_layers(
    v: &Value,
    hidden: u64,
    layers: u64,
    q_rank: u64,
) -> Result<HybridLayers, ShapeError> {
    let linear_kinds = per_layer(
        v,
        "layer_types",
        layers,
        |s| match s {
            "linear_attention" => Some(true),
            "indexed_attention" | "full_attention" | "deepseek_sparse_attention" => Some(false),
            _ => None,
        },
        |i| i % 4 != 3,
    )?;
    let own = own_indexers(v, layers)?;
    let kinds = linear_kinds
        .iter()
        .zip(own)
        .map(|(&linear, own_indexer)| {
            if linear {
                LayerKind::Linear
            } else {
                LayerKind::Attention { own_indexer }
            }
        })
        .collect();
    let nested = v.get("linear_attn_config").filter(|x| x.is_object());
    let pick = |flat: &str, inner: &str, default: u64| -> Result<u64, ShapeError> {
        match nested.filter(|c| c.get(inner).is_some_and(|x| !x.is_null())) {
            Some(c) => size_or(c, inner, default),
            None => size_or(v, flat, default),
        }
    };
    let linear = LinearDims {
        heads: pick("linear_num_heads", "num_heads", 64)?,
        head_dim: pick("linear_head_dim", "head_dim", 128)?,
        conv_kernel: pick("linear_conv_kernel_dim", "short_conv_kernel_size", 4)?,
    };
    if linear.heads == 0 || linear.head_dim == 0 || linear.conv_kernel == 0 {
        return Err(invalid(
            "linear attention needs positive heads, head width and convolution taps".into(),
        ));
    }
    let pool = size_or(v, "index_kpool", 16)?;
    if pool == 0 {
        return Err(invalid("`index_kpool` must be positive".into()));
    }
    Ok(HybridLayers {
        hidden,
        kinds,
        linear: Some(linear),
        indexer: Some(indexer_dims(v, IndexerKeys::Pooled { pool })?),
        hyper_streams: Some(size_or(v, "hc_mult", 4)?),
        q_rank,
    })
}

/// The indexer's query input width: MLA's q-LoRA rank (the hidden size without q-LoRA).
fn q_rank(attention: &Attention, hidden: u64) -> u64 {
    match attention {
        Attention::Mla {
            q_lora_rank: Some(r),
            ..
        } => *r,
        _ => hidden,
    }
}

/// The indexer's sizes (class defaults: 32 heads of 128, top-2048).
fn indexer_dims(v: &Value, keys: IndexerKeys) -> Result<IndexerDims, ShapeError> {
    let dims = IndexerDims {
        heads: size_or(v, "index_n_heads", 32)?,
        head_dim: size_or(v, "index_head_dim", 128)?,
        topk: size_or(v, "index_topk", 2048)?,
        keys,
    };
    if dims.heads == 0 || dims.head_dim == 0 || dims.topk == 0 {
        return Err(invalid(
            "the indexer needs positive index_n_heads, index_head_dim and index_topk".into(),
        ));
    }
    Ok(dims)
}

/// Per layer, whether it runs its own indexer: `indexer_types` ("full" / "shared"), else
/// `index_topk_pattern` ("FSS…"), else every `index_topk_freq`-th layer from `index_skip_topk_offset`
/// (defaults: every layer), as `GlmMoeDsaConfig` resolves them.
fn own_indexers(v: &Value, layers: u64) -> Result<Vec<bool>, ShapeError> {
    let word = |x: &Value| match x.as_str() {
        Some("full") => Ok(true),
        Some("shared") => Ok(false),
        _ => Err(invalid(format!(
            "`indexer_types` holds {x}; each entry must be \"full\" or \"shared\""
        ))),
    };
    let own: Vec<bool> = match (v.get("indexer_types"), v.get("index_topk_pattern")) {
        (Some(Value::Array(a)), _) => a.iter().map(word).collect::<Result<_, _>>()?,
        (Some(x), _) if !x.is_null() => {
            return Err(invalid("`indexer_types` must be a list".into()))
        }
        (_, Some(Value::String(p))) => p
            .chars()
            .map(|c| match c {
                'F' => Ok(true),
                'S' => Ok(false),
                _ => Err(invalid(format!(
                    "`index_topk_pattern` holds `{c}`; each letter must be F or S"
                ))),
            })
            .collect::<Result<_, _>>()?,
        (_, Some(Value::Array(a))) => a.iter().map(word).collect::<Result<_, _>>()?,
        _ => {
            let freq = size_or(v, "index_topk_freq", 1)?.max(1);
            let offset = size_or(v, "index_skip_topk_offset", 2)?;
            (0..layers)
                .map(|i| (i + 1).saturating_sub(offset) % freq == 0)
                .collect()
        }
    };
    if own.len() as u64 != layers {
        return Err(invalid(format!(
            "the indexer layout has {} entries; expected one per layer ({layers})",
            own.len()
        )));
    }
    Ok(own)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn glm53_defaults_follow_the_config_class() {
        let v = json!({"hidden_size": 64, "num_attention_heads": 4, "n_routed_experts": 8,
                       "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1});
        let p = read(&v, GlmArch::Glm53Flash, 8).unwrap();
        let hy = p.hybrid.unwrap();
        use LayerKind::*;
        let idx = Attention { own_indexer: true };
        assert_eq!(
            hy.kinds,
            vec![Linear, Linear, Linear, idx, Linear, Linear, Linear, idx]
        );
        assert_eq!(p.moe.moe_layers, 5, "3 dense layers");
        assert_eq!(p.moe.shared_intermediate, 16);
        let la = hy.linear.unwrap();
        assert_eq!((la.heads, la.head_dim, la.conv_kernel), (64, 128, 4));
        assert_eq!(hy.indexer.unwrap().keys, IndexerKeys::Pooled { pool: 16 });
        assert_eq!(hy.hyper_streams, Some(4));
        assert!(matches!(
            p.attention,
            crate::shape::Attention::Mla {
                q_lora_rank: Some(1536),
                kv_lora_rank: 512,
                qk_rope_head_dim: 0,
                ..
            }
        ));
    }

    #[test]
    fn nested_linear_config_overrides_the_flat_fields() {
        let v = json!({"hidden_size": 64, "num_attention_heads": 4, "n_routed_experts": 8,
                       "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                       "linear_num_heads": 7, "linear_head_dim": 9,
                       "linear_attn_config": {"num_heads": 3, "head_dim": 8, "short_conv_kernel_size": 2},
                       "layer_types": ["linear_attention", "deepseek_sparse_attention"]});
        let hy = read(&v, GlmArch::Glm53Flash, 2).unwrap().hybrid.unwrap();
        let la = hy.linear.unwrap();
        assert_eq!((la.heads, la.head_dim, la.conv_kernel), (3, 8, 2));
    }

    #[test]
    fn glm5_indexer_layouts() {
        let base = json!({"hidden_size": 64, "num_attention_heads": 4, "n_routed_experts": 8,
                          "num_experts_per_tok": 2, "moe_intermediate_size": 16, "kv_lora_rank": 32,
                          "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                          "q_lora_rank": 48});
        let own = |extra: Value| {
            let mut v = base.clone();
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            read(&v, GlmArch::Glm5, 4).map(|p| {
                p.hybrid
                    .unwrap()
                    .kinds
                    .iter()
                    .map(|k| *k == LayerKind::Attention { own_indexer: true })
                    .collect::<Vec<_>>()
            })
        };
        assert_eq!(own(json!({})).unwrap(), [true; 4]);
        assert_eq!(
            own(json!({"index_topk_pattern": "FSSF"})).unwrap(),
            [true, false, false, true]
        );
        assert_eq!(
            own(json!({"index_topk_freq": 2, "index_skip_topk_offset": 1})).unwrap(),
            [true, false, true, false]
        );
        for bad in [
            json!({"index_topk_pattern": "FF"}),
            json!({"indexer_types": ["full", "dense", "full", "full"]}),
            json!({"index_topk": 0}),
            json!({"mlp_layer_types": ["dense", "sparse"]}),
            json!({"kv_lora_rank": "512"}),
        ] {
            assert!(own(bad.clone()).is_err(), "{bad}");
        }
        let p = read(&base, GlmArch::Glm5, 4).unwrap();
        assert_eq!(p.moe.moe_layers, 1, "first_k_dense_replace defaults to 3");
        assert_eq!(p.hybrid.unwrap().indexer.unwrap().row_floats(), 128);
        assert!(read(&base, GlmArch::Glm47Flash, 4)
            .unwrap()
            .hybrid
            .is_none());
    }
}
