"""`kog bench --backend cpu --model DIR`: the same table for the numpy backend, where there is no GPU
(CI, Slurm test clusters). The bandwidth it is held against is a large numpy copy measured in the
same run (the CPU backend streams float32 weights every token); the baseline beside it is PyTorch
eager on the CPU when torch is importable."""
from __future__ import annotations

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


def run(args, say) -> dict:
    from kog_dist.checkpoint import expected_tensors
    from kog_dist.config import load_config
    from kog_dist.sampling import SamplingParams
    from kog_dist.backend import RunCommand
    from workers.factory import make_backend

    cfg = load_config(args.model)
    need = max(args.pp + 1, args.prompt + args.gen)
    backend, cfg = make_backend("cpu", args.model, max_seq=min(need, cfg.max_position_embeddings), num_slots=1)
    # float32 in memory: every tensor but the embedding table is read once per token
    streamed = 4 * sum(int(np.prod(s)) for n, s in expected_tensors(cfg).items() if "tok_embeddings" not in n)
    if cfg.tie_word_embeddings:
        streamed += 4 * cfg.vocab_size * cfg.hidden_size
    bw = copy_bandwidth()
    say(f"copy bandwidth {bw / 1e9:.1f} GB/s (numpy, one thread)")
    rng = np.random.default_rng(args.seed)
    ids = lambda n: [int(x) for x in rng.integers(3, cfg.vocab_size, n)]
    greedy = SamplingParams()

    def go(prompt, gen):
        return backend.run(RunCommand(append=prompt, max_new_tokens=gen, sampling=greedy), ignore_eos=True)

    prompt = ids(args.pp)
    ttft = statistics.median(go(prompt, 1).first_token_ms for _ in range(args.reps))
    out = {"pp": {"prompt": args.pp, "ttft_ms": ttft, "tokens_per_s": args.pp / (ttft / 1e3)}}
    prompt = ids(args.prompt)
    runs = [go(prompt, args.gen) for _ in range(args.reps)]
    tps = [r.decode_tokens_per_s for r in runs]
    med = statistics.median(tps)
    out["tg"] = {"prompt": args.prompt, "gen": len(runs[0].token_ids), "tokens_per_s": med,
                 "runs_tokens_per_s": tps, "ms_per_token": 1e3 / med if med else 0.0,
                 "GB_per_s": med * streamed / 1e9, "fraction_of_copy_bw": med * streamed / bw}
    out["streamed_bytes_per_token"] = streamed
    say(f"tg: {med:.1f} tokens/s")
    backend.close()
    baselines = []
    modes = [m for m in args.baselines.split(",") if m and m != "none"]
    if "eager" in modes:
        try:
            from workers.cuda import torch_baseline as tb
            if tb.torch_available():
                baselines = tb.run_baselines(cfg, None, prompt_len=args.prompt, gen_len=args.gen, modes=["eager"],
                                             device="cpu", dtype="float32", repeats=max(1, args.baseline_repeats),
                                             log=say)
            else:
                baselines = [{"mode": "eager", "error": "torch is not importable"}]
        except Exception as e:  # noqa: BLE001 - a baseline failure is reported, not fatal
            baselines = [{"mode": "eager", "error": f"{type(e).__name__}: {e}"}]
        for b in baselines:
            b["mode"] = "eager (cpu)"
            if "tokens_per_s" in b:
                b["GB_per_s"] = b["tokens_per_s"] * streamed / 1e9
                b["fraction_of_copy_bw"] = b["tokens_per_s"] * streamed / bw
    return {"date": time.strftime("%Y-%m-%d"), "device": "cpu (numpy backend, one process)",
            "model": args.model, "dtype": "F32", "copy_bandwidth_GBps": bw / 1e9,
            "backend_rows": "cpu", "monokernel": out, "baselines": baselines}
