//! The executor: owns a loaded [`Model`] and runs batched forward passes over sequence chunks.
//!
//! One call of [`Engine::forward`] is one engine step: every sequence of the batch contributes its next
//! chunk of tokens (a prefill chunk or one decode token). Linear layers and experts process all tokens of
//! the step together (weights are read once per step); attention runs per sequence against its cache.
pub mod cpu;
pub mod gpu;
pub mod heap;
pub mod indexer;
pub mod kv;
pub mod linear;
pub mod live;
pub mod moe;
pub mod ops;
pub mod parallel;
pub mod placement;
pub mod placement_rules;
pub mod replacement;
pub mod rope;
pub mod sampling;
pub mod skewed_routing;
mod step_times;

use crate::model::build::build_model;
use crate::model::config::RouterInput;
use crate::model::{Model, ModelConfig};
use crate::weights::safetensors::SafetensorsDir;
use crate::weights::TensorSource;
use anyhow::Context;
pub use kv::{KvError, SeqCache};
use rope::Rope;
use std::path::Path;
pub use step_times::StepTimes;

/// Which backend runs the dense part of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    /// CUDA GPU by ordinal.
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("--device takes cpu, cuda or cuda:N, got `{s}`")),
        }
    }
}

/// Engine settings that do not come from the checkpoint.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Worker threads for the CPU backend (0: all CPUs the process may use).
    pub cpu_threads: usize,
    pub device: Device,
    /// Routed experts per MoE layer kept on the GPU (CUDA backend).
    pub gpu_experts: placement::GpuExperts,
    pub placement: placement::PlacementStrategy,
    pub placement_seed: u64,
    /// Routing statistics for `frequency` placement.
    pub routing_stats: Option<std::path::PathBuf>,
    /// Record routing statistics (saved by [`Engine::save_routing_stats`]).
    pub record_routing: bool,
    /// Placement rules (`--placement-rules FILE`, `--n-cpu-moe N`): pinned homes, prefill devices and
    /// DRAM formats per expert, applied before the strategy fills the GPU.
    pub placement_rules: Option<placement_rules::RuleSet>,
    /// Re-place experts between GPU and DRAM while serving (CUDA backend).
    pub live_placement: Option<replacement::LiveOptions>,
    /// GPU KV cache capacity in positions (all sequences together), unless `kv_auto` sizes it.
    pub kv_cache_tokens: usize,
    /// CUDA backend: size the KV cache from the memory left after the weights (at least
    /// `min_tokens`); `None`: exactly `kv_cache_tokens`.
    pub kv_auto: Option<moe_sizing::KvRequest>,
    /// GPU memory the CUDA backend plans within (`None`: the card's); reproduces a smaller card.
    pub gpu_memory_limit: Option<u64>,
    /// Precision of the dense projections on the GPU (auto: bf16 unless the budget is tight).
    pub dense_dtype: moe_sizing::DenseChoice,
    /// Where the embedding table lives with the CUDA backend (auto: host memory when tight).
    pub embeddings: moe_sizing::EmbeddingChoice,
    /// Most tokens and sequences of one step, for the activation buffers the plan reserves.
    pub max_step_tokens: usize,
    pub max_step_seqs: usize,
    /// Most positions one sequence may hold (`--max-model-len` when serving; `None`: the KV cache's).
    pub max_sequence_tokens: Option<usize>,
    /// Steps of at least this many tokens prefill layer by layer on the GPU.
    pub gpu_prefill_threshold: usize,
    /// Steps from this many rows up to `gpu_prefill_threshold` split each layer's DRAM experts
    /// between the GPU (streamed) and the CPU kernels (`gpu::split`); 0 = never.
    pub gpu_split_min_rows: usize,
    /// DRAM experts (and, on the CPU backend, dense projections) run on the packed CPU kernels
    /// (AMX / AVX-512 / AVX2); false = reference path.
    pub cpu_kernels: bool,
    /// Threads, NUMA and hugepage policy of the CPU expert kernels.
    pub cpu_moe: moe_kernels::cpu::CpuMoeOptions,
    /// Format of DRAM experts (None: as in the checkpoint; int8 / int4 are quantized at load).
    pub expert_format: Option<moe_kernels::cpu::moe::WeightFormat>,
    /// Bytes per chunk of layerwise prefill's expert stream (each of the `SLOTS` staging slots).
    pub gpu_stream_chunk_bytes: usize,
    /// Replay decode steps from CUDA graphs (CUDA backend, GQA models). Off by default until a
    /// capture has been seen to work on the test GPU (the first attempt was refused there and fell
    /// back to eager steps; see docs/PERF.md).
    pub cuda_graphs: bool,
    /// CUDA graphs for hybrid-attention models too (`cuda_graphs` must be on as well).
    pub cuda_graphs_hybrid: bool,
    /// CUDA backend, decode: of each token's routed experts, this many with the lowest routing
    /// weight are deferred when the CPU computes them (KTransformers' deferred experts): their output
    /// is added one layer later, so the CPU computes them while the GPU runs the next layer. Changes
    /// the model's output (docs/PERF.md states by how much); 0 (default) is exact.
    pub defer_experts: usize,
    /// Bytes of the chosen experts' packed weights prefetched into the CPU caches per layer while
    /// attention runs, when routing is known before attention (router on the layer input) and the
    /// experts run on the packed CPU kernels; 0 = off.
    pub expert_prefetch_bytes: usize,
    /// Element type of the CPU backend's KV rows (`None`: [`kv::default_dtype`] of the model).
    pub cpu_kv_dtype: Option<kv::KvDtype>,
    /// Element type of the CUDA backend's KV cache: bf16, or FP8 rows with per-head scales (GQA
    /// attention only).
    pub kv_cache_dtype: moe_sizing::KvCacheDtype,
    /// Sliding-window layers give back the KV blocks that left their window (false: every layer keeps
    /// every position, as full-attention layers do).
    pub release_window_kv: bool,
    /// GPUs of the node that run the model together (CUDA backend; 1: one GPU).
    pub tensor_parallel: parallel::TensorParallel,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            cpu_threads: 0,
            device: Device::Cpu,
            gpu_experts: placement::GpuExperts::Count(0),
            placement: placement::PlacementStrategy::Uniform,
            placement_seed: 0,
            routing_stats: None,
            record_routing: false,
            placement_rules: None,
            live_placement: None,
            kv_cache_tokens: 65536,
            kv_auto: None,
            gpu_memory_limit: None,
            dense_dtype: moe_sizing::DenseChoice::Auto,
            embeddings: moe_sizing::EmbeddingChoice::Auto,
            max_step_tokens: 2048,
            max_step_seqs: 64,
            max_sequence_tokens: None,
            gpu_prefill_threshold: 1024,
            gpu_split_min_rows: gpu::split::DEFAULT_MIN_ROWS,
            cpu_kernels: true,
            cpu_moe: Default::default(),
            expert_format: None,
            gpu_stream_chunk_bytes: gpu::stream::CHUNK_BYTES,
            cuda_graphs: false,
            cuda_graphs_hybrid: false,
            defer_experts: 0,
            expert_prefetch_bytes: 0,
            cpu_kv_dtype: None,
            kv_cache_dtype: moe_sizing::KvCacheDtype::Bf16,
            release_window_kv: true,
            tensor_parallel: Default::default(),
        }
    }
}

/// The prefetch size to use when it is turned on: about one L3 cache's worth (more would evict what was
/// prefetched first before the kernels read it). Off by default: on the H200 host (16 cores) it slowed
/// CPU-only SmallThinker-21B decode from 10.8 to 6.6 tok/s, its thread competing with the expert workers.
pub const DEFAULT_EXPERT_PREFETCH_BYTES: usize = 32 << 20;

/// Input of one sequence for one step. The cache must already cover `cache.len() + tokens.len()`
/// positions ([`SeqCache::reserve`], or [`reserve_batch`] for callers without a scheduler).
pub struct SeqInput<'a> {
    pub cache: &'a mut SeqCache,
    pub tokens: &'a [u32],
}

impl<'a> SeqInput<'a> {
    /// A batch of one entry per cache, `tokens[i]` fed to `caches[i]` (the shorter list decides).
    pub fn batch<T: AsRef<[u32]>>(caches: &'a mut [SeqCache], tokens: &'a [T]) -> Vec<Self> {
        caches
            .iter_mut()
            .zip(tokens)
            .map(|(cache, t)| SeqInput {
                cache,
                tokens: t.as_ref(),
            })
            .collect()
    }
}

/// The GPU backend's view of a batch: each sequence's block tables, first position, tokens and
/// recurrent state (borrowed from its cache for the step).
fn gpu_seq_inputs<'a>(batch: &'a mut [SeqInput<'_>]) -> Vec<gpu::forward::GpuSeqInput<'a>> {
    batch
        .iter_mut()
        .map(|s| {
            let pos0 = s.cache.len();
            let (tables, state) = s.cache.parts_mut();
            gpu::forward::GpuSeqInput {
                tables,
                pos0,
                tokens: s.tokens,
                state: state.map(|r| r.device_slots()),
            }
        })
        .collect()
}

/// Reserves the positions each entry's step will write (for drivers without a scheduler: `generate`,
/// `bench`, tests). All entries or an error; a sequence that fails keeps what it had.
pub fn reserve_batch(batch: &mut [SeqInput<'_>]) -> Result<(), KvError> {
    for s in batch.iter_mut() {
        let want = s.cache.len() + s.tokens.len();
        s.cache.reserve(want)?;
    }
    Ok(())
}

/// Where one sequence's chunk sits in the step's flattened token rows.
#[derive(Debug, Clone, Copy)]
pub struct Segment {
    /// First row of this chunk in the step's `[tokens, hidden]` activations.
    pub row0: usize,
    pub len: usize,
    /// Position of the chunk's first token in its sequence.
    pub pos0: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("sequence would reach {len} positions, beyond the model's {max}")]
    TooLong { len: usize, max: usize },
    #[error("empty chunk: every sequence in a step needs at least one token")]
    EmptyChunk,
    #[error("the KV blocks of a sequence cover {reserved} positions, the step writes up to {needed}: reserve before the step")]
    NotReserved { reserved: usize, needed: usize },
    #[error("a sequence's cache belongs to another engine's KV pool")]
    ForeignCache,
    #[error(
        "a sequence's cache has no linear-attention state: make caches with Engine::new_cache"
    )]
    NoRecurrentState,
    #[error("{0}")]
    Backend(String),
}

pub struct Engine {
    /// Live re-placement (copies in flight on the GPU): dropped before the GPU model.
    live: Option<std::sync::Mutex<live::LiveState>>,
    /// The other GPUs of a tensor-parallel group (`gpu` is its rank 0).
    tp: Option<parallel::TpGroup>,
    /// Declared (so dropped) before `model`: the GPU side pins memory the host model owns.
    gpu: Option<gpu::GpuModel>,
    model: Model,
    rope: Rope,
    pool: rayon::ThreadPool,
    /// Persistent pinned workers of the CPU kernels (None: reference path, or GPU with a dense model).
    cpu_pool: Option<std::sync::Arc<moe_kernels::cpu::WorkerPool>>,
    routing_stats: Option<std::sync::Mutex<placement::RoutingStats>>,
    last_step: std::sync::Mutex<StepTimes>,
    /// Which KV block belongs to which sequence (shared with every [`SeqCache`] of this engine).
    kv_blocks: kv::SharedBlockPool,
    /// The rows of those blocks on the CPU backend (the CUDA backend keeps them in its own pool).
    cpu_kv: Option<std::sync::Arc<kv::CpuKvStore>>,
    /// Which block table and storage slot each layer's KV uses (groups by sliding window).
    kv_layout: kv::KvLayout,
    /// Reads a layer's chosen DRAM experts ahead while its attention runs (CPU backend, models routing
    /// from the layer input); None when off or not applicable.
    prefetch: Option<(moe_kernels::cpu::moe::ExpertPrefetcher, usize)>,
}

impl Engine {
    /// Loads a Hugging Face checkpoint directory (config.json + safetensors).
    pub fn load(dir: &Path, opts: &EngineOptions) -> anyhow::Result<Self> {
        let cfg = ModelConfig::from_dir(dir)?;
        let src = SafetensorsDir::open(dir)?;
        Self::from_config(cfg, &src, opts)
            .with_context(|| format!("loading checkpoint {}", dir.display()))
    }

    /// Builds an engine from a config.json value and any tensor source (e.g. a GGUF file).
    pub fn from_source(
        config_json: &serde_json::Value,
        src: &dyn TensorSource,
        opts: &EngineOptions,
    ) -> anyhow::Result<Self> {
        Self::from_config(ModelConfig::from_json(config_json)?, src, opts)
    }

    fn from_config(
        cfg: ModelConfig,
        src: &dyn TensorSource,
        opts: &EngineOptions,
    ) -> anyhow::Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(opts.cpu_threads)
            .thread_name(|i| format!("moe-cpu-{i}"))
            .build()?;
        let rope = Rope::new(&cfg.rope);
        let kv_dtype = opts.cpu_kv_dtype.unwrap_or_else(|| kv::default_dtype(&cfg));
        let footprint = kv::footprint::of(&cfg, kv_dtype.bytes());
        tracing::info!(
            kv_bytes_per_position = footprint.kv_per_position,
            indexer_bytes_per_position = footprint.indexer_per_position,
            linear_state_mib_per_sequence = footprint.state_per_sequence >> 20,
            ?kv_dtype,
            "context memory on the CPU backend"
        );
        let mut model = pool.install(|| build_model(cfg, src))?;
        let rules = opts
            .placement_rules
            .as_ref()
            .map(|r| r.resolve(&model.config))
            .transpose()?;
        if opts.live_placement.is_some() && !matches!(opts.device, Device::Cuda(_)) {
            anyhow::bail!("--live-placement needs --device cuda");
        }
        let mut tp = None;
        let gpu = match opts.device {
            Device::Cpu => {
                if let Some(r) = &rules {
                    if r.pins().iter().flatten().any(|p| *p == Some(true)) {
                        tracing::warn!("placement rules pin experts to the GPU, but the device is the CPU: every expert stays in DRAM");
                    }
                    let placement: Vec<Vec<bool>> =
                        r.experts.iter().map(|row| vec![false; row.len()]).collect();
                    let text = r.describe(&placement, &gpu::setup::default_format_name(opts));
                    tracing::info!("{text}");
                    eprint!("{text}");
                }
                None
            }
            Device::Cuda(ordinal) if opts.tensor_parallel.size > 1 => {
                let (g, group) = parallel::setup::build(&mut model, ordinal, opts, rules.as_ref())?;
                tp = Some(group);
                Some(g)
            }
            Device::Cuda(ordinal) => Some(gpu::setup::build(
                &mut model,
                ordinal,
                opts,
                rules.as_ref(),
            )?),
        };
        let early_routing = model
            .config
            .moe
            .as_ref()
            .is_some_and(|m| m.router_input == RouterInput::LayerInput);
        // Spawned before the worker pool's first region pins this thread to one CPU (a thread spawned
        // after would inherit that pin and share the CPU with the busy caller).
        let prefetch =
            if gpu.is_none() && opts.cpu_kernels && early_routing && opts.expert_prefetch_bytes > 0
            {
                let p = moe_kernels::cpu::moe::ExpertPrefetcher::new()
                    .context("starting the expert prefetch thread")?;
                Some((p, opts.expert_prefetch_bytes))
            } else {
                None
            };
        let on_cpu = matches!(opts.device, Device::Cpu);
        let cpu_pool = if opts.cpu_kernels && (model.config.moe.is_some() || on_cpu) {
            let mut cpu_moe = opts.cpu_moe.clone();
            if cpu_moe.threads.is_none() && opts.cpu_threads > 0 {
                cpu_moe.threads = Some(opts.cpu_threads);
            }
            let p = cpu_moe
                .build_pool()
                .context("starting the CPU expert workers")?;
            match moe_kernels::cpu::topology::topology_source() {
                src @ moe_kernels::cpu::topology::TopologySource::Fallback { .. } => {
                    tracing::warn!("CPU expert workers: {src}")
                }
                src => tracing::info!(
                    threads = p.threads(),
                    pinned_workers = p.pinned_threads(),
                    numa_groups = p.groups(),
                    "CPU expert workers: topology and pinning from {src}"
                ),
            }
            let p = std::sync::Arc::new(p);
            let layer_formats = rules.as_ref().map_or(Vec::new(), |r| r.layer_dtype.clone());
            cpu::experts::pack_model(&mut model, &p, &cpu_moe, opts.expert_format, &layer_formats)?;
            if on_cpu {
                let s = pool.install(|| cpu::dense_pack::pack_dense(&mut model, &p, &cpu_moe))?;
                tracing::info!(
                    packed = s.packed,
                    reference = s.reference,
                    mib = s.bytes >> 20,
                    "dense projections on the CPU kernels"
                );
            }
            // Layerwise prefill pins the packed DRAM experts; skip that when no step can reach the
            // threshold (a step never holds more tokens than the KV cache).
            if let Some(g) = gpu
                .as_ref()
                .filter(|g| opts.gpu_prefill_threshold <= g.kv_positions())
            {
                g.attach_expert_stream(&model, opts.gpu_stream_chunk_bytes)?;
            }
            Some(p)
        } else {
            None
        };
        let kv_layout = match &gpu {
            Some(g) => g.kv_layout.clone(),
            None => kv::KvLayout::of(&model.config, opts.release_window_kv),
        };
        // The KV budget in bytes is that of `kv_cache_tokens` positions of every layer; grouped by
        // sliding window, a block holds fewer layers, so the same bytes make more blocks.
        let blocks = match &gpu {
            // the memory plan sized the device pool
            Some(g) => g.kv.lock().unwrap_or_else(|e| e.into_inner()).total_blocks,
            None => kv_layout.blocks_for_budget(kv::blocks_for(opts.kv_cache_tokens).max(1)),
        };
        let windows = kv_layout.group_windows();
        if windows.len() > 1 {
            tracing::info!(
                groups = windows.len(),
                layers_per_block = kv_layout.slots(),
                blocks,
                longest_sequence = kv_layout.max_positions(blocks),
                "KV cache: sliding-window layers have their own block tables and keep only their window"
            );
        }
        let (kv_blocks, cpu_kv) = match &gpu {
            Some(g) => {
                let copier = gpu::kv::GpuKvCopier {
                    pool: g.kv.clone(),
                    stream: g.dev.stream.clone(),
                };
                let mut copier: std::sync::Arc<dyn kv::blocks::BlockCopy> =
                    std::sync::Arc::new(copier);
                if let Some(group) = &tp {
                    copier = group.block_copier(copier);
                }
                (
                    kv::blocks::shared_grouped_pool(blocks, copier, windows),
                    None,
                )
            }
            None => {
                let widths = kv_layout.slot_widths(&kv::row_widths(&model.config));
                let store = std::sync::Arc::new(kv::CpuKvStore::new(&widths, kv_dtype));
                let pool = kv::blocks::shared_grouped_pool(blocks, store.clone(), windows);
                (pool, Some(store))
            }
        };
        // The loader's tensor buffers are dead now (packed or uploaded): give their pages back.
        heap::release_freed_heap("loading weights");
        let live = match (&gpu, &opts.live_placement) {
            (Some(g), Some(lo)) => {
                let pinned = rules.as_ref().map_or(Vec::new(), |r| {
                    r.pins()
                        .iter()
                        .map(|row| row.iter().map(Option::is_some).collect())
                        .collect()
                });
                let mut gpus = vec![g];
                gpus.extend(tp.iter().flat_map(|t| t.peers.iter()));
                Some(std::sync::Mutex::new(live::LiveState::new(
                    &gpus,
                    &model,
                    lo.clone(),
                    pinned,
                )?))
            }
            _ => None,
        };
        let engine = Self {
            live,
            tp,
            model,
            rope,
            pool,
            gpu,
            cpu_pool,
            prefetch,
            routing_stats: opts.record_routing.then(Default::default),
            last_step: Default::default(),
            kv_blocks,
            cpu_kv,
            kv_layout,
        };
        // the largest step the plan budgets, so the first request finds everything warm
        engine.warm_up_gpu(opts.max_step_tokens);
        Ok(engine)
    }

    /// Share of the KV blocks in use (sequences and cached prefixes), 0 to 1.
    pub fn kv_usage(&self) -> f64 {
        let pool = self.kv_blocks.lock().unwrap_or_else(|e| e.into_inner());
        pool.used() as f64 / pool.total().max(1) as f64
    }

    /// The longest sequence the KV cache holds (alone) between steps. Without sliding-window groups,
    /// every sequence and cached prefix together hold at most this many positions.
    pub fn kv_capacity(&self) -> usize {
        self.kv_capacity_with_steps(0)
    }

    /// The longest sequence the KV cache holds (alone) while it runs steps of up to `step_tokens`
    /// positions: sliding-window groups hold a step's new blocks before giving back old ones.
    pub fn kv_capacity_with_steps(&self, step_tokens: usize) -> usize {
        let total = self
            .kv_blocks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .total();
        self.kv_layout.max_positions_with_steps(total, step_tokens)
    }

    /// How the layers' KV rows share the block pool.
    pub fn kv_layout(&self) -> &kv::KvLayout {
        &self.kv_layout
    }

    /// Bytes the CPU backend's KV rows take now (the high-water mark of blocks in use); None on the
    /// CUDA backend, whose pool is allocated whole at start.
    pub fn cpu_kv_bytes(&self) -> Option<usize> {
        self.cpu_kv.as_ref().map(|s| s.bytes())
    }

    /// With `--cuda-graphs` on, run decode steps eagerly while `paused` (same buffers, graphs kept for
    /// later): graphs on and off compared in one process. Returns whether graphs are in use at all.
    pub fn pause_cuda_graphs(&self, paused: bool) -> bool {
        self.gpu.as_ref().is_some_and(|g| {
            g.graphs_paused
                .store(paused, std::sync::atomic::Ordering::Relaxed);
            g.cuda_graphs
        })
    }

    /// CUDA graphs captured so far (decode segments), 0 without the CUDA backend or with graphs off.
    pub fn cuda_graphs_captured(&self) -> usize {
        self.gpu.as_ref().map_or(0, |g| g.graphs_captured())
    }

    /// CUDA graphs captured so far by each GPU (rank order; one entry without tensor parallelism).
    pub fn cuda_graphs_captured_per_gpu(&self) -> Vec<usize> {
        let peers = self.tp.iter().flat_map(|t| t.peers.iter());
        self.gpu
            .iter()
            .chain(peers)
            .map(gpu::GpuModel::graphs_captured)
            .collect()
    }

    /// Installs (or removes) a probe reading buffers at fixed points of every GPU's layers (tests
    /// comparing a tensor-parallel group with one GPU; turns off CUDA graphs and pipelined decode).
    pub fn set_step_probe(&mut self, probe: Option<std::sync::Arc<parallel::probe::StepProbe>>) {
        let peers = self.tp.iter_mut().flat_map(|t| t.peers.iter_mut());
        for g in self.gpu.iter_mut().chain(peers) {
            g.probe = probe.clone();
        }
    }

    /// The kernels' worker pool of the CPU backend (its region statistics: `bench decode`).
    pub fn cpu_pool(&self) -> Option<&moe_kernels::cpu::WorkerPool> {
        self.cpu_pool.as_deref()
    }

    /// The GPU memory plan and what the start allocated (CUDA backend).
    pub fn gpu_memory(&self) -> Option<&gpu::memory::MemoryReport> {
        self.gpu.as_ref().and_then(|g| g.memory.as_ref())
    }

    /// This engine's device allocations (CUDA backend): bytes in use now and the most in use so far
    /// (weights, KV cache, step buffers; not the CUDA context and cuBLAS workspaces).
    pub fn gpu_pool_usage(&self) -> Option<(u64, u64)> {
        self.gpu.as_ref()?.dev.pool_usage().ok()?
    }

    /// Whether the CUDA backend runs this engine.
    /// What each GPU holds: one entry per GPU of a tensor-parallel group (rank order), one for a
    /// single GPU, none on the CPU backend.
    pub fn gpu_shards(&self) -> Vec<parallel::ShardSummary> {
        let peers = self.tp.iter().flat_map(|t| t.peers.iter());
        self.gpu
            .iter()
            .chain(peers)
            .map(gpu::GpuModel::shard_summary)
            .collect()
    }

    pub fn on_gpu(&self) -> bool {
        self.gpu.is_some()
    }

    /// Timing split of the last step (CUDA backend).
    pub fn last_step_times(&self) -> StepTimes {
        self.last_step
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Writes the recorded routing statistics (JSON) for `--expert-placement frequency`.
    pub fn save_routing_stats(&self, path: &Path) -> anyhow::Result<()> {
        let stats = self
            .routing_stats
            .as_ref()
            .context("routing was not recorded (record_routing is off)")?;
        let stats = stats.lock().unwrap_or_else(|e| e.into_inner());
        std::fs::write(path, serde_json::to_string(&*stats)?)
            .with_context(|| format!("writing {}", path.display()))
    }

    /// Live re-placement figures (`None` when it is off).
    pub fn live_stats(&self) -> Option<live::LiveStats> {
        self.live
            .as_ref()
            .map(|l| l.lock().unwrap_or_else(|e| e.into_inner()).stats())
    }

    /// Waits for the expert copies in flight and swaps them in; returns how many (tests, bench).
    pub fn settle_moves(&self) -> anyhow::Result<usize> {
        match &self.live {
            Some(l) => l
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .settle(&self.gpus()),
            None => Ok(0),
        }
    }

    /// Per layer and expert: on a GPU now (CUDA backend; any GPU of a tensor-parallel group).
    pub fn gpu_residency(&self) -> Option<Vec<Vec<bool>>> {
        self.gpu
            .as_ref()
            .map(|_| live::node_residency(&self.gpus()))
    }

    /// Per GPU (rank order), per layer and expert: resident on that GPU.
    pub fn gpu_residency_per_gpu(&self) -> Vec<Vec<Vec<bool>>> {
        self.gpus().iter().map(|g| g.residency()).collect()
    }

    /// The engine's GPUs: rank 0, then the other ranks of a tensor-parallel group.
    fn gpus(&self) -> Vec<&gpu::GpuModel> {
        let peers = self.tp.iter().flat_map(|t| t.peers.iter());
        self.gpu.iter().chain(peers).collect()
    }

    /// Swaps expert `admit` of `layer` onto the GPU in place of `evict` through live re-placement's
    /// copy path, and waits for it (tests; needs `live_placement`).
    pub fn move_expert_now(&self, layer: usize, admit: usize, evict: usize) -> anyhow::Result<()> {
        let Some(live) = &self.live else {
            anyhow::bail!("moving experts needs the CUDA backend and live re-placement");
        };
        let mv = replacement::Move {
            layer,
            admit,
            evict,
            gain: 0.0,
        };
        live.lock()
            .unwrap_or_else(|e| e.into_inner())
            .move_now(&self.gpus(), &self.model, mv)
    }

    /// The bf16 bits of GPU-resident expert `e` of `layer` (gate_up, down), `None` when it is not on
    /// the GPU (tests: a moved expert must equal one uploaded at start).
    pub fn gpu_expert_bits(
        &self,
        layer: usize,
        e: usize,
    ) -> anyhow::Result<Option<(Vec<u16>, Vec<u16>)>> {
        anyhow::ensure!(self.gpu.is_some(), "needs the CUDA backend");
        // the GPU of the group that holds it
        for g in self.gpus() {
            let Some(gpu::GpuFfn::Moe(moe)) = g.layers.get(layer).map(|l| &l.ffn) else {
                return Ok(None);
            };
            let table = moe.experts.read();
            let Some(m) = table.get(e).and_then(Option::as_ref) else {
                continue;
            };
            g.dev.ctx.bind_to_thread()?;
            let s = &g.dev.stream;
            let gate_up = s.clone_dtoh(m.gate_up.bf16()?)?;
            let down = s.clone_dtoh(m.down.bf16()?)?;
            s.synchronize()?;
            let bits = |v: Vec<half::bf16>| v.into_iter().map(half::bf16::to_bits).collect();
            return Ok(Some((bits(gate_up), bits(down))));
        }
        Ok(None)
    }

    /// Replaces the router's choices on the CUDA backend (`f(layer, ids)` rewrites a step's top-k ids
    /// in place): the skewed-routing benchmark's synthetic router bias.
    pub fn set_routing_override(&self, f: Option<gpu::RoutingOverride>) {
        if let Some(g) = &self.gpu {
            *g.routing_override.lock().unwrap_or_else(|e| e.into_inner()) = f;
        }
    }

    /// Turns the CUDA backend's device-routed experts on or off (`gpu::routed`; A/B runs in one
    /// process). No effect on the CPU backend.
    pub fn set_device_routed(&self, on: bool) {
        if let Some(g) = &self.gpu {
            g.set_device_routed(on);
        }
    }

    fn record(&self, layer: usize, ids: &[u32]) {
        if let Some(live) = &self.live {
            live.lock()
                .unwrap_or_else(|e| e.into_inner())
                .record(layer, ids);
        }
        if let (Some(stats), Some(moe)) = (&self.routing_stats, &self.model.config.moe) {
            stats
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .record(layer, moe.num_experts, ids);
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// An empty cache for a new sequence (no blocks until reserved; a zero linear-attention state for
    /// models with linear layers).
    pub fn new_cache(&self) -> SeqCache {
        let cfg = &self.model.config;
        match &cfg.linear_attention {
            // the CUDA backend keeps the state in GPU memory (made by the sequence's first step)
            Some(_) if self.gpu.is_some() => SeqCache::with_recurrent(
                self.kv_blocks.clone(),
                kv::RecurrentState::on_device(
                    cfg.num_layers,
                    self.tp.as_ref().map_or(1, |g| g.world()),
                ),
            ),
            Some(la) => SeqCache::with_recurrent(
                self.kv_blocks.clone(),
                kv::RecurrentState::new(&cfg.mixers, la),
            ),
            None => SeqCache::new(self.kv_blocks.clone()),
        }
    }

    /// One step; returns the logits at the last position of each entry, in order.
    pub fn forward(&self, batch: &mut [SeqInput<'_>]) -> Result<Vec<Vec<f32>>, StepError> {
        if let Some(g) = &self.gpu {
            self.validate(batch)?;
            return self.pool.install(|| self.run_gpu(g, batch));
        }
        self.run(batch, false)
    }

    /// Reserves each entry's new positions, then runs one step: for drivers without a scheduler
    /// (`generate`, `bench`, tests), where a full cache is simply an error.
    pub fn reserve_and_forward(
        &self,
        batch: &mut [SeqInput<'_>],
    ) -> Result<Vec<Vec<f32>>, StepError> {
        reserve_batch(batch).map_err(|e| StepError::Backend(e.to_string()))?;
        self.forward(batch)
    }

    /// One step returning logits at every position of every entry (rows in batch order; CPU backend).
    pub fn forward_all(&self, batch: &mut [SeqInput<'_>]) -> Result<Vec<Vec<f32>>, StepError> {
        if self.gpu.is_some() {
            return Err(StepError::Backend(
                "logits of every position are only computed by the CPU backend".into(),
            ));
        }
        reserve_batch(batch).map_err(|e| StepError::Backend(e.to_string()))?;
        self.run(batch, true)
    }

    fn run_gpu(
        &self,
        g: &gpu::GpuModel,
        batch: &mut [SeqInput<'_>],
    ) -> Result<Vec<Vec<f32>>, StepError> {
        let mut inputs = gpu_seq_inputs(batch);
        let mut times = StepTimes::default();
        let on_routing = |l: usize, ids: &[u32]| self.record(l, ids);
        let out = self
            .dispatch_gpu_step(g, &mut inputs, &mut times, on_routing)
            .map_err(|e| StepError::Backend(format!("{e:#}")))?;
        drop(inputs);
        if let Some(live) = &self.live {
            live.lock()
                .unwrap_or_else(|e| e.into_inner())
                .after_step(&self.gpus(), &self.model);
        }
        for s in batch.iter_mut() {
            s.cache.advance(s.tokens.len());
        }
        *self.last_step.lock().unwrap_or_else(|e| e.into_inner()) = times;
        Ok(out)
    }

    /// The one place a GPU step is started: rank 0's model alone, or every rank of the
    /// tensor-parallel group together (each rank's all-reduces meet the others'). Real steps and the
    /// load-time warm-up both go through it; `on_routing` sees each MoE layer's routed ids.
    fn dispatch_gpu_step(
        &self,
        g: &gpu::GpuModel,
        inputs: &mut [gpu::forward::GpuSeqInput<'_>],
        times: &mut StepTimes,
        on_routing: impl FnMut(usize, &[u32]),
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let cpu_pool = self.cpu_pool.as_deref();
        match &self.tp {
            Some(group) => group.forward(g, &self.model, cpu_pool, inputs, times, on_routing),
            None => g.forward(&self.model, cpu_pool, inputs, times, on_routing),
        }
    }

    /// Bytes of expert weights prefetched ahead of their use so far (early-routing models on the CPU
    /// backend; 0 when prefetch is off).
    pub fn prefetched_expert_bytes(&self) -> u64 {
        self.prefetch.as_ref().map_or(0, |(p, _)| p.hinted_bytes())
    }

    fn validate(&self, batch: &[SeqInput<'_>]) -> Result<(), StepError> {
        let cfg = &self.model.config;
        for s in batch {
            if s.tokens.is_empty() {
                return Err(StepError::EmptyChunk);
            }
            if let Some(&id) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(StepError::TokenOutOfRange {
                    id,
                    vocab: cfg.vocab_size,
                });
            }
            let len = s.cache.len() + s.tokens.len();
            if len > cfg.max_position_embeddings {
                return Err(StepError::TooLong {
                    len,
                    max: cfg.max_position_embeddings,
                });
            }
            let layers = s.cache.recurrent().map(|r| r.num_layers());
            if cfg.linear_attention.is_some() && layers != Some(cfg.num_layers) {
                return Err(StepError::NoRecurrentState);
            }
            if !std::sync::Arc::ptr_eq(s.cache.pool(), &self.kv_blocks) {
                return Err(StepError::ForeignCache);
            }
            if s.cache.capacity() < len {
                return Err(StepError::NotReserved {
                    reserved: s.cache.capacity(),
                    needed: len,
                });
            }
        }
        Ok(())
    }

    fn run(&self, batch: &mut [SeqInput<'_>], all: bool) -> Result<Vec<Vec<f32>>, StepError> {
        self.validate(batch)?;
        Ok(self.pool.install(|| self.run_validated(batch, all)))
    }
}
