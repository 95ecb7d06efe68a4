"""`kog bench --backend cpu --model PATH|NAME`: the llama-bench style table for the numpy backend, where
there is no GPU (CI, Slurm test clusters, a laptop).

  kog bench --backend cpu --model smollm2-135m-instruct --pp 64 --prompt 32 --gen 128 --reps 3

`--model` takes what open_model takes (a GGUF file, an HF or Laneformer directory) or a built-in name.
Rows: load (open + dequantize + fuse, from a warm page cache), pp<N> (time to first token of an N-token
prompt), tg<G>@<P> (decode, greedy unless told; median of --reps runs) once per BLAS thread setting of the decoder
("1", "2" where there are 2 cores, and "auto", the backend's own: the faster of the two, chosen from the
step times as it decodes), and the same decode on llama.cpp (llama-cpp-python) on the same GGUF file when it is importable. GB/s is
the bytes each engine streams per token times tokens/s: float32 weights for ours (every matrix but the
embedding table, which is read a row at a time, plus the tied LM head), the file's own tensors for
llama.cpp; the fraction is of a large one-thread numpy copy measured in the same run.
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np


def copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes read + written per second by one large numpy copy (one thread, as a rank runs)."""
    a = np.ones(nbytes // 8, np.float64)
    b = np.empty_like(a)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t0)
    return 2.0 * a.nbytes / statistics.median(times[1:])


def thread_settings(cores: int, blas_known: bool) -> list:
    """The decoder's BLAS thread settings to measure: fixed counts (up to 2: the GEMVs are memory bound),
    then "auto" where there is a choice to make."""
    if not blas_known:
        return [None]
    return [1] + ([2, "auto"] if cores > 1 else [])


def row_sampling(args):
    """The decode rows' sampler of every `kog bench` backend: greedy unless --temperature / --top-k / --top-p
    say otherwise (ValueError, the sampler's own line, for values it refuses)."""
    from kog_dist.sampling import SamplingParams
    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed).validate()


def run(args, say) -> dict:
    from kog_dist.backend import RunCommand
    from kog_dist.checkpoint import expected_tensors
    from kog_dist.formats import FormatError, open_model
    from kog_dist.models import ModelNotFound, resolve_model
    from workers.cpu_decode import FastDecoder, blas_threads
    from workers.factory import make_backend

    try:
        path = resolve_model(args.model, say=say)
        t0 = time.perf_counter()
        src = open_model(path, progress=False)
        cfg = src.cfg
        need = max(args.pp + 1, args.prompt + args.gen)
        backend, cfg = make_backend("cpu", src, max_seq=min(need, cfg.max_position_embeddings), num_slots=1,
                                    progress=False)
        load_s = time.perf_counter() - t0
    except (ModelNotFound, FormatError, ValueError, OSError) as e:
        raise SystemExit(f"kog bench: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    say(f"loaded {os.path.basename(path)} in {load_s:.2f} s ({src.kind})")
    streamed = 4 * sum(int(np.prod(s)) for n, s in expected_tensors(cfg).items() if "tok_embeddings" not in n)
    if cfg.tie_word_embeddings:
        streamed += 4 * cfg.vocab_size * cfg.hidden_size
    bw = copy_bandwidth()
    say(f"copy bandwidth {bw / 1e9:.1f} GB/s (numpy, one thread)")
    rng = np.random.default_rng(args.seed)
    ids = lambda n: [int(x) for x in rng.integers(3, cfg.vocab_size, n)]
    sampling = row_sampling(args)

    def go(prompt, gen):
        return backend.run(RunCommand(append=prompt, max_new_tokens=gen, sampling=sampling), ignore_eos=True)

    prompt = ids(args.pp)
    go(prompt, 1)
    ttft = statistics.median(go(prompt, 1).first_token_ms for _ in range(args.reps))
    out = {"pp": {"prompt": args.pp, "ttft_ms": ttft, "tokens_per_s": args.pp / (ttft / 1e3)},
           "load_s": load_s, "streamed_bytes_per_token": streamed, "blas_threads": blas_threads()}
    prompt = list(args.text_ids) if getattr(args, "text_ids", None) else ids(args.prompt)
    default, rows = backend.decoder, []
    mine = "auto" if default.chooser else str(default.threads)
    settings = thread_settings(os.cpu_count() or 1, blas_threads() is not None)
    for t in settings:
        if t is not None:
            backend.decoder = FastDecoder(cfg, default.fw, default.embed, threads=t)
        name = mine if t is None else str(t)
        go(prompt, min(args.gen, 8))                         # warm: caches grown, pages touched
        runs = [go(prompt, args.gen) for _ in range(args.reps)]
        tps = [r.decode_tokens_per_s for r in runs]
        med = statistics.median(tps)
        row = {"threads": name, "prompt": args.prompt, "gen": len(runs[0].token_ids),
               "tokens_per_s": med, "runs_tokens_per_s": tps, "ms_per_token": 1e3 / med if med else 0.0,
               "GB_per_s": med * streamed / 1e9, "fraction_of_copy_bw": med * streamed / bw,
               "ids_head": runs[0].token_ids[:16]}
        if backend.decoder.chooser:
            row["steps_per_thread_count"] = {str(k): v for k, v in backend.decoder.chooser.runs.items()}
        rows.append(row)
        say(f"tg{args.gen} threads {name}: {med:.1f} tokens/s, runs {[round(x, 1) for x in tps]}")
    backend.decoder = default
    out["tg_threads"] = rows
    out["tg"] = next((x for x in rows if x["threads"] == mine), rows[-1])    # the backend's own setting
    out["default_threads"] = mine
    backend.close()
    baselines = []
    if src.kind == "gguf":
        baselines += llama_cpp_rows(path, prompt, args.gen, args.reps, settings, bw, say)
    modes = [m for m in args.baselines.split(",") if m and m != "none"]
    if "eager" in modes:
        baselines += torch_eager(cfg, args, streamed, bw, say)
    return {"date": time.strftime("%Y-%m-%d"), "device": f"cpu ({os.cpu_count()} cores; numpy backend, one process)",
            "model": path, "dtype": "F32", "copy_bandwidth_GBps": bw / 1e9,
            "backend_rows": "cpu", "monokernel": out, "baselines": baselines,
            "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}}


def gguf_streamed_bytes(path: str) -> int:
    """What llama.cpp reads per token: every tensor of the file as stored, the embedding table only
    when it is also the output head (tied), where it is read whole."""
    from gguf import GGUFReader
    r = GGUFReader(path)
    names = {t.name for t in r.tensors}
    return sum(int(t.n_bytes) for t in r.tensors if t.name != "token_embd.weight" or "output.weight" not in names)


def llama_cpp_rows(path, prompt, gen, reps, settings, bw, say) -> list[dict]:
    """Greedy decode on llama.cpp, timed as ours: from the first sampled token to the last."""
    try:
        import llama_cpp
    except ImportError:
        return [{"mode": "llama.cpp", "error": "llama-cpp-python is not importable (pip install llama-cpp-python)"}]
    nbytes = gguf_streamed_bytes(path)
    rows = []
    for n in sorted({t for t in settings if isinstance(t, int)} or {1}):
        try:
            llm = llama_cpp.Llama(model_path=path, n_ctx=len(prompt) + gen + 8, n_threads=n, n_threads_batch=n,
                                  n_batch=max(8, len(prompt)), verbose=False)
            tps, ids = [], []
            for rep in range(reps + 1):                      # the first run warms up
                t_first, k, got = None, 0, []
                for tok in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
                    k += 1
                    got.append(int(tok))
                    if k == 1:
                        t_first = time.perf_counter()
                    if k == gen:
                        break
                dt = time.perf_counter() - t_first
                if rep:
                    tps.append((gen - 1) / dt if gen > 1 and dt > 0 else 0.0)
                    ids = got
            del llm
        except Exception as e:  # noqa: BLE001 - a baseline failure is reported, not fatal
            rows.append({"mode": f"llama.cpp t={n}", "error": f"{type(e).__name__}: {e}"})
            continue
        med = statistics.median(tps)
        rows.append({"mode": f"llama.cpp t={n}", "threads": str(n), "gen_len": gen, "prompt_len": len(prompt),
                     "tokens_per_s": med, "runs_tokens_per_s": tps, "ms_per_token": 1e3 / med if med else 0.0,
                     "streamed_bytes_per_token": nbytes, "GB_per_s": med * nbytes / 1e9,
                     "fraction_of_copy_bw": med * nbytes / bw, "ids_head": ids[:16],
                     "version": getattr(llama_cpp, "__version__", "?")})
        say(f"llama.cpp t={n}: {med:.1f} tokens/s")
    return rows


def torch_eager(cfg, args, streamed, bw, say) -> list[dict]:
    try:
        from workers.cuda import torch_baseline as tb
        if not tb.torch_available():
            return [{"mode": "eager (cpu)", "error": "torch is not importable"}]
        rows = tb.run_baselines(cfg, None, prompt_len=args.prompt, gen_len=args.gen, modes=["eager"],
                                device="cpu", dtype="float32", repeats=max(1, args.baseline_repeats), log=say)
    except Exception as e:  # noqa: BLE001 - a baseline failure is reported, not fatal
        return [{"mode": "eager (cpu)", "error": f"{type(e).__name__}: {e}"}]
    for b in rows:
        b["mode"] = "torch eager (cpu)"
        if "tokens_per_s" in b:
            b["GB_per_s"] = b["tokens_per_s"] * streamed / 1e9
            b["fraction_of_copy_bw"] = b["tokens_per_s"] * streamed / bw
    return rows


def table(r: dict) -> str:
    mk = r["monokernel"]
    rows = [("cpu (numpy)", "-", "load", f"{mk['load_s']:.2f} s", "", "", "")] if "load_s" in mk else []
    pp = mk["pp"]
    rows.append(("cpu (numpy)", str(mk.get("blas_threads") or "?"), f"pp{pp['prompt']}",
                 f"{pp['tokens_per_s']:.0f}", f"TTFT {pp['ttft_ms']:.2f} ms", "", ""))
    for x in mk.get("tg_threads") or [mk["tg"]]:
        th = x.get("threads", "?")
        if x.get("steps_per_thread_count"):
            th += " (" + ", ".join(f"{k}t: {v}" for k, v in x["steps_per_thread_count"].items()) + " steps)"
        rows.append(("cpu (numpy)", th, f"tg{x['gen']} @ {x['prompt']}",
                     f"{x['tokens_per_s']:.1f}", f"{x['ms_per_token']:.3f} ms/tok", f"{x['GB_per_s']:.1f}",
                     f"{100 * x['fraction_of_copy_bw']:.1f}%"))
    for b in r["baselines"]:
        name = b["mode"].split(" t=")[0]
        if "tokens_per_s" in b:
            rows.append((name, b.get("threads", "-"), f"tg{b['gen_len']} @ {b['prompt_len']}",
                         f"{b['tokens_per_s']:.1f}", f"{b['ms_per_token']:.3f} ms/tok", f"{b['GB_per_s']:.1f}",
                         f"{100 * b['fraction_of_copy_bw']:.1f}%"))
        else:
            rows.append((name, "-", "-", "error", b.get("error", "")[:70], "", ""))
    head = ("backend", "threads", "test", "t/s", "latency", "GB/s", "of copy BW")
    w = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    line = lambda x: "| " + " | ".join(str(v).ljust(w[i]) for i, v in enumerate(x)) + " |"
    out = [f"model: {r['model']}  dtype: F32  device: {r['device']}  date: {r['date']}  "
           f"commit: {r.get('commit', '?')}",
           f"copy bandwidth (measured now, one thread): {r['copy_bandwidth_GBps']:.1f} GB/s; float32 weights "
           f"streamed per token: {mk['streamed_bytes_per_token'] / 1e9:.3f} GB, ceiling "
           f"{r['copy_bandwidth_GBps'] * 1e9 / mk['streamed_bytes_per_token']:.1f} tokens/s",
           line(head), "|" + "|".join("-" * (x + 2) for x in w) + "|"]
    out += [line(x) for x in rows]
    return "\n".join(out)
