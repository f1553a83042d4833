//! `/v1/completions` body: parsing and parameter checks.
#![no_main]
use libfuzzer_sys::fuzz_target;
use moe_daemon::api::types::{parse_body, CompletionRequest};

fuzz_target!(|body: &[u8]| {
    let Ok(req) = parse_body::<CompletionRequest>(body) else {
        return;
    };
    let _ = req.common.n();
    let _ = req.common.max_tokens();
    let _ = req.common.sampling();
    let _ = req.common.json_mode();
    let _ = req.common.stop.strings();
});
