"""The OpenAI surface against the default model (SmolLM2-135M-Instruct, greedy unless said)."""
import concurrent.futures
import json

import jsonschema
import openai
import pytest

from conftest import raw

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def chat(c, **kw):
    kw.setdefault("model", "smollm2")
    kw.setdefault("messages", CAPITAL)
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 24)
    return c.chat.completions.create(**kw)


def test_models_lists_the_served_model(real):
    models = real.client().models.list()
    assert [m.id for m in models.data] == ["smollm2"]


def test_chat_greedy_answers_paris_with_usage(real):
    r = chat(real.client())
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 20 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream_and_reports_usage(real):
    c = real.client()
    whole = chat(c).choices[0].message.content
    chunks = list(chat(c, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_completions_text_and_token_ids_agree(real):
    c = real.client()
    prompt = "The capital of France is"
    ids = raw(real.base + "/tokenize", {"prompt": prompt}).json()["tokens"]
    a = c.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
    b = c.completions.create(model="smollm2", prompt=ids, max_tokens=8, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert "Paris" in a.choices[0].text
    assert a.usage.prompt_tokens == len(ids) and a.usage.completion_tokens == 8
    assert a.choices[0].finish_reason == "length"
    streamed = c.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == a.choices[0].text


def test_stop_string_spanning_tokens_cuts_the_output(real):
    c = real.client()
    whole = chat(c).choices[0].message.content
    assert "capital of France" in whole
    r = chat(c, stop=["of Fr"])
    assert r.choices[0].message.content == whole[: whole.index("of Fr")]
    assert r.choices[0].finish_reason == "stop"
    s = chat(c, stop="of Fr", stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in s) == r.choices[0].message.content


def test_seeded_sampling_repeats_and_n_gives_n_choices(real):
    c = real.client()
    kw = dict(temperature=1.0, top_p=0.95, extra_body={"top_k": 50, "min_p": 0.01}, seed=1234, n=3, max_tokens=12,
              messages=[{"role": "user", "content": "Write a word."}])
    a, b = chat(c, **kw), chat(c, **kw)
    assert len(a.choices) == 3
    assert [x.message.content for x in a.choices] == [x.message.content for x in b.choices]
    assert [x.index for x in a.choices] == [0, 1, 2]


def test_penalties_change_a_repetitive_greedy_output(real):
    c = real.client()
    kw = dict(messages=[{"role": "user", "content": "Repeat the word cat twenty times."}], max_tokens=30)
    plain = chat(c, **kw).choices[0].message.content
    penalised = chat(c, frequency_penalty=2.0, presence_penalty=1.5, **kw).choices[0].message.content
    assert plain != penalised


def test_logprobs_and_top_logprobs(real):
    r = chat(real.client(), logprobs=True, top_logprobs=3, max_tokens=5)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 3
        assert e.logprob <= 0 and abs(e.logprob - e.top_logprobs[0].logprob) < 1e-5  # greedy: chosen = best
    assert "".join(e.token for e in entries) == r.choices[0].message.content


def test_json_object_mode_returns_a_json_object(real):
    r = chat(real.client(), response_format={"type": "json_object"}, max_tokens=40,
             messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
    obj = json.loads(r.choices[0].message.content)
    assert isinstance(obj, dict) and "Paris" in obj.values()
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("bad", [
    dict(temperature=5), dict(n=0), dict(top_logprobs=50, logprobs=True), dict(max_tokens=0),
    dict(messages=[]), dict(top_p=0), dict(response_format={"type": "yaml"}),
    dict(tool_choice={"type": "function", "function": {"name": "nope"}}),
])
def test_bad_parameters_are_400(real, bad):
    with pytest.raises(openai.BadRequestError) as e:
        chat(real.client(), **bad)
    assert e.value.status_code == 400
    assert e.value.body["message"]


def test_unknown_model_is_404(real):
    with pytest.raises(openai.NotFoundError) as e:
        chat(real.client(), model="gpt-17")
    assert e.value.body["code"] == "model_not_found"


def test_prompt_longer_than_context_is_400(real):
    with pytest.raises(openai.BadRequestError) as e:
        chat(real.client(), messages=[{"role": "user", "content": "Paris " * 3000}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        chat(real.client(), max_tokens=4000)


def test_malformed_bodies_are_400_and_the_server_survives(real):
    for body in [b"{", b"[]", b'{"messages": "hi"}', b"\xff\xfe", b'{"messages": [{"content": "x"}]}',
                 b'{"prompt": {"a": 1}}', b'{"messages": [{"role": "user", "content": "x"}], "n": "many"}']:
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = raw(real.base + path, body)
            assert r.status_code == 400, (path, body, r.text)
            assert "message" in r.json()["error"]
    r = raw(real.base + "/v1/completions", {"model": "smollm2", "prompt": [10**9]})
    assert r.status_code == 400
    assert raw(real.base + "/health").status_code == 200


def test_32_concurrent_greedy_requests_equal_sequential_ones(real):
    c = real.client()
    questions = [f"What is {i} plus {i + 1}?" if i % 2 else f"Name a fruit that starts with {chr(65 + i)}."
                 for i in range(32)]

    def ask(q):
        return chat(c, messages=[{"role": "user", "content": q}], max_tokens=8).choices[0].message.content

    sequential = [ask(q) for q in questions]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(ask, questions))
    assert together == sequential


def test_metrics_count_requests_and_tokens(real):
    chat(real.client(), max_tokens=4)
    m = real.metrics()
    for name in ["moe:num_requests_waiting", "moe:num_requests_running", "moe:kv_cache_usage_perc",
                 "moe:gpu_expert_hit_ratio", "moe:cpu_expert_seconds_per_step_count"]:
        assert name in m, name
    assert m["moe:prompt_tokens_total"] > 0 and m["moe:generation_tokens_total"] > 0
    assert m["moe:time_to_first_token_seconds_count"] > 0
    assert m["moe:e2e_request_latency_seconds_count"] > 0
    assert m["moe:prefix_cache_hit_tokens_total"] > 0  # the same system prompt was reused


def test_n_choices_stream_by_index_and_max_completion_tokens(real):
    c = real.client()
    whole = chat(c, max_completion_tokens=6)
    assert whole.usage.completion_tokens == 6 and whole.choices[0].finish_reason == "length"
    texts = {0: "", 1: ""}
    for ch in chat(c, n=2, max_completion_tokens=6, stream=True):
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: whole.choices[0].message.content, 1: whole.choices[0].message.content}


WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_or_named_tool_choice_forces_a_call(real, choice):
    # SmolLM2 has no tool format of its own: the call comes from the constrained decoding.
    # One call (parallel_tool_calls false); its arguments follow the tool's schema.
    r = chat(real.client(), tools=WEATHER_TOOL, tool_choice=choice, max_tokens=100, parallel_tool_calls=False,
             messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL[0]["function"]["parameters"])
