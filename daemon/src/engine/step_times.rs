//! Where the time of one engine step went, as both backends measure it (`bench`, `/metrics`).

/// Where time went in a step. The CPU backend fills the expert figures; the CUDA backend all of them.
#[derive(Debug, Default, Clone)]
pub struct StepTimes {
    /// Host time spent waiting for the GPU at MoE hand-offs and the end of the step.
    pub gpu_wait_s: f64,
    /// Host time computing DRAM experts.
    pub cpu_experts_s: f64,
    /// Host time uploading expert weights for layerwise prefill.
    pub transfer_s: f64,
    /// Expert evaluations served by the GPU / all expert evaluations.
    pub gpu_expert_hits: u64,
    pub expert_hits: u64,
}
