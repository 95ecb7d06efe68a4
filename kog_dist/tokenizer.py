"""Tokenizers of a model source (`kog_dist.formats.open_model`): a Hugging Face / Laneformer directory's
tokenizer.json, a GGUF file's tokenizer.ggml.* vocabulary rebuilt with the `tokenizers` package (gpt2
byte-level BPE from merges; llama SentencePiece-style vocabulary with scores and byte fallback), or a
byte-level fallback for test models that have none (byte b is id b + 3, after <unk> 0, <s> 1, </s> 2,
as the byte tokens of Llama-2's vocabulary).

Every tokenizer has: encode(text, add_bos=None), decode(ids, skip_special=True), stream(), bos_id,
eos_ids, vocab_size, add_bos, chat_template, has_chat_template, apply_chat_template(messages, ...),
encode_chat(messages, ...). Special tokens written in the text ("<|im_start|>") encode as their ids."""
from __future__ import annotations

import codecs
import json
import numbers
import os
from types import SimpleNamespace

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.decoders import DecodeStream

from .chat_template import ChatTemplate, find_template
from .config import LaneformerConfig

BYTE_OFFSET = 3

# Tokens that end a turn or a document in the chat models people run; each one the vocabulary holds
# stops generation, whatever its token type, as in llama.cpp's end-of-generation set.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>",
               "<end_of_turn>", "<|end▁of▁sentence|>", "<|return|>")

# Pre-tokenizer split patterns of byte-level BPE vocabularies, by GGUF tokenizer.ggml.pre (the regexes
# of the models' own tokenizer.json, which llama.cpp's llama-vocab.cpp transcribes).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_PRE = {"llama-bpe": _LLAMA3, "llama3": _LLAMA3, "dbrx": _LLAMA3, "smaug-bpe": _LLAMA3,
              "qwen2": _QWEN2, "stablelm2": _QWEN2}
# GPT-2's regex after single digits split off (StarCoder's family, SmolLM's among them).
_DIGITS_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
# GGUF token_type values (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


class ByteTokenizer:
    kind = "bytes"
    chat_template = None
    has_chat_template = False
    add_bos = True

    def __init__(self, cfg: LaneformerConfig):
        self.vocab_size = cfg.vocab_size
        self.bos_id = cfg.bos_token_ids[0] if cfg.bos_token_ids else 1
        self.eos_ids = tuple(cfg.eos_token_ids or (2,))

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        if ids and max(ids) >= self.vocab_size:
            raise ValueError(f"this model's vocabulary ({self.vocab_size}) is too small for byte-level text; "
                             f"pass --prompt-ids instead")
        return ([self.bos_id] if (self.add_bos if add_bos is None else add_bos) else []) + ids

    def decode(self, ids, skip_special: bool = True) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
        return data.decode("utf-8", errors="replace")

    def stream(self) -> "_ByteStream":
        return _ByteStream()

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        raise ValueError("this model has no chat template (give the prompt as raw text)")

    def encode_chat(self, messages, add_generation_prompt: bool = True, **extra) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra))


class _ByteStream:
    def __init__(self):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        i = int(token_id) - BYTE_OFFSET
        return self._dec.decode(bytes([i])) if 0 <= i < 256 else ""


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the checkpoint's bos/eos/add_bos and chat template."""

    def __init__(self, tok: Tokenizer, *, kind: str, vocab_size: int, bos_id, eos_ids, add_bos: bool,
                 chat_template: str | None = None, bos_token: str | None = None, eos_token: str | None = None):
        self._tok, self.kind, self.vocab_size = tok, kind, int(vocab_size)
        self.bos_id = None if bos_id is None else int(bos_id)
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self.chat_template = chat_template
        self._chat = ChatTemplate(chat_template, bos_token, eos_token) if chat_template else None

    @property
    def has_chat_template(self) -> bool:
        return self._chat is not None

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of text; add_bos None follows the tokenizer's own setting. A bos already at the
        start of the text (a chat template that writes bos_token) is not doubled."""
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, not {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        want = self.add_bos if add_bos is None else bool(add_bos)
        if want and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        # ids the tokenizer does not know (padding rows of a larger embedding) decode to nothing
        n = self._tok.get_vocab_size(with_added_tokens=True)
        return self._tok.decode([int(i) for i in ids if 0 <= int(i) < n], skip_special_tokens=skip_special)

    def stream(self) -> "_TokenStream":
        return _TokenStream(self._tok)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        if self._chat is None:
            raise ValueError("this model has no chat template (give the prompt as raw text)")
        return self._chat.render(messages, add_generation_prompt, **extra)

    def encode_chat(self, messages, add_generation_prompt: bool = True, **extra) -> list[int]:
        """The rendered chat as ids: bos as the tokenizer adds it, never twice."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra))

    def token_to_id(self, token: str):
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int):
        return self._tok.id_to_token(int(i))


class _TokenStream:
    """Incremental detokenisation: each step returns the text that the new id completes ("" while a
    UTF-8 character is still incomplete), special tokens skipped."""

    def __init__(self, tok: Tokenizer):
        self._tok, self._ds = tok, DecodeStream(skip_special_tokens=True)
        self._n = tok.get_vocab_size(with_added_tokens=True)
        self._ctx, self._pending = [], []        # the id of the last text out, the ids since

    def step(self, token_id: int) -> str:
        t = int(token_id)
        if not 0 <= t < self._n:
            return ""
        try:
            out = self._ds.step(self._tok, t)
        except Exception:  # byte tokens that form no valid UTF-8 make DecodeStream's prefix check fail
            out = self._lossy(t)
        if out is None:
            self._pending.append(t)
            return ""
        self._ctx, self._pending = [t], []
        return out

    def _lossy(self, t: int) -> str:
        """The pending ids' text as plain decoding gives it (U+FFFD for the bad bytes), read after
        the previous id so a leading space survives; the stream restarts from t."""
        head = self._tok.decode(self._ctx, skip_special_tokens=True)
        text = self._tok.decode(self._ctx + self._pending + [t], skip_special_tokens=True)
        self._ds = DecodeStream(ids=[t], skip_special_tokens=True)
        if text.startswith(head):
            return text[len(head):]
        # the previous id's bytes joined the bad run (byte fallback spoils a run as a whole)
        return self._tok.decode(self._pending + [t], skip_special_tokens=True)


# ---------------------------------------------------------------------------------- loading

def load_tokenizer(src, cfg: LaneformerConfig | None = None):
    """The tokenizer of a model source (`src.kind` "laneformer" | "hf" | "gguf", `src.cfg`,
    `src.model_dir`, `src.gguf_fields`). The older call load_tokenizer(model_dir, cfg) still takes a
    Laneformer directory. Raises ValueError (one line) for a tokenizer that cannot serve the model."""
    if isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        if not os.path.isdir(path):
            raise ValueError(f"{path}: give load_tokenizer the model source of a model file "
                             f"(kog_dist.formats.open_model)")
        mt = _read_json(os.path.join(path, "config.json")).get("model_type")
        kind = "laneformer" if mt in (None, "laneformer_tp", "laneformer") else "hf"
        src = SimpleNamespace(kind=kind, cfg=cfg, model_dir=path, gguf_fields={})
    cfg = cfg if cfg is not None else src.cfg
    kind = getattr(src, "kind", None)
    if kind == "gguf":
        tok = _from_gguf(getattr(src, "gguf_fields", None) or {}, cfg)
    elif kind in ("hf", "laneformer"):
        path = os.path.join(src.model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            if kind == "laneformer":
                return ByteTokenizer(cfg)
            extra = " (tokenizer.model alone is not supported)" if os.path.isfile(
                os.path.join(src.model_dir, "tokenizer.model")) else ""
            raise ValueError(f"{src.model_dir} has no tokenizer.json{extra}")
        tok = _from_hf_dir(src.model_dir, cfg)
    else:
        raise ValueError(f"no tokenizer for a model source of kind {kind!r}")
    _check_vocab(tok, cfg)
    return tok


def _check_vocab(tok: HFTokenizer, cfg):
    n = tok._tok.get_vocab_size(with_added_tokens=True)
    if n > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {n} tokens but the model's vocabulary has {cfg.vocab_size} rows: "
                         f"they do not belong to the same model")
    if tok.bos_id is not None and not 0 <= tok.bos_id < cfg.vocab_size:
        raise ValueError(f"bos id {tok.bos_id} is outside the vocabulary ({cfg.vocab_size})")
    tok.eos_ids = tuple(i for i in tok.eos_ids if 0 <= i < cfg.vocab_size)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{path} is not valid JSON: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not an object")
    return data


def _token_text(value):
    """A tokenizer_config.json special token: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _from_hf_dir(model_dir: str, cfg) -> HFTokenizer:
    path = os.path.join(model_dir, "tokenizer.json")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # the Rust error text is long; keep its first line
        raise ValueError(f"{path} is not a valid tokenizer.json: {str(e).splitlines()[0]}") from None
    tc = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    gen = _read_json(os.path.join(model_dir, "generation_config.json"))

    bos_token, eos_token = _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))
    bos_id = tok.token_to_id(bos_token) if bos_token else None
    if bos_id is None and cfg.bos_token_ids:
        bos_id = cfg.bos_token_ids[0]
    # what the tokenizer.json post-processor does on its own: a leading id that plain encoding lacks
    with_special = tok.encode("a", add_special_tokens=True).ids
    plain = tok.encode("a", add_special_tokens=False).ids
    adds = len(with_special) > len(plain) and with_special[:1] != plain[:1]
    if bos_id is None and adds:
        bos_id = with_special[0]
    add_bos = tc["add_bos_token"] if isinstance(tc.get("add_bos_token"), bool) else (
        adds and with_special[0] == bos_id)
    if bos_id is not None and not bos_token and "bos_token" not in tc:   # null there: templates get ""
        bos_token = tok.id_to_token(bos_id)

    eos = [tok.token_to_id(eos_token)] if eos_token and tok.token_to_id(eos_token) is not None else []
    eos += list(cfg.eos_token_ids or ()) + _ids(gen.get("eos_token_id"))
    eos += [i for i in map(tok.token_to_id, END_OF_TURN) if i is not None]
    if not eos_token and eos:
        eos_token = tok.id_to_token(eos[0])
    return HFTokenizer(tok, kind="tokenizer.json", vocab_size=cfg.vocab_size, bos_id=bos_id, eos_ids=eos,
                       add_bos=add_bos, chat_template=find_template(model_dir, tc),
                       bos_token=bos_token, eos_token=eos_token)


def _from_gguf(fields: dict, cfg) -> HFTokenizer:
    model = fields.get("tokenizer.ggml.model")
    tokens = fields.get("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    tokens = [str(t) for t in tokens]
    types = [int(t) for t in (_gguf_list(fields, "tokenizer.ggml.token_type", numbers.Integral)
                              or [_NORMAL] * len(tokens))]
    if len(types) != len(tokens):
        raise ValueError(f"the GGUF tokenizer has {len(tokens)} tokens but {len(types)} token types")
    if model == "gpt2":
        tok = _gpt2_bpe(tokens, types, fields)
        default_add_bos = fields.get("tokenizer.ggml.pre", "default") in ("llama-bpe", "llama3")
    elif model == "llama":
        tok = _spm(tokens, types, fields)
        default_add_bos = True
    else:
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (supported: gpt2, llama)")

    def tid(key):
        v = fields.get(key)
        ok = isinstance(v, numbers.Integral) and not isinstance(v, bool) and 0 <= int(v) < len(tokens)
        return int(v) if ok else None

    bos_id = tid("tokenizer.ggml.bos_token_id")
    if bos_id is None and cfg.bos_token_ids:
        bos_id = cfg.bos_token_ids[0]
    add_bos = _gguf_value(fields, "tokenizer.ggml.add_bos_token", bool, default_add_bos)
    eos = [i for i in (tid("tokenizer.ggml.eos_token_id"), tid("tokenizer.ggml.eot_token_id"),
                       tid("tokenizer.ggml.eom_token_id")) if i is not None]
    eos += list(cfg.eos_token_ids or ())
    index = {t: i for i, t in enumerate(tokens)}
    eos += [index[t] for t in END_OF_TURN if t in index]
    template = _gguf_value(fields, "tokenizer.chat_template", str, None)
    return HFTokenizer(tok, kind="gguf", vocab_size=cfg.vocab_size, bos_id=bos_id, eos_ids=eos,
                       add_bos=bool(add_bos), chat_template=template if isinstance(template, str) else None,
                       bos_token=tokens[bos_id] if bos_id is not None and bos_id < len(tokens) else None,
                       eos_token=tokens[eos[0]] if eos and eos[0] < len(tokens) else None)


def _gguf_value(fields: dict, key: str, kind, default):
    """A GGUF tokenizer field of the type it must have (bool, str), `default` when absent; a one-line
    ValueError naming the key otherwise."""
    if key not in fields or fields[key] is None:
        return default
    v = fields[key]
    if not isinstance(v, kind):
        raise ValueError(f"the GGUF metadata {key} must be a {kind.__name__}, not {type(v).__name__}")
    return v


def _gguf_list(fields: dict, key: str, kind) -> list:
    """A GGUF array field whose items are all `kind` (numbers.Integral, numbers.Real), [] when absent."""
    v = fields.get(key)
    if v is None:
        return []
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, kind) and not isinstance(x, bool) for x in v):
        raise ValueError(f"the GGUF metadata {key} must be a list of numbers, not {type(v).__name__}")
    return list(v)


def _add_specials(tok: Tokenizer, tokens, types):
    """Control tokens become special tokens (matched in text, skipped when decoding with
    skip_special); user-defined ones are matched in text and always decoded, as llama.cpp does."""
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, ty in enumerate(types) if ty == _CONTROL])
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, ty in enumerate(types) if ty == _USER]
    if user:
        tok.add_tokens(user)


def _gpt2_bpe(tokens, types, fields) -> Tokenizer:
    merges_raw = fields.get("tokenizer.ggml.merges")
    if not merges_raw:
        raise ValueError("the GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
    merges = []
    for m in merges_raw:
        parts = str(m).split(" ")
        if len(parts) != 2:
            raise ValueError(f"the GGUF tokenizer has a malformed merge {str(m)[:40]!r}")
        merges.append((parts[0], parts[1]))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the GGUF tokenizer lists the same token twice")
    pre = str(fields.get("tokenizer.ggml.pre", "default"))
    try:
        tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in ("llama-bpe", "llama3")))
    except Exception as e:
        raise ValueError(f"the GGUF tokenizer's merges do not fit its tokens: {str(e).splitlines()[0]}") from None
    if pre in _SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _DIGITS_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:   # "gpt2", "default" and the rest: GPT-2's own split
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    _add_specials(tok, tokens, types)
    return tok


def _spm(tokens, types, fields) -> Tokenizer:
    """A SentencePiece-style vocabulary as a BPE whose merges are ranked by the merged piece's score:
    llama.cpp's SPM tokenizer merges the adjacent pair whose union has the highest score, which is
    BPE with that order; characters outside the vocabulary fall back to <0xNN> byte tokens."""
    scores = _gguf_list(fields, "tokenizer.ggml.scores", numbers.Real)
    scores = [float(s) for s in scores] if scores else [-float(i) for i in range(len(tokens))]
    if len(scores) != len(tokens):
        raise ValueError(f"the GGUF tokenizer has {len(tokens)} tokens but {len(scores)} scores")
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    mergeable = {t: i for t, i in vocab.items() if types[i] in (_NORMAL, _USER, 0)}
    ranked = []
    for t, i in mergeable.items():
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], i, vocab[a], vocab[b], a, b))
    ranked.sort()
    unk = next((tokens[i] for i, ty in enumerate(types) if ty == _UNKNOWN), None)
    tok = Tokenizer(models.BPE(vocab, [(r[4], r[5]) for r in ranked], unk_token=unk, fuse_unk=True,
                               byte_fallback=True))
    prefix = _gguf_value(fields, "tokenizer.ggml.add_space_prefix", bool, True)
    # "▁" in front of each stretch of text between special tokens, as llama.cpp does (a leading space of
    # the text itself stays a second "▁", so text round-trips)
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    _add_specials(tok, tokens, types)
    return tok
