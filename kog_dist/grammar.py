"""Structured outputs (core): a grammar that a request's tokens must follow, from llguidance.

    fmt = check_format({"type": "json_schema", "schema": {...}})   # GrammarError: one line
    g = compile_format(fmt, tokenizer)      # the library's own errors and unsupported keywords, one line
    m = g.matcher()                         # per request: the grammar's state
    m.mask(logits)                          # before sampling: every token the grammar forbids gets -inf
    m.accept(token)                         # after: advance the state

A format is what the protocol's `response_format` carries: {"type": "json_object"} (any JSON object),
{"type": "json_schema", "schema": S} (OpenAI's {"json_schema": {"name", "schema", "strict"}} is taken too),
or {"type": "lark", "grammar": G} (llguidance's Lark dialect: the tool calls' grammars are built this way).
llguidance was picked over xgrammar by measurement (bench/grammar_mask.py, BENCHMARKS.md "Structured outputs
(issue 55)"): on the default model's 49152-token vocabulary its mask costs tens of microseconds a token, and it
needs no PyTorch. The grammar allows the tokenizer's end-of-turn token once the object is complete, and
nothing else then, so a decode under it ends with EOS (complete) or at max_new_tokens ("length").
"""
from __future__ import annotations

import json
import threading
import time

import numpy as np

MAX_GRAMMAR_CHARS = 256 << 10


class GrammarError(ValueError):
    """A format that cannot be compiled; the message is one line (the library's own where it has one)."""


def _llg():
    try:
        import llguidance
    except ImportError as e:      # pragma: no cover - a dependency in pyproject.toml
        raise GrammarError(f"structured outputs need llguidance (pip install llguidance): {e}") from None
    return llguidance


def check_format(fmt) -> dict | None:
    """A normalised copy of a response_format, or None for {"type": "text"} / None; GrammarError otherwise."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise GrammarError('response_format must be an object with a type: "text", "json_object", "json_schema"'
                           ' or "lark"')
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        inner = fmt.get("json_schema")
        if schema is None and isinstance(inner, dict):      # OpenAI's shape
            schema = inner.get("schema", {})
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise GrammarError("response_format json_schema needs a schema: a JSON Schema object")
        if len(json.dumps(schema)) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the schema is over {MAX_GRAMMAR_CHARS} characters")
        return {"type": "json_schema", "schema": schema}
    if kind == "lark":
        g = fmt.get("grammar")
        if not isinstance(g, str) or not 0 < len(g) <= MAX_GRAMMAR_CHARS:
            raise GrammarError(f"response_format lark needs a grammar: a string of 1..{MAX_GRAMMAR_CHARS} characters")
        return {"type": "lark", "grammar": g}
    raise GrammarError(f'response_format type must be "text", "json_object", "json_schema" or "lark", got {kind!r}'[:160])


def grammar_source(fmt: dict) -> str:
    """The llguidance grammar (its JSON form) of a checked format."""
    llg = _llg()
    try:
        if fmt["type"] == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"})
        if fmt["type"] == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(fmt["schema"])
        return llg.LLMatcher.grammar_from_lark(fmt["grammar"])
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid {fmt['type'].replace('_', ' ')}: {_line(e)}") from None


def _line(e) -> str:
    text = str(e).strip() or type(e).__name__
    return " ".join(text.split())[:300]


_tokenizers: dict = {}
_tok_lock = threading.Lock()


def ll_tokenizer(tokenizer):
    """llguidance's view of a kog tokenizer (an HFTokenizer over `tokenizers`), made once (~0.2 s) and cached."""
    key = id(tokenizer)
    with _tok_lock:
        hit = _tokenizers.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        inner = getattr(tokenizer, "_tok", None)
        if inner is None or not hasattr(inner, "to_str"):
            raise GrammarError("structured outputs need the model's own tokenizer (tokenizer.json or GGUF); "
                               "this model has none")
        eos = list(getattr(tokenizer, "eos_ids", ()) or ())
        lt = _llg().LLTokenizer(inner.to_str(), n_vocab=int(tokenizer.vocab_size), eos_token=eos or None)
        _tokenizers[key] = (tokenizer, lt)
        return lt


class Grammar:
    """A compiled format for one tokenizer; `matcher()` gives each request its own state."""

    def __init__(self, fmt: dict, source: str, lltok, vocab_size: int):
        self.format, self.source, self.lltok, self.vocab_size = fmt, source, lltok, int(vocab_size)

    def matcher(self) -> "Matcher":
        return Matcher(self)


def compile_format(fmt, tokenizer) -> Grammar:
    """Check and compile a response_format for this tokenizer; GrammarError with the library's message."""
    fmt = check_format(fmt)
    if fmt is None:
        raise GrammarError("response_format text needs no grammar")
    src = grammar_source(fmt)
    lt = ll_tokenizer(tokenizer)
    _validate(fmt, src, lt)
    return Grammar(fmt, src, lt, getattr(tokenizer, "vocab_size", lt.vocab_size))


def check_schema(schema) -> None:
    """A JSON Schema that llguidance can enforce, checked without a tokenizer (tool parameters); GrammarError."""
    fmt = check_format({"type": "json_schema", "schema": schema})
    _validate(fmt, grammar_source(fmt), None)


def _validate(fmt, src, lt) -> None:
    is_err, msgs = _llg().LLMatcher.validate_grammar_with_warnings(src, lt)
    if is_err:     # llguidance names what it cannot enforce ("Unimplemented keys: [...]") rather than drop it
        msg = _line(msgs[0] if msgs else "rejected")
        what = "unsupported JSON Schema feature" if msg.startswith("Unimplemented keys") else "invalid"
        raise GrammarError(f"{what} in the {fmt['type'].replace('_', ' ')}: {msg}")


def apply_bitmask(logits: np.ndarray, bits: np.ndarray, v0: int = 0) -> np.ndarray:
    """A copy of logits (its dtype) of vocabulary rows v0.. with -inf where bit i of the packed int32 mask is 0:
    one pass to unpack the bits, one to write the row."""
    n = logits.shape[-1]
    allowed = np.unpackbits(bits.view(np.uint8), bitorder="little", count=v0 + n)[v0:].view(bool)
    return np.where(allowed, logits, logits.dtype.type(-np.inf))


class Matcher:
    """One request's grammar state. `mask_s` sums the host's time spent computing and applying masks."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.m = _llg().LLMatcher(grammar.lltok, grammar.source, log_level=0)
        if self.m.is_error():
            raise GrammarError(f"the grammar failed to start: {_line(self.m.get_error())}")
        self.bits = np.zeros((grammar.lltok.vocab_size + 31) // 32, dtype=np.int32)
        self.mask_s, self.tokens = 0.0, 0

    def mask(self, logits: np.ndarray, v0: int = 0) -> np.ndarray:
        """A masked copy of one row of logits (its own dtype) of vocabulary rows v0.. (a tensor-parallel shard's;
        0: the whole vocabulary): only the tokens the grammar allows stay."""
        t = time.perf_counter()
        self.m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        if not self.bits.any():              # nothing allowed: only a broken grammar gets here
            raise GrammarError(f"the grammar allows no token: {_line(self.m.get_error() or 'dead end')}")
        out = apply_bitmask(np.asarray(logits), self.bits, v0)
        self.mask_s += time.perf_counter() - t
        self.tokens += 1
        return out

    def mask_into(self, words: np.ndarray) -> None:
        """The next token's mask written into `words` (a contiguous 4-byte array of at least len(self.bits) words;
        bit i & 31 of word i >> 5 set where token i is allowed), not applied: the cuda backend's host-mapped
        mask, which its kernel applies (workers/cuda/mask.py). GrammarError when the grammar allows nothing."""
        t = time.perf_counter()
        n = self.bits.size
        if words.dtype.itemsize != 4 or words.size < n or not words.flags.c_contiguous:
            raise ValueError(f"the mask needs {n} contiguous 4-byte words")
        self.m.unsafe_compute_mask_ptr(words.ctypes.data, n * 4)
        if not words[:n].any():
            raise GrammarError(f"the grammar allows no token: {_line(self.m.get_error() or 'dead end')}")
        self.mask_s += time.perf_counter() - t
        self.tokens += 1

    def allows(self, token: int) -> bool:
        return bool((int(self.bits[token >> 5]) >> (token & 31)) & 1)

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False when the grammar refuses it (it then stays in error)."""
        return bool(self.m.consume_token(int(token)))

    def rollback(self, n: int) -> None:
        if n > 0:
            self.m.rollback(int(n))

    @property
    def done(self) -> bool:
        """The grammar is complete and takes nothing more but EOS."""
        return bool(self.m.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self.m.is_accepting())

    def stats(self) -> dict:
        return {"grammar_tokens": self.tokens,
                "grammar_us_per_token": round(self.mask_s * 1e6 / self.tokens, 1) if self.tokens else 0.0}
