//! The config.json fields of the GLM MLA family (GLM-4.7-Flash `glm4_moe_lite`, GLM-5 `glm_moe_dsa`):
//! per-layer `mlp_layer_types`, MLA settings transformers does not read for them, and the sparse-attention
//! indexer ([`IndexerConfig`]; also GLM-5.3-Flash's key-pool variant), as the transformers 5.24 config
//! classes derive them.
use super::{opt_bool, opt_f64, opt_usize, Arch, ConfigError, MlaConfig};
use crate::model::hybrid::Mixer;
use serde_json::Value;

/// Largest `index_n_heads` / `index_head_dim` / `index_topk` accepted (GLM-5: 32 / 128 / 2048).
const INDEXER_LIMITS: [(&str, usize); 4] = [
    ("index_n_heads", 1024),
    ("index_head_dim", 4096),
    ("index_topk", 1 << 24),
    ("index_kpool", 1 << 16),
];

/// What the indexer of one layer does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexerLayer {
    /// Runs its own indexer (weights `self_attn.indexer.*`, keys in the layer's KV blocks).
    Own,
    /// Reuses the selection of the nearest earlier `Own` layer for the same tokens (`"shared"`).
    Shared,
}

/// How the indexer turns scored keys into attended positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexerPooling {
    /// DeepSeek sparse attention (GLM-5): the `topk` best-scoring earlier positions, one score per key.
    PerToken,
    /// GLM-5.3-Flash (`index_kpool`): keys are pooled `pool` at a time by a learned gated softmax; the
    /// `topk / pool` best complete pools are selected and expanded back to positions, and the
    /// incomplete pool that holds the query (its tail) is always attended.
    KeyPool { pool: usize },
}

/// The lightning indexer of DeepSeek sparse attention as GLM-5 / GLM-5.3-Flash configure it.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexerConfig {
    pub n_heads: usize,
    pub head_dim: usize,
    /// Positions attended per query (PerToken) or pooled budget (`topk / pool` pools for KeyPool).
    pub topk: usize,
    /// Leading dims of each indexer head rotated with interleaved RoPE (GLM-5: `qk_rope_head_dim`);
    /// 0 = no rotation (GLM-5.3-Flash).
    pub rope_dim: usize,
    pub pooling: IndexerPooling,
    /// One entry per layer.
    pub layers: Vec<IndexerLayer>,
}

impl IndexerConfig {
    /// Floats per position the indexer keeps in the layer's KV blocks: the normalised key, plus the
    /// gate logits of the pooling for KeyPool.
    pub fn row_width(&self) -> usize {
        self.dims().row_floats() as usize
    }

    /// The memory plan's view of this indexer (the sizing crate's accounting, shared with the operator).
    pub fn dims(&self) -> moe_sizing::IndexerDims {
        moe_sizing::IndexerDims {
            heads: self.n_heads as u64,
            head_dim: self.head_dim as u64,
            topk: self.topk as u64,
            keys: match self.pooling {
                IndexerPooling::PerToken => moe_sizing::IndexerKeys::PerToken,
                IndexerPooling::KeyPool { pool } => {
                    moe_sizing::IndexerKeys::Pooled { pool: pool as u64 }
                }
            },
        }
    }
}

/// Per layer, true when the FFN is the MoE block, from `mlp_layer_types` (`"dense"` / `"sparse"`), or the
/// class default where it is absent (GLM-4.7-Flash: first layer dense; GLM-5: `first_k_dense_replace`
/// dense layers, 3 by default). None for other architectures.
pub(super) fn mlp_layer_types(
    v: &Value,
    arch: Arch,
    num_layers: usize,
) -> Result<Option<Vec<bool>>, ConfigError> {
    let default_dense = match arch {
        Arch::Glm4MoeLite => 1,
        Arch::GlmMoeDsa => opt_usize(v, "first_k_dense_replace").unwrap_or(3),
        _ => return Ok(None),
    };
    match v.get("mlp_layer_types") {
        None | Some(Value::Null) => Ok(Some((0..num_layers).map(|i| i >= default_dense).collect())),
        Some(Value::Array(a)) if a.len() == num_layers => a
            .iter()
            .map(|x| match x.as_str() {
                Some("dense") => Ok(false),
                Some("sparse") => Ok(true),
                _ => Err(ConfigError::Invalid(format!(
                    "`mlp_layer_types` holds {x}; each entry must be \"dense\" or \"sparse\""
                ))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(_) => Err(ConfigError::Invalid(format!(
            "`mlp_layer_types` must be a list of {num_layers} entries (one per layer)"
        ))),
    }
}

/// MLA settings the GLM variants fix: GLM-5's attention always goes through q-LoRA (its indexer reads
/// the q-LoRA residual), and both rotate exactly `qk_rope_head_dim` dims (transformers points
/// `head_dim` at it; a `partial_rotary_factor` below 1 would mis-shape their RoPE).
pub(super) fn check_mla(v: &Value, arch: Arch, mla: Option<&MlaConfig>) -> Result<(), ConfigError> {
    if !matches!(arch, Arch::Glm4MoeLite | Arch::GlmMoeDsa) {
        return Ok(());
    }
    let m = mla.ok_or(ConfigError::Field("kv_lora_rank"))?;
    if arch == Arch::GlmMoeDsa && m.q_lora_rank.is_none() {
        return Err(ConfigError::Invalid(
            "GlmMoeDsaForCausalLM needs `q_lora_rank` (its indexer reads the q-LoRA output)".into(),
        ));
    }
    let partial = v
        .get("rope_parameters")
        .and_then(|p| opt_f64(p, "partial_rotary_factor"))
        .or_else(|| opt_f64(v, "partial_rotary_factor"))
        .unwrap_or(1.0);
    if partial != 1.0 {
        return Err(ConfigError::Invalid(format!(
            "partial_rotary_factor {partial} is not supported for MLA models (the rotated part is qk_rope_head_dim)"
        )));
    }
    Ok(())
}

/// One `index_*` size: the config class default when absent, an error outside `1..=` its limit.
fn indexer_size(v: &Value, key: &'static str, default: usize) -> Result<usize, ConfigError> {
    let x = match v.get(key) {
        None | Some(Value::Null) => default,
        Some(raw) => raw
            .as_u64()
            .map(|x| x as usize)
            .ok_or(ConfigError::Field(key))?,
    };
    let max = INDEXER_LIMITS
        .iter()
        .find(|(k, _)| *k == key)
        .map_or(usize::MAX, |l| l.1);
    if x == 0 || x > max {
        return Err(ConfigError::Invalid(format!(
            "`{key}` is {x}; expected an integer in 1..={max}"
        )));
    }
    Ok(x)
}

/// The indexer of GLM-5 (`GlmMoeDsaConfig`): sizes, and per layer `indexer_types`, or else the pattern
/// `index_topk_pattern` ("FSS…"), or else every `index_topk_freq`-th layer from
/// `index_skip_topk_offset` runs its own indexer (defaults: every layer).
pub(super) fn parse_indexer(
    v: &Value,
    arch: Arch,
    num_layers: usize,
    mla: Option<&MlaConfig>,
) -> Result<Option<IndexerConfig>, ConfigError> {
    if arch != Arch::GlmMoeDsa {
        return Ok(None);
    }
    let n_heads = indexer_size(v, "index_n_heads", 32)?;
    let head_dim = indexer_size(v, "index_head_dim", 128)?;
    let topk = indexer_size(v, "index_topk", 2048)?;
    let rope_dim = mla.map_or(0, |m| m.qk_rope_head_dim);
    if rope_dim > head_dim {
        return Err(ConfigError::Invalid(format!(
            "index_head_dim {head_dim} is smaller than qk_rope_head_dim {rope_dim}"
        )));
    }
    if v.get("index_kpool").is_some_and(|x| !x.is_null())
        || opt_bool(v, "index_kpool_always_select_tail").is_some()
    {
        return Err(ConfigError::Invalid(
            "`index_kpool` is not read by GlmMoeDsaForCausalLM (it belongs to GLM-5.3-Flash)"
                .into(),
        ));
    }
    let layers = indexer_types(v, num_layers)?;
    Ok(Some(IndexerConfig {
        n_heads,
        head_dim,
        topk,
        rope_dim,
        pooling: IndexerPooling::PerToken,
        layers,
    }))
}

/// The key-pool indexer of GLM-5.3-Flash (`Glm5NextTextConfig`): sizes (class defaults 32 heads of 128,
/// `index_topk` 2048, `index_kpool` 16) and the same per-layer `indexer_types` resolution as GLM-5. Its
/// keys are not roped (the indexed layers are NoPE). transformers hands a `"shared"` layer the selection
/// of the decoder layer just before it, so that layer must be an indexed layer with its own indexer;
/// entries on linear-attention layers are not read.
pub(super) fn parse_pooled_indexer(
    v: &Value,
    mixers: &[Mixer],
) -> Result<IndexerConfig, ConfigError> {
    let n_heads = indexer_size(v, "index_n_heads", 32)?;
    let head_dim = indexer_size(v, "index_head_dim", 128)?;
    let topk = indexer_size(v, "index_topk", 2048)?;
    let pool = indexer_size(v, "index_kpool", 16)?;
    if topk % pool != 0 {
        return Err(ConfigError::Invalid(format!(
            "index_topk ({topk}) must be divisible by index_kpool ({pool})"
        )));
    }
    if opt_bool(v, "index_kpool_always_select_tail") == Some(false) {
        return Err(ConfigError::Invalid(
            "`index_kpool_always_select_tail` false is not supported (the query's own pool is always attended)"
                .into(),
        ));
    }
    let layers = indexer_layout(v, mixers.len())?;
    for (i, (mixer, ix)) in mixers.iter().zip(&layers).enumerate() {
        let previous_own =
            i > 0 && mixers[i - 1] == Mixer::Attention && layers[i - 1] == IndexerLayer::Own;
        if *mixer == Mixer::Attention && *ix == IndexerLayer::Shared && !previous_own {
            return Err(ConfigError::Invalid(format!(
                "layer {i}'s indexer is \"shared\", but the layer before it is not an indexed layer running its own indexer (the selection it would reuse)"
            )));
        }
    }
    Ok(IndexerConfig {
        n_heads,
        head_dim,
        topk,
        rope_dim: 0,
        pooling: IndexerPooling::KeyPool { pool },
        layers,
    })
}

/// `indexer_types` / `index_topk_pattern` / `index_topk_freq` + `index_skip_topk_offset`, as
/// `GlmMoeDsaConfig.__post_init__` resolves them. The first layer must run its own indexer.
pub fn indexer_types(v: &Value, num_layers: usize) -> Result<Vec<IndexerLayer>, ConfigError> {
    let layers = indexer_layout(v, num_layers)?;
    if layers.first() == Some(&IndexerLayer::Shared) {
        return Err(ConfigError::Invalid(
            "the first layer's indexer is \"shared\": there is no earlier selection to reuse"
                .into(),
        ));
    }
    Ok(layers)
}

/// The per-layer entries of `indexer_types` (or its pattern / schedule), one per layer.
fn indexer_layout(v: &Value, num_layers: usize) -> Result<Vec<IndexerLayer>, ConfigError> {
    let word = |x: &Value| match x.as_str() {
        Some("full") => Ok(IndexerLayer::Own),
        Some("shared") => Ok(IndexerLayer::Shared),
        _ => Err(ConfigError::Invalid(format!(
            "`indexer_types` holds {x}; each entry must be \"full\" or \"shared\""
        ))),
    };
    let layers: Vec<IndexerLayer> = match (v.get("indexer_types"), v.get("index_topk_pattern")) {
        (Some(Value::Array(a)), _) => a.iter().map(word).collect::<Result<_, _>>()?,
        (Some(x), _) if !x.is_null() => {
            return Err(ConfigError::Invalid(
                "`indexer_types` must be a list".into(),
            ))
        }
        (_, Some(Value::String(p))) => p
            .chars()
            .map(|c| match c {
                'F' => Ok(IndexerLayer::Own),
                'S' => Ok(IndexerLayer::Shared),
                _ => Err(ConfigError::Invalid(format!(
                    "`index_topk_pattern` holds `{c}`; each letter must be F or S"
                ))),
            })
            .collect::<Result<_, _>>()?,
        (_, Some(Value::Array(a))) => a.iter().map(word).collect::<Result<_, _>>()?,
        _ => {
            let freq = opt_usize(v, "index_topk_freq").unwrap_or(1).max(1);
            let offset = opt_usize(v, "index_skip_topk_offset").unwrap_or(2);
            (0..num_layers)
                .map(|i| {
                    if (i + 1).saturating_sub(offset) % freq == 0 {
                        IndexerLayer::Own
                    } else {
                        IndexerLayer::Shared
                    }
                })
                .collect()
        }
    };
    if layers.len() != num_layers {
        return Err(ConfigError::Invalid(format!(
            "the indexer layout has {} entries; expected one per layer ({num_layers})",
            layers.len()
        )));
    }
    Ok(layers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelConfig;
    use serde_json::json;

    fn dsa() -> Value {
        json!({"architectures": ["GlmMoeDsaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 100, "head_dim": 8,
               "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
               "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
               "n_shared_experts": 1, "index_topk": 4, "index_head_dim": 16, "index_n_heads": 4,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    }

    #[test]
    fn glm5_defaults_and_indexer_layout() {
        let c = ModelConfig::from_json(&dsa()).unwrap();
        assert_eq!(c.arch, Arch::GlmMoeDsa);
        assert_eq!(c.head_dim, 24, "MLA q/k head, not config.json's head_dim");
        assert_eq!(c.rope.rotary_dim, 8);
        assert_eq!(c.rope.style, crate::model::config::RopeStyle::Interleaved);
        assert_eq!(
            c.moe_layers,
            vec![false, false, false, true],
            "3 dense by default"
        );
        assert_eq!(c.max_position_embeddings, 202752);
        let ix = c.indexer.unwrap();
        assert_eq!(
            (ix.n_heads, ix.head_dim, ix.topk, ix.rope_dim),
            (4, 16, 4, 8)
        );
        assert_eq!(ix.layers, vec![IndexerLayer::Own; 4]);
        assert_eq!(ix.row_width(), 16);
        let layout = |extra: Value| {
            let mut v = dsa();
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            ModelConfig::from_json(&v).map(|c| c.indexer.unwrap().layers)
        };
        use IndexerLayer::{Own as F, Shared as S};
        assert_eq!(
            layout(json!({"index_topk_pattern": "FSSF"})).unwrap(),
            [F, S, S, F]
        );
        assert_eq!(
            layout(json!({"index_topk_freq": 2, "index_skip_topk_offset": 1})).unwrap(),
            [F, S, F, S]
        );
        assert_eq!(
            layout(json!({"indexer_types": ["full", "shared", "full", "full"], "index_topk_pattern": "FFFF"}))
                .unwrap(),
            [F, S, F, F],
            "indexer_types wins over the pattern"
        );
        for bad in [
            json!({"index_topk_pattern": "SFFF"}),
            json!({"index_topk_pattern": "FF"}),
            json!({"indexer_types": ["full", "dense", "full", "full"]}),
            json!({"index_topk": 0}),
            json!({"index_head_dim": 4}),
            json!({"index_kpool": 4}),
            json!({"q_lora_rank": null}),
            json!({"mlp_layer_types": ["dense", "sparse"]}),
        ] {
            let e = layout(bad.clone()).unwrap_err().to_string();
            assert!(
                e.contains("index") || e.contains("q_lora") || e.contains("mlp_layer"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn glm47_flash_mlp_layer_types_and_rope() {
        let mut v = dsa();
        v["architectures"] = json!(["Glm4MoeLiteForCausalLM"]);
        let c = ModelConfig::from_json(&v).unwrap();
        assert!(c.indexer.is_none());
        assert_eq!(c.moe_layers, vec![false, true, true, true]);
        assert_eq!(c.rope.style, crate::model::config::RopeStyle::Interleaved);
        assert_eq!(c.mla.as_ref().unwrap().latent_norm_eps, 1e-6);
        v["mlp_layer_types"] = json!(["sparse", "dense", "sparse", "dense"]);
        v["rope_interleave"] = json!(false);
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.moe_layers, vec![true, false, true, false]);
        assert_eq!(c.rope.style, crate::model::config::RopeStyle::Neox);
        v["mlp_layer_types"] = json!(["sparse", "moe", "sparse", "dense"]);
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("mlp_layer_types"), "{e}");
        v["mlp_layer_types"] = Value::Null;
        v["rope_parameters"]["partial_rotary_factor"] = json!(0.5);
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("partial_rotary_factor"), "{e}");
    }
}
