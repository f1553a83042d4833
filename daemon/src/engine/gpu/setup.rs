//! Bringing up the CUDA backend: open the GPU, size the memory plan, choose the GPU experts, upload.
use super::kv::GpuKvPool;
use super::{expert_bytes, GpuModel};
use crate::engine::kv::BLOCK;
use crate::engine::placement::{plan_placement, GpuExperts, MemoryPlan, RoutingStats};
use crate::engine::placement_rules::PlacementPlan;
use crate::engine::EngineOptions;
use crate::model::{Model, ModelConfig};
use anyhow::{bail, Context};
use moe_kernels::cuda::GpuDevice;

/// bf16 bytes of everything but the routed experts (routers in f32).
pub fn dense_bytes(cfg: &ModelConfig) -> usize {
    let h = cfg.hidden_size;
    let mut b = cfg.vocab_size * h * 2 * if cfg.tie_word_embeddings { 1 } else { 2 };
    let attn = match &cfg.mla {
        // q (low-rank or direct), kv_a, kv_b (f32 on the GPU), o
        Some(m) => {
            let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
            let q = m
                .q_lora_rank
                .map_or(cfg.num_heads * qk * h, |r| r * h + cfg.num_heads * qk * r);
            (q + (m.kv_lora_rank + m.qk_rope_head_dim) * h + cfg.num_heads * m.v_head_dim * h) * 2
                + cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank * 4
        }
        None => {
            (cfg.num_heads * cfg.head_dim * h * 2 + cfg.num_kv_heads * cfg.head_dim * h * 2) * 2
        }
    };
    for layer in 0..cfg.num_layers {
        b += attn;
        match &cfg.moe {
            Some(m) if cfg.is_moe_layer(layer) => {
                b += m.num_experts * h * 4;
                b += m.shared_intermediate.map_or(0, |w| 3 * h * w * 2);
            }
            _ => b += 3 * h * cfg.intermediate_size * 2,
        }
    }
    b
}

/// Opens GPU `ordinal`, places the experts (`rules`: the rule file's choices, resolved for this model)
/// and uploads everything but the DRAM experts.
pub fn build(
    model: &mut Model,
    ordinal: usize,
    opts: &EngineOptions,
    rules: Option<&PlacementPlan>,
) -> anyhow::Result<GpuModel> {
    let cfg = model.config.clone();
    if cfg.indexer.is_some() {
        bail!(
            "{}: the CUDA backend does not run the sparse-attention indexer yet; use --device cpu",
            cfg.arch_name
        );
    }
    let dev = GpuDevice::open(ordinal)?;
    let (free, total) = dev.memory()?;
    let blocks = opts.kv_cache_tokens.div_ceil(BLOCK).max(1);
    let widths = super::kv_widths(&cfg);
    let (experts, inter) = cfg
        .moe
        .as_ref()
        .map_or((0, 0), |m| (m.num_experts, m.expert_intermediate));
    let each = expert_bytes(cfg.hidden_size, inter);
    let moe_layers = cfg.moe_layers.iter().filter(|&&m| m).count();
    let mut plan = MemoryPlan {
        dense_weights: dense_bytes(&cfg),
        expert_bytes_each: each,
        gpu_experts_total: 0,
        kv_cache: GpuKvPool::bytes_for(cfg.num_layers, widths, blocks),
        // activations of a step, plus layerwise prefill's expert stream (two packed staging
        // chunks and one dense chunk)
        workspace: (1usize << 30)
            + super::stream::device_bytes(each, experts, opts.gpu_stream_chunk_bytes),
        device_free: free,
    };
    let pins = rules.map(PlacementPlan::pins);
    let pinned_gpu: usize = pins
        .iter()
        .flatten()
        .flatten()
        .filter(|&&p| p == Some(true))
        .count();
    let per_layer = match opts.gpu_experts {
        GpuExperts::Count(n) => n.min(experts),
        GpuExperts::Ratio(r) => ((experts as f64 * r).round() as usize).min(experts),
        // What fits beside the pinned experts, spread evenly over the MoE layers.
        GpuExperts::Auto => {
            let room = plan.max_experts_per_layer(1, usize::MAX);
            room.saturating_sub(pinned_gpu) / moe_layers.max(1)
        }
    };
    let stats = match &opts.routing_stats {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            Some(
                serde_json::from_str::<RoutingStats>(&text)
                    .with_context(|| format!("{}: not routing statistics", p.display()))?,
            )
        }
        None => None,
    };
    // Without statistics (a fresh deployment), `frequency` starts as `uniform`; record them with
    // --record-routing and restart with --routing-stats to place by frequency.
    let strategy = match (opts.placement, &stats) {
        (crate::engine::placement::PlacementStrategy::Frequency, None) => {
            tracing::warn!("--expert-placement frequency without --routing-stats: using uniform until statistics exist");
            crate::engine::placement::PlacementStrategy::Uniform
        }
        (s, _) => s,
    };
    let placement = plan_placement(
        strategy,
        &cfg.moe_layers,
        experts,
        per_layer,
        stats.as_ref(),
        opts.placement_seed,
        pins.as_deref(),
    )
    .map_err(anyhow::Error::msg)?;
    plan.gpu_experts_total = placement.iter().flatten().filter(|&&g| g).count();
    let msg = format!(
        "{} ({}.{}), {:.1} GiB total: {}",
        dev.name,
        dev.capability.0,
        dev.capability.1,
        total as f64 / (1u64 << 30) as f64,
        plan.describe()
    );
    tracing::info!("{msg}");
    eprintln!("{msg}");
    if let Some(r) = rules {
        let text = r.describe(&placement, &default_format_name(opts));
        tracing::info!("{text}");
        eprint!("{text}");
    }
    if !plan.fits() {
        bail!(
            "the model does not fit on {}: {}; at most {} GPU experts per layer would fit (use --gpu-experts auto, pin fewer experts to the GPU), or lower --kv-cache-tokens",
            dev.name,
            plan.describe(),
            plan.max_experts_per_layer(moe_layers, experts)
        );
    }
    let mut gpu = GpuModel::upload(
        dev,
        model,
        &placement,
        blocks,
        opts.gpu_prefill_threshold.max(1),
        opts.live_placement.is_some(),
    )?;
    gpu.cuda_graphs = opts.cuda_graphs;
    if let Some(r) = rules {
        gpu.prefill_on_cpu = r.prefill_on_cpu();
    }
    Ok(gpu)
}

/// How the plan names DRAM experts that no rule gives a format: `--expert-dtype`, else as stored.
pub fn default_format_name(opts: &EngineOptions) -> String {
    opts.expert_format.map_or(
        "as-stored".into(),
        crate::engine::placement_rules::resolve::format_name,
    )
}
