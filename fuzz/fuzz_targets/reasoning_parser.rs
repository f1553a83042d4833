//! `<think>…</think>` splitting of model output fed in arbitrary pieces: every byte of the input ends
//! up in reasoning or content, never both, never lost (tags excepted).
//! The body is `moe_fuzzing::reasoning_parser`, which CI also runs on the seeds and their mutations.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| moe_fuzzing::reasoning_parser(data));
