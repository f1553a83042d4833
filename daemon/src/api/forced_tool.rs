//! `tool_choice: "required"` or `{"type": "function", "function": {"name": ...}}` in the Qwen3 / Hermes
//! format: output is constrained, token by token, to exactly one call
//! `<tool_call>\n{"name": "<one of the allowed names>", "arguments": <JSON object>}\n</tool_call>`,
//! after which the sequence ends. (The GLM XML format is not constrained: its values are free text.)
use crate::sched::TokenConstraint;
use crate::text::json_prefix::JsonPrefix;
use std::sync::Arc;

const HEAD: &str = "<tool_call>\n{\"name\": \"";
const MIDDLE: &str = "\", \"arguments\": ";
const TAIL: &str = "}\n</tool_call>";

#[derive(Clone)]
enum Phase {
    /// Text still to match: any of the candidates, `at` characters in.
    Literal {
        candidates: Vec<String>,
        at: usize,
    },
    Arguments(JsonPrefix),
    Done,
}

#[derive(Clone)]
struct CallGrammar {
    phase: Phase,
    /// What follows the current literal phase: 0 = name part, 1 = arguments next, 2 = done next.
    stage: u8,
}

impl CallGrammar {
    fn new(names: &[String]) -> Self {
        let candidates = names.iter().map(|n| format!("{HEAD}{n}{MIDDLE}")).collect();
        Self {
            phase: Phase::Literal { candidates, at: 0 },
            stage: 0,
        }
    }

    fn push(&mut self, c: char) -> bool {
        match &mut self.phase {
            Phase::Done => false,
            Phase::Literal { candidates, at } => {
                candidates.retain(|s| s[*at..].starts_with(c));
                if candidates.is_empty() {
                    return false;
                }
                *at += c.len_utf8();
                if candidates.iter().any(|s| s.len() == *at) {
                    self.stage += 1;
                    self.phase = if self.stage == 1 {
                        Phase::Arguments(JsonPrefix::default())
                    } else {
                        Phase::Done
                    };
                }
                true
            }
            Phase::Arguments(json) => {
                if !json.push(c) {
                    return false;
                }
                if json.is_complete() {
                    self.phase = Phase::Literal {
                        candidates: vec![TAIL.to_string()],
                        at: 0,
                    };
                }
                true
            }
        }
    }

    fn push_str(&mut self, s: &str) -> bool {
        s.chars().all(|c| self.push(c))
    }
}

pub struct ForcedToolCall {
    texts: Arc<Vec<String>>,
    stop_ids: Vec<u32>,
    grammar: CallGrammar,
}

impl ForcedToolCall {
    pub fn new(texts: Arc<Vec<String>>, stop_ids: Vec<u32>, names: &[String]) -> Self {
        Self {
            texts,
            stop_ids,
            grammar: CallGrammar::new(names),
        }
    }
}

impl TokenConstraint for ForcedToolCall {
    fn allows(&self, id: u32) -> bool {
        if self.stop_ids.contains(&id) {
            return self.is_complete();
        }
        match self.texts.get(id as usize) {
            // JSON whitespace inside the arguments is fine; a token must add something.
            Some(t) if !t.is_empty() => self.grammar.clone().push_str(t),
            _ => false,
        }
    }

    fn advance(&mut self, id: u32) {
        if let Some(t) = self.texts.get(id as usize) {
            self.grammar.push_str(t);
        }
    }

    fn is_complete(&self) -> bool {
        matches!(self.grammar.phase, Phase::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_one_call_to_an_allowed_tool_then_completes() {
        let names = vec!["get_weather".to_string(), "get_time".to_string()];
        let mut g = CallGrammar::new(&names);
        assert!(g.push_str("<tool_call>\n{\"name\": \"get_"));
        assert!(!g.clone().push_str("x"));
        assert!(g.push_str("time\", \"arguments\": {\"tz\": \"UTC\"}"));
        assert!(!g.clone().push_str(" extra"));
        assert!(g.push_str("}\n</tool_call>"));
        assert!(matches!(g.phase, Phase::Done));
        assert!(!g.push('x'));
        assert!(!CallGrammar::new(&names).push_str("Sure! <tool_call>"));
    }

    #[test]
    fn token_constraint_uses_token_texts_and_stop_ids() {
        let texts: Vec<String> = [
            "<eos>",
            "<tool_call>\n{\"name\": \"f\", \"arguments\": ",
            "{}",
            "}\n</tool_call>",
            "hi",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut c = ForcedToolCall::new(Arc::new(texts), vec![0], &["f".to_string()]);
        assert!(!c.allows(0) && !c.allows(4) && c.allows(1));
        for id in [1, 2, 3] {
            assert!(c.allows(id), "{id}");
            c.advance(id);
        }
        assert!(c.is_complete() && c.allows(0));
    }
}
