"""Tokenizers: a checkpoint's tokenizer.json through the `tokenizers` package, else bytes."""
import json
import subprocess
import sys

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from kog_dist.config import LaneformerConfig
from kog_dist.tiny import write_tiny_checkpoint
from kog_dist.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_fallback_round_trip():
    tok = ByteTokenizer(LaneformerConfig(vocab_size=512, bos_token_id=1, eos_token_id=2))
    ids = tok.encode("héllo")
    assert ids[0] == 1 and ids[1] == ord("h") + 3
    assert tok.decode(ids) == "héllo"


def test_tokenizer_json_is_used(tmp_path):
    d = str(tmp_path)
    write_tiny_checkpoint(d, vocab_size=300, num_lanes=2, bos_token_id=0, eos_token_id=1)
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(["the cat sat on the mat"] * 50 + ["hello world, hello kog"] * 50,
                           trainers.BpeTrainer(vocab_size=120, special_tokens=["<s>", "</s>", "<unk>"]))
    tk.save(f"{d}/tokenizer.json")
    cfg = LaneformerConfig(vocab_size=300, num_lanes=2, bos_token_id=0, eos_token_id=1)
    tok = load_tokenizer(d, cfg)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("hello world")
    assert ids[0] == 0 and tk.decode(ids[1:]) == "hello world"
    assert len(ids) < 1 + len("hello world")             # real merges, not bytes
    r = subprocess.run([sys.executable, "-m", "kog_cli", "generate", "--model", d, "--prompt",
                        "the cat", "-n", "4", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] == len(tok.encode("the cat"))
    assert out["text"] == tk.decode(out["token_ids"], skip_special_tokens=True)
