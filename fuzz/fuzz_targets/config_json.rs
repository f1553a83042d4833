//! config.json: parsing, bounds, and the rotary tables built from the parsed config.
//! The body is `moe_fuzzing::config_json`, which CI also runs on the seeds and their mutations.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| moe_fuzzing::config_json(data));
