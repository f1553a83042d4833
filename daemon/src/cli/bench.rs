//! `moe-daemon bench …`: synthetic checkpoints and end-to-end decode / prefill benchmarks.
use crate::engine::{Engine, SeqInput};
use clap::{Args, Subcommand};
use moe_kernels::cpu::bench::CpuMoeBenchArgs;
use moe_kernels::cpu::moe::{DecodePath, WeightFormat};
use moe_kernels::cpu::{CpuTier, HugepageMode, NumaMode};
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Write a random checkpoint with a real model's config and tensor names.
    SynthCheckpoint(super::synth::SynthArgs),
    /// Decode throughput: batch of sequences, prompt, then timed decode steps.
    Decode(RunArgs),
    /// Prefill throughput and time to first token of one long prompt.
    Prefill(RunArgs),
    /// CPU expert kernels alone: ms per MoE layer, GB/s and % of the DRAM read bandwidth it measures.
    CpuMoe(CpuMoeArgs),
    /// Perplexity of a text on the CPU backend with the dense weights as stored or as the GPU holds
    /// them under --dense-dtype bf16 / fp8 / int4 (the loader's own quantization round trip).
    Perplexity(super::bench_perplexity::PerplexityArgs),
    /// Decode under a skewed synthetic router whose hot set shifts halfway: GPU hit ratio, tok/s and
    /// slowest step over time for one placement mode (uniform, frequency, live).
    Skew(super::bench_skew::SkewArgs),
}

/// `bench cpu-moe` flags (lists are comma separated).
#[derive(Args, Debug)]
pub struct CpuMoeArgs {
    /// Routed experts per layer.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    pub experts: u32,
    /// Experts each token is routed to.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    pub topk: u32,
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u32).range(1..))]
    pub hidden: u32,
    /// Expert intermediate width.
    #[arg(long, default_value_t = 768, value_parser = clap::value_parser!(u32).range(1..))]
    pub inter: u32,
    /// Expert formats: bf16, fp8, int8, int4, int4g64, int4g128.
    #[arg(long, value_delimiter = ',', default_value = "bf16")]
    pub dtype: Vec<WeightFormat>,
    /// Tokens per layer call.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256,1024")]
    pub tokens: Vec<NonZeroUsize>,
    /// Worker thread counts to measure (default: every CPU this process may use).
    #[arg(long, value_delimiter = ',')]
    pub threads: Vec<NonZeroUsize>,
    /// Distinct layers cycled through, so weights come from DRAM rather than cache.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    pub layers: u32,
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(1..))]
    pub iters: u32,
    /// Cap the kernel tier: scalar, avx2, avx512, amx.
    #[arg(long)]
    pub tier: Option<CpuTier>,
    /// Token count from which the AMX tier uses tiles.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub amx_min: u32,
    #[arg(long, default_value = "auto")]
    pub hugepages: HugepageMode,
    #[arg(long, default_value = "auto")]
    pub numa: NumaMode,
    /// Size of the DRAM bandwidth probe buffer.
    #[arg(long, default_value_t = 4096)]
    pub probe_mib: usize,
    /// Decode paths timed one after the other for each token count (`split`, `fused`, `chained`,
    /// `streams`, options as `DecodePath` parses them; repeats
    /// alternate them); default `MOE_CPU_DECODE`, else chained. Calls above 8 tokens always split.
    #[arg(long, value_delimiter = ',')]
    pub decode_paths: Vec<DecodePath>,
}

impl CpuMoeArgs {
    fn bench_args(&self) -> CpuMoeBenchArgs {
        let defaults = CpuMoeBenchArgs::default();
        let list = |v: &[NonZeroUsize]| v.iter().map(|n| n.get()).collect::<Vec<_>>();
        CpuMoeBenchArgs {
            experts: self.experts as usize,
            topk: self.topk as usize,
            hidden: self.hidden as usize,
            inter: self.inter as usize,
            dtypes: self.dtype.clone(),
            tokens: list(&self.tokens),
            threads: if self.threads.is_empty() {
                defaults.threads
            } else {
                list(&self.threads)
            },
            layers: self.layers as usize,
            iters: self.iters as usize,
            tier: self.tier,
            amx_min_tokens: self.amx_min as usize,
            hugepages: self.hugepages,
            numa: self.numa,
            probe_mib: self.probe_mib,
            paths: if self.decode_paths.is_empty() {
                defaults.paths
            } else {
                self.decode_paths.clone()
            },
        }
    }
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Model directory (config.json + safetensors) or a GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    /// Sequences decoded together; a list (`1,8,32`) times each batch size in turn on the model
    /// loaded once (`bench decode`).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub batch: Vec<NonZeroUsize>,
    #[arg(long, default_value_t = 32)]
    pub prompt_len: usize,
    /// Decode steps timed (after 2 warm-up steps).
    #[arg(long, default_value_t = 32)]
    pub steps: usize,
    /// Prefill chunk (tokens per step); 0 = whole prompt in one step.
    #[arg(long, default_value_t = 0)]
    pub chunk: usize,
    /// `bench decode` only: also time prefills of these prompt lengths with the same loaded model.
    #[arg(long, value_delimiter = ',')]
    pub prefill_lens: Vec<usize>,
    /// `bench decode` on the CUDA backend: after the last batch size, `--ab-rounds` rounds of
    /// `--steps` steps with the start state and then each of these decode-step switches flipped from
    /// it, in turn on the same sequences (the comparison without two runs' noise), then each switch's
    /// effect on the logits (teacher-forced). Switches: graphs, device-routed, prelaunch,
    /// mixed-grouped, walk-mark, early-head, direct-half, fused-segment, fold-norms, o-gemv,
    /// l2-prefetch, caller-works, spare-core, deferN (N routes per token deferred).
    #[arg(long, value_delimiter = ',')]
    pub ab: Vec<crate::engine::gpu::switches::DecodeSwitch>,
    /// Rounds of `--ab`.
    #[arg(long, default_value_t = 3)]
    pub ab_rounds: usize,
    /// Shorthand for `--ab graphs --ab-rounds N`.
    #[arg(long, default_value_t = 0)]
    pub graphs_ab: usize,
    /// `bench decode` with the CUDA backend: also time each `--prefill-lens` prompt with the split of
    /// DRAM experts between GPU and CPU paused (`--gpu-split-min-tokens`), in this process.
    #[arg(long)]
    pub split_ab: bool,
    /// Shorthand for `--ab device-routed --ab-rounds N` (the device-routed experts are on by default:
    /// the A/B flips them off).
    #[arg(long, default_value_t = 0)]
    pub device_routed_ab: usize,
    /// `bench decode` on the CUDA backend: after the last batch size, N rounds of `--steps` steps whose
    /// CPU experts are then timed again without the GPU on the same experts and pool (back to back,
    /// with the step's hand-off gap, with `cpu_moe_bench`'s fixed routing, with fresh random routings),
    /// each against the DRAM probe: what the step adds around the kernels (`bench_replay`). Odd rounds
    /// replace the model's routing with a uniform random one (timings only: their logits are not the
    /// model's).
    #[arg(long, default_value_t = 0)]
    pub cpu_replay: usize,
    /// `bench decode` on the CUDA backend: before decoding, N rounds of the DRAM probe and of the CPU
    /// expert kernels (fresh random routings, batch 1) alone and beside host→device copies of the
    /// packed DRAM experts, and the copies alone: whether the copies add bandwidth (`bench_dma`).
    #[arg(long, default_value_t = 0)]
    pub dma_probe: usize,
    /// `--cpu-replay` only: CPU decode paths (`MOE_CPU_DECODE`'s syntax, e.g. `chained,chained:tail`)
    /// compared in the same process: first `--cpu-replay` rounds of the plain step on each path in
    /// turn; then the replay's rounds 2p and 2p + 1 step on path p, and every round's recorded and
    /// fresh calls are replayed on each path.
    #[arg(long, value_delimiter = ',')]
    pub cpu_paths: Vec<moe_kernels::cpu::moe::DecodePath>,
    #[command(flatten)]
    pub engine: super::engine_args::EngineArgs,
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::SynthCheckpoint(a) => super::synth::run(a),
        BenchCommand::Decode(a) => decode(a),
        BenchCommand::Prefill(a) => prefill(a),
        BenchCommand::Skew(a) => super::bench_skew::run(a),
        BenchCommand::Perplexity(a) => super::bench_perplexity::run(a),
        BenchCommand::CpuMoe(a) => {
            let report = moe_kernels::cpu::bench::run_cpu_moe_bench(&a.bench_args())?;
            print!("{report}");
            Ok(())
        }
    }
}

pub(super) fn prompt(engine: &Engine, len: usize, salt: usize) -> Vec<u32> {
    let v = engine.config().vocab_size as u64;
    (0..len)
        .map(|i| ((i as u64 * 2_654_435_761 + salt as u64 * 40_503 + 17) % v) as u32)
        .collect()
}

fn load(a: &RunArgs) -> anyhow::Result<Engine> {
    let t = Instant::now();
    let mut opts = a.engine.options()?;
    // the longest prompt timed is one step: the memory plan and the load's warm-up cover it
    let longest = a.prefill_lens.iter().copied().max().unwrap_or(0);
    let prompt = if a.chunk == 0 { a.prompt_len } else { a.chunk };
    opts.max_step_tokens = opts.max_step_tokens.max(longest).max(prompt);
    let e = super::model_path::ModelPath::open(&a.model)?.load_engine(&opts)?;
    eprintln!(
        "loaded {} in {:.1} s",
        a.model.display(),
        t.elapsed().as_secs_f64()
    );
    Ok(e)
}

fn prefill_into(
    engine: &Engine,
    cache: &mut crate::engine::SeqCache,
    p: &[u32],
    chunk: usize,
) -> anyhow::Result<Vec<f32>> {
    let chunk = if chunk == 0 { p.len() } else { chunk };
    let mut last = vec![];
    for c in p.chunks(chunk) {
        last = engine
            .reserve_and_forward(&mut [SeqInput { cache, tokens: c }])?
            .remove(0);
    }
    Ok(last)
}

fn decode(a: RunArgs) -> anyhow::Result<()> {
    let engine = load(&a)?;
    for &len in &a.prefill_lens {
        time_prefill(&engine, len, a.chunk, "")?;
    }
    if a.split_ab && engine.pause_split(true) {
        // longer prompts stream every DRAM expert, split or not
        let below = |len: &&usize| **len < a.engine.gpu_prefill_threshold;
        for &len in a.prefill_lens.iter().filter(below) {
            time_prefill(&engine, len, a.chunk, ", split off")?;
        }
        engine.pause_split(false);
    }
    // The DRAM experts' bound (CUDA backend) needs the host's read bandwidth, measured once on the
    // expert pool.
    let pool = engine.cpu_expert_pool().filter(|_| engine.on_gpu());
    let dram_gbs = pool.map(|pool| {
        let gbs = moe_kernels::cpu::bench::measure_dram_read_bw(pool, DRAM_PROBE_MIB);
        println!(
            "DRAM read bandwidth of the expert pool: {gbs:.1} GB/s ({DRAM_PROBE_MIB} MiB probe)"
        );
        gbs
    });
    if a.dma_probe > 0 {
        super::bench_dma::run(&engine, a.dma_probe)?;
    }
    // what the kernel backs the packed experts with (reserved / transparent huge pages or 4 KiB)
    match engine.expert_page_backing() {
        Some(Ok(b)) => println!("packed DRAM experts: {b}"),
        Some(Err(e)) => println!("packed DRAM experts: page backing unknown ({e})"),
        None => {}
    }
    let mut last = None;
    for &batch in &a.batch {
        last = Some(decode_batch(&engine, &a, batch.get(), dram_gbs)?);
    }
    print_gpu_memory(&engine);
    print_expert_gemm_uses(&engine);
    print_host_memory();
    if let (true, Some((caches, next))) = (a.cpu_replay > 0, last.as_mut()) {
        let probe = anyhow::Context::context(
            dram_gbs,
            "--cpu-replay needs the CUDA backend's CPU expert pool",
        )?;
        let (rounds, steps) = (a.cpu_replay, a.steps);
        super::bench_replay::run(&engine, (caches, next), rounds, steps, probe, &a.cpu_paths)?;
    }
    let (switches, rounds) = ab_switches(&a);
    if let (false, Some((caches, next))) = (switches.is_empty(), last.as_mut()) {
        let shape = (a.steps, a.prompt_len);
        super::bench_ab::run(&engine, (caches, next), &switches, rounds, shape, dram_gbs)?;
    }
    Ok(())
}

/// The switches `--ab` (and its shorthands) compares, and the rounds.
fn ab_switches(a: &RunArgs) -> (Vec<crate::engine::gpu::switches::DecodeSwitch>, usize) {
    use crate::engine::gpu::switches::DecodeSwitch;
    let mut switches = a.ab.clone();
    let mut rounds = a.ab_rounds;
    for (n, s) in [
        (a.graphs_ab, DecodeSwitch::Graphs),
        (a.device_routed_ab, DecodeSwitch::DeviceRouted),
    ] {
        if n > 0 {
            if !switches.contains(&s) {
                switches.push(s);
            }
            rounds = if a.ab.is_empty() { n } else { rounds.max(n) };
        }
    }
    (switches, rounds.max(1))
}

/// MiB read by the DRAM bandwidth probe (well beyond any cache).
const DRAM_PROBE_MIB: usize = 2048;

/// `batch` sequences prefilled and decoded together: the throughput line and the step's split.
/// Returns the sequences and their next tokens (for `--ab`).
fn decode_batch(
    engine: &Engine,
    a: &RunArgs,
    batch: usize,
    dram_gbs: Option<f64>,
) -> anyhow::Result<(Vec<crate::engine::SeqCache>, Vec<u32>)> {
    let mut caches: Vec<_> = (0..batch).map(|_| engine.new_cache()).collect();
    let mut next: Vec<u32> = Vec::with_capacity(batch);
    for (i, c) in caches.iter_mut().enumerate() {
        let l = prefill_into(engine, c, &prompt(engine, a.prompt_len, i), a.chunk)?;
        next.push(crate::engine::sampling::argmax(&l) as u32);
    }
    let pool_before = engine.cpu_pool().map(|p| p.region_stats());
    let (elapsed, split) = decode_steps(engine, &mut caches, &mut next, 2, a.steps)?;
    let regions = engine
        .cpu_pool()
        .zip(pool_before)
        .map(|(p, before)| p.region_stats().since(&before));
    let per_step = elapsed / a.steps as f64;
    let layers = engine.config().num_layers as f64;
    println!(
        "decode: batch {} prompt {}: {:.2} ms/step, {:.1} tok/s ({:.1} tok/s per sequence)",
        batch,
        a.prompt_len,
        per_step * 1e3,
        batch as f64 / per_step,
        1.0 / per_step
    );
    let n = a.steps as f64;
    if !engine.on_gpu() {
        let ms = |s: f64| s / n * 1e3;
        println!(
            "  per step: attention {:.2} ms, experts {:.2} ms ({:.3} ms/layer), dense MLP {:.2} ms, final norm + lm_head {:.2} ms, other {:.2} ms",
            ms(split.attention_s),
            ms(split.cpu_experts_s),
            ms(split.cpu_experts_s) / layers,
            ms(split.dense_mlp_s),
            ms(split.head_s),
            ms(elapsed
                - split.attention_s
                - split.cpu_experts_s
                - split.dense_mlp_s
                - split.head_s)
        );
        if let Some(r) = regions {
            // The warm-up steps' regions are in `r` too: per step over every step run.
            let all = (a.steps + 2) as f64;
            println!(
                "  pool regions per step: {:.0}, inside them {:.2} ms (their tails {:.2} ms), outside (the calling thread alone) ~{:.2} ms",
                r.regions as f64 / all,
                r.busy_s / all * 1e3,
                r.tail_s / all * 1e3,
                per_step * 1e3 - r.busy_s / all * 1e3,
            );
        }
        return Ok((caches, next));
    }
    println!(
        "  per step: CPU experts {:.2} ms ({:.3} ms/layer), waiting for GPU {:.2} ms, other host {:.2} ms; GPU served {:.1}% of expert hits",
        split.cpu_experts_s / n * 1e3,
        split.cpu_experts_s / n / layers * 1e3,
        split.gpu_wait_s / n * 1e3,
        (elapsed - split.cpu_experts_s - split.gpu_wait_s) / n * 1e3,
        100.0 * split.gpu_expert_hits as f64 / split.expert_hits.max(1) as f64
    );
    let r = &split.cpu_regions;
    if r.calls > 0 {
        let ms = |s: f64| s / n * 1e3;
        println!(
            "  CPU expert kernels by region, per step: route {:.2} ms, convert {:.2}, gate+up {:.2}, down activations {:.2}, down {:.2}, fused decode region {:.2}, NUMA reduce {:.2} ({:.1} calls per step; the rest of \"CPU experts\" is the hand-off and deferred copies)",
            ms(r.route_s),
            ms(r.convert_s),
            ms(r.gate_up_s),
            ms(r.down_act_s),
            ms(r.down_s),
            ms(r.fused_s),
            ms(r.reduce_s),
            r.calls as f64 / n
        );
    }
    let host = super::bench_host::host_lines(&split, elapsed, a.steps, layers as usize);
    for line in host {
        println!("{line}");
    }
    if let Some(line) = super::bench_ab::handoff_line(&split.handoff) {
        println!(
            "  hand-off per MoE layer ({:.1} layers/step profiled): {line}",
            split.handoff.layers as f64 / n
        );
    }
    if split.device_routed_layers > 0 {
        println!(
            "  device-routed experts: {:.1} MoE layers per step computed their resident experts from the routing on the device (their hits are not in the GPU share above)",
            split.device_routed_layers as f64 / n
        );
    }
    if split.prefetched_bytes > 0 {
        println!(
            "  early routing: {:.1} MB of chosen DRAM experts prefetched per step while attention ran",
            split.prefetched_bytes as f64 / n / 1e6
        );
    }
    if let (Some(gbs), true) = (dram_gbs, split.dram_experts_read > 0) {
        let b = DramBound::of(&split, a.steps, gbs);
        println!(
            "  DRAM bound: {:.1} distinct DRAM experts read per step ({:.1} per MoE layer), {:.2} GB; at {gbs:.1} GB/s {:.2} ms/step = {:.1} tok/s at batch {batch} (this run: {:.0}% of it)",
            b.experts_per_step,
            b.experts_per_step / layers,
            b.bytes_per_step / 1e9,
            b.ms_per_step,
            batch as f64 / b.ms_per_step * 1e3,
            100.0 * b.ms_per_step / (per_step * 1e3)
        );
    }
    Ok((caches, next))
}

/// The decode step's floor set by the DRAM experts: their distinct weights read once per step at the
/// measured DRAM read bandwidth.
struct DramBound {
    experts_per_step: f64,
    bytes_per_step: f64,
    ms_per_step: f64,
}

impl DramBound {
    fn of(t: &crate::engine::StepTimes, steps: usize, gbs: f64) -> Self {
        let steps = steps.max(1) as f64;
        let bytes_per_step = t.dram_expert_bytes as f64 / steps;
        Self {
            experts_per_step: t.dram_experts_read as f64 / steps,
            bytes_per_step,
            ms_per_step: bytes_per_step / (gbs * 1e9) * 1e3,
        }
    }
}

/// `steps` decode steps of every sequence after `warm` untimed ones: seconds and the step split.
pub(super) fn decode_steps(
    engine: &Engine,
    caches: &mut [crate::engine::SeqCache],
    next: &mut Vec<u32>,
    warm: usize,
    steps: usize,
) -> anyhow::Result<(f64, crate::engine::StepTimes)> {
    let mut split = crate::engine::StepTimes::default();
    let mut elapsed = 0.0;
    for step in 0..steps + warm {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut batch = SeqInput::batch(caches, &toks);
        let t = Instant::now();
        let logits = engine.reserve_and_forward(&mut batch)?;
        if step >= warm {
            elapsed += t.elapsed().as_secs_f64();
            split.accumulate(&engine.last_step_times());
        }
        *next = logits
            .iter()
            .map(|l| crate::engine::sampling::argmax(l) as u32)
            .collect();
    }
    Ok((elapsed, split))
}

/// The engine's device memory: planned, allocated at start, and the most in use (step buffers too).
fn print_gpu_memory(engine: &Engine) {
    let (Some(report), Some((_, peak))) = (engine.gpu_memory(), engine.gpu_pool_usage()) else {
        return;
    };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!(
        "  GPU memory: peak {:.2} GiB in use by the engine (plan {:.2} GiB of {:.2} GiB usable; start {:.2} GiB, planned {:.2}); CUDA context etc. {:.2} GiB; dense {}, embeddings {}, {} GPU experts/layer, KV {} positions",
        gib(peak),
        gib(report.plan.total()),
        gib(report.plan.usable_bytes),
        gib(report.start_allocated),
        gib(report.planned_at_start()),
        gib(report.context_used),
        report.plan.dense_dtype.as_str(),
        if report.plan.host_embeddings { "host" } else { "GPU" },
        report.plan.gpu_experts_per_layer,
        report.plan.kv_tokens
    );
}

/// The process's resident host memory by kind (compare with `serve`'s "host memory once loaded"
/// line on the same model).
fn print_host_memory() {
    if let Some(m) = crate::engine::heap::MemoryReport::now() {
        println!("  host memory: {m}");
    }
}

/// How the GPU's expert GEMMs ran: per projection shape and path, the calls and the range of their
/// distinct row counts (and whether `MOE_GROUPED_GEMM` forced the path).
fn print_expert_gemm_uses(engine: &Engine) {
    let Some((uses, forced)) = engine.expert_gemm_uses() else {
        return;
    };
    let how = forced.map_or("by rule".to_string(), |p| {
        format!("forced {} by MOE_GROUPED_GEMM", p.as_str())
    });
    // (m, k, path) -> (calls, fewest and most row counts, as log2 buckets)
    let mut by_shape = std::collections::BTreeMap::new();
    for u in uses {
        let e = by_shape
            .entry((u.kind.m, u.kind.k, u.path))
            .or_insert((0u64, u32::MAX, 0u32));
        e.0 += u.calls;
        e.1 = e.1.min(u.kind.row_counts_log2);
        e.2 = e.2.max(u.kind.row_counts_log2);
    }
    for ((m, k, path), (calls, lo, hi)) in by_shape {
        let low = if lo == 0 { 0 } else { 1u64 << (lo - 1) };
        println!(
            "  expert GEMMs ({how}): {m}x{k} {}: {calls} calls of {low} to {} distinct row counts",
            path.as_str(),
            (1u64 << hi) - 1
        );
    }
}

fn prefill(a: RunArgs) -> anyhow::Result<()> {
    let engine = load(&a)?;
    time_prefill(&engine, a.prompt_len, a.chunk, "")?;
    print_gpu_memory(&engine);
    print_expert_gemm_uses(&engine);
    print_host_memory();
    Ok(())
}

/// Times a prompt of `len` tokens twice (cold, warm); `label` follows "cold" / "warm" in the lines.
fn time_prefill(engine: &Engine, len: usize, chunk: usize, label: &str) -> anyhow::Result<()> {
    // warm-up on a short prompt (kernel compilation, allocator)
    let mut warm = engine.new_cache();
    prefill_into(engine, &mut warm, &prompt(engine, 16, 99), 0)?;
    drop(warm);
    // Twice: the first long prompt also pays one-time costs (GEMM heuristics for new shapes, the
    // stream-ordered allocator growing its pool); the second is what a running server sees.
    for (run, salt) in [("cold", 1), ("warm", 2)] {
        let p = prompt(engine, len, salt);
        let mut cache = engine.new_cache();
        let t = Instant::now();
        prefill_into(engine, &mut cache, &p, chunk)?;
        let s = t.elapsed().as_secs_f64();
        let st = engine.last_step_times();
        let split = if st.split_gpu_experts > 0 {
            let (g, c) = engine.split_rates().unwrap_or((0.0, 0.0));
            format!(
                "; DRAM experts split: {} to the GPU, {} to the CPU (rates {:.1} / {:.1} GB/s)",
                st.split_gpu_experts,
                st.split_cpu_experts,
                g / 1e9,
                c / 1e9
            )
        } else {
            String::new()
        };
        println!(
            "prefill ({run}{label}): {} tokens in {:.3} s = {:.0} tok/s (TTFT {:.0} ms); last step: host time in expert streaming/upload {:.3} s, CPU experts {:.3} s, waiting for GPU {:.3} s, CPU attention {:.3} s, dense MLP {:.3} s, final norm + lm_head {:.3} s{split}",
            p.len(),
            s,
            p.len() as f64 / s,
            s * 1e3,
            st.transfer_s,
            st.cpu_experts_s,
            st.gpu_wait_s,
            st.attention_s,
            st.dense_mlp_s,
            st.head_s,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::DramBound;

    #[test]
    fn the_dram_bound_is_the_distinct_experts_bytes_over_the_bandwidth() {
        // 4 steps reading 64 experts of 9.44 MB each per step, at 100 GB/s
        let t = crate::engine::StepTimes {
            dram_experts_read: 4 * 64,
            dram_expert_bytes: 4 * 64 * 9_440_000,
            ..Default::default()
        };
        let b = DramBound::of(&t, 4, 100.0);
        assert_eq!(b.experts_per_step, 64.0);
        assert!((b.bytes_per_step - 604.16e6).abs() < 1.0);
        assert!((b.ms_per_step - 6.0416).abs() < 1e-9, "{}", b.ms_per_step);
    }
}
