"""OpenAI request bodies to control-plane `generate` requests, and results back to OpenAI's shapes.

Only what the official client sends and reads: /v1/completions and /v1/chat/completions with
max_tokens / max_completion_tokens, temperature, top_p, seed, stop, n (1), stream and
stream_options.include_usage. Unknown fields are ignored (clients send many); known fields whose
values this server cannot honour (n > 1, logprobs, echo, penalties, functions...) are refused with 400
rather than silently dropped. Every refusal is an ``ApiError`` that the app turns into OpenAI's
error JSON."""
from __future__ import annotations

import math
import secrets
import time

from kog_dist import protocol as P
from kog_dist.grammar import GrammarError, check_format

MAX_STOP = 16
ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param=None,
                 code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message, param=None, code=None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# control-plane error codes -> (HTTP status, OpenAI error type)
STATUS = {"bad_request": (400, "invalid_request_error"), "context_overflow": (400, "invalid_request_error"),
          "too_large": (413, "invalid_request_error"), "busy": (429, "rate_limit_error"),
          "shutting_down": (503, "server_error"), "backend_failed": (503, "server_error"),
          "cancelled": (499, "invalid_request_error"), "internal": (500, "server_error")}


def from_server_error(code: str, message: str) -> ApiError:
    status, kind = STATUS.get(code, (500, "server_error"))
    headers = {"Retry-After": "1"} if status in (429, 503) else {}
    oa_code = {"context_overflow": "context_length_exceeded", "busy": "rate_limit_exceeded"}.get(code, code)
    return ApiError(status, message, type_=kind, code=oa_code, headers=headers)


# ------------------------------------------------------------------------------------- fields
def _num(body, key, lo, hi, default, lo_open=False):
    x = body.get(key)
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) \
            or not (lo < x if lo_open else lo <= x) or x > hi:
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise bad(f"{key} must be a number in {rng}, got {x!r}"[:200], key)
    return float(x)


def _int(body, key, lo, hi):
    x = body.get(key)
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
        raise bad(f"{key} must be an integer in [{lo}, {hi}], got {x!r}"[:200], key)
    return x


def _refuse_unsupported(body):
    n = body.get("n")
    if n is not None and n != 1:
        raise bad(f"n must be 1 (this server returns one choice), got {n!r}"[:120], "n")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of must be 1", "best_of")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise bad(f"{key} is not supported (give 0 or leave it out)", key)
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise bad("logprobs are not supported", "logprobs")
    if body.get("echo") not in (None, False):
        raise bad("echo is not supported", "echo")
    if body.get("logit_bias") not in (None, {}):
        raise bad("logit_bias is not supported", "logit_bias")
    if body.get("functions") not in (None, []):
        raise bad("functions (the old form of tools) are not supported: give tools", "functions")
    if body.get("suffix") not in (None, ""):
        raise bad("suffix is not supported", "suffix")


def sampling(body: dict, max_seq: int, default_max: int | None) -> dict:
    """The generate fields shared by both endpoints."""
    _refuse_unsupported(body)
    out = {}
    mt = _int(body, "max_completion_tokens", 0, P.MAX_NEW_TOKENS)
    if mt is None:
        mt = _int(body, "max_tokens", 0, P.MAX_NEW_TOKENS)
    # no limit given: until the context is full (the coordinator clamps, finish_reason "length")
    out["max_new_tokens"] = mt if mt is not None else (default_max if default_max is not None else max_seq)
    out["temperature"] = _num(body, "temperature", 0.0, 2.0, 1.0)
    out["top_p"] = _num(body, "top_p", 0.0, 1.0, 1.0, lo_open=True)
    seed = body.get("seed")
    if seed is None:       # OpenAI: no seed, no reproducibility; the RNG is counter-based, so draw one
        seed = secrets.randbits(63)
    elif isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < (1 << 64):
        raise bad(f"seed must be an integer, got {seed!r}"[:120], "seed")
    out["seed"] = seed % (1 << 64)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or len(stop) > MAX_STOP or \
                not all(isinstance(s, str) and 1 <= len(s) <= P.MAX_STOP_LEN for s in stop):
            raise bad(f"stop must be a string or a list of at most {MAX_STOP} non-empty strings", "stop")
        if stop:
            out["stop"] = stop
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise bad("stream must be true or false", "stream")
    out["stream"] = bool(stream)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options")
    rf = body.get("response_format")
    if rf is not None:             # structured outputs: checked here, compiled (the library's errors) by the coordinator
        try:
            fmt = check_format(rf)
        except GrammarError as e:
            raise bad(str(e), "response_format") from None
        if fmt is not None:
            if out.get("stop"):
                raise bad("stop cannot be combined with response_format (a stop string could cut the object "
                          "short)", "stop")
            out["response_format"] = fmt
    if "speculative" in body:      # our extension: {"method": "prompt_lookup", "k": 8}, true or false
        try:
            k = P.parse_request({"v": 1, "op": "generate", "prompt_ids": [0],
                                 "speculative": body["speculative"]})["speculative"]
            out["speculative"] = {"method": "prompt_lookup", "k": k}
        except P.ProtocolError as e:
            raise bad(str(e), "speculative") from None
    return out


def include_usage(body: dict) -> bool:
    opts = body.get("stream_options") or {}
    return bool(opts.get("include_usage"))


def completion_request(body: dict, max_seq: int) -> dict:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]                             # a batch of one
    msg = {"op": "generate"}
    if isinstance(p, str):
        msg["prompt"] = p
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
        msg["prompt_ids"] = p
    elif isinstance(p, list) and len(p) > 1:
        raise bad("prompt must be one string or one list of token ids (batches are not supported)", "prompt")
    else:
        raise bad("prompt is required: a string or a list of token ids", "prompt")
    if body.get("tools") not in (None, []):
        raise bad("tools are for /v1/chat/completions (the chat template renders them)", "tools")
    msg.update(sampling(body, max_seq, 16))   # OpenAI's default max_tokens for completions
    return msg


def _content(m, i) -> str:
    c = m.get("content")
    if c is None and m.get("role") == "assistant":
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):                  # content parts: text only
        parts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def chat_request(body: dict, max_seq: int) -> dict:
    from . import tools_api as T     # here: it builds on this module
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages is required: a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with role and content", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}"[:160], "messages")
        out.append(T.history(m, i, _content(m, i)))
    msg = {"op": "generate", "messages": out}
    msg.update(sampling(body, max_seq, None))
    p = T.plan(body, msg)          # tools: rendered by the template; "required" / a name: the call's grammar
    if p is not None:
        msg["_tools"] = p          # the gateway's, taken off before the message is sent
    return msg


# ------------------------------------------------------------------------------------- results
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancel": "stop"}


def usage(stats: dict) -> dict:
    n = int(stats.get("new_tokens", 0))
    prompt = int(stats.get("context", n)) - n
    return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}


def new_id(kind: str) -> str:
    return f"{kind}-{secrets.token_hex(12)}"


def completion_body(cid, model, result, chat: bool) -> dict:
    finish = FINISH.get(result.get("stop_reason"), "stop")
    text = result.get("text", "")
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(result.get("stats", {})),
            "kog_stats": result.get("stats", {})}


def chunk_body(cid, created, model, chat: bool, text=None, finish=None, role=False) -> dict:
    if chat:
        delta = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": cid, "object": obj, "created": created, "model": model, "choices": [choice]}


async def end_stream(send, watch) -> None:
    """A stream's last event, [DONE], unless the watch on its connection saw the client go."""
    if watch.done() and not watch.cancelled():
        return
    try:
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
    except OSError:
        pass
