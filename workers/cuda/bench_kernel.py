"""Helpers to see where a decode step's time goes: the monokernel's per-phase clock marks
(backend.run(..., timing_token=k)) turned into a critical-path breakdown."""
from __future__ import annotations

import numpy as np

KINDS = ("qkv", "att", "wo", "w13", "w2")


def phase_breakdown(timing: np.ndarray, num_layers: int, num_lanes: int | None = None) -> dict:
    """timing [5N+2, blocks, 3 or 5] globaltimer ns (0 = block had no work; mk_layout.cuh tmark). Returns,
    per phase kind, summed over layers: the time from the end of the previous phase (last block) to the
    end of this one (last block); the median per-block wait (entry -> inputs ready) and busy (inputs
    ready -> done); with 5 marks also the median staging (inputs ready -> row loop), rows (the row loop)
    and signal (rows done -> done) times, and the tail (median block's end -> last block's end). Also
    "layer_us": each layer's span (from the previous layer's last W2 end; layer 0 from the token) and
    "lm_after_layers_us", the LM head's after them. With num_lanes, when the blocks split evenly over the
    lanes (block b serves lane b // (blocks / lanes) in every phase), also "lanes": when each lane's chain
    ends (its last block's W2 of the last layer) and how far the slowest lane trails the median one: the LM
    head waits for the slowest."""
    t = timing.astype(np.int64)
    N = num_layers
    tok = t[5 * N + 1]
    start_candidates = tok[:, 1][tok[:, 1] > 0]
    start = int(start_candidates.max()) if start_candidates.size else int(t[0, :, 0][t[0, :, 0] > 0].min())
    keys = ("critical_us", "wait_us", "busy_us", "stage_us", "rows_us", "signal_us", "tail_us")
    out = {k: dict.fromkeys(keys, 0.0) for k in KINDS + ("lm",)}
    prev = start
    for ph in list(range(5 * N)) + [5 * N]:
        kind = "lm" if ph == 5 * N else KINDS[ph % 5]
        m = t[ph]
        ok = (m[:, 2] > 0) & (m[:, 1] > 0)
        if not ok.any():
            continue
        end = int(m[ok, 2].max())
        o = out[kind]
        o["critical_us"] += (end - prev) / 1e3
        o["wait_us"] += float(np.median(m[ok, 1] - m[ok, 0])) / 1e3
        o["busy_us"] += float(np.median(m[ok, 2] - m[ok, 1])) / 1e3
        o["tail_us"] += (end - float(np.median(m[ok, 2]))) / 1e3
        if m.shape[1] >= 5:
            fine = ok & (m[:, 3] > 0) & (m[:, 4] > 0)
            if fine.any():
                o["stage_us"] += float(np.median(m[fine, 3] - m[fine, 1])) / 1e3
                o["rows_us"] += float(np.median(m[fine, 4] - m[fine, 3])) / 1e3
                o["signal_us"] += float(np.median(m[fine, 2] - m[fine, 4])) / 1e3
        prev = end
    out["total_us"] = (prev - start) / 1e3
    # each layer from the previous one's last W2 (layer 0: from the token) to its own; then the LM head
    ends = [int(t[5 * i + 4, :, 2].max()) for i in range(N)]
    if all(e > 0 for e in ends) and prev > ends[-1]:
        out["layer_us"] = [round((e - b) / 1e3, 1) for b, e in zip([start] + ends[:-1], ends)]
        out["lm_after_layers_us"] = round((prev - ends[-1]) / 1e3, 1)
    nb = t.shape[1]
    if num_lanes and num_lanes > 1 and nb % num_lanes == 0:
        last = t[5 * N - 1, :, 2].reshape(num_lanes, nb // num_lanes)
        if (last > 0).all():
            ends = (last.max(axis=1) - start) / 1e3
            out["lanes"] = {"end_us": [round(float(e), 1) for e in ends],
                            "slowest_minus_median_us": float(ends.max() - np.median(ends))}
    return out


def format_breakdown(b: dict, streamed: dict | None = None) -> str:
    fine = any(b[k]["rows_us"] > 0 for k in KINDS)
    head = "phase | critical path us | median wait us | median busy us"
    head += " | stage us | rows us | signal us | tail us" if fine else ""
    lines = [head + (" | GB/s on path" if streamed else "")]
    for k in KINDS + ("lm",):
        x = b[k]
        row = f"{k} | {x['critical_us']:.1f} | {x['wait_us']:.1f} | {x['busy_us']:.1f}"
        if fine:
            row += f" | {x['stage_us']:.1f} | {x['rows_us']:.1f} | {x['signal_us']:.1f} | {x['tail_us']:.1f}"
        if streamed and k in streamed and x["critical_us"] > 0:
            row += f" | {streamed[k] / (x['critical_us'] * 1e3):.0f}"
        lines.append(row)
    lines.append(f"total (token wait end -> LM end) | {b['total_us']:.1f}")
    if "layer_us" in b:
        lines.append(f"layers (us, the last block's W2 end to the next) | {' '.join(f'{x:.1f}' for x in b['layer_us'])}"
                     f" | LM head {b['lm_after_layers_us']:.1f}")
    if "lanes" in b:
        ln = b["lanes"]
        lines.append(f"lane chains end (us) | {' '.join(f'{e:.1f}' for e in ln['end_us'])} | slowest - median "
                     f"{ln['slowest_minus_median_us']:.1f}")
    return "\n".join(lines)


def streamed_by_kind(cfg, itemsize: int) -> dict:
    L, D, hd = cfg.num_lanes, cfg.hidden_size, cfg.head_dim
    rqkv = (cfg.heads_per_lane + 2 * cfg.kv_heads_per_lane) * hd
    hdl, fl, N = cfg.heads_per_lane * hd, cfg.ffn_per_lane, cfg.num_hidden_layers
    return {"qkv": N * L * rqkv * D * itemsize, "wo": N * L * D * hdl * itemsize,
            "w13": N * L * 2 * fl * D * itemsize, "w2": N * L * D * fl * itemsize,
            "lm": cfg.vocab_size * D * itemsize}
