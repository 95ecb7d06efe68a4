"""An asyncio client of the control plane (docs/protocol.md), for gateways serving many clients at once.

    c = AsyncClient("tcp://127.0.0.1:5555", timeout=30)
    await c.start()
    h = await c.call("health")                                  # one-reply ops: a dict, or ServerError
    req = c.request({"op": "generate", "prompt": "Hi", "stream": True})
    async for msg in req:                                       # accepted, queued, chunk, progress, result
        ...
    await req.cancel()                                          # stop the decode (the result still comes)
    await c.close()

One DEALER socket carries every request; a reader task routes each reply by its `id` to the request's
own queue, so a slow consumer never delays the others (its messages wait in its queue). Cancelling
goes over the same connection, so the coordinator sees the owner of the request asking. When the
connection to the server drops, every request in flight raises ``ServerGone`` at once.
"""
from __future__ import annotations

import asyncio
import itertools

import zmq
import zmq.asyncio

from . import protocol as P
from .client import BusyError, ClientTimeout, ServerError, ServerGone, _curve

__all__ = ["AsyncClient", "AsyncRequest", "BusyError", "ClientTimeout", "ServerError", "ServerGone"]

_FINAL = ("result", "error")


class AsyncRequest:
    """The replies of one request, in order; iteration ends after the `result` (an `error` raises)."""

    def __init__(self, client: "AsyncClient", rid: int):
        self.client, self.id = client, rid
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rid = None                      # the server's request number, from `accepted`
        self.done = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self.done:
            raise StopAsyncIteration
        try:
            msg = await asyncio.wait_for(self.queue.get(), self.client.timeout)
        except asyncio.TimeoutError:
            self._end()
            raise ClientTimeout(f"no answer from {self.client.endpoint} within {self.client.timeout:g} s") from None
        if isinstance(msg, BaseException):
            self._end()
            raise msg
        kind = msg.get("type")
        if kind == "accepted":
            self.rid = msg.get("rid")
        if kind == "error":
            self._end()
            cls = BusyError if msg.get("code") == "busy" else ServerError
            raise cls(str(msg.get("code")), str(msg.get("message")), msg)
        if kind in _FINAL:
            self._end()
        return msg

    def _end(self):
        self.done = True
        self.client._pending.pop(self.id, None)

    async def cancel(self) -> list:
        """Ask the server to stop this request (running: at the next token; queued: dropped)."""
        if self.done or self.rid is None:
            return []
        try:
            r = await self.client.call("cancel", rid=self.rid, timeout=5.0)
        except (ServerError, ClientTimeout, ServerGone):
            return []
        return r.get("cancelled", [])

    def abandon(self) -> None:
        """Stop listening, and cancel on the server without waiting (for a task being torn down)."""
        if not self.done:
            rid = self.rid
            self._end()
            self.queue.put_nowait(StopAsyncIteration())    # wakes a consumer waiting for the next message
            if rid is not None:
                try:
                    self.client.send_nowait({"op": "cancel", "rid": rid})
                except (ClientTimeout, ServerGone):
                    pass


class AsyncClient:
    """One DEALER connection shared by any number of concurrent requests (all on one event loop)."""

    def __init__(self, endpoint: str, timeout: float = 30.0, *, server_key=None, client_key=None):
        P.endpoint_host(endpoint)                       # ValueError on a malformed endpoint
        self.endpoint, self.timeout = endpoint, float(timeout)
        self._keys = (server_key, client_key)
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._mon = None
        self._tasks = []
        self._ids = itertools.count(1)
        self._pending: dict[int, AsyncRequest] = {}
        self.connected = False

    async def start(self) -> "AsyncClient":
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, P.MAX_REPLY_BYTES)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.RCVHWM, 100_000)
        host = P.endpoint_host(self.endpoint)
        if host and ":" in host:
            s.setsockopt(zmq.IPV6, 1)
        _curve(s, *self._keys)
        self._mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        s.connect(self.endpoint)
        self._sock = s
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._watch())]
        return self

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if self._sock is not None:
            self._sock.disable_monitor()
            self._mon.close(0)
            self._sock.close(0)
            self._sock = None
        self._fail_all(ServerGone("the client is closed"))

    # ------------------------------------------------------------------------------ plumbing
    async def _read(self):
        while True:
            data = await self._sock.recv()
            try:
                msg = P.unpackb(data, P.MAX_REPLY_BYTES)
            except P.ProtocolError:
                continue
            req = self._pending.get(msg.get("id"))
            if req is not None:
                req.queue.put_nowait(msg)

    async def _watch(self):
        from zmq.utils.monitor import parse_monitor_message
        while True:
            ev = parse_monitor_message(await self._mon.recv_multipart())
            if ev["event"] == zmq.EVENT_CONNECTED:
                self.connected = True
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                self.connected = False
                # the replies of requests sent on the old connection can never arrive
                self._fail_all(ServerGone(f"the server at {self.endpoint} closed the connection "
                                          f"(it stopped or crashed)"))

    def _fail_all(self, exc):
        for req in list(self._pending.values()):
            req.queue.put_nowait(exc)

    def send_nowait(self, msg: dict) -> int:
        """Send one request without waiting; returns its id. ClientTimeout when the send would block."""
        if self._sock is None:
            raise ServerGone("the client is closed")
        rid = next(self._ids)
        try:
            self._sock.send(P.packb({"v": P.VERSION, "id": rid, **msg}), zmq.NOBLOCK)
        except zmq.Again:
            raise ClientTimeout(f"cannot send to {self.endpoint} (no connection)") from None
        return rid

    def request(self, msg: dict) -> AsyncRequest:
        """Send a request now; iterate the returned AsyncRequest for its replies."""
        if self._sock is None:
            raise ServerGone("the client is closed")
        rid = next(self._ids)
        req = AsyncRequest(self, rid)
        self._pending[rid] = req
        try:
            self._sock.send(P.packb({"v": P.VERSION, "id": rid, **msg}), zmq.NOBLOCK)
        except zmq.Again:
            req._end()
            raise ClientTimeout(f"cannot send to {self.endpoint} (no connection)") from None
        return req

    async def call(self, op: str, timeout: float | None = None, **fields) -> dict:
        """A one-reply op (health, stats, open, close, cancel, shutdown): the reply's fields."""
        t = self.timeout if timeout is None else float(timeout)
        req = self.request({"op": op, **fields})
        try:
            msg = await asyncio.wait_for(req.__anext__(), t)
        except asyncio.TimeoutError:
            raise ClientTimeout(f"no answer from {self.endpoint} within {t:g} s") from None
        finally:
            req._end()
        for k in ("v", "id", "type"):
            msg.pop(k, None)
        return msg
