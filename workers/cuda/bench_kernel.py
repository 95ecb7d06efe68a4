"""Helpers to see where a decode step's time goes: the monokernel's per-phase clock marks
(backend.run(..., timing_token=k)) turned into a critical-path breakdown."""
from __future__ import annotations

import numpy as np

KINDS = ("qkv", "att", "wo", "w13", "w2")


def phase_breakdown(timing: np.ndarray, num_layers: int) -> dict:
    """timing [5N+2, blocks, 3] globaltimer ns (0 = block had no work). Returns, per phase kind, the time
    from the end of the previous phase (last block) to the end of this one (last block), summed over
    layers, plus median per-block wait (entry -> inputs ready) and busy (inputs ready -> done)."""
    t = timing.astype(np.int64)
    N = num_layers
    tok = t[5 * N + 1]
    start_candidates = tok[:, 1][tok[:, 1] > 0]
    start = int(start_candidates.max()) if start_candidates.size else int(t[0, :, 0][t[0, :, 0] > 0].min())
    out = {k: {"critical_us": 0.0, "wait_us": 0.0, "busy_us": 0.0} for k in KINDS + ("lm",)}
    prev = start
    order = list(range(5 * N)) + [5 * N]
    for ph in order:
        kind = "lm" if ph == 5 * N else KINDS[ph % 5]
        m = t[ph]
        ok = (m[:, 2] > 0) & (m[:, 1] > 0)
        if not ok.any():
            continue
        end = int(m[ok, 2].max())
        out[kind]["critical_us"] += (end - prev) / 1e3
        out[kind]["wait_us"] += float(np.median(m[ok, 1] - m[ok, 0])) / 1e3
        out[kind]["busy_us"] += float(np.median(m[ok, 2] - m[ok, 1])) / 1e3
        prev = end
    out["total_us"] = (prev - start) / 1e3
    return out


def format_breakdown(b: dict, streamed: dict | None = None) -> str:
    lines = ["phase | critical path us | median wait us | median busy us" + (" | GB/s on path" if streamed else "")]
    for k in KINDS + ("lm",):
        x = b[k]
        gbs = ""
        if streamed and k in streamed and x["critical_us"] > 0:
            gbs = f" | {streamed[k] / (x['critical_us'] * 1e3):.0f}"
        lines.append(f"{k} | {x['critical_us']:.1f} | {x['wait_us']:.1f} | {x['busy_us']:.1f}{gbs}")
    lines.append(f"total (token wait end -> LM end) | {b['total_us']:.1f}")
    return "\n".join(lines)


def streamed_by_kind(cfg, itemsize: int) -> dict:
    L, D, hd = cfg.num_lanes, cfg.hidden_size, cfg.head_dim
    rqkv = (cfg.heads_per_lane + 2 * cfg.kv_heads_per_lane) * hd
    hdl, fl, N = cfg.heads_per_lane * hd, cfg.ffn_per_lane, cfg.num_hidden_layers
    return {"qkv": N * L * rqkv * D * itemsize, "wo": N * L * D * hdl * itemsize,
            "w13": N * L * 2 * fl * D * itemsize, "w2": N * L * D * fl * itemsize,
            "lm": cfg.vocab_size * D * itemsize}
