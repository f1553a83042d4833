//! The engine loop: schedule → forward → update, one screen each.
//!
//! The scheduler owns every KV decision (vLLM v1's shape): before a step it reserves the blocks each
//! scheduled chunk will write, so the model never finds the cache full. When a reservation fails it
//! first evicts cached prefixes (least recently used), then preempts the newest running sequence: its
//! blocks are freed and it goes back to the front of the queue with the tokens it has generated, to be
//! recomputed when memory allows (its output continues exactly where it stopped). A sequence's
//! linear-attention state (hybrid models) lives in its cache and goes with it: preemption drops it and
//! the recompute rebuilds it; such caches never enter the prefix cache.
use super::constraint::sample_next;
use super::prefix_cache::PrefixCache;
use super::{
    EngineState, FinishReason, GenRequest, SchedulerConfig, SeqEvent, StepModel, StepStats,
    TokenLogprob, IDLE_POLL,
};
use crate::engine::kv::{KvError, SeqCache, BLOCK};
use crate::engine::sampling::{log_softmax, Sampler};
use crate::metrics::Metrics;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::Instant;

/// A request and what it has produced so far; lives in the waiting queue or, with a cache, running.
struct Sequence {
    req: GenRequest,
    generated: Vec<u32>,
    sampler: Sampler,
    /// Prompt tokens served from the prefix cache at first admission (reported as usage).
    cached_tokens: usize,
    arrived: Instant,
    /// Set at first admission (a preempted sequence is not queued twice in the metrics).
    admitted: bool,
    last_token_at: Option<Instant>,
}

impl Sequence {
    fn new(req: GenRequest) -> Self {
        Self {
            sampler: Sampler::new(&req.sampling),
            req,
            generated: Vec::new(),
            cached_tokens: 0,
            arrived: Instant::now(),
            admitted: false,
            last_token_at: None,
        }
    }

    /// Prompt and generated tokens: what the cache must hold before the next token is sampled.
    fn total_len(&self) -> usize {
        self.req.prompt.len() + self.generated.len()
    }

    fn token(&self, i: usize) -> u32 {
        let p = self.req.prompt.len();
        if i < p {
            self.req.prompt[i]
        } else {
            self.generated[i - p]
        }
    }

    fn tokens(&self) -> Vec<u32> {
        (0..self.total_len()).map(|i| self.token(i)).collect()
    }
}

struct Running {
    seq: Sequence,
    cache: SeqCache,
}

/// What one step computes for one running sequence: positions `start..start + len`.
struct Work {
    seq: usize,
    start: usize,
    len: usize,
}

/// Outcome of making room for a running sequence's chunk.
enum Room {
    Reserved,
    /// Even with every newer sequence preempted and no cached prefix left it does not fit.
    Exhausted,
    Failed(KvError),
}

pub(super) struct Scheduler<M: StepModel> {
    model: M,
    cfg: SchedulerConfig,
    rx: mpsc::Receiver<GenRequest>,
    state: Arc<EngineState>,
    metrics: Arc<Metrics>,
    waiting: VecDeque<Sequence>,
    /// Oldest admission first; the newest is preempted first.
    running: Vec<Running>,
    prefixes: PrefixCache<SeqCache>,
    /// Cumulative expert activations (GPU-served, all) for the hit-share gauge.
    expert_hits: (u64, u64),
}

impl<M: StepModel> Scheduler<M> {
    pub(super) fn new(
        model: M,
        cfg: SchedulerConfig,
        rx: mpsc::Receiver<GenRequest>,
        state: Arc<EngineState>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let prefixes = PrefixCache::new(cfg.prefix_cache_entries, cfg.prefix_cache_tokens);
        Self {
            model,
            cfg,
            rx,
            state,
            metrics,
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefixes,
            expert_hits: (0, 0),
        }
    }

    /// Runs until every [`super::EngineHandle`] is gone and no work is left.
    pub(super) fn run(mut self) {
        loop {
            if !self.intake() {
                return;
            }
            self.drop_finished_or_abandoned();
            self.publish_gauges();
            let work = self.schedule();
            if work.is_empty() {
                continue;
            }
            let t0 = Instant::now();
            self.prepare_constraints(&work);
            // The step's engine figures are recorded before its tokens go out, so a client that has
            // seen its last token also sees the metrics of the step that produced it.
            match self.forward(&work) {
                Ok(logits) => {
                    if let Some(st) = self.model.last_step_stats() {
                        self.record_step_stats(st);
                    }
                    if let Some(live) = self.model.live_placement_stats() {
                        self.record_live_stats(&live);
                    }
                    self.update(&work, logits)
                }
                Err(e) => self.fail(&work, &e),
            }
            self.metrics
                .step_seconds
                .observe(t0.elapsed().as_secs_f64());
            self.publish_gauges();
        }
    }

    /// Longest sequence the model and its KV cache hold with this scheduler's steps in flight.
    fn max_positions(&self) -> usize {
        self.model
            .max_positions_with_steps(self.cfg.max_batch_tokens.max(1))
    }

    /// Moves submitted requests into the waiting queue; blocks (briefly) when idle. False: shut down.
    fn intake(&mut self) -> bool {
        if self.running.is_empty() && self.waiting.is_empty() {
            match self.rx.recv_timeout(IDLE_POLL) {
                Ok(req) => self.enqueue(req),
                Err(mpsc::RecvTimeoutError::Timeout) => return true,
                Err(mpsc::RecvTimeoutError::Disconnected) => return false,
            }
        }
        while let Ok(req) = self.rx.try_recv() {
            self.enqueue(req);
        }
        true
    }

    /// Queues a request, or answers it with an error at once if no step could ever run it.
    fn enqueue(&mut self, req: GenRequest) {
        let vocab = self.model.vocab_size();
        let problem = if req.prompt.is_empty() {
            Some("the prompt is empty".to_string())
        } else if let Some(id) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            Some(format!(
                "token id {id} is outside the vocabulary (size {vocab})"
            ))
        } else if req.prompt.len() >= self.max_positions() {
            Some(format!(
                "the prompt has {} tokens; the context (and KV cache) holds {}",
                req.prompt.len(),
                self.max_positions()
            ))
        } else {
            None
        };
        if let Some(problem) = problem {
            self.state.waiting.fetch_sub(1, Ordering::AcqRel);
            let _ = req.events.send(SeqEvent::Error(problem));
            return;
        }
        self.waiting.push_back(Sequence::new(req));
    }

    /// Frees sequences whose client has gone or whose deadline passed, waiting or running.
    fn drop_finished_or_abandoned(&mut self) {
        let now = Instant::now();
        let expired = |r: &GenRequest| r.deadline.is_some_and(|d| now >= d);
        let before = self.waiting.len();
        self.waiting.retain(|w| {
            if expired(&w.req) {
                let _ = w
                    .req
                    .events
                    .send(SeqEvent::Error("request timed out while waiting".into()));
            }
            !(w.req.events.is_closed() || expired(&w.req))
        });
        let removed = before - self.waiting.len();
        self.state.waiting.fetch_sub(removed, Ordering::AcqRel);
        let metrics = &self.metrics;
        self.running.retain(|r| {
            let req = &r.seq.req;
            if expired(req) {
                let _ = req.events.send(SeqEvent::Error("request timed out".into()));
            }
            let gone = req.events.is_closed() || expired(req);
            if gone {
                metrics.requests_aborted.inc();
            }
            !gone
        });
    }

    /// Token budget: running sequences first (oldest first), then admissions from the waiting queue.
    fn schedule(&mut self) -> Vec<Work> {
        let mut budget = self.cfg.max_batch_tokens.max(1);
        let mut work = Vec::new();
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let r = &self.running[i];
            let start = r.cache.len();
            let len = (r.seq.total_len() - start).min(budget);
            match self.make_room(i, start + len) {
                Room::Reserved => {
                    budget -= len;
                    work.push(Work { seq: i, start, len });
                    i += 1;
                }
                // Everything newer is gone already: this one waits for older ones to finish.
                Room::Exhausted if i > 0 => self.preempt(i),
                // The oldest sequence alone outgrows the whole cache: it can never run.
                Room::Exhausted => {
                    let r = self.running.remove(i);
                    let _ = r.seq.req.events.send(SeqEvent::Error(
                        "the sequence no longer fits in the KV cache".into(),
                    ));
                }
                Room::Failed(e) => {
                    let r = self.running.remove(i);
                    let _ = r.seq.req.events.send(SeqEvent::Error(e.to_string()));
                }
            }
        }
        while budget > 0 && self.running.len() < self.cfg.max_running {
            let Some(len) = self.admit(budget) else {
                break;
            };
            budget -= len;
            let r = self.running.len() - 1;
            let start = self.running[r].cache.len();
            work.push(Work { seq: r, start, len });
        }
        work
    }

    /// Reserves positions `0..positions` for running sequence `i`, evicting cached prefixes and then
    /// preempting newer sequences until it fits.
    fn make_room(&mut self, i: usize, positions: usize) -> Room {
        loop {
            match self.running[i].cache.reserve(positions) {
                Ok(()) => return Room::Reserved,
                Err(KvError::Full { .. }) => {
                    if self.prefixes.evict_lru().is_some() {
                        continue;
                    }
                    if self.running.len() - 1 > i {
                        self.preempt(self.running.len() - 1);
                        continue;
                    }
                    return Room::Exhausted;
                }
                Err(e) => return Room::Failed(e),
            }
        }
    }

    /// Frees running sequence `i`'s blocks and puts it back at the front of the queue.
    fn preempt(&mut self, i: usize) {
        let r = self.running.remove(i);
        drop(r.cache);
        self.metrics.preemptions.inc();
        tracing::debug!(
            tokens = r.seq.total_len(),
            "KV cache full: preempted the newest sequence (it is recomputed later)"
        );
        self.state.waiting.fetch_add(1, Ordering::AcqRel);
        self.waiting.push_front(r.seq);
    }

    /// Admits the front of the queue if its first chunk fits (after evicting cached prefixes, never
    /// preempting); returns that chunk's length.
    fn admit(&mut self, budget: usize) -> Option<usize> {
        let tokens = self.waiting.front()?.tokens();
        let (mut cache, cached) = match self.prefixes.lookup(&tokens) {
            // The cache's own length is the truth (a shorter entry than its key is recomputed from
            // where it ends).
            Some((mut c, n)) => {
                c.truncate(n);
                let held = c.len();
                (c, held)
            }
            None => (self.model.new_cache(), 0),
        };
        let len = (tokens.len() - cached).min(budget);
        loop {
            match cache.reserve(cached + len) {
                Ok(()) => break,
                Err(KvError::Full { .. }) if self.prefixes.evict_lru().is_some() => {}
                Err(_) => return None,
            }
        }
        let mut seq = self.waiting.pop_front()?;
        self.state.waiting.fetch_sub(1, Ordering::AcqRel);
        if !seq.admitted {
            seq.admitted = true;
            seq.cached_tokens = cached;
            self.metrics.prefix_cache_hit_tokens.inc_by(cached as u64);
            self.metrics
                .queue_seconds
                .observe(seq.arrived.elapsed().as_secs_f64());
        }
        self.running.push(Running { seq, cache });
        Some(len)
    }

    /// The constraints of sequences that sample in this step start their next masks, so they are
    /// computed while the forward pass runs.
    fn prepare_constraints(&mut self, work: &[Work]) {
        for w in work {
            let s = &mut self.running[w.seq].seq;
            if w.start + w.len == s.total_len() {
                if let Some(c) = s.req.constraint.as_deref_mut() {
                    c.prepare();
                }
            }
        }
    }

    fn forward(&mut self, work: &[Work]) -> Result<Vec<Vec<f32>>, String> {
        // Each sequence appears at most once in `work`; hand out disjoint &mut caches in work order.
        let mut slots: Vec<Option<&mut Running>> = self.running.iter_mut().map(Some).collect();
        let mut chunks: Vec<Vec<u32>> = Vec::with_capacity(work.len());
        let mut caches = Vec::with_capacity(work.len());
        for w in work {
            let r = slots[w.seq].take().ok_or("sequence scheduled twice")?;
            chunks.push((w.start..w.start + w.len).map(|i| r.seq.token(i)).collect());
            caches.push(&mut r.cache);
        }
        let batch = caches
            .into_iter()
            .zip(chunks.iter().map(Vec::as_slice))
            .collect();
        self.model.forward(batch)
    }

    fn update(&mut self, work: &[Work], logits: Vec<Vec<f32>>) {
        let mut finished = Vec::new();
        let max_positions = self.max_positions();
        for (w, logits) in work.iter().zip(logits) {
            let Running { seq: s, cache } = &mut self.running[w.seq];
            let p = s.req.prompt.len();
            if w.start + w.len < s.total_len() {
                continue; // prefill (or recompute) chunk: no token yet
            }
            // Caches with a linear-attention state cannot be cut back to a prefix: models with linear
            // layers get no prefix reuse (every prompt is computed in full).
            if s.generated.is_empty()
                && cache.supports_prefix_reuse()
                && self.prefixes.would_store(&s.req.prompt)
            {
                let aligned = p / BLOCK * BLOCK;
                let mut shared = cache.clone();
                shared.truncate(aligned);
                self.prefixes
                    .insert(s.req.prompt[..aligned].to_vec(), shared);
            }
            let id = sample_next(
                &mut s.sampler,
                s.req.constraint.as_deref_mut(),
                &logits,
                &s.req.prompt,
                &s.generated,
            );
            let now = Instant::now();
            match s.last_token_at {
                None => {
                    self.metrics
                        .ttft_seconds
                        .observe((now - s.arrived).as_secs_f64());
                    self.metrics.prompt_tokens.inc_by(p as u64);
                }
                Some(t) => self
                    .metrics
                    .inter_token_seconds
                    .observe((now - t).as_secs_f64()),
            }
            s.last_token_at = Some(now);
            let reason = if let Some(id) = id.filter(|id| !s.req.stop_token_ids.contains(id)) {
                s.generated.push(id);
                self.metrics.generation_tokens.inc();
                let logprob = s.req.logprobs.map(|k| token_logprob(&logits, id, k));
                let _ = s.req.events.send(SeqEvent::Token { id, logprob });
                let full = s.total_len() >= max_positions;
                (s.generated.len() >= s.req.max_tokens || full).then_some(FinishReason::Length)
            } else {
                Some(FinishReason::Stop)
            };
            if let Some(reason) = reason {
                let _ = s.req.events.send(SeqEvent::Finished {
                    reason,
                    prompt_tokens: p,
                    completion_tokens: s.generated.len(),
                    cached_tokens: s.cached_tokens,
                });
                self.metrics
                    .e2e_seconds
                    .observe(s.arrived.elapsed().as_secs_f64());
                self.metrics.requests_finished.inc();
                finished.push(w.seq);
            }
        }
        self.remove(finished);
    }

    /// The model failed the whole step (a backend error, not a property of one request: requests are
    /// checked when queued): every sequence in it ends with the error.
    fn fail(&mut self, work: &[Work], error: &str) {
        tracing::error!(error, "engine step failed; failing its sequences");
        for w in work {
            let _ = self.running[w.seq]
                .seq
                .req
                .events
                .send(SeqEvent::Error(format!("engine step failed: {error}")));
        }
        self.remove(work.iter().map(|w| w.seq).collect());
    }

    fn remove(&mut self, mut idx: Vec<usize>) {
        idx.sort_unstable();
        idx.dedup();
        for i in idx.into_iter().rev() {
            self.running.remove(i);
        }
    }

    fn record_step_stats(&mut self, st: StepStats) {
        self.metrics
            .cpu_expert_seconds
            .observe(st.cpu_expert_seconds);
        self.expert_hits.0 += st.expert_hits_gpu;
        self.expert_hits.1 += st.expert_hits_total;
        if self.expert_hits.1 > 0 {
            let share = self.expert_hits.0 as f64 / self.expert_hits.1 as f64;
            self.metrics.gpu_expert_hit_ratio.set(share);
        }
    }

    fn record_live_stats(&mut self, live: &crate::engine::live::LiveStats) {
        let m = &self.metrics;
        for (layer, r) in live.hit_ratio.iter().enumerate() {
            if let Some(r) = r {
                m.gpu_expert_hit_ratio_layer
                    .with_label_values(&[layer.to_string()])
                    .set(*r);
            }
        }
        let seen = m.expert_moves.get();
        m.expert_moves.inc_by(live.moves_total.saturating_sub(seen));
        m.expert_moves_per_minute.set(live.moves_last_minute as f64);
    }

    fn publish_gauges(&self) {
        self.state
            .running
            .store(self.running.len(), Ordering::Release);
        self.metrics.num_waiting.set(self.waiting.len() as i64);
        self.metrics.num_running.set(self.running.len() as i64);
        self.metrics.kv_cache_usage.set(self.model.kv_usage());
    }
}

/// The chosen token's log-probability under the model's distribution, and the `k` most likely tokens.
fn token_logprob(logits: &[f32], id: u32, k: usize) -> TokenLogprob {
    let lp = log_softmax(logits);
    let mut top = Vec::new();
    if k > 0 {
        let mut idx: Vec<usize> = (0..lp.len()).collect();
        let k = k.min(idx.len());
        idx.select_nth_unstable_by(k - 1, |&a, &b| lp[b].total_cmp(&lp[a]));
        idx.truncate(k);
        idx.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]));
        top = idx.into_iter().map(|i| (i as u32, lp[i])).collect();
    }
    TokenLogprob {
        logprob: lp.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY),
        top,
    }
}
