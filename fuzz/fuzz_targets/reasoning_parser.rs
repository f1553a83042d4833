//! `<think>…</think>` splitting of model output fed in arbitrary pieces: every byte of the input ends
//! up in reasoning or content, never both, never lost (tags excepted).
#![no_main]
use libfuzzer_sys::fuzz_target;
use moe_daemon::api::reasoning::ReasoningParser;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let mut p = ReasoningParser::new(cut & 0x80 != 0);
    let step = cut as usize % 7 + 1;
    let chars: Vec<char> = text.chars().collect();
    let mut out = 0;
    for piece in chars.chunks(step) {
        let s: String = piece.iter().collect();
        let split = p.push(&s);
        out += split.reasoning.len() + split.content.len();
    }
    let split = p.finish();
    out += split.reasoning.len() + split.content.len();
    assert!(out <= text.len(), "output longer than the input");
});
