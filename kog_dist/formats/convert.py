"""`kog checkpoint convert SRC DST`: any model open_model reads, written in the Laneformer layout
(config.json + safetensors in the spec's names, q/k in interleaved order, quantized tensors as their
exact float32 values), with the tokenizer files next to it."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

from ..checkpoint import ITEMSIZE, CheckpointReader, expected_tensors, to_float32, write_safetensors_stream
from ..progress import Progress
from ..tokenizer import load_tokenizer
from . import FormatError, open_model

# The files of an HF directory that describe its tokenizer and generation defaults.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "chat_template.jinja", "chat_template.json", "added_tokens.json")
SHARD_BYTES = 2 << 30


def convert(src_path: str, dst_dir: str, dtype: str | None = None, progress: bool | None = None,
            shard_bytes: int = SHARD_BYTES) -> dict:
    """Write the model at `src_path` as a Laneformer directory `dst_dir` (new or empty). `dtype`
    None keeps each tensor's served type (F32 for dequantized GGUF tensors); "F32" | "F16" | "BF16"
    converts all. Returns a summary: {"kind", "tensors", "bytes", "files", "tokenizer"}."""
    if dtype not in (None, "F32", "F16", "BF16"):
        raise FormatError(f"dtype must be F32, F16 or BF16, got {dtype!r}")
    if os.path.exists(dst_dir) and (not os.path.isdir(dst_dir) or os.listdir(dst_dir)):
        raise FormatError(f"{dst_dir} exists and is not an empty directory: choose a new one")
    src = open_model(src_path, progress=False)
    ok = False
    try:
        os.makedirs(dst_dir, exist_ok=True)
        cfg = src.cfg
        names = list(expected_tensors(cfg))
        dts = {n: dtype or src.dtype(n) for n in names}
        sizes = {n: int(np.prod(src.shape(n), dtype=np.int64)) * ITEMSIZE[dts[n]] for n in names}
        total = sum(sizes.values())
        groups, size = [[]], 0
        for n in names:                         # shards of about shard_bytes, planned before writing
            if groups[-1] and size + sizes[n] > shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(n)
            size += sizes[n]

        def produce(n):                         # one tensor at a time: a big model never sits in memory
            bits, dt = src.raw(n)
            if dt != dts[n]:
                bits = to_float32(bits, dt)
            return bits.reshape(src.shape(n))

        if progress is None:
            progress = total > (256 << 20)
        files, wmap = [], {}
        with Progress("converting", total, enabled=progress) as bar:
            for g in groups:
                fname = f"model-{len(files) + 1:05d}.safetensors"
                write_safetensors_stream(os.path.join(dst_dir, fname), [(n, dts[n], src.shape(n)) for n in g],
                                         produce, {"format": "pt"}, bar.advance)
                files.append(fname)
                wmap.update({n: fname for n in g})
        files = _name_shards(dst_dir, files, wmap)
        d = cfg.to_dict()
        d["model_type"] = "laneformer_tp"
        d["converted_from"] = {"kind": src.kind, "name": src.name}
        with open(os.path.join(dst_dir, "config.json"), "w") as f:
            json.dump(d, f, indent=2)
        tok = _tokenizer(src, dst_dir)
        ok = True
    except OSError as e:
        raise FormatError(f"cannot write {dst_dir}: {e.strerror or e}") from None
    finally:
        src.close()
        if not ok:                              # no half-written model left behind (dst was empty)
            shutil.rmtree(dst_dir, ignore_errors=True)
    CheckpointReader(dst_dir).close()          # what was written opens and validates as a Laneformer
    return {"kind": src.kind, "tensors": len(names), "bytes": total, "files": files, "tokenizer": tok}


def _name_shards(dst_dir: str, files: list[str], wmap: dict) -> list[str]:
    """One file is model.safetensors; several are model-0000i-of-0000n with an index, as HF names them."""
    if len(files) == 1:
        os.replace(os.path.join(dst_dir, files[0]), os.path.join(dst_dir, "model.safetensors"))
        return ["model.safetensors"]
    n = len(files)
    new = {f: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, f in enumerate(files)}
    for old, nm in new.items():
        os.replace(os.path.join(dst_dir, old), os.path.join(dst_dir, nm))
    with open(os.path.join(dst_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: new[v] for k, v in wmap.items()}}, f, indent=1)
    return list(new.values())


def _tokenizer(src, dst_dir: str) -> str:
    """Copy an HF / Laneformer directory's tokenizer files; for a GGUF, write the tokenizer built from
    its tokenizer.ggml.* metadata as tokenizer.json + tokenizer_config.json."""
    if src.kind in ("hf", "laneformer"):
        copied = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(src.model_dir, f))]
        for f in copied:
            shutil.copyfile(os.path.join(src.model_dir, f), os.path.join(dst_dir, f))
        return f"copied {', '.join(copied)}" if copied else "none in the source"
    try:
        tok = load_tokenizer(src)
    except ValueError as e:
        return f"none ({e})"
    inner = getattr(tok, "_tok", None)
    if inner is None:
        return "none (the GGUF's tokenizer has no tokenizer.json form)"
    inner.save(os.path.join(dst_dir, "tokenizer.json"))
    tc = {"add_bos_token": bool(tok.add_bos)}
    if tok.bos_id is not None:
        tc["bos_token"] = tok.id_to_token(tok.bos_id)
    if tok.eos_ids:
        tc["eos_token"] = tok.id_to_token(tok.eos_ids[0])
    if tok.chat_template:
        tc["chat_template"] = tok.chat_template
    with open(os.path.join(dst_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2)
    if len(tok.eos_ids) > 1:
        with open(os.path.join(dst_dir, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": list(tok.eos_ids)}, f)
    return "written from the GGUF metadata"
