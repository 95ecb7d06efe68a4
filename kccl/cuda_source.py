"""CUDA sources for NVRTC: local #include "..." files inlined once each (NVRTC has no include path to
the package), shared by the monokernel and kccl's device code."""
from __future__ import annotations

import os
import re


def inline_sources(paths, seen: set | None = None) -> str:
    """The text of `paths` with their local includes inlined (each file once, #pragma once dropped)."""
    return "".join(s for _, s in _pieces(paths, set() if seen is None else seen))


def inlined_line_files(paths) -> list:
    """The file (base name) of each line of inline_sources(paths), line n at index n - 1: to map a compiler's
    line numbers in the inlined text back to the sources (bench/spills_by_file.py)."""
    files = []
    pieces = _pieces(paths, set())
    for name, s in pieces:
        files += [name] * s.count("\n")
    if pieces and not pieces[-1][1].endswith("\n"):
        files.append(pieces[-1][0])
    return files


def _pieces(paths, seen: set) -> list:
    """(file base name, line) of the inlined text in order; the paths' texts joined by a newline."""
    out = []
    for k, p in enumerate(paths):
        if k:
            out.append((out[-1][0] if out else os.path.basename(p), "\n"))
        out += _inline(p, seen)
    return out


def _inline(path: str, seen: set) -> list:
    out = []
    for line in open(path):
        m = re.match(r'\s*#include\s+"([^"]+)"', line)
        if m:
            inc = os.path.join(os.path.dirname(path), m.group(1))
            if inc not in seen:
                seen.add(inc)
                out += _inline(inc, seen)
            continue
        if line.strip() != "#pragma once":
            out.append((os.path.basename(path), line))
    return out
