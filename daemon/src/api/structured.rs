//! Structured generation on llguidance: the tokenizer's byte-level view built once at start-up
//! ([`StructuredOutputs`]), grammars compiled per request off the engine thread, and the per-sequence
//! [`OutputControl`] the scheduler consults at every sampled token (grammar mask, `logit_bias`).
//!
//! Cost: a mask is computed once per sampled token of a constrained sequence, on a mask worker while
//! the step's forward pass runs (`mask_worker.rs`; the engine thread waits only for a late one);
//! llguidance's fuel limits (`ParserLimits`) bound one computation to milliseconds whatever the grammar
//! (`moe:structured_output_mask_seconds` and `…_mask_wait_seconds` show the real figures). Compiling —
//! the expensive part for big schemas or many tools — happens in the HTTP handler's blocking task.
use super::grammar::{CallFormat, CallTags, CALL_OPEN};
use super::mask_worker::{self, ComputedMask, MaskWorkers, PendingMask};
use super::thinking::{token_text, Step, ThinkTokens, ThinkingGate};
use crate::metrics::Metrics;
use crate::sched::TokenConstraint;
use crate::text::TextTokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::TokEnv;
use llguidance::{Matcher, ParserFactory};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Per-model state shared by every request's grammar.
pub struct StructuredOutputs {
    factory: ParserFactory,
    tok_env: TokEnv,
    pub call_tags: CallTags,
    pub think_tokens: ThinkTokens,
}

impl StructuredOutputs {
    /// Builds the token trie from the tokenizer (seconds for a 150K vocabulary, once).
    /// `model_vocab`: the model's logit count, which may exceed the tokenizer's (padding rows).
    pub fn new(tok: &TextTokenizer, model_vocab: usize) -> anyhow::Result<Self> {
        let hf = tok.hf_tokenizer().clone();
        // The bridge asserts on token shapes it does not expect; a refusal must not take the server down.
        let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            toktrie_hf_tokenizers::ByteTokenizer::from_tokenizer(hf)
        }))
        .map_err(|_| anyhow::anyhow!("the tokenizer bridge panicked on this vocabulary"))??;
        let tok_env = built.into_tok_env(Some(model_vocab.max(tok.vocab_size())))?;
        let mut factory = ParserFactory::new_simple(&tok_env)?;
        factory.quiet();
        let trie = tok_env.tok_trie();
        let is_token = |tag: &str| trie.get_special_token(tag).is_some();
        let call_tags = CallTags::new(is_token);
        let think_tokens = ThinkTokens::new(&tok_env);
        Ok(Self {
            factory,
            tok_env,
            call_tags,
            think_tokens,
        })
    }

    /// Compiles a grammar into a fresh matcher. Err: the grammar or schema is invalid or over
    /// llguidance's size limits (the message says which).
    pub fn compile(&self, grammar: TopLevelGrammar, metrics: &Metrics) -> Result<Matcher, String> {
        let t0 = Instant::now();
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let m = Matcher::new(Ok(parser));
        metrics
            .structured_compile_seconds
            .observe(t0.elapsed().as_secs_f64());
        match m.get_error() {
            Some(e) => Err(e),
            None => Ok(m),
        }
    }

    pub fn tok_env(&self) -> &TokEnv {
        &self.tok_env
    }
}

/// How a grammar applies to a sequence.
pub enum GrammarUse {
    /// The whole output follows the grammar; the sequence ends when it does.
    Whole(Matcher),
    /// Free text until the model writes the tool-call opening tag, then the grammar of one call's rest
    /// (written in `format`); after the call, free text again (`single`: the sequence ends after the
    /// first call instead).
    AfterToolCallOpens {
        call: Matcher,
        single: bool,
        format: CallFormat,
    },
}

impl GrammarUse {
    /// An independent copy for another choice of the same request (no recompilation).
    pub fn deep_clone(&self) -> Self {
        match self {
            GrammarUse::Whole(m) => GrammarUse::Whole(m.deep_clone()),
            GrammarUse::AfterToolCallOpens {
                call,
                single,
                format,
            } => GrammarUse::AfterToolCallOpens {
                call: call.deep_clone(),
                single: *single,
                format: *format,
            },
        }
    }
}

/// What the scheduler applies to one sequence's logits: a grammar, `logit_bias`, or both.
pub struct OutputControl {
    grammar: Option<GrammarState>,
    /// (token id, bias added to its logit), from `logit_bias`.
    bias: Vec<(u32, f32)>,
    /// Tokens that end the sequence: allowed only where the grammar may end.
    stop_ids: Vec<u32>,
    metrics: Arc<Metrics>,
    complete: bool,
    /// Holds each mask worker back this long first (tests of late masks).
    mask_delay: Duration,
    /// The reasoning section before the grammar starts (`thinking.rs`).
    thinking: Option<Thinking>,
}

struct Thinking {
    gate: ThinkingGate,
    tok_env: TokEnv,
    /// While `<think>` may still open, the whole-output grammar refused a token written towards
    /// it: the model is committed to thinking.
    grammar_refused: bool,
    /// Right after `</think>`: whitespace (the templates' newlines) may come before the answer.
    after_close: bool,
}

/// Whether token text is whitespace only (and not empty).
fn is_blank(b: &[u8]) -> bool {
    !b.is_empty() && b.iter().all(u8::is_ascii_whitespace)
}

struct GrammarState {
    /// Shared with the mask worker while it computes the next mask.
    matcher: Arc<Mutex<Matcher>>,
    tok_env: TokEnv,
    mode: Mode,
    /// The next token's mask, started before the forward pass ([`TokenConstraint::prepare`]).
    pending: Option<PendingMask>,
}

fn lock(m: &Mutex<Matcher>) -> MutexGuard<'_, Matcher> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

enum Mode {
    Whole,
    Triggered {
        phase: CallPhase,
        single: bool,
        format: CallFormat,
    },
}

/// Where an `auto` sequence stands with respect to tool calls.
enum CallPhase {
    /// Free text; `tail` keeps recent output bytes to spot the opening tag across token boundaries.
    Watching { tail: Vec<u8> },
    /// The tag is written (Hermes format); `after` holds what followed it (whitespace so far). A `{`
    /// next starts a Hermes JSON call, which the grammar then takes over; anything else (another
    /// model's call format) is left to the parser. GLM calls skip this phase: the grammar takes over
    /// right after the tag.
    Opened { after: Vec<u8> },
    /// The call grammar decides the tokens until the call closes.
    Engaged,
}

/// Longest tail kept while watching for the opening tag.
const TAIL_BYTES: usize = 64;

impl OutputControl {
    pub fn new(
        grammar: Option<(GrammarUse, TokEnv)>,
        bias: Vec<(u32, f32)>,
        stop_ids: Vec<u32>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let grammar = grammar.map(|(g, tok_env)| match g {
            GrammarUse::Whole(matcher) => GrammarState {
                matcher: Arc::new(Mutex::new(matcher)),
                tok_env,
                mode: Mode::Whole,
                pending: None,
            },
            GrammarUse::AfterToolCallOpens {
                call,
                single,
                format,
            } => GrammarState {
                matcher: Arc::new(Mutex::new(call)),
                tok_env,
                mode: Mode::Triggered {
                    phase: CallPhase::Watching { tail: Vec::new() },
                    single,
                    format,
                },
                pending: None,
            },
        });
        Self {
            grammar,
            bias,
            stop_ids,
            metrics,
            complete: false,
            mask_delay: Duration::ZERO,
            thinking: None,
        }
    }

    /// The grammar starts after a reasoning section governed by `gate`.
    pub fn with_thinking(mut self, gate: ThinkingGate, tok_env: TokEnv) -> Self {
        self.thinking = Some(Thinking {
            gate,
            tok_env,
            grammar_refused: false,
            after_close: false,
        });
        self
    }

    /// Whether the grammar covers the whole answer (which must then come: the sequence may not
    /// end while reasoning).
    fn whole_grammar(&self) -> bool {
        self.grammar
            .as_ref()
            .is_some_and(|g| matches!(g.mode, Mode::Whole))
    }

    /// Mask workers wait `delay` before each mask (tests: a late mask must not change the output).
    #[cfg(test)]
    pub(crate) fn with_mask_delay(mut self, delay: Duration) -> Self {
        self.mask_delay = delay;
        self
    }

    /// The next mask: the one started before the forward pass (waiting for it if it is late), or
    /// one computed here.
    fn next_mask(&mut self) -> Option<ComputedMask> {
        let g = self.grammar.as_mut()?;
        let m = &self.metrics;
        let computed = match g.pending.take().map(PendingMask::wait) {
            Some((Some(c), waited)) => {
                m.structured_mask_wait_seconds.observe(waited.as_secs_f64());
                m.structured_masks_overlapped.inc();
                c
            }
            _ => {
                let c = mask_worker::compute(&g.matcher);
                m.structured_mask_wait_seconds.observe(c.seconds);
                m.structured_masks_inline.inc();
                c
            }
        };
        m.structured_mask_seconds.observe(computed.seconds);
        Some(computed)
    }

    /// Whether the grammar decides this step's tokens.
    fn masking(&self) -> bool {
        if let Some(t) = &self.thinking {
            if t.gate.inside() || t.grammar_refused {
                return false;
            }
        }
        match &self.grammar {
            Some(g) => match g.mode {
                Mode::Whole => true,
                Mode::Triggered { ref phase, .. } => matches!(phase, CallPhase::Engaged),
            },
            None => false,
        }
    }

    fn apply_mask(&mut self, logits: &mut [f32]) -> bool {
        let Some(ComputedMask {
            mask, accepting, ..
        }) = self.next_mask()
        else {
            return true;
        };
        let Some(g) = &self.grammar else {
            return true;
        };
        let mask = match mask {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "grammar failed; ending the sequence");
                return false;
            }
        };
        // The grammar's own end-of-sequence tokens are not text: our stop tokens say where it ends.
        let trie = g.tok_env.tok_trie();
        for (id, l) in logits.iter_mut().enumerate() {
            let id = id as u32;
            let allowed = if self.stop_ids.contains(&id) {
                accepting
            } else {
                (id as usize) < mask.len()
                    && mask.is_allowed(id)
                    && !trie.eos_tokens().contains(&id)
            };
            if !allowed {
                *l = f32::NEG_INFINITY;
            }
        }
        true
    }

    fn advance_grammar(&mut self, id: u32) {
        let stop = self.stop_ids.contains(&id);
        let Some(g) = &mut self.grammar else { return };
        // A mask started for this token and not used is stale now.
        g.pending = None;
        let mut matcher = lock(&g.matcher);
        match &mut g.mode {
            Mode::Whole => {
                if stop || matcher.consume_token(id).is_err() || matcher.is_stopped() {
                    self.complete = true;
                }
            }
            Mode::Triggered {
                phase,
                single,
                format,
            } => {
                let bytes = g.tok_env.tok_trie().token(id);
                let next = match std::mem::replace(phase, CallPhase::Engaged) {
                    CallPhase::Watching { mut tail } => {
                        tail.extend_from_slice(bytes);
                        match find(&tail, CALL_OPEN.as_bytes()) {
                            Some(at) => {
                                let after = &tail[at + CALL_OPEN.len()..];
                                match format {
                                    CallFormat::Hermes => opened(&mut matcher, &g.tok_env, after),
                                    CallFormat::Glm => engage(&mut matcher, &g.tok_env, after),
                                }
                            }
                            None => {
                                let cut = tail.len().saturating_sub(TAIL_BYTES);
                                tail.drain(..cut);
                                CallPhase::Watching { tail }
                            }
                        }
                    }
                    CallPhase::Opened { mut after } => {
                        after.extend_from_slice(bytes);
                        opened(&mut matcher, &g.tok_env, &after)
                    }
                    CallPhase::Engaged => {
                        let ok = !stop && matcher.consume_token(id).is_ok();
                        if ok && !matcher.is_stopped() {
                            CallPhase::Engaged
                        } else {
                            // The call is closed (or the grammar gave up): free text again.
                            if *single {
                                self.complete = true;
                            }
                            let _ = matcher.reset();
                            CallPhase::Watching { tail: Vec::new() }
                        }
                    }
                };
                *phase = next;
            }
        }
    }
}

/// After the opening tag: wait through whitespace; on `{`, hand the written bytes to the call grammar
/// and engage it if they fit.
fn opened(matcher: &mut Matcher, tok_env: &TokEnv, after: &[u8]) -> CallPhase {
    match after.iter().find(|b| !b.is_ascii_whitespace()) {
        None => CallPhase::Opened {
            after: after.to_vec(),
        },
        Some(b'{') => engage(matcher, tok_env, after),
        Some(_) => CallPhase::Watching { tail: Vec::new() },
    }
}

/// Hands the bytes written after the opening tag to the call grammar and engages it if they fit
/// (back to watching otherwise: the parser then gets the text as the model wrote it).
fn engage(matcher: &mut Matcher, tok_env: &TokEnv, after: &[u8]) -> CallPhase {
    let tokens = tok_env.tokenize_bytes(after);
    let fits = matcher
        .try_consume_tokens(&tokens)
        .is_ok_and(|n| n == tokens.len());
    if fits {
        CallPhase::Engaged
    } else {
        let _ = matcher.reset();
        CallPhase::Watching { tail: Vec::new() }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

impl OutputControl {
    /// The reasoning section's share of `apply`: the closing tag written for the model once its
    /// budget is spent (true: this step's logits are settled), no end of sequence inside the
    /// section when an answer must follow, and `<think>` allowed beside the answer's first tokens.
    /// Returns the tokens to keep whatever the grammar masks, with their logits.
    fn apply_thinking(&mut self, logits: &mut [f32]) -> (bool, Vec<(usize, f32)>) {
        let whole = self.whole_grammar();
        let Some(t) = &mut self.thinking else {
            return (false, Vec::new());
        };
        if let Some(id) = t.gate.forced() {
            for (i, l) in logits.iter_mut().enumerate() {
                if i != id as usize {
                    *l = f32::NEG_INFINITY;
                }
            }
            return (true, Vec::new());
        }
        if t.gate.inside() && whole {
            for &s in &self.stop_ids {
                if let Some(l) = logits.get_mut(s as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        let trie = t.tok_env.tok_trie();
        let ids: Vec<u32> = match (t.gate.may_open(), t.after_close && whole) {
            (true, _) if whole => t.gate.open_continuations(trie, logits.len()),
            (_, true) => (0..logits.len().min(trie.vocab_size()) as u32)
                .filter(|&id| is_blank(token_text(trie, id)))
                .collect(),
            _ => return (false, Vec::new()),
        };
        let keep: Vec<(usize, f32)> = ids
            .into_iter()
            .map(|id| (id as usize, logits[id as usize]))
            .collect();
        if t.grammar_refused {
            logits.fill(f32::NEG_INFINITY);
        }
        (false, keep)
    }

    /// Moves the reasoning section on by `id`; true when the token was the section's (the grammar
    /// must not see it).
    fn advance_thinking(&mut self, id: u32) -> bool {
        let whole = self.whole_grammar();
        let Some(t) = &mut self.thinking else {
            return false;
        };
        let may_open = t.gate.may_open();
        let text = token_text(t.tok_env.tok_trie(), id);
        if t.after_close {
            if is_blank(text) {
                return true;
            }
            t.after_close = false;
        }
        let refused = t.grammar_refused;
        match t.gate.advance(id, text) {
            Step::Thinking if may_open && whole => {
                // Either the answer's first token or `<think>` on its way: the grammar takes it
                // if it can.
                if !refused && !self.grammar_takes(id) {
                    if let Some(t) = &mut self.thinking {
                        t.grammar_refused = true;
                    }
                }
                true
            }
            // A token towards `<think>` is also text the `auto` call watcher may see.
            Step::Thinking if may_open => false,
            Step::Thinking => true,
            Step::Opened => {
                self.restart_grammar(&[]);
                true
            }
            Step::Closed { rest } => {
                let n = rest.iter().take_while(|b| b.is_ascii_whitespace()).count();
                if let Some(t) = &mut self.thinking {
                    t.after_close = n == rest.len();
                }
                self.restart_grammar(&rest[n..]);
                true
            }
            Step::Answering | Step::Done => false,
        }
    }

    /// Feeds `id` to the whole-output grammar without ending the sequence if it refuses.
    fn grammar_takes(&mut self, id: u32) -> bool {
        let Some(g) = &mut self.grammar else {
            return false;
        };
        g.pending = None;
        let mut m = lock(&g.matcher);
        m.try_consume_tokens(&[id]).is_ok_and(|n| n == 1)
    }

    /// The grammar from its start, with `after` (what followed `</think>` in the same token)
    /// already written.
    fn restart_grammar(&mut self, after: &[u8]) {
        if let Some(t) = &mut self.thinking {
            t.grammar_refused = false;
        }
        let Some(g) = &mut self.grammar else { return };
        g.pending = None;
        let mut m = lock(&g.matcher);
        let _ = m.reset();
        match &mut g.mode {
            Mode::Whole => {
                let tokens = g.tok_env.tokenize_bytes(after);
                if !m
                    .try_consume_tokens(&tokens)
                    .is_ok_and(|n| n == tokens.len())
                {
                    // Not the answer's start: the grammar starts afresh.
                    let _ = m.reset();
                }
            }
            Mode::Triggered { phase, .. } => {
                *phase = CallPhase::Watching {
                    tail: after.to_vec(),
                };
            }
        }
    }
}

impl TokenConstraint for OutputControl {
    fn apply(&mut self, logits: &mut [f32]) -> bool {
        let (settled, keep) = self.apply_thinking(logits);
        if settled {
            return true;
        }
        if self.masking() && !self.apply_mask(logits) {
            return false;
        }
        for (id, l) in keep {
            logits[id] = l;
        }
        for &(id, b) in &self.bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += b;
            }
        }
        logits.iter().any(|l| l.is_finite())
    }

    fn prepare(&mut self) {
        if !self.masking() {
            return;
        }
        let delay = self.mask_delay;
        if let Some(g) = self.grammar.as_mut().filter(|g| g.pending.is_none()) {
            g.pending = MaskWorkers::get().start(g.matcher.clone(), delay);
        }
    }

    fn advance(&mut self, id: u32) {
        if !self.advance_thinking(id) {
            self.advance_grammar(id);
        }
    }

    fn is_complete(&self) -> bool {
        self.complete
    }
}

#[cfg(test)]
#[path = "structured_tests.rs"]
mod tests;
