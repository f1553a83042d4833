//! A GGUF file holding the input: header, metadata and tensor table parse, then every tensor
//! dequantised, the HF config derived and the tokenizer built from metadata.
//! The body is `moe_fuzzing::gguf`, which CI also runs on the seeds and their mutations.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| moe_fuzzing::gguf(data));
