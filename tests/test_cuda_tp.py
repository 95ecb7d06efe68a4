"""Tensor parallelism of one-lane (Llama-family) models on the cuda backend: the model seen as N all-early
lanes (kog_dist/tp_lanes.py) and run by the multi-rank monokernel.

CPU: the numpy engine on the lane view gives the HF-style reference's greedy ids (HF llama with KV heads
split and replicated, Qwen2 biases, a bf16 tied head, Q8_0 / Q4_0 GGUF), each lane's slices are the
one-lane tensors' pieces, the multi-rank builds of the view compile (K-quant builds too), the backend choice
and refusals. GPU (marker gpu; ranks sharing one GPU need MPS): `kog generate --np N --backend cuda` gives the
reference's ids and one rank's, greedy and seeded sampling, the default model's answer, and K-quant files
(Q4_K, Q4_K + Q6_K) split as stored (their CPU side: tests/test_tp_kquant.py).
"""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kog_dist.checkpoint import Model
from kog_dist.engine import ReferenceEngine
from kog_dist.formats import open_model
from kog_dist.models import default_gguf_path
from kog_dist.tp_lanes import LaneSource, lanes_config
from workers.factory import choose

from hf_reference import HFLlama, random_hf_tensors, tiny_hf_config, write_gguf, write_hf_dir
from mpi_helpers import mpi_env

PROMPT = [1, 5, 9, 33, 17, 60]
SPM = {"tokenizer.ggml.model": "llama"}


def _hf(d, seed, **kw):
    from test_tp import write_tokenizer
    c = tiny_hf_config(**kw)
    t = random_hf_tensors(c, seed)
    write_hf_dir(d, c, t)
    write_tokenizer(d, c["vocab_size"])
    return c, t


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import gguf
    root = tmp_path_factory.mktemp("cuda_tp")
    out = {}
    c, t = _hf(str(root / "hf"), 3, num_attention_heads=8, num_key_value_heads=2, vocab_size=97,
               num_hidden_layers=3, hidden_size=256, intermediate_size=512)
    out["hf"] = (str(root / "hf"), c, t)
    cq, tq = _hf(str(root / "qwen2"), 4, model_type="qwen2", num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=97, hidden_size=256, intermediate_size=256)
    out["qwen2"] = (str(root / "qwen2"), cq, tq)
    # the cuda backend keeps a GGUF's embedding and LM head in bf16: each file's greedy run has a top-2 logit
    # margin of at least 0.2 (Q4_0 of seed 3 had a 0.013 tie at its fifth token, which one rank's bf16 head
    # flipped on an H100); seed 7's Q4_0 run has 0.20, seed 3's Q8_0 run 0.36
    t7 = random_hf_tensors(c, 7)
    for name, q, tq in (("q8_0", gguf.GGMLQuantizationType.Q8_0, t), ("q4_0", gguf.GGMLQuantizationType.Q4_0, t7)):
        p = str(root / f"{name}.gguf")
        out[name] = (p, c, write_gguf(p, c, tq, qtype=lambda hf, q=q: q, fields=SPM))
    return out


def _greedy_numpy(src, n_tokens):
    m = Model(src)
    e = ReferenceEngine(m.cfg, m.weights, m.embed)
    ids, logits = [], e.prefill(PROMPT)
    for _ in range(n_tokens):
        ids.append(int(np.argmax(logits)))
        logits = e.step(ids[-1])
    m.close()
    return ids


# -- CPU: the lane view is the one-lane model ------------------------------------------------------------
@pytest.mark.parametrize("which,ns", [("hf", (2, 4, 8)), ("qwen2", (2, 4)), ("q8_0", (2,)), ("q4_0", (4,))])
def test_lane_view_gives_the_reference_ids(models, which, ns):
    """8 lanes of a model of 2 KV heads: each KV head replicated in 4 lanes."""
    path, c, held = models[which]
    want = HFLlama(c, held).greedy(PROMPT, 10)[0]
    assert _greedy_numpy(open_model(path, progress=False), 10) == want
    for n in ns:
        src = LaneSource(open_model(path, progress=False), n)
        assert src.cfg.num_lanes == n and src.cfg.broadcast_delay == c["num_hidden_layers"]
        assert _greedy_numpy(src, 10) == want, n


@pytest.mark.parametrize("n", [2, 8])
def test_lane_slices_are_the_one_lane_tensors_pieces(models, n):
    path = models["hf"][0]
    one, lanes = open_model(path, progress=False), LaneSource(open_model(path, progress=False), n)
    cfg, hd = one.cfg, one.cfg.head_dim
    p = "model.layers.1."
    wq, wk = one.tensor(p + "attention.wq.weight")[0], one.tensor(p + "attention.wk.weight")[0]
    wo, w2 = one.tensor(p + "attention.wo.weight")[0], one.tensor(p + "feed_forward.w2.weight")[0]
    lq, lk = lanes.tensor(p + "attention.wq.weight"), lanes.tensor(p + "attention.wk.weight")
    lo, l2 = lanes.tensor(p + "attention.wo.weight"), lanes.tensor(p + "feed_forward.w2.weight")
    assert np.array_equal(np.concatenate(list(lq)), wq)                     # heads in lane order
    assert np.array_equal(np.concatenate(list(lo), axis=1), wo)              # wo's columns likewise
    assert np.array_equal(np.concatenate(list(l2), axis=1), w2)
    hpl, g = cfg.num_attention_heads // n, cfg.num_attention_heads // cfg.kv_heads
    for lane in range(n):   # the KV heads lane l's query heads read, replicated when lanes outnumber them
        kv = sorted({h // g for h in range(lane * hpl, (lane + 1) * hpl)})
        assert np.array_equal(lk[lane], np.concatenate([wk[k * hd:(k + 1) * hd] for k in kv]))
    assert lanes.shape(p + "attention.wo.weight") == (n,) + lo.shape[1:]
    one.close()
    lanes.close()


def test_lane_config_refuses_in_one_line():
    c = lanes_config(open_model_cfg(), 2)
    assert c.use_comm and c.use_early_comm and not c.early_layers_to_future
    with pytest.raises(ValueError) as e:
        lanes_config(open_model_cfg(), 3)
    assert "3 ranks do not divide num_attention_heads=8" in str(e.value) and "\n" not in str(e.value)


def open_model_cfg():
    from kog_dist.config import LaneformerConfig
    return LaneformerConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=128,
                            vocab_size=100, num_hidden_layers=2)


def test_choose_takes_cuda_for_one_lane_over_several_ranks():
    c = open_model_cfg()
    kind, note = choose("cuda", 2, True, True, c)
    assert kind == "cuda" and "tensor-parallel" in note
    assert choose("auto", 4, True, True, c)[0] == "cuda"
    assert choose("auto", 2, True, False, c)[0] == "cpu"
    with pytest.raises(ValueError) as e:
        choose("cuda", 3, True, True, c)
    assert "do not divide" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("shape,n,dtype", [("smollm2-135m", 3, "Q4_1"), ("llama3.2-1b", 2, "BF16"),
                                           ("qwen2.5-0.5b", 2, "Q8_0"), ("llama3.2-1b", 2, "Q4_K+Q6_K"),
                                           ("llama3.2-1b", 4, "Q4_K_M"), ("llama3.1-8b", 2, "Q4_K+Q6_K")])
def test_nvcc_compiles_the_tensor_parallel_build(shape, n, dtype, tmp_path):
    """The K-quant builds too (CFG_QW 4 with a rank's lanes: mk_kquant.cuh's ktype reads p.kt a layer and
    finds a row's matrix within the rank's lane layout, so the kernel is unchanged)."""
    from kog_dist.shapes import shape_config
    from workers.cuda import build
    cfg = lanes_config(shape_config(shape), n)
    src = tmp_path / "mono.cu"
    src.write_text(build.source())
    cmd = ["nvcc", "-arch=sm_90", "-std=c++17", "-ptx", "-o", str(tmp_path / "m.ptx"), "-x", "cu", str(src)]
    cmd += [f"-D{k}={v}" for k, v in build.defines(cfg, dtype, 132 // n, nranks=n).items()]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warning" not in res.stderr.lower(), res.stderr[-3000:]


# -- GPU: N ranks of the multi-rank monokernel ------------------------------------------------------------
from kccl.cuda_ipc import cupy_missing  # noqa: E402 (imports without CuPy)

_why = cupy_missing()


def kog_cuda(model, n, *extra, prompt=None, prompt_ids=None, timeout=240, log=False):
    """The JSON of `kog generate [--np n] --backend cuda --json` (and its stderr with log=True)."""
    from mpi_helpers import have_mpiexec, shared_gpu_reason
    if not have_mpiexec():
        pytest.skip("no mpiexec")
    why = shared_gpu_reason(n)
    if why:
        pytest.skip(why)
    what = ["--prompt", prompt] if prompt else ["--prompt-ids", ",".join(map(str, prompt_ids or PROMPT))]
    r = subprocess.run([sys.executable, "-m", "kog_cli", "generate", *(["--np", str(n)] if n > 1 else []),
                        "--backend", "cuda", *(["--model", model] if model else []), *what, "--json", *extra],
                       capture_output=True, text=True, timeout=timeout, env=mpi_env())
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout)
    assert out.get("ranks", 1) == n and out["backend"] == "cuda"
    return (out, r.stderr) if log else out


@pytest.mark.gpu
@pytest.mark.skipif(_why is not None, reason=f"needs CuPy and a CUDA GPU: {_why}")
@pytest.mark.parametrize("which,ns", [("hf", (2, 4, 8)), ("qwen2", (2, 4)), ("q8_0", (2,)), ("q4_0", (4,))])
def test_generate_np_cuda_gives_the_reference_ids(models, which, ns):
    path, c, held = models[which]
    want = HFLlama(c, held).greedy(PROMPT, 12)[0]
    assert kog_cuda(path, 1, "-n", "12", "--temperature", "0")["token_ids"] == want
    for n in ns:
        assert kog_cuda(path, n, "-n", "12", "--temperature", "0")["token_ids"] == want, n


@pytest.mark.gpu
@pytest.mark.skipif(_why is not None, reason=f"needs CuPy and a CUDA GPU: {_why}")
@pytest.mark.parametrize("sampling", [("--temperature", "0.9", "--top-k", "20", "--top-p", "0.9"),
                                      ("--temperature", "0.05"),                  # peaked: the ranks' candidates
                                      ("--temperature", "1.5", "--top-p", "0.98")],  # flat: past them, all V
                         ids=["topk-topp", "peaked", "flat"])
def test_sampled_ids_same_seed_one_rank_and_several(models, sampling):
    """The draw decided across the ranks' vocabulary shards (mk_sample.cuh sample_full_mr: each rank's
    candidates, or every logit when the draw lies past them) is one rank's draw."""
    path = models["hf"][0]
    args = ["-n", "24", *sampling, "--seed", "1234"]
    one = kog_cuda(path, 1, *args)["token_ids"]
    assert len(set(one)) > (1 if "0.05" in sampling else 3)
    for n in (2, 4):
        assert kog_cuda(path, n, *args)["token_ids"] == one, n


@pytest.mark.gpu
@pytest.mark.skipif(_why is not None, reason=f"needs CuPy and a CUDA GPU: {_why}")
def test_default_model_through_three_cuda_ranks():
    if not default_gguf_path():
        pytest.skip("the default model is not fetched (any kog command online fetches it)")
    q = "What is the capital of France?"
    one = kog_cuda(None, 1, "-n", "24", "--temperature", "0", prompt=q)
    three = kog_cuda(None, 3, "-n", "24", "--temperature", "0", prompt=q)
    assert "Paris" in three["text"]
    assert three["token_ids"] == one["token_ids"]
    # sampled as a chat samples: the real model's peaked logits, decided from the three ranks' candidates
    _sampled_like_one_rank(q, None, [(0.7, 0.9, 5), (1.0, 1.0, 5)])


# Three ranks sum a token's partials in another order than one rank; where a bf16 value (the KV cache) then rounds
# the other way the logits differ by ~1e-3, and a seeded draw whose u lies that close to a boundary of the
# cumulative distribution may differ (bench/tp_draw_margin.py, H100 2026-12-08: every such difference had u
# within 3.9e-3 of a boundary, free text and under a schema alike). So sampled ids are compared up to the first
# draw of one rank with u within MARGIN of a boundary.
MARGIN = 5e-3


def _one_rank_draws(ids, sp, schema, n):
    """One rank's ids (a CudaBackend in this process) and, per token, u's distance to the nearest boundary of its
    own draw's cumulative distribution (its logits, the schema's mask, kog_dist.sampling's rule)."""
    import cupy as cp
    from kog_dist.backend import RunCommand
    from kog_dist.formats import open_model
    from kog_dist.grammar import compile_format
    from kog_dist.sampling import draw
    from kog_dist.tokenizer import load_tokenizer
    from workers.cuda.backend import CudaBackend
    src = open_model(default_gguf_path(), progress=False)
    tok = load_tokenizer(src)
    g = compile_format({"type": "json_schema", "schema": schema}, tok) if schema else None
    b = CudaBackend(src, max_seq=512, num_slots=1, progress=False)
    try:
        dbg = cp.zeros((n, src.cfg.vocab_size), cp.float32)
        r = b.run(RunCommand(append=list(ids), max_new_tokens=n, sampling=sp, grammar=g.matcher() if g else None,
                             stop_ids=tuple(tok.eos_ids)), dbg_logits=dbg)
        logits = dbg.get()
    finally:
        b.close()
        src.close()
    m = g.matcher() if g else None
    dist = []
    for i, t in enumerate(r.token_ids):
        tok_i, margin = draw(m.mask(logits[i]) if m else logits[i], sp, len(ids) + i)
        assert tok_i == t, (i, tok_i, t)     # the kernel drew by the rule from its own logits
        dist.append(margin)
        if m:
            m.accept(t)
    return r.token_ids, dist


def _sampled_like_one_rank(question, schema, cases, n=48):
    """For each (temperature, top_p, seed): 3 cuda ranks' ids are one rank's up to its first draw within MARGIN of
    a boundary; at least 12 tokens compared over the cases (a short answer ends at its end of turn). Returns the 3
    ranks' results."""
    from kog_dist.formats import open_model
    from kog_dist.sampling import SamplingParams
    from kog_dist.tokenizer import load_tokenizer
    import tempfile
    src = open_model(default_gguf_path(), progress=False)
    ids = load_tokenizer(src).encode_chat([{"role": "user", "content": question}])
    src.close()
    extra = []
    if schema:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(schema, f)
        extra = ["--json-schema", f.name]
    compared, outs = 0, []
    for T, top_p, seed in cases:
        one, dist = _one_rank_draws(ids, SamplingParams(T, 0, top_p, seed), schema, n)
        three = kog_cuda(None, 3, "-n", str(n), "--temperature", str(T), "--top-p", str(top_p), "--seed", str(seed),
                         *extra, prompt_ids=ids)
        k = next((i for i, d in enumerate(dist) if d < MARGIN), len(one))
        assert three["token_ids"][:k] == one[:k], (T, top_p, seed, k)
        compared += k
        outs.append(three)
    assert compared >= 12, compared
    return outs


@pytest.fixture(scope="module")
def grammar_model(tmp_path_factory):
    """An HF llama of 8 heads (2 KV heads) with a tokenizer llguidance takes (tests/grammar_helpers.py: 420 ids
    of a vocabulary of 512) and the person schema as a file."""
    from grammar_helpers import SCHEMA, write_tokenizer
    d = str(tmp_path_factory.mktemp("cuda_tp_grammar"))
    c = tiny_hf_config(num_attention_heads=8, num_key_value_heads=2, vocab_size=512, num_hidden_layers=3,
                       hidden_size=256, intermediate_size=512)
    write_hf_dir(d, c, random_hf_tensors(c, 5))
    write_tokenizer(d)
    schema = f"{d}/person.schema.json"
    with open(schema, "w") as f:
        json.dump(SCHEMA, f)
    return d, schema, SCHEMA


@pytest.mark.gpu
@pytest.mark.skipif(_why is not None, reason=f"needs CuPy and a CUDA GPU: {_why}")
@pytest.mark.parametrize("sampling", [("--temperature", "0"), ("--temperature", "1.0", "--seed", "3"),
                                      ("--temperature", "0.9", "--top-p", "0.95", "--seed", "11")],
                         ids=["greedy", "t1", "t09-topp"])
def test_json_schema_through_cuda_ranks_is_one_ranks_and_validates(grammar_model, sampling):
    """Structured outputs on tensor-parallel cuda ranks: every rank's host runs the grammar on the same tokens and
    its kernel masks its rows of the LM head before the ranks' exchange (mk_lm.cuh, sample_full_mr: a shard the
    mask forbids entirely is no candidate). The ids are one rank's, greedy and sampled, and the object validates."""
    import jsonschema
    path, schema, want = grammar_model
    args = ["-n", "120", "--json-schema", schema, "--raw", *sampling]
    one = kog_cuda(path, 1, *args, prompt="Give a person as JSON: ")
    assert one["stats"]["stop_reason"] == "eos", one["text"]
    jsonschema.validate(json.loads(one["text"]), want)
    free = kog_cuda(path, 1, "-n", str(len(one["token_ids"])), "--raw", *sampling, prompt="Give a person as JSON: ")
    assert free["token_ids"] != one["token_ids"]          # the mask is what makes it parse
    for n in (2, 4):
        got = kog_cuda(path, n, *args, prompt="Give a person as JSON: ")
        assert got["token_ids"] == one["token_ids"], n
        assert got["stats"]["stop_reason"] == "eos"


@pytest.mark.gpu
@pytest.mark.skipif(_why is not None, reason=f"needs CuPy and a CUDA GPU: {_why}")
def test_default_model_json_schema_through_three_cuda_ranks():
    """The cpu ranks' test (tests/test_tp.py) on cuda ranks: the default model's object over 3 ranks is one
    rank's greedy, sampled up to a draw that rounding could flip (MARGIN), and validates."""
    import jsonschema
    import tempfile
    if not default_gguf_path():
        pytest.skip("the default model is not fetched (any kog command online fetches it)")
    from test_tp import PERSON
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(PERSON, f)
    args = ("-n", "48", "--json-schema", f.name, "--temperature", "0")
    one = kog_cuda(None, 1, *args, prompt="Ada Lovelace as JSON")
    three = kog_cuda(None, 3, *args, prompt="Ada Lovelace as JSON")
    assert three["token_ids"] == one["token_ids"]
    jsonschema.validate(json.loads(three["text"]), PERSON)
    for r in _sampled_like_one_rank("Ada Lovelace as JSON", PERSON, [(0.9, 1.0, 7), (0.9, 1.0, 8), (0.9, 1.0, 9)]):
        if r["stats"]["stop_reason"] == "eos":
            jsonschema.validate(json.loads(r["text"]), PERSON)


@pytest.fixture(scope="module")
def kquant_models(tmp_path_factory):
    from test_tp_kquant import write_kquant_models
    return write_kquant_models(tmp_path_factory.mktemp("cuda_tp_kquant"))


@pytest.mark.gpu
@pytest.mark.skipif(_why is not None, reason=f"needs CuPy and a CUDA GPU: {_why}")
@pytest.mark.parametrize("which,storage", [("q4_k", "Q4_K"), ("q4_k_m", "Q4_K+Q6_K")])
def test_generate_np_cuda_kquant_as_stored(kquant_models, which, storage):
    """A K-quant GGUF through 2 cuda ranks keeps its layer matrices as stored (each rank's lane: its rows, and
    the super-blocks of its wo / w2 columns; the build is named with the file's types and nothing is
    dequantized to BF16) and gives one rank's ids and the HF-style reference's on the file's values (the
    fixtures' greedy margins are >= 0.1: the embedding and LM head are bf16 on the cuda backend)."""
    path, c, held = kquant_models[which]
    want = HFLlama(c, held).greedy(PROMPT, 12)[0]
    one, log1 = kog_cuda(path, 1, "-n", "12", "--temperature", "0", log=True)
    two, log2 = kog_cuda(path, 2, "-n", "12", "--temperature", "0", log=True)
    for log in (log1, log2):
        assert f"compiling monokernel ({storage}," in log, log[-2000:]
        assert "dequantized to BF16" not in log, log[-2000:]
    assert one["token_ids"] == want
    assert two["token_ids"] == want
