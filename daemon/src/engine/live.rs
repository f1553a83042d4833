//! Live re-placement wired into the engine: the policy ([`replacement`](super::replacement)) fed with
//! each step's routing, and the mover ([`gpu::moves`](super::gpu::moves)) run between steps.
use super::gpu::moves::ExpertMover;
use super::gpu::GpuModel;
use super::replacement::{LiveOptions, LivePlacement};
use crate::model::Model;
use std::time::Instant;

/// Figures for `/metrics` and `bench`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LiveStats {
    /// Per layer: share of recent expert activations served from the GPU (`None`: dense layer or no
    /// traffic yet).
    pub hit_ratio: Vec<Option<f64>>,
    pub moves_total: u64,
    pub moves_last_minute: usize,
    pub in_flight: usize,
}

pub struct LiveState {
    policy: LivePlacement,
    mover: ExpertMover,
    /// The GPU tables' residency as of the last swap (kept here so recording needs no lock).
    resident: Vec<Vec<bool>>,
    /// Moves that failed to start or swap (logged once each, not retried until re-planned).
    pub failures: u64,
}

impl LiveState {
    /// `pinned[layer][expert]`: fixed by a placement rule.
    pub fn new(
        gpu: &GpuModel,
        host: &Model,
        opts: LiveOptions,
        pinned: Vec<Vec<bool>>,
    ) -> anyhow::Result<Self> {
        let cfg = &host.config;
        let (experts, top_k, inter) = cfg.moe.as_ref().map_or((0, 1, 0), |m| {
            (m.num_experts, m.top_k, m.expert_intermediate)
        });
        // bf16 gate, up and down: what one copy moves over PCIe
        let bytes = 3 * cfg.hidden_size * inter * 2;
        Ok(Self {
            policy: LivePlacement::new(opts, &cfg.moe_layers, (experts, top_k), pinned, bytes),
            mover: ExpertMover::new(gpu)?,
            resident: gpu.residency(),
            failures: 0,
        })
    }

    pub fn record(&mut self, layer: usize, ids: &[u32]) {
        let row = self.resident.get(layer).map(Vec::as_slice).unwrap_or(&[]);
        self.policy.window.record(layer, ids, row);
    }

    /// Between two steps: swap in what landed, then start the moves the policy asks for.
    pub fn after_step(&mut self, gpu: &GpuModel, host: &Model) {
        let now = Instant::now();
        match self.mover.swap_landed(gpu) {
            Ok(done) => {
                for m in &done {
                    self.policy.finished(m, true, now);
                }
                if !done.is_empty() {
                    self.resident = gpu.residency();
                }
            }
            Err(e) => {
                self.failures += 1;
                tracing::warn!("live re-placement: swap failed: {e:#}");
                self.resident = gpu.residency();
            }
        }
        for m in self.policy.after_step(now, &self.resident) {
            if let Err(e) = self.mover.start(host, m) {
                self.failures += 1;
                tracing::warn!("live re-placement: {e:#}");
                self.policy.finished(&m, false, now);
            }
        }
    }

    pub fn stats(&mut self) -> LiveStats {
        let now = Instant::now();
        LiveStats {
            hit_ratio: (0..self.resident.len())
                .map(|l| self.policy.window.hit_ratio(l))
                .collect(),
            moves_total: self.policy.moves_total,
            moves_last_minute: self.policy.moves_last_minute(now),
            in_flight: self.mover.in_flight(),
        }
    }

    /// Waits for the copies in flight and swaps them in.
    pub fn settle(&mut self, gpu: &GpuModel) -> anyhow::Result<usize> {
        let done = self.mover.finish_all(gpu)?;
        let now = Instant::now();
        for m in &done {
            self.policy.finished(m, true, now);
        }
        self.resident = gpu.residency();
        Ok(done.len())
    }
}
