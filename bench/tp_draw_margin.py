"""Where one rank's and N cuda ranks' sampled ids part: the draw's margin there. The tensor-parallel ranks sum a
token's partials in another order than one rank, so their logits differ in the last bits; a seeded draw then
differs only where the uniform u lies that close to a boundary of the cumulative distribution. This replays one
rank's draws from its own logits (dbg_logits; the grammar's mask where a schema is given, kog_dist.sampling's
rule) and prints, for each case, whether the replay is the kernel's ids, the first index where N ranks
(`kog generate --np N --backend cuda`, the same prompt ids) differ, u's distance to the nearest boundary there
and the smallest distance over the run. GPU machine, the default model (bench/put_model.sh), under MPS:

    PYTHONPATH=.:/tmp/site python3 bench/tp_draw_margin.py [--np 3] [--tokens 48]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def margins(logits, ids, sp, P, matcher):
    """(replay ids, u's distance to the nearest cumulative boundary, per token) from one rank's logits."""
    from kog_dist.sampling import draw
    out, dist = [], []
    for i, t in enumerate(ids):
        tok, margin = draw(matcher.mask(logits[i]) if matcher is not None else logits[i], sp, P + i)
        out.append(tok)
        dist.append(margin)
        if matcher is not None:
            matcher.accept(t)
    return out, dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--np", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()
    import cupy as cp
    from kog_dist.backend import RunCommand
    from kog_dist.formats import open_model
    from kog_dist.grammar import compile_format
    from kog_dist.models import default_gguf_path
    from kog_dist.sampling import SamplingParams
    from kog_dist.tokenizer import load_tokenizer
    from workers.cuda.backend import CudaBackend
    path = default_gguf_path()
    src = open_model(path, progress=False)
    tok = load_tokenizer(src)
    ids = tok.encode_chat([{"role": "user", "content": "Ada Lovelace as JSON"}])
    g = compile_format({"type": "json_schema", "schema": PERSON}, tok)
    b = CudaBackend(src, max_seq=512, num_slots=1, progress=False)
    schema = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(PERSON, schema)
    schema.close()
    N, V = a.tokens, src.cfg.vocab_size
    for T, seed, constrained in ((0.9, 7, True), (0.9, 7, False), (0.9, 8, True), (0.9, 9, True), (1.0, 5, False)):
        sp = SamplingParams(T, 0, 1.0, seed)
        dbg = cp.zeros((N, V), cp.float32)
        r = b.run(RunCommand(append=list(ids), max_new_tokens=N, sampling=sp, grammar=g.matcher() if constrained else None,
                             stop_ids=tuple(tok.eos_ids)), dbg_logits=dbg)
        one = r.token_ids
        replay, dist = margins(dbg.get()[:len(one)], one, sp, len(ids), g.matcher() if constrained else None)
        cmd = [sys.executable, "-m", "kog_cli", "generate", "--np", str(a.np), "--backend", "cuda", "--json",
               "--prompt-ids", ",".join(map(str, ids)), "-n", str(N), "--temperature", str(T), "--seed", str(seed)]
        if constrained:
            cmd += ["--json-schema", schema.name]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if p.returncode:
            print(f"T {T} seed {seed} schema {constrained}: {a.np} ranks failed: {p.stderr[-400:]}")
            continue
        many = json.loads(p.stdout)["token_ids"]
        i = next((k for k, (x, y) in enumerate(zip(one, many)) if x != y), None)
        at = f"first difference at {i}: {one[i]} vs {many[i]}, u's margin there {dist[i]:.2e}" if i is not None \
            else f"the same {min(len(one), len(many))} ids"
        print(f"T {T} seed {seed} schema {constrained}: replay == kernel {replay == one}; {a.np} ranks: {at}; "
              f"smallest margin {min(dist):.2e} at {int(np.argmin(dist))}; {len(one)} tokens")
    b.close()


if __name__ == "__main__":
    main()
