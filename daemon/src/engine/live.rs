//! Live re-placement wired into the engine: the policy ([`replacement`](super::replacement)) fed with
//! each step's routing, and the mover ([`gpu::moves`](super::gpu::moves)) run between steps.
//!
//! With a tensor-parallel group the policy sees the node (an expert is on the GPUs when one of them
//! holds it) and each GPU has its own mover: a move copies the admitted expert onto the GPU that
//! holds the one it evicts, so every GPU keeps the count its memory plan holds, and once swapped the
//! group's expert owners say so.
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
    /// One per GPU, in rank order.
    movers: Vec<ExpertMover>,
    /// The GPU tables' residency (on any GPU of the node) as of the last swap (kept here so recording
    /// needs no lock).
    resident: Vec<Vec<bool>>,
    /// Moves that failed to start or swap (logged once each, not retried until re-planned).
    pub failures: u64,
}

impl LiveState {
    /// `pinned[layer][expert]`: fixed by a placement rule.
    pub fn new(
        gpus: &[&GpuModel],
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
        let movers = gpus
            .iter()
            .map(|g| ExpertMover::new(g, host, slots))
            .collect::<anyhow::Result<_>>()?;
        // each mover bound its GPU's context: the engine thread drives rank 0's
        if let Some(g) = gpus.first() {
            g.dev.ctx.bind_to_thread()?;
        }
        Ok(Self {
            policy: LivePlacement::new(opts, &cfg.moe_layers, (experts, top_k), pinned, bytes),
            movers,
            resident: node_residency(gpus),
            failures: 0,
        })
    }

    pub fn record(&mut self, layer: usize, ids: &[u32]) {
        let row = self.resident.get(layer).map(Vec::as_slice).unwrap_or(&[]);
        self.policy.window.record(layer, ids, row);
    }

    /// Between two steps: swap in what landed, then start the moves the policy asks for.
    pub fn after_step(&mut self, gpus: &[&GpuModel], host: &Model) {
        let now = Instant::now();
        let landed = self.swap_landed(gpus, false);
        self.apply_landed(gpus, landed, now);
        for m in self.policy.after_step(now, &self.resident) {
            let r = holder(gpus, m.layer, m.evict);
            if let Err(e) = self.movers[r].start(host, m) {
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
            in_flight: self.movers.iter().map(ExpertMover::in_flight).sum(),
        }
    }

    /// Moves `admit` of `layer` onto the GPU in place of `evict` through the live path (copy on the side
    /// stream, swap) and waits for it (tests).
    pub fn move_now(&mut self, gpus: &[&GpuModel], host: &Model, mv: Move) -> anyhow::Result<()> {
        self.movers[holder(gpus, mv.layer, mv.evict)].start(host, mv)?;
        self.settle(gpus)?;
        anyhow::ensure!(
            self.resident.get(mv.layer).and_then(|r| r.get(mv.admit)) == Some(&true),
            "layer {}: expert {} did not arrive",
            mv.layer,
            mv.admit
        );
        Ok(())
    }

    /// Waits for the copies in flight and swaps them in; returns how many were swapped.
    pub fn settle(&mut self, gpus: &[&GpuModel]) -> anyhow::Result<usize> {
        let landed = self.swap_landed(gpus, true)?;
        let swapped = landed.iter().filter(|(_, r)| r.is_ok()).count();
        self.apply_landed(gpus, Ok(landed), Instant::now());
        Ok(swapped)
    }

    /// Swaps the landed copies of every GPU in (after waiting for all of them when `wait`), and
    /// records each successful swap in the group's expert owners.
    fn swap_landed(
        &mut self,
        gpus: &[&GpuModel],
        wait: bool,
    ) -> anyhow::Result<Vec<(Move, anyhow::Result<()>)>> {
        let mut all = Vec::new();
        for (mover, g) in self.movers.iter_mut().zip(gpus) {
            let landed = if wait {
                mover.finish_all(g)?
            } else {
                mover.swap_landed(g)?
            };
            for (m, r) in &landed {
                if r.is_ok() {
                    g.tp_expert_moved(m.layer, m.admit, m.evict);
                }
            }
            all.extend(landed);
        }
        Ok(all)
    }

    /// Tells the policy which moves landed (and whether their swaps happened) and re-reads the
    /// residency.
    fn apply_landed(
        &mut self,
        gpus: &[&GpuModel],
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
                    self.resident = node_residency(gpus);
                }
            }
            Err(e) => {
                self.failures += 1;
                tracing::warn!("live re-placement: checking copies failed: {e:#}");
            }
        }
    }
}

/// Per layer and expert: resident on one of `gpus`.
pub fn node_residency(gpus: &[&GpuModel]) -> Vec<Vec<bool>> {
    let mut node: Vec<Vec<bool>> = Vec::new();
    for g in gpus {
        let mine = g.residency();
        if node.is_empty() {
            node = mine;
            continue;
        }
        for (row, more) in node.iter_mut().zip(mine) {
            for (a, b) in row.iter_mut().zip(more) {
                *a |= b;
            }
        }
    }
    node
}

/// The GPU (rank) whose table holds `expert` of `layer` (0 when none does).
fn holder(gpus: &[&GpuModel], layer: usize, expert: usize) -> usize {
    gpus.iter()
        .position(|g| match g.layers.get(layer).map(|l| &l.ffn) {
            Some(super::gpu::GpuFfn::Moe(m)) => {
                m.experts.read().get(expert).is_some_and(Option::is_some)
            }
            _ => false,
        })
        .unwrap_or(0)
}
