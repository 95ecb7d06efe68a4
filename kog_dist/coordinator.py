"""The coordinator on rank 0: a ZMQ ROUTER control plane in front of one executor (docs/protocol.md).

    coord = Coordinator("tcp://127.0.0.1:5555", executor, tokenizer, cfg, allow_remote=False,
                        curve_keys=None, queue_limit=8, session_ttl_s=600,
                        session_ttl_max_s=600, max_client_sessions=8)   # ControlError: refused
    rc = coord.serve()   # 0 after SIGTERM/SIGINT or the shutdown op; 1 when the executor raised

`executor` has the Backend interface of docs/interfaces.md (run, num_slots, max_seq); serve() never
closes it. Call serve() from the main thread so it can take SIGTERM/SIGINT (drain and return 0) and
SIGUSR1 (MPICH hydra's word that a rank died); `check_endpoint` refuses a bad --control up front.
An executor with ``check_peers()`` (workers.rank.RankGroup: the ranks' heartbeats) is asked every
``peer_check_s`` from the socket loop; when it raises, the job has failed (a frozen rank), whatever the
decode thread is doing.

Who may do what (docs/protocol.md): requests and sessions belong to the connection that made them, or
to the owner token it sent (a client's other connections); only they may cancel or close them. A
client holds at most ``queue_share`` queue places (default half the queue; a gateway that is the
only client may be given all) and ``max_client_sessions`` sessions. `shutdown`
needs the secret this server writes 0600 into the runtime directory (control_auth.write_secret), or
a CURVE-authenticated client.

This file holds the ROUTER socket loop, signals, the decode thread, and parsing and sending messages;
the request queue, sessions and KV-slot table are ``kog_dist.scheduler.Scheduler``, which Coordinator
extends (CURVE keys and endpoint checks: ``kog_dist.control_auth``; all re-exported here).

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
import secrets
import signal
import sys
import threading
import time

import zmq
from zmq.auth import load_certificate

from . import protocol as P
from .control_auth import (ControlError, CurveKeys, check_endpoint, remove_secret,  # noqa: F401 (re-exported)
                           secret_matches, write_secret)
from .protocol import ProtocolError
from .scheduler import (Scheduler, _encode, _lcp, _make_command, _owner_key, _pct, _Req,  # noqa: F401
                        _Session, _Slot)
from .textstream import TextStream, find_stop  # noqa: F401

SWITCH_INTERVAL_S = 1e-4    # the GIL's switch interval while serving (serve() says why)
_serving = {"count": 0, "saved": None}      # coordinators serving in this process; the interval before the first
_serving_lock = threading.Lock()


def _lower_switch_interval():
    with _serving_lock:
        if _serving["count"] == 0:
            _serving["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_serving["saved"], SWITCH_INTERVAL_S))
        _serving["count"] += 1


def _restore_switch_interval():
    with _serving_lock:
        _serving["count"] -= 1
        if _serving["count"] == 0:
            sys.setswitchinterval(_serving["saved"])


class Coordinator(Scheduler):
    """Serve one executor (``run``, ``num_slots``, ``max_seq``) on a ZMQ ROUTER socket."""

    def __init__(self, endpoint, executor, tokenizer, cfg, *, allow_remote=False, curve_keys=None,
                 queue_limit=8, session_ttl_s=600.0, session_ttl_max_s=600.0, max_sessions=256,
                 max_client_sessions=8, queue_share=None, probe_s=0.5, heartbeat_s=1.0, peer_check_s=0.25,
                 shutdown_grace_s=0.0, handle_signals=True, max_frame_bytes=P.MAX_FRAME_BYTES, log=None,
                 speculative=0):
        if isinstance(curve_keys, (tuple, list)):
            curve_keys = CurveKeys(*curve_keys)
        check_endpoint(endpoint, allow_remote, curve_keys)
        self.endpoint, self.executor, self.tokenizer, self.cfg = endpoint, executor, tokenizer, cfg
        self.curve_keys, self.probe_s, self.heartbeat_s = curve_keys, probe_s, heartbeat_s
        self.shutdown_grace_s, self.handle_signals = shutdown_grace_s, handle_signals
        self.max_frame_bytes = max_frame_bytes
        self.log = log or (lambda msg: print(f"[coordinator] {msg}", file=sys.stderr, flush=True))
        self._init_book(executor, tokenizer, cfg, queue_limit=queue_limit, session_ttl_s=session_ttl_s,
                        max_sessions=max_sessions, max_client_sessions=max_client_sessions,
                        session_ttl_max_s=session_ttl_max_s, queue_share=queue_share, speculative=speculative)
        self.peer_check_s, self._next_peer_check = peer_check_s, 0.0
        self.secret_path = self.secret = None
        self.done_events = collections.deque()      # ("done", req, result) | ("failed", req, exc)
        self.jobs = collections.deque()
        self.jobs_cv = threading.Condition()
        self.draining = False
        self.exit_code = None
        self.drain_deadline = None
        self.peer_failed_at = None
        self.signalled = None
        self.shutdown_why = None                 # request_shutdown's reason (another thread's)
        self.t0 = time.monotonic()
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
            try:
                public, secret = load_certificate(self.curve_keys.server_secret_file)
            except Exception as e:
                raise ControlError(f"cannot read CURVE server key {self.curve_keys.server_secret_file}: {e}") from None
            if not secret:
                raise ControlError(f"{self.curve_keys.server_secret_file} holds no secret key")
            # here, not at the top: zmq.auth.thread loads asyncio (~50 modules, 20-70 ms at every rank's
            # start), and only a CURVE server needs it
            from zmq.auth.thread import ThreadAuthenticator
            self.auth = ThreadAuthenticator(self.ctx)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=self.curve_keys.clients_dir)
            s.curve_publickey, s.curve_secretkey, s.curve_server = public, secret, True
        try:
            s.bind(self.endpoint)
        except zmq.ZMQError as e:
            s.close(0)
            raise ControlError(f"cannot bind {self.endpoint}: {e}") from None
        try:
            self.secret_path, self.secret = write_secret(s.getsockopt_string(zmq.LAST_ENDPOINT))
        except ControlError as e:   # serve anyway: only the shutdown op is lost (SIGTERM still works)
            self.log(f"{e}; the shutdown op is refused to every client but CURVE ones")
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
        # The decode thread holds the GIL while it busy-polls the GPU's token ring (and between the CPU
        # backend's BLAS calls); this loop, woken for each token, then waited up to the default 5 ms switch
        # interval for it, so tokens reached clients 0-5 ms late and in bursts (TTFT in 5 ms steps on the
        # H200). At 0.1 ms the loop gets the GIL within a tenth of a GPU token.
        _lower_switch_interval()
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
            _restore_switch_interval()
            self.sock.close(linger=1000)        # flush the last replies (errors, results)
            self.wake_rx.close(0)
            if self.secret_path:
                remove_secret(self.secret_path, self.secret)
            if self.auth is not None:
                self.auth.stop()
            if not thread.is_alive():
                self.ctx.term()
            else:   # the decode thread is stuck on a frozen rank: close its wake-up socket under it and
                # wait (up to the ROUTER's linger) for the last replies to leave before the process does
                self.ctx.destroy(linger=0)
        self.log(f"stopped (exit {self.exit_code or 0})")
        return self.exit_code or 0

    def request_shutdown(self, why: str = "requested") -> None:
        """Ask a serving loop running in another thread to shut down as on SIGTERM (it acts within a poll
        interval). The loop's sockets are its own: calling _begin_shutdown from another thread sent on the
        ROUTER from two threads at once (a zmq socket is not thread-safe: it crashed the process)."""
        self.shutdown_why = why

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

    def _submit(self, req: _Req, cmd):
        """Hand one RunCommand to the decode thread (called by _dispatch)."""
        with self.jobs_cv:
            self.jobs.append((req, cmd))
            self.jobs_cv.notify()

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

    def _may_shut_down(self, req) -> bool:
        # with CURVE every connected client passed the authenticator; otherwise the secret decides
        # (loopback is no credential: any local user can reach it)
        return self.curve_keys is not None or secret_matches(req.get("secret"), self.secret)

    def _on_request(self, ident, envelope, req, frame):
        op = req["op"]
        if op == "health":
            return self._ok(ident, envelope, req, **self.health())
        if op == "stats":
            return self._ok(ident, envelope, req, **self.stats())
        if self.draining:
            raise ProtocolError("shutting_down", "the server is shutting down")
        if op == "shutdown":
            if not self._may_shut_down(req):
                where = (f"kog client shutdown reads it from {self.secret_path}, as the same user"
                         if self.secret_path else "this server could not write one")
                raise ProtocolError("forbidden", f"shutdown needs this server's secret ({where}) or a CURVE client")
            self._ok(ident, envelope, req, shutting_down=True)
            return self._begin_shutdown("shutdown op")
        if op == "open":
            self._expire_sessions()
            if len(self.sessions) >= self.max_sessions:
                raise ProtocolError("too_many_sessions",
                                    f"{len(self.sessions)} sessions are open (limit {self.max_sessions})")
            if self._owned(self.sessions.values(), ident, req) >= self.max_client_sessions:
                raise ProtocolError("too_many_sessions", f"this client holds {self.max_client_sessions} sessions, "
                                                         "the most one client may; close one first")
            s = _Session(secrets.token_hex(8), min(req.get("ttl_s", self.session_ttl_s), self.session_ttl_max_s),
                         ident=ident, owner=_owner_key(ident, req))
            self.sessions[s.sid] = s
            self.counts["sessions_opened"] += 1
            return self._ok(ident, envelope, req, session=s.sid, ttl_s=s.ttl_s)
        if op == "close":
            s = self._session_of(ident, req)
            cancelled = self._cancel(lambda r: r.session is s)
            del self.sessions[s.sid]
            if s.slot is not None and self.slots[s.slot].owner is s:
                self.slots[s.slot].owner = None
            return self._ok(ident, envelope, req, closed=s.sid, cancelled=cancelled)
        if op == "cancel":   # only the caller's own requests (or its sessions')
            if "rid" in req:
                for r in ([self.active] if self.active else []) + list(self.queue):
                    if r.rid == req["rid"] and not self._mine(r, ident, req) and \
                            not (r.session is not None and self._mine(r.session, ident, req)):
                        raise ProtocolError("forbidden", f"request {r.rid} belongs to another client")
                pick = lambda r: r.rid == req["rid"]
            elif "req_id" in req:    # the caller's request by its message id (a quiet one has no rid yet)
                pick = lambda r: r.req_id == req["req_id"] and self._mine(r, ident, req)
            elif "session" in req:
                s = self._session_of(ident, req)
                pick = lambda r: r.session is s
            else:
                pick = lambda r: r is self.active and self._mine(r, ident, req)
            return self._ok(ident, envelope, req, cancelled=self._cancel(pick))
        self._accept(ident, envelope, req)

    # ------------------------------------------------------------------------------ loop upkeep
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

    def _housekeeping(self):
        now = time.monotonic()
        check = getattr(self.executor, "check_peers", None)
        signalled = self.signalled is not None and not self.draining
        # a signal may be the launcher's word that a rank died (Open MPI's mpirun SIGTERMs the rest):
        # ask the peers first, so the clients hear backend_failed rather than shutting_down
        if check is not None and self.exit_code != 1 and (signalled or now >= self._next_peer_check):
            self._next_peer_check = now + self.peer_check_s
            try:
                check()
            except Exception as e:               # a frozen or vanished rank: the job is over
                self._backend_failed(self.active, e)
                return
        if signalled:
            self._begin_shutdown(f"signal {self.signalled}")
        if self.shutdown_why is not None and not self.draining:
            self._begin_shutdown(self.shutdown_why)
        if self.peer_failed_at is not None and self.exit_code != 1:
            # a rank died (hydra's SIGUSR1): a running decode fails by itself (PeerLost); an idle job,
            # or a decode still stuck after 10 s, is failed here
            if self.active is None or now - self.peer_failed_at > 10.0:
                self._backend_failed(self.active, RuntimeError("the launcher reported a failed rank (SIGUSR1)"))
        if now - getattr(self, "_last_expiry", 0.0) >= 1.0:
            self._last_expiry = now
            self._expire_sessions()
