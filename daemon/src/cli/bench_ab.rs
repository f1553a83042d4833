//! `bench decode --ab SWITCH,...`: decode-step switches compared in one process on the same
//! sequences (`engine::gpu::switches`), so that an A/B does not carry two runs' noise: each round
//! times the start state and each switch flipped from it (in turn, the order reversed every other
//! round), continuing the same sequences; the medians over rounds close. Then each switch's effect on the logits, teacher-forced: two copies of
//! one prompt decode the same tokens, one with the start state and one with the switch flipped.
use super::bench::{decode_steps, prompt};
use crate::engine::gpu::handoff::HandoffProfile;
use crate::engine::gpu::switches::DecodeSwitch;
use crate::engine::{Engine, SeqCache, SeqInput, StepTimes};

/// Decode steps of the teacher-forced logits comparison of each switch.
const EFFECT_STEPS: usize = 16;

/// One timed variant: the start state, or one switch flipped from it.
struct Variant {
    label: String,
    flip: Option<(DecodeSwitch, bool)>,
}

/// Median of a non-empty list.
pub(super) fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The A/B rounds over `switches` (see the module docs); leaves every switch as it found it.
/// `probe_gbs`: the DRAM probe of this process, to put the CPU experts' read rate against.
pub(super) fn run(
    engine: &Engine,
    (caches, next): (&mut [SeqCache], &mut Vec<u32>),
    switches: &[DecodeSwitch],
    rounds: usize,
    (steps, prompt_len): (usize, usize),
    probe_gbs: Option<f64>,
) -> anyhow::Result<()> {
    let mut start = Vec::with_capacity(switches.len());
    for &s in switches {
        let Some(on) = engine.decode_switch(s) else {
            anyhow::bail!(
                "--ab {s} needs the CUDA backend{}",
                if s == DecodeSwitch::Graphs {
                    " with CUDA graphs on (hybrid-attention models: --cuda-graphs-hybrid)"
                } else {
                    ""
                }
            );
        };
        start.push((s, on));
    }
    let restore = || {
        for &(s, on) in &start {
            engine.set_decode_switch(s, on);
        }
    };
    let mut variants = vec![Variant {
        label: "start".into(),
        flip: None,
    }];
    for &(s, on) in &start {
        variants.push(Variant {
            label: format!("{s} {}", if on { "off" } else { "on" }),
            flip: Some((s, !on)),
        });
    }
    let describe = start
        .iter()
        .map(|(s, on)| format!("{s} {}", if *on { "on" } else { "off" }))
        .collect::<Vec<_>>()
        .join(", ");
    println!("A/B start state: {describe}");
    let ms = |s: f64| s / steps as f64 * 1e3;
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for round in 0..rounds {
        for i in round_order(round, variants.len()) {
            let v = &variants[i];
            restore();
            if let Some((s, on)) = v.flip {
                engine.set_decode_switch(s, on);
            }
            let r = decode_steps(engine, caches, next, 1, steps);
            let (secs, split) = match r {
                Ok(r) => r,
                Err(e) => {
                    restore();
                    return Err(e);
                }
            };
            times[i].push(ms(secs));
            cpu[i].push(ms(split.cpu_experts_s));
            println!(
                "A/B round {round}, {}: {:.2} ms/step ({:.1} tok/s), waiting for GPU {:.2} ms, CPU experts {:.2} ms{}, other host {:.2} ms{}",
                v.label,
                ms(secs),
                caches.len() as f64 / (secs / steps as f64),
                ms(split.gpu_wait_s),
                ms(split.cpu_experts_s),
                cpu_rate(&split, probe_gbs),
                ms(secs - split.gpu_wait_s - split.cpu_experts_s),
                handoff_suffix(&split, steps)
            );
            println!(
                "A/B round {round}, {}: {}",
                v.label,
                super::bench_host::host_suffix(&split, secs, steps).trim_start_matches("; ")
            );
        }
    }
    restore();
    let base = median(&times[0]);
    let mut line =
        format!("A/B, {rounds} rounds of {steps} steps, median ms/step: start {base:.2}");
    for (v, t) in variants.iter().zip(&times).skip(1) {
        let m = median(t);
        line += &format!(
            "; {} {m:.2} ({:+.1}% tok/s)",
            v.label,
            (base / m - 1.0) * 100.0
        );
    }
    println!("{line}");
    let cpu_line = variants
        .iter()
        .zip(&cpu)
        .map(|(v, t)| format!("{} {:.2}", v.label, median(t)))
        .collect::<Vec<_>>()
        .join("; ");
    println!("A/B, median CPU experts ms/step: {cpu_line}");
    let split_flipped = switches.iter().any(|s| {
        matches!(
            s,
            DecodeSwitch::DecodeSplit | DecodeSwitch::DecodeSplitFixed(_)
        )
    });
    if let (true, Some(b)) = (split_flipped, engine.decode_split_balance()) {
        let (gpu, cpu, launch) = b.rates();
        println!(
            "A/B, decode split balance: GPU share {:.1} GB/s ({} layers measured), CPU experts {:.1} GB/s ({}), host launches {:.1} µs per share",
            gpu / 1e9,
            b.gpu_layers,
            cpu / 1e9,
            b.cpu_layers,
            launch * 1e6
        );
    }
    for v in variants.iter().skip(1) {
        if let Some(flip) = v.flip {
            logits_effect(engine, &start, flip, &v.label, prompt_len)?;
        }
    }
    Ok(())
}

/// The order of the variants in `round`: forward in even rounds, backward in odd ones. The sequences
/// grow by every step timed, and the GPU's attention with them (measured: +6 µs per layer per 17 steps
/// at batch 1), so a fixed order would favour the variants timed first in every round.
fn round_order(round: usize, variants: usize) -> Vec<usize> {
    if round.is_multiple_of(2) {
        (0..variants).collect()
    } else {
        (0..variants).rev().collect()
    }
}

/// ` (GB/s of the DRAM experts' weights, % of the probe)` of the CPU experts, or nothing when they
/// read none.
fn cpu_rate(t: &StepTimes, probe_gbs: Option<f64>) -> String {
    if t.dram_expert_bytes == 0 || t.cpu_experts_s <= 0.0 {
        return String::new();
    }
    let gbs = t.dram_expert_bytes as f64 / t.cpu_experts_s / 1e9;
    match probe_gbs {
        Some(p) => format!(" ({gbs:.1} GB/s, {:.0}% of the probe)", 100.0 * gbs / p),
        None => format!(" ({gbs:.1} GB/s)"),
    }
}

/// Teacher-forced comparison: one prompt in two caches, decoded `EFFECT_STEPS` steps on the start
/// state's tokens, the first cache with the start state and the second with `flip`: per step the
/// rel-L2 of the second's logits against the first's and whether their argmax agrees.
fn logits_effect(
    engine: &Engine,
    start: &[(DecodeSwitch, bool)],
    flip: (DecodeSwitch, bool),
    label: &str,
    prompt_len: usize,
) -> anyhow::Result<()> {
    let restore = || {
        for &(s, on) in start {
            engine.set_decode_switch(s, on);
        }
    };
    restore();
    let p = prompt(engine, prompt_len, 7);
    let mut a = engine.new_cache();
    let mut b = engine.new_cache();
    let mut tok = {
        let la = engine.reserve_and_forward(&mut [SeqInput {
            cache: &mut a,
            tokens: &p,
        }])?;
        engine.reserve_and_forward(&mut [SeqInput {
            cache: &mut b,
            tokens: &p,
        }])?;
        crate::engine::sampling::argmax(&la[0]) as u32
    };
    let (mut worst, mut rels, mut agree) = (0f64, Vec::new(), 0usize);
    for _ in 0..EFFECT_STEPS {
        restore();
        let la = engine.reserve_and_forward(&mut [SeqInput {
            cache: &mut a,
            tokens: &[tok],
        }]);
        engine.set_decode_switch(flip.0, flip.1);
        let lb = engine.reserve_and_forward(&mut [SeqInput {
            cache: &mut b,
            tokens: &[tok],
        }]);
        restore();
        let (la, lb) = (la?.remove(0), lb?.remove(0));
        let rel = rel_l2(&lb, &la);
        worst = worst.max(rel);
        rels.push(rel);
        let top = crate::engine::sampling::argmax(&la);
        agree += usize::from(top == crate::engine::sampling::argmax(&lb));
        tok = top as u32;
    }
    println!(
        "logits, {label} against the start state (teacher-forced, {EFFECT_STEPS} steps): rel-L2 max {worst:.2e}, median {:.2e}; same argmax {agree}/{EFFECT_STEPS}",
        median(&rels)
    );
    Ok(())
}

/// ‖a − b‖ / ‖b‖ (0 for two zero vectors).
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        d += (x as f64 - y as f64).powi(2);
        n += (y as f64).powi(2);
    }
    if n == 0.0 {
        d.sqrt()
    } else {
        (d / n).sqrt()
    }
}

/// `; hand-off per layer: …` for a line of `steps` decode steps, or nothing when no layer was
/// profiled (CPU backend, every expert on the GPU).
pub(super) fn handoff_suffix(t: &StepTimes, steps: usize) -> String {
    let handoff = handoff_line(&t.handoff)
        .map(|l| {
            format!(
                "; hand-off per layer ({:.1}/step): {l}",
                per_step(&t.handoff, steps)
            )
        })
        .unwrap_or_default();
    handoff + &decode_split_suffix(t, steps)
}

/// `; decode split: …` when the steps handed DRAM experts to the GPU's side stream
/// (`engine::gpu::decode_split`): experts per step on each side, the host's wait for the GPU's share.
fn decode_split_suffix(t: &StepTimes, steps: usize) -> String {
    if t.split_gpu_experts == 0 {
        return String::new();
    }
    let per = |n: u64| n as f64 / steps.max(1) as f64;
    format!(
        "; decode split: {:.1} routed DRAM experts per step to the GPU, {:.1} to the CPU, host waited {:.3} ms/step for the GPU's share",
        per(t.split_gpu_experts),
        per(t.split_cpu_experts),
        t.split_gpu_wait_s / steps.max(1) as f64 * 1e3
    )
}

fn per_step(p: &HandoffProfile, steps: usize) -> f64 {
    p.layers as f64 / steps.max(1) as f64
}

/// The hand-off profile per MoE layer, in µs (see `HandoffProfile`).
pub(super) fn handoff_line(p: &HandoffProfile) -> Option<String> {
    if p.layers == 0 {
        return None;
    }
    let us = |s: f64, n: u64| s / n.max(1) as f64 * 1e6;
    let n = p.layers;
    Some(format!(
        "sum raised → next routing seen {:.1} µs = GPU add {:.1} + GPU segment {:.1} + flags' travel {:.1}; host launches in it {:.1} µs; routing seen → CPU experts start {:.1} µs",
        us(p.round_trip_s, n),
        us(p.gpu_add_s, n),
        us(p.gpu_segment_s, n),
        us(p.flag_latency_s(), n),
        us(p.host_launch_s, n),
        us(p.host_to_cpu_s, p.cpu_layers),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_alternate_the_order_of_the_variants() {
        assert_eq!(round_order(0, 3), vec![0, 1, 2]);
        assert_eq!(round_order(1, 3), vec![2, 1, 0]);
        assert_eq!(round_order(2, 2), vec![0, 1]);
    }

    #[test]
    fn the_cpu_rate_is_the_experts_bytes_over_their_time() {
        let t = StepTimes {
            cpu_experts_s: 2e-3,
            dram_expert_bytes: 200_000_000,
            ..StepTimes::default()
        };
        assert_eq!(cpu_rate(&t, Some(125.0)), " (100.0 GB/s, 80% of the probe)");
        assert_eq!(cpu_rate(&t, None), " (100.0 GB/s)");
        assert_eq!(cpu_rate(&StepTimes::default(), Some(1.0)), "");
    }

    #[test]
    fn median_and_rel_l2() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0]), 4.0);
        assert_eq!(rel_l2(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((rel_l2(&[3.0, 4.0], &[0.0, 0.0]) - 5.0).abs() < 1e-12);
        assert!((rel_l2(&[1.1, 0.0], &[1.0, 0.0]) - 0.1).abs() < 1e-6);
    }

    #[test]
    fn the_handoff_line_splits_the_round_trip() {
        assert_eq!(handoff_line(&HandoffProfile::default()), None);
        let p = HandoffProfile {
            layers: 2,
            round_trip_s: 200e-6,
            host_launch_s: 40e-6,
            gpu_add_s: 10e-6,
            gpu_segment_s: 150e-6,
            host_to_cpu_s: 6e-6,
            cpu_layers: 3,
        };
        let l = handoff_line(&p).unwrap();
        assert!(l.contains("seen 100.0 µs"), "{l}");
        assert!(
            l.contains("add 5.0 + GPU segment 75.0 + flags' travel 20.0"),
            "{l}"
        );
        assert!(l.contains("host launches in it 20.0"), "{l}");
        assert!(l.ends_with("start 2.0 µs"), "{l}");
    }
}
