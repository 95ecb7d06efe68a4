"""Edges of the control plane: pipelined session requests, close and cancel by session while a
request runs, id echo, a stream abandoned half-way, health answered while a decode runs."""
from __future__ import annotations

import time

import pytest
import zmq

from kog_dist import protocol as P
from kog_dist.client import Client, ServerError

from test_control_helpers import Reference, Server, Throttled, load, tiny_model, wait_until

PROMPT = [1, 17, 42, 99, 7, 250]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("edges") / "m"))


@pytest.fixture(scope="module")
def ref(model):
    return Reference(model)


@pytest.fixture
def slow(model):
    backend, cfg, tok = load(model)
    with Server(Throttled(backend, 0.01), tok, cfg) as s:
        yield s


def _final(sock, want_id, timeout=10.0):
    """All messages for request `want_id` up to its final one."""
    out = []
    while True:
        assert sock.poll(int(timeout * 1000)), out
        m = P.unpackb(sock.recv(), P.MAX_REPLY_BYTES)
        if m.get("id") == want_id:
            out.append(m)
            if m["type"] in ("ok", "error", "result"):
                return out


def test_pipelined_session_requests_and_string_ids(model, ref):
    backend, cfg, tok = load(model)
    with Server(backend, tok, cfg) as srv:
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(srv.endpoint)
        d.send(P.packb({"v": 1, "op": "open", "id": "open-1"}))
        sid = _final(d, "open-1")[-1]["session"]
        steps = [{"op": "append", "prompt_ids": [1, 5, 9]}, {"op": "generate", "max_new_tokens": 5},
                 {"op": "append", "prompt_ids": [30, 31]}, {"op": "generate", "max_new_tokens": 5, "stream": True}]
        for i, st in enumerate(steps):                       # all sent before any answer is read
            d.send(P.packb({"v": 1, "id": f"step-{i}", "session": sid, **st}))
        by_id, done = {}, set()
        while len(done) < 4:
            assert d.poll(10000)
            m = P.unpackb(d.recv(), P.MAX_REPLY_BYTES)
            by_id.setdefault(m["id"], []).append(m)
            if m["type"] in ("ok", "error", "result"):
                done.add(m["id"])
        res = [by_id[f"step-{i}"] for i in range(4)]
        assert [r[-1]["rid"] for r in res] == sorted(r[-1]["rid"] for r in res)     # served in order
        assert [r[0]["type"] for r in res] == ["accepted"] * 4
        g1, g2 = res[1][-1]["token_ids"], res[3][-1]["token_ids"]
        assert g1 == ref.ids([1, 5, 9], 5) and g2 == ref.ids([1, 5, 9] + g1 + [30, 31], 5)
        assert [t for m in res[3] if m["type"] == "chunk" for t in m["token_ids"]] == g2
        d.close(0)


def test_close_and_cancel_by_session_while_running(slow):
    # b: another connection of the same client (its owner token): it may cancel and close a's session
    with Client(slow.endpoint, timeout=10, owner="o" * 16) as a, Client(slow.endpoint, timeout=10, owner="o" * 16) as b:
        s = a.session()
        st = s.stream(prompt_ids=PROMPT, max_new_tokens=300)
        next(st)
        assert b.cancel(session=s.id) == [st.rid]
        list(st)
        assert st.result.stop_reason == "cancel" and st.result.session == s.id
        st = s.stream(max_new_tokens=300)                    # continues after the cancelled tokens
        next(st)
        b._call("close", session=s.id)
        list(st)
        assert st.result.stop_reason == "cancel"
        with pytest.raises(ServerError) as e:
            s.generate(max_new_tokens=2)
        assert e.value.code == "no_session"


def test_abandoned_stream_is_cancelled_and_client_reusable(slow, ref):
    with Client(slow.endpoint, timeout=10) as c:
        st = c.stream(prompt_ids=PROMPT, max_new_tokens=300)
        next(st)
        t0 = time.monotonic()
        r = c.generate(prompt_ids=PROMPT, max_new_tokens=3)     # closes (cancels) the open stream first
        assert time.monotonic() - t0 < 3.0 and st.result.stop_reason == "cancel"
        assert r.token_ids == ref.ids(PROMPT, 3)
        assert c.stats()["requests"]["cancelled"] == 1


def test_health_answers_while_decoding(slow):
    with Client(slow.endpoint, timeout=10) as a, Client(slow.endpoint, timeout=10) as b:
        st = a.stream(prompt_ids=PROMPT, max_new_tokens=200)
        next(st)
        for _ in range(5):
            t0 = time.monotonic()
            h = b.health()
            assert h["active"] == st.rid and time.monotonic() - t0 < 0.5
        st.close()
        assert wait_until(lambda: b.health()["active"] is None, 5)


def test_quiet_requests_hear_first_from_their_tokens_and_cancel_by_req_id(slow, ref):
    """`quiet`: no `accepted` for a request that starts at once (its first reply is a chunk or a progress,
    carrying its rid),
    `accepted` with the place for a queued one; `cancel` by `req_id` stops the caller's running or queued
    request before it has a rid, and never another connection's."""
    d, other = (zmq.Context.instance().socket(zmq.DEALER) for _ in range(2))
    for s in (d, other):
        s.setsockopt(zmq.LINGER, 0)
        s.connect(slow.endpoint)
    try:
        d.send(P.packb({"v": 1, "op": "generate", "id": 1, "prompt_ids": PROMPT, "max_new_tokens": 3,
                        "stream": True, "quiet": True}))
        got = _final(d, 1)        # chunks (and a progress, should the prefill take over 0.5 s), never accepted
        assert {m["type"] for m in got[:-1]} <= {"chunk", "progress"} and "chunk" in {m["type"] for m in got}
        assert got[-1]["type"] == "result" and got[0]["rid"] == got[-1]["rid"]
        assert got[-1]["token_ids"] == ref.ids(PROMPT, 3)
        # a long one runs; a second, quiet, is queued behind it and told so
        d.send(P.packb({"v": 1, "op": "generate", "id": 2, "prompt_ids": PROMPT, "max_new_tokens": 300,
                        "stream": True, "quiet": True}))
        d.send(P.packb({"v": 1, "op": "generate", "id": 3, "prompt_ids": PROMPT, "max_new_tokens": 300,
                        "quiet": True}))
        by_id = {}
        while 3 not in by_id or 2 not in by_id:
            assert d.poll(10000)
            m = P.unpackb(d.recv(), P.MAX_REPLY_BYTES)
            by_id.setdefault(m["id"], []).append(m)
        assert by_id[3][0]["type"] == "accepted" and by_id[3][0]["position"] == 1
        assert by_id[2][0]["type"] in ("chunk", "progress") and by_id[2][0]["rid"]
        # another connection naming the same message ids cancels nothing of this one's
        other.send(P.packb({"v": 1, "op": "cancel", "id": 9, "req_id": 2}))
        assert _final(other, 9)[-1]["cancelled"] == []
        d.send(P.packb({"v": 1, "op": "cancel", "id": 4, "req_id": 3}))     # the queued one
        d.send(P.packb({"v": 1, "op": "cancel", "id": 5, "req_id": 2}))     # the running one
        ends = {}
        while len(ends) < 4:
            assert d.poll(10000)
            m = P.unpackb(d.recv(), P.MAX_REPLY_BYTES)
            if m["type"] in ("ok", "error", "result"):
                ends[m["id"]] = m
        assert ends[4]["cancelled"] == [by_id[3][0]["rid"]] and ends[3]["code"] == "cancelled"
        assert ends[5]["cancelled"] == [by_id[2][0]["rid"]] and ends[2]["stop_reason"] == "cancel"
        d.send(P.packb({"v": 1, "op": "cancel", "id": 6, "req_id": "x" * 129}))
        assert _final(d, 6)[-1]["code"] == "bad_request"
    finally:
        d.close(0)
        other.close(0)
