"""Shared pieces of the control-plane tests: a tiny model, a coordinator serving a real CpuBackend in a
thread, wrappers that slow a backend down or make it fail, and the one-process reference.

Run as a script it serves a model in the foreground (for the SIGTERM test):
    python tests/test_control_helpers.py serve MODEL_DIR [--delay S] [--queue-limit N]
and prints "serving on ENDPOINT" on stdout once bound.
"""
from __future__ import annotations

import os
import sys
import threading
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from kog_dist.coordinator import Coordinator  # noqa: E402
from launch.cli import free_port  # noqa: E402,F401  (the tests' one way to pick a port)

SHAPE = dict(num_hidden_layers=2, hidden_size=64, num_lanes=4, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=128, vocab_size=300, broadcast_delay=1, max_position_embeddings=1024,
             eos_token_id=299)          # a rare EOS: greedy decodes run long (cancel, kill, disconnect)


def tiny_model(path: str) -> str:
    from kog_dist.tiny import write_tiny_checkpoint
    if not os.path.isfile(os.path.join(path, "config.json")):
        write_tiny_checkpoint(path, seed=3, **SHAPE)
    return path


def load(model_dir: str, num_slots: int = 4):
    from kog_dist.tokenizer import load_tokenizer
    from workers.factory import make_backend
    backend, cfg = make_backend("cpu", model_dir, num_slots=num_slots, progress=False)
    return backend, cfg, load_tokenizer(model_dir, cfg)


class Throttled:
    """A real backend whose tokens come out at most every `delay` seconds (long decodes for tests)."""

    def __init__(self, backend, delay: float):
        self.b, self.delay = backend, delay
        self.max_seq, self.num_slots = backend.max_seq, backend.num_slots

    def run(self, cmd, on_token=None):
        def slow(t):
            time.sleep(self.delay)
            return on_token(t) if on_token else True
        return self.b.run(cmd, slow)

    def free(self, slot):
        self.b.free(slot)


class Failing(Throttled):
    """Raises like a rank group whose peer died, after `after` tokens of a run."""

    def __init__(self, backend, delay: float, after: int):
        super().__init__(backend, delay)
        self.after = after

    def run(self, cmd, on_token=None):
        n = [0]

        def count(t):
            n[0] += 1
            if n[0] > self.after:
                raise RuntimeError("rank 1: peer lost (simulated)")
            return on_token(t)
        return super().run(cmd, count)


class LetterTokenizer:
    """id -> one letter, so every generated id has visible text (for stop strings)."""
    bos_id, eos_ids = 1, (2,)

    def encode(self, text, add_bos=True):
        return ([1] if add_bos else []) + [3 + (ord(ch) - 97) % 26 for ch in text]

    def decode(self, ids):
        return "".join(chr(97 + (i - 3) % 26) for i in ids if i >= 3)


class Reference:
    """The one-process engine: a fresh CpuBackend slot, prefilled from scratch every time."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.backend, self.cfg, self.tok = load(model_dir, num_slots=1)

    def ids(self, prompt_ids, max_new_tokens, stop_ids=(), **sampling):
        from kog_dist.sampling import SamplingParams
        from kog_dist.backend import RunCommand
        self.backend.free(0)
        cmd = RunCommand(slot=0, keep=0, append=list(prompt_ids), max_new_tokens=max_new_tokens,
                         sampling=SamplingParams(**sampling), stop_ids=tuple(stop_ids))
        return self.backend.run(cmd).token_ids


class Server:
    """A Coordinator serving `executor` on a free loopback port, in a thread."""

    def __init__(self, executor, tokenizer, cfg, endpoint="tcp://127.0.0.1:0", **kw):
        kw.setdefault("handle_signals", False)
        kw.setdefault("log", lambda m: None)
        self.coord = Coordinator(endpoint, executor, tokenizer, cfg, **kw)
        self.rc = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while self.coord.bound is None and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert self.coord.bound, "the coordinator did not bind"
        self.endpoint = self.coord.bound

    def _serve(self):
        self.rc = self.coord.serve()

    def stop(self, timeout=10.0):
        if self.thread.is_alive():
            self.coord.request_shutdown("test teardown")    # the loop acts on it within a poll interval
            self.thread.join(timeout)
        assert not self.thread.is_alive(), "the coordinator did not stop"
        return self.rc

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def wait_until(pred, timeout=10.0, step=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return False


def _main(argv):
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["serve"])
    p.add_argument("model")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--queue-limit", type=int, default=8)
    a = p.parse_args(argv)
    backend, cfg, tok = load(a.model, num_slots=2)
    ex = Throttled(backend, a.delay) if a.delay else backend
    c = Coordinator("tcp://127.0.0.1:0", ex, tok, cfg, queue_limit=a.queue_limit,
                    log=lambda m: print(m, flush=True))
    return c.serve()


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
