//! What each fuzz target does with one input, as a plain function: every input a client or a
//! checkpoint file controls must give an error or a result, never a panic, an overflow or a hang.
//! `fuzz/fuzz_targets/<name>.rs` hands libFuzzer's inputs to the function of the same name;
//! `tests/seeds_and_mutations.rs` runs each on `fuzz/seeds/<name>` and mutations of them.
mod files;
pub mod mutate;
mod requests;
mod text;

pub use files::{config_json, gguf, safetensors_header, safetensors_index};
pub use requests::{chat_request, completions_request, tokenize_request};
pub use text::{chat_template, reasoning_parser, tool_parser};

/// A fuzz target: its name (the directory of its seeds) and its body.
pub type Target = (&'static str, fn(&[u8]));

/// Every target, by name.
pub const TARGETS: &[Target] = &[
    ("chat_request", chat_request),
    ("completions_request", completions_request),
    ("tokenize_request", tokenize_request),
    ("safetensors_header", safetensors_header),
    ("safetensors_index", safetensors_index),
    ("gguf", gguf),
    ("config_json", config_json),
    ("chat_template", chat_template),
    ("tool_parser", tool_parser),
    ("reasoning_parser", reasoning_parser),
];

/// A scratch directory for the whole process: file targets rewrite their file in it per input
/// (creating a directory per input would halve libFuzzer's speed).
fn scratch_dir() -> &'static std::path::Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"))
        .path()
}
