//! Where a GPU step's host time goes besides the CPU experts and the waits for the GPU (what
//! `bench decode` prints as "other host"), clocked with `Instant` at a few points of the step (a clock
//! read is tens of ns; a decode layer has fewer than ten).
//!
//! In a pipelined decode step the host's launches of layer l + 1 happen while the GPU runs layer l's
//! add and layer l + 1's segment, so they cost the step nothing unless they take longer than that GPU
//! work (the hand-off profile, `handoff::HandoffProfile`, shows both). What does cost it: the step's
//! setup before the first segment is enqueued (the GPU is idle), the work between a layer's routing
//! landing and its CPU experts starting, the CPU half's edges around the kernels, the tail after the
//! logits landed, and the engine's work around `GpuModel::forward`.
use moe_kernels::cpu::pool::RegionStats;
use std::time::Instant;

/// Sums over the steps measured (seconds).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostProfile {
    /// `GpuModel::forward` from start to return (the caller's time around it is the engine's).
    pub forward_s: f64,
    /// From the step's start to its first layer: locks, index upload, embedding, the route plan
    /// (the capture walk left out).
    pub setup_s: f64,
    /// Of the setup: the device-routed layers' route plan (`routed::plan_routes`: each MoE layer's
    /// resident-address table compared with its expert table).
    pub route_plan_s: f64,
    /// The pre-step capture walk of pipelined graph steps (`forward::capture_segments`), and the
    /// steps that walked (a step whose row count and placement were walked before skips it).
    pub capture_walk_s: f64,
    pub walks: u64,
    /// Enqueueing inside the layer loop: segments (graph replays or eager launches), the GPU halves
    /// enqueued before their routing, dense MLPs. Overlaps the GPU's own work in pipelined steps.
    pub launch_s: f64,
    /// After a layer's routing landed: copying it out, the benchmarks' override, the routing hook
    /// (routing statistics, live re-placement's window).
    pub routing_read_s: f64,
    /// Then the dispatch plan, its statistics, the GPU experts' launches (mixed layers) and the
    /// GPU's wait-and-add launch (layers not prelaunched), up to the CPU half being handed back.
    pub plan_s: f64,
    /// The CPU half from its start to the expert kernels (the sum zeroed or the deferred sum
    /// copied into the port), and from the kernels' return to the flag raised.
    pub half_in_s: f64,
    pub half_out_s: f64,
    /// After the last layer: the final norm and lm_head launches and the logits handed back (the
    /// wait for the GPU left out).
    pub tail_s: f64,
    /// The CPU pool's regions in these steps (worker wake-up and the regions' tails).
    pub pool: RegionStats,
}

impl HostProfile {
    pub fn add(&mut self, o: &HostProfile) {
        self.forward_s += o.forward_s;
        self.setup_s += o.setup_s;
        self.route_plan_s += o.route_plan_s;
        self.capture_walk_s += o.capture_walk_s;
        self.walks += o.walks;
        self.launch_s += o.launch_s;
        self.routing_read_s += o.routing_read_s;
        self.plan_s += o.plan_s;
        self.half_in_s += o.half_in_s;
        self.half_out_s += o.half_out_s;
        self.tail_s += o.tail_s;
        self.pool.add(&o.pool);
    }
}

/// Seconds from `t` to now, and now (for the next lap).
pub(super) fn lap(t: &mut Instant) -> f64 {
    let now = Instant::now();
    let s = now.saturating_duration_since(*t).as_secs_f64();
    *t = now;
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_add_field_by_field_and_laps_move_on() {
        let p = HostProfile {
            forward_s: 1.0,
            setup_s: 0.1,
            route_plan_s: 0.05,
            capture_walk_s: 0.01,
            walks: 1,
            launch_s: 0.2,
            routing_read_s: 0.02,
            plan_s: 0.03,
            half_in_s: 0.004,
            half_out_s: 0.005,
            tail_s: 0.06,
            pool: RegionStats {
                regions: 3,
                joins: 40,
                ..RegionStats::default()
            },
        };
        let mut sum = HostProfile::default();
        sum.add(&p);
        sum.add(&p);
        assert_eq!((sum.forward_s, sum.walks, sum.pool.regions), (2.0, 2, 6));
        assert_eq!((sum.tail_s, sum.pool.joins), (0.12, 80));
        assert_eq!(sum.route_plan_s, 0.1);
        let t0 = Instant::now();
        let mut t = t0;
        let s = lap(&mut t);
        assert!(s >= 0.0 && t >= t0);
    }
}
