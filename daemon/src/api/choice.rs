//! One choice's output pipeline: token → incremental text → stop strings → reasoning split → tool calls,
//! plus logprobs and the finish reason. Streaming and non-streaming responses both run through it.
use super::reasoning::ReasoningParser;
use super::tool_parser::{ToolCall, ToolCallParser};
use crate::sched::{FinishReason, SeqEvent, TokenLogprob};
use crate::text::{IncrementalDetokenizer, StopMatcher, TextTokenizer};

/// How a choice's text is post-processed.
#[derive(Clone, Default)]
pub struct OutputOptions {
    pub stop: Vec<String>,
    /// Split `<think>` blocks; the flag says whether the prompt already opened one.
    pub reasoning: Option<bool>,
    /// Parse tool calls against these tools.
    pub tools: Option<Vec<serde_json::Value>>,
    /// At most this many tool calls are returned (`parallel_tool_calls: false`: 1).
    pub max_calls: Option<usize>,
    pub skip_special_tokens: bool,
}

/// One generated token's logprob entry, with token strings resolved.
#[derive(Debug, Clone)]
pub struct LogprobEntry {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// What one event adds to a choice.
#[derive(Debug, Default)]
pub struct ChoiceDelta {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<ToolCall>,
    /// Index (within the choice) of `calls[0]`, for streamed `tool_calls[].index`.
    pub first_call_index: usize,
    pub logprobs: Vec<LogprobEntry>,
}

impl ChoiceDelta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty()
            && self.content.is_empty()
            && self.calls.is_empty()
            && self.logprobs.is_empty()
    }
}

pub struct ChoiceDecoder {
    detok: IncrementalDetokenizer,
    stop: StopMatcher,
    reasoning: Option<ReasoningParser>,
    tools: Option<ToolCallParser>,
    max_calls: usize,
    pub tokens: usize,
    pub cached_tokens: usize,
    pub calls_made: usize,
    /// Set once the choice is complete: "stop", "length" or "tool_calls".
    pub finish_reason: Option<&'static str>,
}

impl ChoiceDecoder {
    pub fn new(opts: &OutputOptions) -> Self {
        Self {
            detok: IncrementalDetokenizer::new(opts.skip_special_tokens),
            stop: StopMatcher::new(opts.stop.clone()),
            reasoning: opts.reasoning.map(ReasoningParser::new),
            tools: opts.tools.as_deref().map(ToolCallParser::new),
            max_calls: opts.max_calls.unwrap_or(usize::MAX),
            tokens: 0,
            cached_tokens: 0,
            calls_made: 0,
            finish_reason: None,
        }
    }

    /// Feeds one engine event. Errors carry the engine's message.
    pub fn on_event(&mut self, tok: &TextTokenizer, ev: SeqEvent) -> Result<ChoiceDelta, String> {
        let mut out = ChoiceDelta {
            first_call_index: self.calls_made,
            ..Default::default()
        };
        if self.finish_reason.is_some() {
            return Ok(out);
        }
        match ev {
            SeqEvent::Token { id, logprob } => {
                self.tokens += 1;
                if let Some(lp) = logprob {
                    out.logprobs.push(resolve_logprob(tok, id, &lp));
                }
                let text = self.detok.push(tok, id).map_err(|e| e.to_string())?;
                let o = self.stop.push(&text);
                self.route(&o.text, &mut out);
                if o.stopped {
                    self.finish(FinishReason::Stop, &mut out, false);
                }
            }
            SeqEvent::Finished {
                reason,
                cached_tokens,
                ..
            } => {
                self.cached_tokens = cached_tokens;
                self.finish(reason, &mut out, true);
            }
            SeqEvent::Error(e) => return Err(e),
        }
        Ok(out)
    }

    fn route(&mut self, text: &str, out: &mut ChoiceDelta) {
        if text.is_empty() {
            return;
        }
        let content = match &mut self.reasoning {
            Some(r) => {
                let s = r.push(text);
                out.reasoning.push_str(&s.reasoning);
                s.content
            }
            None => text.to_string(),
        };
        self.route_content(&content, out);
    }

    fn route_content(&mut self, content: &str, out: &mut ChoiceDelta) {
        match self.tools.as_mut().map(|t| t.push(content)) {
            Some(s) => {
                out.content.push_str(&s.content);
                self.take_calls(s.calls, out);
            }
            None => out.content.push_str(content),
        }
    }

    /// Keeps calls up to the request's limit.
    fn take_calls(&mut self, calls: Vec<ToolCall>, out: &mut ChoiceDelta) {
        let room = self.max_calls.saturating_sub(self.calls_made);
        let kept: Vec<ToolCall> = calls.into_iter().take(room).collect();
        self.calls_made += kept.len();
        out.calls.extend(kept);
    }

    fn finish(&mut self, reason: FinishReason, out: &mut ChoiceDelta, flush_stop: bool) {
        if flush_stop {
            let held = self.stop.flush();
            self.route(&held, out);
        }
        if let Some(r) = &mut self.reasoning {
            let s = r.finish();
            out.reasoning.push_str(&s.reasoning);
            self.route_content(&s.content, out);
        }
        if let Some(s) = self.tools.as_mut().map(ToolCallParser::finish) {
            out.content.push_str(&s.content);
            self.take_calls(s.calls, out);
        }
        self.finish_reason = Some(match reason {
            _ if self.calls_made > 0 => "tool_calls",
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        });
    }
}

fn resolve_logprob(tok: &TextTokenizer, id: u32, lp: &TokenLogprob) -> LogprobEntry {
    let text = |id: u32| tok.decode(&[id], false).unwrap_or_default();
    LogprobEntry {
        token: text(id),
        logprob: lp.logprob,
        top: lp.top.iter().map(|&(i, l)| (text(i), l)).collect(),
    }
}
