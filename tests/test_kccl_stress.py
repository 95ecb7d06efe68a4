"""Stress of the shm transport: thousands of rounds, several ranks, random tiny delays in senders and
receivers, DTP collects a random 0..depth-1 posts late, payload lengths that change every epoch.

Every rank runs the same schedule of posts and collects (one shared seed, like the real rank program,
where every rank executes the same layers) but sleeps/yields at random points of its own. Each
partial encodes (rank, epoch, tag) in every element, so a slot reused before a peer read it, a flag
seen before its data, or a partial summed twice shows as a wrong sum or as the transport's own
"slot reused too early" error. The sabotage run removes the ack wait and checks that this test fails.
"""

from __future__ import annotations

import os
import uuid

import pytest

from mpi_helpers import have_mpiexec, run_mpi

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not have_mpiexec(), reason="no mpiexec (pip install mpich)")]

STRESS = r'''
import os, sys, time, random
import numpy as np
from mpi4py import MPI
from kccl import Communicator

rounds, sabotage = int(sys.argv[1]), sys.argv[2] == "sabotage"
if sabotage:  # the bug this test exists to catch: a sender not waiting for the readers' acks
    Communicator._wait_acks = lambda self, ch, dests, need, timeout: None
TAGS, DEPTH, MAXLEN = ("attn", "mlp"), 3, 96
comm = Communicator.create(MPI.COMM_WORLD, max_floats=MAXLEN, depth=DEPTH, tags=TAGS, timeout=20)
r, n = comm.rank, comm.size
plan = random.Random(12345)            # the shared schedule
noise = random.Random(1000 + r)        # this rank's own delays

def jitter():
    p = noise.random()
    if p < 0.03:
        time.sleep(noise.random() * 200e-6)
    elif p < 0.10:
        os.sched_yield()

def length(t, epoch):
    return 1 + (epoch * 37 + t * 11) % MAXLEN

def value(rank, t, epoch):             # exact in float32: < 2**24 after summing over ranks
    return float(((epoch % 4096) * 2 + t) * 16 + rank)

def expected(t, epoch):
    return sum(value(q, t, epoch) for q in range(n))

queues = {t: [] for t in range(len(TAGS))}
posted = [0] * len(TAGS)
done = 0
bad = 0
while done < rounds * len(TAGS):
    t = plan.randrange(len(TAGS))
    q = queues[t]
    if posted[t] < rounds and len(q) < DEPTH and (not q or plan.random() < 0.55):
        jitter()
        epoch = posted[t] + 1
        q.append((comm.post(TAGS[t], np.full(length(t, epoch), value(r, t, epoch), np.float32)), epoch))
        posted[t] = epoch
    elif q:
        jitter()
        h, epoch = q.pop(0)
        got = comm.collect(h)
        if got.shape != (length(t, epoch),) or not np.all(got == expected(t, epoch)):
            bad += 1
            print(f"BAD rank {r} tag {TAGS[t]} epoch {epoch}: {got[:4]} != {expected(t, epoch)}", flush=True)
            break
        done += 1
    if plan.random() < 0.02:           # collectives interleaved with the DTP traffic
        k = posted[0]
        s = comm.allreduce(np.full(3, k + r, np.float32))
        assert np.all(s == n * k + n * (n - 1) // 2), ("allreduce", s)
        root = plan.randrange(n)
        b = comm.bcast_int64s([k, root] if r == root else None, root=root)
        assert b.tolist() == [k, root], ("broadcast", b)
comm.barrier()
comm.close()
if bad:
    sys.exit(1)
print(f"OK {r}", flush=True)
'''


def run_stress(n, rounds, mode, prefix, timeout):
    return run_mpi(n, code=STRESS, args=(rounds, mode), timeout=timeout,
                   env={"KCCL_SHM_PREFIX": prefix})


@pytest.mark.parametrize("n, rounds", [(4, 5000), (8, 1500)])
def test_stress_random_delays_many_rounds(n, rounds):
    prefix = f"kccltest-{uuid.uuid4().hex[:8]}"
    res = run_stress(n, rounds, "honest", prefix, timeout=90)
    assert res.returncode == 0, res.output
    assert res.marks("OK") == list(range(n)), res.output
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]


def test_stress_catches_a_sender_that_skips_the_ack_wait():
    prefix = f"kccltest-{uuid.uuid4().hex[:8]}"
    res = run_stress(3, 1500, "sabotage", prefix, timeout=90)
    assert res.returncode != 0, res.output
    assert "BAD" in res.stdout or "reused too early" in res.stderr, res.output
