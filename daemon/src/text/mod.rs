//! Text side of serving: tokenizer (HF `tokenizers`), chat templates (minijinja in HF-compatible mode),
//! incremental detokenisation and stop-string matching.
pub mod chat_template;
pub mod detokenizer;
pub mod stop;
pub mod tokenizer;

pub use chat_template::ChatTemplate;

#[cfg(test)]
mod builtin_template_tests;
pub use detokenizer::IncrementalDetokenizer;
pub use stop::StopMatcher;
pub use tokenizer::TextTokenizer;

#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("{path}: {message}")]
    File { path: String, message: String },
}
