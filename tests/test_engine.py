"""The numpy engine against the independent float64 full recompute of tests/reference64.py."""
import zlib

import numpy as np
import pytest

from kog_dist.checkpoint import Model
from kog_dist.engine import ReferenceEngine
from kog_dist.sampling import SamplingParams
from kog_dist.tiny import write_tiny_checkpoint
from kog_dist.backend import RunCommand
from workers.cpu_backend import CpuBackend

from reference64 import Ref64

BASE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
            intermediate_size=128, vocab_size=300, num_lanes=4, broadcast_delay=2)
# Each variant names what it covers; together: δ 1,2,3; L 1,4,8; GQA 1,2,4; sliding first and last;
# the three comm flags off; tied embeddings; per-lane norm scales; sharded files; bf16 and fp16 storage.
VARIANTS = {
    "d1_L4_gqa2": dict(broadcast_delay=1),
    "d2_L8_gqa1": dict(num_lanes=8, num_key_value_heads=8),
    "d3_L4_gqa4_slide_first": dict(broadcast_delay=3, num_attention_heads=16, num_key_value_heads=4,
                                   sliding_window=3, sliding_window_n_layers=2),
    "L1_slide_last": dict(num_lanes=1, broadcast_delay=1, sliding_window=4, sliding_window_n_layers=-2),
    "no_early_comm": dict(use_early_comm=False),
    "no_early_to_future": dict(early_layers_to_future=False),
    "no_early_both": dict(use_early_comm=False, early_layers_to_future=False, broadcast_delay=1),
    "no_comm": dict(use_comm=False),
    "tied": dict(tie_word_embeddings=True),
    "lane_scales": dict(replicated_rmsn_scale=False, num_lanes=8, num_key_value_heads=8),
    "sharded": dict(_shards=3),
    "bf16": dict(_dtype="BF16", num_lanes=8, num_key_value_heads=8, broadcast_delay=3),
    "fp16": dict(_dtype="F16", sliding_window=5, sliding_window_n_layers=-1),
}


def make(tmp_path_factory, name):
    v = dict(BASE, **VARIANTS[name])
    dtype, shards = v.pop("_dtype", "F32"), v.pop("_shards", 1)
    d = str(tmp_path_factory.mktemp(name))
    write_tiny_checkpoint(d, dtype=dtype, shards=shards, seed=zlib.crc32(name.encode()) % 1000, **v)
    return d


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_float64_full_recompute(tmp_path_factory, name):
    d = make(tmp_path_factory, name)
    m = Model(d)
    ref = Ref64(d)
    rng = np.random.default_rng(0)
    ids = list(rng.integers(0, m.cfg.vocab_size, size=12))
    eng = ReferenceEngine(m.cfg, m.weights, m.embed)
    got_prefill = eng.forward(np.array(ids[:9]), all_logits=True)        # batched prefill, all positions
    got = [eng.step(t) for t in ids[9:]]                                   # then decode with the cache
    want = ref.logits(ids)
    for t in range(9):
        assert rel(got_prefill[t], want[t]) < 2e-6, (name, t, rel(got_prefill[t], want[t]))
    for j, g in enumerate(got):
        assert rel(g, want[9 + j]) < 2e-6, (name, 9 + j)


@pytest.mark.parametrize("name", ["d1_L4_gqa2", "d3_L4_gqa4_slide_first", "L1_slide_last", "bf16",
                                  "no_early_both", "lane_scales"])
def test_greedy_ids_match_for_32_tokens(tmp_path_factory, name):
    d = make(tmp_path_factory, name)
    m = Model(d)
    b = CpuBackend(m.cfg, m.weights, m.embed)
    prompt = [1, 17, 42, 99, 7]
    res = b.run(RunCommand(append=prompt, max_new_tokens=32))
    want = Ref64(d).greedy(prompt, 32)
    if m.cfg.eos_token_ids[0] in want:                 # the engine stops at EOS, the reference goes on
        want = want[:want.index(m.cfg.eos_token_ids[0]) + 1]
    assert res.token_ids == want
    assert res.cached == len(prompt) + len(want) - 1


def test_sliding_window_changes_the_function(tmp_path_factory):
    """The mask is really applied: a window that cuts the context gives other logits than none."""
    d = make(tmp_path_factory, "L1_slide_last")
    m = Model(d)
    ids = np.arange(3, 15)
    a = ReferenceEngine(m.cfg, m.weights, m.embed).forward(ids)
    import dataclasses
    cfg2 = dataclasses.replace(m.cfg, sliding_window=None)
    b = ReferenceEngine(cfg2, m.weights, m.embed).forward(ids)
    assert rel(a, b) > 1e-3


def test_session_continuation_equals_one_shot(tmp_path_factory):
    d = make(tmp_path_factory, "d2_L8_gqa1")
    m = Model(d)
    b = CpuBackend(m.cfg, m.weights, m.embed, num_slots=2)
    sp = SamplingParams(temperature=0.9, top_k=20, seed=5)
    r1 = b.run(RunCommand(slot=1, append=[1, 2, 3], max_new_tokens=6, sampling=sp))
    r2 = b.run(RunCommand(slot=1, keep=r1.cached, append=[r1.token_ids[-1], 9, 10], max_new_tokens=6,
                          sampling=sp))
    assert r2.prefill_tokens == 3                      # nothing held was run again
    full = [1, 2, 3] + r1.token_ids + [9, 10]
    one = CpuBackend(m.cfg, m.weights, m.embed).run(RunCommand(append=full, max_new_tokens=6, sampling=sp))
    assert one.token_ids == r2.token_ids


def test_rank_slices_hold_only_their_lanes(tmp_path_factory):
    d = make(tmp_path_factory, "d2_L8_gqa1")
    full = Model(d)
    half = Model(d, lanes=range(4, 8))
    w = "model.layers.1.feed_forward.w2.weight"
    assert half.weights[w].shape[0] == 4
    np.testing.assert_array_equal(half.weights[w], full.weights[w][4:8])
    lane_bytes = lambda m: sum(a.nbytes for k, a in m.weights.items() if ".attention.w" in k or ".feed_forward." in k)
    assert lane_bytes(half) * 2 == lane_bytes(full)
