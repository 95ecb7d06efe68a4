"""The HTTP gateway: an ASGI app in front of one coordinator, reached through ``kog_dist.aclient.AsyncClient``
(a connection a request in flight). Generation runs on raw ASGI (its way in is TTFT), the other routes on
Starlette (docs/serve.md says why).

    gw = Gateway("tcp://127.0.0.1:5555", model_name="SmolLM2", api_key=None)
    app = gw.app                       # run it with uvicorn; gw.ready is set once the model answers

Routes: GET / (the playground), GET /health, GET /metrics, GET /v1/models[/{id}],
POST /v1/completions, POST /v1/chat/completions. Errors use OpenAI's JSON error shape.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import socket
import time
from json.encoder import encode_basestring

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kog_dist.aclient import AsyncClient, ClientTimeout, ServerError, ServerGone
from kog_dist.models import model_id

from . import openai_api as O
from . import tools_api as T
from .metrics import Metrics

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
MAX_BODY_BYTES = 1 << 20      # the coordinator takes frames up to 1 MiB; larger bodies get 413 here
GENERATE_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}    # path -> chat


def served_name(model: str) -> str:
    """The id clients use for a model path or name: kog_dist.models.model_id (the file's or folder's name,
    without .gguf and its quantisation tag; qwen2.5-0.5b keeps its dots)."""
    return model_id(model)


def _json(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


_MARK = "\x00kog-text\x00"


def text_event_parts(cid, created, model, chat, role=False) -> tuple[bytes, bytes]:
    """The bytes of a streamed text event around its text and its kog_tokens count, cut once from the
    event that chunk_body and _json write (so the two always agree): an event is then
    ``head + encode_basestring(text).encode() + mid + b"%d}\\n\\n" % tokens``. A token on two cores
    shared with the decode cannot afford a dict and a JSON encoder pass of its own."""
    ev = O.chunk_body(cid, created, model, chat, _MARK, role=role)
    ev["kog_tokens"] = 0
    head, tail = _json(ev).split(_json(_MARK))
    if not tail.endswith(b'"kog_tokens":0}'):
        raise AssertionError(f"unexpected event layout {tail!r}")
    return b"data: " + head, tail[:-2]


def error_response(e: O.ApiError) -> Response:
    return Response(_json(e.body()), status_code=e.status, media_type="application/json", headers=e.headers)


MAX_JSON_DEPTH = 32   # an OpenAI request nests 4 levels (messages, content parts); more is an attack


def _depth(obj) -> int:
    """How deep lists and objects nest in a parsed JSON value (iterative: no recursion to exhaust)."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        o, d = todo.pop()
        if isinstance(o, (dict, list)):
            deepest = max(deepest, d)
            if d <= MAX_JSON_DEPTH:
                todo.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


class Gateway:
    """State shared by the routes: the coordinator client, its health, the metrics."""

    def __init__(self, endpoint: str, *, model_name: str | None = None, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, timeout: float = 600.0, health_every_s: float = 1.0,
                 server_key=None, client_key=None, log=None):
        self.endpoint, self.model_name, self.max_body = endpoint, model_name, int(max_body_bytes)
        self._key = api_key.encode() if api_key else None
        self.timeout, self.health_every_s = float(timeout), float(health_every_s)
        self.client = AsyncClient(endpoint, timeout=timeout, server_key=server_key, client_key=client_key)
        self.state = "loading"       # loading -> ok <-> down; failed (the ranks died) is final
        self.failure = None
        self.health: dict = {}
        self.ready = asyncio.Event()
        self.metrics = Metrics()
        self.created = int(time.time())
        self.log = log or (lambda m: None)
        self._task = None
        self.starlette = Starlette(routes=[
            Route("/", self.index), Route("/health", self.get_health), Route("/metrics", self.get_metrics),
            Route("/v1/models", self.models), Route("/v1/models/{model:path}", self.model),
            Route("/v1/completions", _Generate(self, False), methods=["POST"]),
            Route("/v1/chat/completions", _Generate(self, True), methods=["POST"]),
        ], lifespan=self._lifespan)
        starlette = self.starlette

        async def app(scope, receive, send):
            """Generation goes straight to `generate` (Starlette's middleware, router and Request cost ~0.1 ms
            of the way in, which is TTFT), the rest through Starlette. A plain function: uvicorn tells ASGI 3
            apps by that."""
            if scope["type"] == "http" and scope["method"] == "POST":
                chat = GENERATE_PATHS.get(scope["path"])
                if chat is not None:
                    return await self.generate(scope, receive, send, chat)
            await starlette(scope, receive, send)
        self.app = app

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        await self.startup()
        try:
            yield
        finally:
            await self.shutdown()

    # ------------------------------------------------------------------------------ lifecycle
    async def startup(self):
        self.ready = asyncio.Event()
        await self.client.start()
        self._task = asyncio.get_running_loop().create_task(self._watch_health())

    async def shutdown(self):
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self.client.close()

    def fail(self, why: str):
        """The ranks are gone for good (kog serve saw them exit): answer 503 from now on."""
        self.state, self.failure = "failed", why

    async def _watch_health(self):
        misses = 0
        while True:
            try:
                h = await self.client.call("health", timeout=max(2.0, self.health_every_s))
            except (ClientTimeout, ServerGone, ServerError):
                misses += 1
                # three misses in a row (a dropped connection shows at once, through the client's
                # disconnect events): the coordinator hangs, so the requests waiting on it fail now
                # instead of after --timeout
                if self.state == "ok" and (misses >= 3 or not self.client.connected):
                    self.state = "down"
                    self.log(f"the coordinator at {self.endpoint} stopped answering")
                    self.client.fail_pending(f"the coordinator at {self.endpoint} stopped answering")
            else:
                misses = 0
                self.health = h
                if self.state != "failed":
                    self.state = "ok" if h.get("status") == "ok" else "down"
                if self.model_name is None and h.get("model"):
                    self.model_name = served_name(str(h["model"]))
                if self.state == "ok":
                    self.ready.set()
            await asyncio.sleep(self.health_every_s if self.state == "ok" else 0.2)

    # ------------------------------------------------------------------------------ checks
    def _auth(self, header: bytes):
        """`header`: the Authorization header's value (bytes; b"" when absent)."""
        if self._key is None:
            return
        given = header[7:].strip() if header[:7].lower() == b"bearer " else b""
        if not hmac.compare_digest(given, self._key):
            raise O.ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                             type_="authentication_error", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})

    def _auth_request(self, request: Request):
        self._auth(request.headers.get("authorization", "").encode("latin-1"))

    def _available(self):
        if self.state != "ok":
            why = {"loading": "the model is loading", "down": f"the coordinator at {self.endpoint} does not answer",
                   "failed": f"the ranks failed ({self.failure})"}[self.state]
            raise O.ApiError(503, why, type_="server_error", code=self.state, headers={"Retry-After": "1"})

    def _check_model(self, body):
        m = body.get("model")
        if m is not None and not isinstance(m, str):
            raise O.bad("model must be a string", "model")
        if m and self.model_name and m != self.model_name:
            raise O.ApiError(404, f"the model {m!r} does not exist; this server serves {self.model_name!r}"[:200],
                             param="model", code="model_not_found")

    async def _body(self, content_length: bytes | None, receive) -> dict:
        """The request's JSON object, read from ASGI `receive`; 413 over --max-body-bytes."""
        if content_length is not None and content_length.isdigit() and int(content_length) > self.max_body:
            raise O.ApiError(413, f"the request body of {content_length.decode()} bytes is over the limit of "
                                  f"{self.max_body}")
        parts, size, more = [], 0, True
        while more:
            m = await receive()
            if m["type"] != "http.request":        # gone before its body arrived: nobody to answer
                raise O.ApiError(400, "the client disconnected")
            parts.append(m.get("body", b""))
            size += len(parts[-1])
            more = m.get("more_body", False)
            if size > self.max_body:
                raise O.ApiError(413, f"the request body is over the limit of {self.max_body} bytes")
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        try:
            body = json.loads(data)
        except RecursionError:
            raise O.bad(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise O.bad(f"the body is not valid JSON: {e}"[:200]) from None
        if not isinstance(body, dict):
            raise O.bad("the body must be a JSON object")
        if _depth(body) > MAX_JSON_DEPTH:
            raise O.bad(f"the body nests deeper than {MAX_JSON_DEPTH} levels")
        return body

    # ------------------------------------------------------------------------------ small routes
    async def index(self, request):
        return FileResponse(os.path.join(STATIC, "index.html"), media_type="text/html")

    async def get_health(self, request):
        body = {"status": self.state, "model": self.model_name, **{k: self.health.get(k) for k in (
            "max_seq", "vocab_size", "queue", "queue_limit", "active", "chat_template")}}
        if self.failure:
            body["failure"] = self.failure
        return JSONResponse(body, status_code=200 if self.state == "ok" else 503)

    async def get_metrics(self, request):
        try:
            self._auth_request(request)
        except O.ApiError as e:
            return error_response(e)
        return PlainTextResponse(self.metrics.render(self.health if self.state == "ok" else {}),
                                 media_type="text/plain; version=0.0.4")

    def _model_card(self):
        return {"id": self.model_name or "kog", "object": "model", "created": self.created, "owned_by": "kog",
                "max_model_len": self.health.get("max_seq")}

    async def models(self, request):
        try:
            self._auth_request(request)
        except O.ApiError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        try:
            self._auth_request(request)
            self._check_model({"model": request.path_params["model"]})
        except O.ApiError as e:
            return error_response(e)
        return JSONResponse(self._model_card())

    # ------------------------------------------------------------------------------ generation
    async def generate(self, scope, receive, send, chat: bool):
        """POST /v1/completions and /v1/chat/completions, on raw ASGI: checks, then the request goes to the
        coordinator `quiet` (no `accepted` if it starts at once), and its first reply decides the answer: an
        error its status, a queued place the stream's start at once, a chunk the start with its first event.
        A disconnect at any point cancels it on the coordinator."""
        endpoint = "chat" if chat else "completions"
        t0 = time.perf_counter()
        try:
            headers = dict(scope["headers"])
            self._auth(headers.get(b"authorization", b""))
            body = await self._body(headers.get(b"content-length"), receive)
            self._check_model(body)
            self._available()
            max_seq = int(self.health.get("max_seq") or 0)
            msg = O.chat_request(body, max_seq) if chat else O.completion_request(body, max_seq)
            tools = msg.pop("_tools", None)      # tool calls: parsed out of the answer (tools_api)
            msg["quiet"] = True
            req = self.client.request(msg)
        except O.ApiError as e:
            return await self._refuse(send, endpoint, e)
        except (ClientTimeout, ServerGone) as e:
            return await self._refuse(send, endpoint, _unavailable(e))
        self.metrics.in_flight += 1
        watch = asyncio.ensure_future(_watch_disconnect(receive, req))
        try:
            cid = O.new_id("chatcmpl" if chat else "cmpl")
            model = self.model_name or "kog"
            # what the answer needs is made while the coordinator prefills, not after its first token
            sse = (T.ToolSSE if tools else _SSE)(self, req, cid, model, chat, O.include_usage(body), t0, endpoint,
                                                 watch) if msg["stream"] else None
            if tools and sse is not None:
                sse.plan = tools
            try:
                first = await req.__anext__()          # an error, a queued place, a chunk, progress, the result
            except StopAsyncIteration:                 # the client went away before anything came
                return
            except ServerError as e:
                return await self._refuse(send, endpoint, O.from_server_error(e.code, e.message))
            except (ClientTimeout, ServerGone) as e:
                return await self._refuse(send, endpoint, _unavailable(e))
            req.unread(first)
            if sse is not None:
                await sse.run(send, queued=first.get("type") == "accepted" and bool(first.get("position")))
            else:
                await self._whole(send, req, cid, model, chat, endpoint, watch, tools)
        finally:
            watch.cancel()
            self.metrics.in_flight -= 1
            if not req.done:
                req.abandon()

    async def _refuse(self, send, endpoint, e: O.ApiError):
        self.metrics.request(endpoint, e.status)
        await _send_whole(send, e.status, _json(e.body()), e.headers)

    async def _whole(self, send, req, cid, model, chat, endpoint, watch, tools=None):
        """A non-streaming completion: wait for the result."""
        status, out, headers = 200, None, {}
        try:
            async for m in req:
                if m.get("type") == "result":
                    st = m.get("stats", {})
                    self.metrics.finished(st, (st.get("queue_ms", 0) + st.get("ttft_ms", 0)) / 1000)
                    out = O.completion_body(cid, model, m, chat)
                    if tools:
                        out = T.whole(out, tools)
        except ServerError as e:
            err = O.from_server_error(e.code, e.message)
            status, out, headers = err.status, err.body(), err.headers
        except (ClientTimeout, ServerGone) as e:
            err = _unavailable(e)
            status, out, headers = err.status, err.body(), err.headers
        if out is None or (watch.done() and not watch.cancelled()):     # disconnected: nobody to answer
            return
        self.metrics.request(endpoint, status)
        await _send_whole(send, status, _json(out), headers)


def _unavailable(e) -> O.ApiError:
    return O.ApiError(503, str(e), type_="server_error", code="unavailable", headers={"Retry-After": "1"})


async def _send_whole(send, status: int, body: bytes, headers: dict):
    """A whole JSON response on raw ASGI."""
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
        *((k.lower().encode(), str(v).encode()) for k, v in headers.items())]})
    await send({"type": "http.response.body", "body": body})


def _tcp_socket(send):
    """The TCP socket under uvicorn's `send` (a bound method of its request cycle, which holds the asyncio
    transport), or None: another server, a Unix socket, or a platform without TCP_CORK."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or not hasattr(socket, "TCP_CORK") or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    return sock


async def _watch_disconnect(receive, req):
    """The client went away: cancel its request on the coordinator (within one token)."""
    while True:
        m = await receive()
        if m["type"] == "http.disconnect":
            req.abandon()
            return


class _SSE:
    """A streaming completion as server-sent events, ending in `data: [DONE]`."""

    def __init__(self, gw, req, cid, model, chat, usage, t0, endpoint, watch):
        self.gw, self.req, self.cid, self.model, self.chat, self.usage = gw, req, cid, model, chat, usage
        self.t0, self.endpoint, self.watch = t0, endpoint, watch
        self.created = int(time.time())
        self.head, self.mid = text_event_parts(cid, self.created, model, chat)
        self.head1, self.mid1 = text_event_parts(cid, self.created, model, chat, role=True)   # the first event

    def _event(self, obj) -> dict:
        return {"type": "http.response.body", "body": b"data: " + _json(obj) + b"\n\n", "more_body": True}

    async def run(self, send, queued: bool):
        # the response's start goes out with its first event, not while the prefill runs: one wake-up of the
        # client instead of two, and no write of the gateway's on cores the prefill shares (a queued request's
        # at once: its wait can be long)
        start = {"type": "http.response.start", "status": 200,
                 "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                             (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]}
        send_raw = send

        async def send_first(event):
            nonlocal send
            send = send_raw
            # uvicorn writes the start and the first event with two sends: corked, they leave as one segment
            # and wake the client once (0.05 ms of the first token's way on 2 busy cores, BENCHMARKS.md)
            sock = _tcp_socket(send_raw) if event is not None else None
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
            try:
                await send_raw(start)
                self.gw.metrics.request(self.endpoint, 200)
                if event is not None:
                    await send_raw(event)
            finally:
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)
        send = send_first
        if queued:          # behind another decode: its client hears the status now, not when this one starts
            await send_first(None)
        created, first, ttft, tokens = self.created, True, None, 0
        head, mid = self.head, self.mid
        req = self.req
        try:
            async for m in req:
                kind = m.get("type")
                if kind == "chunk":
                    text, tokens = m.get("text", ""), tokens + len(m.get("token_ids", ()))
                    if req.queue:                       # fell behind the decode: one event for all
                        more = req.ready_chunks()
                        text += "".join(c.get("text", "") for c in more)
                        tokens += sum(len(c.get("token_ids", ())) for c in more)
                    if ttft is None and tokens:
                        ttft = time.perf_counter() - self.t0
                    if first:           # kog_tokens: the ids since the last event (the page's tokens/s)
                        await send({"type": "http.response.body", "more_body": True, "body": b"".join(
                            (self.head1, encode_basestring(text).encode(), self.mid1, b"%d}\n\n" % tokens))})
                        first, tokens = False, 0
                    elif text:
                        await send({"type": "http.response.body", "more_body": True, "body": b"".join(
                            (head, encode_basestring(text).encode(), mid, b"%d}\n\n" % tokens))})
                        tokens = 0
                elif kind == "result":
                    if first and self.chat:
                        await send(self._event(O.chunk_body(self.cid, created, self.model, True, "", role=True)))
                    finish = O.FINISH.get(m.get("stop_reason"), "stop")
                    ev = O.chunk_body(self.cid, created, self.model, self.chat, None if self.chat else "", finish)
                    st = m.get("stats", {})
                    ev["kog_stats"] = st
                    await send(self._event(ev))
                    if self.usage:
                        await send(self._event({"id": self.cid, "object": ev["object"], "created": created,
                                                "model": self.model, "choices": [], "usage": O.usage(st)}))
                    self.gw.metrics.finished(st, ttft)
        except (ServerError, ClientTimeout, ServerGone) as e:
            err = O.from_server_error(e.code, e.message) if isinstance(e, ServerError) else \
                O.ApiError(503, str(e), type_="server_error")
            try:
                await send(self._event(err.body()))
            except OSError:
                pass
        except OSError:                               # the client is gone (a send failed)
            pass
        await O.end_stream(send, self.watch)


class _Generate:
    """The generation routes inside Starlette (reached when the fast path in Gateway.app does not match,
    e.g. under a root path): the same raw ASGI handler."""

    def __init__(self, gw, chat: bool):
        self.gw, self.chat = gw, chat

    async def __call__(self, scope, receive, send):
        await self.gw.generate(scope, receive, send, self.chat)
