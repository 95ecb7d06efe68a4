"""The gateway's per-token path without a model: kog_dist.aclient.AsyncClient against a real ZMQ ROUTER
in a thread (timeouts that follow each wait, replies drained in order through the event loop's
watch of the socket), and the streamed text events cut from chunk_body's JSON."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import zmq

from kog_dist import protocol as P
from kog_dist.aclient import AsyncClient, ClientTimeout

try:
    from json.encoder import encode_basestring

    from kog_cli.gateway import openai_api as O
    from kog_cli.gateway.app import _json, _tcp_socket, text_event_parts
except ImportError as e:       # starlette missing
    pytest.skip(f"kog serve's gateway needs {e.name}", allow_module_level=True)


class Router(threading.Thread):
    """Answers each request with `plan(msg)`: a list of (delay_s, reply fields) sent in order."""

    def __init__(self, plan):
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint, self.plan, self.stop = f"tcp://127.0.0.1:{port}", plan, threading.Event()
        self.start()

    def run(self):
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, data = self.sock.recv_multipart()
            msg = P.unpackb(data)
            for delay, reply in self.plan(msg):
                time.sleep(delay)
                self.sock.send_multipart([ident, P.packb({"v": P.VERSION, "id": msg["id"], **reply})])
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def router():
    made = []

    def make(plan):
        made.append(Router(plan))
        return made[-1]
    yield make
    for r in made:
        r.stop.set()
        r.join(5)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def _stream_plan(n, gap):
    def plan(msg):
        if msg["op"] != "generate":
            return []                                      # silent: the caller times out
        return [(0, {"type": "accepted", "rid": 1})] + \
            [(gap, {"type": "chunk", "token_ids": [i], "text": str(i)}) for i in range(n)] + \
            [(0, {"type": "result", "token_ids": list(range(n)), "text": "", "stop_reason": "length"})]
    return plan


def test_a_silent_server_times_out_after_the_wait_and_not_before(router):
    r = router(lambda msg: [])

    async def go():
        c = await AsyncClient(r.endpoint, timeout=5).start()
        t0 = time.monotonic()
        with pytest.raises(ClientTimeout):
            await c.call("health", timeout=0.3)
        took = time.monotonic() - t0
        await c.close()
        return took
    took = _run(go())
    assert 0.29 <= took < 1.5, took


def test_replies_slower_than_nothing_but_inside_the_timeout_never_time_out(router):
    # 8 replies 0.15 s apart with a 0.4 s timeout: the request's one timer fires early, sees a later
    # wait's deadline and moves, rather than timing out 0.4 s after the stream began
    r = router(_stream_plan(8, 0.15))

    async def go():
        c = await AsyncClient(r.endpoint, timeout=0.4).start()
        got = [m async for m in c.request({"op": "generate", "prompt": "x", "stream": True})]
        await c.close()
        return got
    got = _run(go())
    assert [m["type"] for m in got] == ["accepted"] + ["chunk"] * 8 + ["result"]
    assert [m["text"] for m in got[1:-1]] == [str(i) for i in range(8)]


def test_a_gap_longer_than_the_timeout_mid_stream_times_out(router):
    def plan(msg):
        return [(0, {"type": "accepted", "rid": 1}), (0.05, {"type": "chunk", "token_ids": [1], "text": "a"}),
                (1.0, {"type": "chunk", "token_ids": [2], "text": "b"})]
    r = router(plan)

    async def go():
        c = await AsyncClient(r.endpoint, timeout=0.3).start()
        req = c.request({"op": "generate", "prompt": "x", "stream": True})
        kinds = [(await req.__anext__())["type"], (await req.__anext__())["type"]]
        t0 = time.monotonic()
        with pytest.raises(ClientTimeout):
            await req.__anext__()
        took = time.monotonic() - t0
        await c.close()
        return kinds, took, req.done
    kinds, took, done = _run(go())
    assert kinds == ["accepted", "chunk"] and done
    assert 0.25 <= took < 0.9, took


def test_a_burst_is_drained_in_order_and_ready_chunks_takes_what_waits(router):
    r = router(_stream_plan(3000, 0))

    async def go():
        c = await AsyncClient(r.endpoint, timeout=5).start()
        req = c.request({"op": "generate", "prompt": "x", "stream": True})
        assert (await req.__anext__())["type"] == "accepted"
        await asyncio.sleep(0.5)                     # let the burst arrive while nobody reads
        texts, merged = [], 0
        async for m in req:
            if m["type"] == "chunk":
                more = req.ready_chunks()
                merged = max(merged, len(more))
                texts += [m["text"]] + [x["text"] for x in more]
        await c.close()
        return texts, merged
    texts, merged = _run(go())
    assert texts == [str(i) for i in range(3000)]
    assert merged > 100                              # most of the burst waited: taken in one go


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("text", ["a", " \"quoted\" \\ back", "é ü 中文 🙂", "\n\t\x01\x1f", "\u2028\u2029", ""])
def test_text_events_from_the_template_equal_chunk_body_json(chat, text):
    head, mid = text_event_parts("cmpl-abc", 1764633600, 'model "x" \\ é', chat)
    fast = b"".join((head, encode_basestring(text).encode(), mid, b"%d}\n\n" % 3))
    ev = O.chunk_body("cmpl-abc", 1764633600, 'model "x" \\ é', chat, text)
    ev["kog_tokens"] = 3
    assert fast == b"data: " + _json(ev) + b"\n\n"
    back = json.loads(fast[6:])
    assert (back["choices"][0]["delta"]["content"] if chat else back["choices"][0]["text"]) == text


def test_abandoning_a_quiet_request_before_any_reply_cancels_it_by_its_message_id(router):
    """A `quiet` request that starts at once has no rid until its first token: abandoned before that (its HTTP
    client left during the prefill), it is cancelled by `req_id`, on its own connection; once a reply told its
    rid, by rid."""
    seen = []

    def plan(msg):
        seen.append(msg)
        return [(0, {"type": "chunk", "rid": 7, "token_ids": [1], "text": "a"})] if msg.get("max_new_tokens") == 2 \
            else []

    r = router(plan)

    async def go():
        c = await AsyncClient(r.endpoint, timeout=5).start()
        try:
            a = c.request({"op": "generate", "prompt": "x", "quiet": True, "max_new_tokens": 1})
            a.abandon()
            b = c.request({"op": "generate", "prompt": "x", "quiet": True, "max_new_tokens": 2})
            assert (await b.__anext__())["type"] == "chunk"
            b.abandon()
            deadline = time.monotonic() + 5
            while len([m for m in seen if m["op"] == "cancel"]) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return a.id
        finally:
            await c.close()
    a_id = _run(go())
    cancels = [m for m in seen if m["op"] == "cancel"]
    assert [{k: m.get(k) for k in ("rid", "req_id")} for m in cancels] == [{"rid": None, "req_id": a_id},
                                                                          {"rid": 7, "req_id": None}]


def test_the_stream_finds_uvicorns_tcp_socket_to_cork_its_first_event():
    """The first event is corked with the response's start through the socket under uvicorn's `send`
    (kog_cli.gateway.app._tcp_socket): a uvicorn that stops holding it there makes this fail, not the cork
    silently stop."""
    import socket

    import uvicorn
    seen = {}

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        sock = _tcp_socket(send)
        seen["corkable"] = sock is not None and sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK) == 0
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def go():
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = await r.read()
        w.close()
        server.should_exit = True
        await task
        return reply
    reply = _run(go())
    assert reply.startswith(b"HTTP/1.1 200") and b"\r\nok\r\n" in reply and seen == {"corkable": True}


def test_a_request_in_flight_fails_at_once_when_the_server_goes(router):
    """A coordinator gone mid-request (its socket closed: the process died) fails the request with ServerGone
    within a second, not after the request's timeout; the next request on a fresh server works (the dead
    connection left the pool)."""
    from kog_dist.aclient import ServerGone
    r = router(lambda msg: [(0, {"type": "chunk", "rid": 1, "token_ids": [1], "text": "a"})])

    async def go():
        c = await AsyncClient(r.endpoint, timeout=30).start()
        try:
            req = c.request({"op": "generate", "prompt": "x", "quiet": True})
            assert (await req.__anext__())["type"] == "chunk"
            r.stop.set()                                   # the ROUTER closes: the connection drops
            t0 = time.monotonic()
            with pytest.raises(ServerGone):
                await req.__anext__()
            took = time.monotonic() - t0
            for _ in range(100):        # the monitor of the main connection may have told first
                if not c._all:
                    break
                await asyncio.sleep(0.01)
            return took, len(c._idle), len(c._all)
        finally:
            await c.close()
    took, idle, held = _run(go())
    assert took < 1.0 and idle == 0 and held == 0, (took, idle, held)
