"""One opener for every model format the runtime serves (spec/laneformer.md, "Llama-family
checkpoints"): a Laneformer directory, a Hugging Face Llama-family directory (llama, mistral, qwen2;
safetensors) or a GGUF file of the llama architecture. Each becomes a tensor source in Laneformer
names (one lane for real models: lane-first tensors carry a leading axis of 1) with its config.

    src = open_model(path)          # src.kind, .path, .name, .cfg, .model_dir, .gguf_fields
    src.raw(name, lanes, rows)      # (storage bits, "F32" | "F16" | "BF16"), as CheckpointReader.raw
    src.tensor(name, lanes, rows)   # float32
"""
from __future__ import annotations

import json
import os

from ..checkpoint import CheckpointError, CheckpointReader
from ..config import ConfigError
from .base import FormatError, ModelSource
from .gguf_file import GGUF_MAGIC, GGUFSource
from .hf import HF_MODEL_TYPES, HFSource

__all__ = ["open_model", "FormatError", "ModelSource", "SUPPORTED"]

LANEFORMER_TYPES = ("laneformer_tp", "laneformer")
SUPPORTED = ("a Laneformer directory, a Hugging Face directory (model_type "
             + ", ".join(HF_MODEL_TYPES) + ") or a .gguf file of the llama architecture")


def open_model(path, progress: bool | None = None):
    """Open `path` as whichever format it is; a FormatError (one line) for anything else.
    `progress`: None = a bar on stderr for big loads, False = quiet, True = always."""
    if not isinstance(path, (str, os.PathLike)):
        raise FormatError(f"a model path must be a string, got {type(path).__name__}")
    p = os.path.abspath(os.fspath(path))
    if not os.path.exists(p):
        raise FormatError(f"model {path} does not exist (supported: {SUPPORTED})")
    if os.path.isfile(p):
        src = _open_file(p, path)
    elif os.path.isdir(p):
        src = _open_dir(p, path)
    else:
        raise FormatError(f"{path} is neither a file nor a directory (supported: {SUPPORTED})")
    src.progress = progress
    return src


def _open_file(p: str, shown) -> ModelSource:
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise FormatError(f"cannot read {shown}: {e.strerror}") from None
    if magic == GGUF_MAGIC:
        return GGUFSource(p)
    if p.endswith(".gguf"):
        raise FormatError(f"{shown} is not a GGUF file (its first bytes are {magic!r}, not b'GGUF')")
    if os.path.basename(p) == "config.json" or p.endswith(".safetensors"):
        raise FormatError(f"{shown} is one file of a model directory: pass the directory "
                          f"{os.path.dirname(shown) or '.'}")
    raise FormatError(f"{shown} is not a model file (supported: {SUPPORTED})")


def _open_dir(p: str, shown) -> ModelSource:
    cpath = os.path.join(p, "config.json")
    if not os.path.isfile(cpath):
        ggufs = sorted(n for n in os.listdir(p) if n.endswith(".gguf"))
        hint = f"; pass the GGUF file itself, e.g. {os.path.join(shown, ggufs[0])}" if ggufs else ""
        raise FormatError(f"config.json not found in {shown}{hint} (supported: {SUPPORTED})")
    try:
        with open(cpath, "rb") as f:
            d = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FormatError(f"{cpath} is not valid JSON: {(str(e).splitlines() or ['too deeply nested'])[0]}") from None
    if not isinstance(d, dict):
        raise FormatError(f"{cpath} must hold a JSON object")
    mt = d.get("model_type", "laneformer_tp")
    if not isinstance(mt, str):
        raise FormatError(f"{cpath}: model_type must be a string (supported: {SUPPORTED})")
    if mt in LANEFORMER_TYPES:
        try:
            return CheckpointReader(p)
        except (CheckpointError, ConfigError) as e:
            raise FormatError(str(e)) from None
    if mt in HF_MODEL_TYPES:
        return HFSource(p, d)
    raise FormatError(f"{shown}: model_type {mt!r} is not supported (supported: {SUPPORTED})")
