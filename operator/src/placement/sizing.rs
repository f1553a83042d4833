//! Turning `auto` into numbers: GPU experts per layer, CPU threads, DRAM and hugepages for one node's
//! hardware and the model's shape.
//!
//! GPU memory of known models (a full shape from config.json) is planned by the shared sizing crate,
//! the same plan the daemon makes at start (`moe_sizing::choose`: dense weights by dtype, embeddings,
//! GPU experts, KV, step buffers, CUDA graphs within 90% of one GPU); its choices (dense dtype,
//! embeddings in host memory, experts per layer, KV positions, the GPU's memory as the budget) are
//! passed to the daemon as flags, so both run the same plan. An explicit `spec.model.shape` gives
//! bytes only and keeps the coarse formula below (also in docs/OPERATOR.md):
//!
//! ```text
//! gpu_budget   = 0.90 × gpu_memory × gpu_count − dense_bytes − kv_reserve
//! kv_reserve   = kv_bytes_per_token × max_model_len × min(max_num_seqs, 2)   (10% of GPU memory if unknown)
//! gpu_experts  = clamp(⌊gpu_budget / (moe_layers × expert_bytes)⌋, 0, experts_per_layer)
//! cpu_experts  = (experts_per_layer − gpu_experts) × moe_layers × expert_bytes
//! hugepages    = each MoE layer's DRAM experts rounded up to whole pages (one mapping per layer;
//!                2Mi: one page more per layer for a second NUMA node), summed: 1Gi if the node has
//!                enough and at most 1/8 of it stays empty, else 2Mi if the node has enough, else 1Gi
//!                if the node has enough, else off
//! memory       = 4 GiB runtime + 5% of cpu_experts + (cpu_experts when not in hugepages)
//! cpus         = whole CPUs free on the node: allocatable − CPU requested by the pods already bound
//!                there (other workloads', DaemonSets included); without a cluster (`plan`),
//!                allocatable − 2 for DaemonSets.  cpu_threads = cpus − 1
//! ```

use crate::crd::{AutoOr, HugepageSize, MoEDeploymentSpec, ModelShape};
use crate::model_shape::ResolvedShape;
use crate::quantity::{quantity_bytes, round_up_mib, GIB, MIB};

use super::node_facts::NodeFacts;

pub const GPU_USABLE_FRACTION: f64 = moe_sizing::plan::USABLE_FRACTION;
pub const RUNTIME_DRAM_BYTES: u64 = 4 * GIB;
/// Whole CPUs assumed taken by DaemonSets when the pods on a node are not known.
pub const DAEMONSET_CPU_RESERVE: u64 = 2;
/// The fewest whole CPUs an `auto` pod takes: one worker thread and one for the engine and HTTP.
pub const MIN_CPUS: u64 = 2;
/// Full-length sequences whose KV cache must fit on the GPU next to the weights.
pub const KV_RESERVED_SEQUENCES: u32 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HugepageKind {
    OneGi,
    TwoMi,
}

impl HugepageKind {
    pub fn page_bytes(self) -> u64 {
        match self {
            HugepageKind::OneGi => GIB,
            HugepageKind::TwoMi => 2 * MIB,
        }
    }

    pub fn resource_name(self) -> &'static str {
        match self {
            HugepageKind::OneGi => super::node_facts::RESOURCE_HUGEPAGES_1GI,
            HugepageKind::TwoMi => super::node_facts::RESOURCE_HUGEPAGES_2MI,
        }
    }

    /// Value of the daemon's `--hugepages` flag.
    pub fn daemon_arg(self) -> &'static str {
        match self {
            HugepageKind::OneGi => "1G",
            HugepageKind::TwoMi => "2M",
        }
    }

    pub fn available_on(self, node: &NodeFacts) -> u64 {
        match self {
            HugepageKind::OneGi => node.hugepages_1gi_bytes,
            HugepageKind::TwoMi => node.hugepages_2mi_bytes,
        }
    }
}

/// Per-pod numbers the StatefulSet is built from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sizing {
    /// `None`: shape unknown, the daemon decides at start-up (`--gpu-experts auto`).
    pub gpu_experts_per_layer: Option<u32>,
    pub cpus: u32,
    pub cpu_threads: u32,
    pub memory_bytes: u64,
    pub hugepages: Option<(HugepageKind, u64)>,
    /// GPU memory per GPU the weights need (0 when unknown).
    pub gpu_bytes_per_gpu: u64,
    /// The shared memory plan's choices (known models), passed to the daemon.
    pub gpu_plan: Option<GpuPlanChoice>,
}

/// What the shared memory plan chose for one GPU of a node (`--dense-dtype`, `--host-embeddings`,
/// `--kv-cache-tokens`, `--gpu-memory-limit`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GpuPlanChoice {
    pub dense_dtype: moe_sizing::DenseDtype,
    pub host_embeddings: bool,
    pub kv_tokens: u64,
    pub gpu_memory_bytes: u64,
}

/// The plan inputs a deployment gives for a GPU of `gpu_memory_bytes` (the daemon derives the same
/// from the flags the operator passes it).
pub fn plan_inputs(
    spec: &MoEDeploymentSpec,
    detail: &moe_sizing::ModelShape,
    gpu_memory_bytes: u64,
) -> moe_sizing::PlanInputs {
    let kv = moe_sizing::KvRequest::serving(
        spec.serving.max_model_len as u64,
        spec.serving.max_num_seqs as u64,
    );
    moe_sizing::PlanInputs {
        budget_bytes: gpu_memory_bytes,
        dense: moe_sizing::DenseChoice::Auto,
        embeddings: moe_sizing::EmbeddingChoice::Auto,
        experts: match spec.placement.gpu_experts_per_layer {
            AutoOr::Auto => moe_sizing::ExpertsChoice::Auto,
            AutoOr::Count(n) => moe_sizing::ExpertsChoice::PerLayer(n as u64),
        },
        kv,
        // the operator does not pass --kv-cache-dtype: the daemon's default
        kv_dtype: moe_sizing::KvCacheDtype::Bf16,
        max_step_tokens: spec.serving.max_num_batched_tokens as u64,
        max_step_seqs: spec.serving.max_num_seqs as u64,
        // the daemon sets up layerwise prefill's stream when its KV can hold such a step
        stream_staging_bytes: if detail.moe.is_some()
            && kv.max_tokens >= moe_sizing::plan::DEFAULT_PREFILL_THRESHOLD
        {
            moe_sizing::plan::stream_staging_bytes(
                detail.gpu_expert_bytes(),
                detail.experts_per_layer(),
                moe_sizing::plan::STREAM_CHUNK_BYTES,
            )
        } else {
            0
        },
        // the daemon's default: graphs, except for hybrid-attention models
        cuda_graphs: detail.hybrid.is_none(),
        // Rules are resolved against tensor names by the daemon; with rules the operator passes
        // `--gpu-experts auto` and the daemon fits its fill around their pins (see daemon_args).
        pins: Vec::new(),
        move_slots: if spec.placement.live_placement {
            moe_sizing::plan::LIVE_MOVE_SLOTS
        } else {
            0
        },
        // the daemon's default (MOE_FLASH_PREFILL is an engineers' A/B knob, not a pod setting)
        prefill_attention: moe_sizing::PrefillAttention::Fused,
    }
}

/// Bytes of `kind` pages that hold `layers` MoE layers of `layer_bytes` DRAM experts as the daemon maps
/// them: one mapping per layer (per NUMA group of its worker pool), each rounded up to whole pages on
/// its own, so 1 GiB pages hold a 720 MiB layer in 1 GiB. For 2 MiB pages one more page per layer lets
/// a pod whose CPUs span two NUMA nodes (two mappings per layer) fit too; with 1 GiB pages such a pod's
/// layers that do not fit fall back to 2 MiB or transparent pages (the daemon checks its cgroup's
/// hugetlb limit before mapping).
pub fn hugepage_bytes(kind: HugepageKind, layers: u64, layer_bytes: u64) -> u64 {
    if layer_bytes == 0 {
        return 0;
    }
    let numa_slack = match kind {
        HugepageKind::OneGi => 0,
        HugepageKind::TwoMi => 1,
    };
    layers * (layer_bytes.div_ceil(kind.page_bytes()) + numa_slack) * kind.page_bytes()
}

/// Why a node's hardware cannot host any sizing at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SizingError {
    GpuMemoryUnknown,
    DenseWeightsDoNotFit {
        needed_mib: u64,
        available_mib: u64,
    },
    /// The shared plan found nothing that fits (dense weights, one full-length sequence of KV, or
    /// the experts asked for).
    GpuPlan(moe_sizing::PlanError),
    TooFewCpus {
        whole_cpus: u64,
    },
}

/// Spec-level problems that no node can fix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecSizingError {
    #[error("resources.memory is required when the model shape is unknown (set spec.model.shape or use a known model)")]
    MemoryNeedsShape,
    #[error("placement.hugepages.amount is required when the model shape is unknown")]
    HugepagesNeedShape,
    #[error("invalid quantity in {field}: {value:?}")]
    BadQuantity { field: &'static str, value: String },
}

fn kv_reserve_bytes(spec: &MoEDeploymentSpec, shape: &ModelShape, gpu_total: u64) -> u64 {
    match shape.kv_bytes_per_token {
        Some(per_token) => per_token
            .saturating_mul(spec.serving.max_model_len as u64)
            .saturating_mul(spec.serving.max_num_seqs.min(KV_RESERVED_SEQUENCES) as u64),
        None => gpu_total / 10,
    }
}

/// Spec checks that do not depend on any node; run once before looking at nodes.
pub fn check_spec(
    spec: &MoEDeploymentSpec,
    shape: Option<&ResolvedShape>,
) -> Result<(), SpecSizingError> {
    if let Some(q) = &spec.resources.memory {
        quantity_bytes(q).map_err(|_| SpecSizingError::BadQuantity {
            field: "resources.memory",
            value: q.0.clone(),
        })?;
    }
    if let Some(q) = &spec.placement.hugepages.amount {
        quantity_bytes(q).map_err(|_| SpecSizingError::BadQuantity {
            field: "placement.hugepages.amount",
            value: q.0.clone(),
        })?;
    }
    if shape.is_none() {
        if spec.resources.memory.is_none() {
            return Err(SpecSizingError::MemoryNeedsShape);
        }
        let explicit_size = matches!(
            spec.placement.hugepages.size,
            HugepageSize::OneGi | HugepageSize::TwoMi
        );
        if explicit_size && spec.placement.hugepages.amount.is_none() {
            return Err(SpecSizingError::HugepagesNeedShape);
        }
    }
    Ok(())
}

/// The sizing this node's hardware supports. Assumes `check_spec` passed.
pub fn size_for_node(
    spec: &MoEDeploymentSpec,
    shape: Option<&ResolvedShape>,
    node: &NodeFacts,
) -> Result<Sizing, SizingError> {
    let gpu_count = spec.resources.gpu.count as u64;
    let gpu_memory_per_gpu = node.gpu_memory_mib.map(|m| m * MIB);

    // GPU experts and what they cost on the GPU.
    let mut gpu_plan = None;
    let (gpu_experts, gpu_bytes_per_gpu) = match shape {
        Some(ResolvedShape {
            detail: Some(detail),
            ..
        }) => {
            // `gpu.count` GPUs run the model tensor-parallel (`--tensor-parallel`): the plan is each
            // GPU's, with the experts of all of them counted.
            let per_gpu = gpu_memory_per_gpu.ok_or(SizingError::GpuMemoryUnknown)?;
            let inputs = plan_inputs(spec, detail, per_gpu);
            let plan = moe_sizing::choose_devices(detail, &inputs, gpu_count.max(1))
                .map_err(SizingError::GpuPlan)?;
            gpu_plan = Some(GpuPlanChoice {
                dense_dtype: plan.dense_dtype,
                host_embeddings: plan.host_embeddings,
                kv_tokens: plan.kv_tokens,
                gpu_memory_bytes: per_gpu,
            });
            (Some(plan.node_experts_per_layer as u32), plan.total())
        }
        None => (
            match spec.placement.gpu_experts_per_layer {
                AutoOr::Count(n) => Some(n),
                AutoOr::Auto => None,
            },
            0,
        ),
        Some(shape) => {
            let per_gpu = gpu_memory_per_gpu.ok_or(SizingError::GpuMemoryUnknown)?;
            let gpu_total = per_gpu * gpu_count;
            let usable = (gpu_total as f64 * GPU_USABLE_FRACTION) as u64;
            let fixed = shape.dense_bytes + kv_reserve_bytes(spec, shape, gpu_total);
            let layer_expert_bytes = shape.moe_layers as u64 * shape.expert_bytes;
            let experts = match spec.placement.gpu_experts_per_layer {
                AutoOr::Count(n) => n.min(shape.experts_per_layer),
                AutoOr::Auto => {
                    if usable < fixed {
                        return Err(SizingError::DenseWeightsDoNotFit {
                            needed_mib: fixed.div_ceil(MIB),
                            available_mib: usable / MIB,
                        });
                    }
                    let fit = (usable - fixed) / layer_expert_bytes.max(1);
                    fit.min(shape.experts_per_layer as u64) as u32
                }
            };
            let need_total = fixed + experts as u64 * layer_expert_bytes;
            (Some(experts), need_total.div_ceil(gpu_count.max(1)))
        }
    };

    // CPUs: whole cores for Guaranteed QoS; one core is left to the engine/HTTP threads.
    let (cpus, cpu_threads) = match spec.placement.cpu_threads {
        AutoOr::Count(n) => (n.max(1) + 1, n.max(1)),
        AutoOr::Auto => {
            let free = node.free_whole_cpus();
            if free < MIN_CPUS {
                return Err(SizingError::TooFewCpus { whole_cpus: free });
            }
            let cpus = u32::try_from(free).unwrap_or(u32::MAX);
            (cpus, cpus - 1)
        }
    };

    // Expert bytes that stay in DRAM: with live placement DRAM keeps every expert (the GPU holds
    // copies of the hot ones, which can move back at no cost).
    let gpu_experts_off_dram = if spec.placement.live_placement {
        Some(0)
    } else {
        gpu_experts
    };
    // The DRAM experts of one MoE layer (placement keeps the same count in every layer).
    let (moe_layers, layer_dram_bytes) = match (shape, gpu_experts_off_dram) {
        (Some(shape), Some(g)) => (
            shape.moe_layers as u64,
            (shape.experts_per_layer - g.min(shape.experts_per_layer)) as u64 * shape.expert_bytes,
        ),
        _ => (0, 0),
    };
    let cpu_expert_bytes = moe_layers * layer_dram_bytes;
    let pages = |kind: HugepageKind| hugepage_bytes(kind, moe_layers, layer_dram_bytes);

    let hp = &spec.placement.hugepages;
    let explicit_amount = hp.amount.as_ref().and_then(|q| quantity_bytes(q).ok());
    let round_to_page =
        |kind: HugepageKind, bytes: u64| bytes.div_ceil(kind.page_bytes()) * kind.page_bytes();
    let hugepages = match hp.size {
        HugepageSize::Off => None,
        HugepageSize::OneGi | HugepageSize::TwoMi => {
            let kind = if hp.size == HugepageSize::OneGi {
                HugepageKind::OneGi
            } else {
                HugepageKind::TwoMi
            };
            let bytes = explicit_amount.map_or_else(|| pages(kind), |b| round_to_page(kind, b));
            (bytes > 0).then_some((kind, bytes))
        }
        HugepageSize::Auto => {
            if cpu_expert_bytes == 0 {
                None
            } else {
                let one_gi = (HugepageKind::OneGi, pages(HugepageKind::OneGi));
                let two_mi = (HugepageKind::TwoMi, pages(HugepageKind::TwoMi));
                // 1 GiB pages first where at most 1/8 of them stays empty (the daemon's own rule),
                // then 2 MiB pages, then 1 GiB pages however empty: pages reserved on the node serve
                // nothing but hugepage requests, and any huge page beats 4 KiB for the experts.
                let tight = one_gi.1 - cpu_expert_bytes <= cpu_expert_bytes / 8;
                [tight.then_some(one_gi), Some(two_mi), Some(one_gi)]
                    .into_iter()
                    .flatten()
                    .find(|(kind, bytes)| kind.available_on(node) >= *bytes)
            }
        }
    };

    let memory_bytes = match spec
        .resources
        .memory
        .as_ref()
        .and_then(|q| quantity_bytes(q).ok())
    {
        Some(explicit) => explicit,
        None => {
            let experts_in_dram = if hugepages.is_some() {
                0
            } else {
                cpu_expert_bytes
            };
            round_up_mib(RUNTIME_DRAM_BYTES + cpu_expert_bytes / 20 + experts_in_dram)
        }
    };

    Ok(Sizing {
        gpu_experts_per_layer: gpu_experts,
        cpus,
        cpu_threads,
        memory_bytes,
        hugepages,
        gpu_bytes_per_gpu,
        gpu_plan,
    })
}
