"""The coordinator's bookkeeping: the request queue, the sessions and the KV-slot table (docs/protocol.md).

``Scheduler`` is the half of ``kog_dist.coordinator.Coordinator`` that decides what runs where:
accepting a generate/append into the bounded queue, dispatching the head of the queue to a KV slot
(the session's own slot, else the free slot with the longest shared prefix, else the least recently
used session's slot, which that session loses), turning a backend result into the `result` message,
expiring idle sessions, and the `health`/`stats` bodies. It holds no socket: the host class
(``Coordinator``) supplies ``log``, ``tokenizer``, ``draining``/``exit_code``/``t0``, and
``_reply(req, msg)`` / ``_fail(req, code, message)`` (send to a client) and ``_submit(req, cmd)``
(hand a RunCommand to the decode thread). Every method runs on the socket-loop thread.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field

from . import protocol as P
from .backend import RunCommand
from .grammar import GrammarError, compile_format
from .protocol import ProtocolError
from .sampling import SamplingParams
from .textstream import TextStream, find_stop
from .tools import chat_text


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
    owner: object = None         # _owner_key of the client that sent it (see Scheduler._mine)
    grammar: object = None       # response_format compiled (kog_dist.grammar.Grammar): each run gets a matcher
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
    ident: bytes = b""           # the connection that opened it
    owner: object = None         # and its _owner_key


@dataclass(eq=False)
class _Slot:
    tokens: list = field(default_factory=list)
    owner: object = None         # a _Session or None
    last_used: float = 0.0


def _owner_key(ident, req):
    """Whom a request or session belongs to: the client's owner token (any of its connections), else
    the connection (ZMQ routing id) it came on."""
    return ("owner", req["owner"]) if req.get("owner") else ("conn", ident)


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


class Scheduler:
    """Queue, sessions and slot table of one executor; mixed into ``Coordinator``."""

    def _init_book(self, executor, tokenizer, cfg, *, queue_limit, session_ttl_s, max_sessions,
                   max_client_sessions=8, session_ttl_max_s=600.0, queue_share=None, speculative=0):
        self.speculative = int(speculative)      # the server's draft length for requests that do not say
        self.session_ttl_max_s = float(session_ttl_max_s)
        self.queue_limit, self.session_ttl_s = int(queue_limit), min(float(session_ttl_s), self.session_ttl_max_s)
        self.max_sessions, self.max_client_sessions = max_sessions, int(max_client_sessions)
        # one client holds at most this many queue places, so a flood (or a fast retry loop on busy)
        # from one connection always leaves room for the others
        self.queue_share = max(1, self.queue_limit // 2) if queue_share is None else max(1, int(queue_share))
        self.vocab = getattr(cfg, "vocab_size", None)
        self.max_seq = int(executor.max_seq)
        self.eos = set(getattr(tokenizer, "eos_ids", ()) or ()) | set(getattr(cfg, "eos_token_ids", ()) or ())
        self.bos = getattr(tokenizer, "bos_id", None)
        self.add_bos = bool(getattr(tokenizer, "add_bos", True))   # the tokenizer's own setting (SmolLM2: no)
        self.slots = [_Slot() for _ in range(int(executor.num_slots))]
        self.sessions: dict[str, _Session] = {}
        self.queue: collections.deque[_Req] = collections.deque()
        self.active: _Req | None = None
        self.rids = itertools.count(1)
        self.counts = collections.Counter()
        self.hist = {k: collections.deque(maxlen=1024) for k in ("prefill_ms", "ttft_ms", "decode_tokens_per_s")}

    # ------------------------------------------------------------------------------ queue and sessions
    def _session(self, sid) -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            raise ProtocolError("no_session", f"no session {sid[:40]!r} (unknown, closed or expired)")
        return s

    def _mine(self, thing, ident, req) -> bool:
        """True when the caller (connection `ident`, request `req`) owns `thing` (a _Req or _Session):
        the same connection, or the same owner token."""
        return thing.ident == ident or thing.owner == _owner_key(ident, req)

    def _owned(self, things, ident, req) -> int:
        """How many of `things` the caller's connection or its owner token holds (caps count both,
        so neither new tokens on one connection nor new connections with one token escape them)."""
        key = _owner_key(ident, req)
        return sum(1 for t in things if t.ident == ident or t.owner == key)

    def _session_of(self, ident, req) -> _Session:
        s = self._session(req["session"])
        if not self._mine(s, ident, req):
            raise ProtocolError("forbidden", f"session {s.sid} belongs to another client")
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
        session = self._session_of(ident, req) if "session" in req else None
        text_prompt = "prompt" in req
        if "messages" in req:
            try:
                new_ids = [int(t) for t in _encode_chat(self.tokenizer, req["messages"], req.get("tools"))]
            except ValueError as e:
                raise ProtocolError("bad_request", f"cannot render the messages: {e}"[:200]) from None
        elif text_prompt:
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
        if session is None and len(new_ids) + (text_prompt and req.get("add_bos", self.add_bos)) > self.max_seq:
            raise ProtocolError("context_overflow",
                                f"the prompt of {len(new_ids)} tokens does not fit max_seq {self.max_seq}")
        if session is None and not new_ids and not (text_prompt and req.get("add_bos", self.add_bos)
                                                    and self.bos is not None):
            raise ProtocolError("bad_request", "the prompt is empty")
        grammar = None
        if "response_format" in req:     # compiled here: a bad schema is this request's bad_request, at once
            try:
                grammar = compile_format(req["response_format"], self.tokenizer)
            except GrammarError as e:
                raise ProtocolError("bad_request", str(e)[:400]) from None
        busy = self.active is not None or bool(self.queue)
        if busy and len(self.queue) >= self.queue_limit:
            self.counts["busy"] += 1
            raise ProtocolError("busy", f"a decode is running and {len(self.queue)} requests are queued "
                                        f"(limit {self.queue_limit})")
        if busy and self._owned(self.queue, ident, req) >= self.queue_share:
            self.counts["busy"] += 1
            raise ProtocolError("busy", f"this client holds {self.queue_share} of the {self.queue_limit} queue "
                                        "places, its share; retry when one of its requests starts")
        r = _Req(next(self.rids), ident, envelope, req["id"], req["op"], req, new_ids, text_prompt, session,
                 owner=_owner_key(ident, req), grammar=grammar)
        if session is not None:
            session.pending += 1
            session.last_used = time.monotonic()
        self.queue.append(r)
        r.position = len(self.queue) if busy else 0
        if r.position or not req.get("quiet"):
            # quiet: a request that starts at once hears first from its first chunk (a gateway saves
            # a wake-up and its work during the prefill, on cores the prefill may share)
            self._reply(r, {"type": "accepted", "position": r.position})
        self._dispatch()

    def _send_positions(self):
        for i, r in enumerate(list(self.queue), start=1):
            if r.position != i:
                r.position = i
                self._reply(r, {"type": "queued", "position": i})

    def _release(self, req: _Req):
        if req.session is not None and req.session.pending > 0 and req is not self.active:
            req.session.pending -= 1
            req.session.last_used = time.monotonic()

    def _expire_sessions(self):
        now = time.monotonic()
        for s in [s for s in self.sessions.values() if not s.pending and now - s.last_used > s.ttl_s]:
            del self.sessions[s.sid]
            self.counts["sessions_expired"] += 1
            if s.slot is not None and self.slots[s.slot].owner is s:
                self.slots[s.slot].owner = None

    # ------------------------------------------------------------------------------ running
    def _dispatch(self):
        while self.active is None and self.queue and not self.draining:
            r = self.queue[0]
            if r.position > 0 and not self._reply(r, {"type": "queued", "position": 0}):
                continue                         # gone: _lost took it off the queue
            self.queue.popleft()
            s, new = r.session, list(r.new_ids)
            # messages are the whole conversation: they replace a session's context, whose slot keeps
            # the longest common prefix (_lcp below), so a chat turn prefills only what is new
            base = s.ids if s is not None and "messages" not in r.params else []
            if (r.text_prompt and r.params.get("add_bos", self.add_bos) and not base and self.bos is not None
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
                                params=r.params, stop_ids=stop_ids, speculative=self.speculative,
                                grammar=r.grammar.matcher() if r.grammar is not None else None)
            self._submit(r, cmd)
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

    # ------------------------------------------------------------------------------ results
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
              "slot": r.slot, "evicted": r.evicted,
              **{k: int(getattr(res, k, 0)) for k in ("spec_steps", "spec_drafted", "spec_accepted")}}
        if st["spec_steps"]:
            st["spec_tokens_per_pass"] = round((st["spec_steps"] + st["spec_accepted"]) / st["spec_steps"], 3)
        if r.grammar is not None:        # the host's time a token for the mask (structured outputs)
            st["grammar_us_per_token"] = round(float(getattr(res, "grammar_ms", 0.0)) * 1e3 / n, 1) if n else 0.0
            # (cuda) tokens whose sampler waited for the host's mask, and for how long in all
            st["mask_waits"], st["mask_wait_ms"] = int(getattr(res, "mask_waits", 0)), float(getattr(res, "mask_wait_ms", 0.0))
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
        for k in ("spec_steps", "spec_drafted", "spec_accepted"):
            c[k] += st.get(k, 0)
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

    # ------------------------------------------------------------------------------ reports
    def health(self) -> dict:
        return {"status": "draining" if self.draining else "ok", "protocol": P.VERSION,
                "uptime_s": time.monotonic() - self.t0, "active": self.active.rid if self.active else None,
                "queue": len(self.queue), "queue_limit": self.queue_limit, "sessions": len(self.sessions),
                "num_slots": len(self.slots), "max_seq": self.max_seq, "vocab_size": self.vocab,
                "model": getattr(self, "model_name", None),
                "chat_template": bool(getattr(self.tokenizer, "has_chat_template", False))}

    def stats(self) -> dict:
        c = self.counts
        return {"uptime_s": time.monotonic() - self.t0,
                "requests": {k: c[k] for k in ("served", "cancelled", "errors", "busy", "bad_requests",
                                               "disconnected", "dropped", "internal_errors")},
                "tokens_generated": c["tokens_generated"], "prefill_tokens": c["prefill_tokens"],
                "reused_tokens": c["reused_tokens"],
                "speculative": {"steps": c["spec_steps"], "drafted": c["spec_drafted"],
                                "accepted": c["spec_accepted"],   # tokens a verify pass: accepted drafts + 1
                                "tokens_per_pass": round((c["spec_steps"] + c["spec_accepted"]) / c["spec_steps"], 3)
                                if c["spec_steps"] else 0.0},
                **{k: _pct(v) for k, v in self.hist.items()},
                "queue_length": len(self.queue), "queue_limit": self.queue_limit,
                "active": self.active.rid if self.active else None,
                "sessions": {"open": len(self.sessions), "opened": c["sessions_opened"],
                             "expired": c["sessions_expired"]},
                "slots": {"num_slots": len(self.slots),
                          "held_by_sessions": sum(sl.owner is not None for sl in self.slots),
                          "evictions": c["evictions"]}}


def _encode_chat(tokenizer, messages, tools=None):
    """The ids of a chat rendered with the model's template (the tokenizer's own BOS setting, never
    doubled), tools and tool turns included (kog_dist.tools.chat_text). A tokenizer without a template gets
    ChatML written as plain text, the fallback that Hugging Face tokenizers used as their default template
    (docs/protocol.md)."""
    text = chat_text(tokenizer, messages, tools)
    try:
        return tokenizer.encode(text, add_bos=None)
    except TypeError:
        return list(tokenizer.encode(text))


def _encode(tokenizer, text):
    """Token ids of text without BOS (the coordinator adds BOS at the start of a context only)."""
    try:
        return tokenizer.encode(text, add_bos=False)
    except TypeError:
        ids = list(tokenizer.encode(text))
        return ids[1:] if ids and ids[0] == getattr(tokenizer, "bos_id", None) else ids


def _make_command(*, slot, keep, append, max_new_tokens, params, stop_ids, speculative=0, grammar=None):
    sp = SamplingParams(temperature=params.get("temperature", 0.0), top_k=params.get("top_k", 0),
                        top_p=params.get("top_p", 1.0), seed=params.get("seed", 0))
    return RunCommand(slot=slot, keep=keep, append=list(append), max_new_tokens=max_new_tokens,
                      sampling=sp, stop_ids=tuple(stop_ids),
                      speculative=int(params.get("speculative", speculative)), grammar=grammar)
