//! The memory plan of one GPU of a tensor-parallel group (`--tensor-parallel N`, the operator's
//! `gpu.count`): what each of N identical GPUs of one node holds.
//!
//! Per GPU: attention heads and dense / shared-expert intermediate units divided by N (GQA KV heads
//! divided, or one replicated KV head per GPU when the GPUs outnumber them; MLA's latent projections
//! and cache replicated); lm_head rows divided by N; the embedding table, routers and norms
//! replicated; the KV cache holds the GPU's own KV heads; step buffers are sized as for one GPU
//! (each GPU computes the full hidden width between its all-reduces). Routed experts are not split:
//! each GPU holds `gpu_experts_per_layer` whole experts per layer, so the node holds N times that
//! (`node_experts_per_layer`); `--gpu-experts auto` fills every GPU, and a count asked of the node
//! is spread over the GPUs. Hybrid models: linear-attention (KDA) heads are divided like attention
//! heads, so each GPU holds its heads' projections and their recurrent state; hyper-connections and
//! the sparse-attention indexer are replicated.
use crate::plan::{plan_with_inputs, ExpertsChoice, MemoryPlan, PlanError, PlanInputs};
use crate::shape::{Attention, ModelShape};
use crate::weights::DenseDtype;

/// Why a shape does not split over the GPUs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    #[error("tensor parallelism needs at least one GPU")]
    NoGpu,
    #[error("{heads} attention heads do not split over {gpus} GPUs")]
    Heads { heads: u64, gpus: u64 },
    #[error("{heads} linear-attention (KDA) heads do not split over {gpus} GPUs")]
    LinearHeads { heads: u64, gpus: u64 },
    #[error("{kv_heads} KV heads and {gpus} GPUs: one must divide the other")]
    KvHeads { kv_heads: u64, gpus: u64 },
    #[error("{what} intermediate size {size} does not split over {gpus} GPUs")]
    Intermediate {
        what: &'static str,
        size: u64,
        gpus: u64,
    },
}

/// The part of `shape` one of `gpus` GPUs computes: heads and intermediate sizes divided (the
/// vocabulary is left whole: the embedding table is replicated; [`device_lm_head_rows`] gives the
/// lm_head's share).
pub fn device_shape(shape: &ModelShape, gpus: u64) -> Result<ModelShape, SplitError> {
    if gpus == 0 {
        return Err(SplitError::NoGpu);
    }
    let mut s = shape.clone();
    if gpus == 1 {
        return Ok(s);
    }
    let heads_split = |heads: u64| {
        if heads.is_multiple_of(gpus) {
            Ok(heads / gpus)
        } else {
            Err(SplitError::Heads { heads, gpus })
        }
    };
    s.attention = match shape.attention {
        Attention::Gqa {
            heads,
            kv_heads,
            head_dim,
            qkv_bias,
        } => {
            let heads = heads_split(heads)?;
            let kv = if kv_heads.is_multiple_of(gpus) {
                kv_heads / gpus
            } else if kv_heads > 0 && gpus.is_multiple_of(kv_heads) {
                1
            } else {
                return Err(SplitError::KvHeads { kv_heads, gpus });
            };
            Attention::Gqa {
                heads,
                kv_heads: kv,
                head_dim,
                qkv_bias,
            }
        }
        Attention::Mla {
            heads,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        } => Attention::Mla {
            heads: heads_split(heads)?,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        },
    };
    let split = |what, size: u64| {
        if size.is_multiple_of(gpus) {
            Ok(size / gpus)
        } else {
            Err(SplitError::Intermediate { what, size, gpus })
        }
    };
    if shape.layers > shape.moe_layers() {
        s.dense_intermediate = split("dense MLP", shape.dense_intermediate)?;
    }
    if let Some(m) = s.moe.as_mut() {
        if m.shared_intermediate > 0 {
            m.shared_intermediate = split("shared expert", m.shared_intermediate)?;
        }
    }
    if let Some(hy) = s.hybrid.as_mut().filter(|h| h.linear_heads > 0) {
        if !hy.linear_heads.is_multiple_of(gpus) {
            return Err(SplitError::LinearHeads {
                heads: hy.linear_heads,
                gpus,
            });
        }
        hy.linear_heads /= gpus;
        hy.state_floats = crate::hybrid::LinearDims {
            heads: hy.linear_heads,
            head_dim: hy.linear_head_dim,
            conv_kernel: hy.conv_kernel,
        }
        .state_floats();
    }
    Ok(s)
}

/// lm_head rows one of `gpus` GPUs holds (the largest share when the vocabulary does not divide).
pub fn device_lm_head_rows(vocab: u64, gpus: u64) -> u64 {
    vocab.div_ceil(gpus.max(1))
}

/// `inputs` as one GPU of `gpus` sees them: a per-layer expert count asked of the node becomes each
/// GPU's share (rounded up: the GPUs holding one more expert of a layer set the memory).
pub fn device_inputs(inputs: &PlanInputs, gpus: u64) -> PlanInputs {
    let mut i = inputs.clone();
    if let ExpertsChoice::PerLayer(n) = inputs.experts {
        i.experts = ExpertsChoice::PerLayer(n.div_ceil(gpus.max(1)));
    }
    for p in &mut i.pins {
        p.gpu = p.gpu.div_ceil(gpus.max(1));
    }
    i
}

/// The plan of each GPU of a `gpus`-GPU group for fixed choices of dense dtype and embedding home.
pub fn device_plan_with(
    shape: &ModelShape,
    inputs: &PlanInputs,
    dtype: DenseDtype,
    host_embeddings: bool,
    gpus: u64,
) -> Result<MemoryPlan, PlanError> {
    let dev = device_shape(shape, gpus).map_err(PlanError::DoesNotSplit)?;
    let mut dense = crate::weights::dense_bytes(&dev, dtype, host_embeddings);
    if gpus > 1 {
        // Each GPU holds its own lm_head rows, tied or not (the table is not split).
        dense.lm_head = crate::weights::lm_head_layout(shape, dtype)
            .bytes(device_lm_head_rows(shape.vocab, gpus), shape.hidden);
    }
    let per_gpu = device_inputs(inputs, gpus);
    let mut plan = plan_with_inputs(shape, &dev, dense, &per_gpu, dtype, host_embeddings)?;
    plan.gpus = gpus;
    plan.node_experts_per_layer = match inputs.experts {
        // the count asked of the node, which the GPUs' shares cover
        ExpertsChoice::PerLayer(n) => n.min(shape.experts_per_layer()),
        ExpertsChoice::Auto => (plan.gpu_experts_per_layer * gpus).min(shape.experts_per_layer()),
    };
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::known::{config_json, KNOWN_MODELS};
    use crate::plan::{choose, choose_devices, DenseChoice, EmbeddingChoice, KvRequest};

    const GIB: u64 = 1 << 30;

    fn known(key: &str) -> ModelShape {
        ModelShape::from_config_json(&config_json(key).unwrap()).unwrap()
    }

    fn inputs(card_gib: u64, experts: ExpertsChoice) -> PlanInputs {
        PlanInputs {
            budget_bytes: card_gib * GIB,
            dense: DenseChoice::Fixed(DenseDtype::Bf16),
            embeddings: EmbeddingChoice::Gpu,
            experts,
            kv: KvRequest::exactly(32768),
            kv_dtype: crate::KvCacheDtype::Bf16,
            max_step_tokens: 2048,
            max_step_seqs: 16,
            stream_staging_bytes: 0,
            cuda_graphs: false,
            pins: Vec::new(),
            move_slots: 0,
            prefill_attention: crate::plan::PrefillAttention::Fused,
        }
    }

    #[test]
    fn one_gpu_is_the_single_gpu_plan() {
        for k in KNOWN_MODELS {
            let s = known(k.key);
            for card in [24, 80, 141] {
                let i = PlanInputs {
                    dense: DenseChoice::Auto,
                    embeddings: EmbeddingChoice::Auto,
                    ..inputs(card, ExpertsChoice::Auto)
                };
                assert_eq!(choose_devices(&s, &i, 1), choose(&s, &i), "{}", k.key);
            }
        }
    }

    #[test]
    fn two_gpus_halve_attention_kv_and_lm_head_and_double_the_experts() {
        let s = known("qwen3-30b-a3b");
        let one = choose(&s, &inputs(80, ExpertsChoice::Auto)).unwrap();
        let two = choose_devices(&s, &inputs(80, ExpertsChoice::Auto), 2).unwrap();
        assert_eq!(two.gpus, 2);
        assert_eq!(two.dense.attention * 2, one.dense.attention);
        assert_eq!(two.dense.lm_head * 2, one.dense.lm_head);
        assert_eq!(
            two.dense.embeddings, one.dense.embeddings,
            "the table is replicated"
        );
        assert_eq!(
            two.dense.f32_small, one.dense.f32_small,
            "routers and norms replicated"
        );
        // 4 KV heads → 2 per GPU: half the KV bytes per position, the same positions in less memory
        assert_eq!(two.item("KV cache") * 2, one.item("KV cache"));
        // less dense weight per GPU leaves at least as many experts on each; the node has twice that
        assert!(two.gpu_experts_per_layer >= one.gpu_experts_per_layer);
        assert_eq!(
            two.node_experts_per_layer,
            (2 * two.gpu_experts_per_layer).min(s.experts_per_layer())
        );
        assert!(two.total() <= two.usable_bytes);
    }

    #[test]
    fn kv_heads_are_replicated_when_gpus_outnumber_them() {
        let s = known("qwen3-30b-a3b"); // 32 query heads, 4 KV heads
        let d = device_shape(&s, 8).unwrap();
        assert!(matches!(
            d.attention,
            Attention::Gqa {
                heads: 4,
                kv_heads: 1,
                ..
            }
        ));
        assert_eq!(d.kv_bytes_per_token(2) * 4, s.kv_bytes_per_token(2));
    }

    /// GLM-5.3-Flash over 2 GPUs: each holds half the KDA heads, so half of each linear layer's
    /// head-wise projections and of every sequence's recurrent state; KDA heads that do not divide
    /// are refused.
    #[test]
    fn linear_attention_heads_and_their_state_split() {
        let s = known("glm-5.3-flash"); // 64 KDA heads of 128, kernel 4
        let hy = s.hybrid.clone().unwrap();
        let d = device_shape(&s, 2).unwrap();
        let dh = d.hybrid.clone().unwrap();
        assert_eq!(dh.linear_heads, 32);
        assert_eq!(dh.state_floats * 2, hy.state_floats);
        assert_eq!(
            dh.state_floats,
            32 * 128 * 128 + 3 * 32 * 128 * 3,
            "matrices and convolution tail of 32 heads"
        );
        assert_eq!(dh.state_bytes(8) * 2, hy.state_bytes(8));
        let one = choose(&s, &inputs(141, ExpertsChoice::Auto)).unwrap();
        let two = choose_devices(&s, &inputs(141, ExpertsChoice::Auto), 2).unwrap();
        assert!(two.dense.attention < one.dense.attention);
        let mut odd = s.clone();
        odd.hybrid.as_mut().unwrap().linear_heads = 6;
        assert_eq!(
            device_shape(&odd, 4),
            Err(SplitError::LinearHeads { heads: 6, gpus: 4 })
        );
    }

    #[test]
    fn mla_splits_heads_and_keeps_the_latent_whole() {
        let s = known("deepseek-v3");
        let d = device_shape(&s, 8).unwrap();
        assert_eq!(d.kv_bytes_per_token(2), s.kv_bytes_per_token(2));
        let (full, part) = (
            crate::weights::dense_bytes(&s, DenseDtype::Bf16, true).attention,
            crate::weights::dense_bytes(&d, DenseDtype::Bf16, true).attention,
        );
        // q_a and kv_a stay whole on every GPU: more than an eighth
        assert!(part * 8 > full && part * 4 < full, "{part} of {full}");
    }

    #[test]
    fn a_count_asked_of_the_node_is_spread_over_its_gpus() {
        let s = known("qwen3-30b-a3b");
        let p = choose_devices(&s, &inputs(80, ExpertsChoice::PerLayer(10)), 4).unwrap();
        assert_eq!((p.gpu_experts_per_layer, p.node_experts_per_layer), (3, 10));
        let too_many = choose_devices(&s, &inputs(24, ExpertsChoice::PerLayer(128)), 2);
        assert!(matches!(too_many, Err(PlanError::ExpertsDoNotFit { .. })));
    }

    #[test]
    fn what_does_not_divide_is_refused() {
        let s = known("qwen3-30b-a3b");
        let e = choose_devices(&s, &inputs(80, ExpertsChoice::Auto), 3).unwrap_err();
        assert_eq!(
            e,
            PlanError::DoesNotSplit(SplitError::Heads { heads: 32, gpus: 3 })
        );
        assert!(e.to_string().contains("32 attention heads"), "{e}");
        let mut odd = s.clone();
        odd.attention = Attention::Gqa {
            heads: 24,
            kv_heads: 4,
            head_dim: 128,
            qkv_bias: false,
        };
        assert_eq!(
            device_shape(&odd, 6),
            Err(SplitError::KvHeads {
                kv_heads: 4,
                gpus: 6
            })
        );
        let glm = known("glm-4.5-air"); // 96 heads, 8 KV heads, dense 10944, shared 1408
        assert!(device_shape(&glm, 8).is_ok());
        let mut narrow = glm.clone();
        narrow.dense_intermediate = 10945;
        assert!(matches!(
            device_shape(&narrow, 2),
            Err(SplitError::Intermediate {
                what: "dense MLP",
                ..
            })
        ));
        assert_eq!(device_shape(&s, 0), Err(SplitError::NoGpu));
    }
}
