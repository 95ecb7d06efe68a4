"""Hostile neighbours on loopback (issue 32): two clients of one server, where B tries to take what is
A's. B cannot cancel A's requests or use A's sessions, cannot shut the server down without its secret
(written 0600 in the runtime directory), cannot hold more than its share of the queue or its cap of
sessions; a flood from A leaves B its queue places; session TTLs are bounded by the server; sampling
parameters are checked at the edge; a refused CURVE handshake says so; a peer check that fails ends
the job with backend_failed even while the decode thread is stuck."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time

import pytest
import zmq

from kog_dist import control_auth as A
from kog_dist import protocol as P
from kog_dist.client import BusyError, Client, HandshakeRefused, ServerError

from test_control_helpers import REPO_ROOT, Reference, Server, Throttled, load, tiny_model, wait_until

PROMPT = [1, 17, 42, 99, 7, 250]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("hard") / "m"))


@pytest.fixture(autouse=True)
def runtime(tmp_path, monkeypatch):
    """Each test's servers leave their secrets in a runtime directory of its own."""
    d = tmp_path / "xdg"
    d.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(d))
    return d


@pytest.fixture
def slow(model):
    backend, cfg, tok = load(model, num_slots=3)
    with Server(Throttled(backend, 0.01), tok, cfg, queue_limit=4, max_client_sessions=3,
                session_ttl_max_s=30.0) as s:
        yield s


def _err(fn, *args, **kw) -> ServerError:
    with pytest.raises(ServerError) as e:
        fn(*args, **kw)
    return e.value


def test_b_cannot_cancel_or_touch_what_is_a(slow):
    with Client(slow.endpoint, timeout=10) as a, Client(slow.endpoint, timeout=10) as b, \
            Client(slow.endpoint, timeout=10) as a_queued:
        s = a.session()
        st = s.stream(prompt_ids=PROMPT, max_new_tokens=300)
        next(st)
        q = a_queued.stream(prompt_ids=PROMPT, max_new_tokens=2)      # another client's queued request
        q._step()
        assert q.position == 1
        for rid in (st.rid, q.rid):
            e = _err(b.cancel, rid=rid)
            assert e.code == "forbidden" and f"request {rid} belongs to another client" in e.message
        assert b.cancel() == []                       # no rid: only the caller's own running request
        for call in (lambda: b.cancel(session=s.id), lambda: b._call("close", session=s.id),
                     lambda: b.generate(session=s.id, max_new_tokens=1),
                     lambda: b._call("append", session=s.id, prompt_ids=[5])):
            assert _err(call).code == "forbidden"
        h = b.health()
        assert h["active"] == st.rid and h["queue"] == 1 and h["sessions"] == 1      # nothing was touched
        # the owner may, from another socket (Client.cancel's own) sharing its token
        assert a.cancel(rid=st.rid) == [st.rid]
        list(st)
        assert st.result.stop_reason == "cancel"
        list(q)
        assert len(q.result.token_ids) == 2
        s.close()


def test_a_connection_without_a_token_owns_its_requests(slow):
    """Raw clients send no owner token: the connection is the owner; `cancel` without rid stops only the
    caller's running request."""
    def dealer():
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(slow.endpoint)
        return d

    def final(d, want):
        while True:
            assert d.poll(10000)
            m = P.unpackb(d.recv(), P.MAX_REPLY_BYTES)
            if m.get("id") == want and m["type"] in ("ok", "error", "result"):
                return m
    a, b = dealer(), dealer()
    a.send(P.packb({"v": 1, "id": 1, "op": "generate", "prompt_ids": PROMPT, "max_new_tokens": 300}))
    with Client(slow.endpoint, timeout=10) as c:
        assert wait_until(lambda: c.health()["active"] is not None, 5)
        rid = c.health()["active"]
    b.send(P.packb({"v": 1, "id": 2, "op": "cancel"}))
    assert final(b, 2)["cancelled"] == []
    b.send(P.packb({"v": 1, "id": 3, "op": "cancel", "rid": rid}))
    assert final(b, 3)["code"] == "forbidden"
    b.send(P.packb({"v": 1, "id": 4, "op": "cancel", "rid": rid, "owner": "x" * 16}))   # a guessed token
    assert final(b, 4)["code"] == "forbidden"
    a.send(P.packb({"v": 1, "id": 5, "op": "cancel"}))
    assert final(a, 5)["cancelled"] == [rid]
    assert final(a, 1)["stop_reason"] == "cancel"
    a.close(0), b.close(0)


def test_shutdown_needs_the_secret(model, runtime):
    backend, cfg, tok = load(model)
    srv = Server(backend, tok, cfg)
    try:
        path = A.secret_path(srv.endpoint)
        assert os.path.dirname(path) == str(runtime / "kog_dist")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        with Client(srv.endpoint, timeout=10) as b:
            for call in (lambda: b._call("shutdown"), lambda: b.shutdown(secret="0" * 64)):
                e = _err(call)
                assert e.code == "forbidden" and path in e.message
            assert b.health()["status"] == "ok"
        # the same user's `kog client shutdown` reads the file; the server removes it on the way out
        port = srv.endpoint.rsplit(":", 1)[1]
        r = subprocess.run([sys.executable, "-m", "kog_cli", "client", "--connect", f"tcp://localhost:{port}",
                            "shutdown", "--json"], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        assert r.returncode == 0 and '"shutting_down": true' in r.stdout, r.stderr
        srv.thread.join(10)
        assert srv.rc == 0 and not os.path.exists(path)
    finally:
        srv.stop()


def test_no_writable_runtime_directory_still_serves(model, runtime):
    (runtime / "kog_dist").write_text("not a directory")          # even root cannot make the folder
    backend, cfg, tok = load(model)
    with Server(backend, tok, cfg) as srv, Client(srv.endpoint, timeout=10) as c:
        assert c.generate(prompt_ids=PROMPT, max_new_tokens=2).stats["new_tokens"] == 2
        e = _err(c.shutdown)
        assert e.code == "forbidden" and "could not write" in e.message


def test_curve_clients_may_shut_down_and_a_refusal_says_so(model, tmp_path):
    import zmq.auth
    keys, clients, other = tmp_path / "keys", tmp_path / "clients", tmp_path / "other"
    for d in (keys, clients, other):
        d.mkdir()
    zmq.auth.create_certificates(str(keys), "server")
    cpub, csec = zmq.auth.create_certificates(str(keys), "client")
    os.rename(cpub, clients / "client.key")
    _, stranger = zmq.auth.create_certificates(str(other), "stranger")
    backend, cfg, tok = load(model)
    srv = Server(backend, tok, cfg, curve_keys=(str(keys / "server.key_secret"), str(clients)))
    try:
        server_key = str(keys / "server.key")
        for kw, words in (({}, "requires CURVE"),
                          (dict(server_key=server_key, client_key=stranger), "refused this client's CURVE key")):
            t0 = time.monotonic()
            with Client(srv.endpoint, timeout=5, **kw) as c, pytest.raises(HandshakeRefused) as e:
                c.health()
            assert words in str(e.value) and time.monotonic() - t0 < 3
        r = subprocess.run([sys.executable, "-m", "kog_cli", "client", "--connect", srv.endpoint, "--timeout", "5",
                            "--server-key", server_key, "--client-key", stranger, "health"],
                           capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and "refused this client's CURVE key" in r.stderr
        with Client(srv.endpoint, timeout=10, server_key=server_key, client_key=csec) as c:
            assert c._call("shutdown") == {"shutting_down": True}        # authenticated: no secret needed
        srv.thread.join(10)
        assert srv.rc == 0
    finally:
        srv.stop()


def test_a_port_that_speaks_no_zmtp_says_so():
    import socket
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def answer():
        for _ in range(2):
            c, _ = srv.accept()
            c.recv(64)
            c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            c.close()
    t = threading.Thread(target=answer, daemon=True)
    t.start()
    t0 = time.monotonic()
    with Client(f"tcp://127.0.0.1:{srv.getsockname()[1]}", timeout=10) as c, pytest.raises(HandshakeRefused) as e:
        c.health()
    assert "not a kog_dist control endpoint" in str(e.value) and time.monotonic() - t0 < 3
    srv.close()


def test_sessions_capped_per_client_and_ttl_bounded(slow):
    with Client(slow.endpoint, timeout=10) as a, Client(slow.endpoint, timeout=10) as b:
        mine = [a._call("open", ttl_s=86400.0 * 7) for _ in range(3)]
        assert all(m["ttl_s"] == 30.0 for m in mine)                 # the server's --session-ttl-max
        e = _err(a._call, "open")
        assert e.code == "too_many_sessions" and "this client holds 3" in e.message
        # a second connection with the same token is the same client
        with Client(slow.endpoint, timeout=10, owner=a.owner) as a2:
            assert _err(a2._call, "open").code == "too_many_sessions"
        s = b.session()                                               # B still gets one
        assert b.health()["sessions"] == 4
        s.close()
        a._call("close", session=mine[0]["session"])
        a._call("open")                                              # a place freed: A may open again


def test_flooding_client_leaves_others_their_queue_places(model):
    """A pipelines requests and re-sends every refused one at once (a fast retry loop on busy). B, a
    polite client, still gets every request in, with no busy, and A is served too."""
    backend, cfg, tok = load(model)
    with Server(Throttled(backend, 0.004), tok, cfg, queue_limit=4) as srv:
        stop, counts = threading.Event(), {"busy": 0, "accepted": 0, "result": 0}

        def flood():
            d = zmq.Context.instance().socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(srv.endpoint)
            n = 0
            while not stop.is_set():
                n += 1
                d.send(P.packb({"v": 1, "id": n, "op": "generate", "prompt_ids": PROMPT, "max_new_tokens": 3}))
                while d.poll(1 if n % 4 else 0):
                    m = P.unpackb(d.recv(), P.MAX_REPLY_BYTES)
                    k = "busy" if m.get("code") == "busy" else m["type"]
                    if k in counts:
                        counts[k] += 1
            d.close(0)
        t = threading.Thread(target=flood, daemon=True)
        t.start()
        try:
            assert wait_until(lambda: counts["busy"] > 20, 10), counts
            with Client(srv.endpoint, timeout=10) as b:
                got = []
                for i in range(8):
                    r = b.generate(prompt_ids=PROMPT, max_new_tokens=2)   # BusyError would fail the test
                    got.append(r.position)
                assert len(got) == 8
                assert b.stats()["queue_length"] <= 4
        finally:
            stop.set()
            t.join(5)
        assert counts["busy"] > 20 and counts["result"] > 5, counts


def test_one_client_holds_at_most_its_share_of_the_queue(slow):
    with Client(slow.endpoint, timeout=10) as a, Client(slow.endpoint, timeout=10) as b:
        running = a.stream(prompt_ids=PROMPT, max_new_tokens=300)
        next(running)
        share = [Client(slow.endpoint, timeout=10, owner=a.owner) for _ in range(3)]
        try:
            queued = []
            for c in share[:2]:
                queued.append(c.stream(prompt_ids=PROMPT, max_new_tokens=1))
                queued[-1]._step()
            e = _err(share[2].generate, prompt_ids=PROMPT, max_new_tokens=1)   # queue_limit 4: A's share is 2
            assert isinstance(e, BusyError) and "its share" in e.message
            qb = b.stream(prompt_ids=PROMPT, max_new_tokens=1)
            qb._step()
            assert qb.position == 3
            a.cancel(rid=running.rid)
            list(running)
            for q in queued + [qb]:
                list(q)
                assert q.result.stop_reason == "length"
        finally:
            for c in share:
                c.close()


def test_queue_share_is_a_server_setting(model):
    """A gateway that is the server's only client may be given the whole queue (--client-queue)."""
    backend, cfg, tok = load(model)
    with Server(Throttled(backend, 0.01), tok, cfg, queue_limit=3, queue_share=3) as srv, \
            Client(srv.endpoint, timeout=10) as a:
        running = a.stream(prompt_ids=PROMPT, max_new_tokens=300)
        next(running)
        more = [Client(srv.endpoint, timeout=10, owner=a.owner) for _ in range(4)]
        try:
            queued = []
            for c in more[:3]:                  # one at a time: three connections' frames race otherwise
                queued.append(c.stream(prompt_ids=PROMPT, max_new_tokens=1))
                queued[-1]._step()
            assert [q.position for q in queued] == [1, 2, 3]
            with pytest.raises(BusyError):
                more[3].generate(prompt_ids=PROMPT, max_new_tokens=1)      # the queue itself is full
            a.cancel(rid=running.rid)
            list(running)
            for q in queued:
                list(q)
        finally:
            for c in more:
                c.close()


@pytest.mark.parametrize("field, value", [("temperature", 2e6), ("temperature", -1e-300), ("temperature", "0"),
                                          ("temperature", float("nan")), ("top_k", (1 << 31) + 1), ("top_k", 1.0),
                                          ("top_p", 0.0), ("top_p", 1.0000001), ("seed", 1 << 64), ("seed", -1),
                                          ("max_new_tokens", (1 << 20) + 1), ("stop_ids", [1] * 257)])
def test_sampling_ranges_at_the_edge(field, value):
    with pytest.raises(P.ProtocolError) as e:
        P.parse_request({"v": 1, "op": "generate", "prompt_ids": [1], field: value})
    assert e.value.code == "bad_request" and field in e.value.message


def test_tiny_temperature_over_the_wire_is_greedy(model):
    backend, cfg, tok = load(model)
    ref = Reference(model)
    with Server(backend, tok, cfg) as srv, Client(srv.endpoint, timeout=10) as c:
        r = c.generate(prompt_ids=PROMPT, max_new_tokens=12, temperature=5e-324, seed=3)
        assert r.token_ids == ref.ids(PROMPT, 12) and r.stop_reason == "length"


class _Frozen(Throttled):
    """A backend whose peer check fails once `frozen` is set, while its run is stuck (a rank that
    stopped answering mid-decode: the decode thread waits on it, the socket loop must not)."""

    def __init__(self, backend):
        super().__init__(backend, 0.01)
        self.frozen = threading.Event()

    def run(self, cmd, on_token=None):
        def tok(t):
            while self.frozen.is_set():
                time.sleep(0.05)              # stuck, as in a kccl wait on a stopped peer
            return on_token(t)
        return super().run(cmd, tok)

    def check_peers(self):
        if self.frozen.is_set():
            raise RuntimeError("rank 1 (pid 4242) stopped responding: no heartbeat for 3.0 s")


def test_failed_peer_check_fails_everything_while_the_decode_is_stuck(model):
    backend, cfg, tok = load(model)
    ex = _Frozen(backend)
    srv = Server(ex, tok, cfg)
    try:
        with Client(srv.endpoint, timeout=10) as a, Client(srv.endpoint, timeout=10) as b:
            sa = a.stream(prompt_ids=PROMPT, max_new_tokens=300)
            next(sa)
            sb = b.stream(prompt_ids=PROMPT, max_new_tokens=3)
            sb._step()
            t0 = time.monotonic()
            ex.frozen.set()
            for s in (sa, sb):
                e = _err(list, s)
                assert e.code == "backend_failed" and "rank 1" in e.message
            assert time.monotonic() - t0 < 2
            srv.thread.join(5)
            assert srv.rc == 1 and time.monotonic() - t0 < 5
    finally:
        ex.frozen.clear()
