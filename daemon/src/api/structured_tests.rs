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
    /// The Hermes and GLM tags are single tokens of the vocabulary.
    tag_tokens: bool,
    metrics: Arc<Metrics>,
    _dir: tempfile::TempDir,
}

fn fixture(tag_tokens: bool) -> Fixture {
    let (tok, dir) = byte_tokenizer(tag_tokens);
    let vocab = tok.vocab_size();
    Fixture {
        so: StructuredOutputs::new(&tok, vocab).unwrap(),
        vocab,
        tag_tokens,
        metrics: Arc::new(Metrics::new().unwrap()),
        _dir: dir,
    }
}

/// Runs `test` on both vocabularies: tags spelled out byte by byte, and tags as single tokens.
fn on_both_vocabularies(test: impl Fn(&Fixture)) {
    for tag_tokens in [false, true] {
        test(&fixture(tag_tokens));
    }
}

impl Fixture {
    /// A sequence whose whole output follows `g` (Hermes call format).
    fn whole(&self, g: TopLevelGrammar) -> Seq {
        self.seq(g, None, CallFormat::Hermes)
    }

    /// A sequence whose whole output follows `g`, in GLM's call format.
    fn whole_glm(&self, g: TopLevelGrammar) -> Seq {
        self.seq(g, None, CallFormat::Glm)
    }

    /// `auto_single`: `None` the whole output follows `g`; `Some(single)` `g` engages once a tool call
    /// opens (`single`: the sequence ends after one call).
    fn seq(&self, g: TopLevelGrammar, auto_single: Option<bool>, format: CallFormat) -> Seq {
        let m = self.so.compile(g, &self.metrics).unwrap();
        let use_ = match auto_single {
            None => GrammarUse::Whole(m),
            Some(single) => GrammarUse::AfterToolCallOpens {
                call: m,
                single,
                format,
            },
        };
        Seq {
            c: OutputControl::new(
                Some((use_, self.so.tok_env().clone())),
                vec![],
                vec![EOS],
                self.metrics.clone(),
            ),
            vocab: self.vocab,
            tag_tokens: self.tag_tokens,
        }
    }

    /// Forced calls of `tools` in GLM's format.
    fn glm_calls(&self, tools: &[ToolSpec], count: CallCount) -> TopLevelGrammar {
        grammar::forced_calls(tools, &self.so.call_tags, CallFormat::Glm, count).unwrap()
    }

    /// `auto` calls of `tools`, engaged once a call opens.
    fn auto_calls(&self, tools: &[ToolSpec], format: CallFormat) -> TopLevelGrammar {
        grammar::call_after_open(tools, &self.so.call_tags, format).unwrap()
    }

    /// Whether a GLM-format sequence under `g` takes `text` (fed to a fresh sequence).
    fn glm_accepts(&self, g: &TopLevelGrammar, text: &str) -> bool {
        let mut s = self.whole_glm(g.clone());
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.feed(text))).is_ok()
    }

    /// Whether the grammar accepts `text` whole (and may end there).
    fn accepts_whole(&self, g: &TopLevelGrammar, text: &str) -> bool {
        let mut m = self.so.compile(g.clone(), &self.metrics).unwrap();
        let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
        m.try_consume_tokens(&tokens)
            .is_ok_and(|n| n == tokens.len())
            && m.is_accepting().unwrap_or(false)
    }
}

/// One sequence's output control, driven token by token as the sampler would.
struct Seq {
    c: OutputControl,
    vocab: usize,
    tag_tokens: bool,
}

impl Seq {
    /// Whether the mask lets `id` through.
    fn allows(&mut self, id: u32) -> bool {
        let mut l = vec![0.0; self.vocab];
        self.c.apply(&mut l);
        l[id as usize].is_finite()
    }

    fn allows_byte(&mut self, b: u8) -> bool {
        self.allows(b as u32)
    }

    /// Feeds `text` one token at a time (each tag as its single token where the vocabulary has one,
    /// else byte by byte), each first checked against the mask.
    fn feed(&mut self, text: &str) {
        let mut rest = text;
        while !rest.is_empty() {
            let tag = TAGS
                .iter()
                .find(|t| rest.starts_with(**t))
                .filter(|_| self.tag_tokens);
            let (ids, len) = match tag {
                Some(t) => (vec![tag_id(t)], t.len()),
                None => {
                    let n = rest.chars().next().map_or(1, char::len_utf8);
                    (rest.as_bytes()[..n].iter().map(|&b| b as u32).collect(), n)
                }
            };
            for id in ids {
                assert!(self.allows(id), "{:?} refused in {text:?}", &rest[..len]);
                self.c.advance(id);
            }
            rest = &rest[len..];
        }
    }

    /// The grammar is done or lets the sequence end.
    fn may_end(&mut self) -> bool {
        self.c.is_complete() || self.allows(EOS)
    }

    /// With a reasoning section before the grammar.
    fn thinking(self, f: &Fixture, start: ThinkStart, budget: Option<usize>) -> Seq {
        let gate = ThinkingGate::new(ThinkingSpec { start, budget }, &f.so.think_tokens);
        Seq {
            c: self.c.with_thinking(gate, f.so.tok_env().clone()),
            ..self
        }
    }
}

#[test]
fn json_schema_mask_follows_the_schema_on_one_line() {
    let f = fixture(false);
    let schema = json!({"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}},
                        "required": ["city"], "additionalProperties": false});
    let mut s = f.whole(grammar::json_response(Some(&schema), true));
    assert!(!s.allows_byte(b'x') && !s.allows(EOS));
    s.feed("{\"city\": ");
    // One space after `:` at most; no newline; only the enum's values.
    for b in [b' ', b'\n', b'"'] {
        assert_eq!(s.allows_byte(b), b == b'"', "{:?}", b as char);
    }
    s.feed("\"P");
    assert!(!s.allows_byte(b'L'));
    s.feed("aris\"}");
    assert!(s.may_end());
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
    let g = f.auto_calls(&tools(), CallFormat::Hermes);
    let mut s = f.seq(g, Some(true), CallFormat::Hermes);
    s.feed("Let me check. <tool_call>\n");
    assert!(s.allows_byte(b'x'), "still free before the brace");
    s.feed("{\"");
    assert!(!s.allows_byte(b'x'), "engaged: only `name` may follow");
    s.feed("name\":\"get_weather\",\"arguments\":{\"");
    assert!(!s.allows_byte(b'd'), "only the schema's `city`");
    s.feed("city\":\"Paris\"}}\n</tool_call>");
    assert!(
        s.c.is_complete(),
        "parallel_tool_calls false: the sequence ends after one call"
    );
}

#[test]
fn another_call_format_after_the_tag_is_left_alone() {
    let f = fixture(false);
    let g = f.auto_calls(&tools(), CallFormat::Hermes);
    let mut s = f.seq(g, Some(false), CallFormat::Hermes);
    s.feed("<tool_call>get_weather\n<arg_key>city</arg_key>");
    assert!(s.allows_byte(b'x'));
    assert!(!s.c.is_complete());
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
    let mut s = f.whole(g);
    assert!(!s.allows_byte(b'<'), "the tag token, not its spelling");
    s.feed("<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Nice\"}}\n");
    let close = tag_id("</tool_call>");
    assert!(s.allows(close) && !s.allows(EOS));
    s.c.advance(close);
    assert!(s.may_end());
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

#[test]
fn glm_forced_calls_take_the_schemas_names_and_typed_values() {
    on_both_vocabularies(|f| {
        let g = f.glm_calls(&glm_tools(), CallCount::One);
        let ok = |text: &str| f.glm_accepts(&g, text);
        // GLM-4.5's newlines and 4.7's none; a JSON integer; raw (unquoted) text for a string.
        let glm45 =
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n\
                     <arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>";
        assert!(ok(glm45), "tags as tokens: {}", f.tag_tokens);
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
            assert!(!ok(bad), "accepted {bad:?} (tags as tokens: {})", f.tag_tokens);
        }
        let mut s = f.whole_glm(g.clone());
        s.feed(glm45);
        assert!(s.may_end());
    });
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
    on_both_vocabularies(|f| {
        let g = f.glm_calls(&glm_formatted_tool(true), CallCount::One);
        let call = |args: &[(&str, &str)]| {
            let a: String = args
                .iter()
                .map(|(k, v)| format!("<arg_key>{k}</arg_key><arg_value>{v}</arg_value>"))
                .collect();
            format!("<tool_call>book{a}</tool_call>")
        };
        let ok = |args: &[(&str, &str)]| f.glm_accepts(&g, &call(args));
        assert!(
            ok(&[("code", "ABC-12")]),
            "tags as tokens: {}",
            f.tag_tokens
        );
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
            assert!(
                !ok(bad),
                "accepted {bad:?} (tags as tokens: {})",
                f.tag_tokens
            );
        }
        // A text tag inside a constrained value cannot end it early and then carry on.
        let early = "<tool_call>book<arg_key>ref</arg_key><arg_value>a</arg_value>x7";
        assert!(!f.glm_accepts(&g, early));
    });
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
    assert!(f.glm_accepts(&g, text));
    // The JSON path refuses the same format the same way.
    let schema = json!({"type": "string", "format": "lunar-date"});
    let json =
        f.so.compile(grammar::json_response(Some(&schema), true), &f.metrics);
    assert!(json.err().unwrap().contains("Unknown format: lunar-date"));
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
            let by_json = f.accepts_whole(&json, &serde_json::to_string(s).unwrap());
            assert_eq!(
                f.accepts_whole(&raw, s),
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
    on_both_vocabularies(|f| {
        let g = f.auto_calls(&glm_tools(), CallFormat::Glm);
        let mut s = f.seq(g, Some(true), CallFormat::Glm);
        s.feed("I will look it up. <tool_call>");
        assert!(!s.allows_byte(b'x'), "engaged: only the tool's name");
        s.feed("get_weather\n<arg_key>");
        assert!(!s.allows_byte(b'd'), "only `city` first");
        s.feed("city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>");
        assert!(s.c.is_complete(), "tags as tokens: {}", f.tag_tokens);
    });
}

#[test]
fn glm_parallel_calls_and_a_json_answer_are_both_possible() {
    let f = fixture(true);
    let calls = f.glm_calls(&glm_tools(), CallCount::OneOrMore);
    let one =
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>";
    assert!(f.glm_accepts(&calls, &format!("{one}\n{one}{one}")));
    let either = grammar::json_or_calls(
        None,
        false,
        &glm_tools(),
        &f.so.call_tags,
        CallFormat::Glm,
        CallCount::One,
    )
    .unwrap();
    assert!(f.glm_accepts(&either, one));
    assert!(f.glm_accepts(&either, "{\"a\": 1}"));
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

#[test]
fn forced_calls_wait_for_the_reasoning_to_close() {
    on_both_vocabularies(|f| {
        let g = f.glm_calls(&glm_tools(), CallCount::One);
        let mut s = f.whole_glm(g).thinking(f, ThinkStart::MayOpen, None);
        assert!(!s.allows_byte(b'x'), "the call or <think> first");
        s.feed("<think>I should call get_weather ");
        assert!(s.allows_byte(b'x'), "free text inside");
        assert!(!s.allows(EOS), "no end before the call");
        s.feed("<tool_call>, not yet.</think>\n\n");
        assert!(!s.allows_byte(b'x'), "the grammar after </think>");
        s.feed(
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Lyon</arg_value></tool_call>",
        );
        assert!(s.may_end());
    });
}

#[test]
fn a_model_that_does_not_think_answers_at_once() {
    on_both_vocabularies(|f| {
        let g = f.glm_calls(&glm_tools(), CallCount::One);
        let mut s = f.whole_glm(g).thinking(f, ThinkStart::MayOpen, None);
        s.feed(
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
        );
        assert!(s.may_end(), "tags as tokens: {}", f.tag_tokens);
    });
    // A JSON answer: `{` is no way into `<think>`.
    let f = fixture(false);
    let schema =
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let g = grammar::json_response(Some(&schema), true);
    let mut s = f.whole(g).thinking(&f, ThinkStart::MayOpen, None);
    assert!(s.allows_byte(b'<') && !s.allows_byte(b'x'));
    s.feed("{\"a\":1}");
    assert!(s.may_end());
}

#[test]
fn a_spent_budget_closes_the_reasoning_and_the_answer_follows() {
    let f = fixture(false);
    let schema =
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let g = grammar::json_response(Some(&schema), true);
    // The prompt opened <think>; 5 reasoning tokens allowed.
    let mut s = f.whole(g).thinking(&f, ThinkStart::Inside, Some(5));
    s.feed("hmmmm");
    let mut closing = Vec::new();
    for _ in 0.."</think>".len() {
        let mut l = vec![0.0; f.vocab];
        assert!(s.c.apply(&mut l));
        let only: Vec<usize> = (0..f.vocab).filter(|&i| l[i].is_finite()).collect();
        assert_eq!(only.len(), 1, "the gate writes the tag itself");
        closing.push(only[0] as u8);
        s.c.advance(only[0] as u32);
    }
    assert_eq!(closing, b"</think>");
    s.feed("\n{\"a\":2}");
    assert!(s.may_end());
}

#[test]
fn auto_calls_are_not_watched_inside_the_reasoning() {
    let f = fixture(false);
    let g = f.auto_calls(&tools(), CallFormat::Hermes);
    let mut s = f
        .seq(g, Some(true), CallFormat::Hermes)
        .thinking(&f, ThinkStart::MayOpen, None);
    s.feed("<think>maybe <tool_call>\n{\"x");
    assert!(s.allows_byte(b'y'), "reasoning is free text");
    s.feed("</think>Let me look. <tool_call>\n{\"");
    assert!(!s.allows_byte(b'x'), "engaged after the reasoning");
}
