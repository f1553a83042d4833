//! Engine flags shared by `generate`, `serve` and `bench`.
use crate::engine::placement::{GpuExperts, PlacementStrategy};
use crate::engine::placement_rules::RuleSet;
use crate::engine::replacement::LiveOptions;
use crate::engine::{Device, EngineOptions};
use clap::{Args, ValueEnum};
use moe_kernels::cpu::moe::WeightFormat;
use moe_kernels::cpu::{CpuMoeOptions, CpuTier, GroupedInput, HugepageMode, NumaMode};
use moe_sizing::{DenseChoice, DenseDtype, EmbeddingChoice, KvRequest};
use std::path::PathBuf;

/// Precision of the activations the CPU expert kernels multiply with.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertActivations {
    /// Exact: the AVX2/FMA tier, matches transformers to 1e-6.
    F32,
    /// The AVX-512 BF16 / AMX tiers, fastest.
    Bf16,
}

/// `--kv-cache-tokens`: a number of positions or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvTokens {
    Auto,
    Count(usize),
}

impl std::str::FromStr for KvTokens {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            n => n
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .map(Self::Count)
                .ok_or_else(|| {
                    format!("--kv-cache-tokens takes a positive number or `auto`, got `{s}`")
                }),
        }
    }
}

/// Positions `--kv-cache-tokens auto` aims for outside `serve` (which sizes by its context length):
/// at least 4096, up to the 65536 the fixed default used to be.
const AUTO_KV_MIN: usize = 4096;
const AUTO_KV_MAX: usize = 65536;

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenseDtypeArg {
    Auto,
    Bf16,
    Fp8,
    Int4,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvCacheDtypeArg {
    Bf16,
    Fp8,
    Int8,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostEmbeddingsArg {
    Auto,
    On,
    Off,
}

fn parse_gpu_memory_limit(s: &str) -> Result<u64, String> {
    let b = moe_sizing::parse_bytes(s)?;
    if b < 1 << 30 {
        return Err(format!("`{s}` is below 1 GiB: the GPU backend needs more"));
    }
    Ok(b)
}

#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// CPU worker threads (0 = all CPUs this process may use, e.g. a Guaranteed pod's exclusive CPUs).
    #[arg(long, default_value_t = 0)]
    pub cpu_threads: usize,
    /// NUMA policy of the CPU expert workers: auto (one pool per node, experts partitioned) or off.
    #[arg(long, default_value = "auto")]
    pub numa: NumaMode,
    /// Expert memory pages: auto, 1G, 2M (reserved hugepages, else transparent), thp (transparent only) or
    /// off (4 KiB). Load logs what the kernel gave.
    #[arg(long, default_value = "auto")]
    pub hugepages: HugepageMode,
    /// Format of DRAM experts: bf16, fp8, int8, int4 (group 32), int4g64, int4g128. Default: as stored.
    #[arg(long)]
    pub expert_dtype: Option<WeightFormat>,
    /// Element type of the CPU backend's KV cache: f16, bf16 or f32 (default: f16 for GQA models, f32
    /// for MLA models).
    #[arg(long)]
    pub cpu_kv_dtype: Option<crate::engine::kv::KvDtype>,
    /// Element type of the GPU KV cache: bf16, int8 or fp8 (8-bit codes with one scale per KV head and
    /// position: about half the bytes, so twice the context; GQA models only). int8 (llama.cpp's q8_0
    /// rounding) is about five times more accurate per value than fp8 (E4M3, vLLM's name) for the same bytes.
    #[arg(long, value_enum, default_value = "bf16")]
    pub kv_cache_dtype: KvCacheDtypeArg,
    /// Cap the CPU kernel tier (scalar, avx2, avx512, amx); default: the best this CPU has.
    #[arg(long)]
    pub cpu_tier: Option<CpuTier>,
    /// Activations of the CPU dense projections over GGUF-quantized weights in decode-sized calls:
    /// int8 (one int8 row per token per block, as llama.cpp's q8_0 / q8_1 activations: the fastest
    /// decode, but near-tie greedy tokens of small models can flip), int8pair or int8pairall (a second
    /// int8 row for the residual in outlier groups / in every group), bf16 (weights widened).
    /// Default: int8pair for 4-bit codes, int8pairall for 8-bit codes (accurate).
    #[arg(long)]
    pub cpu_dense_input: Option<GroupedInput>,
    /// Activations of the CPU expert kernels. Default: f32 for `generate`, bf16 for `serve`/`bench`.
    #[arg(long, value_enum)]
    pub expert_activations: Option<ExpertActivations>,
    /// Run DRAM experts on the simple reference path instead of the packed SIMD kernels.
    #[arg(long)]
    pub reference_experts: bool,
    /// Backend for attention, dense layers and GPU experts: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// GPUs of this node that run the model together (tensor parallel, from the --device GPU on):
    /// attention heads and dense projections split across them, GPU experts spread over them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub tensor_parallel: u32,
    /// All-reduce of --tensor-parallel: nccl (one GPU per rank), or loopback (every rank on the
    /// --device GPU; checks the sharded model on one GPU, slowly).
    #[arg(long, default_value = "nccl", hide = true)]
    pub tensor_parallel_comm: crate::engine::parallel::CommKind,
    /// Routed experts per MoE layer kept on the GPU, or `auto` (as many as fit).
    #[arg(long, default_value = "0", conflicts_with = "gpu_experts_ratio")]
    pub gpu_experts: GpuExperts,
    /// Share of each layer's routed experts kept on the GPU (0..=1).
    #[arg(long)]
    pub gpu_experts_ratio: Option<f64>,
    /// Which experts go to the GPU: uniform, frequency, front-loading, random.
    #[arg(long, default_value = "uniform")]
    pub expert_placement: PlacementStrategy,
    /// Seed of the `random` placement.
    #[arg(long, default_value_t = 0)]
    pub placement_seed: u64,
    /// Routing statistics (from --record-routing) for `--expert-placement frequency`.
    #[arg(long)]
    pub routing_stats: Option<PathBuf>,
    /// Record how often each expert is routed to and write the statistics to FILE at exit.
    #[arg(long)]
    pub record_routing: Option<PathBuf>,
    /// Placement rules (YAML, docs/PLACEMENT.md): pin experts to the GPU or DRAM by name / layer /
    /// expert, choose where long prompts compute them and their DRAM format; the first matching rule
    /// wins, and --gpu-experts / --expert-placement fill the GPU from the experts no rule pins.
    /// Repeatable: the files are tried in order, after --placement-rules-yaml (a user's rules first,
    /// then, e.g., the rules the operator writes for the node class).
    #[arg(long, value_name = "FILE")]
    pub placement_rules: Vec<PathBuf>,
    /// Placement rules as text, tried before any --placement-rules file (the operator passes a
    /// MoEDeployment's inline rules in MOE_PLACEMENT_RULES).
    #[arg(
        long,
        value_name = "YAML",
        env = "MOE_PLACEMENT_RULES",
        hide_env_values = true
    )]
    pub placement_rules_yaml: Option<String>,
    /// As llama.cpp: the routed experts of the first N layers stay in DRAM, every other layer's
    /// experts live on the GPU.
    #[arg(long, value_name = "N", conflicts_with_all = ["placement_rules", "placement_rules_yaml"])]
    pub n_cpu_moe: Option<usize>,
    /// Move experts between GPU and DRAM while serving, following the recent routing (the GPU holds
    /// the hottest ones; DRAM keeps a copy of every expert).
    #[arg(long)]
    pub live_placement: bool,
    /// PCIe budget of live re-placement's expert copies, MiB per second.
    #[arg(long, default_value_t = crate::engine::replacement::DEFAULT_PCIE_MIB_PER_S, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub live_pcie_mib_per_s: u64,
    /// Tokens (all sequences together) after which a routing count has lost half its weight (live
    /// re-placement): shorter follows shifts faster, longer needs more evidence for a move.
    #[arg(long, default_value_t = crate::engine::replacement::DEFAULT_HALF_LIFE_TOKENS, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub live_half_life_tokens: u64,
    /// Steps between two re-plannings (live re-placement).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub live_interval_steps: u32,
    /// Expert copies in flight at once (live re-placement): each holds one expert's GPU memory, and
    /// bounds the moves per step.
    #[arg(long, default_value_t = moe_sizing::plan::LIVE_MOVE_SLOTS as u32, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub live_move_slots: u32,
    /// GPU KV cache capacity in positions, all sequences together, or `auto`: sized by the GPU memory
    /// plan from what the weights leave (at least one --max-model-len sequence when serving).
    #[arg(long, default_value = "auto")]
    pub kv_cache_tokens: KvTokens,
    /// GPU memory the engine may plan with, e.g. 24GiB or 16GiB (default: the card's), to run as a
    /// smaller card would; what does not fit is refused with the reason.
    #[arg(long, value_parser = parse_gpu_memory_limit)]
    pub gpu_memory_limit: Option<u64>,
    /// Precision of the dense projections on the GPU (attention, dense MLP, shared experts,
    /// lm_head): bf16, fp8 (W8A16), int4 (W4A16, group-wise), or auto (bf16 unless the budget is
    /// tight, then fp8, then int4).
    #[arg(long, default_value = "auto")]
    pub dense_dtype: DenseDtypeArg,
    /// Keep the embedding table in host memory and copy each step's rows (on, off, or auto: when the
    /// GPU budget is tight).
    #[arg(long, default_value = "auto")]
    pub host_embeddings: HostEmbeddingsArg,
    /// Steps with at least this many tokens prefill layer by layer on the GPU (DRAM experts streamed
    /// from pinned memory). Above --kv-cache-tokens it disables layerwise prefill and the pinning.
    #[arg(long, default_value_t = 1024)]
    pub gpu_prefill_threshold: usize,
    /// Steps of at least this many tokens (below --gpu-prefill-threshold) split each layer's routed
    /// DRAM experts between the GPU (streamed, the most-loaded) and the CPU kernels, in the measured
    /// ratio of the two sides' rates; 0 = never (the CPU kernels compute them all).
    #[arg(long, default_value_t = crate::engine::gpu::split::DEFAULT_MIN_ROWS)]
    pub gpu_split_min_tokens: usize,
    /// MiB per chunk of the layerwise-prefill expert stream (four staging chunks + one dense on the GPU).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub gpu_stream_chunk_mib: u64,
    /// Run decode eagerly instead of replaying each layer's attention-and-router segment from a CUDA
    /// graph (graphs are on by default; if the driver refuses a capture the daemon warns and runs
    /// eagerly anyway).
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Also replay decode from CUDA graphs for hybrid-attention models (GLM-5.3-Flash, GLM-5). Off by
    /// default: on the H200 they did not beat eager launches (GLM-5.3-Flash shape, graphs on and off
    /// in one process, docs/PERF.md) and their decode buffers take GPU memory.
    #[arg(long)]
    pub cuda_graphs_hybrid: bool,
    /// Decode with the CUDA backend: defer this many of each token's routed CPU experts (those with
    /// the lowest routing weight) to the next layer, so the CPU computes them while the GPU runs that
    /// layer (KTransformers' deferred experts). Faster, but not exact: the logits change (docs/PERF.md
    /// gives the measured difference). 0 (default): exact.
    #[arg(long, default_value_t = 0)]
    pub defer_experts: usize,
    /// MiB of the chosen experts' weights prefetched into the CPU caches while attention runs, per layer,
    /// for models that route from the layer input (SmallThinker); 0 (default) turns it off. 32 is about
    /// one L3's worth; measured slower on a fully used CPU (docs/PERF.md). On the CUDA backend it also
    /// moves those layers' top-k and routing hand-off before attention (early routing), and the idle
    /// CPU worker pool does the prefetch until the layer's rows land.
    #[arg(long, default_value_t = 0)]
    pub expert_prefetch_mib: usize,
    /// Keep every KV position of sliding-window layers (by default the blocks that left every such
    /// layer's window are reused; outputs are the same either way).
    #[arg(long)]
    pub keep_window_kv: bool,
}

impl EngineArgs {
    /// The rule sources joined in the order tried: the text of --placement-rules-yaml, then each
    /// --placement-rules file.
    fn rule_sets(&self) -> anyhow::Result<Option<RuleSet>> {
        let mut sets = Vec::new();
        if let Some(text) = &self.placement_rules_yaml {
            sets.push(RuleSet::parse("MOE_PLACEMENT_RULES", text)?);
        }
        for path in &self.placement_rules {
            sets.push(RuleSet::load(path)?);
        }
        Ok(RuleSet::join(sets))
    }

    /// Engine options; `exact_by_default` picks f32 expert activations when the flag is absent.
    pub fn options_with(&self, exact_by_default: bool) -> anyhow::Result<EngineOptions> {
        let exact = match self.expert_activations {
            None => exact_by_default,
            Some(a) => a == ExpertActivations::F32,
        };
        let mut o = self.options()?;
        if exact {
            let cap = o
                .cpu_moe
                .max_tier
                .map_or(CpuTier::Avx2, |t| t.min(CpuTier::Avx2));
            o.cpu_moe.max_tier = Some(cap);
        }
        Ok(o)
    }

    /// Engine options with the fast (bf16-activation) expert kernels unless flags say otherwise.
    pub fn options(&self) -> anyhow::Result<EngineOptions> {
        let gpu_experts = match self.gpu_experts_ratio {
            Some(r) if !(0.0..=1.0).contains(&r) => {
                anyhow::bail!("--gpu-experts-ratio must be within 0..=1, got {r}")
            }
            Some(r) => GpuExperts::Ratio(r),
            None => self.gpu_experts,
        };
        if self.device == Device::Cpu && gpu_experts != GpuExperts::Count(0) {
            anyhow::bail!("--gpu-experts needs --device cuda");
        }
        if self.device == Device::Cpu && self.gpu_memory_limit.is_some() {
            anyhow::bail!("--gpu-memory-limit needs --device cuda");
        }
        if self.device == Device::Cpu && self.tensor_parallel > 1 {
            anyhow::bail!("--tensor-parallel needs --device cuda");
        }
        if self.device == Device::Cpu && self.kv_cache_dtype != KvCacheDtypeArg::Bf16 {
            anyhow::bail!(
                "--kv-cache-dtype is the GPU cache's (the CPU backend's is --cpu-kv-dtype)"
            );
        }
        let cpu_moe = CpuMoeOptions {
            threads: (self.cpu_threads > 0).then_some(self.cpu_threads),
            numa: self.numa,
            hugepages: self.hugepages,
            max_tier: self.cpu_tier,
            dense_input: self.cpu_dense_input,
            ..Default::default()
        };
        let placement_rules = match self.n_cpu_moe {
            Some(n) => Some(RuleSet::n_cpu_moe(n)),
            None => self.rule_sets()?,
        };
        let live_placement = self.live_placement.then(|| LiveOptions {
            pcie_bytes_per_s: (self.live_pcie_mib_per_s << 20) as f64,
            half_life_tokens: self.live_half_life_tokens as f64,
            interval_steps: self.live_interval_steps,
            max_in_flight: self.live_move_slots as usize,
            ..Default::default()
        });
        Ok(EngineOptions {
            placement_rules,
            live_placement,
            cpu_kernels: !self.reference_experts,
            cpu_moe,
            expert_format: self.expert_dtype,
            cpu_threads: self.cpu_threads,
            device: self.device,
            gpu_experts,
            placement: self.expert_placement,
            placement_seed: self.placement_seed,
            routing_stats: self.routing_stats.clone(),
            record_routing: self.record_routing.is_some(),
            kv_cache_tokens: match self.kv_cache_tokens {
                KvTokens::Count(n) => n,
                KvTokens::Auto => AUTO_KV_MAX,
            },
            kv_auto: match self.kv_cache_tokens {
                KvTokens::Count(_) => None,
                KvTokens::Auto => Some(moe_sizing::KvRequest {
                    min_tokens: AUTO_KV_MIN as u64,
                    target_tokens: AUTO_KV_MAX as u64,
                    max_tokens: AUTO_KV_MAX as u64,
                    longest_sequence: AUTO_KV_MAX as u64,
                }),
            },
            gpu_memory_limit: self.gpu_memory_limit,
            dense_dtype: match self.dense_dtype {
                DenseDtypeArg::Auto => DenseChoice::Auto,
                DenseDtypeArg::Bf16 => DenseChoice::Fixed(DenseDtype::Bf16),
                DenseDtypeArg::Fp8 => DenseChoice::Fixed(DenseDtype::Fp8),
                DenseDtypeArg::Int4 => DenseChoice::Fixed(DenseDtype::Int4),
            },
            embeddings: match self.host_embeddings {
                HostEmbeddingsArg::Auto => EmbeddingChoice::Auto,
                HostEmbeddingsArg::On => EmbeddingChoice::Host,
                HostEmbeddingsArg::Off => EmbeddingChoice::Gpu,
            },
            max_step_tokens: 2048,
            max_step_seqs: 64,
            max_sequence_tokens: None,
            gpu_prefill_threshold: self.gpu_prefill_threshold,
            gpu_split_min_rows: self.gpu_split_min_tokens,
            gpu_stream_chunk_bytes: (self.gpu_stream_chunk_mib as usize) << 20,
            cuda_graphs: !self.no_cuda_graphs,
            cuda_graphs_hybrid: self.cuda_graphs_hybrid,
            defer_experts: self.defer_experts,
            release_window_kv: !self.keep_window_kv,
            expert_prefetch_bytes: self.expert_prefetch_mib << 20,
            cpu_kv_dtype: self.cpu_kv_dtype,
            tensor_parallel: crate::engine::parallel::TensorParallel {
                size: self.tensor_parallel as usize,
                comm: self.tensor_parallel_comm,
            },
            kv_cache_dtype: match self.kv_cache_dtype {
                KvCacheDtypeArg::Bf16 => moe_sizing::KvCacheDtype::Bf16,
                KvCacheDtypeArg::Fp8 => moe_sizing::KvCacheDtype::Fp8,
                KvCacheDtypeArg::Int8 => moe_sizing::KvCacheDtype::Int8,
            },
        })
    }
}

impl EngineArgs {
    /// Options for serving: KV (when `auto`) sized for `max_context`-position sequences, `max_seqs` of
    /// them at most, and step buffers for `max_step_tokens` tokens.
    pub fn serving_options(
        &self,
        max_context: usize,
        max_seqs: usize,
        max_step_tokens: usize,
    ) -> anyhow::Result<EngineOptions> {
        let mut o = self.options()?;
        if self.kv_cache_tokens == KvTokens::Auto {
            let req = KvRequest::serving(max_context as u64, max_seqs as u64);
            o.kv_cache_tokens = req.target_tokens as usize;
            o.kv_auto = Some(req);
        }
        o.max_step_tokens = max_step_tokens;
        o.max_step_seqs = max_seqs;
        o.max_sequence_tokens = Some(max_context);
        Ok(o)
    }

    /// KV positions for engines without a memory plan (the CPU backend, the scripted test model).
    pub fn kv_tokens_or(&self, auto: usize) -> usize {
        match self.kv_cache_tokens {
            KvTokens::Count(n) => n,
            KvTokens::Auto => auto,
        }
    }
}
