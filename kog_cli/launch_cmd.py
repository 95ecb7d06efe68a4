"""`kog launch`: launch.cli's command; with --dry-run, also the placement the ranks will take (on stderr,
so stdout stays the one command line): the topology plan (each rank's GPU and the cores near it, or
cores only for the cpu backend) and, when the rank program names a --model, what each rank owns of it:
its lanes for a Laneformer, its heads, KV heads, FFN columns and vocabulary rows for a one-lane model
split by tensor parallelism. The launcher's own modules (the base floor) know nothing of models."""
from __future__ import annotations

import os
import sys


def main(argv=None) -> int:
    from launch import cli
    argv = list(sys.argv[1:] if argv is None else argv)
    rc = cli.main(argv)
    if rc != 0:
        return rc
    ns = cli.parse_args(argv)
    if ns.dry_run:
        for line in placement(ns.np, ns.cmd):
            print(line, file=sys.stderr)
    return rc


def _arg(cmd: list[str], flag: str) -> str | None:
    for i, a in enumerate(cmd):
        if a == flag and i + 1 < len(cmd):
            return cmd[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def placement(nranks: int, cmd: list[str]) -> list[str]:
    """Lines: the plan's rank -> GPU / NUMA / cores, then each rank's share of the model (or why not)."""
    out = []
    backend = _arg(cmd, "--backend") or "auto"
    try:
        from topology.plan import plan
        from topology.probe import probe
        from topology.model import format_cpulist
        m = probe()
        p = plan(m, nranks, use_gpus=backend != "cpu" and bool(m.gpus))
        out.append(f"placement: {nranks} rank(s), {p.policy}")
        for e in p.entries:
            gpu = "" if e.gpu is None else f"GPU {e.gpu} ({e.bus_id}), "
            out.append(f"  rank {e.rank}: {gpu}NUMA {'-' if e.numa is None else e.numa}, "
                       f"cores {format_cpulist(e.cores) or '-'}")
        out += [f"  note: {n}" for n in p.notes]
    except Exception as e:  # noqa: BLE001 - a dry run reports what it could not work out
        out.append(f"placement: not planned ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    model = _arg(cmd, "--model")
    if model:
        out += model_split(model, nranks)
    return out


def model_split(model: str, nranks: int) -> list[str]:
    from kog_dist.formats import open_model
    from kog_dist.tp import tp_plan
    from workers.oneshot import check_rank_count
    from kog_dist.models import resolve_model
    try:
        model = resolve_model(model, fetch=False)     # a built-in name only when it is fetched already
    except ValueError as e:
        return [f"model: not opened ({str(e).splitlines()[0]})"]
    try:
        src = open_model(model, progress=False)
        src.close()
        cfg = src.cfg
        check_rank_count(cfg, nranks)
    except ValueError as e:
        return [f"model {model}: {str(e).splitlines()[0]}"]
    if cfg.num_lanes > 1:
        return [f"model {os.path.basename(model)}: {cfg.num_lanes} lanes, split by lanes (DTP)"] + [
            f"  rank {r}: lanes {cfg.lanes_of_rank(r, nranks).start}..{cfg.lanes_of_rank(r, nranks).stop - 1}"
            for r in range(nranks)]
    if nranks == 1:
        return [f"model {os.path.basename(model)}: one lane, on one rank"]
    out = [f"model {os.path.basename(model)}: one lane (H {cfg.num_attention_heads}, KV {cfg.kv_heads}, "
           f"F {cfg.intermediate_size}, V {cfg.vocab_size}), tensor parallel over {nranks} ranks"]
    for r in range(nranks):
        p = tp_plan(cfg, r, nranks)
        out.append(f"  rank {r}: heads {p.heads.start}..{p.heads.stop - 1}, KV heads {p.kv.start}..{p.kv.stop - 1}"
                   f"{' (replicated)' if p.kv_replicated else ''}, FFN {p.ffn.start}..{p.ffn.stop - 1}, "
                   f"vocab {p.vocab.start}..{p.vocab.stop - 1}")
    return out
