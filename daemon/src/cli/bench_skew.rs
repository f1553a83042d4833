//! `moe-daemon bench skew`: decode under a synthetic skewed router (a hot share of each layer's experts
//! takes most hits; the hot set moves halfway), reporting GPU hit ratio, tok/s and the slowest step per
//! window, for one placement mode per run: `uniform`, `frequency` (statistics of the first phase, as a
//! file recorded earlier would hold) or `live` (live re-placement).
use crate::engine::placement::PlacementStrategy;
use crate::engine::skewed_routing::SkewedRouting;
use crate::engine::SeqInput;
use clap::{Args, ValueEnum};
use std::path::PathBuf;
use std::time::Instant;

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkewMode {
    Uniform,
    Frequency,
    Live,
}

#[derive(Args, Debug)]
pub struct SkewArgs {
    /// Model directory (config.json + safetensors) or a GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long, value_enum, default_value = "live")]
    pub mode: SkewMode,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub batch: u32,
    /// Decode steps (the hot set shifts at half of them).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(2..=10_000_000))]
    pub steps: u32,
    /// Share of each layer's experts that are hot.
    #[arg(long, default_value_t = 0.2)]
    pub hot_share: f64,
    /// Share of the hits the hot experts take.
    #[arg(long, default_value_t = 0.8)]
    pub hot_mass: f64,
    /// Steps per reported window.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    pub window: u32,
    /// Untimed steps first (CUDA graph capture, first touches), under the first phase's routing.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub warmup_steps: u32,
    #[command(flatten)]
    pub engine: super::engine_args::EngineArgs,
}

pub fn run(a: SkewArgs) -> anyhow::Result<()> {
    if !(0.0..=1.0).contains(&a.hot_share) || !(0.0..=1.0).contains(&a.hot_mass) {
        anyhow::bail!("--hot-share and --hot-mass are shares within 0..=1");
    }
    let model = super::model_path::ModelPath::open(&a.model)?;
    let mut opts = a.engine.options()?;
    // The config first: the frequency file needs the layer layout and expert count.
    let cfg = model.config()?;
    let moe = cfg
        .moe
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("bench skew needs an MoE model"))?;
    let skew = SkewedRouting {
        experts: moe.num_experts,
        top_k: moe.top_k,
        hot_share: a.hot_share,
        hot_mass: a.hot_mass,
        shift_at: u64::from(a.steps / 2),
        seed: 1,
    };
    let stats_file =
        std::env::temp_dir().join(format!("moe-skew-stats-{}.json", std::process::id()));
    match a.mode {
        SkewMode::Uniform => opts.placement = PlacementStrategy::Uniform,
        SkewMode::Frequency => {
            std::fs::write(
                &stats_file,
                serde_json::to_string(&skew.first_phase_counts(&cfg.moe_layers))?,
            )?;
            opts.placement = PlacementStrategy::Frequency;
            opts.routing_stats = Some(stats_file.clone());
        }
        SkewMode::Live => {
            opts.placement = PlacementStrategy::Uniform;
            if opts.live_placement.is_none() {
                opts.live_placement = Some(Default::default());
            }
        }
    }
    let t = Instant::now();
    let engine = model.load_engine(&opts)?;
    let _ = std::fs::remove_file(&stats_file);
    eprintln!(
        "loaded {} in {:.1} s",
        a.model.display(),
        t.elapsed().as_secs_f64()
    );
    let k = moe.top_k;
    // The routing's step: warm-up steps route as step 0, measured step `i` as step `i`.
    let step_no = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let routed_step = step_no.clone();
    engine.set_routing_override(Some(Box::new(move |layer, ids: &mut [u32]| {
        let step = routed_step.load(std::sync::atomic::Ordering::Relaxed);
        for (t, chunk) in ids.chunks_mut(k).enumerate() {
            skew.choose(layer, step, t, chunk);
        }
    })));
    let batch = a.batch as usize;
    let mut caches: Vec<_> = (0..batch).map(|_| engine.new_cache()).collect();
    let vocab = cfg.vocab_size as u64;
    println!(
        "mode {:?}: batch {batch}, {} steps, hot set shifts at step {}",
        a.mode,
        a.steps,
        a.steps / 2
    );
    let step_tokens = |step: u64| -> Vec<[u32; 1]> {
        // prompts of one token, then a deterministic token stream: the router is synthetic anyway
        (0..batch)
            .map(|i| [((step * 7919 + i as u64 * 104_729) % vocab) as u32])
            .collect()
    };
    for w in 0..u64::from(a.warmup_steps) {
        let toks = step_tokens(w);
        let mut inputs = SeqInput::batch(&mut caches, &toks);
        engine.reserve_and_forward(&mut inputs)?;
    }
    println!("steps        hit_ratio  tok/s    median_ms  max_ms  moves  max/median");
    let mut times = Vec::new();
    let (mut hits, mut all) = (0u64, 0u64);
    let mut moves_before = engine.live_stats().map_or(0, |s| s.moves_total);
    let mut report = SkewReport::default();
    for step in 0..a.steps as u64 {
        step_no.store(step, std::sync::atomic::Ordering::Relaxed);
        let toks = step_tokens(step + u64::from(a.warmup_steps));
        let mut inputs = SeqInput::batch(&mut caches, &toks);
        let t = Instant::now();
        engine.reserve_and_forward(&mut inputs)?;
        times.push(t.elapsed().as_secs_f64());
        let st = engine.last_step_times();
        hits += st.gpu_expert_hits;
        all += st.expert_hits;
        if times.len() == a.window as usize || step + 1 == u64::from(a.steps) {
            let mut sorted = times.clone();
            sorted.sort_by(f64::total_cmp);
            let median = sorted[sorted.len() / 2];
            let max = sorted[sorted.len() - 1];
            let total: f64 = times.iter().sum();
            let moves = engine.live_stats().map_or(0, |s| s.moves_total);
            let first = step + 1 - times.len() as u64;
            let ratio = hits as f64 / all.max(1) as f64;
            println!(
                "{:>5}-{:<6} {:>9.3}  {:>7.1}  {:>9.2}  {:>6.2}  {:>5}  {:>10.2}",
                first,
                step,
                ratio,
                (times.len() * batch) as f64 / total,
                median * 1e3,
                max * 1e3,
                moves - moves_before,
                max / median
            );
            report.window(first, step, ratio, max / median, moves > moves_before);
            moves_before = moves;
            times.clear();
            hits = 0;
            all = 0;
        }
        // a context longer than the cache would end the run: start the sequences over
        if caches[0].len() + 1 >= engine.kv_capacity() / batch {
            caches = (0..batch).map(|_| engine.new_cache()).collect();
        }
    }
    report.print(u64::from(a.steps / 2));
    Ok(())
}

/// The run's summary: how fast the hit ratio came back after the shift, and the slowest step
/// against its window's median while experts moved.
#[derive(Default)]
struct SkewReport {
    /// (first step, last step, hit ratio) per window.
    windows: Vec<(u64, u64, f64)>,
    /// Worst max/median of a window with moves, and its first step.
    worst_moving: Option<(f64, u64)>,
}

impl SkewReport {
    fn window(&mut self, first: u64, last: u64, ratio: f64, max_over_median: f64, moved: bool) {
        self.windows.push((first, last, ratio));
        if moved && self.worst_moving.is_none_or(|(w, _)| max_over_median > w) {
            self.worst_moving = Some((max_over_median, first));
        }
    }

    fn print(&self, shift: u64) {
        let before = self.windows.iter().rfind(|w| w.1 < shift).map(|w| w.2);
        if let Some(before) = before {
            let back = self
                .windows
                .iter()
                .find(|w| w.0 >= shift && w.2 >= 0.9 * before);
            match back {
                Some(w) => println!(
                    "after the shift: hit ratio back to 90 % of {before:.3} in the window {}-{} ({} steps after the shift at most)",
                    w.0,
                    w.1,
                    w.1 + 1 - shift
                ),
                None => println!("after the shift: hit ratio never back to 90 % of {before:.3}"),
            }
        }
        match self.worst_moving {
            Some((r, first)) => println!(
                "slowest step while experts moved: {r:.2}x its window's median (window from step {first})"
            ),
            None => println!("no experts moved"),
        }
    }
}
