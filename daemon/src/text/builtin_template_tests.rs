//! Built-in chat templates render what transformers' `render_jinja_template` (the renderer behind
//! `apply_chat_template`) renders for the same conversations, byte for byte
//! (testdata/*.expected.json, made by tests/fixtures/make_smallthinker_template_expected.py from the same
//! template file), and are registered for their architectures.
use super::chat_template::{builtin_for_architecture, choose_source, ChatTemplate};
use serde_json::{json, Value};

const EXPECTED: &str = include_str!("testdata/smallthinker_chat_template.expected.json");

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "description": "天气 lookup",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}}),
    ]
}

/// The agent conversation as an OpenAI client sends it: arguments as JSON strings, two tool results.
fn agent() -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "Be brief."}),
        json!({"role": "user", "content": "Weather in Paris and Oslo?"}),
        json!({"role": "assistant", "content": "Checking both.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 3}"}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]}),
        json!({"role": "tool", "tool_call_id": "c1", "content": "Sunny, 25°C"}),
        json!({"role": "tool", "tool_call_id": "c2", "content": "Rain tomorrow"}),
        json!({"role": "assistant", "content": "Paris is sunny; Oslo gets rain."}),
        json!({"role": "user", "content": [{"type": "text", "text": "Thanks!"}]}),
    ]
}

fn plain() -> Vec<Value> {
    vec![
        json!({"role": "user", "content": "Hi there"}),
        json!({"role": "assistant", "content": "Hello! How can I help?"}),
        json!({"role": "user", "content": "Name a prime."}),
    ]
}

#[test]
fn smallthinker_template_renders_as_transformers_does() {
    let src = builtin_for_architecture("SmallThinkerForCausalLM").expect("registered");
    let t = ChatTemplate::new(src, None, Some("<|im_end|>")).unwrap();
    assert!(t.renders_tools);
    let expected: Value = serde_json::from_str(EXPECTED).unwrap();
    let none = serde_json::Map::new();
    // (case, messages, tools, generation prompt)
    type Case = (&'static str, Vec<Value>, Option<Vec<Value>>, bool);
    let cases: [Case; 4] = [
        ("default_system", plain(), None, true),
        ("tools", agent(), Some(tools()), true),
        (
            "tools_default_system",
            agent()[1..].to_vec(),
            Some(tools()),
            true,
        ),
        ("no_generation_prompt", agent(), None, false),
    ];
    for (case, messages, tools, generation) in cases {
        let got = t
            .render(&messages, tools.as_deref(), generation, &none)
            .unwrap();
        assert_eq!(got, expected[case].as_str().unwrap(), "{case}");
    }
}

#[test]
fn serve_falls_back_to_the_architecture_template_only_when_none_is_given() {
    let arch = "SmallThinkerForCausalLM";
    let builtin = builtin_for_architecture(arch).unwrap();
    assert_eq!(choose_source(None, None, arch).as_deref(), Some(builtin));
    assert_eq!(
        choose_source(None, Some("own"), arch).as_deref(),
        Some("own")
    );
    assert_eq!(
        choose_source(Some("flag".into()), Some("own"), arch).as_deref(),
        Some("flag")
    );
    assert_eq!(choose_source(None, None, "Qwen3MoeForCausalLM"), None);
}
