"""A one-line progress bar on stderr for long work (loading weights, compiling kernels)."""
from __future__ import annotations

import sys
import time


class Progress:
    """`with Progress("loading weights", total_bytes) as p: p.advance(n)`.

    Redraws in place on a terminal; elsewhere (logs, CI) prints a line at every quarter.
    """

    def __init__(self, label: str, total: float, unit: str = "B", enabled: bool = True, stream=None):
        self.label, self.total, self.unit = label, max(float(total), 1.0), unit
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.done = 0.0
        self.t0 = time.perf_counter()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._next_quarter = 0.25

    def _fmt(self, v: float) -> str:
        if self.unit == "B":
            for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
                if self.total >= s:
                    return f"{v / s:.2f} {u}"
            return f"{v:.0f} B"
        return f"{v:.0f}{self.unit}"

    def advance(self, n: float) -> None:
        self.done += n
        if not self.enabled:
            return
        frac = min(self.done / self.total, 1.0)
        if self._tty:
            bar = "#" * int(frac * 30)
            self.stream.write(f"\r{self.label} [{bar:<30}] {frac * 100:5.1f}% "
                              f"{self._fmt(self.done)}/{self._fmt(self.total)}")
            self.stream.flush()
        elif frac >= self._next_quarter:
            while frac >= self._next_quarter:
                self._next_quarter += 0.25
            self.stream.write(f"{self.label}: {frac * 100:.0f}% ({self._fmt(self.done)})\n")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled and exc[0] is None:
            dt = time.perf_counter() - self.t0
            end = "\r" if self._tty else ""
            self.stream.write(f"{end}{self.label}: done, {self._fmt(self.done)} in {dt:.1f} s"
                              f"{' ' * 20 if self._tty else ''}\n")
            self.stream.flush()
