//! Early routing on the CUDA backend, for models whose router reads the layer input (SmallThinker): a
//! layer's routing is known before its attention runs, so the CPU can start reading the chosen DRAM
//! experts while the GPU computes attention, instead of learning them when it is done.
//!
//! With `--expert-prefetch-mib N` (> 0) such a layer's segment runs the router's top-k before attention
//! and publishes the routing alone into the mapped hand-off (flag EARLY); the rows follow after
//! attention (flag DOWN). The engine thread, which would otherwise spin on DOWN, sees EARLY and hands
//! the CPU worker pool (idle at that point of a decode step) up to N MiB of the chosen experts' packed
//! bytes to prefetch, in the order the expert kernels will read them (expert by expert in slot order,
//! gate and up tiles side by side); every chunk first looks at DOWN, so the prefetch stops the moment
//! the rows land and the layer's real work starts. Prefetched lines sit in the prefetching cores' L2
//! (1 MiB chunks per core at most on a 16-core pool with N = 16), where the kernels' first items find
//! them (from another core's L2 when a different worker takes the item: still no DRAM read).
//! With N = 0 (the default) routing happens at the usual point, after attention: the A/B of the two.
use super::handoff::Handoff;
use super::GpuModel;
use crate::model::MoeBlock;
use moe_kernels::cpu::WorkerPool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Longest the engine thread spins for a layer's early routing (it lands within a router GEMM and a
/// top-k of the layer's start; this only bounds a GPU that failed, which `wait_routing` reports).
const SPIN_LIMIT: Duration = Duration::from_millis(50);
/// Bytes of one prefetch item (half from gate, half from up): a few µs of one core's misses, so a
/// pool that sees DOWN stops within that.
const ITEM_BYTES: usize = 64 << 10;
const LINE: usize = 64;

/// One prefetch item: byte ranges (offset, length) of one expert's packed region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PrefetchItem {
    pub region: usize,
    pub gate: (usize, usize),
    pub up: (usize, usize),
}

/// The prefetch items for `regions` (the chosen experts' packed sizes, in the kernels' order) whose
/// gate block is `gate_bytes` long (up follows it): each expert's gate and up tiles from the start, in
/// steps of `ITEM_BYTES`, expert after expert, until `budget` bytes are planned.
pub(super) fn prefetch_plan(
    region_bytes: &[usize],
    gate_bytes: usize,
    budget: usize,
) -> Vec<PrefetchItem> {
    let half = ITEM_BYTES / 2;
    let mut items = Vec::new();
    let mut planned = 0;
    for (region, &len) in region_bytes.iter().enumerate() {
        // gate and up must both lie inside the region
        let g = gate_bytes.min(len / 2);
        let mut off = 0;
        while off < g && planned < budget {
            let n = half.min(g - off).min((budget - planned).div_ceil(2));
            items.push(PrefetchItem {
                region,
                gate: (off, n),
                up: (g + off, n),
            });
            planned += 2 * n;
            off += n;
        }
    }
    items
}

impl GpuModel {
    /// Whether MoE layers routing from the layer input publish their routing before attention.
    pub(super) fn early_routing(&self) -> bool {
        self.expert_prefetch_bytes > 0
    }

    /// Before a layer's routing wait: once its early routing landed, the pool prefetches the chosen
    /// DRAM experts (up to the budget) until the layer's rows land. Returns the bytes hinted, or
    /// `None` for layers without early routing or without packed DRAM experts.
    pub(super) fn prefetch_chosen_experts(
        &self,
        block: &MoeBlock,
        hand: &Handoff,
        routes: usize,
        pool: Option<&WorkerPool>,
    ) -> Option<u64> {
        let set = block.cpu_set.as_ref().filter(|_| self.early_routing())?;
        let port = &hand.port;
        let t = Instant::now();
        while !port.take_early_routing() {
            if t.elapsed() > SPIN_LIMIT {
                return None;
            }
            std::hint::spin_loop();
        }
        // SAFETY: EARLY was seen: the GPU wrote the routing before it and writes it again only after
        // this layer's CPU half raised its flag, which comes after this read.
        let mut ids: Vec<u32> = unsafe { port.ids.host(routes) }
            .iter()
            .map(|&e| e as u32)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        let regions: Vec<&[u8]> = ids.iter().filter_map(|&e| set.packed_expert(e)).collect();
        let sizes: Vec<usize> = regions.iter().map(|r| r.len()).collect();
        let plan = prefetch_plan(
            &sizes,
            set.packed_geometry().gate.bytes,
            self.expert_prefetch_bytes,
        );
        let hinted = AtomicU64::new(0);
        let item = |i: usize| {
            if port.published() {
                return; // the rows landed: the layer's real work starts now
            }
            let it = plan[i];
            let r = regions[it.region];
            for (off, len) in [it.gate, it.up] {
                r[off..off + len]
                    .chunks(LINE)
                    .for_each(|l| prefetch_line(l.as_ptr()));
            }
            hinted.fetch_add(2 * it.gate.1 as u64, Ordering::Relaxed);
        };
        match pool {
            // all items on the first group's threads (one NUMA node on the machines measured)
            Some(p) => {
                let mut items = vec![0; p.groups()];
                items[0] = plan.len();
                p.run(&items, &|_, i, _| item(i));
            }
            None => (0..plan.len()).for_each(item),
        }
        Some(hinted.into_inner())
    }
}

/// A prefetch hint for the cache line at `p` into L2 (the kernels' next reader may be another core;
/// L1 would only be churned); never faults, changes no data.
#[inline]
fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch is a hint: it never faults and has no architectural effect.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_walks_gate_and_up_side_by_side_expert_after_expert_within_budget() {
        // two experts of 3 blocks of 100 KiB (gate, up, down)
        let g = 100 << 10;
        let plan = prefetch_plan(&[3 * g, 3 * g], g, 300 << 10);
        let planned: usize = plan.iter().map(|p| p.gate.1 + p.up.1).sum();
        assert_eq!(planned, 300 << 10);
        // expert 0 first, whole (200 KiB of gate + up), then 100 KiB of expert 1
        let first: Vec<_> = plan.iter().filter(|p| p.region == 0).collect();
        assert_eq!(first.iter().map(|p| p.gate.1).sum::<usize>(), g);
        assert_eq!(first[0].gate, (0, 32 << 10));
        assert_eq!(first[0].up, (g, 32 << 10));
        assert!(plan.windows(2).all(|w| w[0].region <= w[1].region));
        let second: usize = plan
            .iter()
            .filter(|p| p.region == 1)
            .map(|p| p.gate.1)
            .sum();
        assert_eq!(second, 50 << 10);
        // nothing reaches past the gate / up blocks
        for p in &plan {
            assert!(p.gate.0 + p.gate.1 <= g && p.up.0 >= g && p.up.0 + p.up.1 <= 2 * g);
        }
    }

    #[test]
    fn plan_of_zero_budget_or_no_experts_is_empty() {
        assert!(prefetch_plan(&[3 << 20], 1 << 20, 0).is_empty());
        assert!(prefetch_plan(&[], 1 << 20, 1 << 20).is_empty());
    }

    #[test]
    fn plan_never_leaves_a_region() {
        // a gate size larger than half the region (a caller's mistake) is clamped
        for p in prefetch_plan(&[1000], 900, 1 << 20) {
            assert!(p.up.0 + p.up.1 <= 1000, "{p:?}");
        }
    }
}
