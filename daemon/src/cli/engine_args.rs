//! Engine flags shared by `generate`, `serve` and `bench`.
use crate::engine::placement::{GpuExperts, PlacementStrategy};
use crate::engine::{Device, EngineOptions};
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// CPU worker threads (0 = all CPUs this process may use).
    #[arg(long, default_value_t = 0)]
    pub cpu_threads: usize,
    /// Backend for attention, dense layers and GPU experts: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
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
    /// GPU KV cache capacity in positions, all sequences together.
    #[arg(long, default_value_t = 65536)]
    pub kv_cache_tokens: usize,
    /// Steps with at least this many tokens prefill layer by layer on the GPU (DRAM experts streamed).
    #[arg(long, default_value_t = 1024)]
    pub gpu_prefill_threshold: usize,
}

impl EngineArgs {
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
        Ok(EngineOptions {
            cpu_threads: self.cpu_threads,
            device: self.device,
            gpu_experts,
            placement: self.expert_placement,
            placement_seed: self.placement_seed,
            routing_stats: self.routing_stats.clone(),
            record_routing: self.record_routing.is_some(),
            kv_cache_tokens: self.kv_cache_tokens,
            gpu_prefill_threshold: self.gpu_prefill_threshold,
        })
    }
}
