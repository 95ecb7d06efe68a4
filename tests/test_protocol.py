"""The protocol schema, and a hypothesis fuzz of a live coordinator: malformed msgpack, wrong types,
huge length headers, oversize and multi-part frames, raw TCP garbage. The server must answer every
single-frame message with a well-formed reply, keep serving, and still give the reference ids."""
from __future__ import annotations

import socket
import struct

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kog_dist import protocol as P
from kog_dist.client import Client

from test_control_helpers import Reference, Server, load, tiny_model

PROMPT = [1, 17, 42, 99, 7]


def test_parse_request_defaults_and_normalisation():
    r = P.parse_request({"v": 1, "op": "generate", "prompt": "hi", "stop": "x", "id": 7})
    assert r["id"] == 7 and r["stop"] == ["x"] and r["max_new_tokens"] == 64 and r["stream"] is False
    assert r["temperature"] == 0.0 and r["top_p"] == 1.0 and r["stop_ids"] == []
    assert P.parse_request({"v": 1, "op": "health"}) == {"op": "health", "id": None}
    assert P.parse_request({"v": 1, "op": "generate", "session": "s"})["session"] == "s"
    assert P.parse_request({"v": 1, "op": "cancel", "rid": 3}) == {"op": "cancel", "id": None, "rid": 3}


@pytest.mark.parametrize("msg, code", [
    ({"op": "health"}, "bad_request"),
    ({"v": 2, "op": "health"}, "unsupported_version"),
    ({"v": "1", "op": "health"}, "bad_request"),
    ({"v": 1, "op": "frobnicate"}, "unknown_op"),
    ({"v": 1, "op": 5}, "bad_request"),
    ({"v": 1, "op": "health", "extra": 1}, "bad_request"),
    ({"v": 1, "op": "generate"}, "bad_request"),
    ({"v": 1, "op": "generate", "prompt": "a", "prompt_ids": [1]}, "bad_request"),
    ({"v": 1, "op": "generate", "prompt_ids": [1, -1]}, "bad_request"),
    ({"v": 1, "op": "generate", "prompt_ids": [1, True]}, "bad_request"),
    ({"v": 1, "op": "generate", "prompt_ids": "1,2"}, "bad_request"),
    ({"v": 1, "op": "generate", "prompt_ids": [1], "max_new_tokens": 1.5}, "bad_request"),
    ({"v": 1, "op": "generate", "prompt_ids": [1], "max_new_tokens": True}, "bad_request"),
    ({"v": 1, "op": "generate", "prompt_ids": [1], "temperature": float("nan")}, "bad_request"),
    ({"v": 1, "op": "generate", "prompt_ids": [1], "top_p": 0}, "bad_request"),
    ({"v": 1, "op": "generate", "prompt_ids": [1], "seed": 1 << 64}, "bad_request"),
    ({"v": 1, "op": "generate", "prompt_ids": [1], "stop": [""]}, "bad_request"),
    ({"v": 1, "op": "generate", "prompt_ids": [1], "stop": ["a"] * 17}, "bad_request"),
    ({"v": 1, "op": "generate", "prompt_ids": [1], "stream": 1}, "bad_request"),
    ({"v": 1, "op": "append", "prompt_ids": [1]}, "bad_request"),
    ({"v": 1, "op": "close"}, "bad_request"),
    ({"v": 1, "op": "health", "id": [1]}, "bad_request"),
    ({"v": 1, "op": "open", "ttl_s": -1}, "bad_request"),
])
def test_parse_request_refuses(msg, code):
    with pytest.raises(P.ProtocolError) as e:
        P.parse_request(msg)
    assert e.value.code == code and "\n" not in e.value.message


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x93\x01", b"\x91\x01\x02", msgpack.packb([1, 2]),
                                  msgpack.packb({1: 2}), msgpack.packb(msgpack.ExtType(5, b"x")),
                                  b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff",
                                  b"\x91" * 5000, b"\xd6\xff\x00\x00\x00\x00"])
def test_unpack_refuses_garbage(data):
    with pytest.raises(P.ProtocolError) as e:
        P.unpackb(data)
    assert e.value.code == "bad_request"


def test_unpack_refuses_oversize():
    with pytest.raises(P.ProtocolError) as e:
        P.unpackb(b"\x00" * (P.MAX_FRAME_BYTES + 1))
    assert e.value.code == "too_large"


def test_every_code_is_documented():
    doc = open(__file__.replace("tests/test_protocol.py", "docs/protocol.md")).read()
    for code in P.ERROR_CODES:
        assert f"`{code}`" in doc, code
    for op in P.OPS:
        assert f"`{op}`" in doc, op


def test_loopback_endpoints():
    assert P.is_loopback("tcp://127.0.0.1:5555") and P.is_loopback("tcp://[::1]:1")
    assert P.is_loopback("tcp://localhost:1") and P.is_loopback("ipc:///tmp/kog.sock")
    assert not P.is_loopback("tcp://*:5555") and not P.is_loopback("tcp://0.0.0.0:5555")
    assert not P.is_loopback("tcp://10.1.2.3:5555") and not P.is_loopback("tcp://eth0:5555")
    with pytest.raises(ValueError):
        P.endpoint_host("udp://1.2.3.4:5")


# ------------------------------------------------------------------------------------------ fuzz
@pytest.fixture(scope="module")
def live(tmp_path_factory):
    model = tiny_model(str(tmp_path_factory.mktemp("proto") / "m"))
    backend, cfg, tok = load(model, num_slots=2)
    srv = Server(backend, tok, cfg)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.endpoint)
    yield srv, sock, Reference(model)
    sock.close(0)
    srv.stop()


scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
                    st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=5)),
                      max_leaves=20)
FIELDS = ["v", "op", "id", "prompt", "prompt_ids", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
          "stop", "stop_ids", "stream", "session", "rid", "ttl_s", "add_bos"]
OPS = ["generate", "health", "stats", "open", "append", "close", "cancel", "bogus"]   # never shutdown
shaped = st.fixed_dictionaries({"v": st.one_of(st.just(1), values), "op": st.one_of(st.sampled_from(OPS), values)},
                               optional={k: values for k in FIELDS[2:]})
BASE = {"v": 1, "op": "generate", "prompt_ids": [1, 2, 3], "max_new_tokens": 2}
mutated = st.builds(lambda k, v: {**BASE, k: v}, st.sampled_from(FIELDS), values)   # one field wrong
huge_headers = st.sampled_from([b"\xdd\xff\xff\xff\xff", b"\xdb\x7f\xff\xff\xff", b"\xdf\xff\xff\xff\xf0",
                                b"\xc6\xff\xff\xff\xff", b"\x81\xa2op\xdd\x7f\xff\xff\xff",
                                b"\x82\xa1v\x01\xa2op\xdb\xff\xff\xff\xff"]).map(lambda h: h + b"\x00" * 8)
payloads = st.one_of(
    st.binary(max_size=200),                                            # random bytes
    values.map(lambda v: msgpack.packb(v, use_bin_type=True)),          # valid msgpack, wrong shape
    shaped.map(lambda m: msgpack.packb(m, use_bin_type=True)),          # right shape, wrong types
    mutated.map(lambda m: msgpack.packb(m, use_bin_type=True)),         # a valid request, one field off
    huge_headers,                                                       # lengths far past the frame
    st.binary(min_size=1, max_size=50).map(lambda b: msgpack.packb(b) [:-1]),   # truncated
)


def _settle(sock, timeout=10.0):
    """Read the replies to one message up to its final one (error, ok, or a generate's result)."""
    while True:
        assert sock.poll(int(timeout * 1000)), "no final reply"
        msg = P.unpackb(sock.recv(), P.MAX_REPLY_BYTES)
        assert isinstance(msg, dict) and msg.get("v") == P.VERSION and "type" in msg, msg
        if msg["type"] == "error":
            assert msg["code"] in P.ERROR_CODES and isinstance(msg["message"], str)
        if msg["type"] in ("error", "ok", "result"):
            return msg


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(payloads)
def test_fuzz_single_frames(live, payload):
    srv, sock, _ = live
    if b"shutdown" in payload:
        return
    sock.send(payload)
    _settle(sock)
    assert srv.thread.is_alive()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.one_of(st.just(b""), st.binary(max_size=40), payloads), min_size=2, max_size=7))
def test_fuzz_multipart(live, frames):
    srv, sock, _ = live
    if any(b"shutdown" in f for f in frames):
        return
    sock.send_multipart(frames)
    while True:                               # REQ-style replies come after the same empty frames
        assert sock.poll(10000), "no final reply"
        got = sock.recv_multipart()
        msg = P.unpackb(got[-1], P.MAX_REPLY_BYTES)
        assert all(f == b"" for f in got[:-1]) and msg.get("v") == P.VERSION
        if msg["type"] in ("error", "ok", "result"):
            break
    assert srv.thread.is_alive()


def test_fuzz_then_valid_request(live):
    srv, sock, ref = live
    # oversize frames, multi-part frames, frames with a bad envelope, raw TCP garbage
    sock.send(b"\x80" * (P.MAX_FRAME_BYTES + 10))
    assert _settle(sock)["code"] == "too_large"
    for frames in ([b"junk", P.packb({"v": 1, "op": "health"})], [b""] * 9 + [b"x"], [b"\xff"] * 3):
        sock.send_multipart(frames)                                             # not one frame
        assert _settle(sock)["code"] == "bad_request"
    sock.send_multipart([b"", P.packb({"v": 1, "op": "health", "id": "req"})])  # REQ-style: answered
    assert sock.poll(5000)
    frames = sock.recv_multipart()
    assert frames[0] == b"" and P.unpackb(frames[1])["id"] == "req"
    port = int(srv.endpoint.rsplit(":", 1)[1])
    for junk in (b"\xff" * 64, b"GET / HTTP/1.0\r\n\r\n", struct.pack(">Q", 1 << 62) * 8, b"\x00\x00\x00"):
        with socket.create_connection(("127.0.0.1", port), timeout=2) as raw:
            raw.sendall(junk)
    assert not sock.poll(200)
    with Client(srv.endpoint, timeout=10) as c:
        r = c.generate(prompt_ids=PROMPT, max_new_tokens=12, temperature=0.7, seed=9)
        assert r.token_ids == ref.ids(PROMPT, 12, temperature=0.7, seed=9)
        st_ = c.stats()
        assert st_["requests"]["bad_requests"] > 10 and st_["requests"]["internal_errors"] == 0
