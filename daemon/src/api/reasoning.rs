//! Reasoning split: text inside `<think>…</think>` goes to `reasoning_content`, the rest to `content`
//! (Qwen3, GLM-4.5, DeepSeek-R1). Works on streamed deltas: a tag split across tokens is held back until
//! it is complete or proven not to be a tag. When the prompt already opened `<think>` (DeepSeek-R1's and
//! some GLM templates), generation starts inside the reasoning.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing emitted yet: an opening tag may still come.
    Start,
    Reasoning,
    /// After `</think>`: leading newlines are dropped.
    AfterReasoning,
    Content,
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

pub struct ReasoningParser {
    phase: Phase,
    held: String,
}

/// Length of the longest suffix of `s` that is a proper prefix of `tag` (0 if none).
pub fn partial_tag_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && tag.starts_with(&s[s.len() - k..]))
        .unwrap_or(0)
}

impl ReasoningParser {
    /// `prompt_opened_think`: the rendered prompt ends inside an open `<think>`.
    pub fn new(prompt_opened_think: bool) -> Self {
        Self {
            phase: if prompt_opened_think {
                Phase::Reasoning
            } else {
                Phase::Start
            },
            held: String::new(),
        }
    }

    pub fn prompt_opens_think(prompt: &str) -> bool {
        match (prompt.rfind(OPEN), prompt.rfind(CLOSE)) {
            (Some(o), Some(c)) => o > c,
            (Some(_), None) => true,
            _ => false,
        }
    }

    pub fn push(&mut self, delta: &str) -> Split {
        self.held.push_str(delta);
        let mut out = Split::default();
        loop {
            match self.phase {
                Phase::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.phase = Phase::Reasoning;
                    } else if !t.is_empty() && OPEN.starts_with(t) || t.is_empty() {
                        return out; // could still become "<think>"
                    } else {
                        self.phase = Phase::Content;
                    }
                }
                Phase::Reasoning => {
                    if let Some(i) = self.held.find(CLOSE) {
                        out.reasoning.push_str(&self.held[..i]);
                        self.held.drain(..i + CLOSE.len());
                        self.phase = Phase::AfterReasoning;
                    } else {
                        let keep = partial_tag_suffix(&self.held, CLOSE);
                        let emit = self.held.len() - keep;
                        out.reasoning.push_str(&self.held[..emit]);
                        self.held.drain(..emit);
                        return out;
                    }
                }
                Phase::AfterReasoning => {
                    let t = self.held.trim_start_matches(['\n', '\r']);
                    if t.is_empty() {
                        self.held.clear();
                        return out;
                    }
                    self.held = t.to_string();
                    self.phase = Phase::Content;
                }
                Phase::Content => {
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    /// End of generation: whatever is held goes where the phase says (an unclosed think is reasoning).
    pub fn finish(&mut self) -> Split {
        let rest = std::mem::take(&mut self.held);
        match self.phase {
            Phase::Reasoning => Split {
                reasoning: rest,
                content: String::new(),
            },
            Phase::AfterReasoning => Split::default(),
            Phase::Start | Phase::Content => Split {
                reasoning: String::new(),
                content: rest,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(p: &mut ReasoningParser, pieces: &[&str]) -> Split {
        let mut all = Split::default();
        for piece in pieces {
            let s = p.push(piece);
            all.reasoning += &s.reasoning;
            all.content += &s.content;
        }
        let s = p.finish();
        all.reasoning += &s.reasoning;
        all.content += &s.content;
        all
    }

    #[test]
    fn think_block_split_across_tokens() {
        let mut p = ReasoningParser::new(false);
        let s = run(
            &mut p,
            &[
                "<th",
                "ink>\nLet me",
                " think.</",
                "think>\n\nParis",
                " is it.",
            ],
        );
        assert_eq!(s.reasoning, "\nLet me think.");
        assert_eq!(s.content, "Paris is it.");
    }

    #[test]
    fn no_think_is_all_content_and_open_prompt_starts_in_reasoning() {
        let mut p = ReasoningParser::new(false);
        assert_eq!(run(&mut p, &["<b>", "old</b>"]).content, "<b>old</b>");
        assert!(ReasoningParser::prompt_opens_think(
            "<|assistant|>\n<think>\n"
        ));
        assert!(!ReasoningParser::prompt_opens_think("<think></think>hi"));
        let mut p = ReasoningParser::new(true);
        let s = run(&mut p, &["hmm", "</think>", "ok"]);
        assert_eq!((s.reasoning.as_str(), s.content.as_str()), ("hmm", "ok"));
        let mut p = ReasoningParser::new(false);
        assert_eq!(run(&mut p, &["<think>unfinished"]).reasoning, "unfinished");
    }
}
