"""Reasoning before a constrained answer, as vLLM does with a reasoning parser and structured outputs:
with `tool_choice` required / named or `response_format` json_schema, a reasoning model first thinks
(`reasoning_content`), then the grammar takes over after `</think>`; the reasoning is bounded (half of
`max_tokens` by default, `thinking_token_budget` when given, else the server's `--reasoning-budget`),
and `enable_thinking: false` leaves no room for it. Through the official `openai` client, LangChain and the OpenAI Agents SDK, on the scripted
test model: SmolLM2's vocabulary with Hermes calls (Qwen3's layout) and the GLM-like vocabulary with
GLM's XML calls."""
import json

import jsonschema
import pytest
from pydantic import BaseModel

from conftest import API_KEY, CITY_TOOL
from conftest import chat as one_turn

WEATHER = CITY_TOOL
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def chat(server, text, **kw):
    kw.setdefault("max_tokens", 200)
    return one_turn(server, text, **kw)


def reasoning_of(message):
    return (message.model_extra or {}).get("reasoning_content") or ""


def the_call(choice):
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    return args


# --- the official openai client ---

@pytest.mark.parametrize("choice", ["required", NAMED])
def test_forced_hermes_call_after_thinking(scripted, choice):
    r = chat(scripted, "weather in Paris (hermes)", tools=[WEATHER], tool_choice=choice,
             parallel_tool_calls=False)
    ch = r.choices[0]
    assert the_call(ch) == {"city": "Paris", "days": 3}
    assert "call the tool" in reasoning_of(ch.message)
    assert not (ch.message.content or "").strip()


def test_forced_glm_call_after_thinking(glm_server):
    r = chat(glm_server, "weather in Paris", tools=[WEATHER], tool_choice=NAMED)
    ch = r.choices[0]
    assert the_call(ch) == {"city": "Paris", "days": 3}
    assert "call the tool" in reasoning_of(ch.message)


def test_json_schema_answer_after_thinking(scripted):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    r = chat(scripted, "plan a trip",
             response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": schema,
                                                                     "strict": True}})
    m = r.choices[0].message
    assert json.loads(m.content) == {"city": "Paris", "days": 3}
    assert "lovely in spring" in reasoning_of(m)


# The budget tests run on the GLM-like vocabulary, where `</think>` is one token and every other byte
# is its own: the script's words then line up with the cut the budget makes.

def test_a_spent_budget_closes_the_reasoning_and_the_call_still_comes(glm_tokens):
    # 120 tokens: the reasoning gets half (15 "hmm " words of 4 byte tokens), the call the rest. The
    # script alone would think for 800 tokens and never call.
    r = chat(glm_tokens, "ponder at length", tools=[WEATHER], tool_choice="required",
             parallel_tool_calls=False, max_tokens=120)
    ch = r.choices[0]
    assert the_call(ch) == {"city": "Lyon", "days": 2}
    assert reasoning_of(ch.message).count("hmm") == 15
    assert r.usage.completion_tokens <= 120


def test_thinking_token_budget_bounds_plain_answers_too(glm_tokens):
    r = chat(glm_tokens, "ponder at length", max_tokens=300, extra_body={"thinking_token_budget": 20})
    m = r.choices[0].message
    assert reasoning_of(m).count("hmm") == 5
    assert "<tool_call>get_weather" in (m.content or "")
    # Without a budget the same request thinks until max_tokens.
    r = chat(glm_tokens, "ponder at length", max_tokens=300)
    assert r.choices[0].finish_reason == "length"
    assert reasoning_of(r.choices[0].message).count("hmm") > 5 * 10


def test_server_reasoning_budget_bounds_requests_that_give_none(glm_tokens_budget):
    # --reasoning-budget 40: 10 "hmm " words of 4 byte tokens, then the script's call as the answer
    r = chat(glm_tokens_budget, "ponder at length", max_tokens=300)
    m = r.choices[0].message
    assert reasoning_of(m).count("hmm") == 10
    assert "<tool_call>get_weather" in (m.content or "")
    assert r.choices[0].finish_reason == "stop"
    # the request's own budget wins, smaller or larger
    for budget, words in ((20, 5), (80, 20), (0, 0)):
        r = chat(glm_tokens_budget, "ponder at length", max_tokens=300,
                 extra_body={"thinking_token_budget": budget})
        assert reasoning_of(r.choices[0].message).count("hmm") == words, budget
    # a forced call keeps the server's budget (not half of max_tokens) and still arrives
    r = chat(glm_tokens_budget, "ponder at length", tools=[WEATHER], tool_choice="required",
             parallel_tool_calls=False, max_tokens=200)
    ch = r.choices[0]
    assert the_call(ch) == {"city": "Lyon", "days": 2}
    assert reasoning_of(ch.message).count("hmm") == 10


def test_enable_thinking_false_leaves_no_room_to_think(glm_server):
    r = chat(glm_server, "weather in Paris", tools=[WEATHER], tool_choice=NAMED,
             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    ch = r.choices[0]
    the_call(ch)
    assert reasoning_of(ch.message) == ""


# --- LangChain ---

class Trip(BaseModel):
    city: str
    days: int


def test_langchain_structured_output_and_forced_tool_after_thinking(scripted):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(base_url=scripted.base + "/v1", api_key=API_KEY, model="smollm2", temperature=0,
                     max_tokens=200, max_retries=0, timeout=120)
    trip = llm.with_structured_output(Trip, method="json_schema").invoke("plan a trip")
    assert trip == Trip(city="Paris", days=3)

    @tool
    def get_weather(city: str, days: int = 1) -> str:
        """Weather forecast for a city."""
        return "Sunny, 21 C"

    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("weather in Paris (hermes)")
    (call,) = ai.tool_calls
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris", "days": 3})


# --- OpenAI Agents SDK ---

def test_agents_sdk_output_type_after_thinking(scripted):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=scripted.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    agent = Agent(name="planner", instructions="Plan the trip.", output_type=Trip,
                  model=OpenAIChatCompletionsModel(model="smollm2", openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=200))
    result = Runner.run_sync(agent, "plan a trip", max_turns=2)
    assert result.final_output == Trip(city="Paris", days=3)

