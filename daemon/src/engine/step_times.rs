//! Where the time of one engine step went, as both backends measure it (`bench`, `/metrics`).

/// Where time went in a step. The CPU backend fills the expert, attention, MLP and head figures; the CUDA
/// backend the expert, wait and transfer figures.
#[derive(Debug, Default, Clone)]
pub struct StepTimes {
    /// Host time spent waiting for the GPU at MoE hand-offs and the end of the step.
    pub gpu_wait_s: f64,
    /// Host time computing DRAM experts (routing included).
    pub cpu_experts_s: f64,
    /// Host time uploading expert weights for layerwise prefill.
    pub transfer_s: f64,
    /// CPU backend: attention blocks, projections included.
    pub attention_s: f64,
    /// CPU backend: final norm and lm_head.
    pub head_s: f64,
    /// CPU backend: dense MLP blocks (dense models' FFN; not shared experts, which count as experts).
    pub dense_mlp_s: f64,
    /// Expert evaluations served by the GPU / all expert evaluations.
    pub gpu_expert_hits: u64,
    pub expert_hits: u64,
    /// CUDA backend, early routing: bytes of chosen DRAM experts prefetched while attention ran.
    pub prefetched_bytes: u64,
    /// CUDA backend, early routing: MoE layers whose routing the host saw before their attention ended.
    pub early_routed_layers: u64,
    /// CUDA backend: MoE layers whose resident experts were computed from the routing on the device
    /// (`gpu::routed`), without the host's dispatch plan.
    pub device_routed_layers: u64,
    /// CUDA backend: the CPU expert kernels' time by region (`CpuExpertSet::forward_timed`).
    pub cpu_regions: moe_kernels::cpu::moe::RegionTimes,
    /// CUDA backend, split steps (`gpu::split`): routed DRAM experts streamed to the GPU / left to
    /// the CPU, over the step's layers.
    pub split_gpu_experts: u64,
    pub split_cpu_experts: u64,
    /// Decode split (`decode_split`): the host's wait for the GPU's share after its CPU experts.
    pub split_gpu_wait_s: f64,
    /// CUDA backend: distinct DRAM experts the CPU kernels read (per layer, summed over layers) and
    /// their packed bytes.
    pub dram_experts_read: u64,
    pub dram_expert_bytes: u64,
    /// CUDA backend, decode hand-offs: where the time between two layers' CPU experts went.
    pub handoff: crate::engine::gpu::handoff::HandoffProfile,
    /// CUDA backend: the host's time outside the CPU experts and the GPU waits, by where it went.
    pub host: crate::engine::gpu::host_profile::HostProfile,
}

impl StepTimes {
    /// Adds another step's figures to these (totals over several steps).
    pub fn accumulate(&mut self, o: &StepTimes) {
        self.gpu_wait_s += o.gpu_wait_s;
        self.cpu_experts_s += o.cpu_experts_s;
        self.transfer_s += o.transfer_s;
        self.attention_s += o.attention_s;
        self.head_s += o.head_s;
        self.dense_mlp_s += o.dense_mlp_s;
        self.gpu_expert_hits += o.gpu_expert_hits;
        self.expert_hits += o.expert_hits;
        self.prefetched_bytes += o.prefetched_bytes;
        self.early_routed_layers += o.early_routed_layers;
        self.device_routed_layers += o.device_routed_layers;
        self.cpu_regions.add(&o.cpu_regions);
        self.split_gpu_experts += o.split_gpu_experts;
        self.split_cpu_experts += o.split_cpu_experts;
        self.split_gpu_wait_s += o.split_gpu_wait_s;
        self.dram_experts_read += o.dram_experts_read;
        self.dram_expert_bytes += o.dram_expert_bytes;
        self.handoff.add(&o.handoff);
        self.host.add(&o.host);
    }
}
