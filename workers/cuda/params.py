"""The monokernel's parameters, listed once: `struct Params` in mk_layout.cuh. The host reads the field
list from that header and packs the words by field name (every field is 8 bytes: pointers and u64 as
uint64, long long as int64, double as float64; arrays as consecutive words), so the struct and the
packing cannot drift apart by an index."""
from __future__ import annotations

import os
import re

import numpy as np

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mk_layout.cuh")
_FIELD = re.compile(r"(?:const\s+)?(long long|\w+)\s*(\*?)\s*(\w+)(?:\[(\d+)\])?;$")
_KINDS = {"long long": "i64", "double": "f64", "u64": "u64"}


def read_layout(text: str | None = None, skip: tuple = ("CFG_MASK",)) -> dict[str, tuple[int, int, str]]:
    """name -> (first word, words, kind "u64" | "i64" | "f64"), in the struct's order. The fields under an
    `#if COND` whose COND is in `skip` are left out (they take no words: that build compiles them out); the
    others are included, so the default layout has the fields of `#if KOG_NRANKS > 1` (the host fills them for
    several ranks only) and not those of `#if CFG_MASK` (the one-rank build of structured outputs, which comes
    in their place: MASK_LAYOUT)."""
    if text is None:
        with open(HEADER) as f:
            text = f.read()
    start = text.index("struct Params {")
    body = text[start:text.index("};", start)]
    out, word, cond = {}, 0, None
    for line in body.splitlines()[1:]:
        code = line.split("//")[0].strip()
        if code.startswith("#if"):
            cond = code[3:].strip()
            continue
        if code.startswith("#endif"):
            cond = None
            continue
        if not code or code.startswith("#") or cond in skip:
            continue
        m = _FIELD.match(code)
        if not m:
            raise ValueError(f"mk_layout.cuh: a Params line this reader does not know: {code!r}")
        ctype, star, name, count = m.group(1), m.group(2), m.group(3), int(m.group(4) or 1)
        kind = "u64" if star else _KINDS.get(ctype)
        if kind is None:
            raise ValueError(f"mk_layout.cuh: Params field {name} of type {ctype} is not 8 bytes")
        out[name] = (word, count, kind)
        word += count
    return out


LAYOUT = read_layout()
MASK_LAYOUT = read_layout(skip=("KOG_NRANKS > 1",))   # CFG_MASK 1 (one rank): its fields after the common ones
MR_MASK_LAYOUT = read_layout(skip=())                 # CFG_MASK 1, several ranks: after the multi-rank fields


class ParamWords:
    """The host copy of Params: `p["temperature"] = 0.7`, `p["stop_ids"] = [5, 9]`; `p.words` the uint64
    array passed to the launch."""

    def __init__(self, n_words: int, layout: dict = LAYOUT):
        need = max(w + n for w, n, _ in layout.values())
        if need > n_words:
            raise ValueError(f"Params has {need} words, the host buffer {n_words}")
        self.layout, self.words = layout, np.zeros(n_words, np.uint64)
        self._views = {"u64": self.words, "i64": self.words.view(np.int64), "f64": self.words.view(np.float64)}

    def __setitem__(self, name: str, value) -> None:
        word, count, kind = self.layout[name]
        view = self._views[kind]
        if count == 1:
            view[word] = np.uint64(int(value) & ((1 << 64) - 1)) if kind == "u64" else value
            return
        values = list(value)
        if len(values) > count:
            raise ValueError(f"Params.{name} holds {count} values, got {len(values)}")
        view[word:word + len(values)] = values
