//! Chat-template rendering of request messages and tools (a real Qwen3 template, the inputs a client
//! controls), and compiling an arbitrary template source (what `--chat-template` or a checkpoint gives).
//! The body is `moe_fuzzing::chat_template`, which CI also runs on the seeds and their mutations.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| moe_fuzzing::chat_template(data));
