//! The engine loop: schedule → forward → update, one screen each.
use super::constraint::sample_next;
use super::prefix_cache::{PrefixCache, BLOCK};
use super::{
    EngineState, FinishReason, GenRequest, SchedulerConfig, SeqEvent, StepModel, StepStats,
    TokenLogprob, IDLE_POLL,
};
use crate::engine::sampling::{log_softmax, Sampler};
use crate::metrics::Metrics;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::Instant;

struct Sequence<C> {
    req: GenRequest,
    cache: C,
    generated: Vec<u32>,
    sampler: Sampler,
    cached_tokens: usize,
    arrived: Instant,
    last_token_at: Option<Instant>,
    /// KV positions reserved against the capacity (prompt + max_tokens).
    reserved: usize,
}

struct Waiting {
    req: GenRequest,
    arrived: Instant,
}

/// What one step computes for one running sequence.
struct Work {
    seq: usize,
    start: usize,
    len: usize,
}

pub(super) struct Scheduler<M: StepModel> {
    model: M,
    cfg: SchedulerConfig,
    rx: mpsc::Receiver<GenRequest>,
    state: Arc<EngineState>,
    metrics: Arc<Metrics>,
    waiting: VecDeque<Waiting>,
    running: Vec<Sequence<M::Cache>>,
    prefixes: PrefixCache<M::Cache>,
    reserved: usize,
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
            reserved: 0,
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
            // The step's engine figures are recorded before its tokens go out, so a client that has
            // seen its last token also sees the metrics of the step that produced it.
            match self.forward(&work) {
                Ok(logits) => {
                    if let Some(st) = self.model.last_step_stats() {
                        self.record_step_stats(st);
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

    /// Moves submitted requests into the waiting queue; blocks (briefly) when idle. False: shut down.
    fn intake(&mut self) -> bool {
        if self.running.is_empty() && self.waiting.is_empty() {
            match self.rx.recv_timeout(IDLE_POLL) {
                Ok(req) => self.waiting.push_back(Waiting {
                    req,
                    arrived: Instant::now(),
                }),
                Err(mpsc::RecvTimeoutError::Timeout) => return true,
                Err(mpsc::RecvTimeoutError::Disconnected) => return false,
            }
        }
        while let Ok(req) = self.rx.try_recv() {
            self.waiting.push_back(Waiting {
                req,
                arrived: Instant::now(),
            });
        }
        true
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
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i].req;
            if expired(r) {
                let _ = r.events.send(SeqEvent::Error("request timed out".into()));
            }
            if r.events.is_closed() || expired(r) {
                let s = self.running.swap_remove(i);
                self.reserved -= s.reserved;
                self.metrics.requests_aborted.inc();
            } else {
                i += 1;
            }
        }
    }

    /// Token budget: running sequences first (oldest first), then admissions from the waiting queue.
    fn schedule(&mut self) -> Vec<Work> {
        let mut budget = self.cfg.max_batch_tokens.max(1);
        let mut work = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            let total = s.req.prompt.len() + s.generated.len();
            let done = M::cache_len(&s.cache);
            let len = (total - done).min(budget);
            budget -= len;
            work.push(Work {
                seq: i,
                start: done,
                len,
            });
        }
        while budget > 0 && self.running.len() < self.cfg.max_running {
            let Some(front) = self.waiting.front() else {
                break;
            };
            let need = front.req.prompt.len() + front.req.max_tokens;
            if !self.running.is_empty() && self.reserved + need > self.cfg.kv_capacity_tokens {
                break;
            }
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            self.state.waiting.fetch_sub(1, Ordering::AcqRel);
            let (cache, cached) = match self.prefixes.lookup(&w.req.prompt) {
                Some((mut c, n)) => {
                    M::truncate(&mut c, n);
                    (c, n)
                }
                None => (self.model.new_cache(), 0),
            };
            self.metrics.prefix_cache_hit_tokens.inc_by(cached as u64);
            self.metrics
                .queue_seconds
                .observe(w.arrived.elapsed().as_secs_f64());
            let len = (w.req.prompt.len() - cached).min(budget);
            budget -= len;
            self.reserved += need;
            work.push(Work {
                seq: self.running.len(),
                start: cached,
                len,
            });
            self.running.push(Sequence {
                sampler: Sampler::new(&w.req.sampling),
                req: w.req,
                cache,
                generated: Vec::new(),
                cached_tokens: cached,
                arrived: w.arrived,
                last_token_at: None,
                reserved: need,
            });
        }
        work
    }

    fn forward(&mut self, work: &[Work]) -> Result<Vec<Vec<f32>>, String> {
        // Each sequence appears at most once in `work`; hand out disjoint &mut caches in work order.
        let mut slots: Vec<Option<&mut Sequence<M::Cache>>> =
            self.running.iter_mut().map(Some).collect();
        let mut chunks: Vec<Vec<u32>> = Vec::with_capacity(work.len());
        let mut caches = Vec::with_capacity(work.len());
        for w in work {
            let s = slots[w.seq].take().ok_or("sequence scheduled twice")?;
            let p = s.req.prompt.len();
            let chunk: Vec<u32> = (w.start..w.start + w.len)
                .map(|i| {
                    if i < p {
                        s.req.prompt[i]
                    } else {
                        s.generated[i - p]
                    }
                })
                .collect();
            chunks.push(chunk);
            caches.push(&mut s.cache);
        }
        let batch = caches
            .into_iter()
            .zip(chunks.iter().map(Vec::as_slice))
            .collect();
        self.model.forward(batch)
    }

    fn update(&mut self, work: &[Work], logits: Vec<Vec<f32>>) {
        let mut finished = Vec::new();
        for (w, logits) in work.iter().zip(logits) {
            let s = &mut self.running[w.seq];
            let p = s.req.prompt.len();
            let done = w.start + w.len;
            if done < p + s.generated.len() {
                continue; // prefill chunk: no token yet
            }
            if s.generated.is_empty() && self.prefixes.would_store(&s.req.prompt) {
                let aligned = p / BLOCK * BLOCK;
                let mut c = s.cache.clone();
                M::truncate(&mut c, aligned);
                self.prefixes.insert(s.req.prompt[..aligned].to_vec(), c);
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
                let full = p + s.generated.len() >= self.model.max_positions();
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

    fn fail(&mut self, work: &[Work], error: &str) {
        tracing::error!(error, "engine step failed; failing its sequences");
        for w in work {
            let _ = self.running[w.seq]
                .req
                .events
                .send(SeqEvent::Error(error.to_string()));
        }
        self.remove(work.iter().map(|w| w.seq).collect());
    }

    fn remove(&mut self, mut idx: Vec<usize>) {
        idx.sort_unstable();
        idx.dedup();
        for i in idx.into_iter().rev() {
            let s = self.running.remove(i);
            self.reserved -= s.reserved;
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

    fn publish_gauges(&self) {
        self.state
            .running
            .store(self.running.len(), Ordering::Release);
        self.metrics.num_waiting.set(self.waiting.len() as i64);
        self.metrics.num_running.set(self.running.len() as i64);
        let used: usize = self.running.iter().map(|s| M::cache_len(&s.cache)).sum();
        self.metrics
            .kv_cache_usage
            .set(used as f64 / self.cfg.kv_capacity_tokens.max(1) as f64);
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
