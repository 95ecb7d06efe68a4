"""An asyncio client of the control plane (docs/protocol.md), for gateways serving many clients at once.

    c = AsyncClient("tcp://127.0.0.1:5555", timeout=30)
    await c.start()
    h = await c.call("health")                                  # one-reply ops: a dict, or ServerError
    req = c.request({"op": "generate", "prompt": "Hi", "stream": True})
    async for msg in req:                                       # accepted, queued, chunk, progress, result
        ...
    await req.cancel()                                          # stop the decode (the result still comes)
    await c.close()

Each request in flight has a DEALER connection of its own from a pool (the coordinator caps what one
connection holds: half its queue, a few sessions). To a plain TCP coordinator those connections speak ZMTP
on the event loop's own transport (kog_dist.zmtp: libzmq's I/O thread is one more thread to wake on each
message's way, ~0.2 ms of a first token on two busy cores); to a CURVE one they are libzmq DEALERs whose
descriptors the loop watches (``loop.add_reader``). Either way each reply is routed by its `id` to the
request's own queue, so a slow consumer never delays the others (its messages wait in its queue). No
``zmq.asyncio``: a token costs one callback and one wake-up of its consumer, not a Future, a timer and a
task step per message (on two cores shared with the decode, every microsecond the gateway spends per token
is taken from the decode; bench/serve_overhead.py). The main connection (one-reply ops such as `health`,
and the monitor that tells when the server comes and goes) is always libzmq's.
Cancelling goes over the request's connection, so the coordinator sees the request's owner asking.
When the server's connections drop, every request in flight raises ``ServerGone`` at once.
"""
from __future__ import annotations

import asyncio
import collections
import itertools

import zmq
from zmq.utils.monitor import parse_monitor_message

from . import protocol as P
from . import zmtp
from .client import BusyError, ClientTimeout, ServerError, ServerGone, _curve

__all__ = ["AsyncClient", "AsyncRequest", "BusyError", "ClientTimeout", "ServerError", "ServerGone"]

_FINAL = ("result", "error")
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)


class AsyncRequest:
    """The replies of one request, in order; iteration ends after the `result` (an `error` raises)."""

    def __init__(self, client: "AsyncClient", rid: int, conn: "_Conn", owns_conn: bool = True, quiet: bool = False):
        self.client, self.id, self.conn, self.owns_conn = client, rid, conn, owns_conn
        self.queue: collections.deque = collections.deque()
        self.rid = None                      # the server's request number, from its first reply
        self.quiet = quiet                   # sent `quiet`: maybe no `accepted`, cancelled by req_id until a reply
        self.done = False
        self._back = None                    # a message ready_chunks() took but did not return
        self._unread = None                  # a message given back by unread(), already taken
        self._waiter = None                  # the Future a consumer waits on while the queue is empty
        self._timer = None                   # one timer a request (not one a message): _on_timer
        self._deadline = 0.0

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self._unread is not None:
            m, self._unread = self._unread, None
            return m
        if self.done:
            raise StopAsyncIteration
        return self._take(await self._get(self.client.timeout))

    def _put(self, msg) -> None:
        """A reply (or an exception to raise) for the consumer; wakes it if it waits."""
        self.queue.append(msg)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _get(self, timeout: float):
        if self._back is not None:
            m, self._back = self._back, None
            return m
        if self.queue:                        # the common case while a stream flows: no waiting at all
            return self.queue.popleft()
        loop = self.client._loop
        self._deadline = loop.time() + timeout
        # the timer stays armed across waits and only moves when it fires early (_on_timer) or a
        # shorter wait needs it sooner: a token costs no timer of its own
        if self._timer is None or self._timer.when() > self._deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(self._deadline, self._on_timer, timeout)
        self._waiter = w = loop.create_future()
        try:
            await w
        finally:
            self._waiter = None
        return self.queue.popleft()

    def _on_timer(self, timeout: float) -> None:
        self._timer = None
        if self.done:
            return
        loop = self.client._loop
        w = self._waiter
        if w is not None and not w.done() and loop.time() >= self._deadline:
            self._end()
            w.set_exception(ClientTimeout(f"no answer from {self.client.endpoint} within {timeout:g} s"))
        elif w is not None and not w.done():
            self._timer = loop.call_at(self._deadline, self._on_timer, timeout)

    def unread(self, msg: dict) -> None:
        """Give back the message the last __anext__ returned: the next one returns it again (a consumer
        that looked at the first reply before handing the request on)."""
        self._unread = msg

    def ready_chunks(self) -> list:
        """The `chunk` messages already waiting, without waiting (a consumer that fell behind sends
        them as one); the first message of another kind stays queued for the next __anext__."""
        out = []
        while self._back is None and self.queue:
            m = self.queue.popleft()
            if isinstance(m, dict) and m.get("type") == "chunk":
                out.append(m)
            else:
                self._back = m
        return out

    def _take(self, msg) -> dict:
        if isinstance(msg, BaseException):
            self._end()
            raise msg
        kind = msg.get("type")
        if self.rid is None:
            self.rid = msg.get("rid")
        if kind == "error":
            self._end()
            cls = BusyError if msg.get("code") == "busy" else ServerError
            raise cls(str(msg.get("code")), str(msg.get("message")), msg)
        if kind in _FINAL:
            self._end()
        return msg

    def _end(self, reuse=True):
        if not self.done:
            self.done = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.client._pending.pop(self.id, None)
            if self.owns_conn:
                self.client._release(self.conn, reuse)

    async def cancel(self) -> list:
        """Ask the server to stop this request (running: at the next token; queued: dropped). It goes
        over the request's own connection: the coordinator takes cancels from a request's owner."""
        if self.done or (self.rid is None and not self.quiet):
            return []
        try:
            r = await self.client.call("cancel", **self._which(), timeout=5.0, _conn=self.conn)
        except (ServerError, ClientTimeout, ServerGone):
            return []
        return r.get("cancelled", [])

    def _which(self) -> dict:
        """What a cancel names this request by: its rid, or before any reply to a quiet one its message id."""
        return {"rid": self.rid} if self.rid is not None else {"req_id": self.id}

    def abandon(self) -> None:
        """Stop listening, and cancel on the server without waiting (for a task being torn down)."""
        if not self.done:
            if self.rid is not None or self.quiet:
                try:
                    self.client._send_on(self.conn, {"op": "cancel", **self._which()}, next(self.client._ids))
                except (ClientTimeout, ServerGone):
                    pass
            # the connection can serve again: the leftover replies carry an id nobody waits for
            self._end()
            self._put(StopAsyncIteration())        # wakes a consumer waiting for the next message


class _Conn:
    """One DEALER socket, its file descriptor watched by the event loop."""

    def __init__(self, client: "AsyncClient", heartbeat_s: float | None = None):
        s = client._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 200)            # a last cancel still leaves when the socket closes
        if heartbeat_s:     # a server gone silent (its host died) shows as a disconnect within 3 beats
            s.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_s * 3000))
        s.setsockopt(zmq.MAXMSGSIZE, P.MAX_REPLY_BYTES)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.RCVHWM, 100_000)
        host = P.endpoint_host(client.endpoint)
        if host and ":" in host:
            s.setsockopt(zmq.IPV6, 1)
        _curve(s, *client._keys)
        s.connect(client.endpoint)
        self.sock, self.client = s, client
        self.fd, self.loop = s.getsockopt(zmq.FD), client._loop
        self.loop.add_reader(self.fd, self.drain)
        self.closed = False

    def drain(self):
        """Route every reply waiting. ZMQ's descriptor is edge-triggered (it turns readable when the
        socket's state changes), so this reads on while ZMQ_EVENTS says another message waits."""
        sock, route = self.sock, self.client._route
        for _ in range(4096):
            try:
                route(sock.recv(_NOBLOCK))
            except zmq.Again:                      # woken by a state change without a message
                return
            except zmq.ZMQError:                   # closed under us
                return
            # ask before reading on rather than recv until EAGAIN: pyzmq builds that exception
            # with its strerror text, which costs more than the message it ends
            if self.closed or not sock.getsockopt(_EVENTS) & _POLLIN:
                return
        self.loop.call_soon(self.drain)           # a flood: let the consumers run, then go on

    def send(self, data: bytes):
        try:
            self.sock.send(data, _NOBLOCK)
        except zmq.Again:
            raise ClientTimeout(f"cannot send to {self.client.endpoint} (no connection)") from None
        # libzmq may have taken the descriptor's edge for replies already waiting
        if self.sock.getsockopt(_EVENTS) & _POLLIN:
            self.loop.call_soon(self.drain)

    def close(self, linger=0):
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.fd)
            self.sock.close(linger)


class _ZmtpConn:
    """A request connection that speaks ZMTP on the event loop itself (kog_dist.zmtp: no libzmq I/O thread to
    wake on each message's way); for plain-TCP coordinators (CURVE ones get _Conn)."""

    def __init__(self, client: "AsyncClient", host: str, port: int):
        self.client, self.closed = client, False
        self.dealer = zmtp.Dealer(client._route, self._lost, P.MAX_REPLY_BYTES)
        self.dealer.open(client._loop, host, port)

    def send(self, data: bytes):
        try:
            self.dealer.send(data)
        except ConnectionError:
            raise ServerGone(f"the connection to {self.client.endpoint} is closed") from None

    def _lost(self, why: str):
        self.closed = True
        self.client._lost(self, why)

    def close(self, linger=0):
        if not self.closed:
            self.closed = True
            self.dealer.close()


class AsyncClient:
    """Connections to one coordinator, shared by any number of concurrent requests (one event loop).

    Every request in flight has a connection of its own, taken from a pool: the coordinator caps what
    one connection may hold (its share of the queue, its sessions), and a gateway carries many clients.
    """

    MAX_IDLE = 32

    def __init__(self, endpoint: str, timeout: float = 30.0, *, server_key=None, client_key=None):
        host = P.endpoint_host(endpoint)                # ValueError on a malformed endpoint
        self.endpoint, self.timeout = endpoint, float(timeout)
        self._keys = (server_key, client_key)
        # the requests' connections speak ZMTP themselves to a plain TCP coordinator; the main one (health,
        # the server's comings and goings through its monitor, heartbeats) stays on libzmq
        plain = host is not None and ";" not in endpoint and server_key is None and client_key is None
        self._tcp = (host, int(endpoint.rsplit(":", 1)[1])) if plain else None
        self._ctx = zmq.Context.instance()
        self._loop = None
        self._main = self._mon = None
        self._idle: list[_Conn] = []
        self._all: set[_Conn] = set()
        self._ids = itertools.count(1)
        self._pending: dict[int, AsyncRequest] = {}
        self.connected = False

    async def start(self) -> "AsyncClient":
        self._loop = asyncio.get_running_loop()
        self._main = _Conn(self, heartbeat_s=1.0)
        # connect/disconnect events of the main connection: when the server goes, every connection does
        self._mon = self._main.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._mon_fd = self._mon.getsockopt(zmq.FD)
        self._loop.add_reader(self._mon_fd, self._watch)
        self._loop.call_soon(self._watch)          # events queued before the descriptor was watched
        return self

    async def close(self) -> None:
        if self._main is not None:
            self._loop.remove_reader(self._mon_fd)
            self._main.sock.disable_monitor()
            self._mon.close(0)
            self._main.close()
            self._main = None
        for c in list(self._all):
            c.close()
        self._all.clear()
        self._idle.clear()
        self._fail_all(ServerGone("the client is closed"))

    # ------------------------------------------------------------------------------ plumbing
    def _route(self, data):
        try:
            msg = P.unpackb(data, P.MAX_REPLY_BYTES)
        except P.ProtocolError:
            return
        req = self._pending.get(msg.get("id"))
        if req is not None:
            req._put(msg)

    def _watch(self):
        mon = self._mon
        while mon is not None and not mon.closed:
            try:
                ev = parse_monitor_message(mon.recv_multipart(_NOBLOCK))
            except zmq.Again:
                if not mon.getsockopt(_EVENTS) & _POLLIN:
                    return
                continue
            if ev["event"] == zmq.EVENT_CONNECTED:
                self.connected = True
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                self.connected = False
                # the replies of requests sent on the old connections can never arrive
                self._fail_all(ServerGone(f"the server at {self.endpoint} closed the connection "
                                          f"(it stopped or crashed)"))

    def fail_pending(self, why: str) -> None:
        """Fail every request in flight with ServerGone(why) (the caller judged the server dead)."""
        self._fail_all(ServerGone(why))

    def _fail_all(self, exc):
        for req in list(self._pending.values()):
            req._put(exc)

    def _take(self) -> _Conn:
        if self._main is None:
            raise ServerGone("the client is closed")
        c = self._idle.pop() if self._idle else None
        if c is None:
            c = _ZmtpConn(self, *self._tcp) if self._tcp else _Conn(self)
            self._all.add(c)
        return c

    def _lost(self, conn, why: str):
        """A ZMTP connection closed (the server went, or a protocol error): its request fails now."""
        self._retire(conn)
        for req in list(self._pending.values()):
            if req.conn is conn:
                req._put(ServerGone(f"the connection to {self.endpoint} closed: {why}"))

    def _release(self, conn: _Conn, reuse: bool):
        if conn is self._main or conn not in self._all:
            return
        if reuse and len(self._idle) < self.MAX_IDLE:
            self._idle.append(conn)
        else:
            self._retire(conn)

    def _retire(self, conn: _Conn):
        if conn in self._all:
            self._all.discard(conn)
            if conn in self._idle:
                self._idle.remove(conn)
            conn.close(linger=200)

    def _send_on(self, conn, msg: dict, rid: int):
        conn.send(P.packb({"v": P.VERSION, "id": rid, **msg}))

    def request(self, msg: dict, _conn: _Conn | None = None) -> AsyncRequest:
        """Send a request now (on a connection of its own); iterate the AsyncRequest for its replies."""
        conn = _conn or self._take()
        rid = next(self._ids)
        req = AsyncRequest(self, rid, conn, owns_conn=_conn is None, quiet=bool(msg.get("quiet")))
        self._pending[rid] = req
        try:
            self._send_on(conn, msg, rid)
        except (ClientTimeout, ServerGone):
            req._end(reuse=False)
            raise
        return req

    async def call(self, op: str, timeout: float | None = None, _conn: _Conn | None = None, **fields) -> dict:
        """A one-reply op (health, stats, open, close, cancel, shutdown): the reply's fields."""
        if self._main is None:
            raise ServerGone("the client is closed")
        t = self.timeout if timeout is None else float(timeout)
        req = self.request({"op": op, **fields}, _conn=_conn or self._main)
        try:
            msg = req._take(await req._get(t))
        finally:
            req._end(reuse=False)
        for k in ("v", "id", "type"):
            msg.pop(k, None)
        return msg
