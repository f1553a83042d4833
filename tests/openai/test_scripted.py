"""Tool calls, reasoning split, API key, queue limits and disconnects, on the scripted test double
(`--scripted-replies`: the real SmolLM2 tokenizer and chat template, replies from conftest.SCRIPT)."""
import json
import threading
import time

import openai
import pytest

from conftest import API_KEY, raw

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


def ask(c, text, **kw):
    kw.setdefault("max_tokens", 200)
    return c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": text}],
                                     temperature=0, **kw)


def test_wrong_or_missing_api_key_is_401(scripted):
    with pytest.raises(openai.AuthenticationError) as e:
        ask(scripted.client(api_key="wrong"), "hi")
    assert e.value.status_code == 401
    r = raw(scripted.base + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert raw(scripted.base + "/health").status_code == 200


@pytest.mark.parametrize("fmt", ["hermes", "glm"])
def test_tool_calls_non_streaming(scripted, fmt):
    r = ask(scripted.client(api_key=API_KEY), f"weather in Paris ({fmt})", tools=TOOLS, tool_choice="auto")
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert not (ch.message.content or "").strip()
    if fmt == "hermes":
        assert "call the tool" in ch.message.reasoning_content


@pytest.mark.parametrize("fmt", ["hermes", "glm"])
def test_tool_calls_streaming(scripted, fmt):
    s = ask(scripted.client(api_key=API_KEY), f"weather in Paris ({fmt})", tools=TOOLS, stream=True)
    calls, reasoning, finish = {}, "", None
    for ch in s:
        d = ch.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}
    assert ("call the tool" in reasoning) == (fmt == "hermes")


def test_tool_choice_none_leaves_the_text_alone(scripted):
    r = ask(scripted.client(api_key=API_KEY), "weather in Paris (glm)", tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None
    assert "<tool_call>get_weather" in r.choices[0].message.content


def test_reasoning_split_streaming_and_not(scripted):
    c = scripted.client(api_key=API_KEY)
    r = ask(c, "think about it")
    assert r.choices[0].message.reasoning_content.strip() == "Paris is the capital of France."
    assert r.choices[0].message.content == "The capital is Paris."
    reasoning, content = "", ""
    for ch in ask(c, "think about it", stream=True):
        d = ch.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
    assert reasoning.strip() == "Paris is the capital of France." and content == "The capital is Paris."


def wait_metric(server, name, value, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.metrics().get(name) == value:
            return True
        time.sleep(0.05)
    return False


def test_disconnect_mid_stream_frees_the_slot(scripted):
    # One slot (--max-running 1). A 3000-token stream is dropped after a few chunks; another request
    # must then finish promptly, which it can only do once the dropped one's slot is free.
    c = scripted.client(api_key=API_KEY)
    before = scripted.metrics()["moe:request_aborted_total"]
    s = ask(c, "talk for a long time", stream=True, max_tokens=3500)
    for i, _ in enumerate(s):
        if i == 5:
            break
    s.close()
    assert wait_metric(scripted, "moe:num_requests_running", 0.0), "slot not freed after disconnect"
    assert scripted.metrics()["moe:request_aborted_total"] == before + 1
    t0 = time.time()
    r = ask(scripted.client(api_key=API_KEY, timeout=10), "think about it")
    assert r.choices[0].message.content == "The capital is Paris." and time.time() - t0 < 10


def test_full_queue_is_429_with_retry_after(scripted):
    # --max-running 1 --max-waiting 2: one long stream runs, two wait, the next is refused.
    c = scripted.client(api_key=API_KEY)
    streams = [ask(c, "talk for a long time", stream=True, max_tokens=3500)]
    next(iter(streams[0]))  # running
    waiting = []
    for _ in range(2):
        t = threading.Thread(target=lambda: waiting.append(ask(c, "think about it")))
        t.start()
        waiting.append(t)
    assert wait_metric(scripted, "moe:num_requests_waiting", 2.0)
    r = raw(scripted.base + "/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    streams[0].close()  # frees the slot; the waiting two then finish
    for t in [w for w in waiting if isinstance(w, threading.Thread)]:
        t.join(timeout=30)
    done = [w for w in waiting if not isinstance(w, threading.Thread)]
    assert len(done) == 2 and all(d.choices[0].message.content == "The capital is Paris." for d in done)
