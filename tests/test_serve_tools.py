"""Tool calls (issue 55) through the official `openai` client against a real `kog serve` on the default model
(SmolLM2-135M-Instruct, cpu): tool_choice "required" and a named function give tool_calls whose arguments
validate against the function's parameters (decoded under them), whole and streamed as deltas; a history with
assistant tool_calls and tool results renders and answers; "none" never calls; bad tool definitions are 400s."""
from __future__ import annotations

import json
import os

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serve_helpers import SMOL_GGUF, Serve  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isfile(SMOL_GGUF), reason=f"{SMOL_GGUF} is absent (CI fetches it once)")

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                           "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def client():
    with Serve("--model", SMOL_GGUF, "--backend", "cpu", "--max-seq", "2048", timeout=120) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_gives_a_valid_call(client):
    # left to itself (auto) the 135M model answers in prose and JSON of its own, no call: the call below is the grammar's
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0)
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason != "tool_calls"
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=80, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert len(c.message.tool_calls) == 1
    _check(c.message.tool_calls[0])


@pytest.mark.parametrize("seed", [1, 2])
def test_named_function_sampled_still_validates(client, seed):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=1.0,
                                       seed=seed, tool_choice={"type": "function", "function": {"name": "get_time"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    _check(c.message.tool_calls[0], "get_time")


def test_streamed_call_arrives_as_deltas(client):
    events = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                 max_tokens=80, temperature=0, stream=True))
    deltas = [tc for e in events if e.choices for tc in (e.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].index == 0 and deltas[0].id.startswith("call_")
    args = "".join(d.function.arguments or "" for d in deltas)
    name = "".join(d.function.name or "" for d in deltas)
    jsonschema.validate(json.loads(args), SCHEMAS[name])
    assert [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason] == ["tool_calls"]
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=80, temperature=0)
    assert json.loads(whole.choices[0].message.tool_calls[0].function.arguments) == json.loads(args)


def test_history_with_calls_and_results(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=80, temperature=0).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=40, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    short = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens > short.usage.prompt_tokens + 20      # the call and its result are in the prompt


def test_auto_answers_as_content_or_a_valid_call(client):
    for msgs in (ASK, [{"role": "user", "content": "Say hello."}]):
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=60, temperature=0)
        m = r.choices[0].message
        if m.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls"
            for c in m.tool_calls:
                assert c.function.name in SCHEMAS and isinstance(json.loads(c.function.arguments), dict)
        else:
            assert m.content and "<tool_call>" not in m.content


@pytest.mark.parametrize("tools,choice,words", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                    "properties": {"a": {"type": "strin"}}}}}],
     "required", ["tools[0]", "strin"]),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}],
     "auto", ["unsupported", "uniqueItems"]),
    ([{"type": "function", "function": {"name": "bad name!"}}], "auto", ["name"]),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}], "auto",
     ["twice"]),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, ["nope", "not in tools"]),
    (TOOLS, "sometimes", ["tool_choice"]),
])
def test_bad_tools_are_400_with_the_reason(client, tools, choice, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice, max_tokens=8)
    msg = e.value.body["message"]
    assert all(w in msg for w in words) and "\n" not in msg, msg
