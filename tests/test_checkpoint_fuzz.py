"""Damaged checkpoints (issue 32): every one is refused with one line naming what is wrong, before
anything is served; none ends in a traceback. The damaged files are made from one tiny Laneformer
(and one tiny Hugging Face directory) in a temporary directory."""
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kog_dist.checkpoint import CheckpointError, Model, _File
from kog_dist.config import LaneformerConfig, check_context_fits
from kog_dist.formats import open_model
from kog_dist.tiny import write_tiny_checkpoint

from hf_reference import random_hf_tensors, tiny_hf_config, write_hf_dir

SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, vocab_size=300, num_lanes=2, broadcast_delay=1, max_position_embeddings=256)
ST = "model.safetensors"
T = "model.layers.1.attention.wq.weight"       # the tensor most cases damage


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    one = str(root / "one")
    write_tiny_checkpoint(one, seed=3, **SHAPE)
    sharded = str(root / "sharded")
    write_tiny_checkpoint(sharded, seed=3, shards=2, **SHAPE)
    return root, one, sharded


def copy(base, tmp_path, which="one"):
    root, one, sharded = base
    d = str(tmp_path / "m")
    shutil.copytree(one if which == "one" else sharded, d)
    return d


def read_st(path):
    f = _File(path)
    header, start = dict(f.header), f.data_start
    f.close()
    data = Path(path).read_bytes()[start:]
    return header, data


def write_st(path, header, data: bytes):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def edit_header(d, fn):
    p = os.path.join(d, ST)
    h, data = read_st(p)
    fn(h)      # changes h in place
    write_st(p, h, data)


def edit_config(d, **kw):
    p = os.path.join(d, "config.json")
    c = json.loads(Path(p).read_text())
    c.update(kw)
    with open(p, "w") as f:
        f.write(json.dumps(c))     # json writes inf / nan as Infinity / NaN, as a hostile file would


def poison(d, name, value=np.nan, where=slice(None)):
    p = os.path.join(d, ST)
    h, data = read_st(p)
    b, e = h[name]["data_offsets"]
    a = np.frombuffer(data[b:e], np.float32).copy()
    a[where] = value
    write_st(p, h, data[:b] + a.tobytes() + data[e:])


def refused(d, *words):
    """open_model + Model + a few embedding rows: a CheckpointError of one line holding `words`."""
    with pytest.raises(CheckpointError) as e:
        src = open_model(d, progress=False)
        m = Model(src, progress=False)
        try:
            m.embed(np.arange(SHAPE["vocab_size"]))
        finally:
            m.close()
    msg = str(e.value)
    assert "\n" not in msg and msg, msg
    assert all(w in msg for w in words), msg
    return msg


def test_the_undamaged_model_loads(base, tmp_path):
    d = copy(base, tmp_path)
    m = Model(open_model(d, progress=False), progress=False)
    assert m.embed([0, 299]).shape == (2, 32)
    m.close()


def test_truncation_at_every_structural_boundary(base, tmp_path):
    d = copy(base, tmp_path)
    p = os.path.join(d, ST)
    whole = Path(p).read_bytes()
    (hlen,) = struct.unpack("<Q", whole[:8])
    h, _ = read_st(p)
    cuts = {0, 4, 7, 8, 9, 8 + hlen // 2, 8 + hlen - 1, 8 + hlen, len(whole) - 1}
    for name, m in h.items():
        if name != "__metadata__":
            b, e = m["data_offsets"]
            cuts |= {8 + hlen + b, 8 + hlen + b + 1, 8 + hlen + e - 1}
    cuts = sorted(c for c in cuts if c < len(whole))
    assert len(cuts) > 40
    for cut in cuts:
        with open(p, "wb") as f:
            f.write(whole[:cut])
        msg = refused(d)
        assert "truncated" in msg or "malformed" in msg, (cut, msg)


ENTRY_CASES = {
    "offsets_string": ({"data_offsets": "0,10"}, "data_offsets"),
    "offsets_one": ({"data_offsets": [0]}, "data_offsets"),
    "offsets_three": ({"data_offsets": [0, 1, 2]}, "data_offsets"),
    "offsets_floats": ({"data_offsets": [0.0, 4096.0]}, "data_offsets"),
    "offsets_bools": ({"data_offsets": [False, True]}, "data_offsets"),
    "offsets_null": ({"data_offsets": None}, "data_offsets"),
    "offsets_before_data": ({"data_offsets": [-64, 4032]}, "non-negative"),
    "offsets_reversed": ({"data_offsets": [4096, 0]}, "before the start"),
    "offsets_past_end": ({"data_offsets": [1 << 40, (1 << 40) + 4096]}, "truncated"),
    "shape_int": ({"shape": 5}, "shape"),
    "shape_string": ({"shape": "2,16,32"}, "shape"),
    "shape_negative": ({"shape": [2, -16, -32]}, "shape"),
    "shape_floats": ({"shape": [2.0, 16.0, 32.0]}, "shape"),
    "shape_nested": ({"shape": [[2], 16, 32]}, "shape"),
    "shape_huge": ({"shape": [1 << 40, 1 << 40]}, "bytes for shape"),
    "shape_many_dims": ({"shape": [1] * 20}, "shape"),
    "dtype_unknown": ({"dtype": "F64"}, "dtype"),
    "dtype_int": ({"dtype": 4}, "dtype"),
    "dtype_lower": ({"dtype": "f32"}, "dtype"),
}


@pytest.mark.parametrize("case", sorted(ENTRY_CASES))
def test_header_entries_of_the_wrong_type_or_range(base, tmp_path, case):
    change, word = ENTRY_CASES[case]
    d = copy(base, tmp_path)
    edit_header(d, lambda h: h[T].update(change))
    assert T in refused(d, word) or word == "truncated"


def test_malformed_headers(base, tmp_path):
    d = copy(base, tmp_path)
    p = os.path.join(d, ST)
    h, data = read_st(p)
    for header, word in ((b"[1, 2]", "not a JSON object"), (b"not json", "malformed"), (b"\xff\xfe{}", "malformed"),
                         (b"[" * 100000 + b"]" * 100000, "malformed"), (b"{", "malformed"),
                         (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}', "twice"),
                         (json.dumps({"__metadata__": 5}).encode(), "__metadata__"),
                         (json.dumps({T: [1, 2]}).encode(), "malformed header entry"),
                         (json.dumps({T: {"dtype": "F32"}}).encode(), "malformed header entry")):
        write_st(p, header, data)
        refused(d, word)
    for hlen in (0, 1, 1 << 63, len(data) * 2):   # the length field itself
        with open(p, "wb") as f:
            f.write(struct.pack("<Q", hlen) + json.dumps(h).encode() + data)
        refused(d)


def test_overlapping_tensors_and_header_bytes_read_as_weights(base, tmp_path):
    d = copy(base, tmp_path)
    wo = T.replace("wq", "wo")      # the same number of bytes as wq
    edit_header(d, lambda h: h[wo].update(data_offsets=list(h[T]["data_offsets"])))
    refused(d, "overlap")
    d2 = str(tmp_path / "two")
    shutil.copytree(copy(base, tmp_path / "x"), d2)
    # the first tensor moved to offset 0 while another one is there already
    edit_header(d2, lambda h: h[T].update(data_offsets=[0, h[T]["data_offsets"][1] - h[T]["data_offsets"][0]]))
    refused(d2, "overlap")


def test_tensors_missing_unexplained_or_of_the_wrong_shape(base, tmp_path):
    d = copy(base, tmp_path)
    edit_header(d, lambda h: h.pop("model.layers.1.ffn_norm.weight"))
    refused(d, "model.layers.1.ffn_norm.weight", "missing")
    d = copy(base, tmp_path / "b")
    edit_header(d, lambda h: h.update(junk={"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}))
    refused(d, "junk", "not part of the model")
    d = copy(base, tmp_path / "c")
    edit_header(d, lambda h: h[T].update(shape=[2, 32, 16]))
    refused(d, T, "shape [2, 32, 16]", "[2, 16, 32]")


@pytest.mark.parametrize("name,where,word", [
    (T, slice(None), T),                                       # a NaN layer
    ("model.norm.weight", 3, "model.norm.weight"),              # one inf in a replicated scale
    ("lm_head.weight", slice(100, 101), "lm_head.weight"),
    ("model.tok_embeddings.weight", slice(0, 32), "model.tok_embeddings.weight"),      # row 0: at load
    ("model.tok_embeddings.weight", slice(32 * 17, 32 * 18), "row 17"),                # row 17: when read
])
def test_non_finite_weights_are_refused_with_the_tensor_name(base, tmp_path, name, where, word):
    d = copy(base, tmp_path)
    poison(d, name, np.inf if name == "model.norm.weight" else np.nan, where)
    refused(d, word, "non-finite")


CONFIG_CASES = {
    "fewer_layers_than_on_disk": (dict(num_hidden_layers=1), "num_hidden_layers=1"),
    "more_layers_than_on_disk": (dict(num_hidden_layers=3), "missing"),
    "delay_beyond_layers": (dict(broadcast_delay=1000), "broadcast_delay"),
    "delay_zero": (dict(broadcast_delay=0), "broadcast_delay"),
    "context_1e12": (dict(max_position_embeddings=10 ** 12), "max_position_embeddings"),
    "context_float": (dict(max_position_embeddings=256.5), "max_position_embeddings"),
    "norm_eps_inf": (dict(norm_eps=float("inf")), "norm_eps"),
    "norm_eps_nan": (dict(norm_eps=float("nan")), "norm_eps"),
    "norm_eps_zero": (dict(norm_eps=0), "norm_eps"),
    "norm_eps_string": (dict(norm_eps="1e-5"), "norm_eps"),
    "rope_theta_negative": (dict(rope_theta=-1.0), "rope_theta"),
    "rope_theta_inf": (dict(rope_theta=float("inf")), "rope_theta"),
    "vocab_1e9": (dict(vocab_size=10 ** 9), "vocab_size"),
    "hidden_string": (dict(hidden_size="32"), "hidden_size"),
    "hidden_huge": (dict(hidden_size=1 << 30), "hidden_size"),
    "hidden_odd": (dict(hidden_size=33), "hidden_size"),
    "heads_zero": (dict(num_attention_heads=0), "num_attention_heads"),
    "kv_heads_3": (dict(num_key_value_heads=3), "num_key_value_heads"),
    "ffn_huge": (dict(intermediate_size=10 ** 8), "intermediate_size"),
    "lanes_3": (dict(num_lanes=3), "num_lanes"),
    "window_zero": (dict(sliding_window=0), "sliding_window"),
    "window_huge": (dict(sliding_window=10 ** 30), "sliding_window"),
    "window_layers_99": (dict(sliding_window=8, sliding_window_n_layers=99), "sliding_window_n_layers"),
    "eos_outside": (dict(eos_token_id=10 ** 6), "eos_token_id"),
    "eos_string": (dict(eos_token_id="2"), "eos_token_id"),
    "head_dim_disagrees": (dict(head_dim=7), "head_dim"),
    "head_dim_odd": (dict(head_dim_override=7), "head_dim"),
    "rope_scaling_string": (dict(rope_scaling="yes"), "rope_scaling"),
    "rope_scaling_inf": (dict(rope_scaling={"rope_type": "llama3", "factor": float("inf"), "low_freq_factor": 1,
                                            "high_freq_factor": 4, "original_max_position_embeddings": 64}),
                         "factor"),
    "model_type_int": (dict(model_type=5), "model_type"),
    "model_type_gpt2": (dict(model_type="gpt2"), "gpt2"),
    "flag_string": (dict(use_comm="yes"), "use_comm"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_values_checked_against_each_other_and_limits(base, tmp_path, case):
    change, word = CONFIG_CASES[case]
    d = copy(base, tmp_path)
    edit_config(d, **change)
    refused(d, word)


def test_config_files_that_are_not_json_objects(base, tmp_path):
    d = copy(base, tmp_path)
    p = os.path.join(d, "config.json")
    for text in (b"[]", b"{", b"\xff\xfe", b"[" * 100000, b"5"):
        Path(p).write_bytes(text)
        refused(d, "config.json")


def test_context_whose_kv_cache_cannot_fit_is_refused_saying_so():
    cfg = LaneformerConfig.from_dict(dict(SHAPE, model_type="laneformer_tp", max_position_embeddings=1 << 24))
    with pytest.raises(ValueError) as e:
        check_context_fits(cfg, memory=1 << 30)
    assert "GiB of KV cache" in str(e.value) and "--max-seq" in str(e.value)
    assert check_context_fits(cfg, max_seq=1000, memory=1 << 30) == 1000


def test_weight_map_outside_the_model_directory_is_refused_without_opening(base, tmp_path):
    d = copy(base, tmp_path, "sharded")
    index = os.path.join(d, "model.safetensors.index.json")
    idx = json.loads(Path(index).read_text())
    shard = sorted(set(idx["weight_map"].values()))[0]
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(os.path.join(d, shard), outside / shard)     # a valid shard: opening it would work
    size = os.path.getsize(outside / shard)
    for where in (str(outside / shard), f"../outside/{shard}", f"sub/../../outside/{shard}", "~/x.safetensors",
                  "/etc/passwd", "/nonexistent/x.safetensors"):
        i2 = dict(idx, weight_map={k: (where if v == shard else v) for k, v in idx["weight_map"].items()})
        Path(index).write_text(json.dumps(i2))
        msg = refused(d, "outside the model directory")
        assert str(size) not in msg and "No such file" not in msg and "bytes" not in msg, msg
    for wmap, word in ((["a"], "weight_map"), ({T: 5}, "not a file name"), ({T: ""}, "not a file name"),
                       ({**idx["weight_map"], T: sorted(set(idx["weight_map"].values()))[1 - (idx["weight_map"][T]
                         == sorted(set(idx["weight_map"].values()))[1])]}, "does not hold it")):
        Path(index).write_text(json.dumps(dict(idx, weight_map=wmap)))
        refused(d, word)
    Path(index).write_text("{")
    refused(d, "malformed")


def test_hugging_face_directories(tmp_path):
    c = tiny_hf_config()
    t = random_hf_tensors(c, 1)

    def hf(name, cfg=c, tensors=t, shards=2):
        return write_hf_dir(str(tmp_path / name), cfg, tensors, shards)

    d = hf("outside")
    index = os.path.join(d, "model.safetensors.index.json")
    idx = json.loads(Path(index).read_text())
    first = sorted(set(idx["weight_map"].values()))[0]
    shutil.copy(os.path.join(d, first), tmp_path / "elsewhere.safetensors")
    idx["weight_map"] = {k: (str(tmp_path / "elsewhere.safetensors") if v == first else v)
                         for k, v in idx["weight_map"].items()}
    Path(index).write_text(json.dumps(idx))
    refused(d, "outside the model directory")
    d = hf("cut")
    p = os.path.join(d, first)
    data = Path(p).read_bytes()
    Path(p).write_bytes(data[:len(data) // 2])
    refused(d, first)
    d = hf("header")      # safetensors' own parser (safe_open) meets a header entry of the wrong type
    p = os.path.join(d, first)
    h, data = read_st(p)
    next(m for k, m in h.items() if k != "__metadata__")["data_offsets"] = "0,10"
    write_st(p, h, data)
    refused(d, first)
    t2 = dict(t)
    t2["model.layers.1.mlp.down_proj.weight"] = np.full_like(t["model.layers.1.mlp.down_proj.weight"], np.nan)
    refused(hf("nan", tensors=t2), "model.layers.1.feed_forward.w2.weight", "non-finite")
    refused(hf("layers", cfg=dict(c, num_hidden_layers=2)), "model.layers.2")
    refused(hf("eps", cfg=dict(c, rms_norm_eps=float("inf"))), "norm_eps")
    refused(hf("ctx", cfg=dict(c, max_position_embeddings=10 ** 12)), "max_position_embeddings")
    refused(hf("hd", cfg=dict(c, num_hidden_layers="3")), "num_hidden_layers")


# -- the real commands ----------------------------------------------------------------------------------

def kog(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "kog_cli", *args], capture_output=True, text=True, timeout=timeout)


def one_line_error(r, *words):
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kog: error:"), r.stderr
    assert all(w in lines[0] for w in words), r.stderr


def test_cli_generate_refuses_damaged_files_in_one_line(base, tmp_path):
    d = copy(base, tmp_path)
    edit_header(d, lambda h: h[T].update(shape="2,16,32"))
    one_line_error(kog("generate", "--model", d, "--prompt-ids", "1,2", "-n", "2", "--backend", "cpu"), T, "shape")
    d = copy(base, tmp_path / "nan")
    poison(d, T)
    one_line_error(kog("generate", "--model", d, "--prompt-ids", "1,2", "-n", "2", "--backend", "cpu"),
                   T, "non-finite")


def test_np2_job_says_a_damaged_weight_once(base, tmp_path):
    """Both ranks read the replicated final norm: the error comes once (from rank 0), not per rank."""
    if shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec on this machine")
    d = copy(base, tmp_path)
    poison(d, "model.norm.weight", np.inf, 0)
    r = kog("generate", "--model", d, "--prompt-ids", "1,2", "-n", "2", "--backend", "cpu", "--np", "2")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("model.norm.weight holds non-finite values") == 1, r.stderr


def test_worker_ranks_say_a_bad_file_once(base, tmp_path):
    """kog-worker under mpiexec: rank 0 opens and validates the model first; the error comes once."""
    from mpi_helpers import have_mpiexec, run_mpi
    if not have_mpiexec():
        pytest.skip("no mpiexec on this machine")
    d = copy(base, tmp_path)
    edit_header(d, lambda h: h[T].update(data_offsets="0,10"))
    r = run_mpi(2, code="import sys; from workers.__main__ import main; sys.exit(main(sys.argv[1:]))",
                args=["--model", d, "--bind", "none", "--backend", "cpu"], timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count(f"tensor {T} has data_offsets") == 1, r.stderr
    assert "kog-worker: error: rank 0:" in r.stderr


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_finite_check_on_storage_bits_catches_a_nan_layer_when_sampled(dtype):
    from kog_dist.checkpoint import bf16_bits, check_finite_bits
    a = np.random.default_rng(0).standard_normal((2, 40, 16)).astype(np.float32)
    store = {"F32": lambda x: x, "F16": lambda x: x.astype(np.float16), "BF16": bf16_bits}[dtype]
    assert check_finite_bits("w", store(a), dtype, sample=8) is not None
    a[1] = np.nan                                   # lane 1 all NaN: every sample of it sees one
    with pytest.raises(CheckpointError, match="tensor w holds non-finite"):
        check_finite_bits("w", store(a), dtype, sample=8)
    a = np.ones((4, 16), np.float32)
    a[2, 3] = np.inf
    with pytest.raises(CheckpointError, match="row 2"):
        check_finite_bits("w", store(a), dtype)     # the full check finds a single value


TOKENIZER_FILES = {
    "tokenizer_json_garbage": ("tokenizer.json", b"{not json", "tokenizer.json"),
    "tokenizer_json_deep": ("tokenizer.json", b"[" * 100000, "tokenizer.json"),
    "tokenizer_config_list": ("tokenizer_config.json", b"[1, 2]", "tokenizer_config.json"),
    "tokenizer_config_deep": ("tokenizer_config.json", b"[" * 100000, "tokenizer_config.json"),
    "tokenizer_config_bad_utf8": ("tokenizer_config.json", b'{"a": "\xff"}', "tokenizer_config.json"),
    "template_json_deep": ("chat_template.json", b"[" * 100000, "chat_template.json"),
    "template_json_int": ("chat_template.json", b'{"chat_template": 5}', "chat_template"),
    "template_jinja_bad_utf8": ("chat_template.jinja", b"{{ '\xff' }}", "chat_template.jinja"),
    "generation_config_deep": ("generation_config.json", b"{" * 100000, "generation_config.json"),
}


@pytest.mark.parametrize("case", sorted(TOKENIZER_FILES))
def test_tokenizer_files_that_are_damaged(base, tmp_path, case):
    from kog_dist.tokenizer import load_tokenizer
    from tokenizers import Tokenizer, models
    fname, content, word = TOKENIZER_FILES[case]
    d = copy(base, tmp_path)
    Tokenizer(models.BPE({"a": 0, "b": 1}, [])).save(os.path.join(d, "tokenizer.json"))
    Path(d, fname).write_bytes(content)
    with pytest.raises(ValueError) as e:
        load_tokenizer(open_model(d, progress=False)).apply_chat_template([{"role": "user", "content": "a"}])
    assert "\n" not in str(e.value) and word in str(e.value), str(e.value)


def test_tokenizer_larger_than_the_vocabulary(base, tmp_path):
    from kog_dist.tokenizer import load_tokenizer
    from tokenizers import Tokenizer, models
    d = copy(base, tmp_path)
    Tokenizer(models.BPE({f"t{i}": i for i in range(400)}, [])).save(os.path.join(d, "tokenizer.json"))
    with pytest.raises(ValueError, match="400 tokens but the model's vocabulary has 300"):
        load_tokenizer(open_model(d, progress=False))
