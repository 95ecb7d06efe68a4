"""CI without a GPU: the cuda backend's token mask (structured outputs, issue 55; workers/cuda/mask.py and the
monokernel's CFG_MASK build, mk_mask.cuh). The build compiles warning-free, its Params words are the ones the host
packs, the default build is the one without the mask's code, the mask's bits are the grammar's tokens in the order
the kernel reads them, and the host's pipeline (token n in, token n + 1's mask out) gives the cpu backend's draws.
The GPU behaviour is in tests/test_cuda_grammar.py (marker gpu)."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from grammar_helpers import SCHEMA, write_tiny_model

CUDA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workers", "cuda")
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")


def _tiny_cfg():
    from kog_dist.config import LaneformerConfig
    from kog_dist.tiny import TINY_DEFAULTS
    from grammar_helpers import ONE_LANE
    return LaneformerConfig.from_dict(dict(TINY_DEFAULTS, **ONE_LANE, model_type="laneformer_tp"))


def _shape(name):
    from kog_dist.shapes import shape_config
    return _tiny_cfg() if name == "tiny" else shape_config(name)


def _nvcc(args, tmp_path, timeout=600):
    return subprocess.run([NVCC, "-arch=sm_90", "-std=c++17"] + args, capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path)


@needs_nvcc
@pytest.mark.parametrize("shape,dtype", [("tiny", "F32"), ("smollm2-135m", "Q4_1"), ("smollm2-135m", "BF16"),
                                         ("llama3.2-1b", "Q4_K_M"), ("2b", "BF16")])
def test_mask_build_compiles(shape, dtype, tmp_path):
    """The token mask's build (CFG_MASK 1) of the GPU test's tiny model, the default model's storages, a K-quant
    mix and a model of several lanes, with build.defines' options: warning-free."""
    from workers.cuda.build import defines
    d = defines(_shape(shape), dtype, 132, extra={"CFG_MASK": 1})
    r = _nvcc(["-cubin", os.path.join(CUDA_DIR, "monokernel.cu"), "-o", str(tmp_path / "m.cubin")]
              + [f"-D{k}={v}" for k, v in d.items()], tmp_path)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr[-4000:]


def _ranks_shape(name, n):
    """The config one rank of n builds from: a one-lane model seen as n lanes (kog_dist/tp_lanes.py)."""
    from kog_dist.tp_lanes import lanes_config
    cfg = _shape(name)
    return lanes_config(cfg, n) if cfg.num_lanes == 1 else cfg


@needs_nvcc
@pytest.mark.parametrize("shape,dtype,n", [("smollm2-135m", "Q4_1", 3), ("llama3.1-8b", "Q4_K+Q6_K", 4)])
def test_mask_build_of_several_ranks_compiles(shape, dtype, n, tmp_path):
    """Each rank masks its rows of the LM head before the ranks' exchange (mk_lm.cuh, sample_full_mr): the
    tensor-parallel builds of one-lane models (the default model over 3 ranks; an 8B K-quant mix over 4; the 2B
    model of lanes over 2 and llama3.2-1b Q4_K_M over 2 compiled warning-free too, 2026-12-08)."""
    from workers.cuda.build import defines
    d = defines(_ranks_shape(shape, n), dtype, 132 // n, nranks=n, extra={"CFG_MASK": 1})
    r = _nvcc(["-cubin", os.path.join(CUDA_DIR, "monokernel.cu"), "-o", str(tmp_path / "m.cubin")]
              + [f"-D{k}={v}" for k, v in d.items()], tmp_path)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr[-4000:]


@needs_nvcc
def test_mask_build_refuses_verify_passes_and_ranks_without_candidates(tmp_path):
    """Constrained requests decode a token at a time (no verify pass); on several ranks a rank's missing mask is
    posted with its candidates, so a build without them (CFG_SAMPLE_M 0) is refused: the kernel says so."""
    from workers.cuda.build import defines
    for d, words in ((defines(_shape("smollm2-135m"), "BF16", 132, extra={"CFG_MASK": 1, "CFG_SPEC": 9}),
                      "a token at a time"),
                     (defines(_ranks_shape("smollm2-135m", 3), "BF16", 44, nranks=3,
                              extra={"CFG_MASK": 1, "CFG_SAMPLE_M": 0}), "CFG_SAMPLE_M > 0")):
        r = _nvcc(["-cubin", os.path.join(CUDA_DIR, "monokernel.cu"), "-o", str(tmp_path / "m.cubin")]
                  + [f"-D{k}={v}" for k, v in d.items()], tmp_path)
        assert r.returncode != 0 and words in r.stderr, r.stderr[-2000:]


@needs_nvcc
@pytest.mark.parametrize("n", [1, 3])
def test_mask_params_words_are_the_hosts(n, tmp_path):
    """The CFG_MASK build's Params fields sit where the host packs them: params.MASK_LAYOUT with one rank (the
    multi-rank fields' words), MR_MASK_LAYOUT with several (after those fields); the struct fits the host's
    N_PARAMS words, and the kernel's mask size and wait counters are mask.py's."""
    from workers.cuda import mask
    from workers.cuda.build import defines
    from workers.cuda.host import N_PARAMS
    from workers.cuda.params import LAYOUT, MASK_LAYOUT, MR_MASK_LAYOUT
    names = ("mask", "mask_ready", "mask_stat", "mask_wait_ns")
    prog = tmp_path / "layout.cu"
    prog.write_text(f'#include "{os.path.join(CUDA_DIR, "monokernel.cu")}"\n#include <cstdio>\n#include <cstddef>\n'
                    "int main() { printf(\"%d %d %d %d %d %d %d %d\\n\", "
                    + ", ".join(f"(int)(offsetof(Params, {n}) / 8)" for n in names)
                    + ", (int)(sizeof(Params) / 8), MASK_WORDS, (int)MS_TIMEOUTS, (int)offsetof(Params, kt) / 8); }\n")
    cfg = _ranks_shape("smollm2-135m", n)
    r = _nvcc([str(prog), "-o", str(tmp_path / "layout")]
              + [f"-D{k}={v}" for k, v in defines(cfg, "Q4_1", 132 // n, nranks=n, extra={"CFG_MASK": 1}).items()],
              tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [int(x) for x in subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True,
                                          check=True).stdout.split()]
    layout = MASK_LAYOUT if n == 1 else MR_MASK_LAYOUT
    first = 68 if n == 1 else 73      # after kt (67), or after kd, e0[3], yfin (68 .. 72)
    assert got[:4] == [layout[x][0] for x in names] == list(range(first, first + 4))
    assert got[4] == first + 4 <= N_PARAMS
    assert got[5] == mask.mask_words(cfg.vocab_size) == 1536 and got[6] == mask.STAT_TIMEOUTS
    assert got[7] == LAYOUT["kt"][0] == layout["kt"][0]
    assert not set(names) & set(LAYOUT) and {"kd", "e0", "yfin"}.isdisjoint(MASK_LAYOUT)
    assert [MR_MASK_LAYOUT[x] for x in ("kd", "e0", "yfin")] == [LAYOUT[x] for x in ("kd", "e0", "yfin")]


def _strip_mask(src: str) -> str:
    """The source with every `#if CFG_MASK` block taken out (its #else part kept): the default build's text."""
    out, stack = [], []          # per open #if: (a CFG_MASK block?, in its #else part?)
    for line in src.split("\n"):
        t = line.strip()
        if t.startswith("#if"):
            stack.append([t == "#if CFG_MASK", False])
            if stack[-1][0]:
                continue
        elif t.startswith("#else") and stack and stack[-1][0]:
            stack[-1][1] = True
            continue
        elif t.startswith("#endif") and stack:
            if stack.pop()[0]:
                continue
        if all(not m or e for m, e in stack):
            out.append(line)
    return "\n".join(out)


def _ptx(src: str, d: dict, tmp_path) -> str:
    f = tmp_path / "m.cu"
    f.write_text(src)
    r = _nvcc(["-ptx", str(f), "-o", str(tmp_path / "m.ptx")] + [f"-D{k}={v}" for k, v in d.items()], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    ptx = re.sub(r"_GLOBAL__N__[0-9A-Za-z_]+|tmpxft_[0-9A-Za-z_]+|__nv_static_[0-9A-Za-z_]+|_INTERNAL_[0-9a-f]+_",
                 "SYM", (tmp_path / "m.ptx").read_text())   # bench/ptx_identity.py's normalisation
    return hashlib.sha256(ptx.encode()).hexdigest()


@needs_nvcc
def test_default_build_is_the_one_without_the_mask(tmp_path):
    """The default build (CFG_MASK 0) of the default model's shape compiles to the PTX of the source with the
    mask's blocks removed: the mask adds no instruction to the measured kernel (bench/ptx_identity.py gave the
    same 13 fingerprints before and after the mask's commit)."""
    from workers.cuda.build import defines, source
    src = source()
    bare = _strip_mask(src)
    assert "mask_fetch" in src and "mask_fetch" not in bare and "CFG_MASK" in bare   # the #define stays
    d = defines(_shape("smollm2-135m"), "Q4_1", 132)
    assert _ptx(src, d, tmp_path) == _ptx(bare, d, tmp_path)


class _HostWords:
    """host._Mapped's interface over plain numpy memory."""

    def __init__(self, n, dtype=np.int32):
        self.a = np.zeros(n, dtype)
        self.ptr = self.a.ctypes.data

    def free(self):
        pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kog_dist.formats import open_model
    from kog_dist.grammar import compile_format
    from kog_dist.tokenizer import load_tokenizer
    d = write_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    src = open_model(d, progress=False)
    tok = load_tokenizer(src)
    src.close()
    return d, tok, compile_format({"type": "json_schema", "schema": SCHEMA}, tok)


def test_mask_words_are_the_grammars_tokens_in_the_kernels_bit_order(tiny):
    """DeviceMask's words, read as the kernel reads them (bit v & 31 of word v >> 5, mask.kernel_allows), allow
    exactly the tokens llguidance's per-token logit bias allows, for the first token and after each token of a
    valid answer; ids past the grammar's vocabulary (a model's padding rows) stay forbidden."""
    from workers.cuda.mask import DeviceMask, kernel_allows, mask_words
    _, tok, g = tiny
    V = 600                                   # the tokenizer's model has 512 rows: 88 of padding here
    dm = DeviceMask(V, alloc=_HostWords)
    assert dm.words.a.size == mask_words(V) == 20
    dm.words.a[:] = 0xffffffff                # whatever the last request left
    m = g.matcher()
    dm.start(m)
    assert dm.ready.a[0] == 1 and m.tokens == 1

    def check():
        ref = np.frombuffer(m.m.deep_copy().compute_logit_bias(), np.uint8) > 0
        got = kernel_allows(dm.words.a, V)
        assert ref.size == 512 and not got[512:].any()
        np.testing.assert_array_equal(got[:512], ref)
        v = np.arange(V)          # the same bits the long way round
        assert [int(i) for i in v[got]] == [i for i in range(V) if int(dm.words.a[i // 32]) & (1 << (i % 32))]
    check()
    ids = tok.encode('{"name":"bob","age":3,"ok":true}', add_bos=False) + list(g.lltok.eos_tokens[:1])
    for k, t in enumerate(ids):
        assert kernel_allows(dm.words.a, V)[t], (k, t)
        last = k == len(ids) - 1
        dm.advance(t, not last)
        assert dm.ready.a[0] == (k + 2 if not last else k + 1)
        if not last:
            check()
    assert m.done
    with pytest.raises(ValueError, match="refused token"):
        dm.advance(5, True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_pipeline_gives_the_cpu_backends_draws(tiny, temperature):
    """The host's pipeline against the cpu backend's draw (cpu_backend._draw_masked) on the same logits: a stand-in
    for the kernel reads token n's mask from the words once the count says n + 1, samples as kog_dist.sampling
    does with the forbidden ids at -inf (mk_mask.cuh), and the host advances; the ids are the cpu backend's and
    the answer parses and validates."""
    import json
    import jsonschema
    from kog_dist.sampling import SamplingParams, sample
    from workers.cpu_backend import _draw_masked
    from workers.cuda.mask import DeviceMask, kernel_allows
    _, tok, g = tiny
    V = 512
    sp = SamplingParams(temperature, 0, 0.95, 11)
    rng = np.random.default_rng(5)
    logits = [(rng.standard_normal(V) * 3).astype(np.float32) for _ in range(200)]
    ref_m, ref = g.matcher(), []
    for n, lg in enumerate(logits):
        ref.append(_draw_masked(ref_m, lg, sp, 100 + n))
        if ref[-1] in g.lltok.eos_tokens:
            break
    dm = DeviceMask(V, alloc=_HostWords)
    dm.start(g.matcher())
    got = []
    for n, lg in enumerate(logits):
        assert dm.ready.a[0] == n + 1                      # token n's mask is there when the kernel needs it
        allowed = kernel_allows(dm.words.a, V)
        t = sample(np.where(allowed, lg, np.float32(-np.inf)), sp, 100 + n)
        got.append(t)
        end = t in g.lltok.eos_tokens
        dm.advance(t, not end)
        if end:
            break
    assert got == ref and got[-1] in g.lltok.eos_tokens
    jsonschema.validate(json.loads(tok.decode(got)), SCHEMA)
    assert dm.g.tokens == len(got) and dm.g.mask_s > 0 and dm.host_s >= dm.g.mask_s


def test_cuda_backend_speculation_and_stops_of_a_constrained_request():
    """The source says where the choice is made: a constrained request decodes a token at a time (spec_k 0) and
    the grammar's end of turn stops it; the refusal of the cpu-only build is gone."""
    src = open(os.path.join(CUDA_DIR, "backend.py")).read()
    assert "structured outputs run on the cpu backend" not in src
    assert "self.spec_max > 1 and cmd.grammar is None else 0" in src
    assert "cmd.grammar.grammar.lltok.eos_tokens" in src
    from kog_dist.backend import RunResult
    st = RunResult(mask_waits=3, mask_wait_ms=0.25).stats()
    assert st["mask_waits"] == 3 and st["mask_wait_ms"] == 0.25
