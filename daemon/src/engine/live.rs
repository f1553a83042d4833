//! Live re-placement wired into the engine: the policy ([`replacement`](super::replacement)) fed with
//! each step's routing, and the mover ([`gpu::moves`](super::gpu::moves)) run between steps.
use super::gpu::moves::ExpertMover;
use super::gpu::GpuModel;
use super::replacement::{LiveOptions, LivePlacement, Move};
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
        // What one copy moves over PCIe: the packed expert (DMA of the CPU kernels' bytes), or bf16
        // gate, up and down where experts are kept as checkpoint tensors.
        let packed = host
            .layers
            .iter()
            .filter_map(|l| match &l.ffn {
                crate::model::Ffn::Moe(b) => b.cpu_set.as_ref(),
                _ => None,
            })
            .map(|s| s.packed_geometry().expert_bytes)
            .max();
        let bytes = packed.unwrap_or(3 * cfg.hidden_size * inter * 2);
        let slots = opts.max_in_flight.max(1);
        Ok(Self {
            policy: LivePlacement::new(opts, &cfg.moe_layers, (experts, top_k), pinned, bytes),
            mover: ExpertMover::new(gpu, host, slots)?,
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
        let landed = self.mover.swap_landed(gpu);
        self.apply_landed(gpu, landed, now);
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

    /// Moves `admit` of `layer` onto the GPU in place of `evict` through the live path (copy on the side
    /// stream, swap) and waits for it (tests).
    pub fn move_now(&mut self, gpu: &GpuModel, host: &Model, mv: Move) -> anyhow::Result<()> {
        self.mover.start(host, mv)?;
        self.settle(gpu)?;
        anyhow::ensure!(
            self.resident.get(mv.layer).and_then(|r| r.get(mv.admit)) == Some(&true),
            "layer {}: expert {} did not arrive",
            mv.layer,
            mv.admit
        );
        Ok(())
    }

    /// Waits for the copies in flight and swaps them in; returns how many were swapped.
    pub fn settle(&mut self, gpu: &GpuModel) -> anyhow::Result<usize> {
        let landed = self.mover.finish_all(gpu)?;
        let swapped = landed.iter().filter(|(_, r)| r.is_ok()).count();
        self.apply_landed(gpu, Ok(landed), Instant::now());
        Ok(swapped)
    }

    /// Tells the policy which moves landed (and whether their swaps happened) and re-reads the
    /// residency.
    fn apply_landed(
        &mut self,
        gpu: &GpuModel,
        landed: anyhow::Result<Vec<(Move, anyhow::Result<()>)>>,
        now: Instant,
    ) {
        match landed {
            Ok(landed) => {
                for (m, r) in &landed {
                    if let Err(e) = r {
                        self.failures += 1;
                        tracing::warn!("live re-placement: swap failed: {e:#}");
                    }
                    self.policy.finished(m, r.is_ok(), now);
                }
                if !landed.is_empty() {
                    self.resident = gpu.residency();
                }
            }
            Err(e) => {
                self.failures += 1;
                tracing::warn!("live re-placement: checking copies failed: {e:#}");
            }
        }
    }
}
