//! `model.safetensors.index.json` holding the input, next to one valid shard: shard names must stay
//! inside the directory and every failure must be an error.
//! The body is `moe_fuzzing::safetensors_index`, which CI also runs on the seeds and their mutations.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| moe_fuzzing::safetensors_index(data));
