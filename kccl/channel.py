"""One channel (the collectives' ring or one DTP tag) as one rank sees it: epochs and slot views.

Epoch bookkeeping lives here (`send_epoch`, `recv_epoch[src]`, `collected`), and so do the views
that make the per-call path a handful of indexings: this rank's slots in every peer's segment (to
write) and every source's slots in its own segment (to read), plus the word indices of the slot
headers and ack words (identical in every segment, see layout.py).

Slot header words after EPOCH travel as one 7-word "meta" block written with a single slice store
before EPOCH: NBYTES, DTYPE | OP << 8, NDIM, SHAPE[4] (unused extents 0).
"""

from __future__ import annotations

from array import array

import numpy as np

from . import layout as L

META_WORDS = 3 + L.MAX_NDIM


def make_meta(x: np.ndarray | None, op: int) -> memoryview:
    """The meta block for payload `x` (None: no payload) sent by collective/post `op`."""
    if x is None:
        return memoryview(array("Q", [0, op << 8, 0] + [0] * L.MAX_NDIM))
    shape = list(x.shape) + [0] * (L.MAX_NDIM - x.ndim)
    return memoryview(array("Q", [x.nbytes, L.DTYPE_CODES[x.dtype] | (op << 8), x.ndim] + shape))


def read_meta(meta) -> tuple:
    """(nbytes, dtype or None, op, shape) from a meta block."""
    ndim = meta[2]
    return meta[0], L.CODE_DTYPES.get(meta[1] & 0xFF), meta[1] >> 8, tuple(meta[3:3 + ndim])


class Channel:
    """Channel `cid` of layout `lay` for `rank`; `words[r]`/`arrays[r]` map rank r's segment."""

    def __init__(self, cid: int, lay: L.SegmentLayout, rank: int, words: list, arrays: list):
        self.id = cid
        self.name, self.depth = lay.channels[cid]
        self.rank, self.size = rank, lay.nranks
        self.send_epoch = 0                 # last epoch this rank sent
        self.recv_epoch = [0] * self.size   # last epoch consumed from each source
        self.collected = 0                  # DTP tags: last epoch collected
        self.words, self.own = words, words[rank]
        self.slot_word = [[lay.slot_offset(cid, s, i) // 8 for i in range(self.depth)]
                          for s in range(self.size)]
        self.ack_word = [lay.ack_offset(cid, s) // 8 for s in range(self.size)]
        nbytes = lay.payload_bytes

        def payload(arr, src, i):
            off = lay.slot_offset(cid, src, i) + L.SLOT_HEADER_BYTES
            return arr[off:off + nbytes]

        self.out_payload = [[payload(arrays[d], rank, i) for i in range(self.depth)]
                            for d in range(self.size)]
        self.in_payload = [[payload(arrays[rank], s, i) for i in range(self.depth)]
                           for s in range(self.size)]
        self.in_f32 = [[v.view(np.float32) for v in row] for row in self.in_payload]

    # -- sending --
    def acked_by(self, dest: int) -> int:
        """The last epoch of this rank that `dest` consumed on this channel."""
        return self.words[dest][self.ack_word[self.rank]]

    def write(self, dests, epoch: int, flat_u8: np.ndarray | None, meta: memoryview) -> None:
        """Copy the payload into slot `epoch` of every dest, then the meta block, then EPOCH."""
        idx = epoch % self.depth
        w = self.slot_word[self.rank][idx]
        nbytes = meta[0]
        for d in dests:
            wd = self.words[d]
            if nbytes:
                self.out_payload[d][idx][:nbytes] = flat_u8
            wd[w + 1:w + 1 + META_WORDS] = meta
            wd[w] = epoch  # publish: the last store

    # -- receiving (own segment) --
    def arrived(self, src: int, epoch: int) -> int:
        """The EPOCH word of the slot where `src`'s `epoch` goes."""
        return self.own[self.slot_word[src][epoch % self.depth]]

    def meta(self, src: int, epoch: int) -> memoryview:
        w = self.slot_word[src][epoch % self.depth]
        return self.own[w + 1:w + 1 + META_WORDS]

    def payload(self, src: int, epoch: int, nbytes: int) -> np.ndarray:
        return self.in_payload[src][epoch % self.depth][:nbytes]

    def floats(self, src: int, epoch: int, n: int) -> np.ndarray:
        return self.in_f32[src][epoch % self.depth][:n]

    def ack(self, epochs: dict) -> None:
        """Tell each source its epoch was consumed (the slot may be reused)."""
        own, table = self.own, self.ack_word
        for src, e in epochs.items():
            own[table[src]] = e

    def next_epochs(self, srcs) -> dict:
        """The epoch expected next from each source (committed by `consumed`)."""
        return {s: self.recv_epoch[s] + 1 for s in srcs}

    def consumed(self, epochs: dict) -> None:
        self.ack(epochs)
        for s, e in epochs.items():
            self.recv_epoch[s] = e
