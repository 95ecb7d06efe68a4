"""A Hugging Face directory (config.json, model.safetensors in fp16, tokenizer.json) of a named one-lane shape
with random weights, for measurements that need a served model of a real model's size where the real file
cannot travel (the device takes 64 MiB a call): e.g. bench/serve_overhead.py on the GPU with the SmolLM2-135M
shape. The tokenizer comes from a GGUF (the default model's) or a tokenizer.json.

    python3 bench/random_hf_model.py --shape smollm2-135m --tokenizer-from FILE.gguf|tokenizer.json OUT_DIR
    python3 bench/random_hf_model.py --tokenizer-from FILE.gguf --tokenizer-only OUT_DIR   (just tokenizer.json)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from hf_reference import random_hf_tensors, write_hf_dir  # noqa: E402
from kog_dist.shapes import SHAPES  # noqa: E402


def hf_config(name: str) -> dict:
    s = dict(SHAPES[name])
    if s.get("num_lanes", 1) != 1:
        raise SystemExit(f"{name} is not a one-lane shape")
    keep = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
            "eos_token_id")
    c = {k: s[k] for k in keep if k in s}
    c.update(model_type="qwen2" if s.get("attention_bias") else "llama", rms_norm_eps=s.get("norm_eps", 1e-5),
             hidden_act="silu", torch_dtype="float16")
    return c


def write_tokenizer(src: str, out: str) -> None:
    if src.endswith(".json"):   # a tokenizer.json, and the tokenizer_config.json beside it if there is one
        shutil.copy(src, os.path.join(out, "tokenizer.json"))
        tc = os.path.join(os.path.dirname(src), "tokenizer_config.json")
        if os.path.isfile(tc):
            shutil.copy(tc, os.path.join(out, "tokenizer_config.json"))
        return
    from kog_dist.formats import open_model
    from kog_dist.tokenizer import load_tokenizer
    m = open_model(src)
    tok = load_tokenizer(m)
    tok._tok.save(os.path.join(out, "tokenizer.json"))   # the tokenizers.Tokenizer built from the GGUF's fields
    name = tok._tok.id_to_token
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": name(tok.bos_id) if tok.bos_id is not None else None,
                   "eos_token": name(tok.eos_ids[0]) if tok.eos_ids else None, "add_bos_token": tok.add_bos}, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shape", default="smollm2-135m", choices=[n for n, s in SHAPES.items() if s.get("num_lanes") == 1])
    ap.add_argument("--tokenizer-from", required=True)
    ap.add_argument("--tokenizer-only", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    write_tokenizer(a.tokenizer_from, a.out)
    if a.tokenizer_only:
        return 0
    c = hf_config(a.shape)
    # the tests' writer of random HF directories (HF names, qwen2's biases, untied heads), cast to fp16
    t = {k: v.astype(np.float16) for k, v in random_hf_tensors(c, seed=a.seed).items()}
    write_hf_dir(a.out, c, t)
    print(f"random_hf_model.py: {a.shape} in {a.out} ({sum(x.nbytes for x in t.values()) / 1e6:.0f} MB, fp16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
