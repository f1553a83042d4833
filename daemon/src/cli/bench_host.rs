//! `bench decode`'s lines on the host's time outside the CPU experts and the GPU waits ("other host")
//! and on the CPU pool's regions (`engine::gpu::host_profile`).
use crate::engine::gpu::host_profile::HostProfile;
use crate::engine::StepTimes;

/// "Other host" per step split by where it went, then the CPU half's edges and the pool's regions;
/// `elapsed`: seconds of the `steps` steps as the caller timed them, `layers` per step.
pub(super) fn host_lines(t: &StepTimes, elapsed: f64, steps: usize, layers: usize) -> Vec<String> {
    let h = &t.host;
    if h.forward_s == 0.0 {
        return Vec::new();
    }
    let n = steps.max(1) as f64;
    let ms = |s: f64| s / n * 1e3;
    let per_layer = |s: f64| s / n / layers.max(1) as f64 * 1e6;
    let other = elapsed - t.cpu_experts_s - t.gpu_wait_s;
    let outside = elapsed - h.forward_s;
    let parts = [
        outside,
        h.setup_s,
        h.capture_walk_s,
        h.launch_s,
        h.routing_read_s,
        h.plan_s,
        h.tail_s,
    ];
    let rest = other - parts.iter().sum::<f64>();
    let mut lines = vec![format!(
        "  other host {:.3} ms/step = outside the GPU step {:.3} (engine: reservation, cache advance, live re-placement) + setup {:.3} (device route plan {:.3}) + capture walk {:.3} ({:.2} walks/step) + launches {:.3} ({:.1} µs/layer, overlapping the GPU) + routing read {:.3} ({:.1} µs/layer) + plan {:.3} ({:.1} µs/layer) + tail {:.3} + rest {:.3} ({:.1} µs/layer: loop bookkeeping)",
        ms(other),
        ms(outside),
        ms(h.setup_s),
        ms(h.route_plan_s),
        ms(h.capture_walk_s),
        h.walks as f64 / n,
        ms(h.launch_s),
        per_layer(h.launch_s),
        ms(h.routing_read_s),
        per_layer(h.routing_read_s),
        ms(h.plan_s),
        per_layer(h.plan_s),
        ms(h.tail_s),
        ms(rest),
        per_layer(rest),
    )];
    lines.push(format!(
        "  CPU half edges (inside CPU experts): before the kernels {:.1} µs/layer, after them to the flag {:.1} µs/layer",
        per_layer(h.half_in_s),
        per_layer(h.half_out_s),
    ));
    if let Some(l) = pool_line(h, n) {
        lines.push(l);
    }
    lines
}

/// The same split, short, for an A/B round's line (`bench_ab`): ms per step.
pub(super) fn host_suffix(t: &StepTimes, elapsed: f64, steps: usize) -> String {
    let h = &t.host;
    if h.forward_s == 0.0 {
        return String::new();
    }
    let ms = |s: f64| s / steps.max(1) as f64 * 1e3;
    let other = elapsed - t.cpu_experts_s - t.gpu_wait_s;
    let outside = elapsed - h.forward_s;
    let known = outside
        + h.setup_s
        + h.capture_walk_s
        + h.launch_s
        + h.routing_read_s
        + h.plan_s
        + h.tail_s;
    format!(
        "; other host: outside {:.3}, setup {:.3}, walk {:.3} ({:.2}/step), launches {:.3}, routing read {:.3}, plan {:.3}, tail {:.3}, rest {:.3} ms",
        ms(outside),
        ms(h.setup_s),
        ms(h.capture_walk_s),
        h.walks as f64 / steps.max(1) as f64,
        ms(h.launch_s),
        ms(h.routing_read_s),
        ms(h.plan_s),
        ms(h.tail_s),
        ms(other - known),
    )
}

/// The CPU pool's regions per step: how late the workers joined and how long the regions' tails were.
fn pool_line(h: &HostProfile, steps: f64) -> Option<String> {
    let p = &h.pool;
    if p.regions == 0 {
        return None;
    }
    let us = |s: f64, k: u64| s / k.max(1) as f64 * 1e6;
    Some(format!(
        "  CPU pool: {:.1} regions/step; a worker joined {:.2} µs after the region opened on average, the last one {:.2} µs; {:.2} of {:.1} workers per region missed it; the caller waited {:.2} µs per region for the last workers; tail (first thread out of items → last done) {:.2} µs of {:.2} µs per region, the caller last in {:.0}% of regions; {:.2} caller-thread changes/step",
        p.regions as f64 / steps,
        us(p.join_lag_s, p.joins),
        us(p.max_join_lag_s, p.regions),
        p.missed as f64 / p.regions as f64,
        (p.joins + p.missed) as f64 / p.regions as f64,
        us(p.close_wait_s, p.regions),
        us(p.tail_s, p.regions),
        us(p.busy_s, p.regions),
        100.0 * p.caller_last as f64 / p.regions as f64,
        p.caller_changes as f64 / steps,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use moe_kernels::cpu::pool::RegionStats;

    #[test]
    fn other_host_splits_into_its_parts_and_the_rest() {
        // 2 steps of 10 ms: 6 ms CPU experts, 2 ms GPU wait, so 2 ms other host
        let t = StepTimes {
            cpu_experts_s: 6e-3,
            gpu_wait_s: 2e-3,
            host: HostProfile {
                forward_s: 9e-3,
                setup_s: 0.2e-3,
                launch_s: 0.4e-3,
                tail_s: 0.2e-3,
                pool: RegionStats {
                    regions: 4,
                    joins: 60,
                    join_lag_s: 60e-6,
                    max_join_lag_s: 8e-6,
                    close_wait_s: 4e-6,
                    tail_s: 20e-6,
                    busy_s: 400e-6,
                    caller_last: 1,
                    ..RegionStats::default()
                },
                ..HostProfile::default()
            },
            ..StepTimes::default()
        };
        let lines = host_lines(&t, 10e-3, 2, 4);
        assert_eq!(lines.len(), 3);
        // other 1.0 ms/step = outside 0.5 + setup 0.1 + launches 0.2 + tail 0.1 + rest 0.1
        assert!(
            lines[0].starts_with("  other host 1.000 ms/step = outside the GPU step 0.500"),
            "{}",
            lines[0]
        );
        assert!(
            lines[0].contains("rest 0.100 (25.0 µs/layer"),
            "{}",
            lines[0]
        );
        assert!(
            lines[2].contains("2.0 regions/step; a worker joined 1.00 µs"),
            "{}",
            lines[2]
        );
        assert!(lines[2].contains("the last one 2.00 µs"), "{}", lines[2]);
        assert!(
            lines[2].contains("last done) 5.00 µs of 100.00 µs per region, the caller last in 25%"),
            "{}",
            lines[2]
        );
        assert!(host_lines(&StepTimes::default(), 1.0, 1, 1).is_empty());
    }
}
