//! A checkpoint directory whose `model.safetensors` holds the input: open (header parse and checks)
//! and load every tensor it lists.
//! The body is `moe_fuzzing::safetensors_header`, which CI also runs on the seeds and their mutations.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| moe_fuzzing::safetensors_header(data));
