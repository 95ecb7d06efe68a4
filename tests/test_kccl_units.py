"""kccl without MPI: ring/epoch arithmetic, segment layout, the backoff wait, liveness, and the
protocol driven step by step on an in-process group (`Communicator.create_local_group`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kccl import Communicator, KcclError, KcclTimeout, PeerLost
from kccl import layout as L
from kccl.shm import process_alive, process_starttime, sweep_mpich_segments
from kccl.wait import BackoffPolicy, default_policy, wait_until

FAST = BackoffPolicy(spin_s=0.0, yield_s=0.0, max_sleep_s=1e-3, check_interval_s=0.02)


# ---- epochs and rings -------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [1, 2, 3, 4, 7])
def test_ring_holds_depth_consecutive_epochs_in_distinct_slots(depth):
    for first in range(L.FIRST_EPOCH, 50):
        window = [L.ring_index(e, depth) for e in range(first, first + depth)]
        assert sorted(window) == list(range(depth))
        assert L.ring_index(first + depth, depth) == L.ring_index(first, depth)  # next tenant


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_slot_is_free_exactly_when_previous_tenant_was_acked(depth):
    for e in range(L.FIRST_EPOCH, 40):
        prev = e - depth  # the epoch that used the same slot before
        assert L.ack_needed(e, depth) == prev
        assert L.slot_free(e, depth, acked=max(prev, 0))
        assert not L.slot_free(e, depth, acked=prev - 1) or prev - 1 < 0 and prev <= 0
    # fresh memory (ack 0) lets the first `depth` epochs in, not one more
    assert all(L.slot_free(e, depth, 0) for e in range(1, depth + 1))
    assert not L.slot_free(depth + 1, depth, 0)


def test_epochs_are_uint64_and_never_wrap_in_practice():
    group = Communicator.create_local_group(1, max_floats=4)
    words = group[0]._coll.own
    words[0] = 2**64 - 1
    assert words[0] == 2**64 - 1  # a full 8-byte word: 1e9 epochs/s would take 584 years to wrap
    group[0].close()


# ---- layout -----------------------------------------------------------------------------------

def test_layout_regions_are_aligned_disjoint_and_inside():
    lay = L.SegmentLayout(3, 4 * 100, (("_coll", 2), ("attn", 3), ("mlp", 4)))
    regions = []
    for c, (_, depth) in enumerate(lay.channels):
        for s in range(3):
            regions.append((lay.ack_offset(c, s), L.LINE))
            for i in range(depth):
                regions.append((lay.slot_offset(c, s, i), lay.slot_bytes))
    regions.sort()
    assert regions[0][0] >= L.HEADER_BYTES
    for (a, na), (b, _) in zip(regions, regions[1:]):
        assert a % L.LINE == 0 and a + na <= b
    assert regions[-1][0] + regions[-1][1] == lay.size
    assert lay.slot_bytes >= L.SLOT_HEADER_BYTES + 400


def test_layout_hash_changes_with_every_parameter():
    base = L.SegmentLayout(4, 4096, (("_coll", 2), ("attn", 3)))
    others = [L.SegmentLayout(5, 4096, base.channels), L.SegmentLayout(4, 8192, base.channels),
              L.SegmentLayout(4, 4096, (("_coll", 2), ("attn", 4))),
              L.SegmentLayout(4, 4096, (("_coll", 2), ("mlp", 3)))]
    assert len({base.layout_hash} | {o.layout_hash for o in others}) == 5


# ---- waiting ----------------------------------------------------------------------------------

def test_wait_returns_when_ready_and_times_out_with_description():
    flips = iter([False, False, True])
    wait_until(lambda: next(flips), FAST, timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(KcclTimeout, match="the thing"):
        wait_until(lambda: False, FAST, timeout_s=0.1, describe=lambda: "the thing")
    assert 0.1 <= time.monotonic() - t0 < 1.0


def test_wait_runs_liveness_check_and_propagates_peer_lost():
    calls = []

    def check():
        calls.append(1)
        if len(calls) >= 3:
            raise PeerLost("rank 1 (pid 9) exited", rank=1, pid=9)

    with pytest.raises(PeerLost, match="rank 1"):
        wait_until(lambda: False, FAST, timeout_s=10.0, check=check)
    assert len(calls) == 3


def test_wait_prefers_data_that_arrived_over_a_lost_peer():
    state = {"n": 0}

    def ready():
        state["n"] += 1
        return state["n"] > 3  # data lands while the check runs

    def check():
        raise PeerLost("gone")

    wait_until(ready, FAST, timeout_s=5.0, check=check)


def test_default_policy_does_not_spin_when_oversubscribed():
    cores = len(os.sched_getaffinity(0))
    assert default_policy(cores + 1).spin_s == 0.0
    assert default_policy(1).spin_s > 0.0
    idle = default_policy(1).for_idle()
    assert idle.spin_s == 0 and idle.max_sleep_s >= 1e-3


def test_process_alive_sees_exit_and_pid_reuse():
    me = os.getpid()
    assert process_alive(me, process_starttime(me))
    assert not process_alive(me, process_starttime(me) + 1)  # same pid, another process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not process_alive(child.pid)



@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_sweep_drops_only_unmapped_mpich_segments_of_the_job():
    """kccl.shm.sweep_mpich_segments, as the launchers call it after a job: a segment made since the job
    started and mapped by nobody goes; one still mapped by a process of the job's session is waited for
    (wait_s) and kept while mapped, then goes once that process has exited; one older than the job stays;
    files not named mpich_shm_* are never looked at."""
    tag = f"{os.getpid()}_{time.time_ns()}"
    old, fresh, held = (f"/dev/shm/mpich_shm_kogtest_{tag}_{k}" for k in ("old", "fresh", "held"))
    other = f"/dev/shm/kogtest_{tag}_notmpich"
    for f in (old, fresh, held, other):
        with open(f, "wb") as fh:
            fh.write(b"\0" * 4096)
    os.utime(old, (time.time() - 600, time.time() - 600))
    since = time.time() - 5
    holder = subprocess.Popen([sys.executable, "-c", "import mmap, sys, time; f = open(sys.argv[1], 'r+b'); "
                               "m = mmap.mmap(f.fileno(), 4096); print('mapped', flush=True); time.sleep(60)", held],
                              stdout=subprocess.PIPE, text=True)     # in this session: "the job's"
    try:
        assert holder.stdout.readline().strip() == "mapped"
        t0 = time.monotonic()
        assert sweep_mpich_segments(since, job_session=os.getsid(0), wait_s=0.3) == [fresh]
        assert time.monotonic() - t0 >= 0.3                          # it waited for the holder
        assert os.path.exists(old) and os.path.exists(held) and os.path.exists(other)
        holder.kill()
        holder.wait()
        assert sweep_mpich_segments(since, job_session=os.getsid(0), wait_s=0.3) == [held]
        assert os.path.exists(old) and os.path.exists(other)
    finally:
        holder.kill()
        holder.wait()
        for f in (old, fresh, held, other):
            if os.path.exists(f):
                os.unlink(f)

# ---- protocol on an in-process group -----------------------------------------------------------

@pytest.fixture
def group():
    comms = Communicator.create_local_group(3, max_floats=64, depth=2, timeout=0.3, policy=FAST)
    yield comms
    for c in comms:
        c.close()


def post_all(group, tag, values):
    return [c.post(tag, np.full(4, v, np.float32)) for c, v in zip(group, values)]


def test_post_collect_sums_in_rank_order(group):
    hs = post_all(group, "attn", [1.0, 2.0, 4.0])
    for c, h in zip(group, hs):
        assert np.array_equal(c.collect(h), np.full(4, 7.0, np.float32))


def test_sender_waits_for_the_slowest_reader_before_reusing_a_slot(group):
    a, b, c = group
    first = post_all(group, "attn", [1, 1, 1])      # epoch 1
    second = post_all(group, "attn", [2, 2, 2])     # epoch 2: ring (depth 2) now full
    a.collect(first[0]); a.collect(second[0])       # rank 0 is done; ranks 1, 2 have read nothing
    with pytest.raises(KcclTimeout, match=r"ranks \[1, 2\] to consume 'attn' epoch 1"):
        a.post("attn", np.full(4, 3.0))             # epoch 3 would overwrite epoch 1's slot
    b.collect(first[1]); c.collect(first[2])
    h3 = a.post("attn", np.full(4, 3.0))            # now allowed
    assert np.array_equal(b.collect(second[1]), np.full(4, 6.0))  # epoch 2 intact
    assert h3.epoch == 3


def test_poster_cannot_outrun_its_own_ring(group):
    a = group[0]
    a.post("mlp", np.ones(4)); a.post("mlp", np.ones(4))
    with pytest.raises(KcclError, match="not collected"):
        a.post("mlp", np.ones(4))
    assert a.pending("mlp") == 2


def test_collect_times_out_naming_the_missing_ranks(group):
    h = group[0].post("attn", np.ones(4))
    with pytest.raises(KcclTimeout, match=r"'attn' epoch 1 from ranks \[1, 2\]"):
        group[0].collect(h)


def test_a_slot_overwritten_too_early_is_detected(group):
    hs = post_all(group, "attn", [1, 1, 1])
    attn = group[0]._by_tag["attn"]
    slot = attn.slot_word[1][hs[0].epoch % 2]
    attn.own[slot + L.S_EPOCH] = hs[0].epoch + 2  # as if rank 1 had skipped the ack wait
    with pytest.raises(KcclError, match="reused too early"):
        group[0].collect(hs[0])


def test_closed_peer_is_reported_as_peer_lost(group):
    h = group[0].post("attn", np.ones(4))
    group[2].close()
    with pytest.raises(PeerLost, match="rank 2 .* closed its communicator") as info:
        group[0].collect(h)
    assert info.value.rank == 2
    with pytest.raises(PeerLost):  # the communicator stays broken
        group[0].post("mlp", np.ones(4))


def test_the_others_hear_the_root_cause_not_the_cascade(group):
    hs = [group[0].post("attn", np.ones(4)), group[2].post("attn", np.ones(4))]
    group[1].close()
    with pytest.raises(PeerLost, match=r"rank 1 .* closed its communicator \(noticed by rank 0\)"):
        group[0].collect(hs[0])
    group[0].close()
    with pytest.raises(PeerLost, match=r"rank 1 .* closed its communicator \(reported by rank 0\)"):
        group[2].collect(hs[1])


def test_dead_peer_is_reported_as_peer_lost(group):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    group[0]._watch.pids[1] = child.pid  # rank 1 "was" that process
    group[0]._watch.starts[1] = 0
    h = group[0].post("attn", np.ones(4))
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match=rf"rank 1 \(pid {child.pid}\) exited"):
        group[0].collect(h)
    assert time.monotonic() - t0 < 0.3


def test_broadcast_carries_dtype_and_shape_and_detects_order_mismatch(group):
    a, b, c = group
    data = np.arange(6, dtype=np.int64).reshape(2, 3)
    a.broadcast(data, root=0)
    for peer in (b, c):
        got = peer.broadcast(None, root=0)
        assert got.dtype == np.int64 and np.array_equal(got, data)
    pair = Communicator.create_local_group(2, max_floats=8, timeout=0.3, policy=FAST)
    pair[0].broadcast(np.ones(2, np.float32), root=0)
    with pytest.raises(KcclError, match="rank 1 is in barrier but rank 0 sent broadcast"):
        pair[1].barrier()
    for comm in pair:
        comm.close()


def test_argument_checks():
    from kccl.cuda_ipc import cupy_missing
    if cupy_missing() is not None:
        with pytest.raises(NotImplementedError, match="needs CuPy and a CUDA GPU"):
            Communicator.create(None, transport="cuda_ipc")
    with pytest.raises(ValueError, match="distinct"):
        Communicator.create(None, tags=("a", "a"))
    g = Communicator.create_local_group(1, max_floats=8)
    with pytest.raises(ValueError, match="exceeds the slot"):
        g[0].allreduce(np.ones(9))
    with pytest.raises(KcclError, match="unknown tag"):
        g[0].post("moe", np.ones(2))
    assert np.array_equal(g[0].allreduce(np.ones((2, 2))), np.ones((2, 2)))
    g[0].close()
    g[0].close()  # idempotent
    with pytest.raises(KcclError, match="closed"):
        g[0].allreduce(np.ones(2))


def test_timeouts_in_collect_and_broadcast_can_be_retried(group):
    a, b, c = group
    ha = a.post("attn", np.full(4, 1.0))
    with pytest.raises(KcclTimeout):
        a.collect(ha, timeout=0.05)
    hb, hc = b.post("attn", np.full(4, 2.0)), c.post("attn", np.full(4, 4.0))
    assert np.array_equal(a.collect(ha), np.full(4, 7.0, np.float32))
    with pytest.raises(KcclTimeout):
        b.broadcast(None, root=0, timeout=0.05)
    a.broadcast(np.arange(3), root=0)
    assert b.broadcast(None, root=0).tolist() == [0, 1, 2]
    assert c.broadcast(None, root=0).tolist() == [0, 1, 2]
    assert b.collect(hb)[0] == 7.0 and c.collect(hc)[0] == 7.0


def test_doorbell_wakes_a_blocked_waiter_early():
    from kccl.doorbell import Doorbell

    names = [f"kccltest-bell-{os.getpid()}-r{r}" for r in range(2)]
    bells = [Doorbell.open(names, r) for r in range(2)]
    if bells[0] is None:
        pytest.skip("no abstract UNIX sockets here")
    t0 = time.monotonic()
    bells[1].wait(0.05)  # nobody rang: the timeout
    assert time.monotonic() - t0 >= 0.04
    bells[0].ring(1)
    bells[0].ring(1)
    t0 = time.monotonic()
    bells[1].wait(5.0)   # rung: returns at once, and drains the second ring
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    bells[1].wait(0.05)
    assert time.monotonic() - t0 >= 0.04
    for b in bells:
        b.close()


def test_idle_broadcast_is_woken_by_the_root(group):
    import threading

    a, b, _ = group
    got = {}
    waiter = threading.Thread(target=lambda: got.setdefault("v", b.broadcast(None, 0, idle=True)))
    waiter.start()
    time.sleep(0.2)
    assert b._words[b.rank][L.H_IDLE] == 1  # blocked on its doorbell
    t0 = time.monotonic()
    a.broadcast(np.array([5, 6]), root=0)
    waiter.join(5.0)
    assert got["v"].tolist() == [5, 6] and time.monotonic() - t0 < 1.0
    assert b._words[b.rank][L.H_IDLE] == 0
