"""Session-wide test order: the tests that fault a GPU on purpose run first.

A test marked `gpu_fault` SIGKILLs a rank so that the survivors' kernels fault (their peer's memory goes
away). Under MPS a fault puts the server into recovery until every client of the faulted GPU has exited,
and new clients are refused meanwhile (cudaErrorMpsServerNotReady). A pytest process that already holds a
CUDA context of its own (any GPU test that ran in-process before) is such a client and never exits during
the session, so a fault test that runs after one leaves the GPU unusable for the rest of the session: the
killed-rank test's second case failed so after the ids tests (2 x H200 under MPS, 2026-11-30), and passed
in a pytest of its own. Run first, before this process has a context, each fault test waits until the
server has recovered (mpi_helpers.wait_gpus_ready) and the tests after it find the GPUs usable."""
from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu_fault: faults a GPU on purpose (runs first: tests/conftest.py)")


def pytest_collection_modifyitems(session, config, items):
    first = [i for i in items if i.get_closest_marker("gpu_fault") is not None]
    if first:
        items[:] = first + [i for i in items if i.get_closest_marker("gpu_fault") is None]
