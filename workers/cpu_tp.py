"""The cpu backend's tensor parallelism of a one-lane (Llama-family) model over the ranks of a job
(kog_dist.tp has the plan, the slices read and the sampling rule): each rank's wo and w2 partials are
summed over the ranks by a kccl shm all-reduce (rank order 0..N-1 in float32: every rank gets the same
bits, so every rank holds the same residual stream and takes the same decisions), and each sampled token
is decided from the vocabulary shards' best candidates, exchanged by broadcasts from each rank in turn.
"""
from __future__ import annotations

import numpy as np

from kog_dist.tp import ShardSampler, TPModel, sample_sharded


class TensorParallel:
    """What a CpuBackend of a tensor-parallel rank calls: reduce(partial) and sample(logits, ...)."""

    def __init__(self, comm, plan):
        self.comm, self.plan = comm, plan
        self.v0 = plan.vocab.start
        self._sum = None

    def reduce(self, part: np.ndarray) -> np.ndarray:
        """The sum over the ranks of a partial [D] (attention's wo, the MLP's w2), in rank order."""
        if self._sum is None or self._sum.shape != part.shape:
            self._sum = np.empty(part.shape, np.float32)
        return self.comm.allreduce(part, out=self._sum)

    def sample(self, logits: np.ndarray, params, counter: int) -> int:
        """kog_dist.sampling.sample over the whole vocabulary, from this rank's rows (the same token
        on every rank)."""
        sampler = ShardSampler(logits, self.v0, params)

        def gather(f):
            mine = f(sampler)
            if mine.shape == (2,) and self.plan.cfg.vocab_size < (1 << 24):
                return self._gather_best(mine)
            return allgather(self.comm, mine)
        return sample_sharded(sampler, params, counter, gather)

    def _gather_best(self, best: np.ndarray) -> np.ndarray:
        """Every shard's [max logit, index] in one all-reduce of a zero-padded [N, 2] float32 buffer:
        x + 0 is x, the logits are float32 already and the indices below 2^24, so the sum is each
        rank's row exactly (instead of N broadcasts)."""
        buf = np.zeros((self.comm.size, 2), np.float32)
        buf[self.comm.rank] = best
        return self.comm.allreduce(buf).astype(np.float64)


def allgather(comm, arr: np.ndarray) -> list[np.ndarray]:
    """Every rank's float64 array (any length), in rank order: a broadcast from each rank in turn,
    in pieces that fit a kccl slot."""
    arr = np.ascontiguousarray(arr, dtype=np.float64)
    piece = max(1, comm.max_floats // 2)          # float64 values a slot holds
    out = []
    for root in range(comm.size):
        mine = root == comm.rank
        meta = comm.bcast_int64s(list(arr.shape) + [0] * (2 - arr.ndim) if mine else None, root=root)
        shape = tuple(int(x) for x in meta if x) if not mine else arr.shape
        n = int(np.prod(shape)) if shape else 0
        flat = arr.reshape(-1) if mine else np.empty(n, np.float64)
        for s in range(0, n, piece):
            got = comm.broadcast(flat[s:s + piece] if mine else None, root=root)
            if not mine:
                flat[s:s + piece] = got
        out.append(arr if mine else flat.reshape(shape))
    return out


def build(src, comm, rank: int, size: int, progress=None, store=None):
    """This rank's TPModel and its TensorParallel."""
    m = TPModel(src, rank, size, progress=progress, store=store)
    return m, TensorParallel(comm, m.plan)
