"""The control plane over real sockets against a real one-process CpuBackend: ids equal the reference
engine's, sessions continue from the KV cache, cancel, queue and busy, stop strings, disconnects,
backend failure, eviction and expiry. (Multi-rank runs: test_control_mpi.py.)"""
from __future__ import annotations

import sys
import time

import pytest
import zmq

from kog_dist import protocol as P
from kog_dist.client import BusyError, Client, ServerError

from test_control_helpers import (Failing, LetterTokenizer, Reference, Server, Throttled, load, tiny_model,
                                  wait_until)

PROMPT = [1, 17, 42, 99, 7, 250]
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, seed=1234)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("ctl") / "m"))


@pytest.fixture(scope="module")
def ref(model):
    return Reference(model)


@pytest.fixture
def server(model):
    backend, cfg, tok = load(model, num_slots=3)
    with Server(backend, tok, cfg) as s:
        yield s


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_generate_and_stream_equal_reference(server, ref, sampling):
    want = ref.ids(PROMPT, 24, **sampling)
    with Client(server.endpoint, timeout=10) as c:
        r = c.generate(prompt_ids=PROMPT, max_new_tokens=24, **sampling)
        assert r.token_ids == r.ids == r["token_ids"] == want
        assert r.stop_reason == "length" and r.stats["new_tokens"] == 24
        assert r.stats["prefill_tokens"] == len(PROMPT) and r.stats["decode_tokens_per_s"] > 0
        st = c.stream(prompt_ids=PROMPT, max_new_tokens=24, **sampling)
        chunks = list(st)
        assert [t for ch in chunks for t in ch["token_ids"]] == want == st.result.token_ids
        assert "".join(ch["text"] for ch in chunks) == st.result.text
        # a text prompt: BOS + bytes, as `kog generate --prompt`
        r = c.generate(prompt="hi there", max_new_tokens=8, **sampling)
        assert r.token_ids == ref.ids(ref.tok.encode("hi there"), 8, **sampling)


def test_session_continues_from_cache(server, ref):
    a, b = [1, 5, 9, 33, 71], [120, 121, 122]
    with Client(server.endpoint, timeout=10) as c, c.session() as s:
        r0 = s.append(prompt_ids=a)
        assert r0.stop_reason == "append" and r0.token_ids == []
        g1 = s.generate(max_new_tokens=6, **SAMPLED)
        assert g1.token_ids == ref.ids(a, 6, **SAMPLED)
        assert g1.stats["prefill_tokens"] == 1 and g1.stats["reused_tokens"] == len(a) - 1
        r1 = s.append(prompt_ids=b)
        # only the last sampled token (never fed) and b are prefilled; a and g1 stay cached
        assert r1.stats["prefill_tokens"] == 1 + len(b)
        g2 = s.generate(max_new_tokens=6, **SAMPLED)
        ctx = a + g1.token_ids + b
        assert g2.token_ids == ref.ids(ctx, 6, **SAMPLED)
        assert g2.stats["prefill_tokens"] == 1 and g2.stats["reused_tokens"] == len(ctx) - 1
        # generate with a prompt in a session = append + generate
        g3 = s.generate(prompt_ids=[44, 45], max_new_tokens=4)
        ctx += g2.token_ids + [44, 45]
        assert g3.token_ids == ref.ids(ctx, 4) and g3.stats["prefill_tokens"] == 3
    st = Client(server.endpoint, timeout=10).stats()
    assert st["sessions"]["open"] == 0 and st["reused_tokens"] > 0


def test_cancel_stops_within_a_few_tokens(model):
    backend, cfg, tok = load(model)
    with Server(Throttled(backend, 0.01), tok, cfg) as srv, Client(srv.endpoint, timeout=10) as c:
        st = c.stream(prompt_ids=PROMPT, max_new_tokens=400)
        seen = []
        for ch in st:
            seen += ch["token_ids"]
            if len(seen) >= 5:
                break
        t0 = time.monotonic()
        assert st.cancel() == [st.rid]
        for ch in st:
            seen += ch["token_ids"]
        assert st.result.stop_reason == "cancel" and st.result.extra["cancel_reason"] == "cancel"
        assert st.result.token_ids == seen and len(seen) < 40         # 10 ms a token: a few after the cancel
        assert time.monotonic() - t0 < 2.0
        # cancel with nothing running cancels nothing; the server goes on
        assert c.cancel() == []
        assert c.generate(prompt_ids=PROMPT, max_new_tokens=3).stop_reason == "length"


class Spinning(Throttled):
    """A backend whose host holds the GIL between tokens, as the cuda backend's host does while it polls
    the kernel's token ring: after each token it spins `delay` seconds in Python. Stamps each token."""

    def run(self, cmd, on_token=None):
        def spin(t):
            self.emitted.append(time.perf_counter())
            go = on_token(t) if on_token else True
            end = time.perf_counter() + self.delay
            while time.perf_counter() < end:
                pass
            return go
        self.emitted = []
        return self.b.run(cmd, spin)


def test_tokens_reach_the_client_while_the_host_holds_the_gil(model):
    """The serving loop relays each token while the decode thread spins holding the GIL (the coordinator
    lowers the switch interval while it serves, and restores it after). At Python's default 5 ms the
    loop, then this in-process client, each waited up to 5 ms for the GIL: ~10 ms a token."""
    before = sys.getswitchinterval()
    backend, cfg, tok = load(model)
    spinning = Spinning(backend, 0.02)
    with Server(spinning, tok, cfg) as srv, Client(srv.endpoint, timeout=10) as c:
        lat = []
        for ch in c.stream(prompt_ids=PROMPT, max_new_tokens=12):
            now = time.perf_counter()
            lat += [now - spinning.emitted[len(lat) + k] for k in range(len(ch["token_ids"]))]
    assert len(lat) == 12
    assert sorted(lat)[len(lat) // 2] < 0.003, [round(x * 1e3, 2) for x in lat]
    assert sys.getswitchinterval() == before
    # two coordinators in one process: the first to stop leaves the interval low for the other
    with Server(backend, tok, cfg):
        with Server(backend, tok, cfg):
            pass
        assert sys.getswitchinterval() < before
    assert sys.getswitchinterval() == before


def test_queue_positions_and_busy(model):
    backend, cfg, tok = load(model)
    with Server(Throttled(backend, 0.01), tok, cfg, queue_limit=1) as srv:
        with Client(srv.endpoint, timeout=10) as a, Client(srv.endpoint, timeout=10) as b, \
                Client(srv.endpoint, timeout=10) as c:
            sa = a.stream(prompt_ids=PROMPT, max_new_tokens=300)
            next(sa)
            sb = b.stream(prompt_ids=PROMPT, max_new_tokens=3)
            sb._step()                                         # accepted
            assert sb.position == 1
            with pytest.raises(BusyError) as e:
                c.generate(prompt_ids=PROMPT, max_new_tokens=3)
            assert e.value.code == "busy"
            assert c.health()["queue"] == 1
            assert a.cancel(rid=sa.rid) == [sa.rid]                # only its owner may (test_control_hardening)
            list(sa)
            assert sa.result.stop_reason == "cancel"
            list(sb)
            assert len(sb.result.token_ids) == 3 and sb.result.stats["queue_ms"] > 0
            assert c.stats()["requests"]["busy"] == 1


def test_queued_request_cancelled_gets_error(model):
    backend, cfg, tok = load(model)
    with Server(Throttled(backend, 0.01), tok, cfg) as srv:
        with Client(srv.endpoint, timeout=10) as a, Client(srv.endpoint, timeout=10) as b:
            sa = a.stream(prompt_ids=PROMPT, max_new_tokens=300)
            next(sa)
            sb = b.stream(prompt_ids=PROMPT, max_new_tokens=3)
            sb._step()
            b.cancel(rid=sb.rid)
            with pytest.raises(ServerError) as e:
                list(sb)
            assert e.value.code == "cancelled"
            sa.close()
            assert sa.result.stop_reason == "cancel"


def test_stop_strings_and_stop_ids(model, ref):
    backend, cfg, _ = load(model)
    tok = LetterTokenizer()
    with Server(backend, tok, cfg) as srv, Client(srv.endpoint, timeout=10) as c:
        full = c.generate(prompt_ids=PROMPT, max_new_tokens=30)
        text = full.text
        stop = text[8:11]
        cut = text.find(stop)
        r = c.generate(prompt_ids=PROMPT, max_new_tokens=30, stop=[stop, "zzzzzzzz"])
        assert r.stop_reason == "stop" and r.text == text[:cut]
        assert r.token_ids == full.token_ids[:cut + len(stop)]          # one letter per id
        st = c.stream(prompt_ids=PROMPT, max_new_tokens=30, stop=stop)
        chunks = list(st)
        assert "".join(ch["text"] for ch in chunks) == text[:cut] == st.result.text
        assert all(stop not in ch["text"] for ch in chunks)
        sid = full.token_ids[5]
        r = c.generate(prompt_ids=PROMPT, max_new_tokens=30, stop_ids=[sid])
        k = full.token_ids.index(sid)
        assert r.stop_reason == "stop" and r.token_ids == full.token_ids[:k + 1]
        assert r.token_ids == ref.ids(PROMPT, 30, stop_ids=[sid]) and r.text == text[:k]


def test_disconnect_mid_stream_cancels(model):
    backend, cfg, tok = load(model)
    with Server(Throttled(backend, 0.01), tok, cfg, probe_s=0.1) as srv:
        ctx = zmq.Context.instance()
        for stream in (True, False):
            d = ctx.socket(zmq.DEALER)
            d.connect(srv.endpoint)
            d.send(P.packb({"v": 1, "op": "generate", "prompt_ids": PROMPT, "max_new_tokens": 400,
                            "stream": stream}))
            for _ in range(3):
                assert d.poll(5000)
                d.recv()
            d.close(0)
            t0 = time.monotonic()
            assert wait_until(lambda: srv.coord.active is None, 5.0), "the decode was not cancelled"
            assert time.monotonic() - t0 < 5.0                      # not the 4 s the decode would take
        with Client(srv.endpoint, timeout=10) as c:
            st = c.stats()
            assert st["requests"]["disconnected"] == 2 and st["tokens_generated"] < 200
            assert c.generate(prompt_ids=PROMPT, max_new_tokens=2).stop_reason == "length"


def test_backend_failure_fails_everything_and_exits_nonzero(model):
    backend, cfg, tok = load(model)
    srv = Server(Failing(backend, 0.01, after=20), tok, cfg)
    with Client(srv.endpoint, timeout=10) as a, Client(srv.endpoint, timeout=10) as b:
        sa = a.stream(prompt_ids=PROMPT, max_new_tokens=100)
        next(sa)
        sb = b.stream(prompt_ids=PROMPT, max_new_tokens=3)
        sb._step()
        for s in (sa, sb):
            with pytest.raises(ServerError) as e:
                list(s)
            assert e.value.code == "backend_failed" and "peer lost" in e.value.message
    srv.thread.join(5)
    assert not srv.thread.is_alive() and srv.rc == 1


def test_sessions_evicted_when_slots_run_out(model, ref):
    backend, cfg, tok = load(model, num_slots=1)
    with Server(backend, tok, cfg) as srv, Client(srv.endpoint, timeout=10) as c:
        s1, s2 = c.session(), c.session()
        g1 = s1.generate(prompt_ids=[1, 2 + 8, 30], max_new_tokens=4)
        h1 = s2.generate(prompt_ids=[1, 50, 60], max_new_tokens=4)        # takes s1's only slot
        g2 = s1.generate(prompt_ids=[70], max_new_tokens=4)
        # re-prefilled from the session's ids (the shared BOS at position 0 is reused)
        assert g2.stats["evicted"] and g2.stats["prefill_tokens"] == 3 + 4 + 1 - 1 == 8 - g2.stats["reused_tokens"]
        assert g2.token_ids == ref.ids([1, 10, 30] + g1.token_ids + [70], 4)
        h2 = s2.generate(max_new_tokens=4)
        assert h2.stats["evicted"] and h2.token_ids == ref.ids([1, 50, 60] + h1.token_ids, 4)
        assert c.stats()["slots"]["evictions"] == 3


def test_session_expiry_and_errors(model):
    backend, cfg, tok = load(model)
    with Server(backend, tok, cfg, max_sessions=2) as srv, Client(srv.endpoint, timeout=10) as c:
        s = c.session(ttl_s=0.2)
        s2 = c.session()
        with pytest.raises(ServerError) as e:
            c.session()
        assert e.value.code == "too_many_sessions"
        time.sleep(1.3)
        with pytest.raises(ServerError) as e:
            s.generate(max_new_tokens=2)
        assert e.value.code == "no_session"
        with pytest.raises(ServerError) as e:
            s2.generate(max_new_tokens=2)                # nothing in the context yet
        assert e.value.code == "bad_request"
        cases = [(dict(prompt_ids=[1, 300]), "bad_request"),
                 (dict(prompt_ids=list(range(1, 200)) * 6), "context_overflow"),
                 (dict(prompt_ids=[]), "bad_request"),
                 (dict(prompt_ids=[1], top_p=0.0), "bad_request"),
                 (dict(prompt_ids=[1], max_new_tokens=-1), "bad_request"),
                 (dict(prompt_ids=[1], session="nope"), "no_session")]
        for kw, code in cases:
            with pytest.raises(ServerError) as e:
                c.generate(**kw)
            assert e.value.code == code, (kw, e.value)
        n = backend.max_seq - 4
        r = c.generate(prompt_ids=[3 + i % 290 for i in range(n)], max_new_tokens=100)   # clamped to max_seq
        assert r.stats["new_tokens"] == 4 and r.stop_reason == "length" and r.stats["cached"] < backend.max_seq
        h = c.health()
        assert h["status"] == "ok" and h["protocol"] == P.VERSION and h["num_slots"] == 4
        st = c.stats()
        assert st["requests"]["bad_requests"] >= len(cases) and st["prefill_ms"]["n"] >= 1
        assert c.shutdown() == {"shutting_down": True}
    srv.thread.join(5)
    assert srv.rc == 0
