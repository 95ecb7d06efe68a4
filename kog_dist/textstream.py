"""Streaming text out of token ids with stop strings, for the coordinator's decode thread."""
from __future__ import annotations


class TextStream:
    """Incremental detokenisation with stop strings (runs on the decode thread).

    ``feed(id)`` returns True once the text contains a stop string; ``take()`` returns the newly
    releasable text: never past a stop string, and holding back any tail that could still begin one.
    The text of a terminal token (EOS or a stop id) is not part of the text. Text comes from the
    tokenizer's ``stream()`` (one step per id, never half a UTF-8 character); a tokenizer without
    one is decoded over a short window of recent ids instead."""

    def __init__(self, tokenizer, stop, terminal):
        self.tok, self.stop, self.terminal = tokenizer, stop, terminal
        self.maxstop = max((len(s) for s in stop), default=0)
        make = getattr(tokenizer, "stream", None)
        self.dec = make() if callable(make) else _WindowDecoder(tokenizer)
        self.text, self.released, self.hit = "", 0, None

    def feed(self, t: int) -> bool:
        if self.hit is not None or t in self.terminal:
            return self.hit is not None
        piece = self.dec.step(t)
        if piece:
            start = max(0, len(self.text) - self.maxstop + 1)
            self.text += piece
            self.hit = find_stop(self.text, self.stop, start)
        return self.hit is not None

    def take(self) -> str:
        end = len(self.text) if self.hit is None else self.hit
        if self.hit is None:
            for k in range(min(self.maxstop - 1, end), 0, -1):
                if any(s.startswith(self.text[end - k:end]) for s in self.stop):
                    end -= k
                    break
        out = self.text[self.released:end] if end > self.released else ""
        self.released = max(self.released, end)
        return out


class _WindowDecoder:
    """step() for a tokenizer that only has decode(ids): the text the new id adds to the ids since
    the last complete piece, held back while it ends in a replacement character (a split UTF-8)."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def step(self, t: int) -> str:
        self.ids.append(t)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""


def find_stop(text: str, stop, start: int = 0):
    """Index of the earliest stop string in text[start:] (None when there is none)."""
    hits = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(hits) if hits else None
