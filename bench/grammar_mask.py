"""The host's cost a token of a structured-output mask, llguidance against xgrammar, on the default model's
tokenizer (SmolLM2-135M-Instruct, 49152 tokens): for each token of a valid JSON answer, compute the next-token
bitmask, apply it to a float32 logits row, and advance the matcher by the token. Prints the medians and p90s in
microseconds, the one-time costs (the tokenizer's and the grammar's compile), and the same for {"type": "json_object"}.
With --decode N: the cpu backend's decode tokens/s on the model itself, a greedy answer under the schema against the
same number of tokens unconstrained, alternated N times (medians), and the host's mask time a token inside it.

    python3 bench/grammar_mask.py [--model FILE.gguf] [--reps 20] [--decode 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "email", "tags", "address", "active"], "additionalProperties": False}
ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
          "tags": ["mathematician", "writer", "analytical engine"],
          "address": {"city": "London", "zip": "W1"}, "active": True}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def llguidance_run(tok, ids, schema, reps):
    import llguidance
    from kog_dist.grammar import apply_bitmask
    t = time.perf_counter()
    lt = llguidance.LLTokenizer(tok._tok.to_str(), n_vocab=tok.vocab_size, eos_token=list(tok.eos_ids))
    t_tok = time.perf_counter() - t
    grm = (llguidance.LLMatcher.grammar_from_json_schema(schema) if schema is not None
           else llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}))
    fill, apply_, adv, compile_ms = [], [], [], []
    mask = np.zeros((lt.vocab_size + 31) // 32, dtype=np.int32)
    logits = np.random.default_rng(0).standard_normal(tok.vocab_size).astype(np.float32)
    for _ in range(reps):
        t = time.perf_counter()
        m = llguidance.LLMatcher(lt, grm)
        compile_ms.append((time.perf_counter() - t) * 1e3)
        for i in ids:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            t1 = time.perf_counter()
            t1b = time.perf_counter()
            x = apply_bitmask(logits, mask)
            t2 = time.perf_counter()
            assert (mask[i >> 5] >> (i & 31)) & 1, f"token {i} masked out"
            assert m.consume_token(i), m.get_error()
            t3 = time.perf_counter()
            fill.append(t1 - t0); apply_.append(t2 - t1b); adv.append(t3 - t2)
        assert m.is_accepting()
    return t_tok, compile_ms, fill, apply_, adv


def xgrammar_run(tok, ids, schema, reps):
    import torch
    import transformers
    import xgrammar as xgr
    from kog_dist.grammar import apply_bitmask
    t = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok._tok)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size, stop_token_ids=list(tok.eos_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t_tok = time.perf_counter() - t
    fill, apply_, adv, compile_ms = [], [], [], []
    mask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    logits = np.random.default_rng(0).standard_normal(tok.vocab_size).astype(np.float32)
    for r in range(reps):
        t = time.perf_counter()
        if schema is not None:
            cg = compiler.compile_json_schema(json.dumps(schema) + " " * r)   # no cache hit
        else:
            cg = compiler.compile_builtin_json_grammar()
        m = xgr.GrammarMatcher(cg)
        compile_ms.append((time.perf_counter() - t) * 1e3)
        for i in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            t1 = time.perf_counter()
            t1b = time.perf_counter()
            x = apply_bitmask(logits, mask.numpy()[0])
            t2 = time.perf_counter()
            assert m.accept_token(i), f"token {i} refused"
            t3 = time.perf_counter()
            fill.append(t1 - t0); apply_.append(t2 - t1b); adv.append(t3 - t2)
        assert m.is_terminated() or m.accept_token(tok.eos_ids[0])
    del torch
    return t_tok, compile_ms, fill, apply_, adv


def decode_cost(model, tok, reps, n_max=96):
    """(tokens/s plain, tokens/s constrained, mask us a token, tokens, paired ratios) on the cpu backend: both
    decode n_max tokens (the schema's answer is longer than that), medians of reps."""
    from kog_dist.backend import RunCommand
    from kog_dist.formats import open_model
    from kog_dist.grammar import compile_format
    from workers.factory import make_backend
    backend, _ = make_backend("cpu", open_model(model), max_seq=1024, num_slots=1, dtype=None)
    g = compile_format({"type": "json_schema", "schema": SCHEMA}, tok)
    ids = tok.encode_chat([{"role": "user", "content": "Describe Ada Lovelace as JSON: name, age, email, tags, "
                                                       "address (city, zip) and whether she is active."}])
    plain, constrained, mask_us, n = [], [], [], 0
    for i in range(reps):     # alternated, each first in turn: a load that comes and goes falls on both
        for kind in (("g", "p") if i % 2 == 0 else ("p", "g")):
            if kind == "g":
                r = backend.run(RunCommand(slot=0, keep=0, append=ids, max_new_tokens=n_max, grammar=g.matcher()))
                n = len(r.token_ids)
                constrained.append(r.decode_tokens_per_s)
                mask_us.append(r.grammar_ms * 1e3 / n)
            else:
                r = backend.run(RunCommand(slot=0, keep=0, append=ids, max_new_tokens=n_max), ignore_eos=True)
                plain.append(r.decode_tokens_per_s)
    ratios = sorted(c / p for c, p in zip(constrained, plain))
    return statistics.median(plain), statistics.median(constrained), statistics.median(mask_us), n, ratios


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--decode", type=int, default=0, metavar="N", help="also the decode tokens/s, N alternated runs")
    a = ap.parse_args()
    from kog_dist.formats import open_model
    from kog_dist.models import resolve_model
    from kog_dist.tokenizer import load_tokenizer
    model = resolve_model(a.model)
    tok = load_tokenizer(open_model(model))
    rows = []
    for label, schema in (("json_schema", SCHEMA), ("json_object", None)):
        text = json.dumps(ANSWER)
        ids = tok.encode(text, add_bos=False)
        for lib, fn in (("llguidance", llguidance_run), ("xgrammar", xgrammar_run)):
            try:
                t_tok, comp, fill, apply_, adv = fn(tok, ids, schema, a.reps)
            except ImportError as e:     # xgrammar (and the torch / transformers it needs) is not a dependency
                print(f"{lib}: not installed ({e}); pip install {lib} to compare", file=sys.stderr)
                continue
            us = lambda xs, q: pct(xs, q) * 1e6
            tot = [f + p + v for f, p, v in zip(fill, apply_, adv)]
            rows.append(dict(schema=label, library=lib, tokens=len(ids), tokenizer_s=round(t_tok, 2),
                             compile_ms=round(statistics.median(comp), 2),
                             mask_us_p50=round(us(fill, .5), 1), mask_us_p90=round(us(fill, .9), 1),
                             apply_us_p50=round(us(apply_, .5), 1), advance_us_p50=round(us(adv, .5), 1),
                             total_us_p50=round(us(tot, .5), 1), total_us_p90=round(us(tot, .9), 1)))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| schema | library | tokenizer (s, once) | compile (ms) | mask p50 / p90 (us) | apply p50 | advance p50 "
          "| all p50 / p90 (us) |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['schema']} | {r['library']} | {r['tokenizer_s']} | {r['compile_ms']} | {r['mask_us_p50']} / "
              f"{r['mask_us_p90']} | {r['apply_us_p50']} | {r['advance_us_p50']} | {r['total_us_p50']} / "
              f"{r['total_us_p90']} |")
    if a.decode:
        p, c, us, n, ratios = decode_cost(model, tok, a.decode)
        print(f"\ncpu backend, greedy, {n} tokens, medians of {a.decode}: plain {p:.1f} tok/s, under the schema "
              f"{c:.1f} tok/s ({c / p:.3f}x; paired ratios {', '.join(f'{x:.3f}' for x in ratios)}), the host's "
              f"mask {us:.0f} us a token")


if __name__ == "__main__":
    main()
