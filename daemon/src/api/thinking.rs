//! Room to think before a constrained answer, as vLLM gives reasoning models with a reasoning parser
//! and structured outputs: the grammar (forced tool calls, `json_schema`, or `auto` calls) starts
//! only once the reasoning section has closed (`</think>`), and the reasoning stays bounded: past a
//! budget of tokens the gate writes `</think>` itself, so that a forced answer still arrives within
//! `max_tokens`.
//!
//! Where the section starts comes from the rendered prompt and the request ([`ThinkStart`]): inside
//! it when the template opened `<think>` (DeepSeek-R1, GLM-4.7 / 5 with thinking on), not at all when
//! thinking is off (`enable_thinking: false`, or a template that closed an empty `<think></think>`),
//! and otherwise the model may open it as its first words (Qwen3, GLM-4.5) — until then a
//! constrained answer's first tokens are allowed beside `<think>`, so a model that does not think
//! answers at once.
//!
//! Tags are found in the output bytes, so they work whether the vocabulary has them as single tokens
//! or spells them out; `</think>` is forced as the vocabulary's own tokens for it.
use llguidance::toktrie::{TokEnv, TokTrie};

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";

/// Where a sequence starts with respect to its reasoning section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThinkStart {
    /// The prompt opened `<think>`: the output starts inside it.
    Inside,
    /// The model may open `<think>` as its first words.
    MayOpen,
}

/// What a request's reasoning may do: decided per request from the prompt and the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThinkingSpec {
    pub start: ThinkStart,
    /// Reasoning tokens after which `</think>` is written for the model.
    pub budget: Option<usize>,
}

/// Whether thinking is off for this prompt: the request says `enable_thinking: false`, or the
/// template closed an empty reasoning section at the end of the prompt (Qwen3's and GLM's
/// non-thinking generation prompts).
pub fn thinking_off(prompt: &str, enable_thinking: Option<bool>) -> bool {
    enable_thinking == Some(false) || prompt.trim_end().ends_with(THINK_CLOSE)
}

/// The server's reasoning budget (`--reasoning-budget`, as llama.cpp's): `-1` unrestricted (`None`),
/// `0` ends reasoning at once, `N` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReasoningBudget(pub Option<usize>);

impl std::str::FromStr for ReasoningBudget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "-1" => Ok(Self(None)),
            n => n.parse::<usize>().map(|n| Self(Some(n))).map_err(|_| {
                format!("`{s}` is not a reasoning budget: -1 (unrestricted), 0 (no reasoning) or a number of tokens")
            }),
        }
    }
}

/// The default reasoning budget of a constrained answer: half of `max_tokens`, so that the answer
/// keeps at least the other half.
pub fn constrained_budget(max_tokens: usize) -> usize {
    max_tokens / 2
}

/// The vocabulary's view of the tags, built once per model.
#[derive(Debug, Clone)]
pub struct ThinkTokens {
    /// The tokens of `</think>` as the model writes it (one special token where the vocabulary has
    /// it).
    pub close: Vec<u32>,
}

impl ThinkTokens {
    pub fn new(tok_env: &TokEnv) -> Self {
        let trie = tok_env.tok_trie();
        let close = match trie.get_special_token(THINK_CLOSE) {
            Some(id) => vec![id],
            None => tok_env.tokenize_bytes(THINK_CLOSE.as_bytes()),
        };
        Self { close }
    }
}

/// The text bytes of token `id` (a special token's marker byte dropped).
pub fn token_text(trie: &TokTrie, id: u32) -> &[u8] {
    let b = trie.token(id);
    match b.first() {
        Some(&TokTrie::SPECIAL_TOKEN_MARKER) => &b[1..],
        _ => b,
    }
}

/// One sequence's place in its reasoning section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ThinkPhase {
    /// Nothing but whitespace and a beginning of `<think>` written yet (`held`).
    MayOpen { held: Vec<u8> },
    /// Reasoning: `tokens` written so far; `forcing`: the index of the next `</think>` token the gate
    /// writes once the budget is spent; `tail`: recent bytes, to spot the closing tag.
    Inside {
        tokens: usize,
        forcing: Option<usize>,
        tail: Vec<u8>,
    },
    /// The section is over (or was never opened): the answer.
    Done,
}

/// What one token did to the phase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Still before the answer.
    Thinking,
    /// The model opened `<think>` with this token: anything written for the answer so far is void.
    Opened,
    /// `</think>` closed with this token; `rest`: what the token wrote after the tag.
    Closed { rest: Vec<u8> },
    /// The model did not open `<think>`: this token (and `held` before it) is the answer's.
    Answering,
    /// Already answering.
    Done,
}

/// Longest tail kept while looking for `</think>`.
const TAIL_BYTES: usize = 32;

fn strip_leading_ws(b: &[u8]) -> &[u8] {
    let n = b.iter().take_while(|c| c.is_ascii_whitespace()).count();
    &b[n..]
}

/// Whether `held` (whitespace and what follows) can still become `<think>`, or already is it.
fn open_prefix(held: &[u8]) -> OpenMatch {
    let t = strip_leading_ws(held);
    let open = THINK_OPEN.as_bytes();
    if t.starts_with(open) {
        OpenMatch::Opened(held.len() - t.len() + open.len())
    } else if open.starts_with(t) {
        OpenMatch::Prefix
    } else {
        OpenMatch::No
    }
}

enum OpenMatch {
    /// `<think>` is complete; the bytes after this offset are reasoning.
    Opened(usize),
    Prefix,
    No,
}

/// The token-level gate of one sequence.
#[derive(Debug, Clone)]
pub struct ThinkingGate {
    pub phase: ThinkPhase,
    budget: Option<usize>,
    close: Vec<u32>,
}

impl ThinkingGate {
    pub fn new(spec: ThinkingSpec, tokens: &ThinkTokens) -> Self {
        let phase = match spec.start {
            ThinkStart::Inside => ThinkPhase::Inside {
                tokens: 0,
                forcing: None,
                tail: Vec::new(),
            },
            ThinkStart::MayOpen => ThinkPhase::MayOpen { held: Vec::new() },
        };
        Self {
            phase,
            budget: spec.budget,
            close: tokens.close.clone(),
        }
    }

    pub fn inside(&self) -> bool {
        matches!(self.phase, ThinkPhase::Inside { .. })
    }

    pub fn may_open(&self) -> bool {
        matches!(self.phase, ThinkPhase::MayOpen { .. })
    }

    /// The token the gate writes next (the budget is spent), if any.
    pub fn forced(&mut self) -> Option<u32> {
        let ThinkPhase::Inside {
            tokens, forcing, ..
        } = &mut self.phase
        else {
            return None;
        };
        if forcing.is_none() && self.budget.is_some_and(|b| *tokens >= b) {
            *forcing = Some(0);
        }
        forcing.and_then(|i| self.close.get(i).copied())
    }

    /// Tokens that continue a `<think>` from what was written so far (while it may still open).
    pub fn open_continuations(&self, trie: &TokTrie, vocab: usize) -> Vec<u32> {
        let ThinkPhase::MayOpen { held } = &self.phase else {
            return Vec::new();
        };
        // What `<think>` still needs after the non-blank part written so far (a proper prefix).
        let written = strip_leading_ws(held);
        let open = THINK_OPEN.as_bytes();
        let needed = &open[written.len().min(open.len())..];
        (0..vocab.min(trie.vocab_size()) as u32)
            .filter(|&id| {
                let b = token_text(trie, id);
                // Leading whitespace only before anything of the tag; whitespace alone is the
                // answer's to allow or not.
                let b = if written.is_empty() {
                    strip_leading_ws(b)
                } else {
                    b
                };
                !b.is_empty() && (needed.starts_with(b) || b.starts_with(needed))
            })
            .collect()
    }

    /// Moves the phase on by token `id` (its text `bytes`).
    pub fn advance(&mut self, id: u32, bytes: &[u8]) -> Step {
        match &mut self.phase {
            ThinkPhase::Done => Step::Done,
            ThinkPhase::MayOpen { held } => {
                held.extend_from_slice(bytes);
                match open_prefix(held) {
                    OpenMatch::Opened(at) => {
                        let tail = held[at..].to_vec();
                        self.phase = ThinkPhase::Inside {
                            tokens: 0,
                            forcing: None,
                            tail: Vec::new(),
                        };
                        // A token that opens and closes at once ("<think></think>").
                        match self.advance_inside(id, &tail, false) {
                            Step::Closed { rest } => Step::Closed { rest },
                            _ => Step::Opened,
                        }
                    }
                    OpenMatch::Prefix => Step::Thinking,
                    OpenMatch::No => {
                        self.phase = ThinkPhase::Done;
                        Step::Answering
                    }
                }
            }
            ThinkPhase::Inside { .. } => self.advance_inside(id, bytes, true),
        }
    }

    fn advance_inside(&mut self, id: u32, bytes: &[u8], count: bool) -> Step {
        let ThinkPhase::Inside {
            tokens,
            forcing,
            tail,
        } = &mut self.phase
        else {
            return Step::Done;
        };
        if count {
            *tokens += 1;
        }
        if let Some(i) = forcing {
            if self.close.get(*i) == Some(&id) {
                *i += 1;
            }
        }
        let searched_from = tail.len();
        tail.extend_from_slice(bytes);
        let close = THINK_CLOSE.as_bytes();
        let start = searched_from.saturating_sub(close.len() - 1);
        if let Some(at) = tail[start..].windows(close.len()).position(|w| w == close) {
            let rest = tail[start + at + close.len()..].to_vec();
            self.phase = ThinkPhase::Done;
            return Step::Closed { rest };
        }
        let cut = tail.len().saturating_sub(TAIL_BYTES);
        tail.drain(..cut);
        Step::Thinking
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(start: ThinkStart, budget: Option<usize>) -> ThinkingGate {
        let tokens = ThinkTokens { close: vec![900] };
        ThinkingGate::new(ThinkingSpec { start, budget }, &tokens)
    }

    #[test]
    fn the_model_may_open_think_or_answer_at_once() {
        let mut g = gate(ThinkStart::MayOpen, None);
        assert_eq!(g.advance(1, b"\n<th"), Step::Thinking);
        assert_eq!(g.advance(2, b"ink>Hm"), Step::Opened);
        assert!(g.inside());
        assert_eq!(g.advance(3, b"m.</thi"), Step::Thinking);
        assert_eq!(
            g.advance(4, b"nk>\n\n"),
            Step::Closed {
                rest: b"\n\n".to_vec()
            }
        );
        assert_eq!(g.advance(5, b"{"), Step::Done);
        let mut g = gate(ThinkStart::MayOpen, None);
        assert_eq!(g.advance(1, b"<"), Step::Thinking);
        assert_eq!(g.advance(2, b"tool_call>"), Step::Answering);
        let mut g = gate(ThinkStart::MayOpen, None);
        assert_eq!(
            g.advance(1, b"<think></think>"),
            Step::Closed { rest: vec![] }
        );
    }

    #[test]
    fn the_server_budget_reads_as_llama_cpp_writes_it() {
        let parse = |s: &str| s.parse::<ReasoningBudget>();
        assert_eq!(parse("-1"), Ok(ReasoningBudget(None)));
        assert_eq!(parse("0"), Ok(ReasoningBudget(Some(0))));
        assert_eq!(parse("512"), Ok(ReasoningBudget(Some(512))));
        for bad in ["-2", "x", "1.5", ""] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        // 0 ends the reasoning at once
        let mut g = gate(ThinkStart::Inside, Some(0));
        assert_eq!(g.forced(), Some(900));
    }

    #[test]
    fn a_spent_budget_writes_the_closing_tokens() {
        let mut g = gate(ThinkStart::Inside, Some(2));
        assert_eq!(g.forced(), None);
        g.advance(1, b"a");
        assert_eq!(g.forced(), None);
        g.advance(2, b"b");
        assert_eq!(g.forced(), Some(900), "two tokens spent: close");
        assert_eq!(g.advance(900, b"</think>"), Step::Closed { rest: vec![] });
        assert_eq!(g.forced(), None);
    }

    #[test]
    fn thinking_is_off_when_asked_or_when_the_template_closed_it() {
        assert!(thinking_off("<|assistant|>", Some(false)));
        assert!(thinking_off("<|assistant|>\n<think></think>\n", None));
        assert!(!thinking_off("<think></think>old turn<|assistant|>", None));
        assert!(!thinking_off("<|assistant|><think>", Some(true)));
    }
}
