//! The MoE block of `config.json` (part of [`super`]'s parsing): experts, router kind and input,
//! shared experts, which layers are MoE.
use super::*;

pub(super) fn parse_moe(
    v: &Value,
    arch: Arch,
    num_layers: usize,
) -> Result<(Option<MoeConfig>, Vec<bool>), ConfigError> {
    let norm = opt_bool(v, "norm_topk_prob");
    let top_k = opt_usize(v, "num_experts_per_tok");
    let (moe, layers): (MoeConfig, Vec<bool>) = match arch {
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 => return Ok((None, vec![false; num_layers])),
        Arch::Mixtral => (
            MoeConfig {
                num_experts: get_usize(v, "num_local_experts")?,
                top_k: top_k.ok_or(ConfigError::Field("num_experts_per_tok"))?,
                expert_intermediate: get_usize(v, "intermediate_size")?,
                router: RouterKind::Softmax { renormalize: true },
                routed_scaling_factor: 1.0,
                shared_intermediate: None,
                shared_gate: false,
                router_input: RouterInput::FfnInput,
            },
            vec![true; num_layers],
        ),
        Arch::Qwen2Moe | Arch::Qwen3Moe => {
            let num_experts = opt_usize(v, "num_experts")
                .or_else(|| opt_usize(v, "num_local_experts"))
                .ok_or(ConfigError::Field("num_experts"))?;
            let step = opt_usize(v, "decoder_sparse_step").unwrap_or(1).max(1);
            let dense: Vec<usize> = v
                .get("mlp_only_layers")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_u64())
                        .map(|x| x as usize)
                        .collect()
                })
                .unwrap_or_default();
            let layers = (0..num_layers)
                .map(|i| !dense.contains(&i) && num_experts > 0 && (i + 1) % step == 0)
                .collect();
            let qwen2 = arch == Arch::Qwen2Moe;
            (
                MoeConfig {
                    num_experts,
                    top_k: top_k.ok_or(ConfigError::Field("num_experts_per_tok"))?,
                    expert_intermediate: get_usize(v, "moe_intermediate_size")?,
                    router: RouterKind::Softmax {
                        renormalize: norm.unwrap_or(!qwen2),
                    },
                    routed_scaling_factor: 1.0,
                    shared_intermediate: if qwen2 {
                        opt_usize(v, "shared_expert_intermediate_size").filter(|&w| w > 0)
                    } else {
                        None
                    },
                    shared_gate: qwen2,
                    router_input: RouterInput::FfnInput,
                },
                layers,
            )
        }
        Arch::Glm4Moe | Arch::DeepseekV3 | Arch::Glm4MoeLite | Arch::GlmMoeDsa | Arch::Glm5Next => {
            let num_experts = get_usize(v, "n_routed_experts")?;
            let inter = get_usize(v, "moe_intermediate_size")?;
            let first_dense = opt_usize(v, "first_k_dense_replace").unwrap_or(0);
            let freq = opt_usize(v, "moe_layer_freq").unwrap_or(1).max(1);
            let n_group = opt_usize(v, "n_group").unwrap_or(1).max(1);
            let topk_group = opt_usize(v, "topk_group").unwrap_or(1).max(1);
            if num_experts % n_group != 0 || topk_group > n_group {
                return Err(ConfigError::Invalid(format!(
                    "n_routed_experts {num_experts} must split into n_group {n_group} groups with topk_group {topk_group} <= n_group"
                )));
            }
            let shared = opt_usize(v, "n_shared_experts").unwrap_or(0);
            let layers = match glm::mlp_layer_types(v, arch, num_layers)? {
                Some(sparse) => sparse,
                None => (0..num_layers)
                    .map(|i| i >= first_dense && i % freq == 0)
                    .collect(),
            };
            (
                MoeConfig {
                    num_experts,
                    top_k: top_k.ok_or(ConfigError::Field("num_experts_per_tok"))?,
                    expert_intermediate: inter,
                    router: RouterKind::SigmoidGrouped {
                        n_group,
                        topk_group,
                        renormalize: norm.unwrap_or(true),
                    },
                    routed_scaling_factor: opt_f64(v, "routed_scaling_factor")
                        .unwrap_or(if arch == Arch::Glm5Next { 2.5 } else { 1.0 })
                        as f32,
                    shared_intermediate: (shared > 0).then_some(inter * shared),
                    shared_gate: false,
                    router_input: RouterInput::FfnInput,
                },
                layers,
            )
        }
        Arch::SmallThinker => {
            // The model file takes the top-k of the raw router logits, then either a softmax over those
            // k (`moe_primary_router_apply_softmax`) or their sigmoids divided by their sum. The first
            // equals softmax over all experts → top-k → renormalise (softmax is monotonic and its
            // normaliser cancels); the second equals sigmoid scores → top-k → renormalise with one
            // group and no correction bias. `norm_topk_prob`, present in some of its configs, is not
            // read by the model file and is ignored here too.
            let softmax = opt_bool(v, "moe_primary_router_apply_softmax").unwrap_or(false);
            (
                MoeConfig {
                    num_experts: get_usize(v, "moe_num_primary_experts")?,
                    top_k: get_usize(v, "moe_num_active_primary_experts")?,
                    expert_intermediate: get_usize(v, "moe_ffn_hidden_size")?,
                    router: if softmax {
                        RouterKind::Softmax { renormalize: true }
                    } else {
                        RouterKind::SigmoidGrouped {
                            n_group: 1,
                            topk_group: 1,
                            renormalize: true,
                        }
                    },
                    routed_scaling_factor: 1.0,
                    shared_intermediate: None,
                    shared_gate: false,
                    // The model repository's `SmallThinkerDecoderLayer` always routes from the layer
                    // input (llama.cpp, vLLM and SGLang agree). KTransformers' copy has a
                    // `moe_enable_early_router` switch that the model repository's file does not
                    // read; where they disagree the model repository's file decides.
                    router_input: RouterInput::LayerInput,
                },
                vec![true; num_layers],
            )
        }
    };
    if moe.top_k == 0 || moe.top_k > moe.num_experts {
        return Err(ConfigError::Invalid(format!(
            "num_experts_per_tok {} must be within 1..={}",
            moe.top_k, moe.num_experts
        )));
    }
    Ok((Some(moe), layers))
}
