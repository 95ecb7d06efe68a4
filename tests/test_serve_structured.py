"""Structured outputs (issue 55) through the official `openai` client against a real `kog serve` on the
default model (SmolLM2-135M-Instruct Q4_1, cpu backend): response_format json_schema and json_object on both
endpoints, streamed and not, always parse and validate; a schema cut by max_tokens is "length"; bad schemas and
unsupported features are 400s with the library's message. The same prompts without response_format do not give
a valid object (the mask is what makes these pass)."""
from __future__ import annotations

import json
import os

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serve_helpers import SMOL_GGUF, Serve  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isfile(SMOL_GGUF), reason=f"{SMOL_GGUF} is absent (CI fetches it once)")

MODEL = "SmolLM2-135M-Instruct"
CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "country": {"type": "string", "enum": ["France", "Germany", "Italy", "Spain"]},
    "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
    "capital": {"type": "boolean"}},
    "required": ["city", "country", "population_millions", "capital"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe Paris: its city name, country, population in millions and whether "
                                   "it is a capital."}]


@pytest.fixture(scope="module")
def client():
    with Serve("--model", SMOL_GGUF, "--backend", "cpu", "--max-seq", "1024", timeout=120) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


def _valid(text, schema) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_json_schema_chat_parses_and_validates(client):
    free = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0)
    assert not _valid(free.choices[0].message.content, CITY)      # unconstrained, the model does not comply
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=0,
                                       response_format=_fmt(CITY))
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    assert _valid(text, CITY), text
    assert json.loads(text)["country"] in CITY["properties"]["country"]["enum"]
    assert r.model_extra["kog_stats"]["grammar_us_per_token"] > 0


def test_json_schema_sampled_and_streamed(client):
    for seed in (1, 2, 3):
        events = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=1.0,
                                                     seed=seed, stream=True, response_format=_fmt(CITY)))
        text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
        finish = [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason]
        assert finish == ["stop"] and _valid(text, CITY), (seed, text)


def test_json_schema_on_completions_and_json_object_on_chat(client):
    prompt = "Paris, as JSON with its city, country, population in millions and whether it is a capital:"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0)
    assert not _valid(free.choices[0].text, CITY)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=120, temperature=0,   # the legacy
                                  extra_body={"response_format": _fmt(CITY)})                  # call lacks it
    assert r.choices[0].finish_reason == "stop" and _valid(r.choices[0].text, CITY), r.choices[0].text
    msgs = [{"role": "user", "content": "Give a JSON object with the keys x and y set to 1 and 2."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_cut_by_max_tokens_is_length(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0,
                                       response_format=_fmt(CITY))
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


@pytest.mark.parametrize("schema,words", [
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, ["strin"]),
    ({"type": "array", "uniqueItems": True}, ["unsupported", "uniqueItems"]),
    ({"type": "object", "if": {"required": ["a"]}, "then": {}}, ["unsupported", "if"]),
    ({"type": "string", "pattern": "[a-"}, ["regex"]),
])
def test_bad_schema_is_400_with_the_reason(client, schema, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, response_format=_fmt(schema))
    msg = e.value.body["message"]
    assert all(w in msg for w in words), msg
    assert "\n" not in msg


def test_bad_response_format_shapes_are_400(client):
    for rf in ({"type": "yaml"}, {"type": "json_schema", "json_schema": {"schema": 3}}, "json"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, response_format=rf)
        assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="stop cannot be combined"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, stop=["}"],
                                       response_format={"type": "json_object"})


@pytest.fixture(scope="module")
def worker():
    """`python -m workers` (one rank, cpu) on a free port, driven by kog_dist.Client over the ZMQ protocol."""
    import subprocess
    import sys
    import time

    from kog_dist import Client
    from launch.cli import free_port
    from serve_helpers import ENV, REPO_ROOT
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    p = subprocess.Popen([sys.executable, "-m", "workers", "--model", SMOL_GGUF, "--backend", "cpu", "--bind", "none",
                          "--control", endpoint, "--max-seq", "1024"], env=ENV, cwd=REPO_ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        with Client(endpoint, timeout=120) as c:
            deadline = time.monotonic() + 120
            while True:
                try:
                    c.health()
                    break
                except (TimeoutError, ConnectionError):
                    assert p.poll() is None and time.monotonic() < deadline, "the worker did not come up"
            yield c
    finally:
        p.terminate()
        assert p.wait(30) == 0


def test_protocol_response_format_json_schema_and_lark(worker):
    from kog_dist.client import ServerError
    prompt = "Paris, as JSON with its city, country, population in millions and whether it is a capital:"
    r = worker.generate(prompt, max_new_tokens=120, response_format={"type": "json_schema", "schema": CITY})
    assert r.stop_reason == "eos" and _valid(r.text, CITY), r.text
    assert r.stats["grammar_us_per_token"] > 0 and r.stats["spec_steps"] == 0
    # each request its own grammar: a Lark one (llguidance's dialect) for the next
    r = worker.generate("Answer yes or no: is Paris in France?", max_new_tokens=8,
                        response_format={"type": "lark", "grammar": 'start: ("yes" | "no") "."'})
    assert r.text in ("yes.", "no.") and r.stop_reason == "eos", r.text
    for fmt, words in (({"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
                       ({"type": "xml"}, "response_format type"),
                       ({"type": "lark", "grammar": "start: undefined_rule"}, "undefined_rule")):
        with pytest.raises(ServerError) as e:
            worker.generate("x", max_new_tokens=4, response_format=fmt)
        assert e.value.code == "bad_request" and words in str(e.value), str(e.value)


def test_a_grammar_travels_as_its_format_and_each_rank_compiles_its_own():
    """A command for several ranks carries the grammar's format; from_wire compiles a fresh matcher with the rank's
    tokenizer, whose masks follow the original's token for token; without a tokenizer it refuses in one line."""
    import numpy as np
    from kog_dist.backend import RunCommand
    from kog_dist.formats import open_model
    from kog_dist.grammar import compile_format
    from kog_dist.tokenizer import load_tokenizer
    src = open_model(SMOL_GGUF, progress=False)
    tok = load_tokenizer(src)
    src.close()
    fmt = _fmt({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    cmd = RunCommand(append=[1], max_new_tokens=8, grammar=compile_format(fmt, tok).matcher())
    wire = cmd.to_wire()
    assert wire["grammar"] == cmd.grammar.grammar.format
    got = RunCommand.from_wire(wire, lambda: tok)
    assert got.grammar is not cmd.grammar and RunCommand.from_wire(RunCommand(append=[1]).to_wire()).grammar is None
    logits = np.zeros(tok.vocab_size, np.float32)
    for t in tok.encode('{"n": 42}'):
        a, b = cmd.grammar.mask(logits), got.grammar.mask(logits)
        assert np.array_equal(a, b) and np.isfinite(a[t])
        assert cmd.grammar.accept(t) and got.grammar.accept(t)
    with pytest.raises(ValueError, match="tokenizer"):
        RunCommand.from_wire(wire)