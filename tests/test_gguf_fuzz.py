"""Damaged GGUF files (issues 28 and 32): truncated at every structural boundary, bad tensor offsets,
unknown quantization types, unsupported architectures, metadata of the wrong types, tokenizers that do
not match the vocabulary, chat templates that fail to render, NaN weights: each a one-line error
(a ValueError: FormatError for the file, ValueError for its tokenizer), never a traceback."""
import os
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType as VT

from kog_dist.checkpoint import Model
from kog_dist.formats import open_model
from kog_dist.tokenizer import load_tokenizer

from hf_reference import gguf_name, random_hf_tensors, tiny_hf_config

C = tiny_hf_config()
V = C["vocab_size"]
TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"] + [f"▁t{i}" for i in range(V - 5)]
TYPES = [2, 3, 3, 3, 3] + [1] * (V - 5)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write(path, fields=None, drop=(), tensors=None, arch="llama", quant=None):
    """A tiny llama GGUF: `fields` {key: (value, type[, sub_type])} overriding the standard keys,
    `drop` keys left out, `tensors` {gguf name: array or (bytes array, qtype) or None (left out)}."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(C["num_hidden_layers"])
    w.add_context_length(C["max_position_embeddings"])
    w.add_embedding_length(C["hidden_size"])
    w.add_feed_forward_length(C["intermediate_size"])
    w.add_head_count(C["num_attention_heads"])
    w.add_head_count_kv(C["num_key_value_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_scores([-float(i) for i in range(V)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)
    for k, v in (fields or {}).items():
        w.add_key_value(k, *v)
    for k in drop:
        del w.kv_data[0][k]
    t = {gguf_name(n): a for n, a in random_hf_tensors(C, 0).items()}
    t.update(tensors or {})
    for name, a in t.items():
        if a is None:
            continue
        if isinstance(a, tuple):
            w.add_tensor(name, a[0], raw_dtype=a[1])
        elif quant and a.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(a, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, np.asarray(a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write(str(tmp_path_factory.mktemp("gguf") / "good.gguf"))


def use(path, chat=True):
    """What a request does with a model: open, load, tokenize, render the chat template, embed."""
    src = open_model(path, progress=False)
    tok = load_tokenizer(src)
    m = Model(src, progress=False)
    try:
        ids = tok.encode("t1 t2")
        if chat:
            ids = tok.encode_chat([{"role": "user", "content": "t3"}])
        m.embed(ids)
    finally:
        m.close()
    return tok


def refused(path, *words, chat=True):
    with pytest.raises(ValueError) as e:
        use(path, chat)
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    assert all(w in msg for w in words), msg
    return msg


def test_the_undamaged_file_serves(good):
    tok = use(good)
    assert tok.vocab_size == V and tok.has_chat_template


def boundaries(path):
    r = GGUFReader(path)
    cuts = {0, 3, 4, 8, 16, 24}
    for f in r.fields.values():
        cuts |= {f.offset, f.offset + 1}
    for t in r.tensors:
        cuts |= {t.field.offset, t.field.offset + 4, int(t.data_offset), int(t.data_offset) + 1,
                 int(t.data_offset) + int(t.n_bytes) - 1}
    return sorted(cuts), r


def test_truncation_at_every_structural_boundary(good, tmp_path):
    data = Path(good).read_bytes()
    cuts, _ = boundaries(good)
    cuts = [c for c in cuts if c < len(data)]
    assert len(cuts) > 60
    p = str(tmp_path / "cut.gguf")
    for cut in cuts:
        with open(p, "wb") as f:
            f.write(data[:cut])
        msg = refused(p)
        assert "truncated" in msg or "not a GGUF file" in msg, (cut, msg)


def _patch(good, tmp_path, at, value: bytes, name="patched.gguf"):
    data = bytearray(Path(good).read_bytes())
    data[at:at + len(value)] = value
    p = str(tmp_path / name)
    Path(p).write_bytes(bytes(data))
    return p


def _tensor_info(good, name):
    """Offsets of a tensor's type and data-offset fields in the file (gguf's reader parts)."""
    r = GGUFReader(good)
    t = next(t for t in r.tensors if t.name == name)
    parts = t.field.parts       # name length, name, n_dims, dims, type, offset
    type_at = t.field.offset + sum(p.nbytes for p in parts[:4])
    return type_at, type_at + parts[4].nbytes, r


def test_bad_tensor_offsets_and_types(good, tmp_path):
    type_at, off_at, r = _tensor_info(good, "blk.1.attn_q.weight")
    refused(_patch(good, tmp_path, off_at, struct.pack("<Q", 1 << 40)), "truncated")
    other = next(t for t in r.tensors if t.name == "blk.1.attn_output.weight")
    rel = int(other.data_offset) - r.data_offset
    refused(_patch(good, tmp_path, off_at, struct.pack("<Q", rel)), "overlap")
    refused(_patch(good, tmp_path, type_at, struct.pack("<I", 99)), "unknown GGML type", "99", "Q8_0")
    refused(_patch(good, tmp_path, type_at, struct.pack("<I", int(Q.F16))))        # a type of another size
    # a type GGML has but this runtime does not dequantize (gguf cannot: Q8_1 is ggml's scratch type;
    # the i-quants load dequantized), named with those it does
    bs, ts = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    q81 = np.zeros((C["intermediate_size"], C["hidden_size"] // bs * ts), np.uint8)
    p = write(str(tmp_path / "q81.gguf"), tensors={"blk.0.ffn_up.weight": (q81, Q.Q8_1)})
    refused(p, "blk.0.ffn_up.weight", "Q8_1", "Q8_0", "IQ4_NL")


def test_counts_and_lengths_out_of_range(good, tmp_path):
    refused(_patch(good, tmp_path, 8, struct.pack("<Q", 1 << 60)))     # tensor count
    refused(_patch(good, tmp_path, 16, struct.pack("<Q", 1 << 60)))    # key-value count
    _, r = boundaries(good)
    f = r.fields["general.architecture"]
    refused(_patch(good, tmp_path, f.offset, struct.pack("<Q", 1 << 50)))   # a key's length


@pytest.mark.parametrize("arch", ["qwen2", "gpt2", ""])
def test_unsupported_architecture(tmp_path, arch):
    refused(write(str(tmp_path / "a.gguf"), arch=arch), "architecture", "llama")


def test_architecture_of_the_wrong_type(tmp_path):
    p = write(str(tmp_path / "a.gguf"), fields={"general.architecture": (7, VT.UINT32)})
    refused(p, "architecture")


WRONG_TYPES = {
    "block_count_string": ({"llama.block_count": ("three", VT.STRING)}, "llama.block_count"),
    "block_count_float": ({"llama.block_count": (3.0, VT.FLOAT32)}, "llama.block_count"),
    "embedding_array": ({"llama.embedding_length": ([64], VT.ARRAY, VT.UINT32)}, "llama.embedding_length"),
    "heads_bool": ({"llama.attention.head_count": (True, VT.BOOL)}, "head_count"),
    "context_1e12": ({"llama.context_length": (10 ** 12, VT.UINT64)}, "max_position_embeddings"),
    "eps_string": ({"llama.attention.layer_norm_rms_epsilon": ("1e-5", VT.STRING)}, "layer_norm_rms_epsilon"),
    "eps_nan": ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), VT.FLOAT32)}, "norm_eps"),
    "eps_inf": ({"llama.attention.layer_norm_rms_epsilon": (float("inf"), VT.FLOAT32)}, "norm_eps"),
    "theta_negative": ({"llama.rope.freq_base": (-1.0, VT.FLOAT32)}, "rope_theta"),
    "theta_array": ({"llama.rope.freq_base": ([1.0], VT.ARRAY, VT.FLOAT32)}, "freq_base"),
    "kv_heads_3": ({"llama.attention.head_count_kv": (3, VT.UINT32)}, "num_key_value_heads"),
    "scaling_int": ({"llama.rope.scaling.type": (1, VT.UINT32)}, "scaling.type"),
    "vocab_size_disagrees": ({"llama.vocab_size": (V + 1, VT.UINT32)}, "vocab_size"),
    "tokens_ints": ({"tokenizer.ggml.tokens": (list(range(V)), VT.ARRAY, VT.UINT32)}, "tokenizer.ggml.tokens"),
    "tokens_string": ({"tokenizer.ggml.tokens": ("abc", VT.STRING)}, "tokenizer.ggml.tokens"),
    "bos_string": ({"tokenizer.ggml.bos_token_id": ("1", VT.STRING)}, "bos_token_id"),
    "bos_outside": ({"tokenizer.ggml.bos_token_id": (10 ** 6, VT.UINT32)}, "bos_token_id"),
    "expert_string": ({"llama.expert_count": ("8", VT.STRING)}, "expert_count"),
    # the tokenizer's own fields
    "tokenizer_model_int": ({"tokenizer.ggml.model": (3, VT.UINT32)}, "tokenizer"),
    "tokenizer_model_unknown": ({"tokenizer.ggml.model": ("bert", VT.STRING)}, "bert"),
    "types_short": ({"tokenizer.ggml.token_type": ([1, 1], VT.ARRAY, VT.INT32)}, "token types"),
    "types_string": ({"tokenizer.ggml.token_type": ("x", VT.STRING)}, "token_type"),
    "scores_short": ({"tokenizer.ggml.scores": ([0.0], VT.ARRAY, VT.FLOAT32)}, "scores"),
    "scores_string": ({"tokenizer.ggml.scores": ("x", VT.STRING)}, "scores"),
    "gpt2_without_merges": ({"tokenizer.ggml.model": ("gpt2", VT.STRING)}, "merges"),
    "gpt2_merges_ints": ({"tokenizer.ggml.model": ("gpt2", VT.STRING),
                          "tokenizer.ggml.merges": ([1, 2], VT.ARRAY, VT.UINT32)}, "merge"),
    "add_bos_string": ({"tokenizer.ggml.add_bos_token": ("yes", VT.STRING)}, "add_bos_token"),
    "template_int": ({"tokenizer.chat_template": (5, VT.UINT32)}, "chat_template"),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_metadata_of_the_wrong_type(tmp_path, case):
    fields, word = WRONG_TYPES[case]
    refused(write(str(tmp_path / "m.gguf"), fields=fields), word)


@pytest.mark.parametrize("key", ["llama.block_count", "llama.embedding_length", "llama.attention.head_count",
                                 "llama.feed_forward_length", "tokenizer.ggml.tokens"])
def test_required_metadata_missing(tmp_path, key):
    refused(write(str(tmp_path / "m.gguf"), drop=[key]), key.split(".")[-1] if "tokens" not in key else "")


def test_tokenizer_that_does_not_match_the_vocabulary(tmp_path):
    # more tokens than embedding rows: the embedding's shape disagrees with the vocabulary
    p = write(str(tmp_path / "more.gguf"), fields={"tokenizer.ggml.tokens": (TOKENS + ["▁x"], VT.ARRAY, VT.STRING),
                                                   "tokenizer.ggml.token_type": (TYPES + [1], VT.ARRAY, VT.INT32),
                                                   "tokenizer.ggml.scores": ([0.0] * (V + 1), VT.ARRAY,
                                                                             VT.FLOAT32)})
    refused(p, "token_embd.weight", "shape")
    # a vocabulary given by llama.vocab_size alone, and tokens of another size
    p = write(str(tmp_path / "fewer.gguf"), fields={"llama.vocab_size": (V - 1, VT.UINT32)})
    refused(p, "vocab_size")


@pytest.mark.parametrize("template,word", [
    ("{{ raise_exception('this template needs a system message') }}", "needs a system message"),
    ("{% for m in messages %}{{ m.content", "does not compile"),
    ("{{ messages[5]['content'] }}", "failed to render"),
    ("{{ ''.__class__.__mro__ }}", "chat template"),
    ("{{ messages | map(attribute='x') | sum }}", "failed to render"),
])
def test_chat_template_that_fails_to_render_says_so_at_first_use(tmp_path, template, word):
    p = write(str(tmp_path / "t.gguf"), fields={"tokenizer.chat_template": (template, VT.STRING)})
    use(p, chat=False)      # the model itself serves raw prompts
    refused(p, word)


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")     # gguf's dequantizer meets the inf scale
def test_non_finite_weights(tmp_path):
    t = random_hf_tensors(C, 0)
    bad = t["model.layers.2.mlp.down_proj.weight"].copy()
    bad[3, 7] = np.nan
    refused(write(str(tmp_path / "f32.gguf"), tensors={"blk.2.ffn_down.weight": bad}), "feed_forward.w2", "non-finite")
    q = gguf.quants.quantize(t["model.layers.0.self_attn.q_proj.weight"], Q.Q8_0)
    q[0, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)      # one block's scale
    refused(write(str(tmp_path / "q8.gguf"), tensors={"blk.0.attn_q.weight": (q, Q.Q8_0)}), "attention.wq", "non-finite")


def test_duplicate_and_unexplained_tensors(good, tmp_path):
    extra = np.zeros(C["hidden_size"], np.float32)
    refused(write(str(tmp_path / "x.gguf"), tensors={"blk.9.attn_norm.weight": extra}), "blk.9.attn_norm.weight")
    refused(write(str(tmp_path / "y.gguf"), tensors={"blk.1.attn_norm.weight": None}), "blk.1.attn_norm.weight",
            "missing")


# -- the real command ------------------------------------------------------------------------------------

def kog(*args):
    return subprocess.run([sys.executable, "-m", "kog_cli", *args], capture_output=True, text=True, timeout=60)


def one_line(r, *words):
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kog: error:"), r.stderr
    assert all(w in lines[0] for w in words), r.stderr


def test_cli_refuses_in_one_line(good, tmp_path):
    data = Path(good).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) // 2])
    one_line(kog("generate", "--model", str(cut), "--prompt-ids", "1,2", "-n", "2", "--backend", "cpu"), "truncated")
    p = write(str(tmp_path / "t.gguf"), fields={"tokenizer.chat_template": ("{{ raise_exception('no') }}", VT.STRING)})
    one_line(kog("generate", "--model", p, "--prompt", "t1", "-n", "2", "--backend", "cpu"), "chat template", "no")
