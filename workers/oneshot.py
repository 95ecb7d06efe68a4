"""One request as `kog generate` gives it: the command built from its arguments (here, so that the
rank program's --oneshot mode builds exactly the same one) and the result printed as text or JSON."""
from __future__ import annotations

import json
import sys

from kog_dist.backend import RunCommand
from kog_dist.grammar import GrammarError, compile_format
from kog_dist.sampling import SamplingParams
from kog_dist.speculative import default_draft
from kog_dist.tp import check_tp


def prompt_ids(a, tok) -> list[int]:
    """--prompt-ids as given; --prompt through the model's chat template when it has one (a user turn,
    after --system if given; --raw: the text as it is), else the text encoded with the tokenizer's own
    bos rule."""
    if a.prompt_ids is not None:
        return list(a.prompt_ids)
    if not getattr(a, "raw", False) and getattr(tok, "has_chat_template", False):
        system = getattr(a, "system", None)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": a.prompt}]
        return tok.encode_chat(messages)
    return tok.encode(a.prompt)


def end_of_turn_ids(cfg, tok) -> tuple[int, ...]:
    """The tokenizer's end-of-turn ids that the config's eos does not already stop on."""
    return tuple(i for i in getattr(tok, "eos_ids", ()) if i not in cfg.eos_token_ids and 0 <= i < cfg.vocab_size)


def check_rank_count(cfg, nranks: int) -> None:
    """A rank count the model can be split into, or a one-line refusal: whole lanes a rank for a
    Laneformer; for a one-lane (Llama-family) model, tensor parallelism's rules (kog_dist.tp.check_tp)."""
    if cfg.num_lanes == 1:
        check_tp(cfg, nranks)
        return
    cfg.lanes_of_rank(0, nranks)


def build_request(a, cfg, tok, backend: str = "cpu") -> tuple[list[int], RunCommand]:
    """The command of `kog generate`'s flags; `backend` (the kind that runs it) picks the default draft length."""
    ids = prompt_ids(a, tok)
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
    k = getattr(a, "speculative", None)
    cmd = RunCommand(slot=0, keep=0, append=ids, max_new_tokens=a.max_new_tokens, sampling=sp,
                     stop_ids=tuple(a.stop_ids) + end_of_turn_ids(cfg, tok),
                     speculative=default_draft(backend) if k is None else int(k))
    if getattr(a, "json_schema", None):
        cmd.grammar = _schema_grammar(a.json_schema, tok).matcher()
    return ids, cmd


def _schema_grammar(path: str, tok):
    """--json-schema FILE compiled for the tokenizer; a one-line ValueError for a file or schema that cannot be."""
    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"--json-schema {path}: not a readable JSON file: {str(e).splitlines()[0][:160]}") from None
    try:
        return compile_format({"type": "json_schema", "schema": schema}, tok)
    except GrammarError as e:
        raise ValueError(f"--json-schema {path}: {e}") from None


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
