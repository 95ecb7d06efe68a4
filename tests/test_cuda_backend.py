"""The cuda backend (monokernel) against the numpy reference engine and a float32 CuPy computation.
Runs on the GPU machine: `pytest -m gpu tests/test_cuda_backend.py`; skips cleanly without CuPy or a GPU.
KOG_TEST_DEFINES="CFG_X=1 CFG_Y=2" adds compile-time defines to every kernel built here, to check a tuning
variant of the monokernel against the same references; KOG_TEST_NBLOCKS=N builds them for N blocks."""
from __future__ import annotations

import dataclasses
import os
import zlib

import numpy as np
import pytest

try:
    import cupy as cp
    HAVE_GPU = cp.cuda.runtime.getDeviceCount() > 0
except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
    cp, HAVE_GPU = None, False

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")]

from kog_dist.config import LaneformerConfig  # noqa: E402
from kog_dist.sampling import SamplingParams, sample  # noqa: E402

# each variant combines several of the spec's options, to keep the number of compiles small
VARIANTS = {
    "d2_L4_gqa2_slide_first": dict(sliding_window=16, sliding_window_n_layers=2),
    "d1_L8_mha_slide_last": dict(broadcast_delay=1, num_lanes=8, num_key_value_heads=None, sliding_window=16,
                                 sliding_window_n_layers=-2),
    "d3_L1_gqa4_no_early_comm": dict(broadcast_delay=3, num_lanes=1, num_key_value_heads=4,
                                     use_early_comm=False),
    "d2_L8_no_future_lane_scales": dict(num_lanes=8, early_layers_to_future=False, replicated_rmsn_scale=False),
    "no_comm_tied": dict(use_comm=False, tie_word_embeddings=True),
    "d3_L4_no_early_flags_6layers": dict(broadcast_delay=3, num_hidden_layers=6, use_early_comm=False,
                                         early_layers_to_future=False),
}
GEN = 128


def _tiny_cfg(over, dtype="F32"):
    from kog_dist.tiny import TINY_DEFAULTS
    d = dict(TINY_DEFAULTS)
    d.update(over)
    d["model_type"] = "laneformer_tp"
    return LaneformerConfig.from_dict(d)


@pytest.fixture(scope="module", autouse=True)
def _prebuild():
    from workers.cuda.build import prebuild
    items = [(_tiny_cfg(v), "F32") for v in VARIANTS.values()] + [(_tiny_cfg({}), "F16")]
    prebuild(items)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from kog_dist.tiny import write_tiny_checkpoint
    out = {}
    for name, over in VARIANTS.items():
        d = str(tmp_path_factory.mktemp(name))
        write_tiny_checkpoint(d, dtype="F32", seed=zlib.crc32(name.encode()) % 1000, **over)
        out[name] = d
    return out


def _ref_greedy(model_dir, prompt, n):
    from kog_dist.checkpoint import Model
    from kog_dist.engine import ReferenceEngine
    m = Model(model_dir, progress=False)
    eng = ReferenceEngine(m.cfg, m.weights, m.embed)
    logits = eng.prefill(prompt)
    toks, all_logits = [], []
    for _ in range(n):
        all_logits.append(logits)
        t = int(np.argmax(logits))
        toks.append(t)
        logits = eng.step(t)
    return toks, all_logits, eng


TEST_DEFINES = dict(d.split("=", 1) for d in os.environ.get("KOG_TEST_DEFINES", "").split())
TEST_NBLOCKS = int(os.environ.get("KOG_TEST_NBLOCKS", "0")) or None   # a block count other than the default


def _backend(model_dir, **kw):
    from workers.cuda.backend import CudaBackend
    kw["extra_defines"] = {**TEST_DEFINES, **kw.get("extra_defines", {})}
    kw.setdefault("nblocks", TEST_NBLOCKS)
    return CudaBackend(model_dir, max_seq=kw.pop("max_seq", 512), num_slots=2, progress=False, **kw)


def _cmd(**kw):
    from kog_dist.backend import RunCommand
    return RunCommand(**kw)


PROMPT = [1, 17, 33, 250, 9, 77, 401, 12, 5, 300, 41, 42, 100, 7, 8, 9]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_matches_numpy_engine(models, name):
    ref, ref_logits, _ = _ref_greedy(models[name], PROMPT, GEN)
    b = _backend(models[name])
    r = b.run(_cmd(append=PROMPT, max_new_tokens=GEN), ignore_eos=True)
    b.close()
    assert r.stop_reason == "length" and r.cached == len(PROMPT) + GEN - 1
    if r.token_ids != ref:
        i = next(k for k, (a, c) in enumerate(zip(r.token_ids, ref)) if a != c)
        srt = np.sort(ref_logits[i])
        pytest.fail(f"{name}: first difference at token {i}: {r.token_ids[i]} vs {ref[i]} "
                    f"(reference margin {srt[-1] - srt[-2]:.2e})")


def test_lane_skew_keeps_the_ids(models):
    """The lane skew (CFG_SKEW_NS, on by default only for >= 1 GB models) changes when the upper lanes run,
    never what they compute: forced on a tiny 8-lane model, the ids are still the numpy engine's."""
    name = "d2_L8_no_future_lane_scales"
    ref, _, _ = _ref_greedy(models[name], PROMPT, GEN)
    b = _backend(models[name], extra_defines={"CFG_SKEW_NS": 20000})
    assert b.k.defines["CFG_SKEW_NS"] == 20000
    r = b.run(_cmd(append=PROMPT, max_new_tokens=GEN), ignore_eos=True)
    b.close()
    assert r.token_ids == ref


@pytest.mark.parametrize("pconst", [1, 0])
def test_plain_launch_and_profile_build_keep_the_ids(models, pconst, monkeypatch):
    """The launch without cooperative groups (an older CuPy; ranks on one GPU whose driver refuses the
    cooperative launch) hands Params over as the kernel takes them: by value (the default) or through a
    pointer (CFG_PCONST=0). Either way, on the profile build (timing marks compiled in), the ids are the
    numpy engine's and the marks of the asked step are written."""
    from workers.cuda.backend import CudaBackend
    name = "d2_L4_gqa2_slide_first"
    ref, _, _ = _ref_greedy(models[name], PROMPT, GEN)
    b = _backend(models[name], extra_defines={"CFG_PCONST": pconst}, timing_marks=True)
    assert b.k.defines["CFG_MARKS"] == 1 and b._params_by_value == bool(pconst)
    monkeypatch.setattr(CudaBackend, "_launch", CudaBackend._plain_launch)
    r = b.run(_cmd(append=PROMPT, max_new_tokens=GEN), ignore_eos=True, timing_token=3)
    marks = b.last_timing
    b.close()
    assert r.token_ids == ref
    assert marks is not None and (marks[:, :, 0] > 0).all()          # every phase's entry, every block
    done = marks[:, :, 2]                                               # blocks without units return early
    assert (done > 0).any() and ((done == 0) | (done >= marks[:, :, 0])).all()


def test_logits_match_numpy_engine_and_outputs_poisoned(models):
    name = "d2_L4_gqa2_slide_first"
    ref, ref_logits, _ = _ref_greedy(models[name], PROMPT, 40)
    b = _backend(models[name])
    dbg = cp.full((40, b.cfg.vocab_size), np.nan, cp.float32)
    r = b.run(_cmd(append=PROMPT, max_new_tokens=40), ignore_eos=True, dbg_logits=dbg)
    got = dbg.get()
    assert np.isfinite(got).all(), "unwritten logits"
    for k in range(40):
        rel = np.linalg.norm(got[k] - ref_logits[k]) / np.linalg.norm(ref_logits[k])
        assert rel < 1e-4, (k, rel)
    assert r.token_ids == ref
    b.close()


def test_session_continuation(models):
    """keep + append: a prefill at an offset, then decode, equals the reference engine's path."""
    name = "d1_L8_mha_slide_last"
    ref, _, eng = _ref_greedy(models[name], PROMPT, 10)
    extra = [5, 6, 7, 300]
    eng.truncate(eng.pos - 1)          # the last sampled token was not fed by the backend
    logits = eng.prefill([ref[-1]] + extra)
    ref2 = []
    for _ in range(20):
        t = int(np.argmax(logits))
        ref2.append(t)
        logits = eng.step(t)
    b = _backend(models[name])
    r1 = b.run(_cmd(slot=1, append=PROMPT, max_new_tokens=10), ignore_eos=True)
    assert r1.token_ids == ref
    r2 = b.run(_cmd(slot=1, keep=r1.cached, append=[r1.token_ids[-1]] + extra, max_new_tokens=20), ignore_eos=True)
    assert r2.token_ids == ref2
    assert r2.cached == len(PROMPT) + 10 + len(extra) + 20 - 1
    # only append (max_new_tokens 0), then continue with an empty append (re-runs the last token)
    r3 = b.run(_cmd(slot=0, append=PROMPT, max_new_tokens=0))
    assert r3.token_ids == [] and r3.cached == len(PROMPT) and r3.stop_reason == "none"
    r4 = b.run(_cmd(slot=0, keep=len(PROMPT), append=[], max_new_tokens=10), ignore_eos=True)
    assert r4.token_ids == ref
    b.close()


def test_sampling_seeded_reproducible_and_matches_cpu_rule(models):
    name = "d2_L4_gqa2_slide_first"
    from kog_dist.checkpoint import Model
    from kog_dist.engine import ReferenceEngine
    sp = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=1234)
    b = _backend(models[name])
    r1 = b.run(_cmd(append=PROMPT, max_new_tokens=48, sampling=sp), ignore_eos=True)
    r2 = b.run(_cmd(append=PROMPT, max_new_tokens=48, sampling=sp), ignore_eos=True)
    assert r1.token_ids == r2.token_ids
    r3 = b.run(_cmd(append=PROMPT, max_new_tokens=48, sampling=dataclasses.replace(sp, seed=99)), ignore_eos=True)
    assert r3.token_ids != r1.token_ids
    for spx in (sp, SamplingParams(temperature=1.3, seed=5), SamplingParams(temperature=0.7, top_p=0.5, seed=6)):
        m = Model(models[name], progress=False)
        eng = ReferenceEngine(m.cfg, m.weights, m.embed)
        logits = eng.prefill(PROMPT)
        held = len(PROMPT)
        ref = []
        for _ in range(48):
            t = sample(logits, spx, counter=held)
            ref.append(t)
            logits = eng.step(t)
            held += 1
        r = b.run(_cmd(append=PROMPT, max_new_tokens=48, sampling=spx), ignore_eos=True)
        assert r.token_ids == ref, spx
    b.close()


def test_stop_ids_eos_and_cancel(models):
    name = "d2_L4_gqa2_slide_first"
    ref, _, _ = _ref_greedy(models[name], PROMPT, 60)
    k = next(i for i in range(8, 60) if ref[i] not in ref[:i])
    b = _backend(models[name])
    r = b.run(_cmd(append=PROMPT, max_new_tokens=60, stop_ids=(ref[k],)))
    assert r.token_ids == ref[:k + 1] and r.stop_reason == "stop"
    assert int(b.status.a[0]) == k + 1          # the kernel itself stopped at that token
    # the same token as the config's EOS
    b.dw.cfg = b.cfg = dataclasses.replace(b.cfg, eos_token_id=ref[k])
    r = b.run(_cmd(append=PROMPT, max_new_tokens=60))
    assert r.token_ids == ref[:k + 1] and r.stop_reason == "eos"
    assert int(b.status.a[0]) == k + 1
    # cancel from the token callback: the kernel stops within one token of the flag
    seen = []

    def on_token(t):
        seen.append(t)
        return len(seen) < 5

    r = b.run(_cmd(append=PROMPT, max_new_tokens=400), on_token=on_token, ignore_eos=True)
    assert r.stop_reason == "cancel" and r.token_ids == seen and len(seen) == 5
    assert int(b.status.a[0]) <= b.cancel_raised_at + 1, (int(b.status.a[0]), b.cancel_raised_at)
    assert int(b.status.a[0]) < 400
    b.close()


def test_fp16_tiny_logits(tmp_path):
    from kog_dist.tiny import write_tiny_checkpoint
    write_tiny_checkpoint(str(tmp_path), dtype="F16", seed=3)
    ref, ref_logits, _ = _ref_greedy(str(tmp_path), PROMPT, 24)
    b = _backend(str(tmp_path))
    assert b.dw.dtype == "F16"
    dbg = cp.full((24, b.cfg.vocab_size), np.nan, cp.float32)
    b.run(_cmd(append=PROMPT, max_new_tokens=24), ignore_eos=True, dbg_logits=dbg)
    got = dbg.get()
    for k in range(24):
        rel = np.linalg.norm(got[k] - ref_logits[k]) / np.linalg.norm(ref_logits[k])
        assert rel < 1e-2, (k, rel)
    b.close()


@pytest.mark.parametrize("dtype", ["BF16", "Q4_0"])
def test_2b_shape_logits_against_float32(dtype):
    """The 2B shape's logits at several steps within 1e-2 (relative) of float32 arithmetic on the same
    weights (CupyReference; Q4_0: the layer matrices' exact dequantization, issue 31)."""
    from kog_dist.shapes import shape_config
    from workers.cuda.backend import CudaBackend
    from workers.cuda.build import build
    from workers.cuda.refcheck import CupyReference
    from workers.cuda.weights import random_weights
    cfg = shape_config("2b")
    k = build(cfg, dtype)
    dw = random_weights(cfg, dtype, k, seed=11)
    b = CudaBackend(weights=dw, max_seq=256, num_slots=1, progress=False, extra_defines=TEST_DEFINES)
    prompt = [1, 500, 9000, 31000, 42, 7, 123, 4567]
    n = 64
    dbg = cp.full((n, cfg.vocab_size), np.nan, cp.float32)
    r = b.run(_cmd(append=prompt, max_new_tokens=n), ignore_eos=True, dbg_logits=dbg)
    got = dbg.get()
    assert np.isfinite(got).all()
    ref = CupyReference(dw, k, 256)
    for t in prompt[:-1]:
        ref.step(t)
    feed = [prompt[-1]] + r.token_ids[:-1]
    worst = 0.0
    for s, t in enumerate(feed):
        lg = ref.step(t).get()
        if s in (0, 1, 7, 31, 63):
            rel = float(np.linalg.norm(got[s] - lg) / np.linalg.norm(lg))
            worst = max(worst, rel)
            assert rel < 1e-2, (s, rel)
    print(f"2b {dtype} vs float32: worst relative logits error {worst:.2e}")
    b.close()
