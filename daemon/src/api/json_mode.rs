//! `response_format: {"type": "json_object"}`: output constrained token by token to a valid JSON object
//! (a token is sampled only if its text keeps the output a valid JSON prefix; end-of-sequence only once
//! the object is closed, and the sequence ends as soon as it is). No schema: any object is allowed.
use crate::sched::TokenConstraint;
use crate::text::json_prefix::JsonPrefix;
use crate::text::TextTokenizer;
use std::sync::Arc;

pub struct JsonObjectConstraint {
    /// Text of every token id (special tokens as their literal strings).
    texts: Arc<Vec<String>>,
    stop_ids: Vec<u32>,
    state: JsonPrefix,
}

impl JsonObjectConstraint {
    pub fn new(texts: Arc<Vec<String>>, stop_ids: Vec<u32>) -> Self {
        Self {
            texts,
            stop_ids,
            state: JsonPrefix::default(),
        }
    }
}

/// Per-token texts for constraints, computed once at start-up.
pub fn token_texts(tok: &TextTokenizer) -> Vec<String> {
    (0..tok.vocab_size() as u32)
        .map(|id| tok.decode(&[id], false).unwrap_or_default())
        .collect()
}

impl TokenConstraint for JsonObjectConstraint {
    fn allows(&self, id: u32) -> bool {
        if self.stop_ids.contains(&id) {
            return self.state.is_complete();
        }
        match self.texts.get(id as usize) {
            Some(t) if !t.is_empty() => self.state.clone().push_str(t),
            _ => false,
        }
    }

    fn advance(&mut self, id: u32) {
        if let Some(t) = self.texts.get(id as usize) {
            self.state.push_str(t);
        }
    }

    fn is_complete(&self) -> bool {
        self.state.is_complete()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allows_only_tokens_that_keep_a_json_prefix() {
        let texts: Vec<String> = ["<eos>", "{", "\"a\"", ":", " 1", "}", "hello", ""]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut c = JsonObjectConstraint::new(Arc::new(texts), vec![0]);
        assert!(!c.allows(0) && !c.allows(6) && !c.allows(7) && c.allows(1));
        for id in [1, 2, 3, 4] {
            assert!(c.allows(id), "{id}");
            c.advance(id);
        }
        assert!(!c.allows(0) && !c.allows(2));
        c.advance(5);
        assert!(c.is_complete() && c.allows(0));
    }
}
