"""A tiny model with a tokenizer of its own, for structured-output tests that need no real model: a byte-level BPE
vocabulary trained (deterministically) on a few JSON lines, written as tokenizer.json beside a random one-lane
checkpoint, so kog_dist.tokenizer loads it and llguidance takes it."""
from __future__ import annotations

import json
import os

# whitespace_flexible off: a random model otherwise spends its tokens on the spaces JSON allows
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False}}
ONE_LANE = dict(num_lanes=1, broadcast_delay=1, num_hidden_layers=3, vocab_size=512, hidden_size=256,
                num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)


def write_tokenizer(d: str, vocab: int = 420) -> None:
    """tokenizer.json (byte-level BPE, <pad> <s> </s> at ids 0 1 2, as the tiny checkpoints' bos 1 / eos 2) and
    tokenizer_config.json into directory d."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    texts = [json.dumps({"name": n, "age": a, "ok": a % 2 == 0, "tags": [n[:3], "x"]})
             for n in ("alice", "bob", "carol", "dave", "eve", "mallory", "trent", "peggy") for a in range(40)]
    texts += ["The quick brown fox jumps over the lazy dog. " * 3, "name age city country true false null"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                                       show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>", "bos_token": "<s>"}, f)


def write_tiny_model(d: str, seed: int = 3, dtype: str = "F32", **over) -> str:
    """A random one-lane checkpoint (ONE_LANE, changed by `over`) with write_tokenizer's vocabulary in d."""
    from kog_dist.tiny import write_tiny_checkpoint
    write_tiny_checkpoint(d, dtype=dtype, seed=seed, **{**ONE_LANE, **over})
    write_tokenizer(d)
    return d
