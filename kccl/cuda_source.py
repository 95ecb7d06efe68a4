"""CUDA sources for NVRTC: local #include "..." files inlined once each (NVRTC has no include path to
the package), shared by the monokernel and kccl's device code."""
from __future__ import annotations

import os
import re


def inline_sources(paths, seen: set | None = None) -> str:
    """The text of `paths` with their local includes inlined (each file once, #pragma once dropped)."""
    seen = set() if seen is None else seen
    return "\n".join(_inline(p, seen) for p in paths)


def _inline(path: str, seen: set) -> str:
    out = []
    for line in open(path):
        m = re.match(r'\s*#include\s+"([^"]+)"', line)
        if m:
            inc = os.path.join(os.path.dirname(path), m.group(1))
            if inc not in seen:
                seen.add(inc)
                out.append(_inline(inc, seen))
            continue
        if line.strip() != "#pragma once":
            out.append(line)
    return "".join(out)
