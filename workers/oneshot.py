"""One request as `kog generate` gives it: the command built from its arguments (here, so that the
rank program's --oneshot mode builds exactly the same one) and the result printed as text or JSON."""
from __future__ import annotations

import json
import sys

from kog_dist.backend import RunCommand
from kog_dist.sampling import SamplingParams


def build_request(a, cfg, tok) -> tuple[list[int], RunCommand]:
    ids = list(a.prompt_ids) if a.prompt_ids is not None else tok.encode(a.prompt)
    if not ids:
        raise ValueError("empty prompt: give at least one token")
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ValueError(f"prompt id {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    limit = min(a.max_seq or cfg.max_position_embeddings, cfg.max_position_embeddings)
    if len(ids) > limit:
        raise ValueError(f"prompt of {len(ids)} tokens exceeds the context limit of {limit}")
    sp = SamplingParams(a.temperature, a.top_k, a.top_p, a.seed).validate()
    if a.max_new_tokens < 0:
        raise ValueError("--max-new-tokens must be >= 0")
    cmd = RunCommand(slot=0, keep=0, append=ids, max_new_tokens=a.max_new_tokens, sampling=sp,
                     stop_ids=tuple(a.stop_ids))
    return ids, cmd


def result_json(ids, res, tok, backend: str, ranks: int, model_dir: str) -> dict:
    return {"token_ids": res.token_ids, "text": tok.decode(res.token_ids), "prompt_tokens": len(ids),
            "stats": res.stats(), "backend": backend, "ranks": ranks, "model": model_dir}


def emit(out: dict, as_json: bool) -> None:
    streamed = out.pop("streamed", False)
    if as_json:
        print(json.dumps(out))
        return
    s = out["stats"]
    print("" if streamed else out["text"])
    print(f"\n[{out['backend']} x{out['ranks']}] prompt {out['prompt_tokens']} tokens, prefill "
          f"{s['prefill_ms']:.1f} ms, {s['new_tokens']} new tokens, decode {s['decode_tokens_per_s']:.1f} tok/s "
          f"(stop: {s['stop_reason']})", file=sys.stderr)
