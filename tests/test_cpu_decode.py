"""workers.cpu_decode's fast decode step against ReferenceEngine.step (the executable spec): the same
greedy ids and logits within float32 rounding, on random tiny models of one lane (the Llama-family
path: GQA, q/k/v biases, sliding windows, llama3 rope scaling, a head_dim override) and of several
lanes (the combine rule with its delays and switches), through the CPU backend's sessions, and on
the real default model when the cache has it."""
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from kog_dist.backend import RunCommand
from kog_dist.checkpoint import Model, Weights, expected_tensors
from kog_dist.config import LaneformerConfig
from kog_dist.engine import ReferenceEngine
from kog_dist.models import default_gguf_path
from kog_dist.sampling import SamplingParams
from kog_dist.tokenizer import load_tokenizer
from workers.cpu_backend import CpuBackend
from workers import cpu_verify
from workers.cpu_decode import FastDecoder, FusedWeights, ThreadChooser
from workers.cpu_verify import verify_rows

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
BASE = dict(hidden_size=48, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
            intermediate_size=64, vocab_size=97, num_lanes=1, max_position_embeddings=256)
ONE_LANE = {
    "gqa": dict(),
    "mha_tied": dict(num_key_value_heads=6, tie_word_embeddings=True),
    "bias_window_first": dict(attention_bias=True, sliding_window=5, sliding_window_n_layers=2),
    "window_last_llama3": dict(sliding_window=3, sliding_window_n_layers=-1, rope_scaling=LLAMA3,
                               rope_theta=500000.0),
    "head_dim_override": dict(head_dim_override=16, attention_bias=True),
}
LANES = {
    "delay1": dict(num_lanes=2, broadcast_delay=1),
    "delay2_no_future": dict(num_lanes=2, broadcast_delay=2, early_layers_to_future=False,
                             attention_bias=True),
    "no_early_comm": dict(num_lanes=2, broadcast_delay=1, use_early_comm=False, sliding_window=4,
                          sliding_window_n_layers=-2),
    "no_comm_unshared_norms": dict(num_lanes=2, use_comm=False, replicated_rmsn_scale=False),
    "six_lanes_mha": dict(num_lanes=6, num_key_value_heads=6, broadcast_delay=3, num_hidden_layers=5,
                         intermediate_size=72),
}


def random_model(over: dict, seed: int = 0):
    """(cfg, Weights as load_weights gives them, embed) with random float32 weights."""
    cfg = LaneformerConfig(**{**BASE, **over}).validate()
    rng = np.random.default_rng(seed)
    w = Weights()
    w.lanes = range(cfg.num_lanes)
    for name, shape in expected_tensors(cfg).items():
        if name.endswith((".weight", ".bias")) and "norm" not in name:
            w[name] = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        else:   # norm scales: [L, D] whether replicated or not
            w[name.replace(".scale", ".weight")] = (1.0 + 0.2 * rng.standard_normal(
                (cfg.num_lanes, cfg.hidden_size))).astype(np.float32)
    table = w["model.tok_embeddings.weight"]
    if cfg.tie_word_embeddings:
        w["lm_head.weight"] = table
    return cfg, w, lambda ids: table[np.asarray(ids)]


def decode_both(cfg, w, embed, prompt, n):
    """Greedy decode from the reference engine; the fast step follows the same ids on its own engine
    and gives its logits at every step. Returns (reference logits, fast logits, ids)."""
    ref = ReferenceEngine(cfg, w, embed)
    want = ref.prefill(prompt)
    fast_w = {k: v for k, v in w.items()}                     # FusedWeights puts views in its copy
    dec = FastDecoder(cfg, FusedWeights(cfg, fast_w), embed)
    eng = ReferenceEngine(cfg, fast_w, embed)
    got = eng.prefill(prompt)
    ref_lg, fast_lg, ids = [want], [got], []
    for _ in range(n):
        ids.append(int(np.argmax(want)))
        want, got = ref.step(ids[-1]), dec.step(eng, ids[-1])
        ref_lg.append(want)
        fast_lg.append(got)
    assert eng.pos == ref.pos == len(prompt) + n
    return ref_lg, fast_lg, ids


def assert_close(ref_lg, fast_lg, rel=1e-4):
    for k, (a, b) in enumerate(zip(ref_lg, fast_lg)):
        assert a.shape == b.shape and b.dtype == np.float32
        err = np.max(np.abs(a - b)) / np.max(np.abs(a))
        assert err <= rel, (k, err)
        assert int(np.argmax(a)) == int(np.argmax(b)), k


@pytest.mark.parametrize("name", sorted(ONE_LANE) + sorted(LANES))
def test_fast_step_is_the_reference_step(name):
    """62 prompt tokens then 10 steps: the cache grows past its first capacity (64) mid-decode, and the
    windows slide."""
    cfg, w, embed = random_model({**ONE_LANE, **LANES}[name], seed=len(name))
    prompt = [int(x) for x in np.random.default_rng(1).integers(0, cfg.vocab_size, 62)]
    ref_lg, fast_lg, _ = decode_both(cfg, w, embed, prompt, 10)
    assert_close(ref_lg, fast_lg)


def test_a_wrong_window_or_rope_would_show():
    """The comparison can fail: the same model with the window dropped, or another rope base, departs."""
    cfg, w, embed = random_model(ONE_LANE["bias_window_first"], seed=3)
    prompt = list(range(1, 40))
    ref_lg, _, ids = decode_both(cfg, w, embed, prompt, 3)
    for change in (dict(sliding_window=None), dict(rope_theta=20000.0)):
        other = dataclasses.replace(cfg, **change)
        eng = ReferenceEngine(other, dict(w), embed)
        dec = FastDecoder(other, FusedWeights(other, dict(w)), embed)
        eng.prefill(prompt)
        got = dec.step(eng, ids[0])
        assert np.max(np.abs(got - ref_lg[1])) / np.max(np.abs(ref_lg[1])) > 1e-3, change


def test_fusing_shares_memory_with_the_engine_weights():
    cfg, w, embed = random_model(LANES["delay1"])
    before = {k: v.copy() for k, v in w.items()}
    fw = FusedWeights(cfg, w)
    qkv = fw.layers[1]["qkv"]
    assert qkv.shape == (2, (6 + 2 * 2) // 2 * 8, 48) and qkv.flags.c_contiguous
    for k, v in before.items():
        assert np.array_equal(w[k], v), k
    assert np.shares_memory(w["model.layers.1.attention.wk.weight"], qkv)
    assert np.shares_memory(w["model.layers.1.feed_forward.w3.weight"], fw.layers[1]["gu"])


@pytest.mark.parametrize("name", ["gqa", "delay2_no_future"])
def test_backend_sessions_fast_and_reference_agree(name):
    """CpuBackend with the fast step and with the engine's own step: the same ids through a session that
    keeps part of its cache, re-runs the last token, and a second slot."""
    cfg, w, embed = random_model({**ONE_LANE, **LANES}[name], seed=7)
    greedy = SamplingParams()
    runs = []
    for fast in (True, False):
        b = CpuBackend(cfg, {k: v for k, v in w.items()}, embed, num_slots=2, fast=fast)
        out = []
        r = b.run(RunCommand(slot=0, append=[3, 9, 27, 81, 5], max_new_tokens=12, sampling=greedy), ignore_eos=True)
        out.append(r.token_ids)
        r = b.run(RunCommand(slot=0, keep=8, append=[7, 7], max_new_tokens=9, sampling=greedy), ignore_eos=True)
        out.append(r.token_ids)
        r = b.run(RunCommand(slot=0, keep=b.cached(0), append=[], max_new_tokens=5, sampling=greedy), ignore_eos=True)
        out.append(r.token_ids)
        r = b.run(RunCommand(slot=1, append=[11, 12], max_new_tokens=7, sampling=greedy), ignore_eos=True)
        out.append(r.token_ids + [b.cached(0), b.cached(1)])
        runs.append(out)
    assert runs[0] == runs[1]
    assert len(set(runs[0][0])) > 1          # not a constant stream that any step would give


def steps_then_verify(cfg, w, embed, prompt, tokens):
    """The fast step's logits for `tokens` fed one at a time, and one verify pass over the same tokens
    from the same cache; (step logits, verify rows, step caches' K, V, verify caches' K, V)."""
    fw = FusedWeights(cfg, dict(w))
    dec = FastDecoder(cfg, fw, embed)
    one, many = ReferenceEngine(cfg, dict(w), embed), ReferenceEngine(cfg, dict(w), embed)
    one.prefill(prompt)
    many.prefill(prompt)
    want = np.stack([dec.step(one, t) for t in tokens])
    rows = verify_rows(dec, many, tokens)
    assert many.pos == one.pos == len(prompt) + len(tokens)
    n = one.pos
    kv = lambda e: [(c.k[:, :, :n].copy(), c.v[:, :, :n].copy()) for c in e.caches]
    return want, rows, kv(one), kv(many)


@pytest.mark.parametrize("name", sorted(ONE_LANE))
def test_verify_pass_is_bitwise_the_fast_steps(name, monkeypatch):
    """k + 1 = 1, 2, 5, 8 positions in one pass: every row of logits and every KV entry written is
    bitwise what the one-token steps give (greedy and seeded ids cannot differ), across the cache's
    growth past 64, sliding windows, and an LM head applied in several row blocks (one partial)."""
    monkeypatch.setattr(cpu_verify, "HEAD_BLOCK", 40)           # V = 97: blocks of 40, 40, 17
    cfg, w, embed = random_model(ONE_LANE[name], seed=len(name) + 1)
    rng = np.random.default_rng(2)
    prompt = [int(x) for x in rng.integers(0, cfg.vocab_size, 59)]
    for T in (1, 2, 5, 8):
        tokens = [int(x) for x in rng.integers(0, cfg.vocab_size, T)]
        want, rows, kv_one, kv_many = steps_then_verify(cfg, w, embed, prompt, tokens)
        assert rows.shape == want.shape == (T, cfg.vocab_size) and rows.dtype == np.float32
        assert np.array_equal(rows, want), (T, np.max(np.abs(rows - want)))
        for (k1, v1), (k2, v2) in zip(kv_one, kv_many):
            assert np.array_equal(k1, k2) and np.array_equal(v1, v2)


def test_verify_pass_refuses_what_it_cannot_run():
    cfg, w, embed = random_model(ONE_LANE["gqa"])
    dec = FastDecoder(cfg, FusedWeights(cfg, dict(w)), embed)
    eng = ReferenceEngine(cfg, dict(w), embed, max_seq=8)
    eng.prefill([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="exceeds the limit of 8"):
        verify_rows(dec, eng, [1, 2, 3, 4])
    assert eng.pos == 5
    with pytest.raises(ValueError, match="at least one"):
        verify_rows(dec, eng, [])
    cfg2, w2, embed2 = random_model(LANES["delay1"])
    dec2 = FastDecoder(cfg2, FusedWeights(cfg2, dict(w2)), embed2)
    assert cpu_verify.supports(dec) and not cpu_verify.supports(dec2) and not cpu_verify.supports(None)


def test_context_limit_is_refused():
    cfg, w, embed = random_model(ONE_LANE["gqa"])
    eng = ReferenceEngine(cfg, dict(w), embed, max_seq=6)
    dec = FastDecoder(cfg, FusedWeights(cfg, dict(w)), embed)
    eng.prefill([1, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match="exceeds the limit of 6"):
        dec.step(eng, 1)
    assert eng.pos == 6


@pytest.mark.skipif(default_gguf_path() is None, reason="the default model (SmolLM2-135M GGUF) is not in the cache")
def test_real_default_model_greedy_ids_equal():
    """SmolLM2-135M-Instruct from its GGUF: 32 greedy tokens of the fast step equal the engine's, each
    chosen from logits within 1e-4 relative."""
    m = Model(default_gguf_path(), progress=False)
    try:
        tok = load_tokenizer(m.src)
        prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
        ref_lg, fast_lg, ids = decode_both(m.cfg, m.weights, m.embed, prompt, 32)
        assert_close(ref_lg, fast_lg)
        assert len(set(ids)) > 4 and "Paris" in tok.decode(ids)
    finally:
        m.close()


@pytest.mark.skipif(default_gguf_path() is None, reason="the default model (SmolLM2-135M GGUF) is not in the cache")
def test_real_default_model_verify_pass_is_bitwise_the_fast_steps():
    """The default model's shapes: 8 positions in one pass (its 113 MB LM head in blocks of 4096 rows)
    give bitwise the logits and KV entries of 8 one-token steps."""
    m = Model(default_gguf_path(), progress=False)
    try:
        tok = load_tokenizer(m.src)
        prompt = tok.encode_chat([{"role": "user", "content": "Rename x to y: x = 1; print(x)"}])
        want, rows, kv_one, kv_many = steps_then_verify(m.cfg, m.weights, m.embed, prompt,
                                                        [87, 284, 216, 33, 446, 28, 216, 17])
        assert np.array_equal(rows, want)
        assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(kv_one, kv_many))
    finally:
        m.close()


def test_bench_cpu_on_a_gguf_file(tmp_path):
    """`kog bench --backend cpu --model FILE.gguf`: loads the file itself (a path, as open_model takes),
    times the load, and decodes the same greedy ids under every BLAS thread setting it measures; the
    llama.cpp row is there, measured or saying why not."""
    import gguf
    from hf_reference import random_hf_tensors, tiny_hf_config, write_gguf
    c = tiny_hf_config("llama", tie_word_embeddings=True)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, c, random_hf_tensors(c), qtype=lambda n: gguf.GGMLQuantizationType.Q8_0)
    r = subprocess.run([sys.executable, "-m", "kog_cli", "bench", "--backend", "cpu", "--model", path, "--json",
                        "--reps", "1", "--pp", "8", "--prompt", "4", "--gen", "6", "--baselines", "none"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    mk = rep["monokernel"]
    assert rep["model"] == path and 0 < mk["load_s"] < 30
    rows = mk["tg_threads"]
    assert rows and all(x["gen"] == 6 for x in rows)
    assert len({tuple(x["ids_head"]) for x in rows}) == 1, rows      # threads change speed, not ids
    assert mk["tg"]["threads"] == mk["default_threads"]
    cpp = [b for b in rep["baselines"] if b["mode"].startswith("llama.cpp")]
    # measured, or why not (not installed; or, for this file, llama.cpp wants a real vocabulary)
    assert cpp and all(b.get("tokens_per_s", 0) > 0 or b["error"] for b in cpp), cpp
    r = subprocess.run([sys.executable, "-m", "kog_cli", "bench", "--backend", "cpu", "--model",
                        str(tmp_path / "none.gguf")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "none.gguf" in r.stderr, r.stderr


def test_thread_chooser_follows_the_faster_count():
    """Tries each count once, runs the faster, re-tries the other every `explore` steps, and moves over
    when the times turn (another process took a core)."""
    tc = ThreadChooser([1, 2], explore=4)
    assert tc.best() is None
    cost = {1: 0.020, 2: 0.014}
    picks = []
    for _ in range(16):
        n = tc.pick()
        picks.append(n)
        tc.record(n, cost[n])
    assert picks[:2] == [1, 2] and picks.count(1) == 1 + 4, picks      # explored at steps 4, 8, 12, 16
    tc.record(2, 0.500)                   # one step another process delayed: no switch
    assert tc.best() == 2
    cost = {1: 0.020, 2: 0.080}           # contention: two threads now lose
    later = []
    for _ in range(16):
        n = tc.pick()
        later.append(n)
        tc.record(n, cost[n])
    assert later[-8:].count(1) >= 6 and tc.runs[1] + tc.runs[2] == 33, later
