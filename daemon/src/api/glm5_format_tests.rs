//! GLM-4.7 / GLM-5.x chat format through the server's own pieces: the chat template rendered by
//! [`ChatTemplate`] (minijinja, HF settings) must give exactly what transformers 5.24's
//! `render_jinja_template` gives for the same messages (text/testdata/glm5_chat_template.expected.json,
//! made by tests/fixtures/make_glm5_template_expected.py); the model's compact XML tool calls
//! (`<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`, no newlines, unlike GLM-4.5)
//! parse into OpenAI tool calls typed by the schema; and `<think>` opened by the generation prompt (or
//! closed by it when `enable_thinking` is false) splits reasoning from content.
//!
//! The template (text/testdata/glm5_chat_template.jinja) is the GLM-4.7 hub template's published text for
//! the tools header, message loop and thinking handling, with the tool-call / observation / generation-
//! prompt tail as the GLM-4.5 family writes it; GLM-5's hub template has the same format. The expected
//! renders come from transformers, not from this code.
use super::reasoning::ReasoningParser;
use super::tool_parser::ToolCallParser;
use crate::text::chat_template::ChatTemplate;
use serde_json::{json, Value};

const TEMPLATE: &str = include_str!("../text/testdata/glm5_chat_template.jinja");
const EXPECTED: &str = include_str!("../text/testdata/glm5_chat_template.expected.json");

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "description": "天气 lookup",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}}),
    ]
}

/// The conversation the expected renders were made from, as an OpenAI client sends it (arguments as a
/// JSON string, reasoning in `reasoning_content` or inline `<think>`).
fn messages() -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "Be brief."}),
        json!({"role": "user", "content": "Weather in Paris?"}),
        json!({"role": "assistant", "content": null, "reasoning_content": "Need the tool.",
               "tool_calls": [{"id": "c1", "type": "function",
                               "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 3}"}}]}),
        json!({"role": "tool", "tool_call_id": "c1", "content": "Sunny, 25°C"}),
        json!({"role": "tool", "tool_call_id": "c2", "content": "Rain tomorrow"}),
        json!({"role": "assistant", "content": "<think>old thought</think>It is sunny."}),
        json!({"role": "user", "content": [{"type": "text", "text": "Thanks!"}]}),
    ]
}

#[test]
fn template_renders_as_transformers_does() {
    let t = ChatTemplate::new(TEMPLATE, None, None).unwrap();
    assert!(t.renders_tools);
    assert!(
        TEMPLATE.contains("<arg_key>"),
        "the server's GLM tool-format switch"
    );
    let expected: Value = serde_json::from_str(EXPECTED).unwrap();
    for (case, kwargs) in [
        ("thinking", json!({})),
        ("no_thinking", json!({"enable_thinking": false})),
        ("keep_thinking", json!({"clear_thinking": false})),
    ] {
        let got = t
            .render(
                &messages(),
                Some(&tools()),
                true,
                kwargs.as_object().unwrap(),
            )
            .unwrap();
        assert_eq!(got, expected[case].as_str().unwrap(), "{case}");
    }
}

#[test]
fn compact_xml_tool_calls_and_thinking_split() {
    let mut p = ToolCallParser::new(&tools());
    let mut calls = vec![];
    let mut content = String::new();
    for piece in [
        "Checking.<tool_call>get_wea",
        "ther<arg_key>city</arg_key><arg_value>New York</arg_value><arg_key>da",
        "ys</arg_key><arg_value>2</arg_value></tool_call><tool_call>get_weather<arg_key>city",
        "</arg_key><arg_value>Oslo</arg_value></tool_call>",
    ] {
        let s = p.push(piece);
        content += &s.content;
        calls.extend(s.calls);
    }
    let s = p.finish();
    content += &s.content;
    calls.extend(s.calls);
    assert_eq!(content, "Checking.");
    assert_eq!(calls.len(), 2);
    let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
    assert_eq!(args, json!({"city": "New York", "days": 2}));
    assert_eq!(calls[1].name, "get_weather");

    let t = ChatTemplate::new(TEMPLATE, None, None).unwrap();
    let user = [json!({"role": "user", "content": "hi"})];
    let on = t.render(&user, None, true, &Default::default()).unwrap();
    assert!(on.ends_with("<|assistant|><think>"), "{on}");
    assert!(ReasoningParser::prompt_opens_think(&on));
    let mut r = ReasoningParser::new(true);
    let (mut reasoning, mut text) = (String::new(), String::new());
    for piece in ["The user", " greets.</thi", "nk>Hello!"] {
        let s = r.push(piece);
        reasoning += &s.reasoning;
        text += &s.content;
    }
    let s = r.finish();
    reasoning += &s.reasoning;
    text += &s.content;
    assert_eq!(
        (reasoning.as_str(), text.as_str()),
        ("The user greets.", "Hello!")
    );
    let off = json!({"enable_thinking": false});
    let off = t
        .render(&user, None, true, off.as_object().unwrap())
        .unwrap();
    assert!(off.ends_with("<|assistant|></think>"), "{off}");
    assert!(!ReasoningParser::prompt_opens_think(&off));
}
