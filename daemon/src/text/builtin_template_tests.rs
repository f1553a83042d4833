//! Built-in chat templates render what transformers' `render_jinja_template` (the renderer behind
//! `apply_chat_template`) renders for the same conversations, byte for byte
//! (testdata/*.expected.json, made by tests/fixtures/make_smallthinker_template_expected.py and
//! make_glm53_template_expected.py from the same template files), and are registered for their
//! architectures.
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

/// GLM-5.3-Flash's own template (macros, `break`, namespaces, tool results re-ordered by call id,
/// `strict` / `defer_loading` tools, reasoning effort, thinking switches) as transformers renders it,
/// for an agent conversation sent as an OpenAI client sends it (arguments as JSON strings, `content`
/// null beside tool calls, text parts).
#[test]
fn glm53_flash_template_renders_as_transformers_does() {
    const GLM53: &str = include_str!("testdata/glm53_flash_chat_template.expected.json");
    let src = builtin_for_architecture("Glm5NextForConditionalGeneration").expect("registered");
    let t = ChatTemplate::new(src, None, None).unwrap();
    assert!(t.renders_tools);
    let expected: Value = serde_json::from_str(GLM53).unwrap();
    let tools = vec![
        json!({"type": "function", "function": {"name": "get_weather", "description": "天气 lookup",
               "strict": true, "parameters": {"type": "object", "properties": {
                   "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}),
        json!({"type": "function", "function": {"name": "search_docs", "description": "Search",
               "defer_loading": true,
               "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}),
        json!({"type": "function", "function": {"name": "convert", "description": "Units",
               "parameters": {"type": "object", "properties": {"value": {"type": "number"},
                   "to": {"type": "string"}, "opts": {"type": "object"}}}}}),
    ];
    let call = |id: &str, name: &str, args: &str| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}});
    let agent = vec![
        json!({"role": "system", "content": "Be brief."}),
        json!({"role": "user", "content": "Weather in Paris and Oslo, in °F?"}),
        json!({"role": "assistant", "content": null, "reasoning_content": "Need the tool twice.",
               "tool_calls": [call("c1", "get_weather", "{\"city\": \"Paris\", \"days\": 3}"),
                              call("c2", "get_weather", "{\"city\": \"Oslo\"}")]}),
        json!({"role": "tool", "tool_call_id": "c2", "content": "Rain, 8°C"}),
        json!({"role": "tool", "tool_call_id": "c1", "content": "Sunny, 25°C"}),
        json!({"role": "assistant", "content": "<think>convert both</think>Converting.",
               "tool_calls": [call("c3", "convert",
                                   "{\"value\": 25, \"to\": \"F\", \"opts\": {\"round\": true}}")]}),
        json!({"role": "tool", "tool_call_id": "c3", "content": "77°F"}),
        json!({"role": "assistant", "content": "Paris 77°F and sunny; Oslo rainy."}),
        json!({"role": "user", "content": [{"type": "text", "text": "Thanks!"},
                                           {"type": "text", "text": " And tomorrow?"}]}),
    ];
    let plain = vec![
        json!({"role": "user", "content": "Hi there"}),
        json!({"role": "assistant", "content": "Hello! How can I help?"}),
        json!({"role": "user", "content": "Name a prime."}),
        json!({"role": "assistant", "content": "<think>small one</think>7"}),
    ];
    let kwargs = |v: Value| v.as_object().cloned().unwrap();
    type Case<'a> = (&'a str, &'a [Value], Option<&'a [Value]>, bool, Value);
    let cases: [Case; 5] = [
        ("agent", &agent, Some(&tools), true, json!({})),
        (
            "agent_no_thinking",
            &agent,
            Some(&tools),
            true,
            json!({"enable_thinking": false}),
        ),
        (
            "agent_clear_thinking",
            &agent,
            Some(&tools),
            true,
            json!({"clear_thinking": true}),
        ),
        (
            "agent_low_effort",
            &agent,
            Some(&tools),
            true,
            json!({"reasoning_effort": "low"}),
        ),
        ("plain", &plain, None, false, json!({})),
    ];
    for (case, messages, tools, generation, extra) in cases {
        let got = t
            .render(messages, tools, generation, &kwargs(extra))
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
