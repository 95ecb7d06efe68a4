"""The HTTP gateway's own cost, without a decode's noise: `kog serve --connect` in front of a paced stand-in
coordinator (this file's --coordinator mode: it speaks the protocol's health / generate / cancel and streams
one chunk every --gap-ms), the same streamed request straight to it (`kog client`'s library) and through the
gateway, alternated, as bench/serve_overhead.py does with real ranks.

    python3 bench/gateway_cost.py [--reps 40] [-n 64] [--gap-ms 23] [--json]

On a real model the decode's own spread (the prefill on shared cores) is wider than the gateway's cost and a
paired difference needs hundreds of pairs; here the coordinator answers in fixed time, so a few dozen pairs
give it to ~0.1 ms. Reported: TTFT of both paths and the median of the paired differences, split into the way
in (request sent -> the coordinator has it) and the way out (the coordinator sends the first token -> the
client has its event), from the stand-in's CLOCK_MONOTONIC stamps; and the gateway process's CPU a streamed
token. What it does not show: what that CPU takes from a decode sharing the cores (serve_overhead.py does).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)


def coordinator(endpoint: str, gap: float, stamps: str):
    """The stand-in: health, generate (accepted unless quiet, n chunks gap apart, result), cancel; each generate's arrival
    and first chunk's send times (time.monotonic) appended to `stamps`."""
    import msgpack
    import zmq
    s = zmq.Context().socket(zmq.ROUTER)
    s.bind(endpoint)
    rid = 0

    def reply(env, m):
        s.send_multipart(env + [msgpack.packb({"v": 1, **m}, use_bin_type=True)])
    while True:
        frames = s.recv_multipart()
        env, body = frames[:-1], msgpack.unpackb(frames[-1], raw=False)
        op, mid = body.get("op"), body.get("id")
        if op == "health":
            reply(env, {"id": mid, "type": "ok", "status": "ok", "protocol": 1, "model": "stand-in", "max_seq": 4096,
                        "vocab_size": 49152, "queue": 0, "queue_limit": 8, "active": None})
        elif op == "generate":
            t_in = time.monotonic()
            rid += 1
            n = int(body.get("max_new_tokens", 16))
            if not body.get("quiet"):                # as the coordinator: a quiet request that starts at once hears nothing
                reply(env, {"id": mid, "type": "accepted", "rid": rid, "position": 0})
            time.sleep(gap)                          # the prefill
            for i in range(n):
                if i == 0:
                    t_out = time.monotonic()
                reply(env, {"id": mid, "type": "chunk", "rid": rid, "token_ids": [100 + i], "text": " w"})
                if i == 0:
                    with open(stamps, "a") as f:
                        f.write(f"{t_in} {t_out}\n")
                time.sleep(gap)
            reply(env, {"id": mid, "type": "result", "rid": rid, "token_ids": list(range(100, 100 + n)),
                        "text": " w" * n, "stop_reason": "length",
                        "stats": {"new_tokens": n, "prompt_tokens": 4, "decode_ms": gap * 1e3 * n, "ttft_ms": gap * 1e3}})
        else:
            reply(env, {"id": mid, "type": "ok", "cancelled": []})


def measure(reps: int, n: int, gap: float, stamps: str) -> dict:
    import serve_overhead as so
    from kog_dist.client import Client
    from launch.cli import free_port
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH")))))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--coordinator", endpoint, "--stamps", stamps,
                               "--gap-ms", str(gap * 1e3)], env=env)]
    try:
        gw = subprocess.Popen([sys.executable, "-m", "kog_cli", "serve", "--connect", endpoint, "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
        procs.append(gw)
        url, deadline = None, time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = gw.stderr.readline()
            if not line:
                raise SystemExit("gateway_cost: error: kog serve --connect did not start")
            m = re.search(r"(http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        if "ready at" not in gw.stdout.readline():
            raise SystemExit("gateway_cost: error: the gateway did not become ready")
        http = so.RawHTTP(url)
        rows = {"direct": [], "gateway": []}
        with Client(endpoint, timeout=60) as zc:
            so.direct(zc, "warm", 2)
            so.gateway(http, url, "warm", 2)
            for i in range(reps):
                for path in (("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")):
                    c0 = so.cpu_ns(gw.pid)
                    t0, tf, _, _ = so.direct(zc, "x", n) if path == "direct" else so.gateway(http, url, "x", n)
                    c1 = so.cpu_ns(gw.pid)
                    with open(stamps) as f:
                        t_in, t_out = map(float, f.read().splitlines()[-1].split())
                    # time.perf_counter and time.monotonic are the same clock on Linux (CLOCK_MONOTONIC)
                    rows[path].append({"ttft": (tf - t0) * 1e3, "in": (t_in - t0) * 1e3, "out": (tf - t_out) * 1e3,
                                       "cpu_us": (c1 - c0) / 1e3 / n})
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    med = statistics.median
    out = {"reps": reps, "tokens": n, "gap_ms": gap * 1e3, "load": open("/proc/loadavg").read().split()[:3]}
    for k in ("ttft", "in", "out"):
        out[k] = {p: med(r[k] for r in rows[p]) for p in rows}
        diffs = [g[k] - d[k] for d, g in zip(rows["direct"], rows["gateway"])]
        out[k]["adds"] = med(diffs)
        out[k]["adds_quartiles"] = statistics.quantiles(diffs, n=4)[::2] if len(diffs) >= 4 else None
    out["gateway_cpu_us_per_token"] = med(r["cpu_us"] for r in rows["gateway"])
    return out


def table(r: dict) -> str:
    lines = [f"{r['reps']} pairs of {r['tokens']} tokens, a token every {r['gap_ms']:g} ms from the stand-in; load "
             f"{' '.join(r['load'])}; medians (ms)",
             "| path | TTFT | in: sent -> coordinator | out: first token -> client |", "|---|---|---|---|"]
    for p in ("direct", "gateway"):
        lines.append(f"| {'kog client (ZMQ)' if p == 'direct' else 'kog serve (HTTP)'} | {r['ttft'][p]:.3f} | "
                     f"{r['in'][p]:.3f} | {r['out'][p]:.3f} |")
    q = r["ttft"]["adds_quartiles"]
    lines.append(f"| gateway adds (paired medians) | **{r['ttft']['adds']:+.3f}** | {r['in']['adds']:+.3f} | "
                 f"{r['out']['adds']:+.3f} |")
    if q:
        lines.append(f"TTFT pairs' middle half {q[0]:+.3f}..{q[1]:+.3f} ms; the gateway's CPU "
                     f"{r['gateway_cpu_us_per_token']:.0f} us a streamed token")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("-n", type=int, default=64, help="tokens a request")
    ap.add_argument("--gap-ms", type=float, default=23.0, help="the stand-in's prefill and time a token")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--coordinator", metavar="ENDPOINT", help=argparse.SUPPRESS)   # the stand-in's own process
    ap.add_argument("--stamps", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.coordinator:
        coordinator(a.coordinator, a.gap_ms / 1e3, a.stamps)
        return 0
    if a.reps < 1 or a.n < 2 or a.gap_ms <= 0:
        print("gateway_cost: error: --reps >= 1, -n >= 2, --gap-ms > 0", file=sys.stderr)
        return 2
    import tempfile
    with tempfile.TemporaryDirectory() as t:
        r = measure(a.reps, a.n, a.gap_ms / 1e3, os.path.join(t, "stamps"))
    print(json.dumps(r) if a.json else table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
