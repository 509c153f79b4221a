"""The Tower.Step stream's same-host lane: the same messages over a Unix socket (issue #7).

A frame crosses the Step stream twice, and in grpc.aio every message is four hand-offs between
threads: grpc's poller thread completes the write, wakes the event loop through a socket, and the
same again for the read on the other side. When the backbone and the tower share a host, the
lane carries the very same StepRequest / StepResponse messages over a Unix socket that each event
loop reads itself: no other thread is involved, so a spinning loop sees a message on its next
turn. On the H200 host (docs/perf.md, session 23) a round trip of the Step messages between two
processes, both loops spinning, took 0.61 ms over gRPC and 0.12 ms over the lane (bench/hops.py),
and the stack's single-stream frame went 6.38 -> 5.82 ms.

Wire format, both ways: each message is its serialized length (4 bytes, little-endian) and the
serialized protobuf. The tower speaks first, with one `TowerInfo` (the one GetInfo answers), so the
backbone can check that the socket it reached belongs to the tower it asked over gRPC
(`TowerInfo.instance_id`). Then the connection is a Step stream in every way: requests in order,
responses in the same order, tower state keyed by the connection, all of it freed when the
connection closes. A message longer than the limit, cut off or not parseable ends the connection.

The gRPC Step stream stays the contract (API.md §3.5) and the fallback: the tower names its socket
in `TowerInfo.step_socket`, and a backbone that cannot reach it, or reaches another tower there,
uses the gRPC stream as before.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import struct
import tempfile
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

HEADER = struct.Struct("<I")
DEFAULT_LIMIT_BYTES = 16 * 1024 * 1024       # the Step stream's gRPC message limit
# One read of the socket may take a whole step's message at once (a 256-row prompt piece of the
# full preset is ~1 MB of hidden rows); the reader's buffer grows to this before it pauses.
_STREAM_LIMIT = 4 * 1024 * 1024

# Each socket's kernel send buffer: a chunk's prompt of the 200-word request is ~1.3 MB of hidden
# rows, and with Linux's default (~208 KB) its write went out in ~200 KB pieces, each waiting for
# the reader's loop to take the last one: 3.6 ms for 308 rows on the H200 host (bench/hops.py
# --rows 308). Capped by the kernel at net.core.wmem_max (4 MB there); never an error.
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024

M = TypeVar("M", bound=Message)


class LaneError(Exception):
    """The peer broke the wire format: a message cut off, too long, or not parseable."""


def encode(message: Message) -> bytes:
    body = message.SerializeToString()
    return HEADER.pack(len(body)) + body


def write(writer: asyncio.StreamWriter, message: Message) -> None:
    """Queue one message: its header and body as two writes (no copy of a large body to join them)."""
    body = message.SerializeToString()
    writer.write(HEADER.pack(len(body)))
    writer.write(body)


def widen(writer: asyncio.StreamWriter) -> None:
    """Give the connection's socket SOCKET_BUFFER_BYTES of kernel buffer each way."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


async def read_message(reader: asyncio.StreamReader, message_type: type[M], *,
                       limit_bytes: int = DEFAULT_LIMIT_BYTES) -> M | None:
    """The next message, or None at a clean end of the stream (between two messages)."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise LaneError("the connection closed inside a message header") from None
    (size,) = HEADER.unpack(header)
    if size > limit_bytes:
        raise LaneError(f"message of {size} bytes is over the {limit_bytes}-byte limit")
    try:
        body = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise LaneError(f"the connection closed inside a {size}-byte message") from None
    try:
        return message_type.FromString(body)
    except DecodeError as exc:
        raise LaneError(f"not a {message_type.DESCRIPTOR.name}: {exc}") from None


# --------------------------------------------------------------------------------------------
# the tower's side
# --------------------------------------------------------------------------------------------

OFF = ("0", "off", "none", "false", "no")


def socket_path(setting: str | None, port: int) -> str:
    """The lane's socket from a setting: unset -> <tmp>/dramaturg-<uid>/tower-<port>.sock (the
    stages of one user on one host find each other; serve() makes that directory private);
    0/off/none -> "" (no lane); anything else is the path."""
    if setting is None or not setting.strip():
        return os.path.join(tempfile.gettempdir(), f"dramaturg-{os.getuid()}", f"tower-{port}.sock")
    return "" if setting.strip().lower() in OFF else setting


async def serve(path: str, handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
                ) -> asyncio.AbstractServer:
    """Listen on the Unix socket `path`; each connection runs `handle(reader, writer)` on this
    event loop. Its directory is made (private to this user) if missing. A socket file already
    there is replaced when nothing answers on it (left by a process that is gone); one a live
    process listens on raises OSError, as does any other file there."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(mode):
            raise OSError(f"{path} exists and is not a socket")
        if await _answers(path):
            raise OSError(f"{path} is in use by a running process")
        os.unlink(path)

    async def widened(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        widen(writer)
        await handle(reader, writer)

    return await asyncio.start_unix_server(widened, path, limit=_STREAM_LIMIT)


async def _answers(path: str) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), 1.0)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


def close_server(server: asyncio.AbstractServer | None, path: str) -> None:
    if server is None:
        return
    server.close()
    try:
        os.unlink(path)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# the backbone's side
# --------------------------------------------------------------------------------------------

class LaneCall:
    """A connected lane as the backbone's TowerClient uses a grpc.aio stream call: `write`,
    `read` (grpc.aio.EOF at the end), `cancel`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 response_type: type[Message], limit_bytes: int = DEFAULT_LIMIT_BYTES):
        self._reader, self._writer = reader, writer
        self._response_type, self._limit_bytes = response_type, limit_bytes

    async def write(self, message: Message) -> None:
        if self._writer.is_closing():
            raise ConnectionResetError("the lane is closed")
        write(self._writer, message)
        # returns at once unless the socket's buffer is over its high-water mark
        await self._writer.drain()

    async def read(self):
        message = await read_message(self._reader, self._response_type, limit_bytes=self._limit_bytes)
        return grpc.aio.EOF if message is None else message

    def cancel(self) -> None:
        self._writer.close()


async def connect(path: str, hello_type: type[M], response_type: type[Message], *,
                  timeout_s: float) -> tuple[LaneCall, M]:
    """Open the lane at `path` and read the tower's hello. Raises OSError (nothing there, no
    permission), asyncio.TimeoutError or LaneError."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_unix_connection(path, limit=_STREAM_LIMIT), timeout_s)
    widen(writer)
    try:
        hello = await asyncio.wait_for(read_message(reader, hello_type), timeout_s)
        if hello is None:
            raise LaneError("the tower closed the lane before its hello")
    except BaseException:
        writer.close()
        raise
    return LaneCall(reader, writer, response_type), hello
