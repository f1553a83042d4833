//! Bringing up a tensor-parallel group: open the GPUs, plan each one's memory with the shared sizing
//! model (per GPU, experts counted on all of them), place the routed experts on the node and spread
//! them over the GPUs, then slice and upload each rank's share.
use super::comm::{CommKind, Communicator, Loopback, Nccl};
use super::group::TpGroup;
use super::plan::{rank_placement, spread_experts, ShardPlan};
use super::rank::RankCtx;
use super::shard::rank_model;
use crate::engine::gpu::setup::{self as gpu_setup, gib};
use crate::engine::gpu::{memory, DenseUpload, GpuModel};
use crate::engine::kv::{KvLayout, BLOCK};
use crate::engine::linear::WeightData;
use crate::engine::placement_rules::PlacementPlan;
use crate::engine::EngineOptions;
use crate::model::{Attention, MlaQuery, Model};
use anyhow::{bail, Context};
use moe_kernels::cuda::GpuDevice;
use moe_sizing::{CheckpointFormat, DenseDtype};
use std::sync::Arc;

/// `--tensor-parallel`: how many GPUs of the node run the model together, and how they reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorParallel {
    pub size: usize,
    pub comm: CommKind,
}

impl Default for TensorParallel {
    fn default() -> Self {
        Self {
            size: 1,
            comm: CommKind::Nccl,
        }
    }
}

/// The narrowest input group the quantized kernels take in `d` (1: bf16, no groups).
fn min_group(d: DenseDtype) -> usize {
    match d {
        DenseDtype::Bf16 => 1,
        DenseDtype::Fp8 => 16,
        DenseDtype::Int4 => 32,
    }
}

/// The FP8 block of a checkpoint whose blocks the dense upload keeps (fp8 dense dtype).
fn kept_fp8_block(model: &Model, d: DenseDtype) -> Option<usize> {
    if d != DenseDtype::Fp8 {
        return None;
    }
    model.layers.iter().find_map(|l| {
        let q = match &l.attn {
            Attention::Gqa(a) => &a.q,
            Attention::Mla(a) => match &a.q {
                MlaQuery::Direct(q) | MlaQuery::LowRank { b: q, .. } => q,
            },
            Attention::Linear(_) => return None,
        };
        match &q.w {
            WeightData::F8 { block, .. } => Some(*block),
            _ => None,
        }
    })
}

/// Opens `opts.tensor_parallel.size` GPUs (from `ordinal` on; all on `ordinal` for the loopback
/// communicator), plans and uploads each one's share. Returns rank 0 (the engine's GPU model, which
/// runs the CPU hand-off) and the group of the others. `rules`: placement rules resolved for this
/// model; their GPU pins are placed on the node's GPUs (each GPU plans for its share of a layer's pins).
pub fn build(
    model: &mut Model,
    ordinal: usize,
    opts: &EngineOptions,
    rules: Option<&PlacementPlan>,
) -> anyhow::Result<(GpuModel, TpGroup)> {
    let tp = opts.tensor_parallel;
    let world = tp.size;
    let cfg = model.config.clone();
    let plan = ShardPlan::new(&cfg, world).context("--tensor-parallel")?;
    let ordinals: Vec<usize> = match tp.comm {
        CommKind::Loopback => vec![ordinal; world],
        CommKind::Nccl => (ordinal..ordinal + world).collect(),
    };
    let devs = ordinals
        .iter()
        .map(|&o| GpuDevice::open(o).with_context(|| format!("tensor-parallel GPU {o}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Plan for the smallest card; the loopback's ranks share one card.
    let mut total = u64::MAX;
    let mut free = u64::MAX;
    for d in &devs {
        let (f, t) = d.memory()?;
        total = total.min(t as u64);
        free = free.min(f as u64);
    }
    let sharing = if tp.comm == CommKind::Loopback {
        world as u64
    } else {
        1
    };
    let budget = gpu_setup::memory_budget(opts, &devs[0].name, total) / sharing;
    let shape = memory::shape_of(&cfg, memory::has_qkv_bias(model), CheckpointFormat::Bf16);
    let layer_pins = rules.map(PlacementPlan::layer_pins).unwrap_or_default();
    let mplan = memory::plan(opts, &shape, budget, &layer_pins).map_err(|e| {
        anyhow::anyhow!(
            "{} does not fit in {:.2} GiB per GPU over {world} GPUs: {e}",
            cfg.arch_name,
            gib(budget)
        )
    })?;
    let msg = format!(
        "tensor parallel over {world} GPUs ({:?}), {} GPU experts per layer on each ({} on the node), KV {} positions\n{}",
        tp.comm,
        mplan.gpu_experts_per_layer,
        mplan.node_experts_per_layer,
        mplan.kv_tokens,
        mplan.describe()
    );
    tracing::info!("{msg}");
    eprintln!("{msg}");
    if mplan.total() * sharing > free {
        bail!(
            "the plan needs {:.2} GiB per GPU but a GPU of the group has {:.2} GiB free: lower --gpu-memory-limit or free the GPUs",
            gib(mplan.total() * sharing),
            gib(free)
        );
    }
    plan.check_groups(
        &cfg,
        (min_group(mplan.dense_dtype), mplan.dense_dtype.as_str()),
        kept_fp8_block(model, mplan.dense_dtype),
    )
    .context("--tensor-parallel")?;
    // the node's GPUs hold the strategy's choice together, spread over them below
    let pins = rules.map(PlacementPlan::pins);
    let per_node = mplan.node_experts_per_layer as usize;
    let placement = gpu_setup::place_experts(opts, &cfg, per_node, pins.as_deref())?;
    gpu_setup::log_rules(rules, &placement, opts);
    let owners = spread_experts(&placement, world);
    let comm: Arc<dyn Communicator> = match tp.comm {
        CommKind::Nccl => Arc::new(Nccl::new(&devs.iter().collect::<Vec<_>>())?),
        CommKind::Loopback => Arc::new(Loopback::new(world)),
    };
    let dense = DenseUpload {
        format: memory::dense_format(mplan.dense_dtype),
        host_embeddings: mplan.host_embeddings,
    };
    let blocks = (mplan.kv_tokens as usize).div_ceil(BLOCK).max(1);
    let shared = RankShared {
        comm: comm.clone(),
        group_step: Arc::new(super::rank::GroupStep::default()),
        expert_owner: Arc::new(std::sync::RwLock::new(owners.clone())),
        upload: (blocks, KvLayout::of(&cfg, opts.release_window_kv), dense),
        mplan,
        card: total,
    };
    let t = std::time::Instant::now();
    let ranks = devs
        .into_iter()
        .enumerate()
        .map(|(r, dev)| {
            let mine = rank_placement(&owners, r);
            upload_rank(model, (&plan, r, &mine), dev, opts, &shared)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut msg = format!(
        "tensor-parallel shards uploaded in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    for g in &ranks {
        let s = g.shard_summary();
        msg.push_str(&format!(
            "\n  GPU {}: q rows {}, K width {}, dense MLP units {}, lm_head rows {}, {} routed experts",
            s.rank, s.q_rows, s.kv_width, s.dense_units, s.lm_head_rows, s.gpu_experts
        ));
    }
    tracing::info!("{msg}");
    eprintln!("{msg}");
    let mut ranks = ranks.into_iter();
    let mut first = ranks.next().context("empty tensor-parallel group")?;
    first.dev.ctx.bind_to_thread()?;
    if let Some(r) = rules {
        // long prompts' DRAM experts are rank 0's
        first.prefill_on_cpu = r.prefill_on_cpu();
    }
    Ok((
        first,
        TpGroup {
            peers: ranks.collect(),
            comm,
        },
    ))
}

/// What every rank of a group is built with.
struct RankShared {
    comm: Arc<dyn Communicator>,
    group_step: Arc<super::rank::GroupStep>,
    expert_owner: Arc<std::sync::RwLock<super::rank::ExpertOwners>>,
    /// KV blocks, their layout, and the dense weights' format.
    upload: (usize, KvLayout, DenseUpload),
    /// The memory plan of each GPU, and the smallest card's bytes.
    mplan: moe_sizing::MemoryPlan,
    card: u64,
}

/// Slices rank `r`'s share out of `model` (its routed experts: `mine`) and uploads it to `dev`.
fn upload_rank(
    model: &mut Model,
    (plan, r, mine): (&ShardPlan, usize, &[Vec<bool>]),
    dev: GpuDevice,
    opts: &EngineOptions,
    shared: &RankShared,
) -> anyhow::Result<GpuModel> {
    dev.ctx.bind_to_thread()?;
    // Live re-placement moves experts between DRAM and any GPU: DRAM keeps every expert.
    let keep_host_copies = opts.live_placement.is_some();
    let mut part =
        rank_model(model, plan, r, mine, keep_host_copies).context("--tensor-parallel")?;
    let (free_before, _) = dev.memory()?;
    let (blocks, layout, dense) = &shared.upload;
    let mut g = GpuModel::upload(
        dev,
        &mut part,
        mine,
        (*blocks, layout.clone(), opts.kv_cache_dtype),
        opts.gpu_prefill_threshold.max(1),
        *dense,
        false,
    )
    .with_context(|| format!("uploading tensor-parallel rank {r}"))?;
    let (free_after, _) = g.dev.memory()?;
    // the loopback's ranks share one device's pool: the free-memory delta is this rank's
    g.memory = Some(memory::MemoryReport {
        plan: shared.mplan.clone(),
        context_used: shared.card.saturating_sub(free_before as u64),
        start_allocated: free_before.saturating_sub(free_after) as u64,
    });
    // each rank captures its own decode graphs (halves around the attention's all-reduce);
    // deferred experts are rank 0's (the only one with CPU experts)
    gpu_setup::apply_step_options(&mut g, opts, &model.config);
    let rc = &part.config;
    g.shard = Some(RankCtx {
        rank: r,
        comm: shared.comm.clone(),
        heads: (rc.num_heads, rc.num_kv_heads),
        vocab: rc.vocab_size,
        expert_owner: shared.expert_owner.clone(),
        group_step: shared.group_step.clone(),
    });
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Device, Engine};

    /// What does not split is refused at load with the reason, before a GPU is opened (so this runs,
    /// and fails the same way, on a machine without one) and without a panic: GLM-5.3-Flash's fixture
    /// (KDA layers, hyper-connections, the indexer: all split or replicated) over 3 GPUs, which its 4
    /// attention heads do not divide.
    #[test]
    fn what_does_not_split_is_refused_before_any_device() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/glm5_next/model_bf16");
        let opts = EngineOptions {
            device: Device::Cuda(0),
            tensor_parallel: TensorParallel {
                size: 3,
                comm: CommKind::Loopback,
            },
            ..Default::default()
        };
        let loaded = std::panic::catch_unwind(|| Engine::load(&dir, &opts).map(|_| ()));
        let Ok(Err(err)) = loaded else {
            panic!("loading with --tensor-parallel 3 did not fail cleanly");
        };
        let text = format!("{err:#}");
        assert!(
            text.contains("--tensor-parallel: 4 attention heads do not split over 3 GPUs"),
            "{text}"
        );
    }
}
