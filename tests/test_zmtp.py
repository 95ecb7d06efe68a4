"""kog_dist.zmtp against real libzmq sockets: the gateway's request connections speak ZMTP on the event loop,
so every way libzmq could disagree with them is tried on libzmq itself (pyzmq's ROUTER and its heartbeats,
a CURVE server, a refused port, a frame over the limit)."""
from __future__ import annotations

import asyncio

import pytest
import zmq

from kog_dist import zmtp
from launch.cli import free_port


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def _router(**opts):
    ctx = zmq.Context.instance()
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.LINGER, 0)
    for k, v in opts.items():
        r.setsockopt(getattr(zmq, k), v)
    port = r.bind_to_random_port("tcp://127.0.0.1")
    return r, port


async def _until(cond, timeout=5.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond() and loop.time() < end:
        await asyncio.sleep(0.005)
    return cond()


async def _recv(r, timeout=5.0):
    """A ROUTER's next message, polled from the event loop (the Dealer runs on it)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if r.poll(0):
            return r.recv_multipart()
        await asyncio.sleep(0.002)
    raise AssertionError("the ROUTER received nothing")


def test_messages_both_ways_short_and_long_frames_and_multipart_replies():
    r, port = _router()
    got, lost = [], []

    async def go():
        d = zmtp.Dealer(got.append, lost.append, 1 << 20)
        d.open(asyncio.get_running_loop(), "127.0.0.1", port)
        sent = [b"a", b"x" * 255, b"y" * 256, bytes(range(256)) * 300]   # 1-byte and 8-byte sizes
        for m in sent:
            d.send(m)                                   # before the handshake: held, then sent in order
        ident = None
        for m in sent:
            ident, data = await _recv(r)
            assert data == m
        r.send_multipart([ident, b"one"])
        r.send_multipart([ident, b"", b"two"])          # REQ-style envelope: the last frame is the message
        r.send_multipart([ident, b"z" * 70000])
        assert await _until(lambda: len(got) == 3)
        d.close()
        assert await _until(lambda: lost)
        return got, lost
    got, lost = _run(go())
    assert got == [b"one", b"two", b"z" * 70000] and lost == ["closed by its owner"]
    r.close(0)


def test_heartbeats_are_answered_and_an_idle_connection_stays_up():
    # the coordinator's ROUTER pings every second and drops a peer silent for three; here 50 ms and 150 ms
    r, port = _router(HEARTBEAT_IVL=50, HEARTBEAT_TIMEOUT=150, HEARTBEAT_TTL=150)
    mon = r.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    got, lost = [], []

    async def go():
        d = zmtp.Dealer(got.append, lost.append, 1 << 20)
        d.open(asyncio.get_running_loop(), "127.0.0.1", port)
        d.send(b"hi")
        ident, _ = await _recv(r)
        await asyncio.sleep(1.0)                        # ~20 pings; each unanswered would end it in 150 ms
        d.send(b"still")
        assert (await _recv(r))[1] == b"still"
        r.send_multipart([ident, b"yes"])
        assert await _until(lambda: got == [b"yes"])
        assert not mon.poll(0)                          # the ROUTER never dropped it
        d.close()
    _run(go())
    assert lost == ["closed by its owner"]
    r.disable_monitor()
    mon.close(0)
    r.close(0)


def test_a_curve_server_a_refused_port_and_an_oversized_frame_close_with_a_reason():
    pub, sec = zmq.curve_keypair()
    r, port = _router(CURVE_SERVER=1, CURVE_SECRETKEY=sec, CURVE_PUBLICKEY=pub)
    lost = []

    async def curve():
        d = zmtp.Dealer(lambda m: None, lost.append, 1 << 20)
        d.open(asyncio.get_running_loop(), "127.0.0.1", port)
        d.send(b"hi")
        assert await _until(lambda: lost)
    _run(curve())
    assert "CURVE mechanism" in lost[0], lost
    r.close(0)

    lost.clear()

    async def refused():
        d = zmtp.Dealer(lambda m: None, lost.append, 1 << 20)
        d.open(asyncio.get_running_loop(), "127.0.0.1", free_port())
        assert await _until(lambda: lost)
        with pytest.raises(ConnectionError):
            d.send(b"too late")
    _run(refused())
    assert lost[0].startswith("cannot connect"), lost

    r, port = _router()
    lost.clear()
    got = []

    async def oversized():
        d = zmtp.Dealer(got.append, lost.append, 1000)
        d.open(asyncio.get_running_loop(), "127.0.0.1", port)
        d.send(b"hi")
        ident, _ = await _recv(r)
        r.send_multipart([ident, b"ok"])
        r.send_multipart([ident, b"q" * 1001])
        assert await _until(lambda: lost)
    _run(oversized())
    assert got == [b"ok"] and "over the limit of 1000" in lost[0], (got, lost)
    r.close(0)
