"""The coordinator on rank 0: a ZMQ ROUTER control plane in front of one executor (docs/protocol.md).

    coord = Coordinator("tcp://127.0.0.1:5555", executor, tokenizer, cfg, allow_remote=False,
                        curve_keys=None, queue_limit=8, session_ttl_s=600)   # ControlError: refused
    rc = coord.serve()   # 0 after SIGTERM/SIGINT or the shutdown op; 1 when the executor raised

`executor` has the Backend interface of docs/interfaces.md (run, num_slots, max_seq); serve() never
closes it. Call serve() from the main thread so it can take SIGTERM/SIGINT (drain and return 0) and
SIGUSR1 (MPICH hydra's word that a rank died); `check_endpoint` refuses a bad --control up front.

Threads: the socket loop (the thread that calls ``serve()``) owns the ROUTER socket, the queue, the
sessions and the slot table; one decode thread calls ``executor.run(cmd, on_token)`` for one request
at a time and hands tokens back through a lock-protected buffer plus an inproc wake-up socket. Every
executor call happens on the decode thread, so the executor needs no locking of its own.

Disconnects: the ROUTER is ROUTER_MANDATORY with ZMTP heartbeats (HEARTBEAT_IVL/TIMEOUT), so a
client whose connection is gone (closed, killed, or silent past the heartbeat timeout) makes the next
send to it fail with EHOSTUNREACH. The server sends to every running request at least every
``probe_s`` (token chunks when streaming, `progress` messages otherwise), so a vanished client's
decode is cancelled within one probe interval. No client-side heartbeat code is needed.
"""
from __future__ import annotations

import collections
import itertools
import os
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import zmq

from . import protocol as P
from .control_auth import ControlError, CurveKeys, check_endpoint  # noqa: F401 (re-exported)
from .protocol import ProtocolError
from .textstream import TextStream, find_stop  # noqa: F401


@dataclass(eq=False)
class _Req:
    rid: int
    ident: bytes
    envelope: list
    req_id: object
    op: str                      # generate | append
    params: dict
    new_ids: list
    text_prompt: bool
    session: object = None
    t_accept: float = field(default_factory=time.monotonic)
    position: int = 0
    cancel_reason: str | None = None   # set by the socket loop; read by on_token
    gone: bool = False
    # filled while running
    ctx: list = None
    slot: int = -1
    keep: int = 0
    evicted: bool = False
    t_start: float = 0.0
    t_first: float = 0.0
    n_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    pend_ids: list = field(default_factory=list)
    pend_text: str = ""
    text: object = None
    sent_text: str = ""
    last_sent: float = 0.0


@dataclass(eq=False)
class _Session:
    sid: str
    ttl_s: float
    ids: list = field(default_factory=list)
    slot: int | None = None
    last_used: float = field(default_factory=time.monotonic)
    pending: int = 0
    evictions: int = 0


@dataclass(eq=False)
class _Slot:
    tokens: list = field(default_factory=list)
    owner: object = None         # a _Session or None
    last_used: float = 0.0


def _lcp(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _pct(values) -> dict:
    v = sorted(values)
    if not v:
        return {"n": 0}
    at = lambda q: v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]
    return {"n": len(v), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": v[-1]}


class Coordinator:
    """Serve one executor (``run``, ``num_slots``, ``max_seq``) on a ZMQ ROUTER socket."""

    def __init__(self, endpoint, executor, tokenizer, cfg, *, allow_remote=False, curve_keys=None,
                 queue_limit=8, session_ttl_s=600.0, max_sessions=256, probe_s=0.5,
                 heartbeat_s=1.0, shutdown_grace_s=0.0, handle_signals=True,
                 max_frame_bytes=P.MAX_FRAME_BYTES, log=None):
        if isinstance(curve_keys, (tuple, list)):
            curve_keys = CurveKeys(*curve_keys)
        check_endpoint(endpoint, allow_remote, curve_keys)
        self.endpoint, self.executor, self.tokenizer, self.cfg = endpoint, executor, tokenizer, cfg
        self.curve_keys, self.queue_limit, self.session_ttl_s = curve_keys, int(queue_limit), float(session_ttl_s)
        self.max_sessions, self.probe_s, self.heartbeat_s = max_sessions, probe_s, heartbeat_s
        self.shutdown_grace_s, self.handle_signals = shutdown_grace_s, handle_signals
        self.max_frame_bytes = max_frame_bytes
        self.log = log or (lambda msg: print(f"[coordinator] {msg}", file=sys.stderr, flush=True))
        self.vocab = getattr(cfg, "vocab_size", None)
        self.max_seq = int(executor.max_seq)
        self.eos = set(getattr(tokenizer, "eos_ids", ()) or ()) | set(getattr(cfg, "eos_token_ids", ()) or ())
        self.bos = getattr(tokenizer, "bos_id", None)
        self.slots = [_Slot() for _ in range(int(executor.num_slots))]
        self.sessions: dict[str, _Session] = {}
        self.queue: collections.deque[_Req] = collections.deque()
        self.active: _Req | None = None
        self.rids = itertools.count(1)
        self.done_events = collections.deque()      # ("done", req, result) | ("failed", req, exc)
        self.jobs = collections.deque()
        self.jobs_cv = threading.Condition()
        self.draining = False
        self.exit_code = None
        self.drain_deadline = None
        self.peer_failed_at = None
        self.signalled = None
        self.t0 = time.monotonic()
        self.counts = collections.Counter()
        self.hist = {k: collections.deque(maxlen=1024) for k in ("prefill_ms", "ttft_ms", "decode_tokens_per_s")}
        self.ctx = zmq.Context()
        self.sock = self.wake_rx = self.auth = None
        self.bound = None
        self._wake_addr = f"inproc://kog-wake-{id(self)}"

    # ------------------------------------------------------------------------------ lifecycle
    def _open_sockets(self):
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.RCVHWM, 10_000)
        s.setsockopt(zmq.MAXMSGSIZE, P.HARD_FRAME_BYTES)
        s.setsockopt(zmq.HEARTBEAT_IVL, int(self.heartbeat_s * 1000))
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.heartbeat_s * 3000))
        s.setsockopt(zmq.HEARTBEAT_TTL, int(self.heartbeat_s * 3000))
        host = P.endpoint_host(self.endpoint)
        if host and ":" in host:
            s.setsockopt(zmq.IPV6, 1)
        if self.curve_keys is not None:
            from zmq.auth import load_certificate
            from zmq.auth.thread import ThreadAuthenticator
            try:
                public, secret = load_certificate(self.curve_keys.server_secret_file)
            except Exception as e:
                raise ControlError(f"cannot read CURVE server key {self.curve_keys.server_secret_file}: {e}") from None
            if not secret:
                raise ControlError(f"{self.curve_keys.server_secret_file} holds no secret key")
            self.auth = ThreadAuthenticator(self.ctx)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=self.curve_keys.clients_dir)
            s.curve_publickey, s.curve_secretkey, s.curve_server = public, secret, True
        try:
            s.bind(self.endpoint)
        except zmq.ZMQError as e:
            s.close(0)
            raise ControlError(f"cannot bind {self.endpoint}: {e}") from None
        self.sock = s
        self.bound = s.getsockopt_string(zmq.LAST_ENDPOINT)
        self.wake_rx = self.ctx.socket(zmq.PULL)
        self.wake_rx.bind(self._wake_addr)

    def serve(self) -> int:
        """Serve until shutdown (op or SIGTERM: 0) or executor failure (1). Never closes the executor."""
        self._open_sockets()
        old = {}
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                old[sig] = signal.signal(sig, self._on_signal)
            # MPICH hydra with -disable-auto-cleanup SIGUSR1s the survivors when a rank dies; its
            # default action would kill rank 0 before it can answer the pending requests.
            old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_peer_signal)
        thread = threading.Thread(target=self._decode_loop, name="kog-decode", daemon=True)
        thread.start()
        self.log(f"serving on {self.bound} (slots {len(self.slots)}, max_seq {self.max_seq}, "
                 f"queue {self.queue_limit}{', CURVE' if self.curve_keys else ''})")
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.wake_rx, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(int(self.probe_s * 400)))
                if self.wake_rx in ready:
                    while self.wake_rx.poll(0):
                        self.wake_rx.recv(zmq.NOBLOCK)
                self._pump_active()
                self._pump_done()
                if self.exit_code == 1:
                    break
                if self.sock in ready:
                    for _ in range(256):
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_frames(frames)
                self._housekeeping()
                if self.exit_code == 1 or (self.draining and self.active is None):
                    break
        finally:
            with self.jobs_cv:
                self.jobs.append(None)
                self.jobs_cv.notify()
            if self.exit_code != 1:
                thread.join(timeout=10)
            for sig, h in old.items():
                signal.signal(sig, h)
            self.sock.close(linger=1000)        # flush the last replies (errors, results)
            self.wake_rx.close(0)
            if self.auth is not None:
                self.auth.stop()
            if not thread.is_alive():
                self.ctx.term()
        self.log(f"stopped (exit {self.exit_code or 0})")
        return self.exit_code or 0

    def _on_signal(self, signum, frame):
        self.signalled = signum                  # acted on by the loop, never inside the handler

    def _on_peer_signal(self, signum, frame):
        self.peer_failed_at = self.peer_failed_at or time.monotonic()

    def _begin_shutdown(self, why):
        if self.draining:
            return
        self.log(f"shutting down ({why})")
        self.draining, self.exit_code = True, 0
        while self.queue:
            r = self.queue.popleft()
            self._fail(r, "shutting_down", "the server is shutting down")
        if self.active is not None:
            if self.shutdown_grace_s > 0:
                self.drain_deadline = time.monotonic() + self.shutdown_grace_s
            else:
                self.active.cancel_reason = "shutdown"

    # ------------------------------------------------------------------------------ decode thread
    def _decode_loop(self):
        wake = self.ctx.socket(zmq.PUSH)
        wake.setsockopt(zmq.LINGER, 0)
        wake.connect(self._wake_addr)

        def kick():
            try:
                wake.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        try:
            while True:
                with self.jobs_cv:
                    while not self.jobs:
                        self.jobs_cv.wait()
                    job = self.jobs.popleft()
                if job is None:
                    return
                req, cmd = job
                streaming = bool(req.params.get("stream"))   # otherwise the loop wakes on its own timer

                def on_token(t, req=req, streaming=streaming):
                    now = time.monotonic()
                    hit = req.text.feed(int(t))       # every token the backend returns is streamed
                    with req.lock:
                        if req.n_tokens == 0:
                            req.t_first = now
                        req.n_tokens += 1
                        req.pend_ids.append(int(t))
                        req.pend_text += req.text.take()
                        wake = streaming and len(req.pend_ids) == 1   # the loop has not been told yet
                    if wake:
                        kick()
                    if req.cancel_reason is not None:
                        return False
                    if hit:
                        req.cancel_reason = "stop"
                    return not hit
                try:
                    res = self.executor.run(cmd, on_token)
                    self.done_events.append(("done", req, res))
                except ValueError as e:      # the backend refused the command before running it
                    self.done_events.append(("rejected", req, e))
                except BaseException as e:   # a rank died, or the backend broke: fatal
                    self.done_events.append(("failed", req, e))
                    kick()
                    return
                kick()
        finally:
            wake.close(0)

    # ------------------------------------------------------------------------------ sending
    def _send(self, ident, envelope, msg) -> bool:
        """Send one message; False when the peer is gone (EHOSTUNREACH) or not reading (EAGAIN)."""
        try:
            self.sock.send_multipart([ident, *envelope, P.packb(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise

    def _reply(self, req: _Req, msg) -> bool:
        if req.gone:
            return False
        msg = {"v": P.VERSION, **msg, "rid": req.rid}
        if req.req_id is not None:
            msg["id"] = req.req_id
        if not self._send(req.ident, req.envelope, msg):
            self._lost(req)
            return False
        req.last_sent = time.monotonic()
        return True

    def _lost(self, req: _Req):
        """The client of `req` is gone: cancel its decode or drop it from the queue."""
        if req.gone:
            return
        req.gone = True
        self.counts["disconnected"] += 1
        if req is self.active:
            req.cancel_reason = req.cancel_reason or "disconnect"
            self.log(f"client of request {req.rid} disconnected; cancelling its decode")
        elif req in self.queue:
            self.queue.remove(req)
            self._release(req)

    def _fail(self, req: _Req, code, message):
        self.counts["errors"] += 1
        self._reply(req, P.error_reply(code, message))
        self._release(req)

    def _release(self, req: _Req):
        if req.session is not None and req.session.pending > 0 and req is not self.active:
            req.session.pending -= 1
            req.session.last_used = time.monotonic()

    # ------------------------------------------------------------------------------ incoming
    def _on_frames(self, frames):
        ident = frames[0].bytes
        if len(frames) < 2:                      # nothing but a routing id: nothing to answer
            self.counts["dropped"] += 1
            return
        if len(frames) > P.MAX_FRAMES + 1 or any(len(f) for f in frames[1:-1]):
            self.counts["bad_requests"] += 1
            self._send(ident, [], P.error_reply("bad_request", f"a request is one msgpack frame (optionally "
                                                               f"after empty delimiters), got {len(frames) - 1}"))
            return
        envelope, payload = [b""] * (len(frames) - 2), frames[-1]
        req_id = None
        try:
            msg = P.unpackb(payload.buffer, self.max_frame_bytes)
            req_id = P.request_id(msg)
            req = P.parse_request(msg)
            self._on_request(ident, envelope, req, payload)
        except ProtocolError as e:
            self.counts["bad_requests"] += 1
            self._send(ident, envelope, P.error_reply(e.code, e.message, req_id))
        except Exception as e:                   # a bug must not take the server down
            self.counts["internal_errors"] += 1
            self.log(f"internal error on a request: {type(e).__name__}: {e}")
            self._send(ident, envelope, P.error_reply("internal", f"{type(e).__name__}: {e}"[:200], req_id))

    def _ok(self, ident, envelope, req, **fields):
        msg = {"v": P.VERSION, "type": "ok", **fields}
        if req["id"] is not None:
            msg["id"] = req["id"]
        self._send(ident, envelope, msg)

    def _trusted(self, frame) -> bool:
        if self.curve_keys is not None or P.endpoint_host(self.endpoint) is None:
            return True
        try:
            peer = frame.get("Peer-Address")
        except Exception:
            return False
        return P.is_loopback(f"tcp://{peer}:0") if peer else False

    def _on_request(self, ident, envelope, req, frame):
        op = req["op"]
        if op == "health":
            return self._ok(ident, envelope, req, **self.health())
        if op == "stats":
            return self._ok(ident, envelope, req, **self.stats())
        if self.draining:
            raise ProtocolError("shutting_down", "the server is shutting down")
        if op == "shutdown":
            if not self._trusted(frame):
                raise ProtocolError("forbidden", "shutdown is only accepted from loopback or authenticated clients")
            self._ok(ident, envelope, req, shutting_down=True)
            return self._begin_shutdown("shutdown op")
        if op == "open":
            self._expire_sessions()
            if len(self.sessions) >= self.max_sessions:
                raise ProtocolError("too_many_sessions",
                                    f"{len(self.sessions)} sessions are open (limit {self.max_sessions})")
            s = _Session(secrets.token_hex(8), req.get("ttl_s", self.session_ttl_s))
            self.sessions[s.sid] = s
            self.counts["sessions_opened"] += 1
            return self._ok(ident, envelope, req, session=s.sid, ttl_s=s.ttl_s)
        if op == "close":
            s = self._session(req["session"])
            cancelled = self._cancel(lambda r: r.session is s)
            del self.sessions[s.sid]
            if s.slot is not None and self.slots[s.slot].owner is s:
                self.slots[s.slot].owner = None
            return self._ok(ident, envelope, req, closed=s.sid, cancelled=cancelled)
        if op == "cancel":
            if "rid" in req:
                pick = lambda r: r.rid == req["rid"]
            elif "session" in req:
                s = self._session(req["session"])
                pick = lambda r: r.session is s
            else:
                pick = lambda r: r is self.active
            return self._ok(ident, envelope, req, cancelled=self._cancel(pick))
        self._accept(ident, envelope, req)

    def _session(self, sid) -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            raise ProtocolError("no_session", f"no session {sid[:40]!r} (unknown, closed or expired)")
        return s

    def _cancel(self, pick) -> list:
        out = []
        if self.active is not None and pick(self.active):
            self.active.cancel_reason = self.active.cancel_reason or "cancel"
            out.append(self.active.rid)
        for r in [r for r in self.queue if pick(r)]:
            self.queue.remove(r)
            out.append(r.rid)
            self.counts["cancelled"] += 1
            self._fail(r, "cancelled", "cancelled before it started")
        if len(out) > (self.active is not None and pick(self.active)):
            self._send_positions()
        return out

    def _accept(self, ident, envelope, req):
        session = self._session(req["session"]) if "session" in req else None
        text_prompt = "prompt" in req
        if text_prompt:
            try:
                new_ids = [int(t) for t in _encode(self.tokenizer, req["prompt"])]
            except ValueError as e:
                raise ProtocolError("bad_request", f"cannot tokenize the prompt: {e}"[:200]) from None
        else:
            new_ids = req.get("prompt_ids", [])
        if self.vocab is not None and any(t >= self.vocab for t in new_ids):
            raise ProtocolError("bad_request", f"prompt_ids hold an id >= vocab_size {self.vocab}")
        if self.vocab is not None and any(t >= self.vocab for t in req.get("stop_ids", ())):
            raise ProtocolError("bad_request", f"stop_ids hold an id >= vocab_size {self.vocab}")
        if session is None and len(new_ids) + (text_prompt and req.get("add_bos", True)) > self.max_seq:
            raise ProtocolError("context_overflow",
                                f"the prompt of {len(new_ids)} tokens does not fit max_seq {self.max_seq}")
        if session is None and not new_ids and not (text_prompt and req.get("add_bos", True) and self.bos is not None):
            raise ProtocolError("bad_request", "the prompt is empty")
        busy = self.active is not None or bool(self.queue)
        if busy and len(self.queue) >= self.queue_limit:
            self.counts["busy"] += 1
            raise ProtocolError("busy", f"a decode is running and {len(self.queue)} requests are queued "
                                        f"(limit {self.queue_limit})")
        r = _Req(next(self.rids), ident, envelope, req["id"], req["op"], req, new_ids, text_prompt, session)
        if session is not None:
            session.pending += 1
            session.last_used = time.monotonic()
        self.queue.append(r)
        r.position = len(self.queue) if busy else 0
        self._reply(r, {"type": "accepted", "position": r.position})
        self._dispatch()

    def _send_positions(self):
        for i, r in enumerate(list(self.queue), start=1):
            if r.position != i:
                r.position = i
                self._reply(r, {"type": "queued", "position": i})

    # ------------------------------------------------------------------------------ running
    def _dispatch(self):
        while self.active is None and self.queue and not self.draining:
            r = self.queue[0]
            if r.position > 0 and not self._reply(r, {"type": "queued", "position": 0}):
                continue                         # gone: _lost took it off the queue
            self.queue.popleft()
            s, new = r.session, list(r.new_ids)
            base = s.ids if s is not None else []
            if (r.text_prompt and r.params.get("add_bos", True) and not base and self.bos is not None
                    and (not new or new[0] != self.bos)):
                new = [self.bos] + new
            ctx = base + new
            max_new = r.params["max_new_tokens"] if r.op == "generate" else 0
            if len(ctx) > self.max_seq:
                self._fail(r, "context_overflow",
                           f"the context of {len(ctx)} tokens does not fit max_seq {self.max_seq}")
                continue
            if not ctx:
                self._fail(r, "bad_request", "the context is empty: append or give a prompt first")
                continue
            max_new = min(max_new, self.max_seq - len(ctx))
            r.evicted = bool(s is not None and s.ids and s.slot is None)
            r.slot = self._take_slot(ctx, s)
            keep = _lcp(self.slots[r.slot].tokens, ctx)
            r.keep = min(keep, len(ctx) - 1) if max_new > 0 else keep
            r.ctx, r.t_start, self.active = ctx, time.monotonic(), r
            stop_ids = tuple(r.params.get("stop_ids", ()))
            r.text = TextStream(self.tokenizer, r.params.get("stop", []), self.eos | set(stop_ids))
            if r.keep == len(ctx):               # an append of what the slot already holds
                self._finish(r, None)
                continue
            self.slots[r.slot].tokens = ctx[:r.keep]
            cmd = _make_command(slot=r.slot, keep=r.keep, append=ctx[r.keep:], max_new_tokens=max_new,
                                params=r.params, stop_ids=stop_ids)
            with self.jobs_cv:
                self.jobs.append((r, cmd))
                self.jobs_cv.notify()
        self._send_positions()

    def _take_slot(self, ctx, s) -> int:
        """The session's own slot, else the free slot sharing the longest prefix with ctx (LRU on
        ties), else the least recently used session's slot, which that session loses (evicted)."""
        now = time.monotonic()
        if s is not None and s.slot is not None and self.slots[s.slot].owner is s:
            idx = s.slot
        else:
            free = [i for i, sl in enumerate(self.slots) if sl.owner is None]
            if free:
                idx = max(free, key=lambda i: (_lcp(self.slots[i].tokens, ctx), -self.slots[i].last_used))
            else:
                idx = min(range(len(self.slots)), key=lambda i: self.slots[i].owner.last_used)
                victim = self.slots[idx].owner
                victim.slot = None
                victim.evictions += 1
                self.counts["evictions"] += 1
                self.log(f"slot {idx} evicted from session {victim.sid} (LRU)")
            self.slots[idx].owner = s
            if s is not None:
                s.slot = idx
        self.slots[idx].last_used = now
        return idx

    def _pump_active(self):
        r, now = self.active, time.monotonic()
        if r is None:
            return
        if self.drain_deadline is not None and now > self.drain_deadline:
            r.cancel_reason = r.cancel_reason or "shutdown"
        with r.lock:
            ids, text, n = r.pend_ids, r.pend_text, r.n_tokens
            r.pend_ids, r.pend_text = [], ""
        if ids and r.params.get("stream"):
            r.sent_text += text
            self._reply(r, {"type": "chunk", "token_ids": ids, "text": text})
        elif now - r.last_sent >= self.probe_s:
            self._reply(r, {"type": "progress", "tokens": n})

    def _pump_done(self):
        while self.done_events:
            kind, r, x = self.done_events.popleft()
            if kind == "failed":
                return self._backend_failed(r, x)
            if kind == "rejected":
                self.log(f"the backend refused request {r.rid}: {x}")
                self.active, self.slots[r.slot].tokens = None, []
                self._fail(r, "bad_request", f"refused by the backend: {x}"[:300])
                continue
            self._finish(r, x)
        self._dispatch()

    def _finish(self, r: _Req, res):
        now = time.monotonic()
        self.active = None
        with r.lock:
            pend = r.pend_ids
            r.pend_ids, r.pend_text = [], ""
        tokens = [int(t) for t in res.token_ids] if res is not None else []
        after = r.ctx + tokens
        cached = min(int(res.cached), len(after)) if res is not None else len(r.ctx)
        sl = self.slots[r.slot]
        sl.tokens, sl.last_used = after[:cached], now
        s = r.session
        if s is not None:
            s.pending = max(0, s.pending - 1)
            s.last_used = now
            if self.sessions.get(s.sid) is s:
                s.ids = after
        reason = res.stop_reason if res is not None else "length"
        if reason == "cancel" and r.cancel_reason == "stop":
            reason = "stop"
        elif reason == "none":                   # the backend's word for max_new_tokens == 0
            reason = "length"
        body = tokens
        if reason in ("eos", "stop") and tokens and tokens[-1] in r.text.terminal:
            body = tokens[:-1]
        text = self.tokenizer.decode(body) if body else ""
        hit = find_stop(text, r.params.get("stop", []))
        if hit is not None:
            text, reason = text[:hit], "stop"
        if r.op == "append":
            reason = "append"
        n = len(tokens)
        decode_ms = float(res.decode_ms) if res is not None else 0.0
        st = {"prefill_tokens": int(res.prefill_tokens) if res is not None else 0, "reused_tokens": r.keep,
              "cached": cached, "context": len(after), "new_tokens": n,
              "prefill_ms": float(res.prefill_ms) if res is not None else 0.0,
              "first_token_ms": float(res.first_token_ms) if res is not None else 0.0,
              "ttft_ms": (r.t_first - r.t_start) * 1000 if n else 0.0, "decode_ms": decode_ms,
              "decode_tokens_per_s": (n - 1) * 1000 / decode_ms if n > 1 and decode_ms > 0 else 0.0,
              "queue_ms": (r.t_start - r.t_accept) * 1000, "total_ms": (now - r.t_accept) * 1000,
              "slot": r.slot, "evicted": r.evicted}
        self._record(st, reason)
        if r.params.get("stream") and not r.gone:
            rest = text[len(r.sent_text):] if text.startswith(r.sent_text) else ""
            if pend or rest:
                self._reply(r, {"type": "chunk", "token_ids": pend, "text": rest})
        out = {"type": "result", "token_ids": tokens, "text": text, "stop_reason": reason, "stats": st}
        if r.cancel_reason and reason == "cancel":
            out["cancel_reason"] = r.cancel_reason
        if s is not None:
            out["session"] = s.sid
        self._reply(r, out)

    def _record(self, st, reason):
        c = self.counts
        c["served"] += 1
        c["cancelled"] += reason == "cancel"
        c["tokens_generated"] += st["new_tokens"]
        c["prefill_tokens"] += st["prefill_tokens"]
        c["reused_tokens"] += st["reused_tokens"]
        if st["prefill_tokens"]:
            self.hist["prefill_ms"].append(st["prefill_ms"])
        if st["new_tokens"]:
            self.hist["ttft_ms"].append(st["ttft_ms"])
        if st["new_tokens"] > 1:
            self.hist["decode_tokens_per_s"].append(st["decode_tokens_per_s"])

    def _backend_failed(self, r, exc):
        msg = f"the ranks failed: {type(exc).__name__}: {exc}"[:300]
        self.log(msg + "; failing every pending request and exiting")
        self.exit_code, self.draining, self.active = 1, True, None
        if r is not None:
            self._fail(r, "backend_failed", msg)
        while self.queue:
            self._fail(self.queue.popleft(), "backend_failed", msg)

    # ------------------------------------------------------------------------------ upkeep
    def _housekeeping(self):
        now = time.monotonic()
        if self.signalled is not None and not self.draining:
            self._begin_shutdown(f"signal {self.signalled}")
        if self.peer_failed_at is not None and self.exit_code != 1:
            # a rank died (hydra's SIGUSR1): a running decode fails by itself (PeerLost); an idle job,
            # or a decode still stuck after 10 s, is failed here
            if self.active is None or now - self.peer_failed_at > 10.0:
                self._backend_failed(self.active, RuntimeError("the launcher reported a failed rank (SIGUSR1)"))
        if now - getattr(self, "_last_expiry", 0.0) >= 1.0:
            self._last_expiry = now
            self._expire_sessions()

    def _expire_sessions(self):
        now = time.monotonic()
        for s in [s for s in self.sessions.values() if not s.pending and now - s.last_used > s.ttl_s]:
            del self.sessions[s.sid]
            self.counts["sessions_expired"] += 1
            if s.slot is not None and self.slots[s.slot].owner is s:
                self.slots[s.slot].owner = None

    def health(self) -> dict:
        return {"status": "draining" if self.draining else "ok", "protocol": P.VERSION,
                "uptime_s": time.monotonic() - self.t0, "active": self.active.rid if self.active else None,
                "queue": len(self.queue), "queue_limit": self.queue_limit, "sessions": len(self.sessions),
                "num_slots": len(self.slots), "max_seq": self.max_seq, "vocab_size": self.vocab}

    def stats(self) -> dict:
        c = self.counts
        return {"uptime_s": time.monotonic() - self.t0,
                "requests": {k: c[k] for k in ("served", "cancelled", "errors", "busy", "bad_requests",
                                               "disconnected", "dropped", "internal_errors")},
                "tokens_generated": c["tokens_generated"], "prefill_tokens": c["prefill_tokens"],
                "reused_tokens": c["reused_tokens"],
                **{k: _pct(v) for k, v in self.hist.items()},
                "queue_length": len(self.queue), "queue_limit": self.queue_limit,
                "active": self.active.rid if self.active else None,
                "sessions": {"open": len(self.sessions), "opened": c["sessions_opened"],
                             "expired": c["sessions_expired"]},
                "slots": {"num_slots": len(self.slots),
                          "held_by_sessions": sum(sl.owner is not None for sl in self.slots),
                          "evictions": c["evictions"]}}


def _encode(tokenizer, text):
    """Token ids of text without BOS (the coordinator adds BOS at the start of a context only)."""
    try:
        return tokenizer.encode(text, add_bos=False)
    except TypeError:
        ids = list(tokenizer.encode(text))
        return ids[1:] if ids and ids[0] == getattr(tokenizer, "bos_id", None) else ids


def _make_command(*, slot, keep, append, max_new_tokens, params, stop_ids):
    from workers.backend import RunCommand
    from kog_dist.sampling import SamplingParams
    sp = SamplingParams(temperature=params.get("temperature", 0.0), top_k=params.get("top_k", 0),
                        top_p=params.get("top_p", 1.0), seed=params.get("seed", 0))
    return RunCommand(slot=slot, keep=keep, append=list(append), max_new_tokens=max_new_tokens,
                      sampling=sp, stop_ids=tuple(stop_ids))
