"""Client of the kog_dist control plane (docs/protocol.md); the `kog client` command line is in client_cli.py.

    with kog_dist.Client("tcp://127.0.0.1:5555", timeout=30) as c:
        r = c.generate(prompt="Hello", max_new_tokens=32)        # r.token_ids, r.text, r.stats
        for chunk in c.stream(prompt_ids=[1, 5, 9]):              # {"token_ids": [...], "text": "..."}
            ...
        with c.session() as s:                                    # a KV cache kept on the ranks
            s.append(prompt="System: be brief.\n")
            r = s.generate(max_new_tokens=16)

`timeout` bounds every wait for a message from the server (the server sends progress messages while
it decodes, so long generations do not trip it). A Client is for one thread; only ``cancel()`` may be
called from another (it uses its own socket).

Ownership: every Client sends a random owner token with its requests; the server lets only that
token (or the connection itself) cancel them or use its sessions. ``Client(owner=other.owner)``
shares an identity (another process, a reconnect). ``shutdown()`` sends the server's secret, read from
the file the server wrote for this endpoint (kog_dist.control_auth); a CURVE client needs none.
"""
from __future__ import annotations

import itertools
import secrets
from dataclasses import asdict, dataclass, field

import zmq
from zmq.auth import load_certificate
from zmq.utils.monitor import recv_monitor_message

from . import protocol as P
from .control_auth import read_secret

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_ids")


class ServerError(Exception):
    """An error reply: ``code`` (see docs/protocol.md) and a one-line message."""

    def __init__(self, code: str, message: str, reply: dict | None = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.reply = code, message, reply or {}


class BusyError(ServerError):
    """The server's queue is full; try again later."""


class ClientTimeout(TimeoutError):
    pass


class ServerGone(ConnectionError):
    """The server closed the connection while a request was in flight (it stopped or crashed)."""


class HandshakeRefused(ConnectionError):
    """The server refused the connection's handshake (CURVE: a key it does not accept, or a mismatch
    of security mechanisms); nothing was exchanged."""


_OWNED_OPS = ("generate", "append", "open", "close", "cancel")
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@dataclass
class GenerateResult:
    token_ids: list
    text: str
    stop_reason: str
    stats: dict
    rid: int | None = None
    session: str | None = None
    position: int = 0                    # queue position when the request was accepted (0: ran at once)
    extra: dict = field(default_factory=dict)

    @property
    def ids(self) -> list:
        return self.token_ids

    def __getitem__(self, key):
        return getattr(self, key)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d


def _curve(sock, server_key, client_key):
    if server_key is None and client_key is None:
        return
    if server_key is None or client_key is None:
        raise ValueError("CURVE needs both the server's public key file and this client's secret key file")
    server_public = load_certificate(server_key)[0] if not isinstance(server_key, bytes) else server_key
    public, secret = load_certificate(client_key)
    if not secret:
        raise ValueError(f"{client_key} holds no secret key (give the .key_secret file)")
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret


class Client:
    """One connection (a DEALER socket) to a coordinator."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout: float = 30.0, *, server_key=None,
                 client_key=None, owner: str | None = None):
        P.endpoint_host(endpoint)                       # ValueError on a malformed endpoint
        if owner is not None and not (isinstance(owner, str) and P.MIN_OWNER <= len(owner) <= P.MAX_ID_STR):
            raise ValueError(f"owner must be a string of {P.MIN_OWNER}..{P.MAX_ID_STR} characters")
        self.endpoint, self.timeout = endpoint, float(timeout)
        self.owner = owner or secrets.token_hex(16)
        self._keys = (server_key, client_key)
        self._ctx = zmq.Context.instance()
        # Disconnect events: a server that dies mid-request (a killed job) fails the wait at once;
        # handshake failures: a refused CURVE key says so instead of reading like a crash or a timeout
        # (the monitor is attached before connecting: a handshake on loopback fails within microseconds)
        self._sock, self._mon = self._connect(monitor=zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
        self._ids = itertools.count(1)
        self._open_stream = None

    def _connect(self, monitor=0):
        """A DEALER connected to the endpoint; with `monitor` (event flags), (socket, monitor socket)."""
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, P.MAX_REPLY_BYTES)
        host = P.endpoint_host(self.endpoint)
        if host and ":" in host:
            s.setsockopt(zmq.IPV6, 1)
        _curve(s, *self._keys)
        mon = s.get_monitor_socket(monitor) if monitor else None
        s.connect(self.endpoint)
        return (s, mon) if monitor else s

    def close(self):
        if self._sock is not None:
            if self._open_stream is not None:
                self._open_stream.close()
            self._sock.disable_monitor()
            self._mon.close(0)
            self._sock.close(0)
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------------------ plumbing
    def _send(self, msg: dict) -> int:
        if self._sock is None:
            raise ValueError("the client is closed")
        if self._open_stream is not None:
            self._open_stream.close()
        self._events()                          # disconnects before this request do not count
        rid = next(self._ids)
        if msg.get("op") in _OWNED_OPS:
            msg = {**msg, "owner": self.owner}
        self._send_on(self._sock, P.packb({"v": P.VERSION, "id": rid, **msg}), self._mon)
        return rid

    def _send_on(self, sock, data: bytes, mon=None) -> None:
        """Send, or ClientTimeout: a DEALER with no live connection (e.g. one a server refused) blocks."""
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.timeout * 1000)))
        try:
            sock.send(data)
        except zmq.Again:
            if mon is not None:
                self._events(mon)               # HandshakeRefused if that is why
            raise ClientTimeout(f"cannot send to {self.endpoint} within {self.timeout:g} s (no connection)") from None

    def _events(self, mon=None) -> bool:
        """Drain a monitor socket: raise HandshakeRefused on a failed handshake; True if it disconnected."""
        mon = mon or self._mon
        gone = False
        while mon.poll(0):
            ev = recv_monitor_message(mon)
            if ev["event"] & _HANDSHAKE_FAILED:
                raise HandshakeRefused(self._refusal(ev["event"], ev["value"]))
            gone = True
        return gone

    def _refusal(self, event, value) -> str:
        """One line for a failed handshake (libzmq tells only so much: a CURVE server refusing a client
        without keys and a peer that speaks no ZMTP both just close the connection)."""
        curve = self._keys != (None, None)
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return f"the server at {self.endpoint} refused this client's CURVE key (not among its authorised clients)"
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return (f"the handshake with {self.endpoint} failed: " +
                    ("the server does not use CURVE (drop --server-key/--client-key)" if curve else
                     "the server requires CURVE (give --server-key and --client-key)"))
        if curve:
            return (f"the CURVE handshake with {self.endpoint} failed: the server does not use CURVE, or its "
                    "key is not the one given as --server-key")
        return (f"the handshake with {self.endpoint} failed: the server requires CURVE (give --server-key and "
                "--client-key), or what answers there is not a kog_dist control endpoint")

    def _recv(self, want_id, sock=None, timeout=None) -> dict:
        """The next message for request `want_id` (older requests' leftovers are skipped)."""
        mon = self._mon if sock is None else None
        sock = sock or self._sock
        timeout = self.timeout if timeout is None else timeout
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if mon is not None:
            poller.register(mon, zmq.POLLIN)
        gone = False
        while True:
            ready = dict(poller.poll(200 if gone else int(timeout * 1000)))
            if mon is not None and mon in ready:
                gone = self._events(mon) or gone      # HandshakeRefused on a refused handshake
            if sock not in ready:
                if gone and not sock.poll(200):        # a disconnect, and nothing left to read
                    raise ServerGone(f"the server at {self.endpoint} closed the connection (it stopped or crashed)")
                if not ready:
                    raise ClientTimeout(f"no answer from {self.endpoint} within {timeout:g} s "
                                        "(is a server running there?)")
                continue
            msg = P.unpackb(sock.recv(), P.MAX_REPLY_BYTES)
            if msg.get("id") != want_id:
                continue
            if msg.get("type") == "error":
                cls = BusyError if msg.get("code") == "busy" else ServerError
                raise cls(str(msg.get("code")), str(msg.get("message")), msg)
            return msg

    def _call(self, op: str, **fields) -> dict:
        rid = self._send({"op": op, **fields})
        msg = self._recv(rid)
        msg.pop("v", None), msg.pop("id", None), msg.pop("type", None)
        return msg

    # ------------------------------------------------------------------------------ ops
    def health(self) -> dict:
        return self._call("health")

    def stats(self) -> dict:
        return self._call("stats")

    def shutdown(self, secret: str | None = None) -> dict:
        """Stop the server. `secret` defaults to the one the server left for this user and endpoint
        (control_auth.read_secret); without it only a CURVE client may (else ServerError forbidden)."""
        secret = secret or read_secret(self.endpoint)
        return self._call("shutdown", **({"secret": secret} if secret else {}))

    def cancel(self, rid: int | None = None, session: str | None = None) -> list:
        """Cancel a request (by rid), a session's requests, or (neither) the running decode.
        Safe from any thread: it uses a socket of its own. Returns the rids it cancelled."""
        s = self._connect()
        try:
            msg = {"v": P.VERSION, "id": 0, "op": "cancel", "owner": self.owner}
            if rid is not None:
                msg["rid"] = rid
            if session is not None:
                msg["session"] = session
            self._send_on(s, P.packb(msg))
            return self._recv(0, sock=s, timeout=min(self.timeout, 5.0)).get("cancelled", [])  # answered at once
        finally:
            s.close(0)

    def generate(self, prompt=None, prompt_ids=None, *, max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0,
                 seed=0, stop=None, stop_ids=None, add_bos=None, session=None, response_format=None,
                 speculative=None) -> GenerateResult:
        """Decode; returns a GenerateResult (token_ids / ids, text, stop_reason, stats). `stop` is a
        string or a list of strings, `stop_ids` a list of ids; `session` continues that session;
        `response_format` ({"type": "json_schema", "schema": S} ...) decodes under a grammar, `speculative`
        (False, True or {"k": K}) overrides the server's default (docs/protocol.md)."""
        st = self.stream(prompt, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                         top_p=top_p, seed=seed, stop=stop, stop_ids=stop_ids, add_bos=add_bos, session=session,
                         response_format=response_format, speculative=speculative, _stream=False)
        for _ in st:
            pass
        return st.result

    def stream(self, prompt=None, prompt_ids=None, *, max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0,
               seed=0, stop=None, stop_ids=None, add_bos=None, session=None, response_format=None, speculative=None,
               _stream=True) -> "Stream":
        """An iterator of chunks {"token_ids", "text"} as the ranks produce them; afterwards
        ``.result`` holds the GenerateResult. ``.cancel()`` stops the decode, ``.close()`` cancels
        and waits for the end (also on leaving a ``with`` block)."""
        kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                  stop=stop, stop_ids=stop_ids, add_bos=add_bos, session=session, response_format=response_format,
                  speculative=speculative)
        msg = _request("generate", prompt, prompt_ids, kw)
        msg["stream"] = _stream
        return Stream(self, msg)

    def session(self, ttl_s: float | None = None) -> "Session":
        r = self._call("open", **({"ttl_s": float(ttl_s)} if ttl_s is not None else {}))
        return Session(self, r["session"])


def _request(op, prompt, prompt_ids, kw) -> dict:
    msg = {"op": op}
    if prompt is not None:
        msg["prompt"] = prompt
    if prompt_ids is not None:
        msg["prompt_ids"] = [int(t) for t in prompt_ids]
    for k, v in kw.items():
        if v is not None:
            msg[k] = list(v) if k == "stop_ids" else v
    return msg


class Stream:
    def __init__(self, client: Client, msg: dict):
        self.client, self.result, self.rid, self.position = client, None, None, 0
        self._id = client._send(msg)
        client._open_stream = self
        self._done = False

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        while not self._done:
            chunk = self._step()
            if chunk is not None:
                return chunk
        raise StopIteration

    def _step(self):
        """Handle one message; a chunk dict, or None."""
        try:
            m = self.client._recv(self._id)
        except BaseException:
            self._end()
            raise
        kind = m.get("type")
        if kind in ("accepted", "queued"):
            self.rid = m.get("rid", self.rid)
            if kind == "accepted":
                self.position = m.get("position", 0)
        elif kind == "chunk":
            return {"token_ids": m.get("token_ids", []), "text": m.get("text", "")}
        elif kind == "result":
            self._end()
            extra = {k: v for k, v in m.items() if k not in
                     ("v", "id", "type", "token_ids", "text", "stop_reason", "stats", "rid", "session")}
            self.result = GenerateResult(m.get("token_ids", []), m.get("text", ""), m.get("stop_reason", ""),
                                         m.get("stats", {}), m.get("rid"), m.get("session"), self.position, extra)
        return None

    def _end(self):
        self._done = True
        if self.client._open_stream is self:
            self.client._open_stream = None

    def cancel(self) -> list:
        """Ask the server to stop this decode; keep iterating to get the (partial) result."""
        return self.client.cancel(rid=self.rid) if self.rid is not None and not self._done else []

    def close(self):
        """Cancel if still running and wait (bounded by the client's timeout) for the end."""
        sent = False
        try:
            while not self._done:
                if not sent and self.rid is not None:
                    self.client.cancel(rid=self.rid)
                    sent = True
                self._step()
        except (ServerError, ClientTimeout, ServerGone):
            self._end()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Session:
    """A context that stays on the ranks between requests (a KV slot), until closed or expired."""

    def __init__(self, client: Client, sid: str):
        self.client, self.id = client, sid

    def append(self, prompt=None, prompt_ids=None, add_bos=None) -> GenerateResult:
        """Add context without generating (prefilled now); the result carries the prefill stats."""
        st = Stream(self.client, _request("append", prompt, prompt_ids, {"session": self.id, "add_bos": add_bos}))
        for _ in st:
            pass
        return st.result

    def generate(self, prompt=None, prompt_ids=None, **kw) -> GenerateResult:
        return self.client.generate(prompt, prompt_ids, session=self.id, **kw)

    def stream(self, prompt=None, prompt_ids=None, **kw) -> Stream:
        return self.client.stream(prompt, prompt_ids, session=self.id, **kw)

    def close(self):
        if self.id is not None and self.client._sock is not None:
            try:
                self.client._call("close", session=self.id)
            except ServerError as e:
                if e.code != "no_session":
                    raise
        self.id = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
