//! The KV-pressure scenario shared by the CPU test (CI) and the GPU test (H200): requests that share a
//! prompt prefix, served by the real scheduler on a KV cache that holds about two of them at a time, so
//! the scheduler must share cached prefix blocks, evict them and preempt running sequences. Every output
//! must equal the same request run alone on a roomy cache.
use moe_daemon::engine::sampling::SamplingParams;
use moe_daemon::engine::{Engine, EngineOptions};
use moe_daemon::metrics::Metrics;
use moe_daemon::sched::{spawn_engine, EngineHandle, GenRequest, SchedulerConfig, SeqEvent};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Output tokens and each one's log-probability.
pub type Output = (Vec<u32>, Vec<f32>);

const MAX_TOKENS: usize = 10;

fn start(dir: &Path, opts: EngineOptions, metrics: Arc<Metrics>) -> EngineHandle {
    let dir: PathBuf = dir.to_path_buf();
    let cfg = SchedulerConfig {
        max_batch_tokens: 48,
        ..Default::default()
    };
    let h = spawn_engine(move || Engine::load(&dir, &opts), cfg, metrics);
    while !h.is_ready() {
        assert!(
            !h.state.stopped.load(std::sync::atomic::Ordering::Acquire),
            "the engine failed to load"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    h
}

fn submit(h: &EngineHandle, prompt: Vec<u32>) -> UnboundedReceiver<SeqEvent> {
    let (events, rx) = unbounded_channel();
    h.submit(GenRequest {
        prompt,
        sampling: SamplingParams::greedy(),
        max_tokens: MAX_TOKENS,
        stop_token_ids: vec![],
        logprobs: Some(0),
        deadline: None,
        events,
        constraint: None,
    })
    .unwrap();
    rx
}

fn collect(mut rx: UnboundedReceiver<SeqEvent>) -> Output {
    let (mut ids, mut lps) = (vec![], vec![]);
    loop {
        match rx.blocking_recv().expect("engine dropped the request") {
            SeqEvent::Token { id, logprob } => {
                ids.push(id);
                lps.push(logprob.expect("logprobs were asked for").logprob);
            }
            SeqEvent::Finished { .. } => return (ids, lps),
            SeqEvent::Error(e) => panic!("request failed: {e}"),
        }
    }
}

/// 10 prompts: a 40-token prefix shared by all (two full blocks of 16 cached and shared), then 3 to 12
/// tokens of their own; ids from a fixed xorshift stream below `vocab`.
pub fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    let mut stream = super::xorshift(0x9E37_79B9_7F4A_7C15);
    let mut next = move || (stream() % vocab as u64) as u32;
    let prefix: Vec<u32> = (0..40).map(|_| next()).collect();
    (0..10)
        .map(|i| {
            let tail: Vec<u32> = (0..3 + i).map(|_| next()).collect();
            [prefix.clone(), tail].concat()
        })
        .collect()
}

/// Runs the scenario: returns (outputs alone on a roomy cache, outputs under pressure, metrics of the
/// pressured engine).
pub fn run(
    dir: &Path,
    opts: &EngineOptions,
    vocab: u32,
) -> (Vec<Output>, Vec<Output>, Arc<Metrics>) {
    run_with(dir, opts, vocab, 160)
}

/// [`run`] with the tight cache's size in positions of every layer (models whose sliding-window layers
/// give back blocks fit more in the same bytes, so they need a tighter one to be under pressure).
pub fn run_with(
    dir: &Path,
    opts: &EngineOptions,
    vocab: u32,
    tight_tokens: usize,
) -> (Vec<Output>, Vec<Output>, Arc<Metrics>) {
    let prompts = prompts(vocab);
    let roomy = start(
        dir,
        EngineOptions {
            kv_cache_tokens: 4096,
            ..opts.clone()
        },
        Arc::new(Metrics::new().unwrap()),
    );
    let alone: Vec<Output> = prompts
        .iter()
        .map(|p| collect(submit(&roomy, p.clone())))
        .collect();
    drop(roomy);
    // 10 blocks of 16: one request needs 4 (at most 52 prompt + 10 output positions), the cached prefix 2.
    let metrics = Arc::new(Metrics::new().unwrap());
    let tight = start(
        dir,
        EngineOptions {
            kv_cache_tokens: tight_tokens,
            ..opts.clone()
        },
        metrics.clone(),
    );
    // The first request alone fills the prefix cache; the rest arrive together.
    let mut under_pressure = vec![collect(submit(&tight, prompts[0].clone()))];
    let rxs: Vec<_> = prompts[1..]
        .iter()
        .map(|p| submit(&tight, p.clone()))
        .collect();
    under_pressure.extend(rxs.into_iter().map(collect));
    (alone, under_pressure, metrics)
}

/// Tokens equal, log-probabilities within `tol`, and the pressure really happened.
pub fn check(alone: &[Output], pressured: &[Output], metrics: &Metrics, tol: f32) {
    for (i, (a, b)) in alone.iter().zip(pressured).enumerate() {
        assert_eq!(a.0, b.0, "request {i}: tokens differ from the run alone");
        for (x, y) in a.1.iter().zip(&b.1) {
            assert!(
                (x - y).abs() <= tol,
                "request {i}: logprob {y} vs {x} alone"
            );
        }
    }
    assert!(
        metrics.preemptions.get() > 0,
        "no preemption happened: the cache was not under pressure"
    );
    assert!(
        metrics.prefix_cache_hit_tokens.get() > 0,
        "no prefix was served from the cache"
    );
}
