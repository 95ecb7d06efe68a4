"""The kog_dist control-plane protocol, version 1: msgpack maps over ZMQ (see docs/protocol.md).

Every request is one ZMQ frame holding a msgpack map with at least ``v`` (the protocol version) and
``op``. ``parse_request`` checks it against the schema below before anything acts on it and returns
a normalised copy (defaults filled in); anything wrong raises ``ProtocolError`` carrying one of the
error codes in ``ERROR_CODES``. Never pickle: only msgpack's plain types cross the wire (ext types,
timestamps and non-string map keys are refused).
"""
from __future__ import annotations

import ipaddress
import math
import socket

import msgpack

from .grammar import GrammarError, check_format
from .sampling import MAX_TEMPERATURE, MAX_TOP_K
from .speculative import MAX_DRAFT
from .tools import ToolError, check_tools

VERSION = 1
MAX_FRAME_BYTES = 1 << 20          # a request frame larger than this gets a `too_large` error
HARD_FRAME_BYTES = 16 << 20        # zmq MAXMSGSIZE: larger frames drop the connection, unread
MAX_REPLY_BYTES = 256 << 20        # what a client accepts
MAX_FRAMES = 4                     # frames per request (empty delimiters + payload)
MAX_IDS = 1 << 20
MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_STOP_IDS = 256
MAX_NEW_TOKENS = 1 << 20
MAX_ID_STR = 128
MIN_OWNER = 16                     # an owner token shorter than this is too easy to guess
MAX_SECRET = 256
MAX_MESSAGES = 4096

ERROR_CODES = {
    "bad_request": "the message is not a msgpack map matching the schema (type, range, field)",
    "unsupported_version": "the field v is not a protocol version this server speaks",
    "unknown_op": "op names no operation",
    "too_large": "the frame is over the size limit",
    "busy": "one decode is running and the queue is full; retry later",
    "no_session": "the session is unknown, closed or expired",
    "too_many_sessions": "the server holds its maximum number of sessions",
    "context_overflow": "the context does not fit the model's max_seq",
    "forbidden": "the request is not this client's, or shutdown without the server's secret",
    "cancelled": "the request was cancelled before it started",
    "shutting_down": "the server is shutting down and takes no more work",
    "backend_failed": "the ranks failed (a rank died); the server is exiting",
    "internal": "an unexpected server error",
}

SAMPLING_DEFAULTS = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
GENERATE_DEFAULTS = {"max_new_tokens": 64, "stream": False, "stop": [], "stop_ids": [], **SAMPLING_DEFAULTS}


class ProtocolError(Exception):
    """A request that cannot be served; ``code`` is a key of ERROR_CODES, ``args[0]`` one line."""

    def __init__(self, code: str, message: str):
        assert code in ERROR_CODES, code
        super().__init__(message)
        self.code = code
        self.message = message


def _no_ext(code, data):
    raise ValueError(f"msgpack ext type {code} is not allowed")


def packb(msg: dict) -> bytes:
    """Encode one message (a dict of plain types)."""
    return msgpack.packb(msg, use_bin_type=True)


def unpackb(data: bytes, max_bytes: int = MAX_FRAME_BYTES) -> dict:
    """Decode one frame into a dict, or raise ProtocolError (too_large / bad_request)."""
    if len(data) > max_bytes:
        raise ProtocolError("too_large", f"frame of {len(data)} bytes is over the limit of {max_bytes}")
    try:
        msg = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True,
                              timestamp=0, ext_hook=_no_ext)
    except Exception as e:  # FormatError, ExtraData, StackError, ValueError, UnicodeDecodeError...
        raise ProtocolError("bad_request", f"not a msgpack message: {type(e).__name__}: {e}"[:200]) from None
    if not isinstance(msg, dict):
        raise ProtocolError("bad_request", f"a message must be a msgpack map, not {type(msg).__name__}")
    return msg


# ----------------------------------------------------------------------------------------- checks
def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(msg, key, lo, hi, default=None):
    x = msg.get(key, default)
    if not _is_int(x) or not lo <= x <= hi:
        raise ProtocolError("bad_request", f"{key} must be an integer in [{lo}, {hi}], got {_show(x)}")
    return x


def _float(msg, key, lo, hi, default=None, lo_open=False):
    x = msg.get(key, default)
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) \
            or not (lo < x if lo_open else lo <= x) or not x <= hi:
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise ProtocolError("bad_request", f"{key} must be a number in {rng}, got {_show(x)}")
    return float(x)


def _bool(msg, key, default):
    x = msg.get(key, default)
    if not isinstance(x, bool):
        raise ProtocolError("bad_request", f"{key} must be true or false, got {_show(x)}")
    return x


def _str(msg, key, max_len, default=None, min_len=1):
    x = msg.get(key, default)
    if not isinstance(x, str) or not min_len <= len(x) <= max_len:
        raise ProtocolError("bad_request", f"{key} must be a string of {min_len}..{max_len} characters, got {_show(x)}")
    return x


def _ids(msg, key, max_len, min_len=0):
    x = msg.get(key)
    if not isinstance(x, list) or not min_len <= len(x) <= max_len:
        raise ProtocolError("bad_request", f"{key} must be a list of {min_len}..{max_len} token ids, got {_show(x)}")
    for t in x:
        if not _is_int(t) or not 0 <= t < (1 << 31):
            raise ProtocolError("bad_request", f"{key} must hold non-negative integers, got {_show(t)}")
    return list(x)


def _show(x) -> str:
    s = repr(x) if not isinstance(x, (bytes, list, dict, str)) else f"{type(x).__name__} {repr(x)[:40]}"
    return s[:60]


def _prompt(msg, out, required):
    has_text, has_ids = "prompt" in msg, "prompt_ids" in msg
    if has_text and has_ids:
        raise ProtocolError("bad_request", "give prompt or prompt_ids, not both")
    if has_text:
        out["prompt"] = _str(msg, "prompt", MAX_FRAME_BYTES, min_len=0)
    elif has_ids:
        out["prompt_ids"] = _ids(msg, "prompt_ids", MAX_IDS)
    elif required:
        raise ProtocolError("bad_request", "prompt or prompt_ids is required")
    if "add_bos" in msg:
        out["add_bos"] = _bool(msg, "add_bos", True)


def _session(msg, out, required):
    if "session" in msg or required:
        out["session"] = _str(msg, "session", MAX_ID_STR)


def _messages(msg, out):
    """A chat as [{role, content}]: the coordinator renders it with the model's chat template."""
    if "prompt" in msg or "prompt_ids" in msg or "add_bos" in msg:
        raise ProtocolError("bad_request", "give messages or prompt/prompt_ids (and add_bos), not both")
    x = msg["messages"]
    if not isinstance(x, list) or not 1 <= len(x) <= MAX_MESSAGES:
        raise ProtocolError("bad_request", f"messages must be a list of 1..{MAX_MESSAGES} "
                                           f"{{role, content}} maps, got {_show(x)}")
    for i, m in enumerate(x):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not 1 <= len(m["role"]) <= 32 \
                or not isinstance(m.get("content"), str) or set(m) - {"role", "content", "name", "tool_calls",
                                                                       "tool_call_id"} \
                or not isinstance(m.get("name", ""), str) or not isinstance(m.get("tool_call_id", ""), str):
            raise ProtocolError("bad_request", f"message {i} must be a map of role (string), content (string) "
                                               f"and optionally name, tool_calls, tool_call_id, got {_show(m)}")
        if "tool_calls" in m and not _tool_calls_ok(m["tool_calls"]):
            raise ProtocolError("bad_request", f"message {i}: tool_calls must be a list of {{id, type: function, "
                                               f"function: {{name, arguments}}}} maps, got {_show(m['tool_calls'])}")
    out["messages"] = [dict(m) for m in x]


def _tool_calls_ok(calls) -> bool:
    return isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", ""), (str, dict)) and isinstance(c.get("id", ""), str)
        for c in calls)


def _generate(msg, out):
    _session(msg, out, required=False)
    if "messages" in msg:
        _messages(msg, out)
    else:
        _prompt(msg, out, required="session" not in out)
    d = GENERATE_DEFAULTS
    out["max_new_tokens"] = _int(msg, "max_new_tokens", 0, MAX_NEW_TOKENS, d["max_new_tokens"])
    out["temperature"] = _float(msg, "temperature", 0.0, MAX_TEMPERATURE, d["temperature"])
    out["top_k"] = _int(msg, "top_k", 0, MAX_TOP_K, d["top_k"])
    out["top_p"] = _float(msg, "top_p", 0.0, 1.0, d["top_p"], lo_open=True)
    out["seed"] = _int(msg, "seed", 0, (1 << 64) - 1, d["seed"])
    out["stream"] = _bool(msg, "stream", d["stream"])
    if "quiet" in msg:
        out["quiet"] = _bool(msg, "quiet", False)
    stop = msg.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or \
            not all(isinstance(s, str) and 1 <= len(s) <= MAX_STOP_LEN for s in stop):
        raise ProtocolError("bad_request", f"stop must be a string or a list of at most {MAX_STOP} "
                                           f"strings of 1..{MAX_STOP_LEN} characters, got {_show(stop)}")
    out["stop"] = stop
    out["stop_ids"] = _ids(msg, "stop_ids", MAX_STOP_IDS) if "stop_ids" in msg else []
    if "speculative" in msg:
        out["speculative"] = _speculative(msg["speculative"])
    if "tools" in msg:         # rendered into the prompt by the chat template (kog_dist/tools.py)
        if "messages" not in out:
            raise ProtocolError("bad_request", "tools need messages (the chat template renders them)")
        try:
            out["tools"] = check_tools(msg["tools"])
        except ToolError as e:
            raise ProtocolError("bad_request", str(e)[:400]) from None
    if "response_format" in msg:
        try:
            fmt = check_format(msg["response_format"])
        except GrammarError as e:
            raise ProtocolError("bad_request", str(e)) from None
        if fmt is not None:
            if out["stop"]:
                raise ProtocolError("bad_request", "stop cannot be combined with response_format (a stop string "
                                                   "could cut the object short)")
            out["response_format"] = fmt


def _speculative(v) -> int:
    """`speculative`: false / nil (off), true (k = 8), or {"method": "prompt_lookup", "k": 0..8}; the
    draft length k, 0 = off."""
    if v is None or v is False:
        return 0
    if v is True:
        return MAX_DRAFT
    if isinstance(v, dict) and set(v) <= {"method", "k"} and v.get("method", "prompt_lookup") == "prompt_lookup":
        k = v.get("k", MAX_DRAFT)
        if _is_int(k) and 0 <= k <= MAX_DRAFT:
            return int(k)
    raise ProtocolError("bad_request", f"speculative must be true, false or {{\"method\": \"prompt_lookup\", "
                                       f"\"k\": 0..{MAX_DRAFT}}}, got {_show(v)}")


def _append(msg, out):
    _session(msg, out, required=True)
    _prompt(msg, out, required=True)


def _open(msg, out):
    if "ttl_s" in msg:
        out["ttl_s"] = _float(msg, "ttl_s", 0.0, 86400.0 * 7, lo_open=True)


def _cancel(msg, out):
    if "rid" in msg:
        out["rid"] = _int(msg, "rid", 0, (1 << 63) - 1)
    if "req_id" in msg:
        out["req_id"] = request_id({"id": msg["req_id"]})
        if out["req_id"] is None:
            raise ProtocolError("bad_request", f"req_id must be an integer or a string of at most {MAX_ID_STR} "
                                               f"characters, got {_show(msg['req_id'])}")
    _session(msg, out, required=False)


OPS = {
    "health": ((), None),
    "stats": ((), None),
    "shutdown": (("secret",), lambda m, o: o.update(secret=_str(m, "secret", MAX_SECRET)) if "secret" in m else None),
    "generate": (("prompt", "prompt_ids", "messages", "add_bos", "session", "max_new_tokens", "temperature",
                  "top_k", "top_p", "seed", "stop", "stop_ids", "stream", "owner", "speculative", "quiet",
                  "response_format", "tools"), _generate),
    "open": (("ttl_s", "owner"), _open),
    "append": (("session", "prompt", "prompt_ids", "add_bos", "owner"), _append),
    "close": (("session", "owner"), lambda m, o: _session(m, o, required=True)),
    "cancel": (("rid", "req_id", "session", "owner"), _cancel),
}


def request_id(msg) -> int | str | None:
    """The client's `id` if it is usable for echoing back, else None."""
    x = msg.get("id") if isinstance(msg, dict) else None
    if _is_int(x) and -(1 << 63) <= x < (1 << 64):
        return x
    if isinstance(x, str) and len(x) <= MAX_ID_STR:
        return x
    return None


def parse_request(msg: dict) -> dict:
    """Validate a decoded request; return {'op', 'id', ...normalised fields} or raise ProtocolError."""
    if "id" in msg and request_id(msg) is None:
        raise ProtocolError("bad_request", f"id must be an integer or a string of at most {MAX_ID_STR} characters")
    v = msg.get("v")
    if not _is_int(v):
        raise ProtocolError("bad_request", f"v (the protocol version, {VERSION}) is required as an integer")
    if v != VERSION:
        raise ProtocolError("unsupported_version",
                            f"protocol version {v} is not supported; this server speaks {VERSION}")
    op = msg.get("op")
    if not isinstance(op, str):
        raise ProtocolError("bad_request", "op is required as a string")
    if op not in OPS:
        raise ProtocolError("unknown_op", f"unknown op {op[:40]!r}; ops: {', '.join(sorted(OPS))}")
    fields, check = OPS[op]
    extra = set(msg) - set(fields) - {"v", "op", "id"}
    if extra:
        raise ProtocolError("bad_request", f"unknown field(s) for {op}: {', '.join(sorted(map(str, extra)))[:80]}")
    out = {"op": op, "id": request_id(msg)}
    if "owner" in msg:   # the client's own token: its requests and sessions, from any of its connections
        out["owner"] = _str(msg, "owner", MAX_ID_STR, min_len=MIN_OWNER)
    if check is not None:
        check(msg, out)
    return out


def error_reply(code: str, message: str, req_id=None, **extra) -> dict:
    """An error message; `id` echoes the client's request id when known."""
    msg = {"v": VERSION, "type": "error", "code": code, "message": message}
    if req_id is not None:
        msg["id"] = req_id
    msg.update(extra)
    return msg


# -------------------------------------------------------------------------------------- endpoints
def endpoint_host(endpoint: str) -> str | None:
    """The host part of a tcp:// endpoint ('*' for a wildcard bind); None for ipc:// and inproc://."""
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ValueError(f"bad endpoint {endpoint!r}: expected tcp://HOST:PORT or ipc://PATH")
    scheme, rest = endpoint.split("://", 1)
    if scheme in ("ipc", "inproc"):
        return None
    if scheme != "tcp" or ":" not in rest:
        raise ValueError(f"bad endpoint {endpoint!r}: expected tcp://HOST:PORT or ipc://PATH")
    host = rest.rsplit(":", 1)[0]
    if ";" in host:      # tcp://SOURCE;HOST:PORT (connect form): the destination decides
        host = host.split(";", 1)[1]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(endpoint: str) -> bool:
    """True when the endpoint is reachable from this machine only (loopback tcp, ipc, inproc)."""
    host = endpoint_host(endpoint)
    if host is None or host in ("lo", "localhost"):
        return True
    if host in ("*", "", "0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False          # an interface name (eth0) or an unresolvable name: not loopback
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)
