"""GGML tensor types: which ones load, and their exact float32 values (gguf's own dequantizer)."""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _dequantize
from gguf.quants import quantize

# Served as they are stored (no conversion): GGML type -> the dtype name raw() reports.
PLAIN = {GGMLQuantizationType.F32: "F32", GGMLQuantizationType.F16: "F16", GGMLQuantizationType.BF16: "BF16"}
# Dequantized to float32 when read, by gguf's numpy dequantizer (exact for these: a port of ggml's
# dequantize_row_*, and what transformers' GGUF loader computes with).
QUANTIZED = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
             GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q2_K,
             GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
             GGMLQuantizationType.Q6_K)
# The i-quants, ternary and FP4 types: loaded the same way, never kept quantized by a backend (the cuda
# one says so in a line and stores them as BF16). Those of this gguf version only.
DEQUANTIZED_ONLY = tuple(getattr(GGMLQuantizationType, n) for n in (
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
    "MXFP4", "NVFP4") if hasattr(GGMLQuantizationType, n))
QUANTIZED = QUANTIZED + DEQUANTIZED_ONLY
SUPPORTED_NAMES = tuple(t.name for t in (*PLAIN, *QUANTIZED))


def supported(qtype: GGMLQuantizationType) -> bool:
    return qtype in PLAIN or qtype in QUANTIZED


def served_dtype(qtype: GGMLQuantizationType) -> str:
    return PLAIN.get(qtype, "F32")


def storage_bits(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """A GGUF tensor's data (as gguf's reader gives it: typed for F32/F16, bytes otherwise) in the
    form raw() serves: float32, float16, BF16 as uint16 bits, quantized types dequantized to float32."""
    if qtype == GGMLQuantizationType.F32:
        return np.asarray(data, dtype=np.float32)
    if qtype == GGMLQuantizationType.F16:
        return np.asarray(data, dtype=np.float16)
    if qtype == GGMLQuantizationType.BF16:
        return np.ascontiguousarray(data).view(np.uint16)
    return dequantize_rows(data, qtype)


# Elements per dequantize call: gguf's numpy dequantizer makes several temporaries the size of its
# input; slices of about 32K values keep them in cache (1.5-2x faster than whole tensors on this
# machine's two cores, the same values: every row is whole blocks).
CHUNK = 1 << 15


def dequantize_rows(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf.quants.dequantize, a few rows at a time, of a [rows, bytes] tensor."""
    if data.ndim != 2:
        return _dequantize(data, qtype)
    block, tsize = GGML_QUANT_SIZES[qtype]
    cols = data.shape[1] // tsize * block
    out = np.empty((data.shape[0], cols), np.float32)
    step = max(1, CHUNK // max(cols, 1))
    for s in range(0, data.shape[0], step):
        out[s:s + step] = _dequantize(data[s:s + step], qtype)
    return out


STORE_TYPES = {"Q8_0": GGMLQuantizationType.Q8_0, "Q4_0": GGMLQuantizationType.Q4_0,
               "Q4_1": GGMLQuantizationType.Q4_1}


def round_trip(a: np.ndarray, name: str) -> np.ndarray:
    """The float32 values a matrix takes once stored as `name` (Q8_0 / Q4_0 / Q4_1: gguf.quants' round to
    nearest, then its exact dequantization): what every backend computes with under `--dtype name`."""
    qtype = STORE_TYPES[name]
    if a.shape[-1] % 32:
        raise ValueError(f"--dtype {name.lower()} needs rows of a multiple of 32 weights, got {a.shape[-1]}")
    flat = np.ascontiguousarray(a, dtype=np.float32).reshape(-1, a.shape[-1])
    return dequantize_rows(quantize(flat, qtype), qtype).reshape(a.shape).astype(np.float32, copy=False)
