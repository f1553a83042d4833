//! `/tokenize` body through the same path as the handler: parse, then tokenise within the context,
//! long texts through the prefix probe (a small byte-level BPE tokenizer with a special token).
//! The body is `moe_fuzzing::tokenize_request`, which CI also runs on the seeds and their mutations.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| moe_fuzzing::tokenize_request(data));
