"""PyTorch baselines of the Laneformer decode step (what `kog bench` runs beside the monokernel).

The model (config, weights, the decode step) is :mod:`workers.cuda.torch_model`; this module runs and
times it: greedy decode kept on the device (:class:`_GreedyRunner`), in three modes: ``eager`` (the
step op by op from Python), ``cuda_graph`` (the step, free of host synchronisation and of shapes that
depend on the position, captured once in a CUDA graph and replayed per token), ``compile``
(torch.compile of the step, then captured). The model's public names are re-exported here, so
``torch_baseline.X`` works for them as before.

PyTorch is imported lazily: this module imports without torch. ``run_baselines`` then returns one
``{"mode", "error"}`` entry per mode, so a benchmark can always print its table.

Public API (besides the model's, see :mod:`workers.cuda.torch_model`)::

    run_baselines(cfg, weights=None, prompt_len=128, gen_len=512,
                  modes=("eager", "cuda_graph", "compile"), device="cuda", ...) -> list[dict]
    measure_copy_bandwidth(nbytes=2**31, device="cuda", repeats=10) -> float   # bytes/s, read+write
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Mapping
from typing import Any, Callable, Iterable

from .torch_model import *  # noqa: F403  (the model's public names, re-exported as before)
from .torch_model import __all__ as _MODEL_ALL
from .torch_model import LaneformerTorch, TorchUnavailableError, _GreedyRunner, _import_torch, model_shape

__all__ = [*_MODEL_ALL, "run_baselines", "measure_copy_bandwidth"]


# ---------------------------------------------------------------------------------------------------------
# Benchmarks


def _elapsed(torch, device, fn: Callable[[], None]) -> float:
    """Seconds fn takes on the device (CUDA events), or by the host clock on the CPU."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_copy_bandwidth(nbytes: int = 2**31, device="cuda", repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write (2 * nbytes per copy); the
    median of ``repeats`` timed copies after two warm-up copies."""
    torch = _import_torch()
    dev = torch.device(device)
    src = torch.empty(int(nbytes), dtype=torch.uint8, device=dev)
    src.fill_(1)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    times = [_elapsed(torch, dev, lambda: dst.copy_(src)) for _ in range(max(1, repeats))]
    del src, dst
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return 2.0 * int(nbytes) / statistics.median(times)


def _capture(torch, runner: _GreedyRunner, warmup: int = 3):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            runner.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        runner.step()
    return g


def _err(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".strip()
    first = msg.splitlines()[0] if msg else type(e).__name__
    return first[:400]


def run_baselines(cfg: Any, weights: Mapping | None = None, prompt_len: int = 128, gen_len: int = 512,
                  modes: Iterable[str] = ("eager", "cuda_graph", "compile"), device="cuda", *,
                  dtype="bfloat16", repeats: int = 3, seed: int = 0, prompt_ids=None,
                  compile_mode: str = "max-autotune-no-cudagraphs",
                  log: Callable[[str], None] | None = None) -> list[dict]:
    """Greedy decode speed of the PyTorch baselines.

    For each mode: prefill ``prompt_len`` tokens (pseudo-random ids from ``seed`` unless ``prompt_ids``),
    then time ``gen_len`` greedy decode steps (positions prompt_len .. prompt_len+gen_len-1) with CUDA
    events after a warm-up; ``repeats`` times from the same prefilled cache; report the median.

    modes: "eager" (the step op by op from Python), "cuda_graph" (the same step captured once in a
    CUDA graph and replayed per token), "compile" (torch.compile(fullgraph=True, mode=compile_mode) of
    the step, then captured in a CUDA graph; compile_s reports the compile + autotune time).

    Returns one dict per mode: mode, tokens_per_s, ms_per_token, runs_tokens_per_s, prompt_len, gen_len,
    dtype, device, ids_head (first 16 generated ids), ids_match_eager (when eager ran), plus compile_s /
    capture_s where they apply; or {"mode", "error"} when that mode failed (also when torch is missing,
    CUDA is absent for the graph modes, or torch.compile is unavailable)."""
    modes = list(modes)
    say = log if log is not None else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        torch = _import_torch()
    except TorchUnavailableError as e:
        return [{"mode": m, "error": str(e)} for m in modes]
    results: list[dict] = []
    try:
        dev = torch.device(device)
        c = model_shape(cfg)
        max_seq = prompt_len + gen_len
        max_seq = -(-max_seq // 16) * 16
        say(f"torch baseline: building the model ({c.N} layers, D {c.D}, L {c.L}) on {dev}")
        model = LaneformerTorch(c, weights, device=dev, dtype=dtype if weights is None else None,
                                max_seq=max_seq, seed=seed)
        if prompt_ids is None:
            g = torch.Generator().manual_seed(int(seed) + 1)
            prompt_ids = torch.randint(0, c.V, (prompt_len,), generator=g)
        prompt = model._ids(prompt_ids)
        if prompt.shape[0] != prompt_len:
            raise ValueError(f"prompt_ids has {prompt.shape[0]} ids, prompt_len is {prompt_len}")
    except Exception as e:
        return [{"mode": m, "error": _err(e)} for m in modes]

    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    eager_ids = None
    for mode in modes:
        entry: dict = {"mode": mode}
        graph = runner = compiled = None
        try:
            if mode not in ("eager", "cuda_graph", "compile"):
                raise ValueError(f"unknown mode {mode!r}")
            if mode in ("cuda_graph", "compile") and dev.type != "cuda":
                raise RuntimeError(f"{mode} needs a CUDA device (device is {dev})")
            last = model.prefill(prompt)
            step_fn = model.core
            if mode == "compile":
                if not hasattr(torch, "compile"):
                    raise RuntimeError("torch.compile is not available in this torch")
                compiled = torch.compile(model.core, mode=compile_mode, fullgraph=True, dynamic=False)
                step_fn = compiled
            runner = _GreedyRunner(model, step_fn)
            runner.reset(last, prompt_len)
            if mode == "compile":
                say(f"torch baseline: torch.compile(mode={compile_mode!r}) of the decode step ...")
                t0 = time.perf_counter()
                runner.step()  # compiles (and autotunes)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                entry["compile_s"] = round(time.perf_counter() - t0, 2)
                entry["compile_mode"] = compile_mode
                say(f"torch baseline: compiled in {entry['compile_s']} s")
                runner.reset(last, prompt_len)
            if mode in ("cuda_graph", "compile"):
                t0 = time.perf_counter()
                graph = _capture(torch, runner)
                torch.cuda.synchronize(dev)
                entry["capture_s"] = round(time.perf_counter() - t0, 3)
                one = graph.replay
            else:
                one = runner.step
            n_warm = min(gen_len, 8)

            def decode(n):
                for _ in range(n):
                    one()

            runner.reset(last, prompt_len)
            decode(n_warm)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times = []
            for _ in range(max(1, repeats)):
                runner.reset(last, prompt_len)
                times.append(_elapsed(torch, dev, lambda: decode(gen_len)))
            ids = runner.generated(prompt_len, gen_len + 1)
            tps = [gen_len / t for t in times]
            med = statistics.median(times)
            entry.update({
                "tokens_per_s": round(gen_len / med, 2),
                "ms_per_token": round(med * 1e3 / gen_len, 4),
                "runs_tokens_per_s": [round(x, 2) for x in tps],
                "prompt_len": prompt_len, "gen_len": gen_len, "repeats": len(times),
                "dtype": str(model.dtype).replace("torch.", ""), "device": dev_name,
                "torch": torch.__version__, "ids_head": ids[:16],
            })
            if mode == "eager":
                eager_ids = ids
            elif eager_ids is not None:
                entry["ids_match_eager"] = ids == eager_ids
            say(f"torch baseline: {mode}: {entry['tokens_per_s']} tokens/s")
        except Exception as e:  # one mode failing never stops the others
            entry = {"mode": mode, "error": _err(e)}
            say(f"torch baseline: {mode} failed: {entry['error']}")
        finally:
            del graph, runner, compiled
            if dev.type == "cuda":
                try:
                    torch.cuda.synchronize(dev)
                    torch.cuda.empty_cache()
                except Exception:
                    pass
        results.append(entry)
    return results
