"""Structured outputs on the cuda backend (issue 55): the grammar's token mask applied inside the monokernel
(CFG_MASK, mk_mask.cuh), the host writing token n + 1's mask while the kernel runs its forward (workers/cuda/mask.py).
Against the cpu backend under the same grammar on the same model: the same greedy ids, an answer that parses and
validates, `length` when max_new_tokens cuts it; sampled answers validate; a cancel while the sampler waits for a
mask ends the kernel, as does a mask that never comes (mask_wait_s). On a tiny random one-lane model with a
tokenizer of its own (tests/grammar_helpers.py), and on the default model when its file is on the machine
(KOG_SMOL_GGUF, the kog_dist cache or /tmp/smol: tests/gpu_real_model.sh). Runs on the GPU machine:
`pytest -m gpu tests/test_cuda_grammar.py`; skips cleanly without CuPy or a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

try:
    import cupy as cp
    HAVE_GPU = cp.cuda.runtime.getDeviceCount() > 0
except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
    cp, HAVE_GPU = None, False

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")]

jsonschema = pytest.importorskip("jsonschema")

from grammar_helpers import SCHEMA, write_tiny_model  # noqa: E402
from kog_dist.backend import RunCommand  # noqa: E402
from kog_dist.sampling import SamplingParams  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "country": {"type": "string", "enum": ["France", "Germany", "Italy", "Spain"]},
    "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
    "capital": {"type": "boolean"}},
    "required": ["city", "country", "population_millions", "capital"], "additionalProperties": False}


from test_cuda_llama import _smol_path  # noqa: E402  (the default model where the GPU tests find it)


class Model:
    """One model with its tokenizer, a grammar, a cpu backend and cuda backends by storage."""

    def __init__(self, path, schema):
        from kog_dist.formats import open_model
        from kog_dist.grammar import compile_format
        from kog_dist.tokenizer import load_tokenizer
        from workers.factory import make_backend
        self.path, self.schema = path, schema
        self.src = open_model(path, progress=False)
        self.tok = load_tokenizer(self.src)
        self.g = compile_format({"type": "json_schema", "schema": schema}, self.tok)
        self.cpu, _ = make_backend("cpu", self.src, max_seq=512, num_slots=1)
        self.cfg_vocab = self.src.cfg.vocab_size
        self.cuda = {}

    def backend(self, dtype):
        from workers.cuda.backend import CudaBackend
        if dtype not in self.cuda:
            self.cuda[dtype] = CudaBackend(self.src, max_seq=512, num_slots=1, progress=False, dtype=dtype)
        return self.cuda[dtype]

    def run(self, b, ids, n, sp=SamplingParams(), on_token=None):
        cmd = RunCommand(append=list(ids), max_new_tokens=n, sampling=sp, grammar=self.g.matcher(),
                         stop_ids=tuple(self.tok.eos_ids))
        return b.run(cmd, on_token)

    def valid(self, r):
        text = self.tok.decode(r.token_ids)
        jsonschema.validate(json.loads(text), self.schema)
        return text

    def close(self):
        for b in self.cuda.values():
            b.close()
        self.src.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    m = Model(write_tiny_model(str(tmp_path_factory.mktemp("tiny"))), SCHEMA)
    m.ids = m.tok.encode("Give a person as JSON: ")
    yield m
    m.close()


@pytest.fixture(scope="module")
def smol():
    path = _smol_path()
    if path is None:
        pytest.skip("the SmolLM2 GGUF is not on this machine (tests/gpu_real_model.sh)")
    m = Model(path, CITY)
    m.ids = m.tok.encode_chat([{"role": "user", "content": "Describe Paris: its city name, country, population in "
                                                           "millions and whether it is a capital."}])
    yield m
    m.close()


def _same(name, m, b, got, ref):
    """got == ref, or a failure that says where and by what margin between the two best allowed logits (the
    kernel's, replayed with dbg_logits and the grammar's mask there), as the other cuda-vs-numpy tests do."""
    if got == ref:
        return
    i = next((k for k, (a, c) in enumerate(zip(got, ref)) if a != c), min(len(got), len(ref)))
    margin = float("nan")
    if i < min(len(got), len(ref)):
        dbg = cp.zeros((len(got), m.cfg_vocab), cp.float32)
        b.run(RunCommand(append=list(m.ids), max_new_tokens=len(got), grammar=m.g.matcher(),
                         stop_ids=tuple(m.tok.eos_ids)), dbg_logits=dbg)
        g = m.g.matcher()
        for t in got[:i]:
            g.accept(t)
        lg = g.mask(dbg[i].get())
        top = np.sort(lg[np.isfinite(lg)])[-2:]
        margin = float(top[-1] - top[0]) if top.size == 2 else float("inf")
    pytest.fail(f"{name}: first difference at token {i} of {len(got)} / {len(ref)}: {got[i:i + 4]} vs "
                f"{ref[i:i + 4]} (the kernel's margin between the two best allowed logits there: {margin:.2e})")


def test_tiny_greedy_is_the_cpu_backends_and_validates(tiny):
    """fp32 storage (the numpy engine's arithmetic up to summation order): the ids under the mask are the cpu
    backend's; the answer parses and validates and ends at the grammar's end of turn. The free decode from the
    same prompt differs (the mask is what makes it pass)."""
    b = tiny.backend("F32")
    ref = tiny.run(tiny.cpu, tiny.ids, 120)
    got = tiny.run(b, tiny.ids, 120)
    _same("tiny F32", tiny, b, got.token_ids, ref.token_ids)
    assert got.stop_reason == ref.stop_reason == "eos", (got.stop_reason, tiny.tok.decode(got.token_ids))
    tiny.valid(got)
    assert got.grammar_ms > 0 and got.spec_steps == 0
    free = b.run(RunCommand(append=list(tiny.ids), max_new_tokens=len(got.token_ids)))
    assert free.token_ids != got.token_ids
    print(f"tiny: {len(got.token_ids)} tokens, mask waits {got.mask_waits} ({got.mask_wait_ms:.3f} ms), "
          f"host mask {got.grammar_ms * 1e3 / len(got.token_ids):.1f} us a token")


def test_tiny_cut_by_max_tokens_is_length(tiny):
    b = tiny.backend("F32")
    ref = tiny.run(tiny.cpu, tiny.ids, 5)
    got = tiny.run(b, tiny.ids, 5)
    assert got.stop_reason == ref.stop_reason == "length" and got.token_ids == ref.token_ids
    with pytest.raises(ValueError):
        json.loads(tiny.tok.decode(got.token_ids))


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_tiny_sampled_answers_validate(tiny, dtype):
    """temperature 1 (top-p 0.95 too): the forbidden logits are -inf before the device's sampler; every answer
    validates. The ids are compared with the cpu backend's only in the log (a draw can fall either side of a
    rounding)."""
    b = tiny.backend(dtype)
    for seed, top_p in ((1, 1.0), (2, 0.95), (3, 1.0)):
        sp = SamplingParams(1.0, 0, top_p, seed)
        got = tiny.run(b, tiny.ids, 120, sp)
        assert got.stop_reason == "eos", tiny.tok.decode(got.token_ids)
        tiny.valid(got)
        ref = tiny.run(tiny.cpu, tiny.ids, 120, sp)
        print(f"{dtype} seed {seed}: {len(got.token_ids)} tokens, the cpu backend's ids: {got.token_ids == ref.token_ids}")


def _hold(b, at):
    """b's DeviceMask publishes no mask after token `at` (it still takes the token): the sampler of the next one waits."""
    dm = b.dmask
    real = type(dm).advance

    def advance(tok, more):
        real(dm, tok, more and dm.ready.a[0] < at + 1)
    dm.advance = advance
    return lambda: dm.__dict__.pop("advance", None)


def test_cancel_while_the_sampler_waits_for_a_mask(tiny):
    """The host holds token 4's mask, then cancels (on_token False) 0.3 s later: the kernel, waiting for that mask,
    reads the cancel word and ends; the result is a cancel after 4 tokens, the wait counted; the next request runs."""
    b = tiny.backend("F32")
    tiny.run(b, tiny.ids, 8)               # the build and the mapped words exist
    undo = _hold(b, 3)
    seen = []

    def on_token(t):
        seen.append(t)
        if len(seen) == 4:
            time.sleep(0.3)
            return False
        return True
    try:
        t0 = time.perf_counter()
        r = tiny.run(b, tiny.ids, 60, on_token=on_token)
        dt = time.perf_counter() - t0
    finally:
        undo()
    assert r.stop_reason == "cancel" and len(r.token_ids) == 4 and dt < 5, (r.stop_reason, r.token_ids, dt)
    assert r.mask_waits >= 1 and r.mask_wait_ms >= 200, (r.mask_waits, r.mask_wait_ms)
    again = tiny.run(b, tiny.ids, 120)
    assert again.stop_reason == "eos"
    tiny.valid(again)


def test_a_mask_that_never_comes_ends_the_kernel(tiny):
    """No mask after token 2 and no cancel: the sampler gives up after mask_wait_s, writes no token, and the run
    raises one line; the backend serves the next request."""
    b = tiny.backend("F32")
    tiny.run(b, tiny.ids, 8)
    undo = _hold(b, 2)
    b.mask_wait_s = 0.2
    try:
        with pytest.raises(RuntimeError, match="no token mask for token 3 within 0.2 s"):
            tiny.run(b, tiny.ids, 60)
    finally:
        undo()
        del b.mask_wait_s
    assert int(b.dmask.stat.get()[3]) == 1           # one timeout counted
    again = tiny.run(b, tiny.ids, 120)
    assert again.stop_reason == "eos"
    tiny.valid(again)


def test_kog_generate_json_schema_on_the_cuda_backend(tiny, tmp_path):
    """`kog generate --json-schema FILE --backend cuda`: the text validates, the stop is the grammar's end."""
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SCHEMA))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "kog_cli", "generate", "--model", tiny.path, "--backend", "cuda",
                        "--raw", "--prompt", "Give a person as JSON: ", "-n", "120", "--json-schema", str(f), "--json"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert out["backend"] == "cuda" and out["stats"]["stop_reason"] in ("eos", "stop") and out["stats"]["grammar_ms"] > 0


def test_kog_serve_response_format_on_the_cuda_backend(tiny):
    """`kog serve --backend cuda`: /v1/completions with response_format json_schema answers text that validates,
    finish_reason stop, and the stats name the mask's waits."""
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    import urllib.request
    from serve_helpers import Serve
    with Serve("--model", tiny.path, "--backend", "cuda", "--max-seq", "512", timeout=240) as s:
        with urllib.request.urlopen(s.url + "/v1/models", timeout=30) as resp:   # the served id (folder name)
            served = json.loads(resp.read())["data"][0]["id"]
        body = {"model": served, "prompt": "Give a person as JSON: ", "max_tokens": 120, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
        req = urllib.request.Request(s.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            out = json.loads(resp.read())
    ch = out["choices"][0]
    jsonschema.validate(json.loads(ch["text"]), SCHEMA)
    assert ch["finish_reason"] == "stop", ch
    st = out.get("kog_stats", {})
    assert "mask_waits" in st and st["grammar_us_per_token"] > 0, st


def test_default_model_greedy_is_the_cpu_backends_and_validates(smol):
    """SmolLM2-135M-Instruct: with its layer matrices in Q4_1 and the rest fp32 the ids under the mask are the cpu
    backend's (which computes on the same dequantized weights); in its default storage (Q4_1, bf16 embedding / LM
    head) the answer validates too; a cut by max_tokens is length."""
    ref = smol.run(smol.cpu, smol.ids, 120)
    assert ref.stop_reason in ("eos", "stop")
    got = smol.run(smol.backend("Q4_1:F32"), smol.ids, 120)
    _same("SmolLM2 Q4_1:F32", smol, smol.backend("Q4_1:F32"), got.token_ids, ref.token_ids)
    assert got.stop_reason == ref.stop_reason
    text = smol.valid(got)
    d = smol.run(smol.backend(None), smol.ids, 120)
    assert d.stop_reason in ("eos", "stop")
    smol.valid(d)
    n = len(d.token_ids)
    print(f"SmolLM2: {text}; default storage {n} tokens, {d.decode_tokens_per_s:.0f} tokens/s, mask waits "
          f"{d.mask_waits} ({d.mask_wait_ms:.3f} ms), host {d.grammar_ms * 1e3 / n:.1f} us a token")
    cut = smol.run(smol.backend(None), smol.ids, 5)
    assert cut.stop_reason == "length" and cut.token_ids == d.token_ids[:5]


def test_default_model_sampled_answers_validate(smol):
    b = smol.backend(None)
    for seed in (1, 2, 3):
        r = smol.run(b, smol.ids, 120, SamplingParams(1.0, 0, 1.0, seed))
        assert r.stop_reason in ("eos", "stop"), smol.tok.decode(r.token_ids)
        smol.valid(r)


def test_mask_stats_are_counted(tiny):
    """The sampler's wait counters come back: a request's waits are at most its tokens, and never negative."""
    r = tiny.run(tiny.backend("F32"), tiny.ids, 120)
    st = tiny.backend("F32").dmask.last_stat
    assert 0 <= st[0] <= len(r.token_ids) and st[3] == 0 and st[2] <= st[1] + 1
    assert np.isfinite(r.mask_wait_ms)
