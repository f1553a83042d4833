//! Incremental detokenisation (vLLM's prefix/read offsets): each new token yields the text it adds, and a
//! token that ends inside a multi-byte UTF-8 character yields nothing until the character is complete, so
//! streamed deltas never carry broken characters.
use super::{TextError, TextTokenizer};

#[derive(Default)]
pub struct IncrementalDetokenizer {
    tokens: Vec<u32>,
    /// Start of the window decoded for context (so merges at the window edge decode as in the full text).
    prefix_offset: usize,
    /// Tokens before this index have been emitted.
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    pub fn new(skip_special_tokens: bool) -> Self {
        Self {
            skip_special_tokens,
            ..Default::default()
        }
    }

    /// Adds one token; returns the newly completed text (possibly empty).
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String, TextError> {
        self.tokens.push(id);
        let skip = self.skip_special_tokens;
        let prefix_text = tok.decode(&self.tokens[self.prefix_offset..self.read_offset], skip)?;
        let full_text = tok.decode(&self.tokens[self.prefix_offset..], skip)?;
        if full_text.len() > prefix_text.len() && !full_text.ends_with('\u{FFFD}') {
            let delta = full_text
                .get(prefix_text.len()..)
                .map(str::to_string)
                .unwrap_or_default();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.tokens.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }
}
