//! Running a request's choices on the engine: submission (429 when the queue is full), then either
//! collecting whole choices or streaming them as SSE chunks. Dropping the event receivers (client gone,
//! stop string matched) is what tells the engine to free a sequence.
use super::choice::{ChoiceDecoder, ChoiceDelta, LogprobEntry, OutputOptions};
use super::error::ApiError;
use super::structured::{GrammarUse, OutputControl};
use super::thinking::{ThinkingGate, ThinkingSpec};
use super::tool_parser::ToolCall;
use super::AppState;
use crate::engine::sampling::SamplingParams;
use crate::sched::{GenRequest, SeqEvent, SubmitError, TokenConstraint};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;
use tokio_stream::wrappers::{ReceiverStream, UnboundedReceiverStream};
use tokio_stream::StreamMap;

/// One sequence of a request: `index` is the choice index in the response.
pub struct ChoiceSpec {
    pub index: usize,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
}

pub struct Job {
    pub choices: Vec<ChoiceSpec>,
    pub max_tokens: usize,
    pub logprobs: Option<usize>,
    pub output: OutputOptions,
    pub ignore_eos: bool,
    pub extra_stop_ids: Vec<u32>,
    /// Prompt tokens reported in usage (each distinct prompt once).
    pub prompt_tokens: usize,
    pub control: SamplingControl,
}

/// What restricts a job's sampling, copied for each choice.
#[derive(Default)]
pub struct SamplingControl {
    /// Compiled output grammar (JSON, tool calls).
    pub grammar: Option<GrammarUse>,
    pub logit_bias: Vec<(u32, f32)>,
    /// The reasoning section before the grammar, and its budget.
    pub thinking: Option<ThinkingSpec>,
}

pub struct Running {
    id: String,
    streams: StreamMap<usize, UnboundedReceiverStream<SeqEvent>>,
    decoders: Vec<ChoiceDecoder>,
    pub prompt_tokens: usize,
}

/// Submits every choice; all or nothing (a refused submission drops the others).
pub fn submit(state: &AppState, id: &str, job: Job) -> Result<Running, ApiError> {
    let deadline = Some(Instant::now() + state.request_timeout);
    let mut stop_ids = if job.ignore_eos {
        vec![]
    } else {
        state.tokenizer.stop_token_ids.clone()
    };
    stop_ids.extend(&job.extra_stop_ids);
    let mut streams = StreamMap::new();
    let mut decoders = Vec::new();
    let mut reqs = Vec::with_capacity(job.choices.len());
    for spec in job.choices {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let req = GenRequest {
            prompt: spec.prompt,
            sampling: spec.sampling,
            max_tokens: job.max_tokens,
            stop_token_ids: stop_ids.clone(),
            logprobs: job.logprobs,
            deadline,
            events: tx,
            constraint: output_control(state, &job.control, &stop_ids),
        };
        reqs.push(req);
        streams.insert(spec.index, UnboundedReceiverStream::new(rx));
        decoders.push(ChoiceDecoder::new(&job.output));
    }
    state.engine.submit_all(reqs).map_err(|e| match e {
        SubmitError::QueueFull(_) => {
            state.metrics.requests_rejected.inc();
            ApiError::queue_full(state.retry_after_s)
        }
        e @ SubmitError::TooManySequences { .. } => ApiError::bad_param("n", e.to_string()),
        SubmitError::NotReady => ApiError::unavailable("the model is still loading; see /ready"),
        SubmitError::Stopped => ApiError::unavailable("the engine has stopped"),
    })?;
    tracing::debug!(
        request = id,
        choices = decoders.len(),
        prompt_tokens = job.prompt_tokens,
        "submitted"
    );
    Ok(Running {
        id: id.to_string(),
        streams,
        decoders,
        prompt_tokens: job.prompt_tokens,
    })
}

/// The per-choice constraint, if the request has a grammar, a logit bias or a reasoning gate.
fn output_control(
    state: &AppState,
    job: &SamplingControl,
    stop_ids: &[u32],
) -> Option<Box<dyn TokenConstraint>> {
    let thinking = job.thinking.zip(state.structured.as_ref());
    if job.grammar.is_none() && job.logit_bias.is_empty() && thinking.is_none() {
        return None;
    }
    let grammar = job.grammar.as_ref().zip(state.structured.as_ref());
    let mut control = OutputControl::new(
        grammar.map(|(g, s)| (g.deep_clone(), s.tok_env().clone())),
        job.logit_bias.clone(),
        stop_ids.to_vec(),
        state.metrics.clone(),
    );
    if let Some((spec, so)) = thinking {
        let gate = ThinkingGate::new(spec, &so.think_tokens);
        control = control.with_thinking(gate, so.tok_env().clone());
    }
    Some(Box::new(control))
}

/// A finished choice.
#[derive(Default)]
pub struct ChoiceResult {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<ToolCall>,
    pub logprobs: Vec<LogprobEntry>,
    pub finish_reason: &'static str,
}

fn cut_by_shutdown() -> ApiError {
    ApiError::unavailable("the server shut down before this request finished (shutdown deadline)")
}

fn engine_error(e: String) -> ApiError {
    if e.contains("timed out") {
        ApiError::timeout(e)
    } else {
        ApiError::internal(e)
    }
}

impl Running {
    fn on_event(
        &mut self,
        state: &AppState,
        idx: usize,
        ev: SeqEvent,
    ) -> Result<ChoiceDelta, ApiError> {
        let dec = &mut self.decoders[idx];
        let delta = dec.on_event(&state.tokenizer, ev).map_err(engine_error)?;
        if dec.finish_reason.is_some() {
            // Finished, or a stop string matched: dropping the receiver frees the engine's sequence.
            self.streams.remove(&idx);
        }
        Ok(delta)
    }

    /// The next delta of any choice: (choice index, delta, finish reason once it is done).
    /// None when every choice has ended.
    pub async fn next_delta(
        &mut self,
        state: &AppState,
    ) -> Option<Result<(usize, ChoiceDelta, Option<&'static str>), ApiError>> {
        let (idx, ev) = self.streams.next().await?;
        Some(
            self.on_event(state, idx, ev)
                .map(|d| (idx, d, self.decoders[idx].finish_reason)),
        )
    }

    pub fn check_all_finished(&self) -> Result<(), ApiError> {
        match self.decoders.iter().all(|d| d.finish_reason.is_some()) {
            true => Ok(()),
            false => Err(ApiError::internal(
                "the engine ended a sequence without finishing it",
            )),
        }
    }

    pub fn log_done(&self, streamed: bool) {
        let reasons: Vec<&str> = self
            .decoders
            .iter()
            .map(|d| d.finish_reason.unwrap_or("-"))
            .collect();
        tracing::info!(
            request = %self.id,
            streamed,
            prompt_tokens = self.prompt_tokens,
            completion_tokens = self.decoders.iter().map(|d| d.tokens).sum::<usize>(),
            finish = ?reasons,
            "request finished"
        );
    }

    pub fn usage(&self) -> Value {
        let completion: usize = self.decoders.iter().map(|d| d.tokens).sum();
        let cached = self
            .decoders
            .iter()
            .map(|d| d.cached_tokens)
            .max()
            .unwrap_or(0);
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }

    /// Waits for every choice and returns them in index order.
    pub async fn collect(
        mut self,
        state: &AppState,
    ) -> Result<(Vec<ChoiceResult>, Value), ApiError> {
        let mut results: Vec<ChoiceResult> = (0..self.decoders.len())
            .map(|_| ChoiceResult::default())
            .collect();
        loop {
            let next = tokio::select! {
                n = self.streams.next() => n,
                _ = state.shutdown_deadline_passed() => return Err(cut_by_shutdown()),
            };
            let Some((idx, ev)) = next else { break };
            let d = self.on_event(state, idx, ev)?;
            let r = &mut results[idx];
            r.reasoning += &d.reasoning;
            r.content += &d.content;
            r.calls.extend(d.calls);
            r.logprobs.extend(d.logprobs);
        }
        self.check_all_finished()?;
        self.log_done(false);
        for (r, d) in results.iter_mut().zip(&self.decoders) {
            r.finish_reason = d.finish_reason.unwrap_or("stop");
        }
        Ok((results, self.usage()))
    }

    /// Streams the choices as SSE: `first` chunks, then one chunk per delta built by `chunk`, then
    /// (with `usage_chunk`) a usage-only chunk, then `data: [DONE]`.
    pub fn stream<F, U>(
        mut self,
        state: Arc<AppState>,
        first: Vec<Value>,
        chunk: F,
        usage_chunk: Option<U>,
    ) -> Response
    where
        F: Fn(usize, &ChoiceDelta, Option<&str>) -> Value + Send + 'static,
        U: FnOnce(Value) -> Value + Send + 'static,
    {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(64);
        tokio::spawn(async move {
            let send = |v: Value| {
                let tx = tx.clone();
                async move {
                    tx.send(Ok(Event::default().data(v.to_string())))
                        .await
                        .is_ok()
                }
            };
            for v in first {
                if !send(v).await {
                    return;
                }
            }
            loop {
                let next = tokio::select! {
                    _ = tx.closed() => {
                        // Client gone: dropping `self` drops the receivers, which frees the sequences.
                        tracing::info!(request = %self.id, "client disconnected mid-stream");
                        return;
                    }
                    n = self.streams.next() => n,
                    _ = state.shutdown_deadline_passed() => {
                        tracing::warn!(request = %self.id, "stream ended by the shutdown deadline");
                        let _ = send(cut_by_shutdown().body()).await;
                        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
                        return;
                    }
                };
                let Some((idx, ev)) = next else { break };
                match self.on_event(&state, idx, ev) {
                    Ok(d) => {
                        let finish = self.decoders[idx].finish_reason;
                        if (!d.is_empty() || finish.is_some())
                            && !send(chunk(idx, &d, finish)).await
                        {
                            return;
                        }
                    }
                    Err(e) => {
                        let _ = send(e.body()).await;
                        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
                        return;
                    }
                }
            }
            if let Err(e) = self.check_all_finished() {
                let _ = send(e.body()).await;
            } else if let Some(u) = usage_chunk {
                let _ = send(u(self.usage())).await;
            }
            self.log_done(true);
            let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
        });
        Sse::new(ReceiverStream::new(rx))
            .keep_alive(KeepAlive::default())
            .into_response()
    }
}

/// Checks a prompt against the context and settles max_tokens (default: the server's default, else
/// the rest of the context). Too long a request is a 400 `context_length_exceeded`, as in vLLM, unless
/// the server clamps `max_tokens` to what fits (`--clamp-max-tokens`, llama.cpp's behaviour).
pub fn fit_context(
    state: &AppState,
    prompt_len: usize,
    requested: Option<usize>,
) -> Result<usize, ApiError> {
    let ctx = state.max_context;
    if prompt_len == 0 {
        return Err(ApiError::bad_param("prompt", "the prompt is empty"));
    }
    let requested = requested.or_else(|| {
        let default = state.sampling_defaults.max_tokens?;
        (prompt_len < ctx).then(|| default.min(ctx - prompt_len))
    });
    match requested {
        Some(m) if prompt_len + m > ctx && state.clamp_max_tokens && prompt_len < ctx => {
            Ok(ctx - prompt_len)
        }
        Some(m) if prompt_len + m > ctx => Err(ApiError::context_length(format!(
            "This model's maximum context length is {ctx} tokens. However, you requested {} tokens \
             ({prompt_len} in the messages, {m} in the completion). Please reduce the length of the \
             messages or completion.",
            prompt_len + m
        ))),
        Some(m) => Ok(m),
        None if prompt_len >= ctx => Err(ApiError::context_length(format!(
            "This model's maximum context length is {ctx} tokens. However, your messages resulted in \
             {prompt_len} tokens. Please reduce the length of the messages."
        ))),
        None => Ok(ctx - prompt_len),
    }
}

/// Seeds for n choices: a given seed s gives s, s+1, … so choices differ but repeat across calls.
pub fn choice_sampling(base: &SamplingParams, i: usize) -> SamplingParams {
    let mut p = base.clone();
    p.seed = base.seed.map(|s| s.wrapping_add(i as u64));
    p
}

pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Request ids: process-unique, hex.
pub fn request_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{:x}{:08x}", now_unix(), n)
}
