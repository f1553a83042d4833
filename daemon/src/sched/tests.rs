//! Scheduler tests on the scripted model: batching, chunked prefill, prefix reuse, cancellation, limits.
use super::scripted::{ScriptedModel, ScriptedReplies};
use super::*;
use crate::engine::kv::BLOCK;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

const END: u32 = 0;

fn engine(cfg: SchedulerConfig) -> (EngineHandle, Arc<Metrics>) {
    engine_with_kv(cfg, 65_536)
}

/// The scripted model with a KV cache of `kv_cache_tokens` positions.
fn engine_with_kv(cfg: SchedulerConfig, kv_cache_tokens: usize) -> (EngineHandle, Arc<Metrics>) {
    engine_with(cfg, kv_cache_tokens, None)
}

/// The scripted model, with a second, sliding-window table when `window` is set.
fn engine_with(
    cfg: SchedulerConfig,
    kv_cache_tokens: usize,
    window: Option<usize>,
) -> (EngineHandle, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new().unwrap());
    let spec = ScriptedReplies {
        replies: vec![
            (vec![7, 7], (100..180).collect()),
            (vec![8, 8], vec![50, 51, 52]),
        ],
        end_token: END,
        vocab: 200,
        max_positions: 4096,
        kv_cache_tokens,
        step_delay: Duration::from_millis(2),
        step_stats: Some(StepStats {
            cpu_expert_seconds: 0.01,
            expert_hits_gpu: 3,
            expert_hits_total: 4,
        }),
    };
    let model = match window {
        Some(w) => ScriptedModel::with_sliding_window(spec, w),
        None => ScriptedModel::new(spec),
    };
    let h = spawn_engine(move || Ok(model), cfg, metrics.clone());
    while !h.is_ready() {
        std::thread::sleep(Duration::from_millis(1));
    }
    (h, metrics)
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> (GenRequest, UnboundedReceiver<SeqEvent>) {
    let (tx, rx) = unbounded_channel();
    let req = GenRequest {
        prompt,
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop_token_ids: vec![END],
        logprobs: None,
        deadline: None,
        events: tx,
        constraint: None,
    };
    (req, rx)
}

/// Collects tokens until Finished; returns (tokens, reason, cached_tokens).
fn collect(rx: &mut UnboundedReceiver<SeqEvent>) -> (Vec<u32>, FinishReason, usize) {
    let mut out = Vec::new();
    loop {
        match rx.blocking_recv().expect("engine dropped the request") {
            SeqEvent::Token { id, .. } => out.push(id),
            SeqEvent::Finished {
                reason,
                cached_tokens,
                completion_tokens,
                ..
            } => {
                assert_eq!(completion_tokens, out.len());
                return (out, reason, cached_tokens);
            }
            SeqEvent::Error(e) => panic!("{e}"),
        }
    }
}

/// Each prompt submitted after the previous one finished on `h`: the reference outputs.
fn one_at_a_time(h: &EngineHandle, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .map(|p| {
            let (r, mut rx) = request(p.clone(), max_tokens);
            h.submit(r).unwrap();
            collect(&mut rx).0
        })
        .collect()
}

/// Every prompt submitted at once; their event streams in order.
fn submit_each(
    h: &EngineHandle,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Vec<UnboundedReceiver<SeqEvent>> {
    prompts
        .iter()
        .map(|p| {
            let (r, rx) = request(p.clone(), max_tokens);
            h.submit(r).unwrap();
            rx
        })
        .collect()
}

/// Every stream gives its `want` tokens and finishes at the length limit.
fn all_run_to_length(rxs: Vec<UnboundedReceiver<SeqEvent>>, want: &[Vec<u32>]) {
    for (i, (mut rx, want)) in rxs.into_iter().zip(want).enumerate() {
        let (got, reason, _) = collect(&mut rx);
        assert_eq!(&got, want, "request {i}");
        assert_eq!(reason, FinishReason::Length);
    }
}

#[test]
fn concurrent_requests_with_chunked_prefill_match_sequential_results() {
    let cfg = SchedulerConfig {
        max_batch_tokens: 5,
        ..Default::default()
    };
    let (h, _) = engine(cfg);
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|i| {
            let mut p: Vec<u32> = (1..20 + i).collect();
            p.extend(if i % 2 == 0 { [7, 7] } else { [8, 8] });
            p
        })
        .collect();
    let sequential = one_at_a_time(&h, &prompts, 10);
    let mut rxs = submit_each(&h, &prompts, 10);
    for (rx, want) in rxs.iter_mut().zip(&sequential) {
        assert_eq!(&collect(rx).0, want);
    }
    assert_eq!(sequential[0], (100..110).collect::<Vec<_>>());
    assert_eq!(sequential[1], vec![50, 51, 52]);
}

#[test]
fn finish_reasons_stop_and_length() {
    let (h, _) = engine(SchedulerConfig::default());
    let (r, mut rx) = request(vec![1, 8, 8], 100);
    h.submit(r).unwrap();
    assert_eq!(collect(&mut rx), (vec![50, 51, 52], FinishReason::Stop, 0));
    let (r, mut rx) = request(vec![1, 7, 7], 3);
    h.submit(r).unwrap();
    assert_eq!(collect(&mut rx).1, FinishReason::Length);
}

#[test]
fn shared_prompt_prefix_is_reused_from_the_prefix_cache() {
    let (h, m) = engine(SchedulerConfig::default());
    let base: Vec<u32> = (1..41).collect();
    let (r, mut rx) = request([base.clone(), vec![8, 8]].concat(), 5);
    h.submit(r).unwrap();
    assert_eq!(collect(&mut rx).2, 0);
    let (r, mut rx) = request([base, vec![9, 8, 8]].concat(), 5);
    h.submit(r).unwrap();
    let (tokens, _, cached) = collect(&mut rx);
    assert_eq!(cached, 32);
    assert_eq!(tokens, vec![50, 51, 52]);
    assert_eq!(m.prefix_cache_hit_tokens.get(), 32);
}

#[test]
fn dropped_receiver_frees_the_slot() {
    let cfg = SchedulerConfig {
        max_running: 1,
        ..Default::default()
    };
    let (h, m) = engine(cfg);
    let (r, mut rx) = request(vec![7, 7], 1_000_000);
    h.submit(r).unwrap();
    assert!(matches!(rx.blocking_recv(), Some(SeqEvent::Token { .. })));
    drop(rx);
    // With one slot, this only runs once the abandoned sequence is gone.
    let (r, mut rx) = request(vec![8, 8], 10);
    h.submit(r).unwrap();
    assert_eq!(collect(&mut rx).0, vec![50, 51, 52]);
    assert_eq!(m.requests_aborted.get(), 1);
}

#[test]
fn full_queue_is_refused_and_deadlines_end_requests() {
    let cfg = SchedulerConfig {
        max_running: 1,
        max_waiting: 1,
        ..Default::default()
    };
    let (h, _) = engine(cfg);
    let (mut r, mut rx) = request(vec![7, 7], 1_000_000);
    r.deadline = Some(Instant::now() + Duration::from_millis(60));
    h.submit(r).unwrap();
    assert!(matches!(rx.blocking_recv(), Some(SeqEvent::Token { .. })));
    let (r2, _rx2) = request(vec![1], 1);
    h.submit(r2).unwrap();
    let (r3, _rx3) = request(vec![1], 1);
    // The second waits (its slot is taken); the third finds the queue full.
    let refused = h.submit(r3);
    assert!(
        matches!(refused, Err(SubmitError::QueueFull(_))),
        "{refused:?}"
    );
    let timed_out = loop {
        match rx.blocking_recv() {
            Some(SeqEvent::Error(e)) => break e,
            Some(_) => continue,
            None => panic!("closed without an error"),
        }
    };
    assert!(timed_out.contains("timed out"));
}

struct EvenTokensThenStop(usize);

impl TokenConstraint for EvenTokensThenStop {
    fn apply(&mut self, logits: &mut [f32]) -> bool {
        for (id, l) in logits.iter_mut().enumerate() {
            if !(id.is_multiple_of(2) && id as u32 != END) {
                *l = f32::NEG_INFINITY;
            }
        }
        true
    }
    fn advance(&mut self, _: u32) {
        self.0 += 1;
    }
    fn is_complete(&self) -> bool {
        self.0 == 3
    }
}

#[test]
fn constraint_masks_tokens_and_ends_the_sequence_when_complete() {
    let (h, _) = engine(SchedulerConfig::default());
    let (mut r, mut rx) = request(vec![8, 8], 100);
    r.constraint = Some(Box::new(EvenTokensThenStop(0)));
    h.submit(r).unwrap();
    let (tokens, reason, _) = collect(&mut rx);
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(tokens.len(), 3);
    assert_eq!(tokens[0], 50, "allowed scripted token kept");
    assert!(
        tokens.iter().all(|t| t.is_multiple_of(2) && *t != END),
        "{tokens:?}"
    );
}

#[test]
fn engine_step_stats_feed_the_expert_metrics() {
    let (h, m) = engine(SchedulerConfig::default());
    let (r, mut rx) = request(vec![8, 8], 10);
    h.submit(r).unwrap();
    collect(&mut rx);
    assert!(m.cpu_expert_seconds.get_sample_count() >= 4);
    assert_eq!(m.gpu_expert_hit_ratio.get(), 0.75);
}

/// Runs each prompt alone on a roomy cache: the reference outputs.
fn alone(prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    one_at_a_time(&engine(SchedulerConfig::default()).0, prompts, max_tokens)
}

#[test]
fn preemption_under_load_keeps_every_output_equal_to_running_alone() {
    // 64 requests of 24 prompt + 40 output positions (4 blocks each) on a cache of 32 blocks, which
    // holds 8 of them: the scheduler must preempt and recompute, and every output must be unchanged.
    let prompts: Vec<Vec<u32>> = (0..64u32)
        .map(|i| {
            let mut p: Vec<u32> = (0..22).map(|j| 1 + (i * 7 + j) % 90).collect();
            p.extend([7, 7]);
            p
        })
        .collect();
    let want = alone(&prompts, 40);
    let cfg = SchedulerConfig {
        max_batch_tokens: 64,
        max_waiting: 64,
        ..Default::default()
    };
    let (h, m) = engine_with_kv(cfg, 32 * BLOCK);
    all_run_to_length(submit_each(&h, &prompts, 40), &want);
    assert_eq!(want[0], (100..140).collect::<Vec<_>>());
    assert!(
        m.preemptions.get() > 0,
        "the cache never ran out: the test proves nothing"
    );
}

#[test]
fn prefix_hit_after_the_cache_ran_full_resumes_from_the_right_positions() {
    // The trigger sits in the first block, so a prefix served from the wrong blocks or positions loses
    // it and the answer changes. The cache holds 6 blocks: a long running request leaves too little
    // room for the second prompt (it waits or preempts) and the prefix entry must be shared, not copied.
    let shared: Vec<u32> = [vec![8, 8], (10..40).collect()].concat(); // 32 positions: 2 full blocks
    let first = [shared.clone(), vec![41, 42, 43]].concat();
    let second = [shared.clone(), vec![44, 45]].concat();
    let long = [vec![7, 7], (50..70).collect()].concat();
    let want = alone(&[first.clone(), second.clone(), long.clone()], 3);
    let (h, m) = engine_with_kv(SchedulerConfig::default(), 6 * BLOCK);
    let (r, mut rx) = request(first, 3);
    h.submit(r).unwrap();
    assert_eq!(collect(&mut rx).0, want[0]);
    let (r, mut long_rx) = request(long, 60);
    h.submit(r).unwrap();
    let (r, mut rx) = request(second, 3);
    h.submit(r).unwrap();
    let (got, _, cached) = collect(&mut rx);
    assert_eq!(got, want[1]);
    let (long_out, ..) = collect(&mut long_rx);
    assert_eq!(long_out[..3], want[2][..]);
    assert_eq!(long_out.len(), 60);
    // Either the prefix was served (32 positions) or it was evicted for room: never a partial one.
    assert!(cached == 32 || cached == 0, "{cached}");
    assert!(m.prefix_cache_hit_tokens.get() == cached as u64);
}

#[test]
fn a_prompt_the_cache_can_never_hold_is_refused_at_once() {
    let (h, _) = engine_with_kv(SchedulerConfig::default(), 2 * BLOCK);
    let (r, mut rx) = request((1..40).collect(), 1);
    h.submit(r).unwrap();
    match rx.blocking_recv() {
        Some(SeqEvent::Error(e)) => assert!(e.contains("KV cache"), "{e}"),
        other => panic!("expected an error, got {other:?}"),
    }
    let (r, mut rx) = request(vec![300, 8, 8], 1);
    h.submit(r).unwrap();
    match rx.blocking_recv() {
        Some(SeqEvent::Error(e)) => assert!(e.contains("vocabulary"), "{e}"),
        other => panic!("expected an error, got {other:?}"),
    }
    // The refusals took no queue slot and the engine still serves.
    assert_eq!(h.state.waiting.load(Ordering::Acquire), 0);
    let (r, mut rx) = request(vec![8, 8], 5);
    h.submit(r).unwrap();
    assert_eq!(collect(&mut rx).0, vec![50, 51, 52]);
}

#[test]
fn a_request_is_queued_whole_or_not_at_all() {
    let cfg = SchedulerConfig {
        max_running: 1,
        max_waiting: 3,
        ..Default::default()
    };
    let (h, _) = engine(cfg);
    let many: Vec<_> = (0..4).map(|_| request(vec![8, 8], 3)).collect();
    let (reqs, _rxs): (Vec<_>, Vec<_>) = many.into_iter().unzip();
    assert!(matches!(
        h.submit_all(reqs),
        Err(SubmitError::TooManySequences { n: 4, max: 3 })
    ));
    assert_eq!(
        h.state.waiting.load(Ordering::Acquire),
        0,
        "nothing was queued"
    );
    // Two waiting leave room for one more sequence: a request of two is refused as a whole.
    let (r, mut busy) = request(vec![7, 7], 1_000_000);
    h.submit(r).unwrap();
    assert!(matches!(busy.blocking_recv(), Some(SeqEvent::Token { .. })));
    let (a, mut rx_a) = request(vec![8, 8], 3);
    let (b, mut rx_b) = request(vec![8, 8], 3);
    h.submit_all(vec![a, b]).unwrap();
    let (c, _rx_c) = request(vec![8, 8], 3);
    let (d, _rx_d) = request(vec![8, 8], 3);
    assert!(matches!(
        h.submit_all(vec![c, d]),
        Err(SubmitError::QueueFull(2))
    ));
    drop(busy);
    assert_eq!(collect(&mut rx_a).0, vec![50, 51, 52]);
    assert_eq!(collect(&mut rx_b).0, vec![50, 51, 52]);
}

/// A model whose second table slides over 20 positions (its blocks given back as they leave the
/// window), on a cache too small for the load: preemption, recompute, chunked prefill and prefix hits
/// all go through both tables, every query's window reads the right tokens (the scripted model checks)
/// and every output equals the request run alone.
#[test]
fn sliding_window_tables_under_preemption_and_prefix_reuse() {
    // Group 0 shares a 64-token prefix; group 1 shares only its first 32 tokens (a cached group-0
    // entry has given back the windowed blocks those would need: it must be recomputed, not resumed);
    // group 2 shares its own 64. The trigger ends each prompt.
    let shared: Vec<u32> = (0..64).map(|j| 1 + j % 90).collect();
    let prompts: Vec<Vec<u32>> = (0..48u32)
        .map(|i| {
            let mut p: Vec<u32> = match i % 3 {
                0 => shared.clone(),
                1 => [&shared[..32], &(40..72).collect::<Vec<_>>()].concat(),
                _ => (0..64).map(|j| 1 + (j * 7 + 3) % 90).collect(),
            };
            p.extend((0..5).map(|j| 1 + (i * 7 + j) % 90));
            p.extend([7, 7]);
            p
        })
        .collect();
    let want = alone(&prompts, 40);
    let cfg = SchedulerConfig {
        max_batch_tokens: 40,
        max_waiting: 64,
        ..Default::default()
    };
    // 40 blocks: a request holds up to 7 full-table blocks and 2-4 windowed ones.
    let (h, m) = engine_with(cfg, 40 * BLOCK, Some(20));
    all_run_to_length(submit_each(&h, &prompts, 40), &want);
    assert!(m.preemptions.get() > 0, "the cache never ran out");
    assert!(m.prefix_cache_hit_tokens.get() > 0, "no prefix was reused");
}

/// A cached prefix whose windowed table has given back the blocks a shorter shared prefix would need
/// (and whose blocks were reused since) is not resumed from: the request is computed from the start.
#[test]
fn a_cached_prefix_without_its_window_is_recomputed_not_resumed() {
    let shared: Vec<u32> = (0..64).map(|j| 1 + j % 90).collect();
    let first = [shared.clone(), vec![41, 42, 7, 7]].concat();
    let filler = [
        (100..180).map(|j| j % 90 + 1).collect::<Vec<u32>>(),
        vec![7, 7],
    ]
    .concat();
    let second = [&shared[..32], &(40..72).collect::<Vec<u32>>(), &[43, 7, 7]].concat();
    let want = alone(&[first.clone(), filler.clone(), second.clone()], 4);
    let (h, _) = engine_with(SchedulerConfig::default(), 24 * BLOCK, Some(20));
    for (i, p) in [first, filler, second].into_iter().enumerate() {
        let (r, mut rx) = request(p, 4);
        h.submit(r).unwrap();
        let (got, _, cached) = collect(&mut rx);
        assert_eq!(got, want[i], "request {i}");
        if i == 2 {
            // The first prompt's entry matches 32 positions, but its windowed table gave back
            // positions 0-31 while a query at 32 reads 13-32: nothing is served from it.
            assert_eq!(cached, 0);
        }
    }
}
