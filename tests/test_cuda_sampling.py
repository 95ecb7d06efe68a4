"""The monokernel's sampler (workers/cuda/mk_sample.cuh) against kog_dist.sampling on the kernel's own logits:
every sampled token equals numpy's draw from the logits row the kernel wrote (dbg_logits), whichever path
decided it: the candidates near the maximum sorted in shared memory, or the whole vocabulary sorted in global
scratch (p.sortbuf: the candidates never touch it, so a sentinel there says which path ran). A vocabulary of
40,000 ids, so that the candidates are a real cut of it; temperatures set from the logits' own spread, so that
some draws are decided by the candidates and some are not. Runs on the GPU machine:
`pytest -m gpu tests/test_cuda_sampling.py`."""
from __future__ import annotations

import numpy as np
import pytest

try:
    import cupy as cp
    HAVE_GPU = cp.cuda.runtime.getDeviceCount() > 0
except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
    cp, HAVE_GPU = None, False

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")]

from kog_dist.sampling import SamplingParams, sample  # noqa: E402

VOCAB = 40000
PROMPT = [1, 17, 33, 250, 9, 77, 401, 12, 5, 30000, 41, 42, 100, 7, 8, 39999]
N = 24
SENTINEL = 0x5A5A5A5A5A5A5A5A


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kog_dist.tiny import write_tiny_checkpoint
    d = str(tmp_path_factory.mktemp("sampling"))
    write_tiny_checkpoint(d, dtype="F32", num_lanes=1, broadcast_delay=1, num_hidden_layers=2, hidden_size=128,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, vocab_size=VOCAB,
                          seed=11)
    return d


def _run(b, sp):
    from kog_dist.backend import RunCommand
    dbg = cp.full((N, VOCAB), np.nan, cp.float32)
    b.sortbuf.fill(SENTINEL)
    r = b.run(RunCommand(slot=0, keep=0, append=PROMPT, max_new_tokens=N, sampling=sp), ignore_eos=True,
              dbg_logits=dbg)
    got = dbg.get()
    assert np.isfinite(got).all(), "unwritten logits"
    return r.token_ids, got, bool((b.sortbuf == SENTINEL).all())


@pytest.mark.parametrize("m", [None, 4, 0], ids=["candidates", "four-candidates", "full-sort-only"])
def test_draws_are_the_cpu_rule_on_the_kernels_own_logits(model_dir, m):
    from workers.cuda.backend import CudaBackend
    b = CudaBackend(model_dir, max_seq=256, num_slots=1, progress=False,
                    extra_defines={} if m is None else {"CFG_SAMPLE_M": m})
    try:
        _, got, _ = _run(b, SamplingParams())
        s = float(np.std(got))          # the logits' spread: the temperatures below are relative to it
        params = [SamplingParams(temperature=s / 30, seed=1),
                  SamplingParams(temperature=s / 30, top_k=5, seed=2),
                  SamplingParams(temperature=s / 10, top_p=0.8, seed=3),
                  SamplingParams(temperature=s / 3, top_k=100, top_p=0.95, seed=4),
                  SamplingParams(temperature=s, seed=5),
                  SamplingParams(temperature=3 * s, top_k=30000, top_p=0.99, seed=6)]
        candidates_only = []
        for sp in params:
            ids, got, untouched = _run(b, sp)
            assert ids == [sample(got[k], sp, counter=len(PROMPT) + k) for k in range(N)], sp
            candidates_only.append(untouched)
    finally:
        b.close()
    if m is None:       # a peaked distribution: every token from the candidates; a flat one: the full sort too
        assert candidates_only[0] and candidates_only[1] and not candidates_only[-1], candidates_only
    elif m == 0:        # the full sort for every token
        assert not any(candidates_only), candidates_only
    else:               # four keys: some draws decided by them, the rest by the full sort
        assert not all(candidates_only), candidates_only
