//! `bench decode --cpu-replay N`: the CPU experts of the engine's decode steps timed again without
//! the GPU, in the same process, on the same packed experts and worker pool: what the engine's step
//! adds around the expert kernels, against what the kernels reach alone. Each of N rounds decodes
//! `--steps` steps of the sequences of the last batch size (the routing of every MoE layer recorded
//! on the way, `Engine::set_routing_override` leaving it as it is), then calls the kernels again,
//! one layer after the other as the step did:
//! - `recorded`: the step's own layer calls back to back (its routings, its experts, no GPU);
//! - `recorded + gap`: the same with the caller spinning between two layers for as long as the
//!   step's hand-off took (sum raised → next routing seen), the workers spinning as in the step;
//! - `fixed`: one routing for every call, cycling the first 16 MoE layers, as `cpu_moe_bench` does:
//!   the same experts come back every 16 calls, so a part of them can still be in the L3;
//! - `fresh`: a new random routing for every call over every MoE layer (no expert comes back).
//!
//! The variants' order alternates between rounds. Each is reported in ms per layer call (the mean, as
//! the step's split reports it, and the pool regions' median, p90 and max: a few slow calls move the
//! mean), the weight bytes of the distinct experts it read per second, % of the DRAM probe of the same
//! process, the pool's tail (first thread out of items → last done) per call, and what the OS did
//! meanwhile: involuntary context switches of the pools' threads (`moe-cpu-*`, from
//! `/proc/self/task`) and interrupts (`/proc/interrupts`, the busiest CPU named).
use super::bench::decode_steps;
use crate::engine::{Engine, SeqCache};
use crate::model::Ffn;
use moe_kernels::cpu::moe::CpuExpertSet;
use moe_kernels::cpu::pool::RegionStats;
use moe_kernels::cpu::WorkerPool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// MoE layers the `fixed` variant cycles (`cpu_moe_bench --layers 16` of the decode A/B runs).
const FIXED_LAYERS: usize = 16;

/// One MoE layer's call of a recorded step: the layer and its routed ids (tokens × top-k).
struct Call {
    layer: usize,
    ids: Vec<u32>,
}

/// A variant's calls timed: seconds, calls, bytes of the distinct experts each call read, the pool's
/// regions over them (totals, and each one's time), and the OS's counters over the same span.
#[derive(Default)]
struct Timing {
    secs: f64,
    calls: usize,
    bytes: f64,
    pool: RegionStats,
    regions: Vec<f64>,
    os: OsNoise,
}

/// What the OS did to the process over a span: involuntary context switches of its pool threads,
/// interrupts on all CPUs and on the busiest one (`None` where /proc does not say).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct OsNoise {
    switches: Option<u64>,
    irqs: Option<u64>,
    busiest: Option<(usize, u64)>,
}

/// The counters `OsNoise` is the difference of.
struct OsCounters {
    switches: Option<u64>,
    irqs_per_cpu: Option<Vec<u64>>,
}

impl OsCounters {
    fn now() -> Self {
        OsCounters {
            switches: pool_thread_switches(),
            irqs_per_cpu: std::fs::read_to_string("/proc/interrupts")
                .ok()
                .map(|t| irqs_per_cpu(&t)),
        }
    }

    fn since(&self, earlier: &OsCounters) -> OsNoise {
        let switches = match (self.switches, earlier.switches) {
            (Some(a), Some(b)) => Some(a.saturating_sub(b)),
            _ => None,
        };
        let per_cpu: Option<Vec<u64>> = match (&self.irqs_per_cpu, &earlier.irqs_per_cpu) {
            (Some(a), Some(b)) if a.len() == b.len() => {
                Some(a.iter().zip(b).map(|(x, y)| x.saturating_sub(*y)).collect())
            }
            _ => None,
        };
        OsNoise {
            switches,
            irqs: per_cpu.as_ref().map(|v| v.iter().sum()),
            busiest: per_cpu.and_then(|v| v.iter().copied().enumerate().max_by_key(|&(_, n)| n)),
        }
    }
}

/// Involuntary context switches summed over this process's threads named `moe-cpu-*` (the expert
/// pool's workers and the engine's rayon threads, which run the GPU step).
fn pool_thread_switches() -> Option<u64> {
    let mut sum = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("moe-cpu-") {
            continue;
        }
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        sum += nonvoluntary_switches(&status).unwrap_or(0);
    }
    Some(sum)
}

/// `nonvoluntary_ctxt_switches` of a `/proc/.../status` text.
fn nonvoluntary_switches(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("nonvoluntary_ctxt_switches:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Interrupts per CPU summed over the lines of a `/proc/interrupts` text (its header names the CPUs;
/// each line's first that many numbers are per CPU).
fn irqs_per_cpu(text: &str) -> Vec<u64> {
    let mut lines = text.lines();
    let cpus = lines.next().map_or(0, |h| h.split_whitespace().count());
    let mut sum = vec![0u64; cpus];
    for l in lines {
        let Some((_, rest)) = l.split_once(':') else {
            continue;
        };
        for (s, v) in sum.iter_mut().zip(rest.split_whitespace()) {
            match v.parse::<u64>() {
                Ok(n) => *s += n,
                Err(_) => break, // the line's description (or a line without per-CPU counts)
            }
        }
    }
    sum
}

/// `; first MoE layer of a step: median X ms, the others Y` from the regions of `steps` steps in
/// order (the first layer follows the step's start, where the engine's threads change hands), or
/// nothing when the regions do not divide into the steps.
fn first_layer_split(regions: &[f64], steps: usize) -> String {
    if steps == 0 || regions.len() < 2 * steps || !regions.len().is_multiple_of(steps) {
        return String::new();
    }
    let per_step = regions.len() / steps;
    let (mut first, mut rest): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
    for (i, &r) in regions.iter().enumerate() {
        if i % per_step == 0 {
            first.push(r);
        } else {
            rest.push(r);
        }
    }
    first.sort_by(f64::total_cmp);
    rest.sort_by(f64::total_cmp);
    format!(
        "; first MoE layer of a step: median {:.3} ms, max {:.3}; the others: median {:.3}, max {:.3}",
        quantile(&first, 0.5) * 1e3,
        quantile(&first, 1.0) * 1e3,
        quantile(&rest, 0.5) * 1e3,
        quantile(&rest, 1.0) * 1e3
    )
}

/// The value at quantile `q` (0..=1) of a sorted non-empty list.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

impl Timing {
    fn ms_per_call(&self) -> f64 {
        self.secs / self.calls.max(1) as f64 * 1e3
    }

    fn gbs(&self) -> f64 {
        self.bytes / self.secs.max(1e-12) / 1e9
    }

    /// `ms/call (GB/s, % of the probe); regions' distribution; tail; OS noise`.
    fn describe(&self, probe_gbs: f64) -> String {
        let per_call = |s: f64| s / self.pool.regions.max(1) as f64 * 1e6;
        let per_call_n = |n: u64| n as f64 / self.calls.max(1) as f64;
        let mut d = format!(
            "{:.3} ms/layer ({:.1} GB/s, {:.0}% of the probe)",
            self.ms_per_call(),
            self.gbs(),
            100.0 * self.gbs() / probe_gbs,
        );
        if !self.regions.is_empty() {
            let mut r = self.regions.clone();
            r.sort_by(f64::total_cmp);
            let med = quantile(&r, 0.5);
            let slow = r.iter().filter(|&&x| x > 1.5 * med).count();
            d += &format!(
                "; regions median {:.3} ({:.0}% of the probe), p90 {:.3}, max {:.3} ms, {slow} of {} over 1.5x the median",
                med * 1e3,
                100.0 * self.bytes / self.calls.max(1) as f64 / med / 1e9 / probe_gbs,
                quantile(&r, 0.9) * 1e3,
                quantile(&r, 1.0) * 1e3,
                r.len()
            );
        }
        d += &format!(
            "; pool tail {:.1} µs of {:.1} µs per region, caller last in {:.0}%",
            per_call(self.pool.tail_s),
            per_call(self.pool.busy_s),
            100.0 * self.pool.caller_last as f64 / self.pool.regions.max(1) as f64,
        );
        if let Some(n) = self.os.switches {
            d += &format!("; involuntary switches {:.2}/call", per_call_n(n));
        }
        if let (Some(n), Some((cpu, m))) = (self.os.irqs, self.os.busiest) {
            d += &format!(
                "; interrupts {:.2}/call (most on CPU {cpu}: {:.2}/call)",
                per_call_n(n),
                per_call_n(m)
            );
        }
        d
    }
}

/// The variants of a round, in their order of the first round.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    Recorded,
    Gap,
    Fixed,
    Fresh,
}

const VARIANTS: [Variant; 4] = [
    Variant::Recorded,
    Variant::Gap,
    Variant::Fixed,
    Variant::Fresh,
];

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Variant::Recorded => "recorded",
            Variant::Gap => "recorded + gap",
            Variant::Fixed => "fixed",
            Variant::Fresh => "fresh",
        }
    }
}

/// What the replay reads of the engine: the pool, each MoE layer's packed set, top-k, hidden.
struct Replay<'e> {
    pool: &'e WorkerPool,
    sets: Vec<Option<&'e CpuExpertSet>>,
    top_k: usize,
    hidden: usize,
}

impl<'e> Replay<'e> {
    fn of(engine: &'e Engine) -> anyhow::Result<Self> {
        let pool = engine
            .cpu_expert_pool()
            .filter(|_| engine.on_gpu())
            .ok_or_else(|| {
                anyhow::anyhow!("--cpu-replay needs the CUDA backend's CPU expert pool")
            })?;
        let model = engine.model();
        let cfg = &model.config;
        let top_k = cfg
            .moe
            .as_ref()
            .map(|m| m.top_k)
            .ok_or_else(|| anyhow::anyhow!("--cpu-replay needs an MoE model"))?;
        let sets: Vec<Option<&CpuExpertSet>> = model
            .layers
            .iter()
            .map(|l| match &l.ffn {
                Ffn::Moe(b) => b.cpu_set.as_ref(),
                _ => None,
            })
            .collect();
        anyhow::ensure!(
            sets.iter().any(Option::is_some),
            "--cpu-replay: no MoE layer has experts packed for the CPU kernels"
        );
        Ok(Replay {
            pool,
            sets,
            top_k,
            hidden: cfg.hidden_size,
        })
    }

    /// MoE layers with a packed set, in order.
    fn moe_layers(&self) -> Vec<usize> {
        (0..self.sets.len())
            .filter(|&l| self.sets[l].is_some())
            .collect()
    }

    /// Times `calls` one after the other, spinning `gap` between two.
    fn time(&self, calls: &[Call], gap: Duration) -> anyhow::Result<Timing> {
        let rows = calls.iter().map(|c| c.ids.len()).max().unwrap_or(0);
        let tokens = rows / self.top_k.max(1);
        let x: Vec<f32> = (0..tokens * self.hidden)
            .map(|i| ((i * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let w = vec![1.0 / self.top_k as f32; rows];
        let mut out = vec![0f32; tokens * self.hidden];
        let mut t = Timing::default();
        let before = self.pool.region_stats();
        let os = OsCounters::now();
        self.pool.set_region_log(true);
        self.pool.take_region_log();
        for (i, c) in calls.iter().enumerate() {
            let Some(set) = self.sets[c.layer] else {
                continue;
            };
            if i > 0 && !gap.is_zero() {
                let until = Instant::now() + gap;
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
            }
            let n = c.ids.len() / self.top_k;
            let started = Instant::now();
            set.forward(
                self.pool,
                &x[..n * self.hidden],
                &c.ids,
                &w[..c.ids.len()],
                self.top_k,
                &mut out[..n * self.hidden],
            )?;
            t.secs += started.elapsed().as_secs_f64();
            t.calls += 1;
            t.bytes += distinct_held(set, &c.ids) as f64 * set.bytes_per_expert() as f64;
        }
        t.pool = self.pool.region_stats().since(&before);
        t.regions = self.pool.take_region_log();
        self.pool.set_region_log(false);
        t.os = OsCounters::now().since(&os);
        Ok(t)
    }

    /// `cpu_moe_bench`'s pattern: the first recorded routing for every call, cycling the first
    /// `FIXED_LAYERS` MoE layers, as many calls as `calls`.
    fn fixed(&self, calls: &[Call]) -> Vec<Call> {
        let layers = self.moe_layers();
        let cycle = &layers[..layers.len().min(FIXED_LAYERS)];
        let ids = calls.first().map(|c| c.ids.clone()).unwrap_or_default();
        (0..calls.len())
            .map(|i| Call {
                layer: cycle[i % cycle.len()],
                ids: ids.clone(),
            })
            .collect()
    }

    /// A new random routing (distinct experts per token, of those the layer's set holds) for every
    /// call, over the recorded calls' layers and token counts.
    fn fresh(&self, calls: &[Call], seed: u64) -> Vec<Call> {
        let mut g = seed | 1;
        let mut next = move || {
            // xorshift64: enough to pick experts
            g ^= g << 13;
            g ^= g >> 7;
            g ^= g << 17;
            g
        };
        calls
            .iter()
            .filter_map(|c| {
                let held = self.sets[c.layer]?.expert_ids();
                let k = self.top_k.min(held.len());
                let mut ids = Vec::with_capacity(c.ids.len());
                for _ in 0..c.ids.len() / self.top_k {
                    let start = ids.len();
                    while ids.len() < start + k {
                        let e = held[(next() % held.len() as u64) as usize];
                        if !ids[start..].contains(&e) {
                            ids.push(e);
                        }
                    }
                    // a set of fewer than top-k experts: its first again (rows of one expert)
                    ids.resize(start + self.top_k, held[0]);
                }
                Some(Call {
                    layer: c.layer,
                    ids,
                })
            })
            .collect()
    }
}

/// Distinct ids of `ids` that `set` holds.
fn distinct_held(set: &CpuExpertSet, ids: &[u32]) -> usize {
    let mut d: Vec<u32> = ids.iter().copied().filter(|&e| set.holds(e)).collect();
    d.sort_unstable();
    d.dedup();
    d.len()
}

/// The replay's rounds (see the module docs), on the sequences `--ab` would continue.
pub(super) fn run(
    engine: &Engine,
    (caches, next): (&mut [SeqCache], &mut Vec<u32>),
    rounds: usize,
    steps: usize,
    probe_gbs: f64,
) -> anyhow::Result<()> {
    let replay = Replay::of(engine)?;
    let mut engine_ms = Vec::with_capacity(rounds);
    let mut ms: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
    for round in 0..rounds {
        let recorded = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&recorded);
        engine.set_routing_override(Some(Box::new(move |layer, ids: &mut [u32]| {
            sink.lock().unwrap_or_else(|e| e.into_inner()).push(Call {
                layer,
                ids: ids.to_vec(),
            });
        })));
        let os = OsCounters::now();
        replay.pool.set_region_log(true);
        replay.pool.take_region_log();
        let r = decode_steps(engine, caches, next, 0, steps);
        engine.set_routing_override(None);
        replay.pool.set_region_log(false);
        let regions = replay.pool.take_region_log();
        let os = OsCounters::now().since(&os);
        let (_, split) = r?;
        let calls = std::mem::take(&mut *recorded.lock().unwrap_or_else(|e| e.into_inner()));
        anyhow::ensure!(
            !calls.is_empty(),
            "--cpu-replay: the decode steps handed no MoE layer to the host (every expert on the GPU?)"
        );
        let step = Timing {
            secs: split.cpu_experts_s,
            calls: split.cpu_regions.calls as usize,
            bytes: split.dram_expert_bytes as f64,
            pool: split.host.pool,
            regions,
            os,
        };
        let p = &split.handoff;
        let gap = Duration::from_secs_f64(p.round_trip_s / p.layers.max(1) as f64);
        println!(
            "CPU replay round {round}: engine step {} ({} layer calls; hand-off gap {:.1} µs per layer{})",
            step.describe(probe_gbs),
            step.calls,
            gap.as_secs_f64() * 1e6,
            first_layer_split(&step.regions, steps)
        );
        engine_ms.push(step.ms_per_call());
        let order: Vec<usize> = if round % 2 == 0 {
            (0..VARIANTS.len()).collect()
        } else {
            (0..VARIANTS.len()).rev().collect()
        };
        for i in order {
            let v = VARIANTS[i];
            let t = match v {
                Variant::Recorded => replay.time(&calls, Duration::ZERO)?,
                Variant::Gap => replay.time(&calls, gap)?,
                Variant::Fixed => replay.time(&replay.fixed(&calls), Duration::ZERO)?,
                Variant::Fresh => replay.time(
                    &replay.fresh(&calls, 0x9E37_79B9_7F4A_7C15 ^ round as u64),
                    Duration::ZERO,
                )?,
            };
            println!(
                "CPU replay round {round}: {} {}",
                v.label(),
                t.describe(probe_gbs)
            );
            ms[i].push(t.ms_per_call());
        }
    }
    let med = super::bench_ab::median;
    let base = med(&engine_ms);
    let mut line =
        format!("CPU replay, {rounds} rounds, median ms per layer call: engine step {base:.3}");
    for (v, m) in VARIANTS.iter().zip(&ms) {
        let m = med(m);
        line += &format!(
            "; {} {m:.3} ({:+.1}% vs the step)",
            v.label(),
            (base / m - 1.0) * 100.0
        );
    }
    println!("{line}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_report_rate_share_and_tail() {
        let t = Timing {
            secs: 2e-3,
            calls: 4,
            bytes: 200e6,
            pool: RegionStats {
                regions: 4,
                tail_s: 40e-6,
                busy_s: 2e-3,
                caller_last: 1,
                ..RegionStats::default()
            },
            ..Timing::default()
        };
        assert_eq!(t.ms_per_call(), 0.5);
        assert!((t.gbs() - 100.0).abs() < 1e-9);
        let d = t.describe(125.0);
        assert!(
            d.starts_with("0.500 ms/layer (100.0 GB/s, 80% of the probe"),
            "{d}"
        );
        assert!(
            d.contains("tail 10.0 µs of 500.0 µs per region, caller last in 25%"),
            "{d}"
        );
        assert_eq!(Timing::default().ms_per_call(), 0.0);
        let with_regions = Timing {
            regions: vec![0.4e-3, 0.5e-3, 0.5e-3, 1.0e-3],
            os: OsNoise {
                switches: Some(2),
                irqs: Some(8),
                busiest: Some((3, 4)),
            },
            ..t
        };
        let d = with_regions.describe(125.0);
        assert!(d.contains("regions median 0.500 (80% of the probe), p90 1.000, max 1.000 ms, 1 of 4 over 1.5x"), "{d}");
        assert!(d.contains("involuntary switches 0.50/call"), "{d}");
        assert!(
            d.contains("interrupts 2.00/call (most on CPU 3: 1.00/call)"),
            "{d}"
        );
    }

    #[test]
    fn proc_counters_parse() {
        let status =
            "Name:\tmoe-cpu-3\nvoluntary_ctxt_switches:\t10\nnonvoluntary_ctxt_switches:\t7\n";
        assert_eq!(nonvoluntary_switches(status), Some(7));
        assert_eq!(nonvoluntary_switches("Name: x\n"), None);
        let irqs = "           CPU0       CPU1\n  0:         40          0   IO-APIC    2-edge      timer\nLOC:       1000       2000   Local timer interrupts\nERR:          0\n";
        assert_eq!(irqs_per_cpu(irqs), vec![1040, 2000]);
        let a = OsCounters {
            switches: Some(10),
            irqs_per_cpu: Some(vec![5, 9]),
        };
        let b = OsCounters {
            switches: Some(4),
            irqs_per_cpu: Some(vec![1, 2]),
        };
        let n = a.since(&b);
        assert_eq!(
            (n.switches, n.irqs, n.busiest),
            (Some(6), Some(11), Some((1, 7)))
        );
        assert_eq!(quantile(&[1.0, 2.0, 3.0], 0.5), 2.0);
    }

    #[test]
    fn the_first_layer_of_each_step_is_split_out() {
        // 2 steps of 3 layers: the first of each slow
        let r = [2e-3, 1e-3, 1e-3, 3e-3, 1e-3, 1e-3];
        let s = first_layer_split(&r, 2);
        assert_eq!(
            s,
            "; first MoE layer of a step: median 3.000 ms, max 3.000; the others: median 1.000, max 1.000"
        );
        assert_eq!(first_layer_split(&r[..5], 2), "");
        assert_eq!(first_layer_split(&r, 0), "");
    }
}
