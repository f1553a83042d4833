//! `/v1/completions` body: parsing and parameter checks.
//! The body is `moe_fuzzing::completions_request`, which CI also runs on the seeds and their mutations.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| moe_fuzzing::completions_request(data));
