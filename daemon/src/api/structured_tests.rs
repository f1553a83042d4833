//! Grammar masks on a small byte-level tokenizer (one token per byte, plus end-of-turn and, in one
//! variant, the tool-call tags — Hermes' and GLM's — as single tokens): what is allowed, when the
//! grammar engages, when the sequence ends.
use super::*;
use crate::api::grammar::{self, CallCount, CallFormat, ToolSpec};
use crate::api::thinking::{ThinkStart, ThinkingGate, ThinkingSpec};
use serde_json::json;
use std::time::Duration;

const EOS: u32 = 256;
/// The tags given single tokens (ids 257…) in the `tag_tokens` variant.
const TAGS: [&str; 6] = [
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
];

/// The single token of `tag` in the `tag_tokens` variant.
fn tag_id(tag: &str) -> u32 {
    257 + TAGS.iter().position(|t| *t == tag).unwrap() as u32
}

/// GPT-2's byte → printable char map (what byte-level BPE vocabularies are written in).
fn byte_char(b: u8) -> char {
    let self_mapped = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if self_mapped {
        return b as char;
    }
    let shifted = (0..b)
        .filter(|&x| !matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF))
        .count() as u32;
    char::from_u32(0x100 + shifted).unwrap_or('?')
}

fn byte_tokenizer(tag_tokens: bool) -> (TextTokenizer, tempfile::TempDir) {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8)
        .map(|b| (byte_char(b).to_string(), json!(b)))
        .collect();
    let mut added = vec![json!({"id": EOS, "content": "<|im_end|>", "special": true,
        "single_word": false, "lstrip": false, "rstrip": false, "normalized": false})];
    if tag_tokens {
        for (i, t) in TAGS.iter().enumerate() {
            added.push(json!({"id": 257 + i, "content": t, "special": false,
                "single_word": false, "lstrip": false, "rstrip": false, "normalized": false}));
        }
    }
    let spec = json!({
        "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
        "post_processor": null, "added_tokens": added,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), spec.to_string()).unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        json!({"eos_token": "<|im_end|>"}).to_string(),
    )
    .unwrap();
    (TextTokenizer::from_hf_dir(dir.path()).unwrap(), dir)
}

struct Fixture {
    so: StructuredOutputs,
    vocab: usize,
    metrics: Arc<Metrics>,
    _dir: tempfile::TempDir,
}

fn fixture(tag_tokens: bool) -> Fixture {
    let (tok, dir) = byte_tokenizer(tag_tokens);
    let vocab = tok.vocab_size();
    Fixture {
        so: StructuredOutputs::new(&tok, vocab).unwrap(),
        vocab,
        metrics: Arc::new(Metrics::new().unwrap()),
        _dir: dir,
    }
}

impl Fixture {
    fn control(&self, g: TopLevelGrammar, auto_single: Option<bool>) -> OutputControl {
        self.control_in(g, auto_single, CallFormat::Hermes)
    }

    fn control_in(
        &self,
        g: TopLevelGrammar,
        auto_single: Option<bool>,
        format: CallFormat,
    ) -> OutputControl {
        let m = self.so.compile(g, &self.metrics).unwrap();
        let use_ = match auto_single {
            None => GrammarUse::Whole(m),
            Some(single) => GrammarUse::AfterToolCallOpens {
                call: m,
                single,
                format,
            },
        };
        OutputControl::new(
            Some((use_, self.so.tok_env().clone())),
            vec![],
            vec![EOS],
            self.metrics.clone(),
        )
    }
}

fn allowed(c: &mut OutputControl, vocab: usize, id: u32) -> bool {
    let mut l = vec![0.0; vocab];
    c.apply(&mut l);
    l[id as usize].is_finite()
}

/// Feeds `text` byte by byte, each byte first checked against the mask.
fn feed(c: &mut OutputControl, vocab: usize, text: &str) {
    for b in text.bytes() {
        assert!(
            allowed(c, vocab, b as u32),
            "{:?} refused in {text:?}",
            b as char
        );
        c.advance(b as u32);
    }
}

#[test]
fn json_schema_mask_follows_the_schema_on_one_line() {
    let f = fixture(false);
    let schema = json!({"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}},
                        "required": ["city"], "additionalProperties": false});
    let mut c = f.control(grammar::json_response(Some(&schema), true), None);
    assert!(!allowed(&mut c, f.vocab, b'x' as u32) && !allowed(&mut c, f.vocab, EOS));
    feed(&mut c, f.vocab, "{\"city\": ");
    // One space after `:` at most; no newline; only the enum's values.
    for b in [b' ', b'\n', b'"'] {
        assert_eq!(
            allowed(&mut c, f.vocab, b as u32),
            b == b'"',
            "{:?}",
            b as char
        );
    }
    feed(&mut c, f.vocab, "\"P");
    assert!(!allowed(&mut c, f.vocab, b'L' as u32));
    feed(&mut c, f.vocab, "aris\"}");
    assert!(c.is_complete() || allowed(&mut c, f.vocab, EOS));
    assert!(f.metrics.structured_mask_seconds.get_sample_count() > 5);
}

fn tools() -> Vec<ToolSpec> {
    vec![ToolSpec::from_openai(
        &json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": false}}}),
    )
    .unwrap()]
}

#[test]
fn auto_calls_are_free_until_the_tag_and_the_brace_then_follow_the_schema() {
    let f = fixture(false);
    let g = grammar::call_after_open(&tools(), &f.so.call_tags, CallFormat::Hermes).unwrap();
    let mut c = f.control(g, Some(true));
    feed(&mut c, f.vocab, "Let me check. <tool_call>\n");
    assert!(
        allowed(&mut c, f.vocab, b'x' as u32),
        "still free before the brace"
    );
    feed(&mut c, f.vocab, "{\"");
    assert!(
        !allowed(&mut c, f.vocab, b'x' as u32),
        "engaged: only `name` may follow"
    );
    feed(&mut c, f.vocab, "name\":\"get_weather\",\"arguments\":{\"");
    assert!(
        !allowed(&mut c, f.vocab, b'd' as u32),
        "only the schema's `city`"
    );
    feed(&mut c, f.vocab, "city\":\"Paris\"}}\n</tool_call>");
    assert!(
        c.is_complete(),
        "parallel_tool_calls false: the sequence ends after one call"
    );
}

#[test]
fn another_call_format_after_the_tag_is_left_alone() {
    let f = fixture(false);
    let g = grammar::call_after_open(&tools(), &f.so.call_tags, CallFormat::Hermes).unwrap();
    let mut c = f.control(g, Some(false));
    feed(
        &mut c,
        f.vocab,
        "<tool_call>get_weather\n<arg_key>city</arg_key>",
    );
    assert!(allowed(&mut c, f.vocab, b'x' as u32));
    assert!(!c.is_complete());
}

#[test]
fn forced_calls_use_tag_tokens_when_the_vocabulary_has_them() {
    let f = fixture(true);
    let g = grammar::forced_calls(
        &tools(),
        &f.so.call_tags,
        CallFormat::Hermes,
        CallCount::One,
    )
    .unwrap();
    let mut c = f.control(g, None);
    assert!(
        !allowed(&mut c, f.vocab, b'<' as u32),
        "the tag token, not its spelling"
    );
    assert!(allowed(&mut c, f.vocab, tag_id("<tool_call>")));
    c.advance(tag_id("<tool_call>"));
    feed(
        &mut c,
        f.vocab,
        "\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Nice\"}}\n",
    );
    let close = tag_id("</tool_call>");
    assert!(allowed(&mut c, f.vocab, close) && !allowed(&mut c, f.vocab, EOS));
    c.advance(close);
    assert!(c.is_complete() || allowed(&mut c, f.vocab, EOS));
}

/// A tool with a required enum string, an optional integer and an optional free string.
fn glm_tools() -> Vec<ToolSpec> {
    vec![ToolSpec::from_openai(
        &json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Lyon"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "note": {"type": "string", "maxLength": 24}},
        "required": ["city"], "additionalProperties": false}}}),
    )
    .unwrap()]
}

/// Feeds `text`, reading each GLM / Hermes tag as its single token when the vocabulary has one.
fn feed_tagged(c: &mut OutputControl, vocab: usize, text: &str, tag_tokens: bool) {
    let mut rest = text;
    while !rest.is_empty() {
        let tag = TAGS
            .iter()
            .find(|t| rest.starts_with(**t))
            .filter(|_| tag_tokens);
        match tag {
            Some(t) => {
                let id = tag_id(t);
                assert!(allowed(c, vocab, id), "{t} refused in {text:?}");
                c.advance(id);
                rest = &rest[t.len()..];
            }
            None => {
                let n = rest.chars().next().map_or(1, char::len_utf8);
                feed(c, vocab, &rest[..n]);
                rest = &rest[n..];
            }
        }
    }
}

/// Whether `text` can come next (fed to a copy of the control).
fn glm_accepts(f: &Fixture, g: &TopLevelGrammar, prefix: &str, tag_tokens: bool) -> bool {
    let mut c = f.control_in(g.clone(), None, CallFormat::Glm);
    let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        feed_tagged(&mut c, f.vocab, prefix, tag_tokens)
    }));
    ok.is_ok()
}

#[test]
fn glm_forced_calls_take_the_schemas_names_and_typed_values() {
    for tag_tokens in [false, true] {
        let f = fixture(tag_tokens);
        let g = grammar::forced_calls(
            &glm_tools(),
            &f.so.call_tags,
            CallFormat::Glm,
            CallCount::One,
        )
        .unwrap();
        let ok = |text: &str| glm_accepts(&f, &g, text, tag_tokens);
        // GLM-4.5's newlines and 4.7's none; a JSON integer; raw (unquoted) text for a string.
        let glm45 =
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n\
                     <arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>";
        assert!(ok(glm45), "tags as tokens: {tag_tokens}");
        assert!(ok("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Lyon</arg_value>\
                    <arg_key>note</arg_key><arg_value>bring a \"coat\" <maybe></arg_value></tool_call>"));
        // An invented name, a value outside the enum, a string for the integer, a quoted string,
        // the required argument left out, an unknown tool.
        for bad in [
            "<tool_call>get_weather<arg_key>d",
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome",
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>x",
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>\"",
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Lyon</arg_value><arg_key>note</arg_key><arg_value>twenty-five characters...",
            "<tool_call>get_weather</tool_call>",
            "<tool_call>get_time",
        ] {
            assert!(!ok(bad), "accepted {bad:?} (tags as tokens: {tag_tokens})");
        }
        let mut c = f.control_in(g.clone(), None, CallFormat::Glm);
        feed_tagged(&mut c, f.vocab, glm45, tag_tokens);
        assert!(c.is_complete() || allowed(&mut c, f.vocab, EOS));
    }
}

/// A tool whose raw-text arguments carry a `pattern` (anchored, and one matching anywhere) and
/// `format`s.
fn glm_formatted_tool(strict: bool) -> Vec<ToolSpec> {
    vec![
        ToolSpec::from_openai(&json!({"type": "function", "function": {"name": "book",
        "strict": strict, "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{2}$"},
            "ref": {"type": "string", "pattern": "x7"},
            "day": {"type": "string", "format": "date"},
            "id": {"type": "string", "format": "uuid"},
            "host": {"type": "string", "format": "ipv4", "maxLength": 9}},
        "required": ["code"], "additionalProperties": false}}}))
        .unwrap(),
    ]
}

#[test]
fn glm_raw_text_values_follow_pattern_and_format() {
    for tag_tokens in [false, true] {
        let f = fixture(tag_tokens);
        let g = grammar::forced_calls(
            &glm_formatted_tool(true),
            &f.so.call_tags,
            CallFormat::Glm,
            CallCount::One,
        )
        .unwrap();
        let call = |args: &[(&str, &str)]| {
            let a: String = args
                .iter()
                .map(|(k, v)| format!("<arg_key>{k}</arg_key><arg_value>{v}</arg_value>"))
                .collect();
            format!("<tool_call>book{a}</tool_call>")
        };
        let ok = |args: &[(&str, &str)]| glm_accepts(&f, &g, &call(args), tag_tokens);
        assert!(ok(&[("code", "ABC-12")]), "tags as tokens: {tag_tokens}");
        assert!(ok(&[
            ("code", "XYZ-99"),
            ("ref", "ab x7 cd"),
            ("day", "2026-02-28"),
            ("id", "123e4567-e89b-12d3-a456-426614174000"),
            ("host", "10.0.0.1")
        ]));
        for bad in [
            &[("code", "abc-12")][..],
            &[("code", "ABC-123")],
            &[("code", "ABC-12"), ("ref", "x8")],
            &[("code", "ABC-12"), ("day", "2026-02-30")],
            &[("code", "ABC-12"), ("day", "tomorrow")],
            &[("code", "ABC-12"), ("id", "123e4567")],
            &[("code", "ABC-12"), ("host", "300.1.1.1")],
            // ipv4 and at most 9 characters: both hold.
            &[("code", "ABC-12"), ("host", "192.168.0.1")],
        ] {
            assert!(!ok(bad), "accepted {bad:?} (tags as tokens: {tag_tokens})");
        }
        // A text tag inside a constrained value cannot end it early and then carry on.
        let early = "<tool_call>book<arg_key>ref</arg_key><arg_value>a</arg_value>x7";
        assert!(!glm_accepts(&f, &g, early, tag_tokens));
    }
}

#[test]
fn glm_unknown_formats_are_refused_for_strict_tools_and_ignored_otherwise() {
    let f = fixture(false);
    let with_format = |strict: bool| {
        let mut t = glm_formatted_tool(strict);
        t[0].parameters["properties"]["day"]["format"] = json!("lunar-date");
        grammar::forced_calls(&t, &f.so.call_tags, CallFormat::Glm, CallCount::One)
    };
    let err = with_format(true).unwrap_err();
    assert!(
        err.contains("Unknown format: lunar-date") && err.contains("`day`"),
        "{err}"
    );
    let g = with_format(false).unwrap();
    let text = "<tool_call>book<arg_key>code</arg_key><arg_value>ABC-12</arg_value>\
                <arg_key>day</arg_key><arg_value>any text</arg_value></tool_call>";
    assert!(glm_accepts(&f, &g, text, false));
    // The JSON path refuses the same format the same way.
    let schema = json!({"type": "string", "format": "lunar-date"});
    let json =
        f.so.compile(grammar::json_response(Some(&schema), true), &f.metrics);
    assert!(json.err().unwrap().contains("Unknown format: lunar-date"));
}

/// Whether the grammar accepts `text` whole (and may end there).
fn accepts_whole(f: &Fixture, g: &TopLevelGrammar, text: &str) -> bool {
    let mut m = f.so.compile(g.clone(), &f.metrics).unwrap();
    let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
    m.try_consume_tokens(&tokens)
        .is_ok_and(|n| n == tokens.len())
        && m.is_accepting().unwrap_or(false)
}

#[test]
fn raw_text_formats_accept_what_the_json_path_accepts() {
    let f = fixture(false);
    let samples = [
        "2026-02-28T12:30:00Z",
        "2026-02-30T12:30:00Z",
        "2026-12-01",
        "2026-13-01",
        "23:59:60+01:00",
        "24:00:00Z",
        "P3DT4H",
        "a.b+c@example.org",
        "a@@b",
        "host-1.example",
        "-host",
        "192.168.0.1",
        "256.1.1.1",
        "::1",
        "2001:db8::8a2e:370:7334",
        "1::2::3",
        "123e4567-e89b-12d3-a456-426614174000",
        "123e4567e89b12d3a456426614174000",
        "https://example.org/a?b=c#d",
        "not a uri",
    ];
    let formats = [
        "date-time",
        "date",
        "time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uuid",
        "uri",
    ];
    for format in formats {
        let prop = json!({"type": "string", "format": format});
        let json = grammar::json_response(Some(&prop), true);
        let regexes = crate::api::raw_text::text_regexes(&prop, true).unwrap();
        let raw = TopLevelGrammar::from_lark(format!(
            "start: V\nV: {}",
            crate::api::raw_text::terminal_expr(&regexes)
        ));
        let mut accepted = 0;
        for s in samples {
            let by_json = accepts_whole(&f, &json, &serde_json::to_string(s).unwrap());
            assert_eq!(
                accepts_whole(&f, &raw, s),
                by_json,
                "{format} on {s:?}: raw text and JSON disagree"
            );
            accepted += usize::from(by_json);
        }
        assert!(accepted > 0, "{format}: no sample accepted");
    }
}

#[test]
fn glm_auto_calls_engage_at_the_tag_and_end_after_one_call_when_single() {
    for tag_tokens in [false, true] {
        let f = fixture(tag_tokens);
        let g = grammar::call_after_open(&glm_tools(), &f.so.call_tags, CallFormat::Glm).unwrap();
        let mut c = f.control_in(g, Some(true), CallFormat::Glm);
        feed_tagged(
            &mut c,
            f.vocab,
            "I will look it up. <tool_call>",
            tag_tokens,
        );
        assert!(
            !allowed(&mut c, f.vocab, b'x' as u32),
            "engaged: only the tool's name"
        );
        feed_tagged(&mut c, f.vocab, "get_weather\n<arg_key>", tag_tokens);
        assert!(!allowed(&mut c, f.vocab, b'd' as u32), "only `city` first");
        feed_tagged(
            &mut c,
            f.vocab,
            "city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
            tag_tokens,
        );
        assert!(c.is_complete(), "tags as tokens: {tag_tokens}");
    }
}

#[test]
fn glm_parallel_calls_and_a_json_answer_are_both_possible() {
    let f = fixture(true);
    let calls = grammar::forced_calls(
        &glm_tools(),
        &f.so.call_tags,
        CallFormat::Glm,
        CallCount::OneOrMore,
    )
    .unwrap();
    let one =
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>";
    assert!(glm_accepts(&f, &calls, &format!("{one}\n{one}{one}"), true));
    let either = grammar::json_or_calls(
        None,
        false,
        &glm_tools(),
        &f.so.call_tags,
        CallFormat::Glm,
        CallCount::One,
    )
    .unwrap();
    assert!(glm_accepts(&f, &either, one, true));
    assert!(glm_accepts(&f, &either, "{\"a\": 1}", true));
}

#[test]
fn logit_bias_moves_logits_without_a_grammar() {
    let metrics = Arc::new(Metrics::new().unwrap());
    let mut c = OutputControl::new(None, vec![(1, -100.0), (2, 5.0)], vec![], metrics);
    let mut l = vec![0.0; 4];
    assert!(c.apply(&mut l));
    assert_eq!(l, vec![0.0, -100.0, 5.0, 0.0]);
}

// --- masks computed during the forward pass ---

/// The scheduler calls `apply` / `advance` / `is_complete` but never `prepare`: every mask is
/// computed on the engine thread after the forward pass (the reference).
struct InlineOnly(OutputControl);

impl TokenConstraint for InlineOnly {
    fn apply(&mut self, logits: &mut [f32]) -> bool {
        self.0.apply(logits)
    }
    fn advance(&mut self, id: u32) {
        self.0.advance(id)
    }
    fn is_complete(&self) -> bool {
        self.0.is_complete()
    }
}

#[derive(Clone, Copy, Debug)]
enum MaskTiming {
    Inline,
    Overlapped,
    /// Each mask worker sleeps longer than a step first: every mask is late.
    Late,
}

/// Three sequences of a JSON-schema request through the real scheduler on the scripted model, which
/// writes an answer off the schema (wrong enum value, a string for an integer, an extra key), sampled
/// at temperature 1 with fixed seeds. Returns each sequence's output and the run's metrics.
fn constrained_run(f: &Fixture, timing: MaskTiming) -> (Vec<String>, Arc<Metrics>) {
    use crate::engine::sampling::SamplingParams;
    use crate::sched::scripted::{ScriptedModel, ScriptedReplies};
    use crate::sched::{spawn_engine, GenRequest, SchedulerConfig, SeqEvent};
    let bytes = |s: &str| s.bytes().map(u32::from).collect::<Vec<_>>();
    let model = ScriptedModel::new(ScriptedReplies {
        replies: vec![(
            bytes("go"),
            bytes(r#"{"city": "Rome", "days": "many", "x": 1}"#),
        )],
        end_token: EOS,
        vocab: f.vocab,
        max_positions: 4096,
        kv_cache_tokens: 65_536,
        step_delay: Duration::from_millis(1),
        step_stats: None,
    });
    let metrics = Arc::new(Metrics::new().unwrap());
    let h = spawn_engine(
        move || Ok(model),
        SchedulerConfig::default(),
        metrics.clone(),
    );
    while !h.is_ready() {
        std::thread::sleep(Duration::from_millis(1));
    }
    let schema = json!({"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]},
        "days": {"type": "integer"}}, "required": ["city", "days"], "additionalProperties": false});
    let mut rxs = Vec::new();
    for seed in 0..3 {
        let m =
            f.so.compile(grammar::json_response(Some(&schema), true), &metrics)
                .unwrap();
        let control = OutputControl::new(
            Some((GrammarUse::Whole(m), f.so.tok_env().clone())),
            vec![],
            vec![EOS],
            metrics.clone(),
        );
        let constraint: Box<dyn TokenConstraint> = match timing {
            MaskTiming::Inline => Box::new(InlineOnly(control)),
            MaskTiming::Overlapped => Box::new(control),
            MaskTiming::Late => Box::new(control.with_mask_delay(Duration::from_millis(15))),
        };
        let mut sampling = SamplingParams::greedy();
        sampling.temperature = 1.0;
        sampling.seed = Some(seed);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        h.submit(GenRequest {
            prompt: bytes("go"),
            sampling,
            max_tokens: 64,
            stop_token_ids: vec![EOS],
            logprobs: None,
            deadline: None,
            events: tx,
            constraint: Some(constraint),
        })
        .unwrap();
        rxs.push(rx);
    }
    let outputs = rxs
        .iter_mut()
        .map(|rx| {
            let mut out = Vec::new();
            loop {
                match rx.blocking_recv().expect("engine dropped the request") {
                    SeqEvent::Token { id, .. } => out.push(id as u8),
                    SeqEvent::Finished { .. } => break,
                    SeqEvent::Error(e) => panic!("{e}"),
                }
            }
            String::from_utf8(out).unwrap()
        })
        .collect();
    (outputs, metrics)
}

#[test]
fn masks_computed_during_the_forward_pass_late_or_not_give_the_same_output() {
    let f = fixture(false);
    let (reference, inline) = constrained_run(&f, MaskTiming::Inline);
    for out in &reference {
        let v: serde_json::Value =
            serde_json::from_str(out).unwrap_or_else(|e| panic!("{out}: {e}"));
        assert!(
            ["Paris", "Lyon"].contains(&v["city"].as_str().unwrap()),
            "{out}"
        );
        // An integer (JSON's `-0` included).
        let days = v["days"].as_f64().unwrap();
        assert!(
            days.fract() == 0.0 && v.as_object().unwrap().len() == 2,
            "{out}"
        );
    }
    assert!(inline.structured_masks_inline.get() > 10);
    assert_eq!(inline.structured_masks_overlapped.get(), 0);
    for timing in [MaskTiming::Overlapped, MaskTiming::Late] {
        let (outputs, metrics) = constrained_run(&f, timing);
        assert_eq!(outputs, reference, "{timing:?}");
        // Every mask came from a worker (the inline fallback is for a lost worker only).
        assert_eq!(metrics.structured_masks_inline.get(), 0, "{timing:?}");
        assert_eq!(
            metrics.structured_masks_overlapped.get(),
            inline.structured_masks_inline.get(),
            "{timing:?}"
        );
    }
}

// --- a reasoning section before the grammar ---

fn thinking(
    f: &Fixture,
    c: OutputControl,
    start: ThinkStart,
    budget: Option<usize>,
) -> OutputControl {
    let gate = ThinkingGate::new(ThinkingSpec { start, budget }, &f.so.think_tokens);
    c.with_thinking(gate, f.so.tok_env().clone())
}

#[test]
fn forced_calls_wait_for_the_reasoning_to_close() {
    for tag_tokens in [false, true] {
        let f = fixture(tag_tokens);
        let g = grammar::forced_calls(
            &glm_tools(),
            &f.so.call_tags,
            CallFormat::Glm,
            CallCount::One,
        )
        .unwrap();
        let mut c = thinking(
            &f,
            f.control_in(g, None, CallFormat::Glm),
            ThinkStart::MayOpen,
            None,
        );
        assert!(
            !allowed(&mut c, f.vocab, b'x' as u32),
            "the call or <think> first"
        );
        feed_tagged(
            &mut c,
            f.vocab,
            "<think>I should call get_weather ",
            tag_tokens,
        );
        assert!(allowed(&mut c, f.vocab, b'x' as u32), "free text inside");
        assert!(!allowed(&mut c, f.vocab, EOS), "no end before the call");
        feed_tagged(
            &mut c,
            f.vocab,
            "<tool_call>, not yet.</think>\n\n",
            tag_tokens,
        );
        assert!(
            !allowed(&mut c, f.vocab, b'x' as u32),
            "the grammar after </think>"
        );
        feed_tagged(
            &mut c,
            f.vocab,
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Lyon</arg_value></tool_call>",
            tag_tokens,
        );
        assert!(c.is_complete() || allowed(&mut c, f.vocab, EOS));
    }
}

#[test]
fn a_model_that_does_not_think_answers_at_once() {
    for tag_tokens in [false, true] {
        let f = fixture(tag_tokens);
        let g = grammar::forced_calls(
            &glm_tools(),
            &f.so.call_tags,
            CallFormat::Glm,
            CallCount::One,
        )
        .unwrap();
        let mut c = thinking(
            &f,
            f.control_in(g, None, CallFormat::Glm),
            ThinkStart::MayOpen,
            None,
        );
        let call =
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>";
        feed_tagged(&mut c, f.vocab, call, tag_tokens);
        assert!(
            c.is_complete() || allowed(&mut c, f.vocab, EOS),
            "tags as tokens: {tag_tokens}"
        );
    }
    // A JSON answer: `{` is no way into `<think>`.
    let f = fixture(false);
    let schema =
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let g = grammar::json_response(Some(&schema), true);
    let mut c = thinking(&f, f.control(g, None), ThinkStart::MayOpen, None);
    assert!(allowed(&mut c, f.vocab, b'<' as u32) && !allowed(&mut c, f.vocab, b'x' as u32));
    feed(&mut c, f.vocab, "{\"a\":1}");
    assert!(c.is_complete() || allowed(&mut c, f.vocab, EOS));
}

#[test]
fn a_spent_budget_closes_the_reasoning_and_the_answer_follows() {
    let f = fixture(false);
    let schema =
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let g = grammar::json_response(Some(&schema), true);
    // The prompt opened <think>; 5 reasoning tokens allowed.
    let mut c = thinking(&f, f.control(g, None), ThinkStart::Inside, Some(5));
    feed(&mut c, f.vocab, "hmmmm");
    let mut closing = Vec::new();
    for _ in 0.."</think>".len() {
        let mut l = vec![0.0; f.vocab];
        assert!(c.apply(&mut l));
        let only: Vec<usize> = (0..f.vocab).filter(|&i| l[i].is_finite()).collect();
        assert_eq!(only.len(), 1, "the gate writes the tag itself");
        closing.push(only[0] as u8);
        c.advance(only[0] as u32);
    }
    assert_eq!(closing, b"</think>");
    feed(&mut c, f.vocab, "\n{\"a\":2}");
    assert!(c.is_complete() || allowed(&mut c, f.vocab, EOS));
}

#[test]
fn auto_calls_are_not_watched_inside_the_reasoning() {
    let f = fixture(false);
    let g = grammar::call_after_open(&tools(), &f.so.call_tags, CallFormat::Hermes).unwrap();
    let mut c = thinking(&f, f.control(g, Some(true)), ThinkStart::MayOpen, None);
    feed(&mut c, f.vocab, "<think>maybe <tool_call>\n{\"x");
    assert!(
        allowed(&mut c, f.vocab, b'y' as u32),
        "reasoning is free text"
    );
    feed(&mut c, f.vocab, "</think>Let me look. <tool_call>\n{\"");
    assert!(
        !allowed(&mut c, f.vocab, b'x' as u32),
        "engaged after the reasoning"
    );
}
