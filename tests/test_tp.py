"""Tensor parallelism of one-lane (Llama-family) models on the cpu backend: the plan and its refusals,
each rank's slices, sampling merged across vocabulary shards, and N ranks under a real mpiexec giving
one rank's ids and the HF-style reference's, on HF and GGUF fixtures (plain and quantized)."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kog_dist.config import LaneformerConfig
from kog_dist.formats import open_model
from kog_dist.models import default_gguf_path
from kog_dist.sampling import SamplingParams, sample
from kog_dist.tp import (FIRST_CANDIDATES, ShardSampler, TPModel, check_tp, read_block, sample_sharded,
                         split_logits, tp_bytes_per_token, tp_plan)
from workers.factory import choose

from hf_reference import HFLlama, random_hf_tensors, tiny_hf_config, write_gguf, write_hf_dir
from mpi_helpers import mpi_env

PROMPT = [1, 5, 9, 33, 17, 60]
SPM = {"tokenizer.ggml.model": "llama"}     # the GGUF fixtures' token list read as a plain vocabulary


def write_tokenizer(d: str, V: int) -> None:
    """A word-level tokenizer.json of V tokens "t0".."t{V-1}" (an HF directory needs one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(os.path.join(d, "tokenizer.json"))


def hf_model(d, seed=1, **kw):
    c = tiny_hf_config(**kw)
    t = random_hf_tensors(c, seed)
    write_hf_dir(d, c, t)
    write_tokenizer(d, c["vocab_size"])
    return c, t


def kog_np(model, n, *extra, timeout=180):
    r = subprocess.run([sys.executable, "-m", "kog_cli", "generate", "--np", str(n), "--backend", "cpu",
                        "--model", model, "--prompt-ids", ",".join(map(str, PROMPT)), "--json", *extra],
                       capture_output=True, text=True, timeout=timeout, env=mpi_env())
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ranks"] == n
    return out


# -- the plan ---------------------------------------------------------------------------------------
def cfg_of(H, KV, F, V=100, D=64):
    return LaneformerConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=KV, intermediate_size=F,
                            vocab_size=V, num_hidden_layers=2, head_dim_override=D // H if D % H == 0 else 8)


def test_plan_splits_heads_kv_ffn_and_vocab():
    c = cfg_of(8, 4, 128, V=101)
    plans = [tp_plan(c, r, 2) for r in range(2)]
    assert [list(p.heads) for p in plans] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(p.kv) for p in plans] == [[0, 1], [2, 3]]
    assert [(p.ffn.start, p.ffn.stop) for p in plans] == [(0, 64), (64, 128)]
    assert [(p.vocab.start, p.vocab.stop) for p in plans] == [(0, 50), (50, 101)]   # uneven is fine
    assert plans[0].local.heads_per_lane == 4 and plans[0].local.kv_heads_per_lane == 2
    assert plans[0].local.head_dim == c.head_dim and not plans[0].kv_replicated


def test_plan_replicates_kv_heads_when_ranks_outnumber_them():
    c = cfg_of(8, 2, 128)
    plans = [tp_plan(c, r, 8) for r in range(8)]
    # query head h reads KV head h // 4: ranks 0-3 hold KV head 0, ranks 4-7 KV head 1
    assert [list(p.kv) for p in plans] == [[0]] * 4 + [[1]] * 4
    assert all(p.kv_replicated and p.local.kv_heads_per_lane == 1 and p.local.heads_per_lane == 1
               for p in plans)


@pytest.mark.parametrize("H,KV,F,N,words", [
    (9, 3, 1536, 2, "2 ranks do not divide num_attention_heads=9; rank counts this model splits into: 1, 3"),
    (8, 4, 90, 4, "4 ranks do not divide intermediate_size=90"),
    (12, 4, 120, 6, "6 ranks neither divide num_key_value_heads=4 nor are a multiple of it"),
])
def test_refusals_name_the_numbers(H, KV, F, N, words):
    with pytest.raises(ValueError) as e:
        check_tp(cfg_of(H, KV, F, D=H * 8), N)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_backend_choice_of_a_one_lane_model_over_several_ranks():
    """cpu stays cpu; cuda splits it as lanes (tests/test_cuda_tp.py), auto without a GPU everywhere is cpu."""
    c = cfg_of(8, 4, 128)
    assert choose("cpu", 2, False, False, c) == ("cpu", None)
    assert choose("cuda", 2, True, True, c)[0] == "cuda"
    assert choose("auto", 2, True, False, c)[0] == "cpu"


# -- each rank's slices ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """An HF directory (fp32), the same model as an F32 GGUF and as a Q8_0 / Q4_0 / Q4_K GGUF
    (D = F = 256 so K-quant super-blocks fit; a rank's wo / w2 columns then start inside a super-block)."""
    import gguf
    root = tmp_path_factory.mktemp("tp")
    out = {}
    c, t = hf_model(str(root / "hf"), seed=3, num_attention_heads=8, num_key_value_heads=2,
                    vocab_size=97, num_hidden_layers=3)
    out["hf"] = (str(root / "hf"), c, t)
    cq, tq = hf_model(str(root / "qwen2"), seed=4, model_type="qwen2", num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97)
    out["qwen2"] = (str(root / "qwen2"), cq, tq)           # q/k/v biases, split with their rows
    cb, tb = hf_model(str(root / "bf16"), seed=6, num_attention_heads=4, num_key_value_heads=4,
                      vocab_size=97, tie_word_embeddings=True)
    tb = {k: _bf16(v) for k, v in tb.items()}
    _save_bf16(str(root / "bf16"), tb)
    out["bf16"] = (str(root / "bf16"), cb, tb)             # BF16 through the mapped reader, a tied head
    for name, q in (("f32", None), ("q8_0", gguf.GGMLQuantizationType.Q8_0),
                    ("q4_0", gguf.GGMLQuantizationType.Q4_0)):
        p = str(root / f"{name}.gguf")
        out[name] = (p, c, write_gguf(p, c, t, qtype=(lambda hf, q=q: q) if q else None, fields=SPM))
    ck = tiny_hf_config(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                        vocab_size=97, num_hidden_layers=2, tie_word_embeddings=True)
    tk = random_hf_tensors(ck, 5)
    p = str(root / "q4_k.gguf")
    out["q4_k"] = (p, ck, _k_quant_gguf(p, ck, tk, gguf.GGMLQuantizationType.Q4_K))
    return out


def _bf16(a):
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).view(np.float32)


def _save_bf16(d, t):
    """t's values (already bf16-exact) stored as BF16 safetensors (numpy has no bfloat16: bits by hand)."""
    from kog_dist.checkpoint import save_safetensors
    save_safetensors(os.path.join(d, "model.safetensors"), {k: (v, "BF16") for k, v in t.items()})


def _k_quant_gguf(path, c, t, qtype):
    """wo and w2 (the matrices split by columns) as random valid K-quant blocks (gguf cannot quantize
    to them), the rest F32; returns the values the file holds in HF names."""
    import gguf
    from gguf.quants import dequantize
    rng = np.random.default_rng(7)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    extra, dq = {}, {}
    for i in range(c["num_hidden_layers"]):
        for hf, g in (("self_attn.o_proj.weight", "attn_output.weight"), ("mlp.down_proj.weight", "ffn_down.weight")):
            a = t.pop(f"model.layers.{i}.{hf}")
            rows, cols = a.shape
            b = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
            b[:, :, 0:4] = np.array([0.0004, 0.0001], np.float16).view(np.uint8)   # d, dmin
            b = b.reshape(rows, -1)
            extra[f"blk.{i}.{g}"] = (b, qtype)
            dq[f"model.layers.{i}.{hf}"] = dequantize(b, qtype)
    held = write_gguf(path, c, t, extra_tensors=extra, fields=SPM)
    held.update(dq)
    return held


@pytest.mark.parametrize("which", ["hf", "qwen2", "bf16", "q8_0", "q4_k"])
@pytest.mark.parametrize("n", [2, 4])
def test_rank_slices_are_the_whole_tensors_pieces(fixtures, which, n):
    """Every rank's slices (read with get_slice / GGUF row and block ranges) put together are the
    tensors one rank reads; the wo / w2 partials of the ranks sum to the whole product."""
    path, c, _ = fixtures[which]
    whole = open_model(path)
    models = [TPModel(open_model(path), r, n) for r in range(n)]
    cfg = whole.cfg
    for name in ("model.layers.1.attention.wq.weight", "model.layers.1.attention.wk.weight",
                 "model.layers.1.feed_forward.w1.weight", "model.layers.1.attention.wo.weight",
                 "model.layers.1.feed_forward.w2.weight"):
        full = whole.tensor(name)[0]
        parts = [m.weights[name][0] for m in models]
        if name.endswith(("wo.weight", "w2.weight")):       # by columns: the rank's heads / FFN columns
            np.testing.assert_array_equal(np.concatenate(parts, axis=1), full)
        elif name.endswith("wk.weight") and n > cfg.kv_heads:
            g = n // cfg.kv_heads                    # each KV head held by g ranks
            np.testing.assert_array_equal(np.concatenate(parts[::g], axis=0), full)
        else:
            np.testing.assert_array_equal(np.concatenate(parts, axis=0), full)
    head = whole.tensor("lm_head.weight" if not cfg.tie_word_embeddings else "model.tok_embeddings.weight")
    np.testing.assert_array_equal(np.concatenate([m.weights["lm_head.weight"] for m in models]), head)
    # only the rank's rows of the vocabulary, and only its share of the layer bytes was read
    assert sum(m.weights["lm_head.weight"].shape[0] for m in models) == cfg.vocab_size
    norms = 4 * cfg.hidden_size * (2 * cfg.num_hidden_layers + 1)       # copied to every rank, with biases
    norms += 4 * cfg.num_hidden_layers * (cfg.num_attention_heads + 2 * cfg.kv_heads) * cfg.head_dim
    bits = 16 if whole.dtype("model.layers.0.attention.wq.weight") in ("BF16", "F16") else 32   # as read
    share = tp_bytes_per_token(cfg, n, bits=bits)
    for m in models:
        assert 0.9 * share <= m.src.nbytes_read <= share + norms, (m.src.nbytes_read, share)
    assert share < 0.6 * tp_bytes_per_token(cfg, 1, bits=bits)
    for m in models:
        m.close()
    whole.close()


def test_gguf_block_reads_only_covering_blocks(fixtures):
    """A column range inside Q4_K super-blocks (256 weights) is cut from whole blocks: the same values
    as the dequantized tensor's columns."""
    path, _, _ = fixtures["q4_k"]
    src = open_model(path)
    name = "model.layers.0.attention.wo.weight"
    full = src.tensor(name)[0]
    got = read_block(src, name, slice(3, 40), slice(64, 192))
    np.testing.assert_array_equal(got, full[3:40, 64:192])
    src.close()


# -- sampling over vocabulary shards -----------------------------------------------------------------
def sharded(x, n, p, counter):
    shards = [ShardSampler(rows, v0, p) for v0, rows in split_logits(x, n)]
    calls = []

    def gather(f):
        calls.append(1)
        return [f(s) for s in shards]
    return sample_sharded(shards[0], p, counter, gather), len(calls)


def test_sharded_sampling_is_sample_on_the_whole_logits():
    rng = np.random.default_rng(0)
    cases = 0
    for trial in range(300):
        V, n = int(rng.integers(8, 4000)), int(rng.integers(2, 9))
        x = (rng.standard_normal(V) * rng.choice([0.5, 3.0, 12.0])).astype(np.float32)
        if trial % 4 == 0:
            x[rng.integers(0, V, 6)] = x.max()                 # equal maxima across shards
        if trial % 5 == 0:
            x = np.round(x)                                      # many equal logits
        p = SamplingParams(float(rng.choice([0.0, 0.4, 1.0, 3.0])), int(rng.choice([0, 0, 1, 7, 60, 10 ** 6])),
                           float(rng.choice([1.0, 0.95, 0.5])), int(rng.integers(0, 1 << 62)))
        for counter in range(4):
            assert sharded(x, n, p, counter)[0] == sample(x, p, counter), (V, n, p, counter)
            cases += 1
    assert cases == 1200


def test_sharded_sampling_asks_for_more_candidates_only_when_the_draw_needs_them():
    rng = np.random.default_rng(1)
    V = 20000
    flat = rng.standard_normal(V).astype(np.float32) * 0.01    # near-uniform: the draw lies deep
    p = SamplingParams(temperature=1.0, seed=3)
    got, rounds = sharded(flat, 4, p, 5)
    assert got == sample(flat, p, 5) and rounds > 2             # best, then several candidate rounds
    peaked = flat.copy()
    peaked[123] = 40.0
    got, rounds = sharded(peaked, 4, p, 5)
    assert got == 123 and rounds == 2                           # one round of FIRST_CANDIDATES decides
    assert FIRST_CANDIDATES < V // 4
    # top-k beyond one round's cap (MAX_FIRST): still the whole-vocabulary draw
    p = SamplingParams(temperature=1.0, top_k=9000, top_p=0.9, seed=11)
    for c in range(3):
        assert sharded(flat, 3, p, c)[0] == sample(flat, p, c)


# -- N ranks under mpiexec -----------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("which,ranks", [("hf", (2, 4, 8)), ("qwen2", (2, 4)), ("bf16", (4,)), ("f32", (2,)),
                                         ("q8_0", (2, 4)), ("q4_0", (8,)), ("q4_k", (2, 4))])
def test_greedy_ids_through_n_ranks_equal_one_rank_and_the_reference(fixtures, which, ranks):
    """8 ranks of a model of 2 KV heads: each KV head replicated on 4 ranks."""
    path, c, held = fixtures[which]
    want = HFLlama(c, held).greedy(PROMPT, 12)[0]
    one = kog_np(path, 1, "-n", "12", "--temperature", "0")["token_ids"]
    assert one == want
    for n in ranks:
        assert kog_np(path, n, "-n", "12", "--temperature", "0")["token_ids"] == want, n


@pytest.mark.mpi
def test_sampled_ids_same_seed_whatever_n(fixtures):
    path = fixtures["hf"][0]
    for extra in (["--top-k", "20", "--top-p", "0.9"], ["--top-k", "0", "--top-p", "1.0"]):
        args = ["-n", "16", "--temperature", "0.9", "--seed", "1234", *extra]
        one = kog_np(path, 1, *args)["token_ids"]
        assert len(set(one)) > 3                                 # a real draw, not a greedy run
        assert [kog_np(path, n, *args)["token_ids"] for n in (2, 4)] == [one, one]
    other = kog_np(path, 2, "-n", "16", "--temperature", "0.9", "--seed", "99")["token_ids"]
    assert other != one


@pytest.mark.mpi
def test_rank_count_the_model_cannot_split_is_refused_before_any_rank_starts(fixtures):
    path = fixtures["hf"][0]
    r = subprocess.run([sys.executable, "-m", "kog_cli", "generate", "--np", "3", "--backend", "cpu",
                        "--model", path, "--prompt-ids", "1,2", "--json"], capture_output=True, text=True,
                       timeout=60, env=mpi_env())
    assert r.returncode == 2
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1
    assert "3 ranks do not divide num_attention_heads=8" in err and "1, 2, 4, 8" in err


@pytest.mark.mpi
def test_default_model_through_three_ranks_gives_one_ranks_text():
    """SmolLM2-135M (9 heads, 3 KV heads, FFN 1536, a Q4_1 GGUF): 3 ranks, one KV head each."""
    path = default_gguf_path()
    if not path:
        pytest.skip("the default model is not fetched (any kog command online fetches it)")
    args = ["--model", path, "--prompt", "What is the capital of France?", "-n", "24", "--temperature", "0"]

    def run(n):
        r = subprocess.run([sys.executable, "-m", "kog_cli", "generate", "--np", str(n), "--backend", "cpu",
                            *args, "--json"], capture_output=True, text=True, timeout=300, env=mpi_env())
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)
    one, three = run(1), run(3)
    assert "Paris" in one["text"]
    assert three["text"] == one["text"] and three["token_ids"] == one["token_ids"]


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.mpi
def test_json_schema_through_three_ranks_is_one_ranks_and_validates(tmp_path):
    """Structured outputs on tensor-parallel ranks: each rank compiles the request's format and masks its own
    vocabulary shard; the merged draw is one rank's, greedy and seeded sampling, and the object validates."""
    import jsonschema
    path = default_gguf_path()
    if not path:
        pytest.skip("the default model is not fetched (any kog command online fetches it)")
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))

    def run(n, *extra):
        r = subprocess.run([sys.executable, "-m", "kog_cli", "generate", "--np", str(n), "--backend", "cpu",
                            "--model", path, "--prompt", "Ada Lovelace as JSON", "--json-schema", str(schema),
                            "-n", "48", "--json", *extra], capture_output=True, text=True, timeout=300, env=mpi_env())
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)
    for extra in (["--temperature", "0"], ["--temperature", "0.9", "--seed", "7"]):
        one, three = run(1, *extra), run(3, *extra)
        assert three["token_ids"] == one["token_ids"], extra
        jsonschema.validate(json.loads(three["text"]), PERSON)


@pytest.mark.mpi
def test_openai_client_json_schema_and_a_required_tool_call_through_tensor_parallel_ranks():
    """What an agent sends, against `kog serve --np 3` (the default model split over 3 cpu ranks): a json_schema
    response_format and a tool_choice naming a function; the object and the call's arguments validate."""
    openai = pytest.importorskip("openai")
    import jsonschema
    from serve_helpers import Serve
    if not default_gguf_path():
        pytest.skip("the default model is not fetched (any kog command online fetches it)")
    with Serve("--backend", "cpu", "--np", "3", "--bind", "none", timeout=180) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
        model = c.models.list().data[0].id
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Ada Lovelace as JSON"}],
                                      max_tokens=48, temperature=0, response_format={
                                          "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        tool = {"type": "function", "function": {"name": "set_person", "parameters": PERSON}}
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Record Ada, 36."}],
                                      max_tokens=48, temperature=0, tools=[tool],
                                      tool_choice={"type": "function", "function": {"name": "set_person"}})
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "set_person"
        jsonschema.validate(json.loads(call.function.arguments), PERSON)
        assert "3 rank(s), backend cpu, tensor parallel" in s.err.text()


@pytest.mark.mpi
def test_killed_rank_ends_a_tensor_parallel_job(tmp_path):
    """SIGKILL one rank of a 4-rank TP decode: kog generate fails, within seconds, leaving nothing."""
    from test_distributed import _busy, _past_loading, _ranks_of, shm_entries
    d = str(tmp_path / "m")
    hf_model(d, num_attention_heads=8, num_key_value_heads=4, hidden_size=256, intermediate_size=1024,
             num_hidden_layers=6, vocab_size=300, max_position_embeddings=100000, eos_token_id=None)
    before = shm_entries()
    p = subprocess.Popen([sys.executable, "-m", "kog_cli", "generate", "--np", "4", "--backend", "cpu",
                          "--model", d, "--prompt-ids", "1,2,3", "-n", "100000", "--max-seq", "100000",
                          "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(),
                         start_new_session=True)
    victim = None
    deadline = time.time() + 60
    while victim is None and time.time() < deadline:
        time.sleep(0.5)
        ranks = _ranks_of(p.pid)
        if len(ranks) == 4 and all(_past_loading(q) for q in ranks) and _busy(ranks):
            victim = ranks[1]
    assert victim, "the ranks never started decoding"
    time.sleep(1.0)
    os.kill(victim, signal.SIGKILL)
    t0 = time.time()
    try:
        _, err = p.communicate(timeout=15)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode != 0 and time.time() - t0 < 10
    assert "Traceback" not in err
    time.sleep(0.5)
    assert _ranks_of(p.pid) == []
    assert shm_entries() - before == set()


@pytest.mark.mpi
def test_bench_np_cpu_runs_a_tensor_parallel_model(fixtures):
    """`kog bench --np 2 --backend cpu --model GGUF`: the table's rows, per-rank bytes, the ids rank 0
    decoded (greedy, eos ignored) equal to the one-process bench's."""
    path = fixtures["q8_0"][0]
    args = ["--backend", "cpu", "--model", path, "--pp", "8", "--prompt", "6", "--gen", "10", "--reps", "1", "--json"]
    outs = []
    for n in (1, 2):
        r = subprocess.run([sys.executable, "-m", "kog_cli", "bench", "--np", str(n), *args], capture_output=True,
                           text=True, timeout=240, env=mpi_env())
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    one, two = outs
    assert two["ranks"] == 2 and "tensor parallel" in two["device"]
    assert two["monokernel"]["tg"]["tokens_per_s"] > 0 and two["monokernel"]["tg"]["gen"] == 10
    assert two["monokernel"]["tg"]["ids_head"] == one["monokernel"]["tg"]["ids_head"]
    assert two["monokernel"]["streamed_bytes_per_token"] < one["monokernel"]["streamed_bytes_per_token"]


@pytest.mark.mpi
def test_mpirun_serve_serves_a_tensor_parallel_model(tmp_path, fixtures):
    """kog-worker under mpiexec (launch/mpirun-serve.sh -n 4): the control plane serves the reference's
    greedy ids from a one-lane model split over 4 ranks (KV heads replicated: the model has 2), twice
    on one job (the second request reuses the ranks' caches' slots), and SIGTERM ends every rank with 0."""
    import shutil
    from test_launch_helpers import REPO, env, kill_all, kog, procs_with, wait_for
    src, c, t = fixtures["hf"]
    d = str(tmp_path / "served-tp")
    shutil.copytree(src, d)
    want = HFLlama(c, t).greedy(PROMPT, 8)[0]
    ep, log = tmp_path / "endpoint", tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", os.path.join(REPO, "launch", "mpirun-serve.sh"), "-n", "4", "--model", d,
                                 "--backend", "cpu", "--endpoint-file", str(ep)], cwd=tmp_path, env=env(),
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: ep.exists() or proc.poll() is not None, 120, "the control endpoint")
        assert proc.poll() is None, log.read_text()
        assert "tensor parallel (heads 0..1, KV heads 0..0 replicated" in log.read_text()
        for _ in range(2):
            p = kog(["client", "--connect", ep.read_text().strip(), "generate", "--prompt-ids",
                     ",".join(map(str, PROMPT)), "--max-new-tokens", "8", "--temperature", "0", "--json"], timeout=60)
            assert json.loads(p.stdout)["token_ids"] == want
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
        wait_for(lambda: not procs_with(d), 15, "every rank gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_all(d)


def test_launch_dry_run_shows_each_ranks_share(fixtures):
    """`kog launch --dry-run`: stdout is the command alone; stderr the placement plan and, for a one-lane
    model, each rank's heads / KV heads / FFN columns / vocabulary rows (KV replicated on 4 ranks)."""
    path = fixtures["hf"][0]
    r = subprocess.run([sys.executable, "-m", "kog_cli", "launch", "--np", "4", "--dry-run", "--", "kog-worker",
                        "--model", path, "--backend", "cpu"], capture_output=True, text=True, timeout=60,
                       env=mpi_env())
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().splitlines()) == 1 and "kog-worker --model" in r.stdout
    err = r.stderr
    assert "placement: 4 rank(s)" in err and "  rank 3: " in err
    assert "tensor parallel over 4 ranks" in err
    assert "rank 1: heads 2..3, KV heads 0..0 (replicated), FFN 32..63, vocab 24..47" in err
    bad = subprocess.run([sys.executable, "-m", "kog_cli", "launch", "--np", "3", "--dry-run", "--", "kog-worker",
                          "--model", path], capture_output=True, text=True, timeout=60, env=mpi_env())
    assert bad.returncode == 0 and "3 ranks do not divide num_attention_heads=8" in bad.stderr


@pytest.mark.mpi
def test_dtype_store_through_ranks_equals_one_rank(fixtures):
    """--dtype q8_0: each rank rounds its own column slices to Q8_0 blocks (they start on block
    boundaries), the values one rank gives the whole matrices."""
    path = fixtures["hf"][0]
    args = ["-n", "12", "--temperature", "0", "--dtype", "q8_0"]
    one = kog_np(path, 1, *args)["token_ids"]
    assert kog_np(path, 2, *args)["token_ids"] == one


@pytest.mark.mpi
def test_one_lane_laneformer_checkpoint_through_ranks(tmp_path):
    """A Laneformer directory of one lane (per-lane norm scales, `.scale` [1, D]; read through the
    whole-tensor fallback: the Laneformer reader has no block reads) gives one rank's ids through 2 and 4."""
    from kog_dist.tiny import write_tiny_checkpoint
    d = str(tmp_path / "lf1")
    write_tiny_checkpoint(d, num_lanes=1, hidden_size=64, num_hidden_layers=3, num_attention_heads=8,
                          num_key_value_heads=4, intermediate_size=128, vocab_size=300, seed=5,
                          replicated_rmsn_scale=False)
    one = kog_np(d, 1, "-n", "12", "--temperature", "0")["token_ids"]
    assert [kog_np(d, n, "-n", "12", "--temperature", "0")["token_ids"] for n in (2, 4)] == [one, one]


def test_generate_np_backend_cuda_refuses_a_split_the_model_cannot_take(fixtures):
    r = subprocess.run([sys.executable, "-m", "kog_cli", "generate", "--np", "3", "--backend", "cuda", "--model",
                        fixtures["hf"][0], "--prompt-ids", "1,2"], capture_output=True, text=True, timeout=60,
                       env=mpi_env())
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "3 ranks do not divide num_attention_heads=8" in r.stderr


@pytest.mark.mpi
def test_chat_np_three_answers_through_tensor_parallel_ranks():
    """`kog chat --np 3` on the default model (its own 3 ranks under mpiexec): the answer, then a clean stop."""
    if not default_gguf_path():
        pytest.skip("the default model is not fetched (any kog command online fetches it)")
    r = subprocess.run([sys.executable, "-m", "kog_cli", "chat", "--np", "3", "--backend", "cpu", "-n", "16",
                        "--temperature", "0"], input="What is the capital of France?\n", capture_output=True,
                       text=True, timeout=300, env=mpi_env())
    assert r.returncode == 0, r.stderr
    assert "The capital of France is Paris." in r.stdout
    assert "Traceback" not in r.stderr


@pytest.mark.mpi
def test_kog_serve_np_four_completes_with_the_reference_ids(fixtures):
    """`kog serve --np 4` (the HTTP gateway over 4 tensor-parallel ranks, KV heads replicated): a greedy
    completion's tokens are the HF-style reference's; SIGTERM stops everything with 0."""
    import httpx
    from serve_helpers import Serve
    path, c, t = fixtures["hf"]
    ref = HFLlama(c, t).greedy(PROMPT, 8)[0]
    want = ref[:ref.index(2) + 1] if 2 in ref else ref               # eos (id 2) ends a completion
    s = Serve("--model", path, "--backend", "cpu", "--np", "4", "--bind", "none")
    try:
        assert s.rank_pids()                                          # the launcher, under kog serve
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={
            "prompt": " ".join(f"t{i}" for i in PROMPT), "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert [int(w[1:]) for w in r.json()["choices"][0]["text"].split()] == want
        assert "4 rank(s), backend cpu, tensor parallel" in s.err.text()
        assert s.stop(signal.SIGTERM) == 0
        assert not s.rank_pids()
    finally:
        if s.rank_pids():
            s.stop(signal.SIGKILL)
