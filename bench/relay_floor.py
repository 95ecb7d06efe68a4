"""The least CPU a process that relays each streamed token costs on this machine: what `kog serve`'s gateway
does per token (a ZMQ message in from the coordinator, one write to the HTTP client's TCP socket), done by
the smallest programs that can do it, beside the real gateway's figure (bench/serve_overhead.py's "gateway
CPU/token").

    python3 bench/relay_floor.py [--n 150] [--gap-ms 23] [--load] [--json]

A sender process emits N small messages GAP apart; the relay under test forwards each to a sink process
over loopback TCP; the relay's CPU time (every thread of it, Linux schedstat) over N is its cost a token.
The ways:
  socket       one thread, a blocking recv on a plain TCP socket, then send (no ZMQ: the least a relay does)
  zmq          a blocking ZMQ DEALER recv, then send (ZMQ's I/O thread reads the socket and wakes the caller)
  zmq-pinned   the same with the relay's threads on one CPU (the I/O thread's wake-up stays on its CPU)
  zmq-asyncio  the gateway's structure: the DEALER's descriptor watched by an asyncio loop (add_reader),
               drained, each message written through an asyncio transport
--load runs a numpy GEMV on every core meanwhile, as the cpu backend's decode does on a small machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_overhead import cpu_ns  # noqa: E402  (CPU time of every thread of a process, Linux schedstat)
from launch.cli import free_port  # noqa: E402  (serve_overhead put the repository on the path)

WAYS = ("socket", "zmq", "zmq-pinned", "zmq-asyncio")


def _sink(port_q):
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    port_q.put(ls.getsockname()[1])
    c, _ = ls.accept()
    while c.recv(65536):
        pass


def _sender(way, addr, n, gap):
    """n messages gap apart, then b"E"; a ZMQ ROUTER (answers the relay's first frame) or a TCP client."""
    msg = b'{"type":"chunk","text":" word","token_ids":[42]}'
    if way == "socket":
        s = socket.create_connection(addr)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send = s.sendall
    else:
        import zmq
        r = zmq.Context().socket(zmq.ROUTER)
        r.bind(addr)
        ident, _ = r.recv_multipart()
        send = lambda m: r.send_multipart([ident, m])   # noqa: E731
    for _ in range(n):
        send(msg)
        time.sleep(gap)
    send(b"E")
    time.sleep(0.3)


def _load(stop):
    import numpy as np
    a = np.random.rand(4096, 4096).astype(np.float32)
    x = np.random.rand(4096).astype(np.float32)
    while not stop.is_set():
        a @ x


def relay(way: str, n: int, gap: float) -> float:
    """The relay's CPU a message (us), this process being the relay."""
    q = mp.Queue()
    sink = mp.Process(target=_sink, args=(q,), daemon=True)
    sink.start()
    out = socket.create_connection(("127.0.0.1", q.get(timeout=30)))
    out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if way == "socket":
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        snd = mp.Process(target=_sender, args=(way, ls.getsockname(), n, gap), daemon=True)
        snd.start()
        c, _ = ls.accept()
        c0 = cpu_ns(os.getpid())
        while not (d := c.recv(65536)).endswith(b"E"):
            out.sendall(b"data: " + d + b"\n\n")
    else:
        import zmq
        ep = f"tcp://127.0.0.1:{free_port()}"
        snd = mp.Process(target=_sender, args=(way, ep, n, gap), daemon=True)
        snd.start()
        ctx = zmq.Context()
        d = ctx.socket(zmq.DEALER)
        d.connect(ep)
        d.send(b"go")
        c0 = cpu_ns(os.getpid())
        if way == "zmq-asyncio":
            _asyncio_relay(d, out)
        else:
            while (m := d.recv()) != b"E":
                out.sendall(b"data: " + m + b"\n\n")
        d.close(0)
        ctx.term()
    c1 = cpu_ns(os.getpid())
    snd.join(10)
    sink.terminate()
    out.close()
    return (c1 - c0) / n / 1e3


def _asyncio_relay(d, out):
    import zmq

    async def main():
        loop = asyncio.get_running_loop()
        _, w = await asyncio.open_connection(sock=out.dup())
        done = loop.create_future()

        def drain():
            while d.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                m = d.recv(zmq.NOBLOCK)
                if m == b"E":
                    if not done.done():
                        done.set_result(None)
                    return
                w.write(b"data: " + m + b"\n\n")
        loop.add_reader(d.getsockopt(zmq.FD), drain)
        loop.call_soon(drain)        # the descriptor is edge-triggered: what came before add_reader
        await done
        loop.remove_reader(d.getsockopt(zmq.FD))
        w.close()
    asyncio.run(main())


def _one(way, n, gap, conn):
    """A relay in a fresh process (its own threads, affinity and CPU count)."""
    if way == "zmq-pinned":
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    conn.send(relay(way, n, gap))


def measure(n: int, gap: float, load: bool, repeats: int) -> dict:
    stop, loaders = mp.Event(), []
    if load:
        loaders = [mp.Process(target=_load, args=(stop,), daemon=True) for _ in range(os.cpu_count() or 1)]
        for p in loaders:
            p.start()
        time.sleep(0.5)
    rows = []
    try:
        for way in WAYS:
            runs = []
            for _ in range(repeats):
                a, b = mp.Pipe()
                p = mp.Process(target=_one, args=(way, n, gap, b))
                p.start()
                if not a.poll(60 + n * gap * 2):
                    p.kill()
                    raise RuntimeError(f"the {way} relay did not finish")
                runs.append(a.recv())
                p.join(10)
            rows.append({"way": way, "us_cpu_per_message": statistics.median(runs), "runs": runs})
    finally:
        stop.set()
        for p in loaders:
            p.join(5)
    return {"messages": n, "gap_ms": gap * 1e3, "load": load, "cpus": os.cpu_count(), "rows": rows}


def table(r: dict) -> str:
    out = [f"{r['messages']} messages {r['gap_ms']:g} ms apart, {r['cpus']} CPUs, "
           f"{'a GEMV on every core' if r['load'] else 'no other load'}; CPU of the relay process a message "
           f"(median of runs)",
           "| way         | us CPU a message | runs |", "|-------------|------------------|------|"]
    for w in r["rows"]:
        out.append(f"| {w['way']:<11} | {w['us_cpu_per_message']:>16.0f} | "
                   f"{' '.join(f'{x:.0f}' for x in w['runs'])} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=150, help="messages a run")
    ap.add_argument("--gap-ms", type=float, default=23.0, help="between messages (the cpu backend's ~23 ms a token)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--load", action="store_true", help="a numpy GEMV on every core meanwhile")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.n < 1 or a.gap_ms < 0 or a.repeats < 1:
        print("relay_floor: error: --n and --repeats >= 1, --gap-ms >= 0", file=sys.stderr)
        return 2
    r = measure(a.n, a.gap_ms / 1e3, a.load, a.repeats)
    print(json.dumps(r) if a.json else table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
