"""Tokenizers: the checkpoint's tokenizer.json through the `tokenizers` package, or a byte-level
fallback for test models that have none (byte b is id b + 3, after <unk> 0, <s> 1, </s> 2, as the
byte tokens of Llama-2's vocabulary)."""
from __future__ import annotations

import os

from .config import LaneformerConfig

BYTE_OFFSET = 3


class ByteTokenizer:
    kind = "bytes"

    def __init__(self, cfg: LaneformerConfig):
        self.vocab_size = cfg.vocab_size
        self.bos_id = cfg.bos_token_ids[0] if cfg.bos_token_ids else 1
        self.eos_ids = cfg.eos_token_ids or (2,)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        if ids and max(ids) >= self.vocab_size:
            raise ValueError(f"this model's vocabulary ({self.vocab_size}) is too small for byte-level text; "
                             f"pass --prompt-ids instead")
        return ([self.bos_id] if add_bos else []) + ids

    def decode(self, ids) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    kind = "tokenizer.json"

    def __init__(self, path: str, cfg: LaneformerConfig):
        from tokenizers import Tokenizer
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the Rust error text is long; keep its first line
            raise ValueError(f"{path} is not a valid tokenizer.json: {str(e).splitlines()[0]}") from None
        self.vocab_size = cfg.vocab_size
        self.bos_id = cfg.bos_token_ids[0] if cfg.bos_token_ids else self._tok.token_to_id("<s>")
        self.eos_ids = cfg.eos_token_ids or tuple(i for i in [self._tok.token_to_id("</s>")] if i is not None)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(model_dir: str, cfg: LaneformerConfig):
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(path):
        return HFTokenizer(path, cfg)
    return ByteTokenizer(cfg)
