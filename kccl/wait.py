"""Waiting on a predicate: spin briefly, then os.sched_yield, then sleep with exponential backoff.

The policy exists so that 8 ranks on a 2-core machine still make progress (a rank that spins holds a
core its peer needs), while a rank with a core of its own sees a flag within microseconds.

    spin   -- call `ready()` back to back for `spin_s` (0 when ranks outnumber cores);
    yield  -- then os.sched_yield() between calls until `yield_s` has passed since the wait began;
    sleep  -- then time.sleep(d) with d doubling from `min_sleep_s` up to `max_sleep_s`.

Every wait has a deadline (KcclTimeout) and, once past the spin phase, calls `check()` every
`check_interval_s` (the communicator passes its peer-liveness check, which raises PeerLost).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from typing import Callable

from .errors import KcclTimeout

_sched_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


@dataclass(frozen=True)
class BackoffPolicy:
    """Timing knobs of `wait_until` (seconds)."""

    spin_s: float = 50e-6
    yield_s: float = 300e-6
    min_sleep_s: float = 20e-6
    max_sleep_s: float = 1e-3
    check_interval_s: float = 0.1

    def for_idle(self, max_sleep_s: float = 20e-3) -> "BackoffPolicy":
        """The policy for an idle wait (between requests): no spinning, longer sleeps, ~0 CPU."""
        return replace(self, spin_s=0.0, yield_s=0.0, max_sleep_s=max_sleep_s)


def default_policy(local_ranks: int = 1) -> BackoffPolicy:
    """The policy for `local_ranks` processes on this host: no spinning when they outnumber the cores.

    Environment overrides: KCCL_SPIN_US, KCCL_YIELD_US, KCCL_MAX_SLEEP_US.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    spin_s = 50e-6 if local_ranks <= cores else 0.0
    policy = BackoffPolicy(spin_s=spin_s)
    env = os.environ
    if "KCCL_SPIN_US" in env:
        policy = replace(policy, spin_s=float(env["KCCL_SPIN_US"]) * 1e-6)
    if "KCCL_YIELD_US" in env:
        policy = replace(policy, yield_s=float(env["KCCL_YIELD_US"]) * 1e-6)
    if "KCCL_MAX_SLEEP_US" in env:
        policy = replace(policy, max_sleep_s=float(env["KCCL_MAX_SLEEP_US"]) * 1e-6)
    return policy


def wait_until(
    ready: Callable[[], bool],
    policy: BackoffPolicy,
    timeout_s: float = 30.0,
    check: Callable[[], None] | None = None,
    describe: Callable[[], str] = lambda: "a condition",
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once `ready()` is true; raise KcclTimeout after `timeout_s` (math.inf: never).

    `check()` runs every `policy.check_interval_s` after the spin phase and once more before a
    timeout is raised, so a dead peer is reported as PeerLost rather than as a timeout. `sleep`
    may return early (a doorbell's wait).
    """
    if ready():
        return
    start = time.monotonic()
    deadline = start + timeout_s if math.isfinite(timeout_s) else math.inf
    spin_end = start + policy.spin_s
    yield_end = start + policy.yield_s
    next_check = start + policy.check_interval_s
    sleep_s = policy.min_sleep_s
    now = start
    while True:
        if ready():
            return
        if now < spin_end:
            now = time.monotonic()
            continue
        if now < yield_end:
            _sched_yield()
        else:
            sleep(sleep_s)
            sleep_s = min(sleep_s * 2.0, policy.max_sleep_s)
        now = time.monotonic()
        if check is not None and now >= next_check:
            _check_unless_ready(check, ready)
            next_check = now + policy.check_interval_s
        if now >= deadline:
            if ready():
                return
            if check is not None:
                _check_unless_ready(check, ready)
                if ready():
                    return
            raise KcclTimeout(f"timed out after {timeout_s:g} s waiting for {describe()}")


def _check_unless_ready(check: Callable[[], None], ready: Callable[[], bool]) -> None:
    """Run `check()`; if it raises but the data arrived meanwhile (a peer that sent, then exited), the
    wait succeeded: return so the caller proceeds (it will re-test `ready()`)."""
    try:
        check()
    except Exception:
        if not ready():
            raise
