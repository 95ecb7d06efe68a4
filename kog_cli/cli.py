"""`kog`: the command line. generate and checkpoint live here; the other subcommands belong to their
packages and are dispatched to their `main(argv)`."""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys

from kog_dist.checkpoint import CheckpointError, expected_tensors
from kog_dist.config import ConfigError
from kog_dist.formats.convert import convert
from kog_dist.formats.gguf_write import GGUF_DTYPES
from kog_dist.models import resolve_model
from kog_dist.shapes import SHAPES
from kog_dist.speculative import DEFAULT_DRAFT, MAX_DRAFT
from kog_dist.tiny import write_tiny_checkpoint
from workers.oneshot import emit

from .generate import generate_one_process, run_under_mpiexec

SUBCOMMANDS = {  # name -> (module, one-line help)
    "generate": (None, "decode one prompt (one process, or --np N ranks under mpiexec)"),
    "checkpoint": (None, "write test checkpoints (kog checkpoint tiny DIR ...)"),
    "bench": ("kog_cli.bench", "llama-bench style speed table (prefill, decode, GB/s, baselines)"),
    "client": ("kog_cli.client_cli", "talk to a running server: generate, health, stats, run SCRIPT.jsonl"),
    "serve": ("kog_cli.serve", "OpenAI-compatible HTTP server and playground (starts the ranks, or --connect)"),
    "chat": ("kog_cli.chat", "interactive terminal chat (streams; a local server, or --connect)"),
    "topo": ("topology.cli", "machine topology report and rank placement plan"),
    "launch": ("kog_cli.launch_cmd", "start ranks with the launcher that is present (mpiexec, mpirun, srun)"),
}


class UsageError(ValueError):
    pass


def fail(msg: str, code: int = 2) -> int:
    print(f"kog: error: {msg}", file=sys.stderr)
    return code


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as argparse does, without the usage dump
        raise UsageError(f"{message} (see {self.prog} --help)")


MODEL_HELP = ("a Laneformer or Hugging Face (llama, mistral, qwen2) directory, a .gguf file (llama), or a "
              "built-in name: smollm2-135m-instruct (the default, fetched once), tiny-random")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", "-n", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = all")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-ids", default="", help="comma-separated ids that end the generation")


def parse_ids(s: str, what: str = "--prompt-ids") -> list[int]:
    try:
        return [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"{what} must be comma-separated integers, got {s!r}") from None


# -- kog generate --------------------------------------------------------------------------------
def generate_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kog generate", description="Decode one prompt and print the text (or --json).")
    p.add_argument("--model", help=MODEL_HELP)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", help="prompt text (a user turn of the model's chat template, if it has one)")
    g.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    p.add_argument("--raw", action="store_true", help="give --prompt to the model as it is (no chat template)")
    p.add_argument("--system", help="a system message before the prompt (chat models)")
    add_sampling_flags(p)
    p.add_argument("--backend", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--np", type=int, default=1, dest="nranks", help="ranks (started under mpiexec)")
    p.add_argument("--max-seq", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--dtype", default=None, help="storage of the layer matrices: bf16, fp16, fp32, q8_0, q4_0, "
                   "q4_1 (default: the model's own; quantized GGUF blocks as stored)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--json-schema", metavar="FILE", default=None,
                   help="decode under this JSON Schema (structured outputs): the text always parses and validates, "
                        "or the stop is `length`")
    p.add_argument("--speculative", type=int, default=None, metavar="K",
                   help="prompt-lookup speculative decoding with up to K draft tokens, 0..8 (0 = off; default: "
                        f"{', '.join(f'{k} on {b}' for b, k in DEFAULT_DRAFT.items())}): lossless, the same tokens")
    return p


def cmd_generate(argv) -> int:
    a = generate_parser().parse_args(argv)
    if a.prompt is None and a.prompt_ids is None:
        a.prompt = "Hello"
    if a.nranks < 1:
        raise UsageError("--np must be >= 1")
    a.model = resolve_model(a.model)
    a.prompt_ids = parse_ids(a.prompt_ids) if a.prompt_ids is not None else None
    a.stop_ids = parse_ids(a.stop_ids, "--stop-ids")
    if a.speculative is not None and not 0 <= a.speculative <= MAX_DRAFT:
        raise UsageError(f"--speculative must be 0..{MAX_DRAFT} draft tokens, got {a.speculative}")
    if a.nranks > 1:
        return run_under_mpiexec(a)
    out = generate_one_process(a)
    emit(out, a.json)
    return 0


# -- kog checkpoint tiny ------------------------------------------------------------------------------
def cmd_checkpoint(argv) -> int:
    p = _Parser(prog="kog checkpoint", description="Write checkpoints in the spec's layout: random ones "
                "(tiny), or any model kog reads converted (convert).")
    sub = p.add_subparsers(dest="kind", required=True, parser_class=_Parser)
    c = sub.add_parser("convert", help="write a Laneformer directory from a GGUF / HF / Laneformer model")
    c.add_argument("src", help=MODEL_HELP)
    c.add_argument("dst", help="new (or empty) directory")
    c.add_argument("--dtype", default=None, type=str.upper, choices=("F32", "F16", "BF16"),
                   help="storage type (default: the source's; quantized tensors become F32)")
    if argv[:1] == ["convert"]:
        a = p.parse_args(argv)
        convert(resolve_model(a.src), a.dst, dtype=a.dtype)
        print(f"wrote {a.dst} (Laneformer layout) from {a.src}")
        return 0
    t = sub.add_parser("tiny", help="random weights: a Laneformer directory (config.json + safetensors) or, "
                       "with --format gguf, a one-lane GGUF file")
    t.add_argument("dir", help="the directory to write (--format gguf: the file)")
    t.add_argument("--shape", default=None, help=f"start from a named shape ({', '.join(SHAPES)}); the flags "
                   "below change it")
    for flag, key in (("--layers", "num_hidden_layers"), ("--hidden", "hidden_size"), ("--lanes", "num_lanes"),
                      ("--heads", "num_attention_heads"), ("--kv-heads", "num_key_value_heads"),
                      ("--ffn", "intermediate_size"), ("--vocab", "vocab_size"), ("--delay", "broadcast_delay"),
                      ("--window", "sliding_window"), ("--window-layers", "sliding_window_n_layers"),
                      ("--max-pos", "max_position_embeddings")):
        t.add_argument(flag, dest=key, type=int, default=None)
    t.add_argument("--format", default="laneformer", choices=("laneformer", "gguf"), dest="fmt")
    t.add_argument("--dtype", default=None, type=str.lower, choices=tuple(GGUF_DTYPES),
                   help="storage: f32 (the default), f16, bf16; --format gguf also q8_0, q4_0, q4_1, q5_0, q5_1, "
                   "q4_k, q5_k, q6_k and llama.cpp's q4_k_m, q5_k_m mixes")
    t.add_argument("--shards", type=int, default=1)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--tie", dest="tie_word_embeddings", action="store_true", default=None)
    for flag, key in (("--no-comm", "use_comm"), ("--no-early-comm", "use_early_comm"),
                      ("--no-early-to-future", "early_layers_to_future")):
        t.add_argument(flag, dest=key, action="store_false", default=None)
    a = vars(p.parse_args(argv))
    a.pop("kind")
    out, shards, seed, shape, fmt = a.pop("dir"), a.pop("shards"), a.pop("seed"), a.pop("shape"), a.pop("fmt")
    dtype = a.pop("dtype") or "f32"
    if shape is not None and shape not in SHAPES:
        raise UsageError(f"unknown --shape {shape!r} (known: {', '.join(SHAPES)})")
    if fmt == "laneformer" and dtype not in ("f32", "f16", "bf16"):
        raise UsageError(f"--dtype {dtype} needs --format gguf (a Laneformer directory holds f32, f16 or bf16)")
    if fmt == "gguf" and shards != 1:
        raise UsageError("--shards is for a Laneformer directory; a GGUF is one file")
    if fmt == "gguf" and a.get("num_lanes") is None and (shape is None or SHAPES[shape].get("num_lanes") != 1):
        a["num_lanes"] = 1          # a GGUF is a one-lane (llama) model
    cfg = write_tiny_checkpoint(out, dtype=dtype, shards=shards, seed=seed, shape=shape, fmt=fmt,
                                **{k: v for k, v in a.items() if v is not None})
    nparams = sum(math.prod(s) for s in expected_tensors(cfg).values())
    what = f"{shards} shard(s)" if fmt == "laneformer" else "GGUF"
    print(f"wrote {out}: {cfg.num_hidden_layers} layers, D {cfg.hidden_size}, {cfg.num_lanes} lanes, "
          f"δ {cfg.broadcast_delay}, V {cfg.vocab_size}, {nparams / 1e6:.2f}M params, {dtype}, {what}")
    return 0


# -- dispatch -------------------------------------------------------------------------------------
def usage() -> str:
    lines = ["usage: kog COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {n:<11} {h}" for n, (_, h) in SUBCOMMANDS.items()]
    lines += ["", "kog COMMAND --help for the flags of each."]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        return fail(f"unknown command {name!r}; commands: {', '.join(SUBCOMMANDS)}")
    try:
        if name == "generate":
            return cmd_generate(rest)
        if name == "checkpoint":
            return cmd_checkpoint(rest)
        module = importlib.import_module(SUBCOMMANDS[name][0])
        return int(module.main(rest) or 0)
    except BrokenPipeError:  # `kog ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (UsageError, ConfigError, CheckpointError, ValueError, OSError) as e:
        return fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
