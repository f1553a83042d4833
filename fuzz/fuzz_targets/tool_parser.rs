//! Tool-call extraction (Hermes `<tool_call>` JSON and GLM `<arg_key>` XML) from model output fed in
//! arbitrary pieces: never panics, and no text is both content and call.
//! The body is `moe_fuzzing::tool_parser`, which CI also runs on the seeds and their mutations.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| moe_fuzzing::tool_parser(data));
