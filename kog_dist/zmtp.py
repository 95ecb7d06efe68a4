"""A DEALER connection speaking ZMTP 3.1 itself on an asyncio transport (rfc.zeromq.org/spec/23, the NULL
mechanism over TCP): how the gateway's requests reach the coordinator's ROUTER without libzmq's I/O thread.

libzmq does a socket's I/O on a thread of its own: a message sent wakes that thread to write it, and a
message received wakes it to read it and then wakes the caller. A gateway relaying a token therefore woke two
threads of its process where a plain socket wakes one; on the 2-core machine each wake-up costs ~0.1 ms of a
first token's way (bench/gateway_cost.py). Here the event loop writes and reads the TCP socket itself.

Only what a DEALER client of the coordinator needs: the greeting and READY of the NULL mechanism (no security:
CURVE connections stay on libzmq, kog_dist.aclient chooses), single-frame messages out, messages in (a
multi-part message arrives as its last frame), PING answered with PONG (the coordinator's heartbeats), a size
limit on what comes in. Anything unexpected closes the connection, which its owner sees as a lost server.
"""
from __future__ import annotations

import asyncio

SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"
GREETING = SIGNATURE + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31     # ZMTP 3.1, client
MORE, LONG, COMMAND = 1, 2, 4


def frame(data: bytes, flags: int = 0) -> bytes:
    n = len(data)
    if n < 256:
        return bytes((flags, n)) + data
    return bytes((flags | LONG,)) + n.to_bytes(8, "big") + data


def command(name: bytes, body: bytes = b"") -> bytes:
    return frame(bytes((len(name),)) + name + body, COMMAND)


def _prop(name: bytes, value: bytes) -> bytes:
    return bytes((len(name),)) + name + len(value).to_bytes(4, "big") + value


READY = command(b"READY", _prop(b"Socket-Type", b"DEALER") + _prop(b"Identity", b""))


def properties(body: bytes) -> dict:
    """The metadata of a READY command's body (after its name)."""
    out, i = {}, 0
    while i < len(body):
        n = body[i]
        name = bytes(body[i + 1:i + 1 + n])
        i += 1 + n
        m = int.from_bytes(body[i:i + 4], "big")
        out[name.lower()] = bytes(body[i + 4:i + 4 + m])
        i += 4 + m
    return out


class ZmtpError(Exception):
    pass


class Dealer(asyncio.Protocol):
    """One connection: `send(payload)` (held until the handshake ends), `on_message(payload)` for
    each message in, `on_lost(why)` once when it closes for any reason. Connect with `open()`."""

    def __init__(self, on_message, on_lost, max_size: int):
        self.on_message, self.on_lost, self.max_size = on_message, on_lost, int(max_size)
        self.transport = None
        self.closed = False
        self._out = []                         # messages sent before the handshake ended
        self._buf = bytearray()
        self._greeted = self._ready = False

    def open(self, loop, host: str, port: int):
        """Connect in the background; what is sent meanwhile goes out once connected."""
        task = loop.create_task(loop.create_connection(lambda: self, host, port))
        task.add_done_callback(self._connected)
        return task

    def _connected(self, task):
        if task.cancelled():
            self._lose("the connection attempt was cancelled")
        elif task.exception() is not None:
            self._lose(f"cannot connect: {task.exception()}")

    # ------------------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport):
        if self.closed:
            transport.close()
            return
        self.transport = transport
        # the signature and major version first, the rest once the peer's greeting says NULL: a CURVE server
        # would drop the connection on our mechanism before its own greeting could be read
        transport.write(GREETING[:11])

    def data_received(self, data):
        buf = self._buf
        buf += data
        try:
            if not self._greeted:
                if len(buf) < 64:
                    return
                self._greeting(bytes(buf[:64]))
                del buf[:64]
                self.transport.write(GREETING[11:] + READY)
            i, n = 0, len(buf)
            while n - i >= 2:
                flags = buf[i]
                if flags & LONG:
                    if n - i < 9:
                        break
                    size, head = int.from_bytes(buf[i + 1:i + 9], "big"), 9
                else:
                    size, head = buf[i + 1], 2
                if size > self.max_size:
                    raise ZmtpError(f"a frame of {size} bytes is over the limit of {self.max_size}")
                if n - i < head + size:
                    break
                body = bytes(buf[i + head:i + head + size])
                i += head + size
                if flags & COMMAND:
                    self._command(body)
                elif not self._ready:
                    raise ZmtpError("a message before the peer's READY")
                elif not flags & MORE:             # a multi-part message is its last frame (an envelope's payload)
                    self.on_message(body)
            del buf[:i]
        except ZmtpError as e:
            self._lose(f"the coordinator's ZMTP: {e}")
            if self.transport is not None:
                self.transport.abort()

    def connection_lost(self, exc):
        self._lose(f"the connection closed{f' ({exc})' if exc else ''}")

    # ------------------------------------------------------------------------------ ZMTP
    def _greeting(self, g: bytes):
        if g[0] != 0xFF or not g[9] & 1 or g[10] < 3:
            raise ZmtpError("not a ZMTP 3 peer")
        mech = g[12:32].rstrip(b"\x00")
        if mech != b"NULL":
            raise ZmtpError(f"the server wants the {mech.decode('ascii', 'replace')} mechanism (CURVE keys?)")
        self._greeted = True

    def _command(self, body: bytes):
        name = body[1:1 + body[0]]
        rest = body[1 + body[0]:]
        if name == b"READY":
            kind = properties(rest).get(b"socket-type", b"")
            if kind not in (b"ROUTER", b"DEALER"):
                raise ZmtpError(f"a {kind.decode('ascii', 'replace') or 'nameless'} socket is no coordinator")
            self._ready = True
            # only now: libzmq takes everything that arrives before it has sent its own READY for a handshake
            # command, and a message there for a protocol error
            if self._out:
                self.transport.write(b"".join(self._out))
            self._out = None
        elif name == b"PING":                  # TTL (2 bytes), then a context to echo
            self.transport.write(command(b"PONG", rest[2:]))
        elif name == b"ERROR":
            raise ZmtpError(f"the peer refused the connection: {rest[1:1 + rest[0]].decode('utf-8', 'replace')}"
                            if rest else "the peer refused the connection")
        # PONG and unknown commands: nothing to do (the spec says to ignore those)

    # ------------------------------------------------------------------------------ the owner's side
    def send(self, payload: bytes) -> None:
        if self.closed:
            raise ConnectionError("the connection is closed")
        f = frame(payload)
        if self._out is not None:
            self._out.append(f)
        else:
            self.transport.write(f)

    def close(self) -> None:
        """Close after what is written has gone out (a last cancel still leaves)."""
        self._lose("closed by its owner")
        if self.transport is not None:
            self.transport.close()

    def _lose(self, why: str):
        if not self.closed:
            self.closed = True
            self.on_lost(why)
