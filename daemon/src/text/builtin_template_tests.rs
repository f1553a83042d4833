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

/// GLM-5's template (the built-in of `GlmMoeDsaForCausalLM` and `Glm4MoeLiteForCausalLM`) renders what
/// zai-org/GLM-5's tokenizer rendered in a published probe (transformers 5.8 `apply_chat_template`):
/// one user turn, and a multi-turn chat whose history assistant turn is closed with `</think>`.
#[test]
fn glm5_template_renders_the_published_glm5_prompts() {
    for arch in ["GlmMoeDsaForCausalLM", "Glm4MoeLiteForCausalLM"] {
        let t = ChatTemplate::new(builtin_for_architecture(arch).unwrap(), None, None).unwrap();
        let none = serde_json::Map::new();
        let one = [json!({"role": "user", "content": "你好"})];
        assert_eq!(
            t.render(&one, None, true, &none).unwrap(),
            "[gMASK]<sop><|user|>你好<|assistant|><think>"
        );
        let turns = [
            json!({"role": "user", "content": "1+1="}),
            json!({"role": "assistant", "content": "2"}),
            json!({"role": "user", "content": "2+2="}),
        ];
        assert_eq!(
            t.render(&turns, None, true, &none).unwrap(),
            "[gMASK]<sop><|user|>1+1=<|assistant|></think>2<|user|>2+2=<|assistant|><think>"
        );
    }
}

/// What GLM-5 generates after its generation prompt (`<|assistant|><think>`): reasoning, `</think>`,
/// then compact XML tool calls. The server's parsers turn it into an OpenAI message (reasoning, typed
/// arguments as a JSON string); sent back as the conversation's last assistant turn, the template
/// renders exactly the generated text again (the cache's prefix stays valid across the tool round),
/// and after the next user turn the reasoning is cleared as the model was trained (kept with
/// `clear_thinking: false`).
#[test]
fn glm5_tool_call_and_think_round_trip() {
    use crate::api::reasoning::ReasoningParser;
    use crate::api::tool_parser::ToolCallParser;
    let t = ChatTemplate::new(
        include_str!("testdata/glm5_chat_template.jinja"),
        None,
        None,
    )
    .unwrap();
    let none = serde_json::Map::new();
    let user = json!({"role": "user", "content": "Weather in Paris?"});
    let prompt = t
        .render(std::slice::from_ref(&user), Some(&tools()), true, &none)
        .unwrap();
    assert!(
        prompt.ends_with("<|user|>Weather in Paris?<|assistant|><think>"),
        "{prompt}"
    );
    let generated = "Need the tool.</think><tool_call>get_weather<arg_key>city</arg_key>\
                     <arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>";
    // the server's split: reasoning until </think>, then content and tool calls
    let mut r = ReasoningParser::new(ReasoningParser::prompt_opens_think(&prompt));
    let (a, b) = (r.push(generated), r.finish());
    let reasoning = a.reasoning + &b.reasoning;
    let mut tp = ToolCallParser::new(&tools());
    let (c, d) = (tp.push(&(a.content + &b.content)), tp.finish());
    let content = c.content + &d.content;
    let calls: Vec<_> = c.calls.into_iter().chain(d.calls).collect();
    assert_eq!(
        (reasoning.as_str(), content.as_str()),
        ("Need the tool.", "")
    );
    assert_eq!(calls.len(), 1);
    let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
    assert_eq!(
        args,
        json!({"city": "Paris", "days": 3}),
        "days typed by the schema"
    );
    let assistant = json!({"role": "assistant", "content": content, "reasoning_content": reasoning,
        "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": calls[0].name, "arguments": calls[0].arguments}}]});
    let history = [user.clone(), assistant.clone()];
    let again = t.render(&history, Some(&tools()), false, &none).unwrap();
    assert_eq!(
        again,
        format!("{prompt}{generated}"),
        "the generated turn renders back byte for byte"
    );
    // the tool result, then the model's answer, then a new user turn: the old reasoning is cleared
    let result = json!({"role": "tool", "tool_call_id": "c1", "content": "Sunny, 25°C"});
    let answer = json!({"role": "assistant", "content": "Sunny.", "reasoning_content": "Easy."});
    let next = json!({"role": "user", "content": "Thanks"});
    let convo = [user, assistant, result, answer, next];
    let cleared = t.render(&convo, Some(&tools()), true, &none).unwrap();
    assert!(
        cleared.contains("<|assistant|></think><tool_call>get_weather")
            && cleared.contains("<|observation|><tool_response>Sunny, 25°C</tool_response><|assistant|></think>Sunny.<|user|>Thanks<|assistant|><think>"),
        "{cleared}"
    );
    let kept = json!({"clear_thinking": false});
    let kept = t
        .render(&convo, Some(&tools()), true, kept.as_object().unwrap())
        .unwrap();
    assert!(
        kept.contains("<|assistant|><think>Need the tool.</think><tool_call>")
            && kept.contains("<|assistant|><think>Easy.</think>Sunny."),
        "{kept}"
    );
}
