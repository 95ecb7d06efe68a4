"""Tensor parallelism of a one-lane (Llama-family) model over N ranks, Megatron-style: the plan of
which heads, KV heads, FFN columns and vocabulary rows a rank owns, the read of only those slices,
and sampling decided across vocabulary shards from each shard's best candidates.

Rank r of N owns query heads [r H/N, (r+1) H/N) and the KV heads they read (KV/N of them when N divides
KV; one, replicated on N/KV ranks, when KV divides N), FFN columns [r F/N, (r+1) F/N), and vocabulary
rows [r V // N, (r+1) V // N) of the LM head. wq/wk/wv and w1/w3 are read by rows (their outputs),
wo and w2 by columns (their inputs): each rank's wo and w2 give a partial of width D, summed over the
ranks in rank order (two all-reduces a layer), so every rank holds the same residual stream. Norm
scales are copied; embedding rows are read on demand from the file, as on one rank.

The math is the one-lane spec's; only the summation order of wo and w2 (and so float32 rounding)
depends on N. Sampling over the shards reproduces kog_dist.sampling.sample on the whole logits
(sample_sharded): greedy and top-k exactly, bit for bit on the same logits; top_k = 0 up to the last
bit of the normaliser (see sample_sharded).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .checkpoint import Weights, check_finite, stored_values
from .config import LaneformerConfig
from .progress import Progress
from .sampling import SamplingParams, uniform

_QUANT_STORES = ("Q8_0", "Q4_0", "Q4_1")
QBLOCK = 32                 # weights per block of the --dtype quantized stores


@dataclasses.dataclass(frozen=True)
class TPPlan:
    rank: int
    size: int
    heads: range            # query heads (global indices)
    kv: range               # KV heads
    ffn: range              # FFN columns
    vocab: range            # LM head rows
    cfg: LaneformerConfig   # the whole model's
    local: LaneformerConfig  # this rank's shard as a one-lane config (what the engine computes)

    @property
    def kv_replicated(self) -> bool:
        return self.size > self.cfg.kv_heads


def check_tp(cfg: LaneformerConfig, size: int) -> None:
    """A one-line refusal (ValueError) when a one-lane model cannot be split over `size` ranks."""
    if size < 1:
        raise ValueError(f"--np must be >= 1, got {size}")
    if size == 1:
        return
    if cfg.num_lanes != 1:
        raise ValueError(f"tensor parallelism splits one-lane models; this one has {cfg.num_lanes} lanes")
    H, KV, F, V = cfg.num_attention_heads, cfg.kv_heads, cfg.intermediate_size, cfg.vocab_size
    ok = [n for n in range(2, H + 1) if H % n == 0 and (KV % n == 0 or n % KV == 0) and F % n == 0]
    hint = f"; rank counts this model splits into: {', '.join(map(str, [1] + ok))}"
    if H % size:
        raise ValueError(f"{size} ranks do not divide num_attention_heads={H}{hint}")
    if KV % size and size % KV:
        raise ValueError(f"{size} ranks neither divide num_key_value_heads={KV} nor are a multiple of it "
                         f"(KV heads are split, or replicated when ranks outnumber them){hint}")
    if F % size:
        raise ValueError(f"{size} ranks do not divide intermediate_size={F}{hint}")
    if V < size:
        raise ValueError(f"{size} ranks for a vocabulary of {V}")


def tp_plan(cfg: LaneformerConfig, rank: int, size: int) -> TPPlan:
    check_tp(cfg, size)
    H, KV, F, V = cfg.num_attention_heads, cfg.kv_heads, cfg.intermediate_size, cfg.vocab_size
    hl, g = H // size, H // KV
    heads = range(rank * hl, (rank + 1) * hl)
    kv = range(heads.start // g, (heads.stop - 1) // g + 1)
    fl = F // size
    ffn = range(rank * fl, (rank + 1) * fl)
    vocab = range(V * rank // size, V * (rank + 1) // size)
    local = dataclasses.replace(cfg, num_attention_heads=hl, num_key_value_heads=len(kv),
                                intermediate_size=fl, head_dim_override=cfg.head_dim)
    return TPPlan(rank, size, heads, kv, ffn, vocab, cfg, local)


# -- weights -----------------------------------------------------------------------------------------
def _slices(plan: TPPlan, name: str) -> tuple[slice | None, slice | None]:
    """(rows, columns) of a one-lane tensor that this rank reads (None: all)."""
    hd = plan.cfg.head_dim
    q = slice(plan.heads.start * hd, plan.heads.stop * hd)
    kv = slice(plan.kv.start * hd, plan.kv.stop * hd)
    f = slice(plan.ffn.start, plan.ffn.stop)
    for suffix, rc in (("attention.wq.weight", (q, None)), ("attention.bq.bias", (q, None)),
                       ("attention.wk.weight", (kv, None)), ("attention.bk.bias", (kv, None)),
                       ("attention.wv.weight", (kv, None)), ("attention.bv.bias", (kv, None)),
                       ("attention.wo.weight", (None, q)),
                       ("feed_forward.w1.weight", (f, None)), ("feed_forward.w3.weight", (f, None)),
                       ("feed_forward.w2.weight", (None, f))):
        if name.endswith(suffix):
            return rc
    return None, None


def read_block(src, name: str, rows: slice | None, cols: slice | None) -> np.ndarray:
    """float32 of rows x cols of a one-lane model's tensor (lane axis dropped): the source's own
    block reader where it has one (HF get_slice, GGUF row ranges of whole blocks), else the whole
    tensor, then sliced."""
    block = getattr(src, "block", None)
    if block is not None:
        from .checkpoint import to_float32
        return to_float32(*block(name, rows, cols))
    a = src.tensor(name)
    if a.ndim >= 2 and src.shape(name)[0] == 1 and a.shape[0] == 1:
        a = a[0]
    if rows is not None:
        a = a[rows]
    if cols is not None:
        a = a[:, cols]
    return np.ascontiguousarray(a)


class TPModel:
    """What a rank of a tensor-parallel job needs: its plan, its slices of every layer matrix (in the
    engine's layout, a lane axis of 1, shapes of plan.local), its LM head rows, embedding rows on
    demand. `cfg` is the whole model's config; `local_cfg` the shard's. store: see load_weights."""

    def __init__(self, src, rank: int, size: int, progress: bool | None = None, store: str | None = None):
        from .checkpoint import expected_tensors
        try:
            self.plan = plan = tp_plan(src.cfg, rank, size)
            self.cfg, self.local_cfg = src.cfg, plan.local
            if store in _QUANT_STORES:
                for cut, what in ((plan.heads.start * src.cfg.head_dim, "the rank's first head column"),
                                  (plan.ffn.start, "the rank's first FFN column")):
                    if cut % QBLOCK:
                        raise ValueError(f"--dtype {store.lower()} over {size} ranks: {what} ({cut}) is not "
                                         f"a multiple of its {QBLOCK}-weight blocks")
            names = [n for n in expected_tensors(src.cfg) if n not in ("model.tok_embeddings.weight",
                                                                          "lm_head.weight")]
            w = Weights()
            w.lanes = range(0, 1)
            with Progress("loading weights", len(names) + 1, enabled=bool(progress)) as bar:
                for n in names:
                    rows, cols = _slices(plan, n)
                    a = check_finite(n, read_block(src, n, rows, cols))
                    norm = "norm." in n                    # .weight, or a one-lane Laneformer's .scale [1, D]
                    if store not in (None, "F32") and ".layers." in n and not (norm or n.endswith(".bias")):
                        a = stored_values(a, store)
                    if norm:
                        a = np.broadcast_to(a.reshape(-1), (1, src.cfg.hidden_size)).copy()
                    else:
                        a = np.ascontiguousarray(a[None], dtype=np.float32)
                    w[n.replace(".scale", ".weight")] = a
                    w.nbytes_stored += a.nbytes
                    bar.advance(1)
                head = "model.tok_embeddings.weight" if src.cfg.tie_word_embeddings else "lm_head.weight"
                v = slice(plan.vocab.start, plan.vocab.stop)
                w["lm_head.weight"] = check_finite(head, read_block(src, head, v, None))
                w.nbytes_stored += w["lm_head.weight"].nbytes
                bar.advance(1)
        except BaseException:
            src.close()
            raise
        self.weights, self.src, self.reader = w, src, src
        self.dir = src.model_dir
        self.lanes = range(0, 1)

    def embed(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.cfg.vocab_size):
            raise ValueError(f"token id outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        return check_finite("model.tok_embeddings.weight",
                            self.src.tensor("model.tok_embeddings.weight", rows=ids), ids)

    def close(self) -> None:
        self.src.close()


# -- sampling over vocabulary shards -------------------------------------------------------------------
FIRST_CANDIDATES = 64        # candidates a shard sends first when top_k = 0 (more rounds when needed)
MAX_FIRST = 4096             # ... and at most, when top_k is larger


class ShardSampler:
    """One shard's part of a draw: logits [n] of vocabulary rows [v0, v0 + n)."""

    def __init__(self, logits: np.ndarray, v0: int, params: SamplingParams):
        self.x = np.asarray(logits, dtype=np.float64)
        self.v0, self.p = int(v0), params
        self.order = None

    def best(self) -> np.ndarray:
        """[max logit, its global index (lowest among equal maxima)]."""
        i = int(np.argmax(self.x))
        return np.array([self.x[i], self.v0 + i], np.float64)

    def candidates(self, top: float, count: int) -> np.ndarray:
        """The shard's first `count` candidates in draw order (probability descending, ties by lower
        index) with the global maximum `top`: rows [logit, global index]; then one row [exhausted,
        sum of all the shard's weights]."""
        if self.order is None:
            # the weights exactly as sample() computes them over the whole vocabulary: elementwise
            self.w = np.exp((self.x - top) / self.p.temperature)
            self.order = np.lexsort((np.arange(self.w.size), -self.w))
            self.total = float(self.w[self.order].sum())
        sel = self.order[:count]
        out = np.empty((len(sel) + 1, 2), np.float64)
        out[:-1, 0], out[:-1, 1] = self.x[sel], self.v0 + sel
        out[-1] = (float(len(sel) == len(self.order)), self.total)
        return out


def merge_best(bests) -> int:
    b = np.asarray(bests, np.float64).reshape(-1, 2)
    top = b[:, 0].max()
    return int(b[b[:, 0] == top, 1].min())


def decide(parts, top: float, params: SamplingParams, u: float, top_k: int) -> int | None:
    """The token sample() draws, from every shard's candidates (ShardSampler.candidates, rank order),
    or None when the candidates sent do not decide it yet (ask for more)."""
    x = np.concatenate([p[:-1, 0] for p in parts])
    idx = np.concatenate([p[:-1, 1] for p in parts]).astype(np.int64)
    w = np.exp((x - top) / params.temperature)
    order = np.lexsort((idx, -w))
    x, idx, w = x[order], idx[order], w[order]
    # the merged order is the global one up to the earliest of the cut-off shards' last candidates:
    # a candidate a shard did not send comes after every one it sent
    valid = len(w)
    for p in parts:
        if not p[-1, 0]:
            valid = min(valid, int(np.nonzero(idx == int(p[-2, 1]))[0][0]) + 1)
    complete = all(p[-1, 0] for p in parts)
    if top_k > 0:
        if valid < top_k and not complete:
            return None
        q = w[:top_k]
        q = q / q.sum()
    else:
        total = 0.0
        for p in parts:                       # the shards' sums, in rank order
            total += float(p[-1, 1])
        q = w[:valid] / total
    c = np.cumsum(q)
    n = len(q)
    if params.top_p < 1.0:
        n = int(np.searchsorted(c, params.top_p, side="left")) + 1
        if n > len(q) and not (top_k > 0 or complete):
            return None
        n = min(n, len(q))
        q = q[:n] / q[:n].sum()
        c = np.cumsum(q)
    elif top_k == 0 and not complete and not (c.size and c[-1] > u):
        return None
    i = int(np.searchsorted(c, u, side="right"))
    return int(idx[min(i, n - 1)])


def sample_sharded(sampler: ShardSampler, params: SamplingParams, counter: int, gather) -> int:
    """sample() over the whole vocabulary, decided from the shards' best candidates. `gather(f)` runs
    f on every rank's ShardSampler and returns the results in rank order (ranks: an all-gather; tests:
    a list). Greedy: each shard's maximum (exact). Otherwise the global maximum first, then each shard's
    first candidates in draw order (top_k of them, or FIRST_CANDIDATES and 4x more each round while
    the top-p cut or the draw lies past what was sent): with top_k > 0 the kept set and everything after
    are sample()'s own arithmetic on the same numbers, bit for bit. With top_k = 0 the normaliser is the
    shards' sums added in rank order, not numpy's sum over the sorted vocabulary, so it can differ in
    its last bit: a draw changes only when u falls within ~1e-16 of a boundary. The random number is
    uniform(seed, counter), the same on every rank and for every N: nothing about it depends on the split."""
    if params.greedy:
        return merge_best(gather(lambda s: s.best()))
    top = float(np.asarray(gather(lambda s: s.best()), np.float64).reshape(-1, 2)[:, 0].max())
    u = uniform(params.seed, counter)
    top_k = int(params.top_k)
    count = min(top_k, MAX_FIRST) if top_k > 0 else FIRST_CANDIDATES
    while True:
        parts = gather(lambda s: s.candidates(top, count))
        got = decide(parts, top, params, u, top_k)
        if got is not None:
            return got
        count *= 4


def split_logits(logits: np.ndarray, size: int) -> list[tuple[int, np.ndarray]]:
    """(v0, rows) of each rank's vocabulary shard, as tp_plan splits V (tests, tools)."""
    V = len(logits)
    return [(V * r // size, logits[V * r // size: V * (r + 1) // size]) for r in range(size)]


def tp_bytes_per_token(cfg: LaneformerConfig, size: int, bits: float = 16.0) -> float:
    """Weight bytes one rank streams per decoded token (layers + its LM head rows), for the cost model."""
    hd, H, KV, D, F = cfg.head_dim, cfg.num_attention_heads, cfg.kv_heads, cfg.hidden_size, cfg.intermediate_size
    kvl = max(KV // size, 1)
    per_layer = D * hd * (H // size + 2 * kvl) + D * hd * (H // size) + 3 * D * (F // size)
    return (cfg.num_hidden_layers * per_layer + D * math.ceil(cfg.vocab_size / size)) * bits / 8
