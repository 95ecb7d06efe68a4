"""Progress of long work (loading, dequantizing, uploading, converting) on stderr, through tqdm.

On a terminal the bar redraws in place; elsewhere (logs, CI) tqdm would write a carriage-return line
per update, so there the bar prints one plain line at each quarter instead, and a last line with the
time taken either way."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    """`with Progress("loading weights", total_bytes) as p: p.advance(n)`."""

    def __init__(self, label: str, total: float, unit: str = "B", enabled: bool = True, stream=None):
        self.label, self.total, self.unit = label, max(float(total), 1.0), unit
        self.stream = stream or sys.stderr
        self.enabled, self.done, self.t0 = enabled, 0.0, time.perf_counter()
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar = tqdm(total=self.total, desc=label, unit=unit.strip() or "it", unit_scale=unit == "B",
                         file=self.stream, leave=False, dynamic_ncols=True) if enabled and tty else None
        self._next_quarter = 0.25
        self._last = ""

    def _fmt(self, v: float) -> str:
        if self.unit == "B":
            return tqdm.format_sizeof(v, "B")
        return f"{v:.0f}{self.unit}"

    def advance(self, n: float) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled:
            frac = min(self.done / self.total, 1.0)
            if frac >= self._next_quarter:
                while frac >= self._next_quarter:
                    self._next_quarter += 0.25
                pct = f"{frac * 100:.0f}%"
                if pct != self._last:         # 99.9% and 100% print alike: once
                    self.stream.write(f"{self.label}: {pct} ({self._fmt(self.done)})\n")
                    self.stream.flush()
                self._last = pct

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()
        if self.enabled and exc[0] is None:
            self.stream.write(f"{self.label}: done, {self._fmt(self.done)} in "
                              f"{time.perf_counter() - self.t0:.1f} s\n")
            self.stream.flush()
