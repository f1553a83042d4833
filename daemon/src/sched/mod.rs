//! Continuous batching on one engine thread (vLLM v1's shape): each step is schedule → forward → update.
//! There are no prefill/decode phases: a token budget per step lets every running sequence's computed
//! tokens catch up (one token when decoding, a chunk of its prompt when prefilling), then waiting
//! requests are admitted, starting from the longest cached prompt prefix. HTTP handlers talk to the thread
//! over channels: [`EngineHandle::submit`] in, [`SeqEvent`]s out. A dropped event receiver (client gone,
//! stop string hit) frees the sequence and its cache at the next step.
pub mod constraint;
pub mod model;
pub mod prefix_cache;
pub mod scripted;
mod step;

use crate::engine::sampling::SamplingParams;
use crate::metrics::Metrics;
pub use constraint::TokenConstraint;
pub use model::{StepModel, StepStats};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// Scheduler limits.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Tokens computed per step across all sequences (prefill chunks + decode tokens).
    pub max_batch_tokens: usize,
    /// Sequences running at once.
    pub max_running: usize,
    /// Requests allowed to wait; beyond this, submissions are refused (HTTP 429).
    pub max_waiting: usize,
    /// Cached prefixes kept for reuse, and the KV positions they may hold together (their blocks are
    /// shared with sequences and given back under memory pressure).
    pub prefix_cache_entries: usize,
    pub prefix_cache_tokens: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_batch_tokens: 512,
            max_running: 64,
            max_waiting: 256,
            prefix_cache_entries: 32,
            prefix_cache_tokens: 16_384,
        }
    }
}

/// One sequence to generate.
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// Token ids that end the sequence (EOS, end of turn); not reported as output.
    pub stop_token_ids: Vec<u32>,
    /// Report this many top alternatives per token (Some(0): the chosen token's logprob only).
    pub logprobs: Option<usize>,
    pub deadline: Option<Instant>,
    pub events: UnboundedSender<SeqEvent>,
    /// Restricts sampling (JSON mode); the sequence stops once the constraint is complete.
    pub constraint: Option<Box<dyn TokenConstraint>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS / end-of-turn token (or, decided by the API side, a stop string).
    Stop,
    /// max_tokens or the context length reached.
    Length,
}

#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub logprob: f32,
    /// (token id, logprob), best first.
    pub top: Vec<(u32, f32)>,
}

/// What the engine thread tells a request.
#[derive(Debug, Clone)]
pub enum SeqEvent {
    Token {
        id: u32,
        logprob: Option<TokenLogprob>,
    },
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    },
    Error(String),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    #[error("the model is still loading")]
    NotReady,
    #[error("the request queue is full ({0} waiting)")]
    QueueFull(usize),
    #[error("the request asks for {n} sequences; the queue holds at most {max} (--max-waiting)")]
    TooManySequences { n: usize, max: usize },
    #[error("the engine has stopped")]
    Stopped,
}

/// State the HTTP side reads without asking the engine thread.
#[derive(Default)]
pub struct EngineState {
    pub ready: AtomicBool,
    pub stopped: AtomicBool,
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
}

/// Cloneable handle used by HTTP handlers.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<GenRequest>,
    pub state: Arc<EngineState>,
    max_waiting: usize,
}

impl EngineHandle {
    pub fn submit(&self, req: GenRequest) -> Result<(), SubmitError> {
        self.submit_all(vec![req])
    }

    /// Queues the sequences of one request (its `n` choices) together or none of them: a request with
    /// more sequences than the queue may ever hold is refused outright, one that does not fit now is
    /// refused as a whole (retry later).
    pub fn submit_all(&self, reqs: Vec<GenRequest>) -> Result<(), SubmitError> {
        if self.state.stopped.load(Ordering::Acquire) {
            return Err(SubmitError::Stopped);
        }
        if !self.state.ready.load(Ordering::Acquire) {
            return Err(SubmitError::NotReady);
        }
        let n = reqs.len();
        if n > self.max_waiting {
            return Err(SubmitError::TooManySequences {
                n,
                max: self.max_waiting,
            });
        }
        let waiting = self.state.waiting.fetch_add(n, Ordering::AcqRel);
        if waiting + n > self.max_waiting {
            self.state.waiting.fetch_sub(n, Ordering::AcqRel);
            return Err(SubmitError::QueueFull(waiting));
        }
        for (i, req) in reqs.into_iter().enumerate() {
            if self.tx.send(req).is_err() {
                self.state.waiting.fetch_sub(n - i, Ordering::AcqRel);
                return Err(SubmitError::Stopped);
            }
        }
        Ok(())
    }

    pub fn is_ready(&self) -> bool {
        self.state.ready.load(Ordering::Acquire)
    }
}

/// Starts the engine thread: `load` runs there first (the model is built on the thread that owns it),
/// then the step loop runs until every handle is dropped.
pub fn spawn_engine<M, F>(load: F, cfg: SchedulerConfig, metrics: Arc<Metrics>) -> EngineHandle
where
    M: StepModel,
    F: FnOnce() -> anyhow::Result<M> + Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    let state = Arc::new(EngineState::default());
    let handle = EngineHandle {
        tx,
        state: state.clone(),
        max_waiting: cfg.max_waiting,
    };
    let spawned = std::thread::Builder::new()
        .name("moe-engine".into())
        .spawn(move || {
            let model = match load() {
                Ok(m) => m,
                Err(e) => {
                    tracing::error!(error = %format!("{e:#}"), "model failed to load");
                    state.stopped.store(true, Ordering::Release);
                    return;
                }
            };
            state.ready.store(true, Ordering::Release);
            tracing::info!("model loaded; engine ready");
            step::Scheduler::new(model, cfg, rx, state.clone(), metrics).run();
            state.stopped.store(true, Ordering::Release);
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start the engine thread");
        handle.state.stopped.store(true, Ordering::Release);
    }
    handle
}

/// How long the idle engine thread sleeps between looks at the channel.
const IDLE_POLL: Duration = Duration::from_millis(50);

#[cfg(test)]
mod tests;
