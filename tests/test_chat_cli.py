"""`kog chat` as a user runs it: its own one-process server, turns that reuse the session's KV cache,
/stats, /reset, Ctrl-C stopping an answer (the chat goes on), end of input leaving with 0; and
--connect to a running coordinator. The real SmolLM2 GGUF answers two turns when it is present."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import pytest

from serve_helpers import ENV, REPO_ROOT, SMOL_GGUF, Coordinator, kog, tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("chat") / "m")


def _stats(out: str) -> list[dict]:
    rows = []
    for m in re.finditer(r"stats: turn (\d+): ttft_ms ([\d.]+), tokens_per_s ([\d.]+), new_tokens (\d+), "
                         r"reused_tokens (\d+), prefill_tokens (\d+), context (\d+), stop (\w+)", out):
        rows.append({"turn": int(m[1]), "ttft_ms": float(m[2]), "tps": float(m[3]), "new": int(m[4]),
                     "reused": int(m[5]), "prefill": int(m[6]), "context": int(m[7]), "stop": m[8]})
    return rows


def _chat(args, stdin_text, timeout=60):
    p = subprocess.run(kog("chat", *args), input=stdin_text, capture_output=True, text=True, env=ENV,
                       cwd=REPO_ROOT, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def test_local_turns_reuse_the_session_and_reset(model):
    rc, out, err = _chat(["--model", model, "--backend", "cpu", "-n", "6", "--temperature", "0"],
                         "hello there\n/stats\nand a second question\n/stats\n/reset\n/stats\n/bogus\nthird\n")
    assert rc == 0, err
    assert "Traceback" not in err and "no chat template" in err
    s = _stats(out)
    assert [r["turn"] for r in s] == [1, 2]
    assert s[0]["reused"] == 0 and s[0]["new"] == 6 and s[0]["tps"] > 0
    # the second turn keeps the first turn's context in the session's slot: only the new part prefills
    # (at least the first prompt; the random model's answer is invalid UTF-8, so its text re-encodes differently)
    assert s[1]["reused"] >= s[0]["prefill"] - 1
    assert s[1]["context"] > s[0]["context"] and s[1]["reused"] > 0
    assert "(a new conversation)" in out and "stats: no turns yet" in out and "unknown command /bogus" in out


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(model):
    with Coordinator(model, delay=0.02) as c:
        p = subprocess.Popen(kog("chat", "--connect", c.endpoint, "-n", "150", "--temperature", "0"),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
                             cwd=REPO_ROOT)
        got, err = bytearray(), bytearray()

        def read(pipe, into):
            for part in iter(lambda: os.read(pipe.fileno(), 4096), b""):
                into.extend(part)
        reader = threading.Thread(target=read, args=(p.stdout, got), daemon=True)
        reader.start()
        threading.Thread(target=read, args=(p.stderr, err), daemon=True).start()
        deadline = time.monotonic() + 20
        while b"kog chat: model" not in err and time.monotonic() < deadline:
            time.sleep(0.02)
        p.stdin.write(b"tell me a long story\n")
        p.stdin.flush()
        while len(got) < 8 and time.monotonic() < deadline:     # a few tokens of the answer arrived
            time.sleep(0.01)
        assert len(got) >= 8, err.decode(errors="replace")
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        while b"[stopped]" not in got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b"[stopped]" in got and time.monotonic() - t0 < 3.0
        p.stdin.write(b"/stats\nshort one\n/stats\n")
        p.stdin.close()
        assert p.wait(30) == 0, err.decode(errors="replace")
        reader.join(5)
        s = _stats(got.decode(errors="replace"))
        assert [r["stop"] for r in s][:1] == ["cancel"] and len(s) == 2, got.decode(errors="replace")
        assert s[0]["new"] < 100                       # stopped well before its 150 tokens (3 s)
        assert s[1]["reused"] > 0                      # the stopped answer stays in the session's context


@pytest.mark.skipif(not os.path.isfile(SMOL_GGUF), reason=f"{SMOL_GGUF} is absent (CI fetches it once)")
def test_smollm2_two_turns():
    rc, out, err = _chat(["--model", SMOL_GGUF, "--backend", "cpu", "--max-seq", "256", "-n", "24",
                          "--temperature", "0"], "What is the capital of France?\nAnd of Italy?\n/stats\n",
                         timeout=120)
    if rc != 0 and "gguf" in err.lower():
        pytest.skip(f"this tree cannot serve the GGUF yet: {err.strip().splitlines()[-1]}")
    assert rc == 0, err
    lines = out.splitlines()
    assert "Paris" in lines[0] and "Rome" in lines[1]
    (s,) = _stats(out)
    assert s["stop"] == "eos" and s["prefill"] < 20 and s["reused"] > 30
