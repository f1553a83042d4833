"""Real agent clients against the server, each through its own tool and structured-output flows:
LangChain (`langchain-openai`), the OpenAI Agents SDK (chat-completions and Responses models) and litellm.
Tool calls come from the scripted test double (SmolLM2 never calls tools by itself); structured outputs
from the real model under the schema-constrained decoding. Every tool call's arguments are validated
against the tool's JSON schema."""
import json
import os
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from conftest import API_KEY

# litellm must not fetch its model price list from the network at import time.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Lyon"]}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False}


def get_weather(city: Literal["Paris", "Lyon"], days: int = 1) -> str:
    """Weather forecast for a city."""
    return "Sunny, 21 C"


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    city: Literal["Paris", "London", "Rome"]


# --- LangChain ---

def lc_model(server, key):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(base_url=server.base + "/v1", api_key=key, model="smollm2", temperature=0,
                      max_tokens=120, max_retries=0, timeout=120)


def test_langchain_bind_tools_round_trip(scripted):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    weather = tool(get_weather)
    llm = lc_model(scripted, API_KEY).bind_tools([weather])
    msgs = [HumanMessage("weather in Paris (hermes)")]
    ai = llm.invoke(msgs)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], weather.args_schema.model_json_schema())
    msgs += [ai, ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.invoke(msgs)
    assert "sunny" in final.content


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(real, method):
    llm = lc_model(real, "unused").with_structured_output(Person, method=method)
    p = llm.invoke("Invent a person who lives in Rome.")
    assert isinstance(p, Person)
    jsonschema.validate(p.model_dump(), Person.model_json_schema())


# --- OpenAI Agents SDK ---

def agents_client(server, key):
    from agents import set_tracing_disabled
    from openai import AsyncOpenAI
    set_tracing_disabled(True)  # no trace export to the network
    return AsyncOpenAI(base_url=server.base + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_agents_sdk_runs_a_tool(scripted, api):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool)
    calls = []

    @function_tool
    def weather_tool(city: Literal["Paris", "Lyon"], days: int) -> str:
        """Weather forecast for a city."""
        calls.append({"city": city, "days": days})
        return "Sunny, 21 C"

    weather_tool.name = "get_weather"
    client = agents_client(scripted, API_KEY)
    model_cls = OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel
    agent = Agent(name="weather", instructions="Use the tools.", tools=[weather_tool],
                  model=model_cls(model="smollm2", openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=120))
    result = Runner.run_sync(agent, "weather in Paris (hermes)", max_turns=4)
    assert calls == [{"city": "Paris", "days": 3}]
    jsonschema.validate(calls[0], weather_tool.params_json_schema)
    assert "sunny" in result.final_output


def test_agents_sdk_output_type(real):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner
    agent = Agent(name="people", instructions="Answer with the requested data.", output_type=Person,
                  model=OpenAIChatCompletionsModel(model="smollm2", openai_client=agents_client(real, "x")),
                  model_settings=ModelSettings(temperature=0, max_tokens=80))
    out = Runner.run_sync(agent, "Invent a person who lives in Paris.", max_turns=1).final_output
    assert isinstance(out, Person)
    jsonschema.validate(out.model_dump(), Person.model_json_schema())


# --- litellm ---

def test_litellm_tool_call_and_json_schema(scripted, real):
    import litellm
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": WEATHER_PARAMS}}]
    r = litellm.completion(model="openai/smollm2", api_base=scripted.base + "/v1", api_key=API_KEY,
                           messages=[{"role": "user", "content": "weather in Paris (hermes)"}],
                           tools=tools, temperature=0, max_tokens=120, timeout=120)
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    r = litellm.completion(model="openai/smollm2", api_base=real.base + "/v1", api_key="unused",
                           messages=[{"role": "user", "content": "Invent a person in London."}],
                           response_format=Person, temperature=0, max_tokens=80, timeout=120)
    jsonschema.validate(json.loads(r.choices[0].message.content), Person.model_json_schema())
