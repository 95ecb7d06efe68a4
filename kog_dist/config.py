"""Laneformer configuration: config.json read exactly as spec/laneformer.md's table says."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields

import numpy as np


class ConfigError(ValueError):
    """A config that cannot describe a Laneformer; the message is one line."""


@dataclass(frozen=True)
class LaneformerConfig:
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    intermediate_size: int = 16384
    vocab_size: int = 128256
    num_lanes: int = 1
    broadcast_delay: int = 1
    use_comm: bool = True
    use_early_comm: bool = True
    early_layers_to_future: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    sliding_window: int | None = None
    sliding_window_n_layers: int = 0
    lm_head_type: str = "replicate"
    replicated_rmsn_scale: bool = True
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    eos_token_id: int | list | None = None
    bos_token_id: int | list | None = None
    model_type: str = "laneformer_tp"
    # Llama-family additions (spec, "Llama-family checkpoints"); the defaults keep a Laneformer as it was.
    attention_bias: bool = False              # q/k/v biases [L, rows], added before RoPE
    rope_scaling: dict | None = None          # {"rope_type": "llama3", ...} or {"rope_type": "factors", ...}
    head_dim_override: int | None = None      # HF head_dim when it differs from D / H
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # -- derived shapes ------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads if self.num_key_value_heads is None else self.num_key_value_heads

    @property
    def head_dim(self) -> int:
        if self.head_dim_override is not None:
            return self.head_dim_override
        return self.hidden_size // self.num_attention_heads

    @property
    def heads_per_lane(self) -> int:
        return self.num_attention_heads // self.num_lanes

    @property
    def kv_heads_per_lane(self) -> int:
        return self.kv_heads // self.num_lanes

    @property
    def ffn_per_lane(self) -> int:
        return self.intermediate_size // self.num_lanes

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return _int_tuple(self.eos_token_id)

    @property
    def bos_token_ids(self) -> tuple[int, ...]:
        return _int_tuple(self.bos_token_id)

    def is_sliding(self, layer: int) -> bool:
        """Spec: S > 0 slides layers i < S; S < 0 slides the last -S layers; no window, no sliding."""
        if self.sliding_window is None:
            return False
        s = self.sliding_window_n_layers
        if s >= 0:
            return layer < s
        return layer >= self.num_hidden_layers + s

    def lanes_of_rank(self, rank: int, nranks: int) -> range:
        if nranks <= 0 or self.num_lanes % nranks:
            raise ConfigError(f"{nranks} ranks do not divide num_lanes={self.num_lanes}; "
                              f"use a rank count from {divisors(self.num_lanes)}")
        per = self.num_lanes // nranks
        return range(rank * per, (rank + 1) * per)

    # -- validation ----------------------------------------------------------------------------
    def validate(self) -> "LaneformerConfig":
        ints = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size", "num_lanes", "max_position_embeddings")
        for name in ints:
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {_short(v)}")
            if v > LIMITS[name]:
                raise ConfigError(f"{name}={v} is more than this runtime takes ({LIMITS[name]} at most)")
        N = self.num_hidden_layers
        if not _is_int(self.broadcast_delay) or self.broadcast_delay < 1:
            raise ConfigError(f"broadcast_delay must be an integer >= 1, got {_short(self.broadcast_delay)}")
        # A delay of N already makes every layer an early one (no partial arrives later): a larger one
        # means nothing more, only deeper exchange rings. One lane sends no partials at all.
        delay_max = N if self.num_lanes > 1 else max(N, ONE_LANE_DELAY_MAX)
        if self.broadcast_delay > delay_max:
            raise ConfigError(f"broadcast_delay={self.broadcast_delay} is more than num_hidden_layers={N}"
                              + ("" if self.num_lanes > 1 else f" (and {ONE_LANE_DELAY_MAX})")
                              + ": the delay counts layers, so it must be at most the layer count")
        if self.num_key_value_heads is not None and (not _is_int(self.num_key_value_heads)
                                                     or self.num_key_value_heads <= 0):
            raise ConfigError(f"num_key_value_heads must be a positive integer or null, "
                              f"got {_short(self.num_key_value_heads)}")
        H, KV, L = self.num_attention_heads, self.kv_heads, self.num_lanes
        if self.head_dim_override is not None:
            if not _is_int(self.head_dim_override) or self.head_dim_override <= 0:
                raise ConfigError(f"head_dim must be a positive integer, got {_short(self.head_dim_override)}")
        elif self.hidden_size % H:
            raise ConfigError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={H}")
        if self.head_dim > HEAD_DIM_MAX:
            raise ConfigError(f"head_dim={self.head_dim} is more than this runtime takes ({HEAD_DIM_MAX} at most)")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if H % L:
            raise ConfigError(f"num_attention_heads={H} is not divisible by num_lanes={L}")
        if KV % L:
            raise ConfigError(f"num_key_value_heads={KV} is not divisible by num_lanes={L}")
        if H % KV:
            raise ConfigError(f"num_key_value_heads={KV} does not divide num_attention_heads={H}")
        if self.intermediate_size % L:
            raise ConfigError(f"intermediate_size={self.intermediate_size} is not divisible by num_lanes={L}")
        if self.lm_head_type != "replicate":
            raise ConfigError(f"lm_head_type={_short(self.lm_head_type)} is not supported (only 'replicate')")
        if self.sliding_window is not None and (not _is_int(self.sliding_window) or self.sliding_window < 1
                                                or self.sliding_window > LIMITS["max_position_embeddings"]):
            raise ConfigError(f"sliding_window must be an integer in 1..{LIMITS['max_position_embeddings']} "
                              f"or null, got {_short(self.sliding_window)}")
        S = self.sliding_window_n_layers
        if not _is_int(S) or abs(S) > N:
            raise ConfigError(f"sliding_window_n_layers must be an integer in -{N}..{N} "
                              f"(num_hidden_layers={N}), got {_short(S)}")
        for name, lo, hi in (("rope_theta", 1.0, ROPE_THETA_MAX), ("norm_eps", 0.0, 1.0)):
            v = getattr(self, name)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or not (lo < v <= hi or (name == "rope_theta" and v == lo))):
                raise ConfigError(f"{name} must be a finite number in ({lo:g}, {hi:g}], got {_short(v)}")
        for name in ("use_comm", "use_early_comm", "early_layers_to_future", "replicated_rmsn_scale",
                     "tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {_short(getattr(self, name))}")
        for name in ("eos_token_id", "bos_token_id"):
            try:
                ids = _int_tuple(getattr(self, name))
            except (TypeError, ValueError):
                raise ConfigError(f"{name} must be an integer or a list of integers") from None
            if any(i < 0 or i >= self.vocab_size for i in ids):
                raise ConfigError(f"{name}={_short(getattr(self, name))} is outside the vocabulary")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling, self.head_dim)
        return self

    # -- io ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "LaneformerConfig":
        if not isinstance(d, dict):
            raise ConfigError("config.json must hold a JSON object")
        mt = d.get("model_type", "laneformer_tp")
        if mt not in ("laneformer_tp", "laneformer"):
            raise ConfigError(f"model_type {_short(mt)} is not a Laneformer ('laneformer_tp')")
        known = {f.name for f in fields(cls)} - {"extra"}
        kw = {k: v for k, v in d.items() if k in known}
        D, H = d.get("hidden_size", 4096), d.get("num_attention_heads", 32)
        derived = D // H if _is_int(D) and _is_int(H) and H > 0 else None
        if d.get("head_dim") is not None and d["head_dim"] != (d.get("head_dim_override") or derived):
            raise ConfigError(f"head_dim={_short(d['head_dim'])} disagrees with hidden_size/num_attention_heads "
                              f"(a different head_dim is given as head_dim_override)")
        try:
            cfg = cls(**kw, extra={k: v for k, v in d.items() if k not in known})
        except TypeError as e:  # pragma: no cover - dataclass rejects nothing we pass
            raise ConfigError(str(e)) from None
        return cfg.validate()

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {k: v for k, v in d.items() if v is not None or k == "num_key_value_heads"}


# Bounds on what a config may ask for: far above every published model, low enough that no value
# makes an allocation or a loop unbounded (issue 32: a context of 10^12 was taken as it came).
LIMITS = {"hidden_size": 1 << 16, "num_hidden_layers": 1024, "num_attention_heads": 1024,
          "intermediate_size": 1 << 20, "vocab_size": 1 << 22, "num_lanes": 1024,
          "max_position_embeddings": 1 << 24}
HEAD_DIM_MAX = 1024
ROPE_THETA_MAX = 1e12
ONE_LANE_DELAY_MAX = 16


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def kv_cache_bytes(cfg: LaneformerConfig, seq: int, lanes: int | None = None, itemsize: int = 4) -> int:
    """Bytes of K and V for one sequence of `seq` positions over `lanes` lanes (None: all)."""
    lanes = cfg.num_lanes if lanes is None else lanes
    return 2 * cfg.num_hidden_layers * cfg.kv_heads_per_lane * lanes * cfg.head_dim * int(seq) * itemsize


def machine_memory() -> int | None:
    """Physical memory of this machine in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_context_fits(cfg: LaneformerConfig, max_seq: int | None = None, itemsize: int = 4,
                       memory: int | None = None) -> int:
    """The context limit (max_seq, or the model's) if one sequence's KV cache at that length fits in
    this machine's memory; a ConfigError saying what it needs, what there is and what --max-seq fits
    otherwise."""
    seq = min(max_seq or cfg.max_position_embeddings, cfg.max_position_embeddings)
    memory = machine_memory() if memory is None else memory
    need = kv_cache_bytes(cfg, seq, itemsize=itemsize)
    if memory and need > memory:
        fit = max(1, memory // 2 // max(1, kv_cache_bytes(cfg, 1, itemsize=itemsize)))
        raise ConfigError(f"a context of {seq} tokens needs {need / 2**30:.1f} GiB of KV cache, more than this "
                          f"machine's {memory / 2**30:.1f} GiB: pass a smaller --max-seq (e.g. {fit})")
    return seq


def load_config(model_dir: str) -> LaneformerConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        raise ConfigError(f"model directory {model_dir} does not exist")
    if not os.path.isfile(path):
        raise ConfigError(f"{path} not found")
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {str(e).splitlines()[0]}") from None
    return LaneformerConfig.from_dict(d)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_tuple(v) -> tuple[int, ...]:
    if v is None:
        return ()
    if _is_int(v):
        return (v,)
    if isinstance(v, (list, tuple)) and all(_is_int(x) for x in v):
        return tuple(v)
    raise TypeError("not an int or list of ints")


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_type(scaling: dict) -> str:
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _check_rope_scaling(sc, hd: int) -> None:
    if not isinstance(sc, dict):
        raise ConfigError(f"rope_scaling must be an object or null, got {_short(sc)}")
    kind = rope_type(sc)
    if kind == "llama3":
        for k in LLAMA3_KEYS:
            v = sc.get(k)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v > 0
                    or v > LIMITS["max_position_embeddings"]):
                raise ConfigError(f"rope_scaling (llama3) needs a positive finite {k}, got {_short(v)}")
        if not sc["high_freq_factor"] > sc["low_freq_factor"]:
            raise ConfigError("rope_scaling (llama3) needs high_freq_factor > low_freq_factor")
    elif kind == "factors":
        # llama.cpp's form of the same scaling (a GGUF's rope_freqs.weight): inverse frequencies divided
        # by one factor per pair.
        f = sc.get("factors")
        if (not isinstance(f, (list, tuple)) or len(f) != hd // 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                           and x > 0 for x in f)):
            raise ConfigError(f"rope_scaling (factors) needs {hd // 2} positive finite factors")
    else:
        raise ConfigError(f"rope_scaling type {_short(kind)} is not supported (supported: llama3)")


def rope_inv_freq(cfg: LaneformerConfig):
    """theta^(-2k/hd) for k in [0, hd/2): the angle per position of each interleaved pair, with the
    spec's llama3 rope_scaling applied when the config has it."""
    hd = cfg.head_dim
    w = [cfg.rope_theta ** (-2.0 * k / hd) for k in range(hd // 2)]
    sc = cfg.rope_scaling
    if sc is not None and rope_type(sc) == "llama3":
        f, a, b = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        M = float(sc["original_max_position_embeddings"])
        out = []
        for wk in w:
            wavelength = 2.0 * math.pi / wk
            if wavelength < M / b:
                out.append(wk)
            elif wavelength > M / a:
                out.append(wk / f)
            else:
                s = (M / wavelength - a) / (b - a)
                out.append((1.0 - s) * wk / f + s * wk)
        w = out
    elif sc is not None and rope_type(sc) == "factors":
        w = [wk / float(fk) for wk, fk in zip(w, sc["factors"])]
    return np.array(w, dtype=np.float64)

