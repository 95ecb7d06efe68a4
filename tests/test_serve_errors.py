"""`kog serve`'s error paths with raw HTTP (httpx): bad bodies, refused parameters, 404, the context
limit, 429 + Retry-After under a flood (every accepted request completed), 503 while the coordinator is
not there yet and after the ranks died, a disconnect mid-stream cancelling the decode, API keys, and a
clean SIGTERM. The gateway runs with --connect in front of a throttled coordinator (tokens every 20 ms)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time

import httpx
import pytest
from tokenizers import Tokenizer, models

from kog_cli.gateway import served_name
from kog_dist import protocol as P
from kog_dist.client import Client
from kog_dist.scheduler import _encode_chat
from kog_dist.tokenizer import HFTokenizer
from serve_helpers import Coordinator, Proc, Serve, kog, shm_names, tiny_model

DELAY = 0.02


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("serr") / "m")


@pytest.fixture(scope="module")
def coord(model):
    with Coordinator(model, delay=DELAY, queue_limit=2) as c:
        yield c


@pytest.fixture(scope="module")
def url(coord):
    with Serve("--connect", coord.endpoint, "--max-body-bytes", "65536", "--served-model-name", "m") as s:
        yield s.url


def _post(url, path, body, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=data, headers={"content-type": "application/json"}, timeout=30, **kw)


def _err(r, status):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    return e


def test_bad_bodies_and_parameters(url):
    _err(_post(url, "/v1/completions", b"{not json"), 400)
    _err(_post(url, "/v1/completions", b"[1, 2]"), 400)
    e = _err(_post(url, "/v1/completions", {"prompt": "x", "temperature": "hot"}), 400)
    assert e["param"] == "temperature"
    assert _err(_post(url, "/v1/completions", {"prompt": "x", "max_tokens": -1}), 400)["param"] == "max_tokens"
    assert _err(_post(url, "/v1/chat/completions", {"messages": "hi"}), 400)["param"] == "messages"
    assert _err(_post(url, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
                400)["param"] == "messages"
    assert _err(_post(url, "/v1/completions", {"prompt": "x", "n": 2}), 400)["param"] == "n"
    assert _err(_post(url, "/v1/completions", {"prompt": "x", "stop": [1]}), 400)["param"] == "stop"
    assert _err(_post(url, "/v1/completions", {"prompt": 5}), 400)["param"] == "prompt"
    # a body over --max-body-bytes, announced or not
    _err(_post(url, "/v1/completions", {"prompt": "x" * 70000}), 413)
    # nesting: past Python's recursion limit, and deep but parseable in an ignored field
    assert "nests deeper" in _err(_post(url, "/v1/completions", "[" * 30000 + "]" * 30000), 400)["message"]
    assert "nests deeper" in _err(_post(url, "/v1/completions", '{"prompt": "x", "a": ' + '[' * 40 + ']' * 40 + '}'),
                                  400)["message"]
    # unknown fields are ignored
    r = _post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0, "frobnicate": {"a": 1},
                                       "user": "me"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_unknown_model_and_context_limit(url):
    e = _err(_post(url, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404)
    assert e["code"] == "model_not_found"
    assert httpx.get(url + "/v1/models/gpt-9").status_code == 404
    e = _err(_post(url, "/v1/completions", {"prompt": "y" * 1100, "max_tokens": 2}), 400)   # max_seq 1024
    assert e["code"] == "context_length_exceeded"
    assert httpx.get(url + "/nope").status_code == 404


async def _flood(url, n):
    async with httpx.AsyncClient(timeout=30) as c:
        body = {"prompt": "flood", "max_tokens": 10, "temperature": 0}
        return await asyncio.gather(*[c.post(url + "/v1/completions", json=body) for _ in range(n)])


def test_flood_gets_429_and_every_accepted_request_completes(url):
    rs = asyncio.run(_flood(url, 16))
    codes = sorted(r.status_code for r in rs)
    ok, busy = [r for r in rs if r.status_code == 200], [r for r in rs if r.status_code == 429]
    assert len(ok) + len(busy) == 16, codes
    assert 3 <= len(ok) < 16 and busy, codes          # 1 running + 2 queued at least
    for r in busy:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
    texts = {r.json()["choices"][0]["text"] for r in ok}
    assert len(texts) == 1 and all(r.json()["usage"]["completion_tokens"] == 10 for r in ok)


def test_disconnect_mid_stream_cancels_and_the_next_is_served_at_once(url, coord):
    with Client(coord.endpoint, timeout=10) as c:
        before = c.stats()
    body = {"prompt": "long", "max_tokens": 500, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data: ")
                if n >= 3:
                    break
        # leaving the block closes the connection mid-stream
    t0 = time.monotonic()
    r = _post(url, "/v1/completions", {"prompt": "next", "max_tokens": 1, "temperature": 0})
    took = time.monotonic() - t0
    assert r.status_code == 200 and took < 0.5, took    # not behind the 10 s of the abandoned decode
    with Client(coord.endpoint, timeout=10) as c:
        after = c.stats()
    assert after["requests"]["cancelled"] == before["requests"]["cancelled"] + 1
    # the abandoned decode stopped within a few tokens of the disconnect (1 more for "next")
    assert after["tokens_generated"] - before["tokens_generated"] <= n + 6
    # a client that gives up on a whole (non-streamed) answer is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        # greedy: with OpenAI's default temperature 1 and a random seed the tiny model ends within 15
        # tokens (0.3 s at 20 ms a token) about one time in ten, and the post returns
        httpx.post(url + "/v1/completions", json={"prompt": "long", "max_tokens": 500, "temperature": 0},
                   timeout=0.3)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with Client(coord.endpoint, timeout=10) as c:
            last = c.stats()
        if last["requests"]["cancelled"] == after["requests"]["cancelled"] + 1:
            break
        time.sleep(0.05)
    assert last["requests"]["cancelled"] == after["requests"]["cancelled"] + 1
    assert last["tokens_generated"] - after["tokens_generated"] < 100      # not its 500 tokens


def test_a_queued_stream_hears_its_status_before_its_decode_starts(url):
    """A stream's response starts with its first event (no write while the prefill runs), except for a request
    queued behind another decode: its client hears its 200 at once, not after the decode ahead of it."""
    ahead = {"prompt": "long", "max_tokens": 200, "temperature": 0, "stream": True}    # 4 s at 20 ms a token
    with httpx.Client(timeout=30) as h, h.stream("POST", url + "/v1/completions", json=ahead) as running:
        assert running.status_code == 200
        lines = running.iter_lines()     # kept: a line iterator dropped unfinished closes the response
        next(line for line in lines if line.startswith("data: "))     # it decodes now
        t0 = time.monotonic()
        queued = {"prompt": "next", "max_tokens": 2, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as h2, h2.stream("POST", url + "/v1/completions", json=queued) as r:
            took = time.monotonic() - t0
            assert r.status_code == 200 and took < 2.0, took
        assert next(line for line in lines if line.startswith("data: "))   # the one ahead still decodes
        # leaving both blocks closes the connections: both requests are cancelled


def test_503_until_the_coordinator_answers(model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    gw = Serve("--connect", endpoint, wait=False)
    try:
        base = gw.wait_http()
        r = httpx.get(base + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        e = _err(_post(base, "/v1/completions", {"prompt": "x"}), 503)
        assert e["code"] == "loading"
        worker = Proc([sys.executable, "-m", "workers", "--model", model, "--control", endpoint, "--bind", "none",
                       "--backend", "cpu"])
        try:
            gw.wait_ready(30)
            r = _post(base, "/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
        finally:
            assert worker.stop() == 0
        deadline = time.monotonic() + 5
        while httpx.get(base + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(base + "/health").json()["status"] == "down"
        assert _err(_post(base, "/v1/completions", {"prompt": "x"}), 503)["code"] == "down"
    finally:
        assert gw.stop() == 0


def test_rank_death_gives_503_then_exit_1_and_sigterm_is_clean(model):
    """One rank SIGKILLed: 503, then exit 1. Two ranks under mpiexec: SIGTERM, exit 0, nothing left."""
    before = shm_names()
    with Serve("--model", model, "--backend", "cpu", "--failure-linger-s", "1") as s:
        assert _post(s.url, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200
        (rank,) = s.rank_pids()
        os.kill(rank, signal.SIGKILL)
        deadline = time.monotonic() + 5       # (a dropped connection may show as "down" first)
        while httpx.get(s.url + "/health").json()["status"] != "failed" and time.monotonic() < deadline:
            time.sleep(0.05)
        e = _err(_post(s.url, "/v1/completions", {"prompt": "x"}), 503)
        assert e["code"] == "failed" and "exited" in e["message"]
        assert s.wait(15) == 1
    s2 = Serve("--model", model, "--backend", "cpu", "--np", "2", "--bind", "none")    # under mpiexec
    assert s2.rank_pids()
    r = _post(s2.url, "/v1/completions", {"prompt": "x", "max_tokens": 3, "temperature": 0})   # greedy: no early EOS
    assert r.json()["usage"]["completion_tokens"] == 3
    assert s2.stop(signal.SIGTERM) == 0 and "SIGTERM: stopping" in s2.err.text()
    assert not s2.rank_pids()
    assert not {n for n in shm_names() - before if n.startswith(("kccl", "mpich"))}


def test_api_key_and_non_loopback_host(model, coord):
    out = Proc(kog("serve", "--connect", coord.endpoint, "--host", "0.0.0.0", "--port", "0"))
    assert out.wait(30) == 2
    err = out.err.text().strip().splitlines()
    assert len(err) == 1 and "--api-key" in err[0] and "Traceback" not in out.err.text()
    with socket.socket() as taken:                 # a busy port: one line, exit 2, no rank started
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        out = Proc(kog("serve", "--model", model, "--port", str(taken.getsockname()[1])))
        assert out.wait(30) == 2
        assert "cannot listen on" in out.err.text() and len(out.err.text().strip().splitlines()) == 1
    with Serve("--connect", coord.endpoint, "--api-key", "s3cret") as s:
        body = {"prompt": "x", "max_tokens": 1}
        assert _err(_post(s.url, "/v1/completions", body), 401)["code"] == "invalid_api_key"
        r = httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200


def test_protocol_messages_field():
    ok = P.parse_request({"v": 1, "op": "generate", "messages": [{"role": "user", "content": "hi"}]})
    assert ok["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in ok
    for bad in ([], "hi", [{"role": "user"}], [{"role": "user", "content": 5}], [{"role": "", "content": "x"}],
                [{"role": "user", "content": "x", "extra": 1}]):
        with pytest.raises(P.ProtocolError) as e:
            P.parse_request({"v": 1, "op": "generate", "messages": bad})
        assert e.value.code == "bad_request"
    with pytest.raises(P.ProtocolError, match="not both"):
        P.parse_request({"v": 1, "op": "generate", "messages": [{"role": "user", "content": "x"}], "prompt": "y"})
    # a template that fails to render is the client's error (the coordinator answers bad_request)
    vocab = {"<s>": 0, "a": 1, "[UNK]": 2}
    tok = HFTokenizer(Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")), kind="hf", vocab_size=3, bos_id=0,
                      eos_ids=[], add_bos=False, chat_template="{{ raise_exception('only user turns') }}")
    with pytest.raises(ValueError, match="only user turns"):
        _encode_chat(tok, [{"role": "system", "content": "a"}])


def test_served_model_names():
    assert served_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"   # no quant tag
    assert served_name("qwen2.5-0.5b-instruct-q8_0.gguf") == "qwen2.5-0.5b-instruct"
    assert served_name("Llama-3.2-1B-Instruct-Q4_K_M.gguf") == "Llama-3.2-1B-Instruct"
    assert served_name("model-f16.gguf") == "model" and served_name("plain.gguf") == "plain"
    assert served_name("/models/qwen2.5-0.5b/") == "qwen2.5-0.5b"     # a directory keeps its dots
    assert served_name("tiny-random") == "tiny-random"
