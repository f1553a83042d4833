//! The GPU memory plan of this engine: the shared sizing model (`moe_sizing`, which the operator uses
//! too) fed with the configuration actually loaded and the engine options, and what the start really
//! allocated beside it.
use crate::engine::linear::{Linear, WeightData};
use crate::engine::placement::GpuExperts;
use crate::engine::EngineOptions;
use crate::model::{config::ModelConfig, Attention as HostAttention, Ffn, MlaQuery, Mlp, Model};
use moe_kernels::cpu::GgmlBlock;
use moe_kernels::cuda::quant::DenseFormat;
use moe_sizing::{
    Attention, CheckpointFormat, ExpertsChoice, HybridLayers, HybridShape, KvRequest, LayerKind,
    LayerPins, MemoryPlan, ModelShape, Moe, PlanInputs, StoredDense, StoredFormat,
};

/// The sizing shape of a loaded configuration (`qkv_bias`: q/k/v projections carry biases, which
/// the loaded weights know and `ModelConfig` does not keep).
pub fn shape_of(cfg: &ModelConfig, qkv_bias: bool, checkpoint: CheckpointFormat) -> ModelShape {
    let attention = match &cfg.mla {
        Some(m) => Attention::Mla {
            heads: cfg.num_heads as u64,
            q_lora_rank: m.q_lora_rank.map(|r| r as u64),
            kv_lora_rank: m.kv_lora_rank as u64,
            qk_nope_head_dim: m.qk_nope_head_dim as u64,
            qk_rope_head_dim: m.qk_rope_head_dim as u64,
            v_head_dim: m.v_head_dim as u64,
        },
        None => Attention::Gqa {
            heads: cfg.num_heads as u64,
            kv_heads: cfg.num_kv_heads as u64,
            head_dim: cfg.head_dim as u64,
            qkv_bias,
        },
    };
    let moe = cfg.moe.as_ref().map(|m| Moe {
        experts: m.num_experts as u64,
        top_k: m.top_k as u64,
        expert_intermediate: m.expert_intermediate as u64,
        shared_intermediate: m.shared_intermediate.unwrap_or(0) as u64,
        shared_gate: m.shared_gate,
        moe_layers: cfg.moe_layers.iter().filter(|&&x| x).count() as u64,
    });
    ModelShape {
        hybrid: hybrid_shape(cfg),
        hidden: cfg.hidden_size as u64,
        layers: cfg.num_layers as u64,
        vocab: cfg.vocab_size as u64,
        tied_embeddings: cfg.tie_word_embeddings,
        attention,
        dense_intermediate: cfg.intermediate_size as u64,
        moe,
        checkpoint,
        stored: None,
    }
}

/// The per-layer kinds of a hybrid-attention model (`None` for the others), for the sizing crate's
/// accounting: which layers are linear, which run their own indexer, the linear and indexer shapes
/// and the hyper-connection streams.
pub fn hybrid_layers(cfg: &ModelConfig) -> Option<HybridLayers> {
    use crate::model::config::IndexerLayer;
    use crate::model::hybrid::Mixer;
    if cfg.hyper.is_none() && cfg.linear_attention.is_none() && cfg.indexer.is_none() {
        return None;
    }
    let kinds = (0..cfg.num_layers)
        .map(|l| match cfg.mixers.get(l) {
            Some(Mixer::Linear) => LayerKind::Linear,
            _ => LayerKind::Attention {
                own_indexer: cfg
                    .indexer
                    .as_ref()
                    .is_some_and(|ix| ix.layers.get(l) == Some(&IndexerLayer::Own)),
            },
        })
        .collect();
    Some(HybridLayers {
        hidden: cfg.hidden_size as u64,
        kinds,
        linear: cfg.linear_attention.map(|la| la.dims()),
        indexer: cfg.indexer.as_ref().map(|ix| ix.dims()),
        hyper_streams: cfg.hyper.map(|h| h.mult as u64),
        q_rank: cfg
            .mla
            .as_ref()
            .and_then(|m| m.q_lora_rank)
            .unwrap_or(cfg.hidden_size) as u64,
    })
}

/// What a hybrid-attention model adds to the plan (`None` for the others): linear layers and their
/// per-sequence state, indexer rows, and the hybrid step buffers per row (`gpu::hybrid_bufs`).
pub fn hybrid_shape(cfg: &ModelConfig) -> Option<HybridShape> {
    hybrid_layers(cfg).map(|h| h.shape())
}

/// Whether decode replays CUDA graphs for `cfg`: `--cuda-graphs` on, and for hybrid-attention models
/// `--cuda-graphs-hybrid` too (the plan's decode buffers follow the same choice).
pub fn cuda_graphs_for(opts: &EngineOptions, cfg: &ModelConfig) -> bool {
    opts.cuda_graphs && (hybrid_layers(cfg).is_none() || opts.cuda_graphs_hybrid)
}

/// How `l` is stored, as far as its GPU bytes depend on it: the GGUF block types whose codes the
/// GPU may keep (`quantize_linear`); values and FP8 blocks otherwise.
pub fn stored_format(l: &Linear) -> StoredFormat {
    match &l.w {
        WeightData::Ggml { kind, .. } => match kind {
            GgmlBlock::Q4_0 => StoredFormat::Q4_0,
            GgmlBlock::Q4_1 => StoredFormat::Q4_1,
            GgmlBlock::Q4K => StoredFormat::Q4K,
            GgmlBlock::Q5K => StoredFormat::Q5K,
            GgmlBlock::Q5_0 => StoredFormat::Q5_0,
            GgmlBlock::Q5_1 => StoredFormat::Q5_1,
            GgmlBlock::Q6K => StoredFormat::Q6K,
            GgmlBlock::Q8_0 => StoredFormat::Q8_0,
            GgmlBlock::F32 | GgmlBlock::F16 | GgmlBlock::Bf16 => StoredFormat::Values,
        },
        _ => StoredFormat::Values,
    }
}

/// The stored formats of the loaded model's dense projections, in the order the sizing crate counts
/// them ([`StoredDense`]); `None` when no projection is a GGUF block type (the plan of values).
pub fn stored_dense(model: &Model) -> Option<StoredDense> {
    let f = stored_format;
    let mlp = |m: &Mlp| [f(&m.gate), f(&m.up), f(&m.down)];
    let mut s = StoredDense {
        lm_head: f(model.lm_head()),
        ..Default::default()
    };
    for layer in &model.layers {
        match &layer.attn {
            HostAttention::Gqa(a) => s.attention.push([f(&a.q), f(&a.k), f(&a.v), f(&a.o)]),
            HostAttention::Mla(a) => s.attention.push(match &a.q {
                MlaQuery::Direct(q) => [f(q), StoredFormat::Values, f(&a.kv_a), f(&a.o)],
                MlaQuery::LowRank { a: qa, b: qb, .. } => [f(qa), f(qb), f(&a.kv_a), f(&a.o)],
            }),
            HostAttention::Linear(_) => {}
        }
        match &layer.ffn {
            Ffn::Dense(m) => s.dense_mlp.push(mlp(m)),
            Ffn::Moe(block) => s.shared_experts.extend(block.shared.as_ref().map(mlp)),
        }
    }
    s.any_blocks().then_some(s)
}

/// The sizing shape of a loaded model: its configuration's ([`shape_of`]) with the stored formats
/// of its dense projections (GGUF blocks the GPU keeps as they are), and tied only when the model holds
/// no lm_head of its own (a checkpoint tied in its config that still carries a distinct lm_head keeps
/// it, as transformers does, and the GPU uploads it whatever the dtype).
pub fn shape_of_model(model: &Model, checkpoint: CheckpointFormat) -> ModelShape {
    let cfg = shape_of(&model.config, has_qkv_bias(model), checkpoint);
    ModelShape {
        stored: stored_dense(model),
        tied_embeddings: cfg.tied_embeddings && model.lm_head.is_none(),
        ..cfg
    }
}

/// Whether the loaded model's attention projections carry biases.
pub fn has_qkv_bias(model: &Model) -> bool {
    model
        .layers
        .first()
        .is_some_and(|l| matches!(&l.attn, HostAttention::Gqa(a) if a.q.bias.is_some()))
}

/// Plan inputs from the engine options: `budget` bytes of GPU memory, `stream_staging` bytes for
/// layerwise prefill's device buffers, `pins` per MoE layer from the placement rules (empty: none).
pub fn plan_inputs(
    opts: &EngineOptions,
    shape: &ModelShape,
    budget: u64,
    stream_staging: u64,
    pins: &[LayerPins],
) -> PlanInputs {
    let experts = shape.experts_per_layer();
    PlanInputs {
        budget_bytes: budget,
        dense: opts.dense_dtype,
        embeddings: opts.embeddings,
        experts: match opts.gpu_experts {
            GpuExperts::Auto => ExpertsChoice::Auto,
            GpuExperts::Count(n) => ExpertsChoice::PerLayer(n as u64),
            GpuExperts::Ratio(r) => {
                ExpertsChoice::PerLayer(((experts as f64 * r).round() as u64).min(experts))
            }
        },
        kv: {
            let kv = opts
                .kv_auto
                .unwrap_or_else(|| KvRequest::exactly(opts.kv_cache_tokens as u64));
            KvRequest {
                longest_sequence: opts
                    .max_sequence_tokens
                    .map_or(kv.longest_sequence, |m| (m as u64).min(kv.longest_sequence)),
                ..kv
            }
        },
        kv_dtype: opts.kv_cache_dtype,
        max_step_tokens: opts.max_step_tokens as u64,
        max_step_seqs: opts.max_step_seqs as u64,
        stream_staging_bytes: stream_staging,
        cuda_graphs: opts.cuda_graphs && (shape.hybrid.is_none() || opts.cuda_graphs_hybrid),
        pins: pins.to_vec(),
        move_slots: opts
            .live_placement
            .as_ref()
            .map_or(0, |l| l.max_in_flight as u64),
        prefill_attention: match super::attention::flash_prefill_mode() {
            Some(_) => moe_sizing::PrefillAttention::Fused,
            None => moe_sizing::PrefillAttention::Gemm,
        },
    }
}

/// The plan the engine starts with, within `budget` bytes of GPU memory (of each GPU of a
/// tensor-parallel group); `pins`: the experts placement rules pin, per MoE layer (empty without rules).
pub fn plan(
    opts: &EngineOptions,
    shape: &ModelShape,
    budget: u64,
    pins: &[LayerPins],
) -> Result<MemoryPlan, moe_sizing::PlanError> {
    // Layerwise prefill's stream is set up when the KV cache can hold a step that long.
    let kv_most = opts
        .kv_auto
        .map_or(opts.kv_cache_tokens as u64, |k| k.max_tokens);
    let staging = if (opts.gpu_prefill_threshold as u64) <= kv_most && shape.moe.is_some() {
        moe_sizing::plan::stream_staging_bytes(
            shape.gpu_expert_bytes(),
            shape.experts_per_layer(),
            opts.gpu_stream_chunk_bytes as u64,
        )
    } else {
        0
    };
    // With --tensor-parallel N: the plan of each of the N GPUs (experts counted on all of them).
    let gpus = opts.tensor_parallel.size.max(1) as u64;
    moe_sizing::choose_devices(
        shape,
        &plan_inputs(opts, shape, budget, staging, pins),
        gpus,
    )
}

/// The kernels' format for a planned dense dtype.
pub fn dense_format(d: moe_sizing::DenseDtype) -> DenseFormat {
    match d {
        moe_sizing::DenseDtype::Bf16 => DenseFormat::Bf16,
        moe_sizing::DenseDtype::Fp8 => DenseFormat::Fp8,
        moe_sizing::DenseDtype::Int4 => DenseFormat::Int4,
    }
}

/// The plan and what the engine's start allocated on the device (the bytes of the device's memory
/// pool that every buffer is allocated from; without pools, the drop in free memory).
#[derive(Debug, Clone)]
pub struct MemoryReport {
    pub plan: MemoryPlan,
    /// Device bytes in use once the CUDA context, cuBLAS and the kernels are loaded.
    pub context_used: u64,
    /// Device bytes the upload allocated (weights, KV cache, scratch).
    pub start_allocated: u64,
}

impl MemoryReport {
    /// What the plan says the start allocates (everything but per-step buffers and graphs, which are
    /// allocated when steps run).
    pub fn planned_at_start(&self) -> u64 {
        self.plan.total()
            - self.plan.item("activations")
            - self.plan.item("CUDA graphs")
            - self.plan.item("prefill staging")
            - self.plan.item("live moves")
            - self.plan.item("recurrent states")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_config(name: &str) -> Option<serde_json::Value> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures")
            .join(name)
            .join("model_bf16/config.json");
        let text = std::fs::read_to_string(path).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// The operator reads config.json with the sizing crate; the engine with `ModelConfig`. Both
    /// must give the same shape, or the operator would size a different model than the one loaded.
    #[test]
    fn sizing_reads_every_config_as_the_engine_does() {
        let mut configs: Vec<(String, serde_json::Value)> = moe_sizing::known::KNOWN_MODELS
            .iter()
            .map(|k| {
                (
                    k.key.to_string(),
                    moe_sizing::known::config_json(k.key).unwrap(),
                )
            })
            .collect();
        for name in [
            "qwen3_moe",
            "glm4_moe",
            "mixtral",
            "qwen2_moe",
            "llama",
            "qwen2",
            "qwen3",
            "deepseek_v3",
            "deepseek_v3_plain",
            "smallthinker",
            "smallthinker_softmax",
            "glm4_moe_lite",
            "glm_moe_dsa",
            "glm5_next",
            "glm5_next_indexer",
        ] {
            if let Some(v) = fixture_config(name) {
                configs.push((name.to_string(), v));
            }
        }
        assert!(configs.len() >= 5);
        let hybrid = configs
            .iter()
            .filter(|(_, v)| ModelShape::from_config_json(v).is_ok_and(|s| s.hybrid.is_some()))
            .count();
        assert!(hybrid >= 4, "GLM-5 and GLM-5.3-Flash configs and fixtures");
        for (name, v) in configs {
            let sized = ModelShape::from_config_json(&v).unwrap();
            let cfg = ModelConfig::from_json(&v).unwrap();
            let bias = matches!(sized.attention, Attention::Gqa { qkv_bias: true, .. });
            let engine = shape_of(&cfg, bias, sized.checkpoint);
            assert_eq!(sized, engine, "{name}");
        }
    }

    /// GLM-5.3-Flash's plan counts what the GPU engine holds for it: no KV rows in its 34 linear
    /// layers, the MLA latent (512 bf16) and the f32 indexer row (key + pool gate, 256 floats) in its
    /// 11 indexed layers, the decode buffers' indexer score column (64 rows / pool of 4 × 4 B) per KV
    /// position, a 146 MiB recurrent state per sequence of a step (64: 9.1 GiB), and the hybrid step
    /// rows; `auto` GPU experts get what is left after all of it (without the hybrid terms the same
    /// budget would have promised more experts than fit).
    #[test]
    fn glm53_flash_plan_counts_states_and_indexer_rows() {
        let v = crate::cli::synth::config_like("glm-5.3-flash").unwrap();
        let cfg = ModelConfig::from_json(&v).unwrap();
        let shape = shape_of(&cfg, false, CheckpointFormat::Fp8 { block: 128 });
        let hy = shape.hybrid.clone().expect("a hybrid shape");
        assert_eq!((hy.linear_layers, hy.indexer_layers), (34, 11));
        assert_eq!((hy.indexer_row_floats, hy.indexer_unit), (256, 4));
        // 64 heads × 128² matrices + a 3-tap tail of q, k and v (3 × 8192), f32
        assert_eq!(hy.state_floats, 64 * 128 * 128 + 3 * 3 * 8192);
        let state_per_seq = hy.state_bytes(1);
        assert_eq!(state_per_seq, 152_633_344); // 145.6 MiB
        assert_eq!(
            shape.kv_bytes_per_token(2),
            11 * 512 * 2 + 11 * 256 * 4,
            "11 KiB of latent + 11 KiB of indexer rows per position"
        );
        assert_eq!(
            moe_sizing::plan::kv_bytes_per_position(&shape, true, moe_sizing::KvCacheDtype::Bf16),
            11 * 512 * 2 + 11 * 256 * 4 + 64 * 4 / 4
        );
        // A step row (hidden 4096): 4 streams + mix 24 + proj 24; linear 10 × 8192 + 2 × 128 + 64;
        // indexer 2 × 4096 + 32 × 128 + 2 × 128 + 32 + (512 × 4 + 4) + 1; segment 5.
        let row = (4 * 4096 + 24 + 24)
            + (10 * 8192 + 256 + 64)
            + (2 * 4096 + 4096 + 256 + 32)
            + 2052
            + 1
            + 5;
        assert_eq!(hy.step_row_values, row);
        let inputs = PlanInputs {
            budget_bytes: 80 << 30,
            dense: moe_sizing::DenseChoice::Fixed(moe_sizing::DenseDtype::Fp8),
            embeddings: moe_sizing::EmbeddingChoice::Gpu,
            experts: ExpertsChoice::Auto,
            kv: KvRequest::exactly(131072),
            kv_dtype: moe_sizing::KvCacheDtype::Bf16,
            max_step_tokens: 2048,
            max_step_seqs: 64,
            stream_staging_bytes: 0,
            cuda_graphs: true,
            pins: Vec::new(),
            move_slots: 0,
            prefill_attention: moe_sizing::PrefillAttention::Fused,
        };
        let p = moe_sizing::choose(&shape, &inputs).unwrap();
        assert_eq!(p.item("recurrent states"), 64 * state_per_seq);
        assert_eq!(p.item("KV cache"), 131072 * (22 * 1024 + 64));
        // the large step's score rows: 2048 queries × 131072 / 4 candidates × 4 B = 256 MiB
        let plain_steps = moe_sizing::plan::step_buffer_bytes(
            &shape,
            2048,
            64,
            moe_sizing::PrefillAttention::Fused,
        );
        assert_eq!(p.item("activations"), plain_steps + (256 << 20));
        assert!(p.total() <= p.usable_bytes);
        let blind = ModelShape {
            hybrid: None,
            ..shape.clone()
        };
        let q = moe_sizing::choose(&blind, &inputs).unwrap();
        assert!(
            q.gpu_experts_per_layer > p.gpu_experts_per_layer,
            "without the hybrid terms: {} experts per layer, with them {}",
            q.gpu_experts_per_layer,
            p.gpu_experts_per_layer
        );
        println!("{}", p.describe());
    }

    /// The plan's attention weights of a hybrid model are what the loaded checkpoint holds: linear
    /// layers' own projections (q, k, v, the gates' low-rank pairs, β, o) and MLA's in the indexed
    /// layers, bf16 bytes of every `Linear` (glm5_next fixture: 3 linear, 2 indexed layers); the f32
    /// indexer and hyper-connection weights are what the loaded layers hold.
    #[test]
    fn glm53_plan_counts_linear_layer_projections() {
        use crate::model::{Attention as A, MlaQuery};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/glm5_next/model_bf16");
        let e =
            crate::engine::Engine::load(&dir, &crate::engine::EngineOptions::default()).unwrap();
        let bytes = |l: &crate::engine::linear::Linear| (l.out_dim * l.in_dim * 2) as u64;
        let mut want = 0;
        for layer in &e.model().layers {
            want += match &layer.attn {
                A::Linear(la) => [
                    &la.q, &la.k, &la.v, &la.f_a, &la.f_b, &la.b, &la.g_a, &la.g_b, &la.o,
                ]
                .into_iter()
                .map(bytes)
                .sum::<u64>(),
                A::Mla(m) => {
                    let q = match &m.q {
                        MlaQuery::LowRank { a, b, .. } => bytes(a) + bytes(b),
                        MlaQuery::Direct(l) => bytes(l),
                    };
                    q + bytes(&m.kv_a) + bytes(&m.o)
                }
                A::Gqa(_) => unreachable!("no GQA layer in GLM-5.3-Flash"),
            };
        }
        let shape = shape_of(e.config(), false, CheckpointFormat::Bf16);
        let got = moe_sizing::dense_bytes(&shape, moe_sizing::DenseDtype::Bf16, false).attention;
        assert_eq!(got, want);
        // The f32 extras the GPU uploads: each own indexer's weights, each layer's hyper-connections.
        let floats = |l: &crate::engine::linear::Linear| (l.out_dim * l.in_dim) as u64;
        let (mut indexer, mut hyper) = (0, 0);
        for layer in &e.model().layers {
            if let A::Mla(m) = &layer.attn {
                if let Some(crate::model::SparseAttention::Own(w)) = &m.indexer {
                    let pool = w
                        .pool
                        .as_ref()
                        .map_or(0, |p| p.ape.len() as u64 + floats(&p.gate));
                    indexer += floats(&w.wq_b)
                        + floats(&w.wk)
                        + floats(&w.weights_proj)
                        + (w.k_norm_weight.len() + w.k_norm_bias.len()) as u64
                        + pool;
                }
            }
            if let Some(h) = &layer.hyper {
                hyper += [&h.attn, &h.ffn]
                    .iter()
                    .map(|c| (c.proj.len() + c.base.len()) as u64)
                    .sum::<u64>();
            }
        }
        let hy = shape.hybrid.as_ref().unwrap();
        assert!(indexer > 0 && hyper > 0);
        assert_eq!(hy.indexer_layers * hy.indexer_weight_floats, indexer);
        assert_eq!(shape.layers * hy.hyper_weight_floats, hyper);
    }

    /// The sizing crate's hyper-connection mixing width is the kernels'.
    #[test]
    fn hyper_mix_width_agrees_with_the_kernels() {
        for m in 1..=16 {
            assert_eq!(
                moe_sizing::hybrid::hyper_mix_width(m as u64),
                moe_kernels::cuda::hyper::mix_width(m) as u64
            );
        }
    }

    /// The sizing crate's alignment rule for quantized widths is the kernels'.
    #[test]
    fn quantized_groups_agree_with_the_kernels() {
        use moe_kernels::cuda::quant::group_for;
        for cols in [16, 32, 48, 64, 96, 100, 128, 1408, 2560, 10944, 12288] {
            for d in moe_sizing::DenseDtype::ALL {
                assert_eq!(
                    d.group_for(cols as u64).map(|g| g as usize),
                    group_for(dense_format(d), cols),
                    "{d:?} {cols}"
                );
            }
        }
    }

    /// The plan budgets long-prefill score blocks only for heads the fused kernel does not take.
    #[test]
    fn fused_prefill_head_dims_agree_with_the_kernels() {
        let kernels: Vec<u64> = moe_kernels::cuda::ops::FLASH_HEAD_DIMS
            .iter()
            .map(|&d| d as u64)
            .collect();
        assert_eq!(kernels, moe_sizing::plan::FUSED_PREFILL_HEAD_DIMS);
    }
}

#[cfg(test)]
#[path = "memory_gguf_tests.rs"]
mod gguf_tests;
