"""OpenAI tool calls in the gateway: `tools` / `tool_choice` to the control plane's `tools` (rendered by the
chat template, kog_dist/tools.py) and, for "required" or a named function, a `response_format` of the call's
JSON Schema (the arguments are decoded under the function's parameters, so they always validate); the answer
parsed back into `tool_calls`, whole or streamed (text that may still begin a call is held back, then sent as
content or as tool_calls deltas)."""
from __future__ import annotations

import json
import secrets
import time

from kog_dist.tools import ToolError, call_schema, check_choice, check_tools, may_be_call, parse_calls

from . import openai_api as O


def _json(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def plan(body: dict, msg: dict) -> dict | None:
    """Put tools (and the call's grammar) into the generate message; the plan for reading the answer, or None."""
    tools = body.get("tools")
    if tools in (None, []):
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise O.bad("tool_choice needs tools", "tool_choice")
        return None
    try:
        tools = check_tools(tools)
    except ToolError as e:
        raise O.bad(str(e), "tools") from None
    try:
        choice = check_choice(body.get("tool_choice"), tools)
    except ToolError as e:
        raise O.bad(str(e), "tool_choice") from None
    if choice == "none":
        return None
    msg["tools"] = tools
    if choice != "auto":
        if "response_format" in msg:
            raise O.bad("response_format cannot be combined with tool_choice required or a named function",
                        "response_format")
        msg["response_format"] = {"type": "json_schema", "schema": call_schema(tools, choice)}
    return {"names": [t["function"]["name"] for t in tools], "choice": choice}


def history(m: dict, i: int, content: str) -> dict:
    """One message of the chat for the control plane, its tool_calls and tool_call_id kept."""
    out = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
    calls = m.get("tool_calls")
    if calls not in (None, []):
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise O.bad(f"messages[{i}].tool_calls: only assistant messages carry a list of tool calls", "messages")
        kept = []
        for c in calls:
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments", "{}"), str):
                raise O.bad(f"messages[{i}].tool_calls: each is {{id, type: function, function: {{name, arguments "
                            f"(a JSON string)}}}}", "messages")
            kept.append({"id": str(c.get("id", "")), "type": "function",
                         "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}})
        out["tool_calls"] = kept
    if m["role"] == "tool":
        tid = m.get("tool_call_id")
        if not isinstance(tid, str):
            raise O.bad(f"messages[{i}]: a tool message needs tool_call_id (a string)", "messages")
        out["tool_call_id"] = tid
    return out


def _calls(text: str, p: dict):
    content, calls = parse_calls(text, p["names"])
    return content, [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                      "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


def whole(out: dict, p: dict) -> dict:
    """A non-streamed chat completion's message with its tool calls parsed out."""
    choice = out["choices"][0]
    if choice["finish_reason"] == "length":
        return out
    content, calls = _calls(choice["message"]["content"], p)
    if calls:
        choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
        choice["finish_reason"] = "tool_calls"
    return out


class ToolSSE:
    """A streamed chat completion with tools: content streams as it comes unless it may begin a call."""

    def __init__(self, gw, req, cid, model, chat, usage, t0, endpoint, watch):
        self.gw, self.req, self.cid, self.model, self.usage = gw, req, cid, model, usage
        self.t0, self.endpoint, self.watch, self.plan = t0, endpoint, watch, None
        self.created = int(time.time())

    def _ev(self, delta=None, finish=None, **extra) -> dict:
        body = {"id": self.cid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}], **extra}
        return {"type": "http.response.body", "body": b"data: " + _json(body) + b"\n\n", "more_body": True}

    async def run(self, send, queued: bool):
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})
        self.gw.metrics.request(self.endpoint, 200)
        await send(self._ev({"role": "assistant", "content": ""}))
        # auto: undecided while the text may still begin a call, then content (streamed) for good; else all held
        held, mode, ttft = "", "undecided" if self.plan["choice"] == "auto" else "hold", None
        try:
            async for m in self.req:
                kind = m.get("type")
                if kind == "chunk":
                    ttft = ttft or time.perf_counter() - self.t0
                    text = m.get("text", "")
                    if mode == "content":
                        if text:
                            await send(self._ev({"content": text}))
                        continue
                    held += text
                    if mode == "undecided" and not may_be_call(held):
                        await send(self._ev({"content": held}))
                        held, mode = "", "content"
                    continue
                if kind != "result":
                    continue
                st = m.get("stats", {})
                finish = O.FINISH.get(m.get("stop_reason"), "stop")
                content, calls = (held, []) if finish == "length" or mode == "content" else _calls(held, self.plan)
                if content:
                    await send(self._ev({"content": content}))
                for i, c in enumerate(calls):
                    await send(self._ev({"tool_calls": [{"index": i, **c}]}))
                await send(self._ev({}, "tool_calls" if calls else finish, kog_stats=st))
                if self.usage:
                    body = {"id": self.cid, "object": "chat.completion.chunk", "created": self.created,
                            "model": self.model, "choices": [], "usage": O.usage(st)}
                    await send({"type": "http.response.body", "body": b"data: " + _json(body) + b"\n\n",
                                "more_body": True})
                self.gw.metrics.finished(st, ttft)
        except OSError:
            return
        except Exception as e:   # the coordinator's error (ServerError) or the connection's, as OpenAI's error event
            err = O.from_server_error(e.code, e.message) if hasattr(e, "code") else \
                O.ApiError(503, str(e), type_="server_error")
            try:
                await send({"type": "http.response.body", "body": b"data: " + _json(err.body()) + b"\n\n",
                            "more_body": True})
            except OSError:
                return
        await O.end_stream(send, self.watch)
