//! GLM-5.3-Flash for `bench synth-checkpoint --like glm-5.3-flash`: its config.json and the tensors of
//! its hybrid layers (linear attention, indexed MLA with the indexer, hyper-connections), named as the
//! released multimodal checkpoint names them (`model.language_model.*`).
//!
//! Its config.json (and where each number comes from) is `moe_sizing::known`'s `glm-5.3-flash`.
use serde_json::Value;

/// Keeps the first `layers` layers in every per-layer list of the text config.
pub fn set_layers(text: &mut Value, layers: usize) {
    for key in ["layer_types", "mlp_layer_types", "indexer_types"] {
        if let Some(a) = text.get_mut(key).and_then(Value::as_array_mut) {
            a.truncate(layers);
        }
    }
    if let Some(lac) = text.get_mut("linear_attn_config") {
        for key in ["kda_layers", "full_attn_layers"] {
            if let Some(a) = lac.get_mut(key).and_then(Value::as_array_mut) {
                a.retain(|x| x.as_u64().is_some_and(|i| (i as usize) < layers));
            }
        }
    }
}

/// What kind of values a tensor holds (mirrors synth.rs's `Kind` without depending on it).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Values {
    /// Projection `[out, in]` (bf16 or FP8).
    Proj,
    /// Norm weight (ones).
    Norm,
    /// Small F32 values (kept in F32 by the checkpoint: convolution, gate biases, hyper-connection
    /// bases and scales).
    F32,
}

/// The token mixer and hyper-connection tensors of layer `l` (its FFN and norms come from the shared
/// code): `p(name, shape, values)`.
pub fn mixer_specs(
    c: &crate::model::ModelConfig,
    l: usize,
    prefix: &str,
    p: &mut dyn FnMut(String, Vec<usize>, Values),
) {
    use crate::model::hybrid::Mixer;
    let h = c.hidden_size;
    let a = format!("{prefix}.self_attn");
    if let (Some(Mixer::Linear), Some(la)) = (c.mixers.get(l), &c.linear_attention) {
        let (qkv, hd, heads, k) = (la.qkv_dim(), la.head_dim, la.num_heads, la.conv_kernel);
        for n in ["q_proj", "k_proj", "v_proj"] {
            p(format!("{a}.{n}.weight"), vec![qkv, h], Values::Proj);
        }
        for n in ["q_conv1d", "k_conv1d", "v_conv1d"] {
            p(format!("{a}.{n}.weight"), vec![qkv, 1, k], Values::F32);
        }
        p(format!("{a}.f_a_proj.weight"), vec![hd, h], Values::Proj);
        p(format!("{a}.f_b_proj.weight"), vec![qkv, hd], Values::Proj);
        p(format!("{a}.dt_bias"), vec![qkv], Values::F32);
        p(format!("{a}.A_log"), vec![heads], Values::F32);
        p(format!("{a}.b_proj.weight"), vec![heads, h], Values::Proj);
        p(format!("{a}.g_a_proj.weight"), vec![hd, h], Values::Proj);
        p(format!("{a}.g_b_proj.weight"), vec![qkv, hd], Values::Proj);
        p(format!("{a}.o_norm.weight"), vec![hd], Values::Norm);
        p(format!("{a}.o_proj.weight"), vec![h, qkv], Values::Proj);
    } else if let Some(m) = &c.mla {
        let r = m.q_lora_rank.unwrap_or(h);
        let nh = c.num_heads;
        p(format!("{a}.q_a_proj.weight"), vec![r, h], Values::Proj);
        p(format!("{a}.q_a_layernorm.weight"), vec![r], Values::Norm);
        p(
            format!("{a}.q_b_proj.weight"),
            vec![nh * m.qk_nope_head_dim, r],
            Values::Proj,
        );
        p(
            format!("{a}.kv_a_proj_with_mqa.weight"),
            vec![m.kv_lora_rank, h],
            Values::Proj,
        );
        p(
            format!("{a}.kv_a_layernorm.weight"),
            vec![m.kv_lora_rank],
            Values::Norm,
        );
        p(
            format!("{a}.kv_b_proj.weight"),
            vec![nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
            Values::Proj,
        );
        p(
            format!("{a}.o_proj.weight"),
            vec![h, nh * m.v_head_dim],
            Values::Proj,
        );
        indexer_specs(c, l, &a, r, p);
    }
    if let Some(hc) = &c.hyper {
        let rows = (2 + hc.mult) * hc.mult;
        for which in ["attn", "ffn"] {
            p(
                format!("{prefix}.hc_{which}_fn"),
                vec![rows, hc.mult * h],
                Values::Proj,
            );
            p(format!("{prefix}.hc_{which}_base"), vec![rows], Values::F32);
            p(format!("{prefix}.hc_{which}_scale"), vec![3], Values::F32);
        }
    }
}

/// The key-pool indexer's tensors under attention prefix `a` (`q_lora_rank` `r`), on a layer that runs
/// its own indexer.
fn indexer_specs(
    c: &crate::model::ModelConfig,
    l: usize,
    a: &str,
    r: usize,
    p: &mut dyn FnMut(String, Vec<usize>, Values),
) {
    use crate::model::config::{IndexerLayer, IndexerPooling};
    let Some(ix) = &c.indexer else { return };
    let IndexerPooling::KeyPool { pool } = ix.pooling else {
        return;
    };
    if ix.layers.get(l) != Some(&IndexerLayer::Own) {
        return;
    }
    let (h, ih, id) = (c.hidden_size, ix.n_heads, ix.head_dim);
    let i = format!("{a}.indexer");
    p(format!("{i}.wq_b.weight"), vec![ih * id, r], Values::Proj);
    p(format!("{i}.wk.weight"), vec![id, h], Values::Proj);
    p(format!("{i}.k_norm.weight"), vec![id], Values::Norm);
    p(format!("{i}.k_norm.bias"), vec![id], Values::F32);
    p(
        format!("{i}.weights_proj.weight"),
        vec![ih, h],
        Values::Proj,
    );
    p(
        format!("{i}.index_kpool_compress_ape"),
        vec![pool, id],
        Values::F32,
    );
    p(
        format!("{i}.index_kpool_compress_gate"),
        vec![id, h],
        Values::Proj,
    );
}
