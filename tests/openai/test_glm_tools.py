"""GLM's XML tool calls (`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`)
constrained by the tool's schema, through the real clients: the official `openai` client, LangChain,
the OpenAI Agents SDK and the Pi coding agent. The model is the scripted test double behind a
GLM-4.5-style chat template; its script writes invented argument names and wrongly typed values where
the grammar must step in. Every call's arguments are validated with `jsonschema`."""
import json
import os
import re
from typing import Literal

import jsonschema
import openai
import pytest

from conftest import (API_KEY, CITY_TOOL, assert_auto_calls_follow_the_schema, assert_forced_city_call,
                      assert_two_streamed_city_calls, chat)
from conftest import check_calls as check_tool_calls
from test_pi_agent import PI, Recorder, run_pi, tool_calls_of

TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                       "required": ["tz"]}}}
BOOK_TOOL = {"type": "function", "function": {
    "name": "book", "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{2}$"},
        "day": {"type": "string", "format": "date"}},
        "required": ["code", "day"], "additionalProperties": False}}}


# RFC 3339's full-date (what JSON Schema's `date` format is). Python's `date.fromisoformat` would
# refuse year 0000, which RFC 3339 allows and which the scripted model, once off its script, writes.
RFC3339_DATE = re.compile(r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])")


def check_calls(calls):
    check_tool_calls(calls, [CITY_TOOL, TIME_TOOL, BOOK_TOOL])


def ask(server, text, **kw):
    kw.setdefault("max_tokens", 200)
    return chat(server, text, **kw)


# `glm_server` (conftest) runs each test on two vocabularies: SmolLM2's, where the tags are text the
# grammar spells out, and a GLM-like one (on the glm4_moe fixture) where they are single tokens.


# --- the official openai client ---

@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_glm_call_follows_the_schema(glm_server, choice):
    r = ask(glm_server, "invent arguments", tools=[CITY_TOOL, TIME_TOOL], tool_choice=choice,
            parallel_tool_calls=False)
    assert_forced_city_call(r, check_calls)


def test_unconstrained_script_would_break_the_schema(glm_server):
    # The same script without tools in the request is plain text: what the grammar corrected above.
    r = ask(glm_server, "invent arguments")
    assert "<arg_key>description</arg_key>" in r.choices[0].message.content


def test_forced_glm_call_keeps_raw_text_to_pattern_and_format(glm_server):
    # The script writes `abc-1234` and `2026-13-45`; the tool wants `^[A-Z]{3}-\d{2}$` and a date.
    unconstrained = ask(glm_server, "book a flight").choices[0].message.content
    assert "<arg_value>2026-13-45</arg_value>" in unconstrained
    r = ask(glm_server, "book a flight", tools=[BOOK_TOOL], tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    check_calls(calls)
    for c in calls:
        args = json.loads(c.function.arguments)
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", args["code"]), args
        assert RFC3339_DATE.fullmatch(args["day"]), args


def test_strict_tool_with_an_unknown_format_is_refused(glm_server):
    tool = json.loads(json.dumps(BOOK_TOOL))
    tool["function"]["strict"] = True
    tool["function"]["parameters"]["properties"]["day"]["format"] = "lunar-date"
    with pytest.raises(openai.BadRequestError, match="Unknown format: lunar-date"):
        ask(glm_server, "book a flight", tools=[tool], tool_choice="required")
    # Not strict: the format is ignored (any text), as for JSON values; the request is served.
    tool["function"]["strict"] = False
    r = ask(glm_server, "book a flight", tools=[tool], tool_choice="required", max_tokens=60)
    assert r.choices[0].finish_reason in ("tool_calls", "length")


def test_auto_glm_calls_engage_the_grammar_at_the_tag(glm_server):
    r = ask(glm_server, "invent arguments", tools=[CITY_TOOL], tool_choice="auto")
    assert_auto_calls_follow_the_schema(r, check_calls)


def test_two_streamed_glm_calls_both_formats(glm_server):
    s = ask(glm_server, "weather in two cities", tools=[CITY_TOOL], stream=True)
    assert_two_streamed_city_calls(s, check_calls)


def test_glm_round_trip_with_typed_values_and_reasoning(glm_server):
    c = glm_server.client(api_key=API_KEY)
    msgs = [{"role": "user", "content": "weather in Paris"}]
    r = c.chat.completions.create(model="smollm2", messages=msgs, tools=[CITY_TOOL], temperature=0)
    m = r.choices[0].message
    (call,) = m.tool_calls
    check_calls([call])
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}  # an integer, not "3"
    assert "call the tool" in (m.model_extra or {}).get("reasoning_content", "")
    msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    r2 = c.chat.completions.create(model="smollm2", messages=msgs, tools=[CITY_TOOL], temperature=0)
    assert r2.choices[0].finish_reason == "stop"
    assert "sunny" in r2.choices[0].message.content


# --- LangChain ---

def get_weather(city: Literal["Paris", "Lyon"], days: int = 1) -> str:
    """Weather forecast for a city."""
    return "Sunny, 21 C"


@pytest.mark.parametrize("tool_choice", [None, "get_weather"])
def test_langchain_bind_tools_glm(glm_scripted, tool_choice):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    weather = tool(get_weather)
    llm = ChatOpenAI(base_url=glm_scripted.base + "/v1", api_key=API_KEY, model="smollm2", temperature=0,
                     max_tokens=200, max_retries=0, timeout=120)
    prompt = "weather in Paris" if tool_choice is None else "invent arguments"
    bound = llm.bind_tools([weather], tool_choice=tool_choice)
    msgs = [HumanMessage(prompt)]
    ai = bound.invoke(msgs)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], weather.args_schema.model_json_schema())
    msgs += [ai, ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([weather]).invoke(msgs)
    assert "sunny" in final.content


# --- OpenAI Agents SDK ---

def test_agents_sdk_runs_a_glm_tool(glm_scripted):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI
    set_tracing_disabled(True)
    calls = []

    @function_tool
    def weather_tool(city: Literal["Paris", "Lyon"], days: int) -> str:
        """Weather forecast for a city."""
        calls.append({"city": city, "days": days})
        return "Sunny, 21 C"

    weather_tool.name = "get_weather"
    client = AsyncOpenAI(base_url=glm_scripted.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    agent = Agent(name="weather", instructions="Use the tools.", tools=[weather_tool],
                  model=OpenAIChatCompletionsModel(model="smollm2", openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=200))
    result = Runner.run_sync(agent, "weather in Paris", max_turns=4)
    assert calls == [{"city": "Paris", "days": 3}]
    jsonschema.validate(calls[0], weather_tool.params_json_schema)
    assert "sunny" in result.final_output


# --- the Pi coding agent ---

@pytest.mark.skipif(not PI and not os.environ.get("CI"), reason="the Pi coding agent is not installed")
def test_pi_tool_loop_over_glm_calls(glm_scripted, tmp_path):
    rec = Recorder(glm_scripted.base)
    try:
        out = run_pi(tmp_path, rec.base, API_KEY, "read hello.txt and tell me the secret word.")
    finally:
        rec.close()
    assert out.returncode == 0, out.stderr + out.stdout
    assert "tangerine" in out.stdout, "\n".join(f"{s} {b[-2500:]}" for _, s, b in rec.exchanges)
    validated = 0
    for req, status, body in rec.exchanges:
        if "messages" not in req:
            continue
        assert status == 200
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in req.get("tools") or []}
        for name, args in tool_calls_of(body):
            jsonschema.validate(json.loads(args), schemas[name])
            validated += 1
    assert validated == 1
