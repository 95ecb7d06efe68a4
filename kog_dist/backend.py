"""The backend contract (core): what the coordinator asks of a rank's compute (cpu: numpy; cuda: the
monokernel, both in workers/), and the decode loop rules they share. docs/interfaces.md says the same in prose."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kog_dist.sampling import SamplingParams


@dataclass
class RunCommand:
    slot: int = 0                      # which KV cache (sessions keep theirs between requests)
    keep: int = 0                      # cached positions of the slot to keep; the rest is dropped
    append: list = field(default_factory=list)   # token ids to prefill after them
    max_new_tokens: int = 0            # 0: only append
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: tuple = ()
    speculative: int = 0               # prompt-lookup draft tokens a verify pass at most (0: plain decode)
    grammar: object = None             # a kog_dist.grammar.Matcher: the tokens it forbids are masked before
                                       # each draw (on the wire: its format, compiled again by each rank)

    def to_wire(self) -> dict:
        s = self.sampling
        return {"slot": self.slot, "keep": self.keep, "append": [int(i) for i in self.append],
                "max_new_tokens": self.max_new_tokens, "stop_ids": [int(i) for i in self.stop_ids],
                "temperature": float(s.temperature), "top_k": int(s.top_k), "top_p": float(s.top_p),
                "seed": int(s.seed), "speculative": int(self.speculative),
                "grammar": self.grammar.grammar.format if self.grammar is not None else None}

    @classmethod
    def from_wire(cls, d: dict, tokenizer=None) -> "RunCommand":
        """`tokenizer` (or a callable giving it) compiles the command's grammar, if it has one: every rank
        then masks with its own matcher of the same format, fed the same tokens."""
        grammar = None
        if d.get("grammar") is not None:
            from kog_dist.grammar import compile_format
            tok = tokenizer() if callable(tokenizer) else tokenizer
            if tok is None:
                raise ValueError("a command with a grammar needs the model's tokenizer on this rank")
            grammar = compile_format(d["grammar"], tok).matcher()
        return cls(slot=d["slot"], keep=d["keep"], append=list(d["append"]),
                   max_new_tokens=d["max_new_tokens"], stop_ids=tuple(d["stop_ids"]),
                   sampling=SamplingParams(d["temperature"], d["top_k"], d["top_p"], d["seed"]),
                   speculative=d.get("speculative", 0), grammar=grammar)


@dataclass
class RunResult:
    token_ids: list = field(default_factory=list)
    stop_reason: str = "length"        # "eos" | "stop" | "length" | "cancel" | "none"
    prefill_tokens: int = 0
    prefill_ms: float = 0.0
    first_token_ms: float = 0.0        # from the start of run to the first sampled token
    decode_ms: float = 0.0             # from the first sampled token to the last
    cached: int = 0                    # positions the slot's cache holds now
    spec_steps: int = 0                # speculative decoding: verify passes,
    spec_drafted: int = 0              # draft tokens proposed,
    spec_accepted: int = 0             # and accepted
    grammar_ms: float = 0.0            # structured outputs: the host's time computing and applying masks
    mask_waits: int = 0                # (cuda) tokens whose sampler waited for the host's mask,
    mask_wait_ms: float = 0.0          # and how long in all

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / (self.decode_ms / 1e3) if n > 0 and self.decode_ms > 0 else 0.0

    def stats(self) -> dict:
        return {"prefill_tokens": self.prefill_tokens, "prefill_ms": round(self.prefill_ms, 3),
                "ttft_ms": round(self.first_token_ms, 3), "decode_ms": round(self.decode_ms, 3),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
                "new_tokens": len(self.token_ids), "stop_reason": self.stop_reason,
                "spec_steps": self.spec_steps, "spec_drafted": self.spec_drafted,
                "spec_accepted": self.spec_accepted, "grammar_ms": round(self.grammar_ms, 3),
                "mask_waits": self.mask_waits, "mask_wait_ms": round(self.mask_wait_ms, 3),
                "spec_tokens_per_pass": round((self.spec_steps + self.spec_accepted) / self.spec_steps, 3)
                if self.spec_steps else 0.0}


class Backend:
    """One rank's compute. `run` truncates the slot's cache to `keep`, prefills `append` (batched), then
    decodes up to `max_new_tokens`, calling on_token(id) after each; on_token returning False cancels."""
    max_seq: int
    num_slots: int

    def run(self, cmd: RunCommand, on_token=None) -> RunResult:  # pragma: no cover - interface
        raise NotImplementedError

    def free(self, slot: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass


def check_command(cmd: RunCommand, cached: int, vocab_size: int, max_seq: int, num_slots: int) -> None:
    """Refuse a command before any compute, with a one-line reason."""
    if not 0 <= cmd.slot < num_slots:
        raise ValueError(f"slot {cmd.slot} is out of range (0..{num_slots - 1})")
    if not 0 <= cmd.keep <= cached:
        raise ValueError(f"cannot keep {cmd.keep} positions: the slot holds {cached}")
    bad = [t for t in cmd.append if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    if cmd.keep + len(cmd.append) == 0:
        raise ValueError("empty prompt: give at least one token")
    if cmd.max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    if cmd.keep + len(cmd.append) > max_seq:
        raise ValueError(f"prompt of {cmd.keep + len(cmd.append)} tokens exceeds the context limit of {max_seq}")
    cmd.sampling.validate()


class Clock:
    """Millisecond marks for RunResult."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3
