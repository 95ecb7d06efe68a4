"""`kog client` (generate, health, stats, run SCRIPT.jsonl, bad input), CURVE and bind refusal,
SIGTERM of a serving process during a decode."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

from kog_cli.client_cli import main
from kog_dist.client import Client, ServerError
from kog_dist.coordinator import ControlError, Coordinator

from test_control_helpers import REPO_ROOT, Reference, Server, load, tiny_model

PROMPT = [1, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("cli") / "m"))


@pytest.fixture(scope="module")
def ref(model):
    return Reference(model)


@pytest.fixture(scope="module")
def server(model):
    backend, cfg, tok = load(model)
    with Server(backend, tok, cfg) as s:
        yield s


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_health_stats(server, ref, capsys):
    rc, out, err = run_cli(capsys, "--connect", server.endpoint, "generate", "--prompt-ids", "1,17,42,99,7",
                           "-n", "9", "--temperature", "0.8", "--seed", "5", "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["token_ids"] == ref.ids(PROMPT, 9, temperature=0.8, seed=5) and r["stats"]["new_tokens"] == 9
    # --connect after the subcommand, text output, streaming
    rc, out, err = run_cli(capsys, "generate", "--connect", server.endpoint, "--prompt", "abc", "-n", "4", "--stream")
    assert rc == 0 and "tok/s" in err and "stop: " in err
    rc, out, err = run_cli(capsys, "--connect", server.endpoint, "health", "--json")
    assert rc == 0 and json.loads(out)["status"] == "ok"
    rc, out, err = run_cli(capsys, "--connect", server.endpoint, "stats")
    assert rc == 0 and "requests.served:" in out and "decode_tokens_per_s.p50:" in out


def test_run_script(server, ref, capsys, tmp_path):
    script = tmp_path / "s.jsonl"
    steps = [{"op": "append", "prompt_ids": [1, 5, 9]}, {"op": "generate", "max_new_tokens": 5},
             {"op": "append", "prompt": "xy", "add_bos": False},
             {"op": "generate", "max_new_tokens": 4, "temperature": 0.5, "seed": 3}]
    script.write_text("\n".join(json.dumps(s) for s in steps) + "\n\n")
    rc, out, err = run_cli(capsys, "--connect", server.endpoint, "run", str(script), "--json")
    assert rc == 0, err
    rows = json.loads(out)
    assert [r["op"] for r in rows] == ["append", "generate", "append", "generate"]
    g1, g2 = rows[1]["token_ids"], rows[3]["token_ids"]
    assert "token_ids" not in rows[0] and g1 == ref.ids([1, 5, 9], 5)
    ctx = [1, 5, 9] + g1 + ref.tok.encode("xy", add_bos=False)
    assert g2 == ref.ids(ctx, 4, temperature=0.5, seed=3)
    assert rows[3]["stats"]["prefill_tokens"] == 1
    rc, out, err = run_cli(capsys, "--connect", server.endpoint, "run", str(script))
    assert rc == 0 and out.splitlines()[0].split()[:3] == ["step", "op", "prefill"] and len(out.splitlines()) == 5


@pytest.mark.parametrize("argv, code, words", [
    (["generate"], 2, "required"),
    (["generate", "--prompt-ids", "1,x"], 2, "comma-separated"),
    (["--connect", "nonsense", "health"], 2, "bad endpoint"),
    (["frobnicate"], 2, "invalid choice"),
    (["generate", "--prompt-ids", "1,999999"], 1, "bad_request"),
    (["generate", "--prompt-ids", "1", "--top-p", "0"], 1, "top_p"),
    (["run", "/nonexistent.jsonl"], 2, "cannot read"),
])
def test_bad_input_one_line(server, capsys, argv, code, words):
    if "--connect" not in argv:
        argv = ["--connect", server.endpoint] + argv
    rc, out, err = run_cli(capsys, *argv)
    assert rc == code and words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("lines, words", [
    (["{"], "s.jsonl:1: not JSON"),
    (['{"op": "append", "prompt_ids": [1]}', '{"op": "jump"}'], "s.jsonl:2:"),
    (['{"op": "append"}'], "exactly one of prompt"),
    (['{"op": "generate", "max_new_tokens": "5"}'], "max_new_tokens"),
    (['{"op": "generate", "max_tokens": 5}'], "unknown field"),
    ([""], "no steps"),
])
def test_bad_script(server, capsys, tmp_path, lines, words):
    p = tmp_path / "s.jsonl"
    p.write_text("\n".join(lines))
    rc, out, err = run_cli(capsys, "--connect", server.endpoint, "run", str(p))
    assert rc == 2 and words in err and len(err.strip().splitlines()) == 1


def test_unreachable_server_times_out(capsys):
    rc, out, err = run_cli(capsys, "--connect", "tcp://127.0.0.1:9", "--timeout", "0.3", "health")
    assert rc == 1 and "no answer" in err


def test_client_exported_lazily():
    r = subprocess.run([sys.executable, "-c", "import sys, kog_dist; assert 'zmq' not in sys.modules; "
                        "from kog_dist import Client; import kog_dist.client as m; assert Client is m.Client"],
                       capture_output=True, text=True, timeout=30, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr


def test_kog_client_dispatch(server):
    r = subprocess.run([sys.executable, "-m", "kog_cli", "client", "--connect", server.endpoint, "health",
                        "--json"], capture_output=True, text=True, timeout=30, cwd=REPO_ROOT)
    assert r.returncode == 0 and json.loads(r.stdout)["protocol"] == 1, r.stderr


def test_bind_refusals_and_curve(model, tmp_path):
    import zmq.auth
    backend, cfg, tok = load(model)
    with pytest.raises(ControlError, match="not a loopback"):
        Coordinator("tcp://0.0.0.0:5555", backend, tok, cfg)
    with pytest.raises(ControlError, match="no CURVE keys"):
        Coordinator("tcp://*:5555", backend, tok, cfg, allow_remote=True)
    with pytest.raises(ControlError, match="not found"):
        Coordinator("tcp://*:5555", backend, tok, cfg, allow_remote=True, curve_keys=("/nope", str(tmp_path)))
    keys, clients, other = tmp_path / "keys", tmp_path / "clients", tmp_path / "other"
    for d in (keys, clients, other):
        d.mkdir()
    zmq.auth.create_certificates(str(keys), "server")
    cpub, csec = zmq.auth.create_certificates(str(keys), "client")
    zmq.auth.create_certificates(str(other), "stranger")
    os.rename(cpub, clients / "client.key")
    with Server(backend, tok, cfg, endpoint="tcp://0.0.0.0:0", allow_remote=True,
                curve_keys=(str(keys / "server.key_secret"), str(clients))) as srv:
        ep = "tcp://127.0.0.1:" + srv.endpoint.rsplit(":", 1)[1]
        with Client(ep, timeout=10, server_key=str(keys / "server.key"), client_key=csec) as c:
            assert c.generate(prompt_ids=PROMPT, max_new_tokens=3).stats["new_tokens"] == 3
        for kw in ({}, {"server_key": str(keys / "server.key"), "client_key": str(other / "stranger.key_secret")}):
            with Client(ep, timeout=0.5, **kw) as c, pytest.raises((TimeoutError, ConnectionError)):
                c.health()                                      # not authorised: no answer at all


def test_sigterm_during_decode(model):
    """SIGTERM while one decode runs and one waits: the running one ends with cancel_reason shutdown,
    the queued one gets shutting_down, and the process exits 0 promptly."""
    p = subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "tests", "test_control_helpers.py"), "serve",
                          model, "--delay", "0.01"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 30
        while "serving on" not in line and time.monotonic() < deadline:
            line = p.stdout.readline()
        ep = line.split("serving on ")[1].split()[0]
        with Client(ep, timeout=10) as a, Client(ep, timeout=10) as b:
            sa = a.stream(prompt_ids=PROMPT, max_new_tokens=400)
            next(sa)
            sb = b.stream(prompt_ids=PROMPT, max_new_tokens=3)
            sb._step()
            p.send_signal(signal.SIGTERM)
            list(sa)
            assert sa.result.stop_reason == "cancel" and sa.result.extra["cancel_reason"] == "shutdown"
            with pytest.raises(ServerError) as e:
                list(sb)
            assert e.value.code == "shutting_down"
        assert p.wait(timeout=10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_ipc_endpoint(model, ref, tmp_path):
    backend, cfg, tok = load(model)
    with Server(backend, tok, cfg, endpoint=f"ipc://{tmp_path}/kog.sock") as srv:
        with Client(srv.endpoint, timeout=10) as c:
            assert c.generate(prompt_ids=PROMPT, max_new_tokens=5).token_ids == ref.ids(PROMPT, 5)
            assert c.shutdown() == {"shutting_down": True}       # ipc peers are local: allowed
