"""Tokenizers: a checkpoint's tokenizer.json through the `tokenizers` package, else bytes; bos, eos and
add_bos from the checkpoint's own files; chat templates beside it; streaming without split characters."""
import json
import subprocess
import sys
import types

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kog_dist.config import LaneformerConfig
from kog_dist.textstream import TextStream
from kog_dist.tiny import write_tiny_checkpoint
from kog_dist.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

CORPUS = ["the cat sat on the mat"] * 50 + ["hello world, hello kog"] * 50 + ["héllo 日本語 🎉 naïve"] * 20


def test_byte_fallback_round_trip():
    tok = ByteTokenizer(LaneformerConfig(vocab_size=512, bos_token_id=1, eos_token_id=2))
    ids = tok.encode("héllo")
    assert ids[0] == 1 and ids[1] == ord("h") + 3
    assert tok.decode(ids) == "héllo"
    assert tok.encode("hi", add_bos=False) == [ord("h") + 3, ord("i") + 3]
    st = tok.stream()
    pieces = [st.step(i) for i in tok.encode("é🎉", add_bos=False)]
    assert pieces == ["", "é", "", "", "", "🎉"]
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def _whitespace_bpe(d):
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(CORPUS[:100], trainers.BpeTrainer(vocab_size=120, special_tokens=["<s>", "</s>", "<unk>"]))
    tk.save(f"{d}/tokenizer.json")
    return tk


def test_tokenizer_json_is_used(tmp_path):
    d = str(tmp_path)
    write_tiny_checkpoint(d, vocab_size=300, num_lanes=2, bos_token_id=0, eos_token_id=1)
    tk = _whitespace_bpe(d)
    cfg = LaneformerConfig(vocab_size=300, num_lanes=2, bos_token_id=0, eos_token_id=1)
    tok = load_tokenizer(d, cfg)
    assert isinstance(tok, HFTokenizer)
    # no tokenizer_config.json and no post-processor: the tokenizer adds no bos of its own
    assert tok.add_bos is False and tok.bos_id == 0 and tok.eos_ids == (1,)
    ids = tok.encode("hello world")
    assert ids[0] != 0 and tk.decode(ids) == "hello world"
    assert len(ids) < len("hello world")                 # real merges, not bytes
    assert tok.encode("hello world", add_bos=True) == [0] + ids
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    tok = load_tokenizer(d, cfg)
    assert tok.add_bos and tok.encode("hello world") == [0] + ids
    r = subprocess.run([sys.executable, "-m", "kog_cli", "generate", "--model", d, "--prompt",
                        "the cat", "-n", "4", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] == len(tok.encode("the cat"))
    assert out["text"] == tk.decode(out["token_ids"], skip_special_tokens=True)


def _byte_level_bpe(d, post_bos=False):
    """A ChatML-style byte-level BPE: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if post_bos:
        tk.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                          special_tokens=[("<|endoftext|>", 0)])
    tk.save(f"{d}/tokenizer.json")
    return tk


def _hf(d, vocab_size=512, **cfg):
    return types.SimpleNamespace(kind="hf", cfg=LaneformerConfig(vocab_size=vocab_size, **cfg), model_dir=str(d),
                                 gguf_fields={})


CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_hf_directory_settings(tmp_path):
    _byte_level_bpe(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>",
        "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = load_tokenizer(_hf(tmp_path))
    assert tok.bos_id == 1 and tok.add_bos is False and tok.vocab_size == 512
    assert tok.eos_ids == (2, 7, 0)           # eos, generation_config's, then <|endoftext|> (end of text)
    msgs = [{"role": "user", "content": "héllo 🎉"}]
    text = tok.apply_chat_template(msgs)
    assert text == "<|im_start|>user\nhéllo 🎉<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1   # special tokens as single ids
    assert tok.encode_chat(msgs) == ids
    assert tok.decode(ids) == "user\nhéllo 🎉\nassistant\n"
    assert tok.decode(ids, skip_special=False) == text
    assert tok.decode(ids + [450, 511]) == tok.decode(ids)           # padding rows past the tokenizer
    with pytest.raises(ValueError, match="message 0 has role 'robot'"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_hf_add_bos_from_post_processor(tmp_path):
    _byte_level_bpe(tmp_path, post_bos=True)
    tok = load_tokenizer(_hf(tmp_path))
    assert tok.add_bos and tok.bos_id == 0 and not tok.has_chat_template
    ids = tok.encode("hello")
    assert ids[0] == 0 and ids.count(0) == 1
    assert tok.encode("<|endoftext|>hello") == ids                    # a bos in the text is not doubled
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    assert load_tokenizer(_hf(tmp_path)).encode("hello") == ids[1:]   # tokenizer_config.json decides


def test_hf_stream_and_textstream(tmp_path):
    _byte_level_bpe(tmp_path)
    tok = load_tokenizer(_hf(tmp_path, eos_token_id=2))
    s = "héllo 日本語 🎉 the cat"
    ids = tok.encode(s)
    assert len(ids) < len(s.encode())                                # merged, not single bytes
    st = tok.stream()
    pieces = [st.step(i) for i in ids]
    assert "".join(pieces) == s and all("\ufffd" not in p for p in pieces)
    ts = TextStream(tok, ["cat", "日本"], {2})
    got = []
    for i in ids + [2]:
        done = ts.feed(i)
        got.append(ts.take())
        if done:
            break
    assert "".join(got) == "héllo " and all("日" not in g for g in got)
    # nothing released past a possible stop prefix; terminal ids add no text
    ts = TextStream(tok, ["zz"], {2})
    for i in tok.encode("the caz") + [2]:
        ts.feed(i)
    assert ts.take() == "the ca" and ts.text == "the caz"


def test_textstream_with_a_decode_only_tokenizer():
    class Letters:                                   # no stream(): the window decoder is used
        def decode(self, ids):
            return "".join(chr(97 + i) for i in ids)
    ts = TextStream(Letters(), ["cd"], {25})
    out = ""
    for i in [0, 1, 2, 25, 3, 4]:
        done = ts.feed(i)
        out += ts.take()
        if done:
            break
    assert out == "ab" and ts.hit == 2


def test_bad_hf_tokenizers_are_refused(tmp_path):
    _byte_level_bpe(tmp_path)
    with pytest.raises(ValueError, match="tokenizer has 305 tokens but the model.s vocabulary has 300"):
        load_tokenizer(_hf(tmp_path, vocab_size=300))     # trained to 305 (small corpus)
    (tmp_path / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        load_tokenizer(_hf(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    tok = load_tokenizer(_hf(tmp_path))
    with pytest.raises(ValueError, match="does not compile") as e:
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert "\n" not in str(e.value)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(_hf(tmp_path))
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        load_tokenizer(_hf(tmp_path))
    lane = types.SimpleNamespace(kind="laneformer", cfg=LaneformerConfig(vocab_size=300), model_dir=str(tmp_path))
    assert isinstance(load_tokenizer(lane), ByteTokenizer)


def test_coordinator_follows_the_tokenizers_add_bos(tmp_path):
    """A text prompt gets bos only where the tokenizer says so (SmolLM2 does not), unless asked."""
    from kog_dist.client import Client
    from test_control_helpers import Server
    from workers.factory import make_backend
    d = str(tmp_path)
    write_tiny_checkpoint(d, seed=1, num_hidden_layers=1, hidden_size=32, num_lanes=1, num_attention_heads=2,
                          num_key_value_heads=2, intermediate_size=64, vocab_size=512, bos_token_id=0,
                          eos_token_id=2)
    _byte_level_bpe(d)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    backend, cfg = make_backend("cpu", d, num_slots=1, progress=False)
    tok = load_tokenizer(d, cfg)
    n = len(tok.encode("hello world"))
    with Server(backend, tok, cfg) as srv, Client(srv.endpoint, timeout=10) as c:
        assert c.generate(prompt="hello world", max_new_tokens=1).stats["prefill_tokens"] == n
        assert c.generate(prompt="hello world", max_new_tokens=1, add_bos=True).stats["prefill_tokens"] == n + 1


def test_path_form(tmp_path):
    """load_tokenizer(path, cfg): a Laneformer or Hugging Face directory; a file needs its source."""
    cfg = LaneformerConfig(vocab_size=512)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="has no tokenizer.json"):         # HF: no byte fallback
        load_tokenizer(str(tmp_path), cfg)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "laneformer_tp"}))
    assert isinstance(load_tokenizer(str(tmp_path), cfg), ByteTokenizer)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="open_model"):
        load_tokenizer(str(tmp_path / "m.gguf"), cfg)


def test_qwen2_style_null_bos(tmp_path):
    """bos_token null in tokenizer_config.json (Qwen2): the config's bos id is kept for the coordinator,
    never added, and a template's {{ bos_token }} renders empty as in transformers."""
    _byte_level_bpe(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}"}))
    tok = load_tokenizer(_hf(tmp_path, bos_token_id=0))
    assert tok.bos_id == 0 and not tok.add_bos and tok.eos_ids[0] == 2
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    assert tok.encode("hi")[0] != 0
