//! Bringing up the CUDA backend: open the GPU, plan its memory, choose the GPU experts, upload.
use super::{memory, DenseUpload, GpuModel};
use crate::engine::kv::{KvLayout, BLOCK};
use crate::engine::placement::{plan_placement, PlacementStrategy, RoutingStats};
use crate::engine::placement_rules::PlacementPlan;
use crate::engine::EngineOptions;
use crate::model::{Model, ModelConfig};
use anyhow::{bail, Context};
use moe_kernels::cuda::GpuDevice;
use moe_sizing::CheckpointFormat;

pub(crate) fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// Opens GPU `ordinal`, plans its memory with the shared sizing model (refusing with the reason what
/// does not fit), places the experts (`rules`: the rule file's choices, resolved for this model;
/// experts they pin to the GPU are planned) and uploads everything but the DRAM experts.
pub fn build(
    model: &mut Model,
    ordinal: usize,
    opts: &EngineOptions,
    rules: Option<&PlacementPlan>,
) -> anyhow::Result<GpuModel> {
    let cfg = model.config.clone();
    let dev = GpuDevice::open(ordinal)?;
    let (free, total) = dev.memory()?;
    let context_used = (total - free) as u64;
    let budget = memory_budget(opts, &dev.name, total as u64);
    let shape = memory::shape_of_model(model, CheckpointFormat::Bf16);
    let layer_pins = rules.map(PlacementPlan::layer_pins).unwrap_or_default();
    let plan = memory::plan(opts, &shape, budget, &layer_pins).map_err(|e| {
        anyhow::anyhow!(
            "{} does not fit in {:.2} GiB of {} ({}): {e}",
            cfg.arch_name,
            gib(budget),
            dev.name,
            if opts.gpu_memory_limit.is_some() {
                "--gpu-memory-limit"
            } else {
                "the card's memory"
            }
        )
    })?;
    let msg = format!(
        "{} ({}.{}), {:.1} GiB, {:.1} GiB free; dense projections {}, embeddings {}, {} GPU experts per layer, KV {} positions\n{}",
        dev.name,
        dev.capability.0,
        dev.capability.1,
        gib(total as u64),
        gib(free as u64),
        plan.dense_dtype.as_str(),
        if plan.host_embeddings { "in host memory" } else { "on the GPU" },
        plan.gpu_experts_per_layer,
        plan.kv_tokens,
        plan.describe()
    );
    tracing::info!("{msg}");
    eprintln!("{msg}");
    // Another process may hold memory the budget assumed free.
    if plan.total() > free as u64 {
        bail!(
            "the plan needs {:.2} GiB but {} has {:.2} GiB free (other processes use the rest): lower --gpu-memory-limit or free the GPU",
            gib(plan.total()),
            dev.name,
            gib(free as u64)
        );
    }
    let per_layer = plan.gpu_experts_per_layer as usize;
    let blocks = (plan.kv_tokens as usize).div_ceil(BLOCK).max(1);
    let pins = rules.map(PlacementPlan::pins);
    let placement = place_experts(opts, &cfg, per_layer, pins.as_deref())?;
    // The plan counted each layer's pins plus the strategy's fill; front-loading spreads the count
    // unevenly, which with pins can place more than the plan holds.
    let placed = placement.iter().flatten().filter(|&&g| g).count() as u64;
    if placed > plan.gpu_experts_total {
        bail!(
            "the placement puts {placed} experts on the GPU but the memory plan holds {}: with placement rules that pin GPU experts use --expert-placement uniform, frequency or random",
            plan.gpu_experts_total
        );
    }
    log_rules(rules, &placement, opts);
    let dense = DenseUpload {
        format: memory::dense_format(plan.dense_dtype),
        host_embeddings: plan.host_embeddings,
    };
    let t = std::time::Instant::now();
    let mut gpu = GpuModel::upload(
        dev,
        model,
        &placement,
        (
            blocks,
            KvLayout::of(&cfg, opts.release_window_kv),
            opts.kv_cache_dtype,
        ),
        opts.gpu_prefill_threshold.max(1),
        dense,
        opts.live_placement.is_some(),
    )?;
    let (free_after, _) = gpu.dev.memory()?;
    // The pool counts exactly this engine's buffers; the free-memory delta is the fallback.
    let start_allocated = match gpu.dev.pool_usage()? {
        Some((in_use, _)) => in_use,
        None => (free - free_after) as u64,
    };
    // From here the pool's high-water mark is this engine's: start + step buffers.
    gpu.dev.reset_pool_peak()?;
    let report = memory::MemoryReport {
        plan,
        context_used,
        start_allocated,
    };
    let msg = format!(
        "GPU memory at start: {:.2} GiB allocated for weights, KV and scratch (planned {:.2} GiB), uploaded in {:.1} s",
        gib(report.start_allocated),
        gib(report.planned_at_start()),
        t.elapsed().as_secs_f64()
    );
    tracing::info!("{msg}");
    eprintln!("{msg}");
    gpu.memory = Some(report);
    apply_step_options(&mut gpu, opts, &model.config);
    // Early routing needs the CPU kernels' packed experts to read ahead (routers on the layer input).
    let layer_input_router = cfg
        .moe
        .as_ref()
        .is_some_and(|m| m.router_input == crate::model::config::RouterInput::LayerInput);
    if layer_input_router && opts.cpu_kernels {
        gpu.expert_prefetch_bytes = opts.expert_prefetch_bytes;
    }
    gpu.split_min_rows = opts.gpu_split_min_rows;
    if let Some(r) = rules {
        gpu.prefill_on_cpu = r.prefill_on_cpu();
    }
    Ok(gpu)
}

/// The bytes one GPU is planned with: `--gpu-memory-limit`, or the card's `total` when unset or
/// above it (with a warning).
pub fn memory_budget(opts: &EngineOptions, card: &str, total: u64) -> u64 {
    match opts.gpu_memory_limit {
        Some(limit) if limit > total => {
            tracing::warn!(
                "--gpu-memory-limit {:.2} GiB is above {card}'s {:.2} GiB: planning with the card's memory",
                gib(limit),
                gib(total)
            );
            total
        }
        Some(limit) => limit,
        None => total,
    }
}

/// Per MoE layer, the routed experts the GPUs hold: `per_layer` chosen by `--expert-placement`
/// around the rules' `pins`. Without statistics (a fresh deployment), `frequency` starts as
/// `uniform`; record them with --record-routing and restart with --routing-stats to place by
/// frequency.
pub fn place_experts(
    opts: &EngineOptions,
    cfg: &ModelConfig,
    per_layer: usize,
    pins: Option<&[Vec<Option<bool>>]>,
) -> anyhow::Result<Vec<Vec<bool>>> {
    let experts = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
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
    let strategy = match (opts.placement, &stats) {
        (PlacementStrategy::Frequency, None) => {
            tracing::warn!("--expert-placement frequency without --routing-stats: using uniform until statistics exist");
            PlacementStrategy::Uniform
        }
        (s, _) => s,
    };
    plan_placement(
        strategy,
        &cfg.moe_layers,
        experts,
        per_layer,
        stats.as_ref(),
        opts.placement_seed,
        pins,
    )
    .map_err(anyhow::Error::msg)
}

/// Logs what the placement rules chose for this model (nothing without rules).
pub fn log_rules(rules: Option<&PlacementPlan>, placement: &[Vec<bool>], opts: &EngineOptions) {
    if let Some(r) = rules {
        let text = r.describe(placement, &default_format_name(opts));
        tracing::info!("{text}");
        eprint!("{text}");
    }
}

/// The step settings every GPU takes from the options: CUDA graphs, deferred experts, the step's
/// token and sequence caps.
pub fn apply_step_options(gpu: &mut GpuModel, opts: &EngineOptions, cfg: &ModelConfig) {
    gpu.cuda_graphs = memory::cuda_graphs_for(opts, cfg);
    gpu.switches.set_defer_experts(opts.defer_experts);
    gpu.max_step = (opts.max_step_tokens, opts.max_step_seqs);
}

/// How the plan names DRAM experts that no rule gives a format: `--expert-dtype`, else as stored.
pub fn default_format_name(opts: &EngineOptions) -> String {
    opts.expert_format.map_or(
        "as-stored".into(),
        crate::engine::placement_rules::resolve::format_name,
    )
}
