//! `/v1/chat/completions` body: parsing and every parameter check the handler runs before tokenising.
//! The body is `moe_fuzzing::chat_request`, which CI also runs on the seeds and their mutations.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| moe_fuzzing::chat_request(data));
