"""`kog serve`: the ranks, their coordinator and an OpenAI-compatible HTTP gateway, in one command.

    kog serve --model M [--np N] [--host 127.0.0.1] [--port 8000]
    kog serve --connect tcp://HOST:PORT [--host ...] [--port ...]    # front a running kog-worker job

Starts the rank program (one `python -m workers` process for --np 1, N ranks under mpiexec/mpirun/srun
otherwise), serves HTTP at once (503 until the model is loaded), prints the URL when the coordinator
answers `health`, and on Ctrl-C / SIGTERM stops the gateway, then the ranks (SIGTERM: they drain and
exit 0), and exits 0. The gateway is a client of the coordinator, never a second path to the ranks.
docs/serve.md has the routes, the errors and the security rules.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

from kog_dist import protocol as P
from kccl.mpirun import signal_job
from kccl.shm import sweep_mpich_segments
from launch.cli import LaunchError, build_command, detect, free_port

from .generate import _die_with_parent

try:        # starlette and uvicorn: kog chat needs neither
    import uvicorn

    from .gateway import MAX_BODY_BYTES, Gateway, served_name
except ImportError as _e:
    uvicorn = Gateway = served_name = None
    MAX_BODY_BYTES = 1 << 20
    _MISSING = _e.name



class UsageError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kog serve", description="OpenAI-compatible HTTP server (and playground at /) "
                                              "in front of the kog_dist ranks.")
    p.add_argument("--model", help="model path or built-in name (as kog-worker --model)")
    p.add_argument("--np", type=int, default=1, dest="nranks", help="ranks (more than 1: under mpiexec)")
    p.add_argument("--connect", metavar="ENDPOINT", help="front an already running kog-worker job "
                                                         "(its --control endpoint) instead of starting ranks")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: a free one; the URL is printed)")
    p.add_argument("--api-key", default=os.environ.get("KOG_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $KOG_API_KEY)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow a non-loopback --host without --api-key")
    p.add_argument("--served-model-name", help="the model id clients use (default: the model's file name)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request waits for its next coordinator message (a queued one hears "
                        "only when its place changes; a coordinator that stops answering health fails "
                        "its requests within seconds)")
    p.add_argument("--control", help="the endpoint the ranks bind (default: a free loopback port)")
    p.add_argument("--backend", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--max-seq", type=int, default=None)
    p.add_argument("--dtype", default=None, help="storage of the layer matrices (as kog-worker --dtype)")
    p.add_argument("--slots", type=int, default=4, help="KV caches (prefix reuse between requests)")
    p.add_argument("--queue-limit", type=int, default=8, help="requests waiting behind the running one (429 after)")
    p.add_argument("--speculative", type=int, default=None, metavar="K",
                   help="prompt-lookup speculative decoding with up to K (0..8; 0 = off) draft tokens for requests "
                        "that do not say (default: the backend's, off today on cpu and cuda; a request's "
                        "\"speculative\" field overrides)")
    p.add_argument("--bind", choices=("none", "cores", "numa"), default=None,
                   help="rank CPU binding (default: none for --np 1, cores otherwise)")
    p.add_argument("--failure-linger-s", type=float, default=5.0,
                   help="after the ranks died: answer 503 this long, then exit 1")
    p.add_argument("--server-key", help="with --connect: the server's CURVE public key file")
    p.add_argument("--client-key", help="with --connect: this client's CURVE secret key file")
    return p


def _is_loopback_host(host: str) -> bool:
    try:
        return P.is_loopback(f"tcp://{host}:0" if ":" not in host else f"tcp://[{host}]:0")
    except ValueError:
        return False


def check_args(a) -> None:
    if a.nranks < 1:
        raise UsageError("--np must be >= 1")
    if not 0 <= a.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {a.port}")
    if a.max_body_bytes < 1024:
        raise UsageError("--max-body-bytes must be at least 1024")
    if not _is_loopback_host(a.host) and not a.api_key and not a.insecure_no_auth:
        raise UsageError(f"--host {a.host} is reachable from other machines: give --api-key KEY "
                         f"(or $KOG_API_KEY), or --insecure-no-auth to serve without one")
    if a.connect:
        P.endpoint_host(a.connect)               # ValueError on a malformed endpoint
        if a.model or a.nranks != 1:
            raise UsageError("--connect fronts a running job: --model and --np belong to that job")
    if a.control:
        P.endpoint_host(a.control)


def listen(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before any rank starts: a busy port is one line and exit 2."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def rank_command(a, control: str) -> tuple[list[str], str | None]:
    """The ranks' command line, and its launcher's kind (None for one rank, started directly). Several
    ranks keep survivors (launch.cli.build_command): a dead rank then reaches the clients as
    backend_failed from rank 0, not as a lost server, under MPICH and Open MPI alike."""
    cmd = [sys.executable, "-m", "workers", "--control", control, "--backend", a.backend,
           "--bind", a.bind or ("none" if a.nranks == 1 else "cores"), "--slots", str(a.slots),
           "--queue-limit", str(a.queue_limit)]
    if getattr(a, "speculative", None) is not None:     # else the ranks' backend picks its default
        cmd += ["--speculative", str(a.speculative)]
    if a.model:
        cmd += ["--model", a.model]
    if a.max_seq:
        cmd += ["--max-seq", str(a.max_seq)]
    if getattr(a, "dtype", None):
        cmd += ["--dtype", a.dtype]
    if a.nranks == 1:
        return cmd, None
    try:
        launcher = detect()
        return build_command(launcher, a.nranks, cmd, keep_survivors=True), launcher.kind
    except LaunchError as e:
        raise UsageError(f"--np {a.nranks} needs an MPI launcher: {e}") from None


def start_ranks(cmd: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # a session of its own: the terminal's Ctrl-C reaches kog serve only, which then stops the ranks
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_die_with_parent)
    proc.started = time.time()   # stop_ranks sweeps MPICH's segments made since
    return proc


def stop_ranks(proc: subprocess.Popen, kind: str | None = None, grace_s: float = 15.0) -> int | None:
    """SIGTERM (the coordinator drains, tells the other ranks, all exit 0), then SIGKILL. kind: the
    launcher's (rank_command): Open MPI's mpirun takes SIGTERM as an abort, so there the ranks get it
    themselves (kccl.mpirun.signal_job)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            if kind is not None and sig == signal.SIGTERM:
                signal_job(proc.pid, sig, kind)
            else:
                os.killpg(proc.pid, sig)
        t = time.monotonic() + wait
        while proc.poll() is None and time.monotonic() < t:
            time.sleep(0.05)
    if proc.poll() is not None:   # a rank killed while starting left MPICH's segment named
        sweep_mpich_segments(proc.started, job_session=proc.pid)
    return proc.poll()


class _Server(uvicorn.Server if uvicorn is not None else object):
    """uvicorn without its own signal handling: kog serve decides what SIGINT/SIGTERM do."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self):      # older uvicorn
        pass

    def stop(self):
        self.should_exit = True
        if getattr(self, "_wake", None) is not None:
            self._wake.set()

    async def main_loop(self):
        """uvicorn's own loop wakes ten times a second to look at should_exit; this one once a second
        (the Date header's period: on_tick renews it when its counter is a multiple of 10) and at once
        on stop(). An idle gateway's wake-ups are CPU taken from the decode on a small machine."""
        self._wake = asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)


def _say(msg: str) -> None:
    print(f"kog serve: {msg}", file=sys.stderr, flush=True)


def _name(a) -> str | None:
    if a.served_model_name:
        return a.served_model_name
    return served_name(a.model) if a.model else None


async def _exited(proc: subprocess.Popen) -> None:
    """Until the rank job exits: its pidfd, where Linux has them, so that an idle gateway does not
    wake ten times a second to ask (on two cores shared with the decode, every wake-up costs it)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        fd = None
    if fd is None:
        while proc.poll() is None:
            await asyncio.sleep(0.1)
        return
    loop, done = asyncio.get_running_loop(), asyncio.Event()
    loop.add_reader(fd, done.set)
    try:
        while proc.poll() is None:
            await done.wait()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def _run(a, proc, control, sock) -> int:
    gw = Gateway(control, model_name=_name(a), api_key=a.api_key, max_body_bytes=a.max_body_bytes,
                 timeout=a.timeout, server_key=a.server_key, client_key=a.client_key, log=_say)
    config = uvicorn.Config(gw.app, host=a.host, port=a.port, log_level="warning", loop="asyncio", http="auto",
                            lifespan="on", timeout_graceful_shutdown=5, access_log=False)
    server = _Server(config)
    loop = asyncio.get_running_loop()
    why = {"signal": None}

    def on_signal(signum):
        why["signal"] = signum
        server.stop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    rc = {"rc": 0}

    async def supervise():
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.02)
        if not server.started:
            return
        sock = server.servers[0].sockets[0].getsockname()
        host = f"[{sock[0]}]" if ":" in sock[0] else sock[0]
        url = f"http://{host}:{sock[1]}"
        _say(f"HTTP on {url} (503 until the model is loaded); coordinator {control}")
        while not gw.ready.is_set():
            if proc is not None and proc.poll() is not None:
                _say(f"the ranks exited ({proc.returncode}) before the model was loaded")
                rc["rc"] = 1
                server.stop()
                return
            if server.should_exit:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(gw.ready.wait(), 0.1)
        print(f"kog serve: ready at {url}/ (model {gw.model_name}; OpenAI base URL {url}/v1)", flush=True)
        if proc is None:
            return
        await _exited(proc)
        if server.should_exit:
            return
        gw.fail(f"the rank job exited with status {proc.returncode}")
        _say(f"the ranks exited ({proc.returncode}); answering 503 for {a.failure_linger_s:g} s, then exiting 1")
        rc["rc"] = 1
        await asyncio.sleep(a.failure_linger_s)
        server.stop()

    sup = loop.create_task(supervise())
    await server.serve(sockets=[sock])
    sup.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sup
    if why["signal"] is not None:
        _say(f"{signal.Signals(why['signal']).name}: stopping")
    return rc["rc"]


def main(argv=None) -> int:
    if uvicorn is None:
        print(f"kog serve: error: {_MISSING} is not installed (kog serve needs starlette and uvicorn: "
              f"pip install starlette uvicorn)", file=sys.stderr)
        return 2
    try:
        a = parser().parse_args(argv)
        check_args(a)
        control = a.connect or a.control or f"tcp://127.0.0.1:{free_port()}"
        cmd, kind = (None, None) if a.connect else rank_command(a, control)
        sock = listen(a.host, a.port)
    except (UsageError, ValueError) as e:
        print(f"kog serve: error: {e}", file=sys.stderr)
        return 2
    proc = start_ranks(cmd) if cmd is not None else None
    try:
        rc = asyncio.run(_run(a, proc, control, sock))
    except KeyboardInterrupt:
        rc = 0
    finally:
        if proc is not None:
            code = stop_ranks(proc, kind)
            if code not in (0, None, -signal.SIGTERM) and proc.returncode is not None:
                _say(f"the ranks exited with status {code}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
