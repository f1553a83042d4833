//! `bench decode --cpu-replay N`: the CPU experts of the engine's decode steps timed again without
//! the GPU, in the same process, on the same packed experts and worker pool: what the engine's step
//! adds around the expert kernels, against what the kernels reach alone. Each of N rounds decodes
//! `--steps` steps of the sequences of the last batch size (the routing of every MoE layer recorded
//! on the way through `Engine::set_routing_override`: left as the model chose it in even rounds,
//! replaced by a uniform random routing in odd ones), then calls the kernels again, one layer after
//! the other as the step did:
//! - `recorded`: the step's own layer calls back to back (its routings, its experts, no GPU);
//! - `recorded + gap`: the same with the caller spinning between two layers for as long as the
//!   step's hand-off took (sum raised → next routing seen), the workers spinning as in the step;
//! - `fixed`: one routing for every call, cycling the first 16 MoE layers, as `cpu_moe_bench` does:
//!   the same experts come back every 16 calls, so a part of them can still be in the L3;
//! - `fresh`: a new uniform random routing for every call over every MoE layer (no expert comes
//!   back); with GPU-resident experts a call computes the drawn experts that live in DRAM;
//! - `fresh, top-k in DRAM`: the same with each token's experts drawn from those in DRAM (with
//!   GPU-resident experts: calls of an all-DRAM layer's size on the same sets, for comparison);
//! - `read anchor of the recorded calls`: the recorded calls' experts read by the pool with the DRAM
//!   probe's loop instead of computed (`cpu_moe_bench`'s `read` row): the limit of those pages.
//!
//! Each timing is also split by how many distinct DRAM experts a call read (a mixed layer's count
//! varies from call to call), with a line through the calls: the cost of a call whatever it reads,
//! and of each expert at the margin.
//!
//! A random-weight checkpoint's router may choose nearly the same experts step after step, which the
//! 300 MiB L3 of the H200 host then partly serves; the random rounds time the step DRAM-true (each
//! round prints how much its routing repeats). The variants' order alternates between rounds. Each is reported in ms per layer call (the mean, as
//! the step's split reports it, and the pool regions' median, p90 and max: a few slow calls move the
//! mean), the weight bytes of the distinct experts it read per second, % of the DRAM probe of the same
//! process, the pool's tail (first thread out of items → last done) per call, and what the OS did
//! meanwhile: involuntary context switches of the pools' threads (`moe-cpu-*`, from
//! `/proc/self/task`) and interrupts (`/proc/interrupts`, the busiest CPU named).
use super::bench::decode_steps;
use super::bench_os::{OsCounters, OsNoise};
use crate::engine::{Engine, SeqCache};
use crate::model::Ffn;
use moe_kernels::cpu::bench_step::{read_call, read_chunks, ReadAnchor, READ_CHUNK};
use moe_kernels::cpu::moe::{CpuExpertSet, DecodePath};
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

/// How much the recorded calls' routing repeats, per MoE layer over the steps (expert reuse across
/// steps is what the L3 can serve): distinct experts per layer, and the share of a layer's experts in
/// one step that the previous step of that layer chose too; beside what uniform random routing of
/// `top_k` of `experts` would give.
fn routing_reuse(calls: &[Call], top_k: usize, experts: usize) -> String {
    let mut by_layer: std::collections::BTreeMap<usize, Vec<Vec<u32>>> = Default::default();
    for c in calls {
        let mut ids = c.ids.clone();
        ids.sort_unstable();
        ids.dedup();
        by_layer.entry(c.layer).or_default().push(ids);
    }
    let (mut distinct, mut repeated, mut chosen) = (0usize, 0usize, 0usize);
    let mut steps = 0;
    for seq in by_layer.values() {
        let mut all: Vec<u32> = seq.iter().flatten().copied().collect();
        all.sort_unstable();
        all.dedup();
        distinct += all.len();
        steps = steps.max(seq.len());
        for w in seq.windows(2) {
            repeated += w[1]
                .iter()
                .filter(|e| w[0].binary_search(e).is_ok())
                .count();
            chosen += w[1].len();
        }
    }
    let layers = by_layer.len().max(1);
    let p = (top_k as f64 / experts.max(1) as f64).min(1.0);
    let uniform_distinct = experts as f64 * (1.0 - (1.0 - p).powi(steps as i32));
    format!(
        "routing: {:.1} distinct experts per layer over {steps} steps, {:.0}% of a step's experts chosen by the layer's previous step too (uniform random: {uniform_distinct:.1}, {:.0}%)",
        distinct as f64 / layers as f64,
        100.0 * repeated as f64 / chosen.max(1) as f64,
        100.0 * p
    )
}

/// The pool regions of `regions` (one per call that read an expert, in order) by how many distinct
/// DRAM experts the call read (`held`, per call; calls that read none open no region), each count's
/// calls and median region, and a least-squares line through every call: the time a call costs
/// whatever it reads, and each expert's cost at the margin (as GB/s of `expert_bytes`). Says so
/// instead when the regions do not match the calls.
fn by_experts(held: &[usize], regions: &[f64], expert_bytes: f64) -> String {
    let held: Vec<usize> = held.iter().copied().filter(|&h| h > 0).collect();
    if held.is_empty() || held.len() != regions.len() {
        return format!(
            "by DRAM experts per call: {} regions for {} calls that read experts, not split",
            regions.len(),
            held.len()
        );
    }
    let mut counts: Vec<String> = Vec::new();
    for n in 1..=held.iter().copied().max().unwrap_or(0) {
        let mut r: Vec<f64> = held
            .iter()
            .zip(regions)
            .filter(|(h, _)| **h == n)
            .map(|(_, &r)| r)
            .collect();
        if r.is_empty() {
            continue;
        }
        r.sort_by(f64::total_cmp);
        let med = quantile(&r, 0.5);
        counts.push(format!(
            "{n}: {} × {:.3} ms ({:.0} GB/s)",
            r.len(),
            med * 1e3,
            n as f64 * expert_bytes / med / 1e9
        ));
    }
    let k = held.len() as f64;
    let (sx, sy) = held
        .iter()
        .zip(regions)
        .fold((0.0, 0.0), |(x, y), (&h, &r)| (x + h as f64, y + r));
    let (sxx, sxy) = held
        .iter()
        .zip(regions)
        .fold((0.0, 0.0), |(xx, xy), (&h, &r)| {
            (xx + (h * h) as f64, xy + h as f64 * r)
        });
    let det = k * sxx - sx * sx;
    let fit = if det > 0.0 {
        let b = (k * sxy - sx * sy) / det;
        let a = (sy - b * sx) / k;
        format!(
            "; line through the calls: {:.1} µs + {:.1} µs per expert ({:.0} GB/s at the margin)",
            a * 1e6,
            b * 1e6,
            expert_bytes / b / 1e9
        )
    } else {
        String::new()
    };
    format!(
        "by DRAM experts per call (calls × region median): {}{fit}",
        counts.join(", ")
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
        if let Some((label, n)) = &self.os.most_switched {
            d += &format!(" (most: {label} {:.2}/call)", per_call_n(*n));
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
    FreshHeld,
    Read,
}

const VARIANTS: [Variant; 6] = [
    Variant::Recorded,
    Variant::Gap,
    Variant::Fixed,
    Variant::Fresh,
    Variant::FreshHeld,
    Variant::Read,
];

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Variant::Recorded => "recorded",
            Variant::Gap => "recorded + gap",
            Variant::Fixed => "fixed",
            Variant::Fresh => "fresh",
            Variant::FreshHeld => "fresh, top-k in DRAM",
            Variant::Read => "read anchor of the recorded calls",
        }
    }
}

/// What the replay reads of the engine: the pool, each MoE layer's packed set, top-k, hidden.
struct Replay<'e> {
    pool: &'e WorkerPool,
    sets: Vec<Option<&'e CpuExpertSet>>,
    top_k: usize,
    /// Routed experts per MoE layer (DRAM and GPU-resident together).
    num_experts: usize,
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
        let (top_k, num_experts) = cfg
            .moe
            .as_ref()
            .map(|m| (m.top_k, m.num_experts))
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
            num_experts,
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

    /// The read anchor of `calls` (`cpu_moe_bench`'s `read` row): each call's distinct DRAM experts,
    /// their packed bytes in 256 KiB pieces summed by the pool with the DRAM probe's loop, one call
    /// after the other: what those very pages cost to read, region start and tail included.
    fn time_read(&self, calls: &[Call]) -> Timing {
        let anchor = ReadAnchor {
            prefetch: None,
            chunk: READ_CHUNK,
        };
        let mut t = Timing::default();
        let before = self.pool.region_stats();
        let os = OsCounters::now();
        self.pool.set_region_log(true);
        self.pool.take_region_log();
        for c in calls {
            let Some(set) = self.sets[c.layer] else {
                continue;
            };
            let mut held: Vec<u32> = c.ids.iter().copied().filter(|&e| set.holds(e)).collect();
            held.sort_unstable();
            held.dedup();
            if held.is_empty() {
                continue;
            }
            let chunks = read_chunks(set, &held, anchor.chunk);
            let started = Instant::now();
            read_call(self.pool, &chunks, anchor);
            t.secs += started.elapsed().as_secs_f64();
            t.calls += 1;
            t.bytes += held.len() as f64 * set.bytes_per_expert() as f64;
        }
        t.pool = self.pool.region_stats().since(&before);
        t.regions = self.pool.take_region_log();
        self.pool.set_region_log(false);
        t.os = OsCounters::now().since(&os);
        t
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

    /// A new uniform random routing (`top_k` distinct experts of the layer's `num_experts` per token)
    /// for every call, over the recorded calls' layers and token counts: a call reads the drawn
    /// experts its set holds, so with GPU-resident experts the DRAM share per call follows the
    /// placement, as in the random rounds of the step.
    fn fresh(&self, calls: &[Call], seed: u64) -> Vec<Call> {
        let mut state = seed | 1;
        calls
            .iter()
            .filter(|c| self.sets[c.layer].is_some())
            .map(|c| {
                let mut ids = vec![0u32; c.ids.len()];
                random_routing(&mut ids, self.top_k, self.num_experts, &mut state);
                Call {
                    layer: c.layer,
                    ids,
                }
            })
            .collect()
    }

    /// Every set's decode-sized calls on `p` (`None`: each set's own path).
    fn set_path(&self, p: Option<DecodePath>) {
        self.sets
            .iter()
            .flatten()
            .for_each(|s| s.set_shared_decode_path(p));
    }

    /// Packed bytes of one expert (the first MoE layer's; every layer packs the same format).
    fn expert_bytes(&self) -> f64 {
        self.sets
            .iter()
            .flatten()
            .next()
            .map_or(0.0, |s| s.bytes_per_expert() as f64)
    }

    /// As [`Replay::fresh`], but each token's `top_k` experts drawn from those the layer's set holds:
    /// calls of as many DRAM experts as an all-DRAM layer's, on the same sets (with GPU-resident
    /// experts: a call of few DRAM experts against one of `top_k`, in one process, without the GPU).
    fn fresh_held(&self, calls: &[Call], seed: u64) -> Vec<Call> {
        let mut state = seed | 1;
        calls
            .iter()
            .filter_map(|c| {
                let held = self.sets[c.layer]?.expert_ids();
                let mut ids = vec![0u32; c.ids.len()];
                random_routing(&mut ids, self.top_k, held.len(), &mut state);
                ids.iter_mut().for_each(|e| *e = held[*e as usize]);
                Some(Call {
                    layer: c.layer,
                    ids,
                })
            })
            .collect()
    }

    /// Distinct experts each call reads (those its layer's set holds), in call order.
    fn held_per_call(&self, calls: &[Call]) -> Vec<usize> {
        calls
            .iter()
            .map(|c| self.sets[c.layer].map_or(0, |s| distinct_held(s, &c.ids)))
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
    paths: &[DecodePath],
) -> anyhow::Result<()> {
    let replay = Replay::of(engine)?;
    let mut r = paths_ab(
        &replay,
        engine,
        (caches, next),
        (rounds, steps),
        probe_gbs,
        paths,
    );
    if r.is_ok() {
        r = rounds_of(
            &replay,
            engine,
            (caches, next),
            (rounds, steps),
            probe_gbs,
            paths,
        );
    }
    replay.set_path(None);
    r
}

/// Before the replay's rounds, with two or more `paths`: the plain decode step (the model's routing,
/// no override, so device-routed layers stay on the device) on each path in turn, `rounds` times,
/// on the same sequences: the step's time and its CPU experts per path in one process.
fn paths_ab(
    replay: &Replay<'_>,
    engine: &Engine,
    (caches, next): (&mut [SeqCache], &mut Vec<u32>),
    (rounds, steps): (usize, usize),
    probe_gbs: f64,
    paths: &[DecodePath],
) -> anyhow::Result<()> {
    if paths.len() < 2 {
        return Ok(());
    }
    let mut per_path: Vec<(Vec<f64>, Vec<f64>)> = vec![Default::default(); paths.len()];
    for round in 0..rounds.max(1) {
        for (i, &p) in paths.iter().enumerate() {
            replay.set_path(Some(p));
            let (elapsed, t) = decode_steps(engine, caches, next, 0, steps)?;
            let n = steps.max(1) as f64;
            let calls = t.cpu_regions.calls.max(1) as f64;
            let gbs = t.dram_expert_bytes as f64 / t.cpu_experts_s.max(1e-12) / 1e9;
            println!(
                "CPU paths A/B round {round} [{p}]: {:.2} ms/step ({:.1} tok/s); CPU experts {:.2} ms/step = {:.3} ms/call ({gbs:.1} GB/s, {:.0}% of the probe); waiting for GPU {:.2}, other host {:.2} ms/step",
                elapsed / n * 1e3,
                n / elapsed.max(1e-12),
                t.cpu_experts_s / n * 1e3,
                t.cpu_experts_s / calls * 1e3,
                100.0 * gbs / probe_gbs,
                t.gpu_wait_s / n * 1e3,
                (elapsed - t.cpu_experts_s - t.gpu_wait_s) / n * 1e3,
            );
            per_path[i].0.push(elapsed / n * 1e3);
            per_path[i].1.push(t.cpu_experts_s / calls * 1e3);
        }
    }
    let med = super::bench_ab::median;
    let (base_step, base_cpu) = (med(&per_path[0].0), med(&per_path[0].1));
    let mut line = format!(
        "CPU paths A/B, median of {} rounds: [{}] {base_step:.2} ms/step, CPU experts {base_cpu:.3} ms/call",
        rounds.max(1),
        paths[0]
    );
    for (p, (step, cpu)) in paths.iter().zip(&per_path).skip(1) {
        let (st, c) = (med(step), med(cpu));
        line += &format!(
            "; [{p}] {st:.2} ms/step ({:+.1}% tok/s), CPU experts {c:.3} ms/call ({:+.1}%)",
            (base_step / st - 1.0) * 100.0,
            (c / base_cpu - 1.0) * 100.0
        );
    }
    println!("{line}");
    Ok(())
}

/// The rounds of [`run`]; each set is left on whatever path the last round timed.
fn rounds_of(
    replay: &Replay<'_>,
    engine: &Engine,
    (caches, next): (&mut [SeqCache], &mut Vec<u32>),
    (rounds, steps): (usize, usize),
    probe_gbs: f64,
    paths: &[DecodePath],
) -> anyhow::Result<()> {
    let experts = replay.num_experts;
    // the sets' own path, or each of `paths` for two rounds in turn (the model's routing, random)
    let step_paths: Vec<Option<DecodePath>> = if paths.is_empty() {
        vec![None]
    } else {
        paths.iter().copied().map(Some).collect()
    };
    let label = |what: &str, p: Option<DecodePath>| match p {
        Some(p) => format!("{what} [{p}]"),
        None => what.to_string(),
    };
    // per routing (the model's, random): each line's ms per call over rounds, in first-seen order
    let mut medians: [Vec<(String, Vec<f64>)>; 2] = Default::default();
    let mut note = |random: bool, what: String, ms: f64| {
        let lines = &mut medians[usize::from(random)];
        match lines.iter_mut().find(|(l, _)| *l == what) {
            Some((_, v)) => v.push(ms),
            None => lines.push((what, vec![ms])),
        }
    };
    for round in 0..rounds {
        let random = round % 2 == 1;
        let step_path = step_paths[(round / 2) % step_paths.len()];
        replay.set_path(step_path);
        let recorded = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&recorded);
        let (top_k, mut state) = (replay.top_k, 0x2545_F491_4F6C_DD1D_u64 ^ round as u64);
        engine.set_routing_override(Some(Box::new(move |layer, ids: &mut [u32]| {
            if random {
                random_routing(ids, top_k, experts, &mut state);
            }
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
        let step_label = label("engine step", step_path);
        println!(
            "CPU replay round {round}: {step_label} {} ({} layer calls; hand-off gap {:.1} µs per layer{})",
            step.describe(probe_gbs),
            step.calls,
            gap.as_secs_f64() * 1e6,
            first_layer_split(&step.regions, steps)
        );
        println!(
            "CPU replay round {round}: {}",
            routing_reuse(&calls, replay.top_k, experts)
        );
        let expert_bytes = replay.expert_bytes();
        println!(
            "CPU replay round {round}: {step_label} {}",
            by_experts(&replay.held_per_call(&calls), &step.regions, expert_bytes)
        );
        note(random, step_label, step.ms_per_call());
        // every variant under the step's path, then the recorded and fresh calls under each other
        // path; the order turns around every round
        let mut timings: Vec<(Variant, Option<DecodePath>)> =
            VARIANTS.iter().map(|&v| (v, step_path)).collect();
        for &p in step_paths.iter().filter(|&&p| p != step_path) {
            timings.push((Variant::Recorded, p));
            timings.push((Variant::Fresh, p));
        }
        if round % 2 == 1 {
            timings.reverse();
        }
        let fresh = replay.fresh(&calls, 0x9E37_79B9_7F4A_7C15 ^ round as u64);
        let fixed = replay.fixed(&calls);
        let fresh_held = replay.fresh_held(&calls, 0x6A09_E667_F3BC_C909 ^ round as u64);
        for (v, path) in timings {
            let (timed, gap) = match v {
                Variant::Recorded => (&calls, Duration::ZERO),
                Variant::Gap => (&calls, gap),
                Variant::Fixed => (&fixed, Duration::ZERO),
                Variant::Fresh => (&fresh, Duration::ZERO),
                Variant::FreshHeld => (&fresh_held, Duration::ZERO),
                Variant::Read => (&calls, Duration::ZERO),
            };
            replay.set_path(path);
            let t = match v {
                Variant::Read => replay.time_read(timed),
                _ => replay.time(timed, gap)?,
            };
            let what = label(v.label(), path);
            println!("CPU replay round {round}: {what} {}", t.describe(probe_gbs));
            println!(
                "CPU replay round {round}: {what} {}",
                by_experts(&replay.held_per_call(timed), &t.regions, expert_bytes)
            );
            note(random, what, t.ms_per_call());
        }
    }
    let med = super::bench_ab::median;
    for (lines, routing) in medians
        .iter()
        .zip(["the model's routing", "random routing"])
    {
        let Some((first, base)) = lines.first() else {
            continue;
        };
        let base = med(base);
        let mut line = format!(
            "CPU replay, {} rounds with {routing}, median ms per layer call: {first} {base:.3}",
            lines[0].1.len()
        );
        for (what, v) in &lines[1..] {
            let m = med(v);
            line += &format!(
                "; {what} {m:.3} ({:+.1}% vs the first)",
                (base / m - 1.0) * 100.0
            );
        }
        println!("{line}");
    }
    Ok(())
}

/// Rewrites `ids` (tokens × `top_k`) with a uniform random routing: `top_k` distinct experts of
/// `0..experts` per token (fewer experts than `top_k`: the first ones, repeated), from the xorshift
/// `state`.
fn random_routing(ids: &mut [u32], top_k: usize, experts: usize, state: &mut u64) {
    let mut next = || {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    };
    for token in ids.chunks_mut(top_k.max(1)) {
        for i in 0..token.len() {
            token[i] = if experts <= top_k {
                (i % experts.max(1)) as u32
            } else {
                loop {
                    let e = (next() % experts as u64) as u32;
                    if !token[..i].contains(&e) {
                        break e;
                    }
                }
            };
        }
    }
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
                most_switched: Some(("moe-cpu-3 (CPUs 0)".into(), 2)),
                irqs: Some(8),
                busiest: Some((3, 4)),
            },
            ..t
        };
        let d = with_regions.describe(125.0);
        assert!(d.contains("regions median 0.500 (80% of the probe), p90 1.000, max 1.000 ms, 1 of 4 over 1.5x"), "{d}");
        assert!(
            d.contains("involuntary switches 0.50/call (most: moe-cpu-3 (CPUs 0) 0.50/call)"),
            "{d}"
        );
        assert!(
            d.contains("interrupts 2.00/call (most on CPU 3: 1.00/call)"),
            "{d}"
        );
    }

    #[test]
    fn quantiles_index_sorted_lists() {
        assert_eq!(quantile(&[1.0, 2.0, 3.0], 0.5), 2.0);
        assert_eq!(quantile(&[1.0, 2.0, 3.0], 1.0), 3.0);
    }

    #[test]
    fn routing_reuse_counts_distinct_and_repeated_experts() {
        let call = |layer, ids: &[u32]| Call {
            layer,
            ids: ids.to_vec(),
        };
        // layer 0 repeats {1, 2} then moves to {2, 3}; layer 5 never repeats
        let calls = [
            call(0, &[1, 2]),
            call(5, &[7, 8]),
            call(0, &[2, 1]),
            call(5, &[9, 10]),
            call(0, &[3, 2]),
            call(5, &[11, 12]),
        ];
        let r = routing_reuse(&calls, 2, 16);
        // distinct: 3 and 6 → 4.5; repeated: layer 0 2 + 1 of 4, layer 5 0 of 4 → 3 of 8
        assert!(
            r.starts_with(
                "routing: 4.5 distinct experts per layer over 3 steps, 38% of a step's experts"
            ),
            "{r}"
        );
        // uniform: 16 × (1 − (7/8)³) = 5.28, 2/16 = 12.5 %
        assert!(r.ends_with("(uniform random: 5.3, 12%)"), "{r}");
    }

    #[test]
    fn random_routing_picks_distinct_experts_per_token() {
        let mut ids = vec![0u32; 3 * 8];
        let mut state = 42;
        random_routing(&mut ids, 8, 128, &mut state);
        for t in ids.chunks(8) {
            let mut d = t.to_vec();
            d.sort_unstable();
            d.dedup();
            assert_eq!(d.len(), 8, "{t:?}");
            assert!(t.iter().all(|&e| e < 128));
        }
        let before = ids.clone();
        random_routing(&mut ids, 8, 128, &mut state);
        assert_ne!(ids, before, "a new draw per call");
        let mut few = vec![9u32; 4];
        random_routing(&mut few, 4, 2, &mut state);
        assert_eq!(few, vec![0, 1, 0, 1]);
    }

    #[test]
    fn calls_split_by_experts_read_and_a_line_through_them() {
        // 10 µs + 100 µs per expert of 10 MB (100 GB/s at the margin); a call that read nothing
        // opened no region
        let held = [1, 0, 2, 4, 2];
        let regions = [110e-6, 210e-6, 410e-6, 210e-6];
        let s = by_experts(&held, &regions, 10e6);
        assert!(
            s.starts_with("by DRAM experts per call (calls × region median): 1: 1 × 0.110 ms (91 GB/s), 2: 2 × 0.210 ms (95 GB/s), 4: 1 × 0.410 ms (98 GB/s)"),
            "{s}"
        );
        assert!(
            s.ends_with(
                "line through the calls: 10.0 µs + 100.0 µs per expert (100 GB/s at the margin)"
            ),
            "{s}"
        );
        let off = by_experts(&held, &regions[..3], 10e6);
        assert!(off.contains("3 regions for 4 calls"), "{off}");
        // one count only: no line
        assert!(!by_experts(&[2, 2], &[1e-4, 1e-4], 1e6).contains("line"));
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
