"""Speculative decoding in the monokernel (mk_spec.cuh, mk_spec_lm.cuh): verify passes of the last token and
its prompt-lookup drafts, acceptance and drafting on the device. Lossless means bit for bit here: every
position of a pass computes what a plain step computes there, so the logits of every token given are the
plain kernel's exactly, the ids are the plain decode's (and the numpy engine's), greedy or sampled, and
the cache a run leaves behind continues as the plain one does. Runs on the GPU machine:
`pytest -m gpu tests/test_cuda_spec.py`; skips cleanly without CuPy or a GPU."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

try:
    import cupy as cp
    HAVE_GPU = cp.cuda.runtime.getDeviceCount() > 0
except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
    cp, HAVE_GPU = None, False

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")]

from kog_dist.backend import RunCommand  # noqa: E402
from kog_dist.checkpoint import Model  # noqa: E402
from kog_dist.engine import ReferenceEngine  # noqa: E402
from kog_dist.sampling import SamplingParams  # noqa: E402
from kog_dist.tiny import write_tiny_checkpoint  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
ONE = dict(num_lanes=1, broadcast_delay=1, num_hidden_layers=3, vocab_size=512)
MODELS = {
    # SmolLM2's heads (9 query / 3 kv heads of 64, D 576), tied, biases
    "hd64_h9kv3_tied_bias": (dict(ONE, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                  intermediate_size=256, tie_word_embeddings=True, attention_bias=True), "F32"),
    # head_dim 128, untied, Llama-3 rope scaling
    "hd128_untied_llama3": (dict(ONE, hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=512, rope_theta=500000.0, rope_scaling=LLAMA3), "F32"),
    # a sliding window of 8 on every layer: a pass's positions see different windows
    "hd64_slide_all": (dict(ONE, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                            head_dim_override=64, intermediate_size=384, sliding_window=8,
                            sliding_window_n_layers=3), "F32"),
    # quantized layer matrices (Q4_1, the default model's type) and bf16 storage
    "q4_1": (dict(ONE, hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=256,
                  tie_word_embeddings=True), "Q4_1:F32"),
    "bf16": (dict(ONE, hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=256,
                  tie_word_embeddings=True, attention_bias=True), "BF16"),
}
GEN = 128
# a prompt that repeats itself: random-weight models then loop, and the context holds what they repeat
PROMPT = [1, 17, 33, 250, 9, 77, 401, 12, 5, 300, 41, 42] * 3


def _cfg(over):
    from kog_dist.config import LaneformerConfig
    from kog_dist.tiny import TINY_DEFAULTS
    return LaneformerConfig.from_dict(dict(TINY_DEFAULTS, **over, model_type="laneformer_tp"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from workers.cuda.build import prebuild, spec_positions, speculating_defines
    out = {}
    for name, (over, dt) in MODELS.items():
        d = str(tmp_path_factory.mktemp(name))
        write_tiny_checkpoint(d, dtype="F32", seed=zlib.crc32(name.encode()) % 1000, **over)
        if over.get("tie_word_embeddings"):   # tiny's N(0, 1) tied rows: scaled as test_cuda_llama does
            from test_cuda_llama import _adjust
            _adjust(d, over)
        out[name] = d
    items = []
    for over, dt in MODELS.values():
        sp = spec_positions(_cfg(over), dt, 132)
        items += [(_cfg(over), dt), (_cfg(over), dt, sp)]
        sd = speculating_defines(_cfg(over), dt, 132)   # a speculating backend's two builds
        sps = spec_positions(_cfg(over), dt, 132, nthreads=sd["CFG_NT"])
        items += [(_cfg(over), dt, 0, sd), (_cfg(over), dt, sps, sd)]
    prebuild(items)
    return out


def _backend(path, dtype, extra=None, speculative=False):
    from workers.cuda.backend import CudaBackend
    return CudaBackend(path, max_seq=512, num_slots=2, progress=False, dtype=dtype, extra_defines=extra,
                       speculative=speculative)


def _echo_prompt(b):
    """The prompt, what the model says after it (48 tokens, slot 0), and the prompt again: what the model says
    next is then mostly in its context, so drafts get accepted."""
    said = b.run(RunCommand(slot=0, append=PROMPT, max_new_tokens=48), ignore_eos=True).token_ids
    return PROMPT + said + PROMPT


def _run(b, cmd, n):
    dbg = cp.zeros((n, b.cfg.vocab_size), cp.float32)
    r = b.run(cmd, ignore_eos=True, dbg_logits=dbg)
    return r, dbg.get()[:len(r.token_ids)]


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _plain_then_speculative(b, label):
    """The echo prompt's greedy decode of GEN tokens without and with speculation (k = 8) on backend b
    (closed after): the ids and the logits of every token given are the same bit for bit, and drafts were
    accepted. Returns (prompt, plain result, speculative result)."""
    try:
        prompt = _echo_prompt(b)
        plain, lp = _run(b, RunCommand(slot=0, append=prompt, max_new_tokens=GEN), GEN)
        spec, ls = _run(b, RunCommand(slot=1, append=prompt, max_new_tokens=GEN, speculative=8), GEN)
    finally:
        b.close()
    i = _first_diff(spec.token_ids, plain.token_ids)
    assert i is None, f"{label}: first difference at token {i}"
    bad = np.nonzero((ls != lp).any(axis=1))[0]
    assert bad.size == 0, f"{label}: logits of tokens {bad[:8]} differ (max {np.abs(ls - lp).max():.3e})"
    assert spec.spec_steps > 0 and spec.spec_accepted > 0, spec.stats()
    return prompt, plain, spec


def _numpy_greedy(path, prompt):
    """The numpy engine's greedy ids for GEN tokens after prompt."""
    m = Model(path, progress=False)
    eng = ReferenceEngine(m.cfg, m.weights, m.embed)
    lg, ref = eng.prefill(prompt), []
    for _ in range(GEN):
        ref.append(int(np.argmax(lg)))
        lg = eng.step(ref[-1])
    return ref


@pytest.mark.parametrize("speculating", [False, True], ids=["plain_backend", "speculating_backend"])
@pytest.mark.parametrize("name", list(MODELS))
def test_speculative_greedy_is_the_plain_decode_bit_for_bit(models, name, speculating):
    """Greedy, 128 tokens after a prompt that holds much of what the model will say: the ids with speculation
    (k = 8) are the plain kernel's, the logits of every token given are the plain kernel's bit for bit, and
    drafts were accepted. fp32 storage: the ids are also the numpy engine's. Both for a backend made
    without speculation and for one made to speculate (both builds with its defines: 384 threads for most here, a chunk a lane for Q4_1)."""
    over, dt = MODELS[name]
    b = _backend(models[name], dt, speculative=speculating)
    if speculating:
        assert b.k.nthreads == b._spec()[0].nthreads
    prompt, plain, spec = _plain_then_speculative(b, name)
    assert plain.stop_reason == spec.stop_reason == "length"
    if dt == "F32":
        i = _first_diff(spec.token_ids, _numpy_greedy(models[name], prompt))
        assert i is None, f"{name}: token {i} differs from the numpy engine's"


@pytest.mark.parametrize("speculating", [False, True], ids=["plain_backend", "speculating_backend"])
def test_speculative_many_chunks_is_the_plain_decode_bit_for_bit(models, speculating):
    """Attention in many position chunks (CFG_ATT_MINPOS 3: more than 8 a kv head past 24 positions, 44 past
    132, as SmolLM2 has at a 3968-token context): the plain step merges them once a kv head after attention
    (mk_att.cuh att_merge_step, in groups of threads) and the verify pass's last chunk block with the same
    att_merge, so the logits of every token given are still the plain kernel's bit for bit and the ids the
    numpy engine's."""
    name = "hd64_h9kv3_tied_bias"
    b = _backend(models[name], "F32", extra={"CFG_ATT_MINPOS": 3}, speculative=speculating)
    prompt, plain, _ = _plain_then_speculative(b, "CFG_ATT_MINPOS=3")
    i = _first_diff(plain.token_ids, _numpy_greedy(models[name], prompt))
    assert i is None, f"token {i} differs from the numpy engine's"


def test_speculative_sampling_draws_the_plain_tokens(models):
    """Sampled (temperature, top-p, seed): each position's token is the plain sampler's draw at its counter,
    so the ids with speculation are the plain run's; another seed gives other ids."""
    name = "hd64_h9kv3_tied_bias"
    b = _backend(models[name], "F32")
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    try:
        plain = b.run(RunCommand(slot=0, append=PROMPT, max_new_tokens=96, sampling=sp), ignore_eos=True)
        spec = b.run(RunCommand(slot=1, append=PROMPT, max_new_tokens=96, sampling=sp, speculative=8),
                     ignore_eos=True)
        other = b.run(RunCommand(slot=1, append=PROMPT, max_new_tokens=96, speculative=8,
                                 sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=12)), ignore_eos=True)
    finally:
        b.close()
    assert spec.token_ids == plain.token_ids
    assert other.token_ids != plain.token_ids
    assert spec.spec_steps > 0 and spec.spec_drafted > spec.spec_accepted, spec.stats()   # drafts rejected


def test_speculative_stops_and_the_cache_it_leaves(models):
    """A stop id and max_tokens that fall inside a pass's accepted drafts end the run where the plain run
    ends; the slot then holds what the plain run's holds: a second turn on it gives the plain ids."""
    name = "hd64_h9kv3_tied_bias"
    b = _backend(models[name], "F32")
    try:
        base = b.run(RunCommand(slot=0, append=PROMPT, max_new_tokens=GEN), ignore_eos=True).token_ids
        stop_at = next(i for i in range(30, GEN) if base[i] not in base[:i])   # a token's first appearance
        for kw in ({"stop_ids": (base[stop_at],), "max_new_tokens": GEN}, {"max_new_tokens": 37}):
            runs = []
            for slot, k in ((0, 0), (1, 8)):
                r1 = b.run(RunCommand(slot=slot, append=PROMPT, speculative=k, **kw), ignore_eos=True)
                turn = [3, 5, 7, 11]
                r2 = b.run(RunCommand(slot=slot, keep=b.cached(slot), append=turn, max_new_tokens=48, speculative=k),
                           ignore_eos=True)
                runs.append((r1.token_ids, r1.stop_reason, r1.cached, r2.token_ids))
            assert runs[0] == runs[1], kw
            if "stop_ids" in kw:
                assert runs[0][1] == "stop" and runs[0][0][-1] == base[stop_at]
        assert runs[0][1] == "length" and len(runs[0][0]) == 37
    finally:
        b.close()


def test_device_drafting_follows_the_cpu_rule(models):
    """The drafts come from the device's lookup and sizes (mk_spec_lm.cuh draft_lookup, draft_update,
    draft_size): replaying the run on the host with kog_dist.speculative.lookup and AdaptiveDraft (backend.py's
    shortest match and first draft, the same clipping to the tokens and positions left) over the plain run's
    ids gives the kernel's counts of passes, draft tokens and accepted ones exactly."""
    from kog_dist.speculative import MAX_NGRAM, AdaptiveDraft, lookup
    from workers.cuda import backend as B
    name, n, k = "hd64_h9kv3_tied_bias", 96, 8
    b = _backend(models[name], "F32")
    try:
        prompt = _echo_prompt(b)
        plain = b.run(RunCommand(slot=0, append=prompt, max_new_tokens=n + 16), ignore_eos=True).token_ids
        spec = b.run(RunCommand(slot=1, append=prompt, max_new_tokens=n, speculative=k), ignore_eos=True)
        sp_max = b.spec_max
    finally:
        b.close()
    assert spec.token_ids == plain[:n]
    ctx, given = list(prompt) + [plain[0]], 1          # the first pass: the last prompt token alone
    policy = AdaptiveDraft(min(k, sp_max - 1), start=B.SPEC_START)
    steps = drafted = accepted = 0
    while given < n:
        kk = min(policy.size(), n - given - 1, 512 - (len(ctx) - 1) - 1, sp_max - 1)
        draft = lookup(ctx, kk, MAX_NGRAM, B.SPEC_MIN_NGRAM) if kk > 0 else []
        acc = 0
        while acc < len(draft) and draft[acc] == plain[given + acc]:
            acc += 1
        if draft:
            steps, drafted, accepted = steps + 1, drafted + len(draft), accepted + acc
        policy.update(len(draft), acc)
        take = min(acc + 1, n - given)
        ctx += plain[given:given + take]
        given += take
    assert (spec.spec_steps, spec.spec_drafted, spec.spec_accepted) == (steps, drafted, accepted)
    assert accepted > 0


def test_speculative_cache_equals_the_plain_cache(models):
    """After a run with speculation, the slot's keys and values at every position it holds are the plain
    run's bit for bit (rejected positions past them are overwritten before any query reads them)."""
    name = "hd64_slide_all"
    b = _backend(models[name], "F32")
    try:
        prompt = _echo_prompt(b)
        plain = b.run(RunCommand(slot=0, append=prompt, max_new_tokens=80), ignore_eos=True)
        spec = b.run(RunCommand(slot=1, append=prompt, max_new_tokens=80, speculative=8), ignore_eos=True)
        assert spec.token_ids == plain.token_ids and spec.cached == plain.cached
        assert spec.spec_accepted > 0, spec.stats()
        n = plain.cached
        for a, c in zip(b.caches[0], b.caches[1]):      # keys, then values: [layers, kv heads, max_seq, hd]
            assert cp.array_equal(a[:, :, :n], c[:, :, :n]), "cache differs"
    finally:
        b.close()


def test_out_of_line_phases_give_the_same_bits(models):
    """The knob CFG_SPEC_NOINL=1 (the pass's phases out of line, reading Params from the shared copy) changes
    where the code lives, not what it computes: the ids and logits of the greedy test's run are the plain
    kernel's bit for bit. (Written without device time: not run yet.)"""
    name = "q4_1"
    over, dt = MODELS[name]
    b = _backend(models[name], dt, {"CFG_SPEC_NOINL": 1})
    try:
        prompt = _echo_prompt(b)
        plain, lp = _run(b, RunCommand(slot=0, append=prompt, max_new_tokens=GEN), GEN)
        spec, ls = _run(b, RunCommand(slot=1, append=prompt, max_new_tokens=GEN, speculative=8), GEN)
    finally:
        b.close()
    assert spec.token_ids == plain.token_ids and spec.spec_accepted > 0
    assert np.array_equal(ls, lp)


def test_sampled_tokens_follow_the_model_distribution(models):
    """Over many seeds, the first three tokens sampled on the device with speculation after a context that
    drafts (temperature 0.6, top-p 0.98) follow the model's exact distribution (plain numpy forwards,
    chi-square at p = 1e-4; tests/spec_stats.py), as the plain kernel's do over other seeds; the same counts
    against 1.15 times the temperature are told apart. Drafts were accepted and rejected."""
    from spec_stats import assert_sampler_follows, draws_after_echo
    name, sp = "hd64_h9kv3_tied_bias", SamplingParams(temperature=0.6, top_p=0.98)
    # chosen among random prompts (seed 0) for the check's power: after the echo the model says what it said
    # the first time with probability 0.70 (then the lookup drafts), the two drafts next with 0.35, 0.47
    b = _backend(models[name], "F32")
    try:
        ctx, spec, plain, drafted, accepted = draws_after_echo(b, [211, 227, 244, 488, 102, 257, 28, 219], sp, 2000)
    finally:
        b.close()
    m = Model(models[name], progress=False)
    assert_sampler_follows(ReferenceEngine(m.cfg, m.weights, m.embed), ctx, sp, spec, plain, drafted, accepted)
