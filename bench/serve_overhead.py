"""What the HTTP gateway adds: the same streamed greedy request through `kog client` (the sync ZMQ
client, straight to the coordinator) and through `kog serve`'s /v1/completions, alternated, side by side.

    python bench/serve_overhead.py --model FILE.gguf [-n 64] [--reps 10] [--np 1] [--backend cpu] [--blas-threads 1]
    python bench/serve_overhead.py --connect tcp://127.0.0.1:5555 --url http://127.0.0.1:8000

Both are measured in this process, from sending the request: TTFT to the first token's event, and
the time per token from the first event to the last over (tokens - 1). Every request's prompt starts
with a letter the last 51 did not, so each prefills the same number of tokens (no prefix reuse; the ranks'
reused_tokens are checked).

Two more columns say where a difference comes from: "decode/token" is the ranks' own decode time a
token (the result's stats), so a gateway that slows the decode itself (CPU taken from it on a small
machine) shows there, not only at the client; "gateway CPU/token" is the CPU time the `kog serve`
process spent during the request over its tokens (Linux, when this script started it; its ranks are
other processes), idle between requests as well as streaming.

The TTFT difference is also split at the coordinator's own stamps (accepted -> first token, its stats' queue_ms +
ttft_ms): the coordinator's part (the prefill, which a gateway slows only by taking CPU from it) carries the
prefill's whole spread; the rest (request sent -> accepted, first token -> the client has it) is the gateway's
ways in and out, bounded by far fewer pairs.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import socket
import statistics
import string
import subprocess
import sys
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kog_dist.client import Client  # noqa: E402

PROMPT = "The river flows through the valley, and the people who live along its banks"


def cpu_ns(pid) -> int | None:
    """CPU time of every thread of a process so far (Linux schedstat), None where unknown."""
    if pid is None:
        return None
    total, found = 0, False
    for f in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(f) as fh:
                total += int(fh.read().split()[0])
            found = True
        except (OSError, ValueError, IndexError):
            pass
    return total if found else None


def direct(c, prompt, n):
    t0 = time.perf_counter()
    t_first = t_last = None
    s = c.stream(prompt=prompt, max_new_tokens=n, temperature=0.0)
    for ch in s:
        if ch["token_ids"]:
            t_last = time.perf_counter()
            t_first = t_first or t_last
    return t0, t_first, t_last, s.result.stats


class RawHTTP:
    """A keep-alive HTTP/1.1 connection read by hand: the client's own parsing (httpx costs a few
    hundred microseconds a request) stays out of what is measured as the gateway's."""

    def __init__(self, url):
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        self.addr, self.host, self.sock = (host, int(port)), f"{host}:{port}", None
        self._connect()

    def _connect(self):
        if self.sock is not None:
            self.sock.close()
        self.sock = socket.create_connection(self.addr)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def _idle_closed(self) -> bool:
        """uvicorn closes a keep-alive connection idle for 5 s (a slow direct request in between)."""
        self.sock.setblocking(False)
        try:
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        finally:
            self.sock.setblocking(True)

    def _more(self):
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the gateway closed the connection")
        self.buf += data

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._more()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _read(self, n) -> bytes:
        while len(self.buf) < n:
            self._more()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def post_stream(self, path, body):
        """Yields the body's chunks of a chunked response as they arrive."""
        data = json.dumps(body).encode()
        if self._idle_closed():
            self._connect()
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        status = self._line()
        if b" 200 " not in status:
            raise RuntimeError(status.decode())
        while self._line():
            pass                                           # headers (chunked transfer encoding)
        while True:
            size = int(self._line(), 16)
            chunk = self._read(size + 2)[:-2]
            if size == 0:
                return
            yield chunk


def gateway(http, url, prompt, n):
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    t_first = t_last = None
    stats = {}
    for chunk in http.post_stream("/v1/completions", body):
        for ev in chunk.split(b"\n\n"):
            if ev.startswith(b"data: {") and b'"finish_reason":null' in ev:
                t_last = time.perf_counter()
                t_first = t_first or t_last
            elif b'"kog_stats"' in ev:
                stats = json.loads(ev[6:])["kog_stats"]
    return t0, t_first, t_last, stats


def start_serve(a):
    cmd = [sys.executable, "-m", "kog_cli", "serve", "--port", "0", "--model", a.model, "--np", str(a.np),
           "--backend", a.backend]
    if a.max_seq:
        cmd += ["--max-seq", str(a.max_seq)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH")))))
    if a.blas_threads:          # the ranks' BLAS threads (kog serve passes its environment on)
        env.update(OPENBLAS_NUM_THREADS=str(a.blas_threads), OMP_NUM_THREADS=str(a.blas_threads))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    url = control = None
    seen = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (url is None or control is None):
        line = p.stderr.readline()
        if not line:
            break
        seen.append(line.rstrip())
        m = re.search(r"HTTP on (http://\S+) .*coordinator (tcp://\S+)", line)
        if m:
            url, control = m.group(1), m.group(2)
    line = p.stdout.readline() if url is not None else ""
    if "ready at" not in line:   # not started, or not ready: its last words on stderr say why
        p.kill()
        seen += [x for x in p.communicate(timeout=30)[1].splitlines() if x.strip()]
        raise SystemExit(f"kog serve did not {'become ready' if url else 'start'}: "
                         f"{line.strip() or ' | '.join(seen[-3:]) or 'no output'}")
    return p, url, control


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--np", type=int, default=1)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--max-seq", type=int, default=None)
    ap.add_argument("--connect", help="a running coordinator (with --url: its gateway)")
    ap.add_argument("--url")
    ap.add_argument("-n", type=int, default=64, help="tokens per request")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--pause-ms", type=float, default=0.0,
                    help="idle time before each request, so none starts in the previous one's tail")
    ap.add_argument("--json-out", help="write every pair's measurements here (JSON), as they were taken")
    ap.add_argument("--blas-threads", type=int, default=None,
                    help="BLAS threads of the ranks (default: theirs; 1 leaves a core to the gateway on 2 cores)")
    a = ap.parse_args(argv)
    proc = None
    if a.connect:
        if not a.url:
            raise SystemExit("--connect needs --url (the gateway in front of it)")
        url, control = a.url.rstrip("/"), a.connect
    else:
        if not a.model:
            raise SystemExit("give --model (or --connect and --url)")
        proc, url, control = start_serve(a)
    rows = {"kog client (ZMQ)": [], "kog serve (HTTP)": []}
    try:
        # both keep their connection between requests (as a gateway and a client library do)
        http = RawHTTP(url)
        with Client(control, timeout=120) as zc:
            direct(zc, "warm " + PROMPT, 4)
            gateway(http, url, "warm " + PROMPT, 4)
            reused = 0
            for i in range(a.reps):                  # alternate the order: neither path always goes first
                for k, name in enumerate(list(rows) if i % 2 == 0 else list(rows)[::-1]):
                    is_direct = name.startswith("kog client")
                    # a first letter no recent request had: no prompt shares a prefix with one the ranks keep
                    # (starting with the pair's number, the second of a pair reused its first digits' KV and
                    # prefilled ~2 ms faster, whichever path it was)
                    prompt = f"{string.ascii_letters[(2 * i + k) % 52]}{i:03d}{'d' if is_direct else 'g'} {PROMPT}"
                    if a.pause_ms:
                        time.sleep(a.pause_ms / 1e3)
                    c0 = cpu_ns(proc.pid if proc is not None else None)
                    t0, tf, tl, st = direct(zc, prompt, a.n) if is_direct else gateway(http, url, prompt, a.n)
                    c1 = cpu_ns(proc.pid if proc is not None else None)
                    nt = int(st.get("new_tokens", a.n))
                    reused = max(reused, int(st.get("reused_tokens", 0)))
                    rows[name].append(((tf - t0) * 1000, (tl - tf) * 1000 / max(1, a.n - 1),
                                       float(st.get("decode_ms", 0.0)) / max(1, nt - 1),
                                       (c1 - c0) / 1e6 / max(1, nt) if c0 is not None and c1 is not None else None,
                                       float(st.get("queue_ms", 0.0)) + float(st.get("ttft_ms", 0.0))))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"n": a.n, "reps": a.reps, "fields": ["ttft_ms", "per_token_ms", "decode_per_token_ms",
                                                            "gateway_cpu_ms_per_token", "coordinator_ttft_ms"],
                       **rows}, f)
    if reused:
        print(f"warning: a request reused {reused} cached prompt tokens: its TTFT is not comparable", file=sys.stderr)
    print(f"{a.reps} requests each, {a.n} tokens, greedy, streamed; medians (ms); load average "
          f"{' '.join(open('/proc/loadavg').read().split()[:3]) if os.path.exists('/proc/loadavg') else '?'}")
    print(f"{'path':<20} {'TTFT':>9} {'per token':>10} {'decode/token':>13} {'gateway CPU/token':>18}")
    med = statistics.median
    for name, v in rows.items():
        cpu = [x[3] for x in v if x[3] is not None]
        print(f"{name:<20} {med(x[0] for x in v):>9.3f} {med(x[1] for x in v):>10.4f} {med(x[2] for x in v):>13.4f} "
              f"{med(cpu) if cpu else float('nan'):>18.4f}")
    # each repetition ran both paths back to back: the median of the paired differences follows the
    # gateway's cost even while other work on the machine makes both paths drift
    (d, g) = rows.values()
    diff = [med(gi[k] - di[k] for di, gi in zip(d, g)) for k in (0, 1, 2)]
    base = med(x[1] for x in d)
    print(f"{'gateway adds':<20} {diff[0]:>9.3f} {diff[1]:>10.4f} {diff[2]:>13.4f}   ({100 * diff[1] / base:+.2f}% "
          f"per token; medians of the paired differences)")
    if len(d) >= 4:             # how far the pairs spread: a difference inside it is noise
        q = [statistics.quantiles([gi[k] - di[k] for di, gi in zip(d, g)], n=4) for k in (0, 1)]
        print(f"{'  middle half':<20} {q[0][0]:>+.2f}..{q[0][2]:<+.2f} {q[1][0]:>+.3f}..{q[1][2]:+.3f}   "
              f"(the paired differences' quartiles)")
        ci = [median_interval([gi[k] - di[k] for di, gi in zip(d, g)]) for k in (0, 1)]
        print(f"{'  95% interval':<20} {ci[0][0]:>+.2f}..{ci[0][1]:<+.2f} {ci[1][0]:>+.3f}..{ci[1][1]:+.3f}   "
              f"({100 * ci[1][0] / base:+.2f}%..{100 * ci[1][1] / base:+.2f}% per token: the median's, "
              f"bootstrapped over the pairs)")
        # the TTFT split at the coordinator's own stamps (accepted -> first token: queue_ms + ttft_ms): the
        # prefill's spread stays in its part, so the ways in and out are bounded by far fewer pairs
        own = [gi[4] - di[4] for di, gi in zip(d, g)]
        ways = [(gi[0] - gi[4]) - (di[0] - di[4]) for di, gi in zip(d, g)]
        for label, xs in (("coordinator's TTFT", own), ("ways in and out", ways)):
            lo, hi = median_interval(xs)
            print(f"{'  of which':<11}{label:<19} {med(xs):>+.3f} ms (95% {lo:+.2f}..{hi:+.2f}): "
                  + ("accepted -> first token, the prefill the gateway's CPU may slow" if label[0] == "c" else
                     "request sent -> accepted, first token -> the client has it"))


def median_interval(xs, level=0.95, rounds=2000, seed=0):
    """A bootstrap interval of the median of xs (the pairs resampled with replacement, a fixed seed): the
    bound a run can show, which narrows with the square root of the pairs."""
    import random
    rng = random.Random(seed)
    n = len(xs)
    meds = sorted(statistics.median(rng.choices(xs, k=n)) for _ in range(rounds))
    lo = meds[int((1 - level) / 2 * rounds)]
    hi = meds[min(rounds - 1, int((1 + level) / 2 * rounds))]
    return lo, hi


if __name__ == "__main__":
    main()
