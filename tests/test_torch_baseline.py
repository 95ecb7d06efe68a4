"""workers.cuda.torch_baseline against an independent float64 numpy implementation of the spec.

The numpy reference below is written straight from /work/shared/spec/laneformer.md: one token at a
time, one lane at a time, one head at a time, RoPE pair by pair. The torch module (lane as a batch
dimension, static KV cache, masks from device positions) runs on the CPU here; its decode step is the
same code that the GPU modes capture in a CUDA graph.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

from workers.cuda import torch_baseline as tb

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (pip install torch==2.13.0)")

BASE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
            intermediate_size=128, vocab_size=101, num_lanes=4, broadcast_delay=2, use_comm=True,
            use_early_comm=True, early_layers_to_future=True, rope_theta=10000.0, norm_eps=1e-5,
            sliding_window=4, sliding_window_n_layers=2, lm_head_type="replicate",
            replicated_rmsn_scale=True, max_position_embeddings=64, tie_word_embeddings=False)

VARIANTS = {
    "base": {},
    "delay1_no_early_flags_last_layer_slides_mha_lane_scales": dict(
        broadcast_delay=1, use_early_comm=False, early_layers_to_future=False, sliding_window_n_layers=-1,
        num_key_value_heads=None, replicated_rmsn_scale=False),
    "no_comm_tied_2lanes": dict(use_comm=False, tie_word_embeddings=True, num_lanes=2,
                                num_hidden_layers=2),
    "gqa_2kv_per_lane_delay3": dict(hidden_size=128, num_attention_heads=16, num_key_value_heads=8,
                                    num_hidden_layers=4, broadcast_delay=3, use_early_comm=False,
                                    sliding_window=3, sliding_window_n_layers=3),
    "one_lane": dict(num_lanes=1, broadcast_delay=1, num_hidden_layers=2),
}


# ---------------------------------------------------------------------------------------------------------
# independent float64 reference


def make_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """float64 arrays whose values are exactly representable in float32."""
    rng = np.random.default_rng(seed)
    D, N, L = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_lanes"]
    H = cfg["num_attention_heads"]
    KV = cfg["num_key_value_heads"] or H
    hd, F, V = D // H, cfg["intermediate_size"], cfg["vocab_size"]

    def mat(*shape):
        return rng.normal(0, 1 / math.sqrt(shape[-1]), shape)

    def scale():
        return 1 + 0.2 * rng.normal(size=(D,) if cfg["replicated_rmsn_scale"] else (L, D))

    suf = "weight" if cfg["replicated_rmsn_scale"] else "scale"
    w = {"model.tok_embeddings.weight": rng.normal(size=(V, D))}
    for i in range(N):
        p = f"model.layers.{i}."
        w[p + "attention_norm." + suf] = scale()
        w[p + "attention.wq.weight"] = mat(L, H * hd // L, D)
        w[p + "attention.wk.weight"] = mat(L, KV * hd // L, D)
        w[p + "attention.wv.weight"] = mat(L, KV * hd // L, D)
        w[p + "attention.wo.weight"] = mat(L, D, H * hd // L)
        w[p + "ffn_norm." + suf] = scale()
        w[p + "feed_forward.w1.weight"] = mat(L, F // L, D)
        w[p + "feed_forward.w3.weight"] = mat(L, F // L, D)
        w[p + "feed_forward.w2.weight"] = mat(L, D, F // L)
    w["model.norm." + suf] = scale()
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = 3 * mat(V, D)
    return {k: v.astype(np.float32).astype(np.float64) for k, v in w.items()}


class NumpyLaneformer:
    def __init__(self, cfg: dict, w: dict[str, np.ndarray]):
        self.cfg, self.w = cfg, w
        self.D, self.N, self.L = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_lanes"]
        self.H = cfg["num_attention_heads"]
        self.KV = cfg["num_key_value_heads"] or self.H
        self.hd = self.D // self.H
        self.t = 0
        # cache[layer][lane] = list over positions of (k heads [KV/L, hd], v heads)
        self.cache = [[[] for _ in range(self.L)] for _ in range(self.N)]

    def scale(self, name, lane):
        c = self.cfg
        if c["replicated_rmsn_scale"]:
            return self.w[name + ".weight"]
        return self.w[name + ".scale"][lane]

    def rms(self, x, g):
        return x / math.sqrt(float(np.mean(x * x)) + self.cfg["norm_eps"]) * g

    def rope(self, x, t):
        out = x.copy()
        hd = x.shape[0]
        for k in range(hd // 2):
            ang = t * self.cfg["rope_theta"] ** (-2 * k / hd)
            c, s = math.cos(ang), math.sin(ang)
            a, b = x[2 * k], x[2 * k + 1]
            out[2 * k], out[2 * k + 1] = a * c - b * s, a * s + b * c
        return out

    def sliding(self, i):
        c = self.cfg
        if c["sliding_window"] is None:
            return False
        S = c["sliding_window_n_layers"]
        return i < S if S >= 0 else i >= self.N + S

    def combine(self, h, parts, hist, i):
        c, L = self.cfg, self.L
        d = c["broadcast_delay"]
        new = []
        for l in range(L):
            if not c["use_comm"]:
                add = math.sqrt(L) * parts[l]
            elif i < d:
                add = sum(parts) if c["use_early_comm"] else math.sqrt(L) * parts[l]
            else:
                src = i - d
                if src < d and not c["early_layers_to_future"]:
                    others = 0
                else:
                    P = hist[src]
                    others = sum(P[j] for j in range(L) if j != l)
                add = parts[l] + others
            new.append(h[l] + add)
        return new

    def step(self, token: int) -> np.ndarray:
        t = self.t
        c, L, hd, w = self.cfg, self.L, self.hd, self.w
        Hl, KVl = self.H // L, self.KV // L
        group = self.H // self.KV
        h = [w["model.tok_embeddings.weight"][token].copy() for _ in range(L)]
        attn_hist, mlp_hist = {}, {}
        for i in range(self.N):
            p = f"model.layers.{i}."
            parts = []
            for l in range(L):
                n = self.rms(h[l], self.scale(p + "attention_norm", l))
                q = w[p + "attention.wq.weight"][l] @ n
                k = w[p + "attention.wk.weight"][l] @ n
                v = w[p + "attention.wv.weight"][l] @ n
                qh = [self.rope(q[a * hd:(a + 1) * hd], t) for a in range(Hl)]
                kh = [self.rope(k[a * hd:(a + 1) * hd], t) for a in range(KVl)]
                vh = [v[a * hd:(a + 1) * hd] for a in range(KVl)]
                self.cache[i][l].append((kh, vh))
                outs = []
                for a in range(Hl):
                    g_head = l * Hl + a                       # global query head
                    kv_local = g_head // group - l * KVl      # its KV head, inside this lane
                    lo = t - c["sliding_window"] + 1 if self.sliding(i) else 0
                    js = [j for j in range(max(0, lo), t + 1)]
                    sc = np.array([qh[a] @ self.cache[i][l][j][0][kv_local] / math.sqrt(hd) for j in js])
                    e = np.exp(sc - sc.max())
                    pr = e / e.sum()
                    outs.append(sum(pr[x] * self.cache[i][l][j][1][kv_local] for x, j in enumerate(js)))
                parts.append(w[p + "attention.wo.weight"][l] @ np.concatenate(outs))
            h = self.combine(h, parts, attn_hist, i)
            attn_hist[i] = parts
            parts = []
            for l in range(L):
                n = self.rms(h[l], self.scale(p + "ffn_norm", l))
                g = w[p + "feed_forward.w1.weight"][l] @ n
                u = w[p + "feed_forward.w3.weight"][l] @ n
                parts.append(w[p + "feed_forward.w2.weight"][l] @ (g / (1 + np.exp(-g)) * u))
            h = self.combine(h, parts, mlp_hist, i)
            mlp_hist[i] = parts
        y = sum(self.rms(h[l], self.scale("model.norm", l)) for l in range(L)) / L
        head = w["model.tok_embeddings.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
        self.t += 1
        return head @ y


def cfg_of(name):
    cfg = dict(BASE)
    cfg.update(VARIANTS[name])
    return cfg


def reference_run(cfg, w, prompt, n_gen):
    """Teacher-forced prompt logits, then greedy: (logits per position, generated ids)."""
    ref = NumpyLaneformer(cfg, w)
    logits = [ref.step(t) for t in prompt]
    gen = []
    for _ in range(n_gen):
        nxt = int(np.argmax(logits[-1]))
        gen.append(nxt)
        logits.append(ref.step(nxt))
    gen.append(int(np.argmax(logits[-1])))
    return np.array(logits), gen


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


PROMPT = [5, 17, 3, 99, 42, 8]
N_DECODE = 8   # positions up to 13: past every sliding window used here


# ---------------------------------------------------------------------------------------------------------
# tests


@needs_torch
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matches_numpy_reference(variant, dtype):
    import torch

    cfg = cfg_of(variant)
    w = make_weights(cfg, seed=zlib.crc32(variant.encode()) % 1000)
    ref_logits, ref_gen = reference_run(cfg, w, PROMPT, N_DECODE)
    tol = 1e-5 if dtype == "float32" else 1e-10

    model = tb.LaneformerTorch(cfg, w, device="cpu", dtype=dtype, max_seq=32)
    # prefill, all positions
    pre = model.prefill(PROMPT, all_logits=True).numpy()
    assert pre.shape == (len(PROMPT), cfg["vocab_size"])
    assert rel_err(pre, ref_logits[:len(PROMPT)]) < tol
    # decode steps, teacher-forced with the reference's greedy ids
    pos = len(PROMPT)
    for s in range(N_DECODE):
        out = model.decode_step(ref_gen[s], pos + s).numpy()
        assert rel_err(out, ref_logits[pos + s]) < tol, f"decode step {s}"
    # decode step with device tensors (the graph-capturable form)
    model.prefill(PROMPT)
    out = model.decode_step(torch.tensor([ref_gen[0]]), torch.tensor([pos])).numpy()
    assert rel_err(out, ref_logits[pos]) < tol
    # greedy ids through the device-side runner
    ids = model.greedy_generate(PROMPT, N_DECODE + 1)
    assert ids == ref_gen


@needs_torch
def test_prefill_in_pieces_equals_one_shot():
    cfg = cfg_of("base")
    w = make_weights(cfg, seed=3)
    model = tb.LaneformerTorch(cfg, w, device="cpu", dtype="float64", max_seq=32)
    whole = model.prefill(PROMPT, all_logits=True).numpy()
    model.prefill(PROMPT[:2])
    rest = model.prefill(PROMPT[2:], start_pos=2, all_logits=True).numpy()
    assert rel_err(rest, whole[2:]) < 1e-12


@needs_torch
def test_bf16_close_to_fp32_and_dataclass_config():
    """A config object with the spec's field names works; bf16 storage stays near float32."""
    import torch

    class Cfg:
        pass

    c = Cfg()
    for k, v in cfg_of("base").items():
        setattr(c, k, v)
    w = make_weights(cfg_of("base"), seed=5)
    ref = tb.reference_logits_fp32(c, w, PROMPT, device="cpu").numpy()
    wt = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in w.items()}
    model = tb.LaneformerTorch(c, wt, device="cpu", max_seq=16)
    assert model.dtype == torch.bfloat16 and model.core.k_cache.dtype == torch.bfloat16
    assert tuple(model.core.k_cache.shape) == (3, 4, 1, 16, 8)
    out = model.prefill(PROMPT, all_logits=True)
    assert out.dtype == torch.float32
    assert rel_err(out.numpy(), ref) < 0.05


@needs_torch
def test_random_weights_shapes_and_finite_2b_like_depth():
    import torch

    cfg = dict(cfg_of("base"), num_hidden_layers=15, hidden_size=96, num_attention_heads=8,
               num_key_value_heads=4, intermediate_size=384, num_lanes=4, broadcast_delay=2)
    w = tb.random_weights(cfg, device="cpu", dtype="float32", seed=1)
    assert {k: tuple(v.shape) for k, v in w.items()} == tb.weight_shapes(cfg)
    model = tb.LaneformerTorch(cfg, w, device="cpu", max_seq=32)
    out = model.prefill(list(range(10)), all_logits=True)
    assert torch.isfinite(out).all() and out.abs().max() > 0
    # weights=None builds random ones itself
    m2 = tb.LaneformerTorch(cfg, None, device="cpu", dtype="float32", max_seq=16, seed=1)
    assert torch.equal(m2.prefill([1, 2, 3]), tb.LaneformerTorch(cfg, w, device="cpu", max_seq=16).prefill([1, 2, 3]))


@needs_torch
def test_bad_configs_and_weights_are_refused():
    with pytest.raises(ValueError, match="lm_head_type"):
        tb.ModelShape(dict(cfg_of("base"), lm_head_type="split"))
    with pytest.raises(ValueError, match="num_lanes"):
        tb.ModelShape(dict(cfg_of("base"), num_lanes=3))
    w = make_weights(cfg_of("base"), seed=1)
    w["model.layers.1.attention.wq.weight"] = w["model.layers.1.attention.wq.weight"][:, :-1]
    with pytest.raises(ValueError, match="wq"):
        tb.LaneformerTorch(cfg_of("base"), w, device="cpu")
    del w["model.norm.weight"]
    with pytest.raises(KeyError, match="model.norm.weight"):
        tb.LaneformerTorch(cfg_of("base"), w, device="cpu")


@needs_torch
def test_run_baselines_on_cpu_reports_errors_per_mode():
    cfg = cfg_of("base")
    w = make_weights(cfg, seed=2)
    out = tb.run_baselines(cfg, {k: v.astype(np.float32) for k, v in w.items()}, prompt_len=5,
                           gen_len=6, modes=("eager", "cuda_graph", "bogus"), device="cpu",
                           repeats=2, prompt_ids=PROMPT[:5], log=lambda m: None)
    assert [r["mode"] for r in out] == ["eager", "cuda_graph", "bogus"]
    e = out[0]
    assert "error" not in e, e
    assert e["tokens_per_s"] > 0 and e["ms_per_token"] > 0 and len(e["runs_tokens_per_s"]) == 2
    _, ref_gen = reference_run(cfg, w, PROMPT[:5], 6)
    assert e["ids_head"] == ref_gen[:7]
    assert "CUDA" in out[1]["error"]
    assert "bogus" in out[2]["error"]


@needs_torch
def test_measure_copy_bandwidth_cpu():
    bw = tb.measure_copy_bandwidth(nbytes=1 << 20, device="cpu", repeats=3)
    assert bw > 1e6


@needs_torch
@pytest.mark.skipif(os.environ.get("KOG_SKIP_COMPILE") == "1", reason="KOG_SKIP_COMPILE=1")
def test_compiled_step_matches_eager_on_cpu():
    """The decode step traces as one graph (fullgraph=True) and gives the eager step's logits."""
    import torch

    cfg = cfg_of("base")
    w = make_weights(cfg, seed=7)
    model = tb.LaneformerTorch(cfg, w, device="cpu", dtype="float32", max_seq=16)
    try:
        compiled = torch.compile(model.core, fullgraph=True, dynamic=False)
        last = model.prefill(PROMPT)
        r = tb._GreedyRunner(model, compiled)
        r.reset(last, len(PROMPT))
        for _ in range(4):
            r.step()
    except Exception as e:  # no working C++ toolchain for inductor on this machine
        if "fullgraph" in str(e) or "Unsupported" in type(e).__name__:
            raise
        pytest.skip(f"torch.compile unusable here: {type(e).__name__}: {str(e)[:200]}")
    got = r.generated(len(PROMPT), 5)
    assert got == model.greedy_generate(PROMPT, 5)
    _, ref_gen = reference_run(cfg, w, PROMPT, 4)
    assert got == ref_gen


def test_imports_and_fails_clearly_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from workers.cuda import torch_baseline as tb\n"
        "assert not tb.torch_available()\n"
        "r = tb.run_baselines(tb.SHAPE_2B, modes=('eager', 'compile'))\n"
        "assert [x['mode'] for x in r] == ['eager', 'compile'] and all('PyTorch' in x['error'] for x in r), r\n"
        "try:\n"
        "    tb.LaneformerTorch(tb.SHAPE_2B)\n"
        "except tb.TorchUnavailableError as e:\n"
        "    assert 'PyTorch' in str(e); print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_shapes_of_the_2b_checkpoint():
    """The published parameter count follows from SHAPE_2B (no torch needed)."""
    shapes = tb.weight_shapes(tb.SHAPE_2B)
    assert sum(math.prod(s) for s in shapes.values()) == 2_320_069_632
    c = tb.ModelShape(tb.SHAPE_2B)
    assert (c.hd, c.Hl, c.KVl, c.Fl, c.G) == (96, 4, 2, 1536, 2)
    assert [c.is_sliding(i) for i in range(15)] == [True] * 10 + [False] * 5
