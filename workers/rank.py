"""How the ranks of one job work together: the lane exchange over KCCL, rank 0's `RankGroup` (the
executor the coordinator drives) and the follower loop of every other rank.

Rank 0 broadcasts each command (msgpack bytes over KCCL) before it runs it itself; every rank then
runs the same command on its own lanes, meeting the others in the DTP exchanges. After each sampled
token rank 0 broadcasts go/stop, so a cancel is taken by every rank at the same step.
"""
from __future__ import annotations

import msgpack
import numpy as np

from kog_dist.backend import RunCommand, RunResult, check_command

OP_RUN, OP_FREE, OP_EXIT = "run", "free", "exit"


class KcclExchange:
    """The engine's exchange (allreduce now; post now, collect δ layers later) over a Communicator."""

    def __init__(self, comm):
        self.comm = comm

    def allreduce(self, tag: str, x: np.ndarray) -> np.ndarray:
        return self.comm.allreduce(x)

    def post(self, tag: str, x: np.ndarray):
        return self.comm.post(tag, x)

    def collect(self, handle) -> np.ndarray:
        return self.comm.collect(handle)


def make_agree(comm):
    """Every rank takes rank 0's go/stop decision for this step."""
    if comm is None or comm.size == 1:
        return None

    def agree(flag: bool) -> bool:
        return bool(comm.bcast_int64s([1 if flag else 0] if comm.rank == 0 else None)[0])
    return agree


def send_message(comm, msg: dict) -> None:
    comm.broadcast(np.frombuffer(msgpack.packb(msg), dtype=np.uint8), root=0)


def recv_message(comm) -> dict:
    data = comm.broadcast(None, root=0, idle=True, timeout=float("inf"))
    return msgpack.unpackb(data.tobytes())


class RankGroup:
    """Rank 0's view of the whole job, with the Backend interface the coordinator drives."""

    def __init__(self, backend, comm, heartbeat=None):
        self.backend, self.comm, self.heartbeat = backend, comm, heartbeat
        self.max_seq, self.num_slots = backend.max_seq, backend.num_slots
        self.closed = False

    def check_peers(self) -> None:
        """Raise when a rank stopped beating (workers.heartbeat); the coordinator asks from its loop."""
        if self.heartbeat is not None:
            self.heartbeat.check()

    def run(self, cmd: RunCommand, on_token=None) -> RunResult:
        # Refuse here, before the followers hear of it, so a bad request cannot desynchronise them.
        check_command(cmd, self.backend.cached(cmd.slot), self.backend.cfg.vocab_size, self.max_seq,
                      self.num_slots)
        if self.comm.size > 1:   # a grammar travels as its format: each rank compiles its own matcher
            if cmd.grammar is not None and not getattr(self.backend, "grammar_on_ranks", False):
                raise ValueError("structured outputs on several ranks run on the cpu backend in this build")
            send_message(self.comm, {"op": OP_RUN, "cmd": cmd.to_wire()})
        return self.backend.run(cmd, on_token)

    def free(self, slot: int) -> None:
        if self.comm.size > 1:
            send_message(self.comm, {"op": OP_FREE, "slot": int(slot)})
        self.backend.free(slot)

    def cached(self, slot: int) -> int:
        return self.backend.cached(slot)

    def close(self) -> None:
        if not self.closed and self.comm.size > 1:
            self.closed = True
            try:
                send_message(self.comm, {"op": OP_EXIT})
            except Exception:  # followers already gone: nothing to tell them
                pass


def follow(backend, comm, log, tokenizer=None) -> int:
    """A rank other than 0: sleep until rank 0 sends a command, run it, repeat until told to exit.
    `tokenizer`: a callable giving the model's tokenizer, asked for at the first command with a grammar."""
    cache = []

    def tok():
        if not cache:
            cache.append(tokenizer() if tokenizer is not None else None)
        return cache[0]
    while True:
        msg = recv_message(comm)
        op = msg.get("op")
        if op == OP_EXIT:
            return 0
        if op == OP_FREE:
            backend.free(int(msg["slot"]))
        elif op == OP_RUN:
            backend.run(RunCommand.from_wire(msg["cmd"], tok))
        else:
            log(f"unknown message from rank 0: {op!r}")
            return 1
