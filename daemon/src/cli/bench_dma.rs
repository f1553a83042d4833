//! `bench decode --dma-probe N`: do the GPU's copies of packed DRAM experts over PCIe add to what
//! the CPU expert kernels read from DRAM, or take from it? A decode step that hands part of a layer's
//! DRAM experts to the GPU (`engine::gpu::split`) gains only if the first. Each of N rounds times,
//! in one process on the engine's own pool, kernels and registered expert memory:
//! - the engine's DRAM probe alone and beside the copies;
//! - the copies alone (host→device from the registered packed experts, `engine::gpu::copy_load`);
//! - the CPU expert kernels at batch 1 on fresh random routings (a new one per call, cycling every
//!   MoE layer, so no expert comes back from the L3) alone and beside the copies.
//!
//! The variants' order alternates between rounds; the summary gives the medians and what the
//! copies cost each CPU reader, against what they moved.
use crate::engine::Engine;
use crate::model::Ffn;
use moe_kernels::cpu::bench::measure_dram_read_bw;
use moe_kernels::cpu::moe::CpuExpertSet;
use moe_kernels::cpu::WorkerPool;
use std::time::{Duration, Instant};

/// MiB the probe reads (as `bench decode`'s).
const PROBE_MIB: usize = 2048;
/// How long the copies alone run.
const COPIES_ALONE: Duration = Duration::from_millis(300);
/// Kernel calls per timing (a few hundred ms at batch 1).
const KERNEL_CALLS: usize = 384;

/// One timing of the CPU side (GB/s) and of the copies beside it, if they ran.
#[derive(Clone, Copy, Debug)]
struct Rates {
    cpu_gbs: f64,
    copies_gbs: Option<f64>,
    /// The kernels' ms per layer call (none for the probe).
    ms_per_call: Option<f64>,
}

/// What the rounds measured, per variant (in [`VARIANTS`] order).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    Probe,
    ProbeCopies,
    CopiesAlone,
    Kernels,
    KernelsCopies,
}

const VARIANTS: [Variant; 5] = [
    Variant::Probe,
    Variant::ProbeCopies,
    Variant::CopiesAlone,
    Variant::Kernels,
    Variant::KernelsCopies,
];

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Variant::Probe => "DRAM probe",
            Variant::ProbeCopies => "DRAM probe + copies",
            Variant::CopiesAlone => "copies alone",
            Variant::Kernels => "CPU experts",
            Variant::KernelsCopies => "CPU experts + copies",
        }
    }
}

/// The engine's MoE layers with DRAM experts, their top-k and hidden width.
struct Kernels<'e> {
    pool: &'e WorkerPool,
    sets: Vec<&'e CpuExpertSet>,
    top_k: usize,
    hidden: usize,
}

impl<'e> Kernels<'e> {
    fn of(engine: &'e Engine) -> anyhow::Result<Self> {
        let pool = engine
            .cpu_expert_pool()
            .filter(|_| engine.on_gpu())
            .ok_or_else(|| {
                anyhow::anyhow!("--dma-probe needs the CUDA backend's CPU expert pool")
            })?;
        let model = engine.model();
        let top_k = model
            .config
            .moe
            .as_ref()
            .map(|m| m.top_k)
            .ok_or_else(|| anyhow::anyhow!("--dma-probe needs an MoE model"))?;
        let sets: Vec<&CpuExpertSet> = model
            .layers
            .iter()
            .filter_map(|l| match &l.ffn {
                Ffn::Moe(b) => b.cpu_set.as_ref(),
                _ => None,
            })
            .filter(|s| s.expert_ids().len() >= top_k)
            .collect();
        anyhow::ensure!(
            !sets.is_empty(),
            "--dma-probe: no MoE layer holds top-k experts in DRAM"
        );
        Ok(Kernels {
            pool,
            sets,
            top_k,
            hidden: model.config.hidden_size,
        })
    }

    /// [`KERNEL_CALLS`] batch-1 calls, cycling the layers, each on a new random routing of distinct
    /// held experts (xorshift from `seed`): GB/s of the experts read and ms per call.
    fn time(&self, seed: u64) -> anyhow::Result<(f64, f64)> {
        let mut g = seed | 1;
        let mut next = move || {
            g ^= g << 13;
            g ^= g >> 7;
            g ^= g << 17;
            g
        };
        let x: Vec<f32> = (0..self.hidden)
            .map(|i| ((i * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let w = vec![1.0 / self.top_k as f32; self.top_k];
        let mut out = vec![0f32; self.hidden];
        let mut ids = Vec::with_capacity(self.top_k);
        let (mut secs, mut bytes) = (0.0, 0.0);
        for call in 0..KERNEL_CALLS {
            let set = self.sets[call % self.sets.len()];
            let held = set.expert_ids();
            ids.clear();
            while ids.len() < self.top_k {
                let e = held[(next() % held.len() as u64) as usize];
                if !ids.contains(&e) {
                    ids.push(e);
                }
            }
            let t = Instant::now();
            set.forward(self.pool, &x, &ids, &w, self.top_k, &mut out)?;
            secs += t.elapsed().as_secs_f64();
            bytes += (self.top_k * set.bytes_per_expert()) as f64;
        }
        Ok((bytes / secs / 1e9, secs / KERNEL_CALLS as f64 * 1e3))
    }
}

/// One variant's timing in round `round`.
fn measure(engine: &Engine, k: &Kernels<'_>, v: Variant, round: usize) -> anyhow::Result<Rates> {
    let seed = 0x9E37_79B9_7F4A_7C15 ^ round as u64;
    let probe = || measure_dram_read_bw(k.pool, PROBE_MIB);
    let rates = |cpu_gbs, copies: Option<f64>, ms| Rates {
        cpu_gbs,
        copies_gbs: copies,
        ms_per_call: ms,
    };
    Ok(match v {
        Variant::Probe => rates(probe(), None, None),
        Variant::ProbeCopies => {
            let (gbs, c) = engine.with_expert_copies(probe)?;
            rates(gbs, Some(c.gbs()), None)
        }
        Variant::CopiesAlone => {
            let (_, c) = engine.with_expert_copies(|| std::thread::sleep(COPIES_ALONE))?;
            rates(0.0, Some(c.gbs()), None)
        }
        Variant::Kernels => {
            let (gbs, ms) = k.time(seed)?;
            rates(gbs, None, Some(ms))
        }
        Variant::KernelsCopies => {
            let (r, c) = engine.with_expert_copies(|| k.time(seed))?;
            let (gbs, ms) = r?;
            rates(gbs, Some(c.gbs()), Some(ms))
        }
    })
}

fn describe(v: Variant, r: &Rates) -> String {
    let mut d = match v {
        Variant::CopiesAlone => String::new(),
        _ => format!("CPU {:.1} GB/s", r.cpu_gbs),
    };
    if let Some(ms) = r.ms_per_call {
        d += &format!(" ({ms:.3} ms per layer call)");
    }
    if let Some(c) = r.copies_gbs {
        if !d.is_empty() {
            d += ", ";
        }
        d += &format!("copies {c:.1} GB/s");
        if r.cpu_gbs > 0.0 {
            d += &format!(", together {:.1} GB/s", r.cpu_gbs + c);
        }
    }
    d
}

/// The rounds (see the module docs) and their summary.
pub(super) fn run(engine: &Engine, rounds: usize) -> anyhow::Result<()> {
    let k = Kernels::of(engine)?;
    println!(
        "DMA probe: {} MoE layers with DRAM experts, {:.1} MB per expert, top-{}, {} pool threads",
        k.sets.len(),
        k.sets[0].bytes_per_expert() as f64 / 1e6,
        k.top_k,
        k.pool.threads()
    );
    let mut got: Vec<Vec<Rates>> = vec![Vec::new(); VARIANTS.len()];
    for round in 0..rounds {
        let order: Vec<usize> = if round % 2 == 0 {
            (0..VARIANTS.len()).collect()
        } else {
            (0..VARIANTS.len()).rev().collect()
        };
        for i in order {
            let r = measure(engine, &k, VARIANTS[i], round)?;
            println!(
                "DMA probe round {round}: {}: {}",
                VARIANTS[i].label(),
                describe(VARIANTS[i], &r)
            );
            got[i].push(r);
        }
    }
    let med = |i: usize, f: &dyn Fn(&Rates) -> f64| {
        let v: Vec<f64> = got[i].iter().map(f).collect();
        super::bench_ab::median(&v)
    };
    let cpu = |r: &Rates| r.cpu_gbs;
    let copies = |r: &Rates| r.copies_gbs.unwrap_or(0.0);
    let ms = |r: &Rates| r.ms_per_call.unwrap_or(0.0);
    let alone = med(2, &copies);
    for (a, b, what) in [(0, 1, "DRAM probe"), (3, 4, "CPU experts")] {
        let (solo, beside, c) = (med(a, &cpu), med(b, &cpu), med(b, &copies));
        println!(
            "DMA probe, medians of {rounds} rounds: {what} {solo:.1} GB/s alone, {beside:.1} beside copies ({:+.1}%), copies {c:.1} GB/s beside it ({alone:.1} alone): together {:.1} GB/s ({:+.1}% over the CPU alone)",
            (beside / solo - 1.0) * 100.0,
            beside + c,
            ((beside + c) / solo - 1.0) * 100.0
        );
    }
    println!(
        "DMA probe: CPU experts {:.3} ms per batch-1 layer call alone, {:.3} beside copies",
        med(3, &ms),
        med(4, &ms)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_variant_says_what_it_measured() {
        let r = |cpu_gbs, copies_gbs, ms_per_call| Rates {
            cpu_gbs,
            copies_gbs,
            ms_per_call,
        };
        assert_eq!(
            describe(Variant::Probe, &r(103.4, None, None)),
            "CPU 103.4 GB/s"
        );
        assert_eq!(
            describe(Variant::ProbeCopies, &r(83.6, Some(51.9), None)),
            "CPU 83.6 GB/s, copies 51.9 GB/s, together 135.5 GB/s"
        );
        assert_eq!(
            describe(Variant::CopiesAlone, &r(0.0, Some(54.9), None)),
            "copies 54.9 GB/s"
        );
        assert_eq!(
            describe(Variant::KernelsCopies, &r(84.4, Some(43.7), Some(0.895))),
            "CPU 84.4 GB/s (0.895 ms per layer call), copies 43.7 GB/s, together 128.1 GB/s"
        );
    }
}
