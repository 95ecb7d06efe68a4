"""`kog bench`: llama-bench style speed table of the cuda backend (the monokernel), with the device's
copy bandwidth and the PyTorch baselines measured in the same run.

  kog bench --shape 2b                 random weights of the published 2B shape, made on the device
  kog bench --shape smollm2-135m --dtype bf16,q4_1   one-lane Llama shapes; several storages in one run
  kog bench --model PATH               any checkpoint (Laneformer or HF directory, .gguf file)
  kog bench --shape 2b --json          one JSON object on stdout
  kog bench --model M --speculative 8  speculative rows: agent-like tasks with and without prompt lookup
                                       (--gen tokens a task, --reps rounds; kog_cli/bench_spec.py)

Rows: pp<N> (time to first token of an N-token prompt: prefill + the first decode step + sampling),
tg<G>@<P> (decode of G tokens after a P-token prompt, median of --reps runs, timed by CUDA events
around the one kernel launch; greedy unless --temperature / --top-k / --top-p say how to sample), GB/s
(weight bytes streamed per token * tokens/s) and the fraction of the copy bandwidth measured in this run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from kog_dist.shapes import SHAPES, shape_config
from workers.cuda.device import cupy_copy_bandwidth, device_name
from workers.factory import STORE_NAMES


def _say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _commit() -> str:
    """KOG_COMMIT when set (a copy of the tree without its history), else `git describe --dirty`: a tree
    that differs from its HEAD says so instead of passing for that commit."""
    import os
    import subprocess
    if os.environ.get("KOG_COMMIT"):
        return os.environ["KOG_COMMIT"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=root,
                              capture_output=True, text=True, timeout=5).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


# --dtype -> the backend's storage (workers.cuda.weights.split_dtype): quantized types keep the embedding,
# LM head and KV cache in bf16


def finish_rows(mk: dict, bw: float) -> None:
    """The decode rows' fraction of the copy bandwidth `bw` (bytes/s, measured in the same run) and the
    long-context slowdown, from the rows' GB_per_s."""
    for key in ("tg", "tg_ctx"):
        if key in mk:
            mk[key]["fraction_of_copy_bw"] = mk[key]["GB_per_s"] * 1e9 / bw
    if "tg_ctx" in mk:
        mk["ctx_slowdown"] = 1.0 - mk["tg_ctx"]["tokens_per_s"] / mk["tg"]["tokens_per_s"]


def _ids(rng, n, V):
    return [int(x) for x in rng.integers(3, V, n)]


def _text_ids(args) -> str | None:
    """--text: its chat-encoded ids into args.text_ids and their count into args.prompt; an error line or None."""
    args.text_ids = None
    if args.text is None:
        return None
    if not args.model or args.nranks != 1 or args.speculative:
        return "--text takes --model, one process and no --speculative (the agent tasks have their own prompts)"
    from kog_dist.formats import FormatError, open_model
    from kog_dist.models import ModelNotFound, resolve_model
    from kog_dist.tokenizer import load_tokenizer
    try:
        src = open_model(resolve_model(args.model), progress=False)
    except (ModelNotFound, FormatError, ValueError, OSError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    try:
        tok = load_tokenizer(src)
        args.text_ids = (tok.encode_chat([{"role": "user", "content": args.text}]) if tok.has_chat_template
                         else tok.encode(args.text))    # a model without a template: the text as it is
    finally:
        src.close()
    if not args.text_ids:
        return "--text gives no tokens"
    args.prompt = len(args.text_ids)
    return None


def measure(backend, args, log=_say) -> dict:
    """The monokernel rows. Returns a dict of measurements."""
    import numpy as np
    from kog_dist.backend import RunCommand
    from workers.cuda.weights import streamed_bytes
    cfg = backend.cfg
    V = cfg.vocab_size
    rng = np.random.default_rng(args.seed)
    from .bench_cpu import row_sampling
    sampling = row_sampling(args)
    ktypes = getattr(backend.dw, "ktypes", None)   # the K-quants: each matrix's own type
    out = {"streamed_bytes_per_token": streamed_bytes(cfg, backend.dw.dtype, ktypes), "timing_marks": bool(args.profile),
           "dtype": backend.dw.dtype}

    def run(prompt, gen):
        return backend.run(RunCommand(slot=0, keep=0, append=prompt, max_new_tokens=gen, sampling=sampling),
                           ignore_eos=True)

    # prefill / time to first token
    prompt = _ids(rng, args.pp, V)
    run(prompt, 1)
    ttft, pre = [], []
    for _ in range(args.reps):
        r = run(prompt, 1)
        ttft.append(r.first_token_ms)
        pre.append(r.prefill_ms)
    out["pp"] = {"prompt": args.pp, "ttft_ms": statistics.median(ttft), "prefill_ms": statistics.median(pre),
                 "tokens_per_s": args.pp / (statistics.median(ttft) / 1e3), "runs_ttft_ms": ttft}
    log(f"pp{args.pp}: TTFT {out['pp']['ttft_ms']:.2f} ms (prefill {out['pp']['prefill_ms']:.2f} ms)")

    def decode_row(plen, gen, key):
        prompt = list(args.text_ids) if key == "tg" and args.text_ids else _ids(rng, plen, V)
        r = run(prompt, gen)
        tps, host = [], []
        for _ in range(args.reps):
            r = run(prompt, gen)
            if len(r.token_ids) != gen:
                raise RuntimeError(f"{key}: {len(r.token_ids)} tokens of {gen}")
            tps.append(gen / (backend.last_kernel_ms / 1e3))
            host.append(r.decode_tokens_per_s)
        med = statistics.median(tps)
        out[key] = {"prompt": plen, "gen": gen, "tokens_per_s": med, "runs_tokens_per_s": tps,
                    "host_tokens_per_s": statistics.median(host), "ms_per_token": 1e3 / med,
                    "GB_per_s": med * out["streamed_bytes_per_token"] / 1e9, "ids_head": r.token_ids[:16]}
        log(f"{key}: {med:.1f} tokens/s ({1e3 / med:.3f} ms/token), runs {[round(x, 1) for x in tps]}")

    decode_row(args.prompt, args.gen, "tg")
    if args.profile:
        from workers.cuda.bench_kernel import format_breakdown, phase_breakdown, streamed_by_kind
        prompt = list(args.text_ids) if args.text_ids else _ids(rng, args.prompt, V)
        bds = []
        steps = [k for k in (8, 200, 400) if k < args.gen] or [args.gen - 1]   # a step the decode reaches
        for k in steps:
            backend.run(RunCommand(slot=0, keep=0, append=prompt, max_new_tokens=min(args.gen, k + 2),
                                   sampling=sampling), ignore_eos=True, timing_token=k)
            bds.append(phase_breakdown(backend.last_timing, cfg.num_hidden_layers, cfg.num_lanes))
        out["phases"] = bds
        from workers.cuda.weights import matrix_bytes
        sb = streamed_by_kind(cfg, matrix_bytes(1 << 20, backend.dw.dtype) / (1 << 20))
        sb["lm"] = streamed_bytes(cfg, backend.dw.dtype, ktypes) - sum(v for k, v in sb.items() if k != "lm")
        for k, bd in zip(steps, bds):
            log(f"phase breakdown of decode step {k} (context {args.prompt + k}):\n" + format_breakdown(bd, sb))
    if args.ctx and args.ctx <= backend.max_seq:
        decode_row(args.ctx - args.ctx_gen, args.ctx_gen, "tg_ctx")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kog bench", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--shape", help=f"a named shape with random weights made on the device ({', '.join(SHAPES)})")
    ap.add_argument("--dtype", default=None,
                    help=f"storage ({', '.join(STORE_NAMES)}); comma separated: one row each, in the same run (--shape "
                         "default bf16; --model default: the checkpoint's own, a Q8_0/Q4_0/Q4_1 GGUF as it is)"),
    ap.add_argument("--reps", type=int, default=5, help="timed runs per row (median reported)")
    ap.add_argument("--pp", type=int, default=1024, help="prompt tokens for the prefill / TTFT row")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--text", help="the decode rows start from this text, a user turn of the model's chat template "
                                   "(as it is without one; --model, one process), instead of --prompt random ids: a "
                                   "real prompt's distribution for the sampled rows")
    ap.add_argument("--gen", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=4096, help="context of the long-context decode row (0: skip)")
    ap.add_argument("--ctx-gen", type=int, default=128)
    ap.add_argument("--baselines", default="eager,cuda_graph,compile",
                    help="PyTorch baseline modes, comma separated, or 'none'")
    ap.add_argument("--baseline-repeats", type=int, default=3)
    ap.add_argument("--compile-mode", default="max-autotune-no-cudagraphs")
    ap.add_argument("--prefetch", type=int, default=None,
                    help="L2 prefetch bytes per block and phase (default: 32 KB with two ranks, else 64 KB)")
    ap.add_argument("--nblocks", type=int, default=None)
    ap.add_argument("--define", action="append", default=[], metavar="CFG_X=V",
                    help="extra compile-time define of the monokernel (tuning variants)")
    ap.add_argument("--seed", type=int, default=0, help="the random weights' and the sampler's seed")
    ap.add_argument("--temperature", type=float, default=0.0, help="decode rows sample at this temperature "
                    "(0: greedy, the default)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--backend", choices=("auto", "cuda", "cpu"), default="auto",
                    help="cuda: the monokernel; cpu: the numpy backend (needs --model); auto: cuda if there is a GPU")
    ap.add_argument("--profile", action="store_true", help="per-phase clock marks of some decode steps (a build with the "
                    "marks compiled in, about 1.4%% slower than the decode build)")
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="speculative rows instead: with --model the agent-like tasks decoded with and without "
                         "prompt lookup of up to K (1..8) draft tokens, --gen tokens each, --reps rounds; with --shape "
                         "(cuda) the cost of a verify pass of 1, 2, 4, 8 and K + 1 positions against a plain token")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--json-out", help="also write the JSON report to this file")
    ap.add_argument("--np", type=int, default=1, dest="nranks",
                    help="ranks, started under mpiexec / mpirun / srun: the multi-rank cuda backend, one per GPU; "
                         "with --backend cpu --model, the cpu backend's ranks (tensor parallel for a one-lane model)")
    from .bench_mr import IN_MPI
    ap.add_argument(IN_MPI, action="store_true", dest="in_mpi", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    err = _check_sizes(args) or _text_ids(args)
    if err:
        print(f"kog bench: error: {err}", file=sys.stderr)
        return 2
    if args.speculative:
        return _speculative(args)
    from workers.factory import cuda_available
    if args.nranks != 1 and not args.in_mpi:
        err = _check_np(args)
        if err is None and args.backend != "cpu" and not cuda_available():
            err = "--np runs the multi-rank cuda backend: it needs CuPy and a CUDA GPU on every rank"
        if err:
            print(f"kog bench: error: {err}", file=sys.stderr)
            return 2
        if args.backend == "cpu":   # ranks share the cores: one BLAS thread each, as kog-worker's
            for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                os.environ.setdefault(v, "1")
        from .bench_mr import launch
        return launch(argv, args.nranks)
    if args.in_mpi and args.backend == "cpu":
        from .bench_tp import run_rank as run_cpu_rank
        return run_cpu_rank(args, _say, _emit)
    if args.in_mpi:
        from .bench_mr import run_rank
        return run_rank(args, _say, _emit)
    if args.backend == "cpu" or (args.backend == "auto" and not cuda_available()):
        if args.shape:
            print("kog bench: error: --shape makes its weights on a GPU; on the cpu backend give --model DIR",
                  file=sys.stderr)
            return 2
        from .bench_cpu import run as run_cpu
        return _emit(dict(run_cpu(args, _say), commit=_commit(), args=vars(args)), args)
    try:
        import cupy as cp
        ndev = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - any failure means no usable GPU
        print(f"kog bench: error: --backend cuda needs CuPy and a CUDA GPU ({type(e).__name__}: {e})",
              file=sys.stderr)
        return 2
    if ndev < 1:
        print("kog bench: error: no CUDA GPU", file=sys.stderr)
        return 2
    from workers.cuda.backend import CudaBackend
    from workers.cuda.build import build
    from workers.cuda.weights import random_weights, split_dtype
    dev = cp.cuda.Device()
    report = {"date": time.strftime("%Y-%m-%d"), "device": device_name(dev.id), "commit": _commit(),
              "sms": dev.attributes["MultiProcessorCount"], "args": vars(args)}
    try:
        from workers.cuda import torch_baseline as tb
        have_torch = tb.torch_available()
    except Exception:  # noqa: BLE001
        tb, have_torch = None, False
    # copy bandwidth of this device, in this run
    bw = tb.measure_copy_bandwidth() if have_torch else cupy_copy_bandwidth()
    report["copy_bandwidth_GBps"] = bw / 1e9
    _say(f"copy bandwidth {bw / 1e9:.0f} GB/s ({'torch' if have_torch else 'cupy'})")
    need = max(args.pp + 1, args.prompt + args.gen, args.ctx)
    dtypes = [STORE_NAMES[d] for d in args.dtype.split(",")] if args.dtype else [None]
    src = None
    if args.shape:
        cfg = shape_config(args.shape)
        dtypes = [d or "BF16" for d in dtypes]
        model_name = f"laneformer-{args.shape} (random)"
    else:
        from kog_dist.checkpoint import CheckpointError
        from workers.cuda.weights import default_dtype, open_source
        try:
            src = open_source(args.model)
        except (CheckpointError, ValueError, OSError) as e:
            print(f"kog bench: error: {str(e).splitlines()[0]}", file=sys.stderr)
            return 2
        cfg = src.cfg
        dtypes = [d or default_dtype(src) for d in dtypes]
        model_name = args.model
    extra = dict(d.split("=", 1) for d in args.define)
    report["model"] = model_name
    report["variants"] = []
    for dtype in dtypes:
        if args.shape:
            k = build(cfg, dtype, args.nblocks, args.prefetch, extra=extra, marks=args.profile)
            args.prefetch = int(k.defines["CFG_PF"])   # the report's args say what ran
            t0 = time.perf_counter()
            dw = random_weights(cfg, dtype, k, seed=args.seed)
            _say(f"random {args.shape} weights ({dtype}) on the device in {time.perf_counter() - t0:.1f} s")
            backend = CudaBackend(weights=dw, max_seq=min(need, cfg.max_position_embeddings), num_slots=1,
                                  nblocks=args.nblocks, prefetch=args.prefetch, extra_defines=extra,
                                  timing_marks=args.profile)
        else:
            backend = CudaBackend(src, max_seq=min(need, cfg.max_position_embeddings), num_slots=1,
                                  nblocks=args.nblocks, prefetch=args.prefetch, extra_defines=extra,
                                  dtype=dtype, timing_marks=args.profile)
        mk = measure(backend, args)
        mk["compile_s"] = backend.k.compile_s
        finish_rows(mk, bw)
        report["variants"].append(mk)
        backend.close()
        del backend
        cp.get_default_memory_pool().free_all_blocks()
    if src is not None:
        src.close()
    mk = report["monokernel"] = report["variants"][0]
    report["dtype"] = mk["dtype"]
    report["compile_s"] = mk["compile_s"]
    modes = [m for m in args.baselines.split(",") if m and m != "none"]
    report["baselines"] = []
    if modes:
        if not have_torch:
            report["baselines"] = [{"mode": m, "error": "torch is not importable"} for m in modes]
        else:
            report["baselines"] = tb.run_baselines(
                cfg, None, prompt_len=args.prompt, gen_len=args.gen, modes=modes,
                dtype={"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[split_dtype(report["dtype"])[1]],
                repeats=args.baseline_repeats, compile_mode=args.compile_mode,
                log=lambda m: _say(m))
    for b in report["baselines"]:
        if "tokens_per_s" in b:
            b["GB_per_s"] = b["tokens_per_s"] * mk["streamed_bytes_per_token"] / 1e9
            b["fraction_of_copy_bw"] = b["GB_per_s"] * 1e9 / bw
    return _emit(report, args)


def _check_sizes(args) -> str | None:
    """Why the counts and sizes cannot make a benchmark, in one line, or None."""
    for flag, v, lo in (("--reps", args.reps, 1), ("--baseline-repeats", args.baseline_repeats, 1),
                        ("--pp", args.pp, 1), ("--prompt", args.prompt, 1), ("--gen", args.gen, 1),
                        ("--ctx", args.ctx, 0), ("--ctx-gen", args.ctx_gen, 1), ("--prefetch", args.prefetch, 0),
                        ("--nblocks", args.nblocks, 1)):
        if v is not None and v < lo:
            return f"{flag} must be >= {lo} (got {v})"
    if args.shape is not None and args.shape not in SHAPES:
        return f"unknown shape {args.shape!r} (known: {', '.join(SHAPES)})"
    for d in (args.dtype or "").split(",") if args.dtype else ():
        if d not in STORE_NAMES:
            return f"unknown --dtype {d!r} (known: {', '.join(STORE_NAMES)})"
    from .bench_cpu import row_sampling
    try:
        row_sampling(args)
    except ValueError as e:
        return str(e)
    if args.ctx and args.ctx_gen >= args.ctx:
        return f"--ctx-gen ({args.ctx_gen}) must be below --ctx ({args.ctx}): the row decodes at that context"
    return None


def _check_np(args) -> str | None:
    """Why `--np N` cannot run, in one line (before any rank starts), or None."""
    if args.nranks < 1:
        return f"--np must be >= 1 (got {args.nranks})"
    if args.backend == "cpu":
        if args.shape or not args.model:
            return "--np with --backend cpu runs a real model: give --model (a GGUF file, a directory or a built-in name)"
        try:   # a rank count the model cannot split into is refused before any rank starts
            from kog_dist.formats import open_model
            from kog_dist.models import resolve_model
            from workers.oneshot import check_rank_count
            src = open_model(resolve_model(args.model, say=_say), progress=False)
            src.close()
            check_rank_count(src.cfg, args.nranks)
        except (ValueError, OSError) as e:
            return str(e).splitlines()[0]
        return None
    try:
        from kog_dist.tp_lanes import rank_config
        from workers.cuda.multirank import check
        if args.shape:
            cfg = shape_config(args.shape)
        else:
            from kog_dist.formats import open_model
            from kog_dist.models import resolve_model
            src = open_model(resolve_model(args.model, say=_say), progress=False)
            src.close()
            cfg = src.cfg
        check(rank_config(cfg, args.nranks), args.nranks)
    except (ValueError, OSError) as e:
        return str(e).splitlines()[0]
    return None


def _speculative(args) -> int:
    if not 1 <= args.speculative <= 8:
        print(f"kog bench: error: --speculative takes 1 to 8 draft tokens (got {args.speculative})", file=sys.stderr)
        return 2
    if args.shape is not None and args.model is None and args.nranks == 1:
        return _speculative_cost(args)
    if args.model is None or args.nranks != 1:
        print("kog bench: error: --speculative runs a real model's tokenizer and chat template on one rank: give "
              "--model (and no --np), or --shape for the cost of a verify pass", file=sys.stderr)
        return 2
    from .bench_spec import run, table
    if args.dtype and "," in args.dtype:
        print("kog bench: error: --speculative takes one --dtype", file=sys.stderr)
        return 2
    report = run(args.model, args.backend, args.speculative, args.gen, args.reps, 3 * args.reps, _say, dtype=args.dtype)
    _emit(dict(report, commit=_commit(), args=vars(args)), args, table)
    return 0 if all(r["identical"] for r in report["rows"]) else 1


def _speculative_cost(args) -> int:
    """`kog bench --shape S --speculative K`: the cuda backend's verify passes of P positions on random weights,
    against its plain token in the same run (kog_cli/bench_spec.pass_cost)."""
    from workers.factory import cuda_available
    if args.backend == "cpu" or not cuda_available():
        print("kog bench: error: --shape with --speculative measures the cuda backend's verify passes: it needs "
              "CuPy and a CUDA GPU (the cpu backend's cost: --model M --backend cpu --speculative K)", file=sys.stderr)
        return 2
    if args.dtype and "," in args.dtype:
        print("kog bench: error: --speculative takes one --dtype", file=sys.stderr)
        return 2
    import cupy as cp
    from workers.cuda.backend import CudaBackend
    from workers.cuda.build import build
    from workers.cuda.weights import random_weights
    from .bench_spec import pass_cost
    cfg = shape_config(args.shape)
    dtype = STORE_NAMES[args.dtype] if args.dtype else "BF16"
    k = build(cfg, dtype, args.nblocks, args.prefetch)
    b = CudaBackend(weights=random_weights(cfg, dtype, k, seed=args.seed), max_seq=args.prompt + args.gen + 16,
                    num_slots=1, nblocks=args.nblocks, prefetch=args.prefetch, speculative=True)
    try:
        if b.spec_max < 2:
            print(f"kog bench: error: the {args.shape} shape has {cfg.num_lanes} lanes: verify passes are built for "
                  "one-lane models", file=sys.stderr)
            return 2
        sizes = sorted({1, 2, 4, 8, args.speculative + 1})
        rows = pass_cost(b, sizes, args.prompt, args.gen, args.reps)
    finally:
        b.close()
    report = {"date": time.strftime("%Y-%m-%d"), "device": device_name(cp.cuda.Device().id), "commit": _commit(),
              "shape": args.shape, "dtype": dtype, "positions_max": b.spec_max, "rows": rows, "args": vars(args)}

    def render(r):
        out = [f"{r['shape']} ({r['dtype']}, random weights) on {r['device']}: a verify pass of P positions against "
               f"a plain token, {args.prompt} + {args.gen} tokens, medians of {args.reps}",
               "| positions | us a pass | x a plain token |", "|---|---|---|"]
        out += [f"| {x['positions']} | {x['pass_us']:.1f} | {x['vs_plain']:.2f}x |" for x in r["rows"]]
        return "\n".join(out)
    return _emit(report, args, render)


def _emit(report: dict, args, render=None) -> int:
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, default=str, indent=1)
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print((render or table)(report))
    return 0


def _dt_name(dtype: str) -> str:
    return {v: k for k, v in STORE_NAMES.items()}.get(dtype, dtype.lower())


def table(r: dict) -> str:
    if r.get("backend_rows") == "cpu":
        from .bench_cpu import table as cpu_table
        return cpu_table(r)
    mk = r["monokernel"]
    dt = _dt_name(r["dtype"])
    ours = "cpu (numpy)" if r.get("backend_rows") == "cpu" else "monokernel"
    rows = []
    variants = r.get("variants") or [mk]
    for v in variants:
        name = ours if len(variants) == 1 else f"{ours} {_dt_name(v.get('dtype', r['dtype']))}"
        pp = v["pp"]
        rows.append((name, f"pp{pp['prompt']}", f"{pp['tokens_per_s']:.0f}",
                     f"TTFT {pp['ttft_ms']:.2f} ms", "", ""))
        for key in ("tg", "tg_ctx"):
            if key in v:
                x = v[key]
                rows.append((name, f"tg{x['gen']} @ {x['prompt']}", f"{x['tokens_per_s']:.1f}",
                             f"{x['ms_per_token']:.3f} ms/tok", f"{x['GB_per_s']:.0f}",
                             f"{100 * x['fraction_of_copy_bw']:.1f}%"))
    for b in r["baselines"]:
        name = f"torch {b['mode']}"
        if "tokens_per_s" in b:
            rows.append((name, f"tg{b['gen_len']} @ {b['prompt_len']}", f"{b['tokens_per_s']:.1f}",
                         f"{b['ms_per_token']:.3f} ms/tok", f"{b['GB_per_s']:.0f}",
                         f"{100 * b['fraction_of_copy_bw']:.1f}%"))
        else:
            rows.append((name, "-", "error", b.get("error", "")[:60], "", ""))
    head = ("backend", "test", "t/s", "latency", "GB/s", "of copy BW")
    w = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    line = lambda x: "| " + " | ".join(str(v).ljust(w[i]) for i, v in enumerate(x)) + " |"
    sms = f" ({r['sms']} SMs)" if "sms" in r else ""
    if len(variants) > 1:
        dt = ",".join(_dt_name(v.get("dtype", r["dtype"])) for v in variants)
    out = [f"model: {r['model']}  dtype: {dt}  device: {r['device']}{sms}  date: {r['date']}  "
           f"commit: {r.get('commit', '?')}",
           f"copy bandwidth (measured now): {r['copy_bandwidth_GBps']:.0f} GB/s; weights streamed per token: "
           + "; ".join(f"{_dt_name(v.get('dtype', r['dtype']))} {v['streamed_bytes_per_token'] / 1e9:.3f} GB, ceiling "
                       f"{r['copy_bandwidth_GBps'] * 1e9 / v['streamed_bytes_per_token']:.0f} tokens/s" for v in variants)
           + ("; torch baselines in bf16" if r.get("baselines") and len(variants) > 1 else ""),
           line(head), "|" + "|".join("-" * (x + 2) for x in w) + "|"]
    out += [line(x) for x in rows]
    a = r.get("args") or {}
    if a.get("temperature"):
        out.append(f"decode rows sampled: temperature {a['temperature']:g}, top-k {a.get('top_k', 0)}, "
                   f"top-p {a.get('top_p', 1.0):g}, seed {a.get('seed', 0)}")
    if mk.get("timing_marks"):
        out.append("--profile: every row ran the profile build (clock marks compiled in, ~1.4% slower); "
                   "without --profile the rows are the decode build's")
    if "ctx_slowdown" in mk:
        out.append(f"decode at {mk['tg_ctx']['prompt'] + mk['tg_ctx']['gen']} context: "
                   f"{100 * mk['ctx_slowdown']:.1f}% slower than at {mk['tg']['prompt']}+{mk['tg']['gen']}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
