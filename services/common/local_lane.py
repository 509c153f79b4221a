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

Large requests through shared memory: a chunk's prompt (308 rows of the 200-word request, 1.3 MB)
or a lane step of many prompts (up to ~8 MB) crossed the socket in kernel-buffer-sized pieces,
each waiting for the other loop: 3.6 ms for 308 rows on the H200 host, 1.6 ms for a 20-word
prompt's 134, on the path of its first frame. So each connection has a ring: a file the tower
makes in the socket's directory (private to its user, or the volume the stages share), maps and
names in its hello (`TowerInfo.step_ring`); the backbone maps it too, and a request of
RING_MIN_BYTES or more goes there, its frame on the socket only the header with the length's top
bit set and the body's offset in the ring (4 more bytes, little-endian). The tower parses the body
in place, before it answers, so a request's place in the ring is free again once its response is
read (one response per request, in order). The tower removes the file at the connection's first
request (both sides hold their mappings) or end; a request that does not fit goes through the
socket, and so does everything when the backbone cannot map the ring.

The gRPC Step stream stays the contract (API.md §3.5) and the fallback: the tower names its socket
in `TowerInfo.step_socket`, and a backbone that cannot reach it, or reaches another tower there,
uses the gRPC stream as before.
"""

from __future__ import annotations

import asyncio
import glob
import mmap
import os
import socket
import stat
import struct
import tempfile
from collections import deque
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

# A request of this many bytes or more goes through the connection's ring (a decode step's one
# row is ~4 KB and stays on the socket: two small writes cost less than a copy into the ring).
RING_MIN_BYTES = 64 * 1024
# The ring: two requests of the 16 MB limit in flight at once, and room to wrap. Reserved whole when
# a connection opens (Ring says why): on a tmpfs, 40 MB of memory per backbone connection.
RING_BYTES = 40 * 1024 * 1024
RING_FLAG = 0x8000_0000              # in a header: the body is in the ring; its offset follows
RING_OFFSET = struct.Struct("<I")

M = TypeVar("M", bound=Message)


class LaneError(Exception):
    """The peer broke the wire format: a message cut off, too long, or not parseable."""


def encode(message: Message) -> bytes:
    body = message.SerializeToString()
    return HEADER.pack(len(body)) + body


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
                       limit_bytes: int = DEFAULT_LIMIT_BYTES, ring: mmap.mmap | None = None) -> M | None:
    """The next message, or None at a clean end of the stream (between two messages). `ring`:
    the connection's shared memory, where a header may say the body is."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise LaneError("the connection closed inside a message header") from None
    (size,) = HEADER.unpack(header)
    if size & RING_FLAG:
        return await _read_from_ring(reader, message_type, size & ~RING_FLAG, limit_bytes, ring)
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


async def _read_from_ring(reader: asyncio.StreamReader, message_type: type[M], size: int, limit_bytes: int,
                          ring: mmap.mmap | None) -> M:
    try:
        (offset,) = RING_OFFSET.unpack(await reader.readexactly(RING_OFFSET.size))
    except asyncio.IncompleteReadError:
        raise LaneError("the connection closed inside a message header") from None
    if ring is None:
        raise LaneError("a message in shared memory on a connection without a ring")
    if size > limit_bytes:
        raise LaneError(f"message of {size} bytes is over the {limit_bytes}-byte limit")
    if offset + size > len(ring):
        raise LaneError(f"message at {offset}..{offset + size} is outside the {len(ring)}-byte ring")
    # parsed in place (the message copies what it keeps); the views go before the ring may close
    with memoryview(ring) as whole, whole[offset:offset + size] as body:
        try:
            return message_type.FromString(body)
        except DecodeError as exc:
            raise LaneError(f"not a {message_type.DESCRIPTOR.name}: {exc}") from None


# --------------------------------------------------------------------------------------------
# the tower's side
# --------------------------------------------------------------------------------------------

class Ring:
    """A connection's shared memory, as the tower makes it: a file beside the socket
    (`<socket>.ring-<random>`, mode 0600), mapped. `unlink` once the backbone has had its chance
    to map it (its first request); `close` at the connection's end. Its space is reserved when it
    is made: a write through a mapping into a page the file system cannot back (a full tmpfs)
    kills the writer with SIGBUS, so a ring that does not fit is an OSError here instead, and the
    connection's requests go through the socket."""

    def __init__(self, socket_path: str, size: int | None = None):
        size = size or RING_BYTES
        fd, self.path = tempfile.mkstemp(prefix=os.path.basename(socket_path) + ".ring-",
                                         dir=os.path.dirname(socket_path) or ".")
        try:
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def unlink(self) -> None:
        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = ""

    def close(self) -> None:
        self.unlink()
        self.map.close()


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
    for stale in glob.glob(glob.escape(path) + ".ring-*"):   # rings of a tower that is gone
        try:
            os.unlink(stale)
        except OSError:
            pass

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


async def read_requests(reader: asyncio.StreamReader, message_type: type[M], ring: Ring | None):
    """A connection's requests until its clean end, through `ring` where their headers say so.
    The ring's file goes at the first one: the backbone has mapped it by then, or never will."""
    while (request := await read_message(reader, message_type, ring=ring.map if ring else None)) is not None:
        if ring is not None:
            ring.unlink()
        yield request


# --------------------------------------------------------------------------------------------
# the backbone's side
# --------------------------------------------------------------------------------------------

class LaneCall:
    """A connected lane as the backbone's TowerClient uses a grpc.aio stream call: `write`,
    `read` (grpc.aio.EOF at the end), `cancel`. With the tower's ring mapped (`ring`), a large
    request goes there; each response read frees the oldest request's place (the Step stream
    answers every request once, in order, after parsing it)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 response_type: type[Message], limit_bytes: int = DEFAULT_LIMIT_BYTES,
                 ring: mmap.mmap | None = None):
        self._reader, self._writer = reader, writer
        self._response_type, self._limit_bytes = response_type, limit_bytes
        self.ring = ring
        self._placed: deque[tuple[int, int]] = deque()        # ring places of unanswered requests
        self._unanswered: deque[bool] = deque()               # per request: in the ring?
        self.ring_messages = 0                                # requests sent through the ring

    async def write(self, message: Message) -> None:
        if self._writer.is_closing():
            raise ConnectionResetError("the lane is closed")
        body = message.SerializeToString()
        place = self._place(len(body)) if self.ring is not None and len(body) >= RING_MIN_BYTES else None
        if place is None:
            self._writer.write(HEADER.pack(len(body)))
            self._writer.write(body)
        else:
            start, end = place
            self.ring[start:end] = body
            self._placed.append(place)
            self._writer.write(HEADER.pack(RING_FLAG | len(body)) + RING_OFFSET.pack(start))
            self.ring_messages += 1
        self._unanswered.append(place is not None)
        # returns at once unless the socket's buffer is over its high-water mark
        await self._writer.drain()

    def _place(self, size: int) -> tuple[int, int] | None:
        """Where a body of `size` bytes fits in the ring after the unanswered ones (wrapping to
        the start), or None."""
        capacity = len(self.ring)
        if not self._placed:
            return (0, size) if size <= capacity else None
        first = self._placed[0][0]
        last_start, last_end = self._placed[-1]
        if last_start >= first:                 # the places in use do not wrap
            if last_end + size <= capacity:
                return last_end, last_end + size
            return (0, size) if size <= first else None
        return (last_end, last_end + size) if last_end + size <= first else None

    async def read(self):
        message = await read_message(self._reader, self._response_type, limit_bytes=self._limit_bytes)
        if message is None:
            return grpc.aio.EOF
        if self._unanswered and self._unanswered.popleft():
            self._placed.popleft()
        return message

    def cancel(self) -> None:
        self._writer.close()
        if self.ring is not None:
            self.ring.close()                 # a later write finds the writer closing first


def map_ring(socket_path: str, name: str) -> mmap.mmap | None:
    """The tower's ring named in its hello, mapped; None when there is none or it cannot be
    mapped (another container's file system, permissions): the requests then go on the socket.
    Only a file beside the socket, named as the tower names its rings, is opened."""
    if not name or os.path.basename(name) != name or not name.startswith(os.path.basename(socket_path) + ".ring-"):
        return None
    try:
        fd = os.open(os.path.join(os.path.dirname(socket_path), name), os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_size < RING_MIN_BYTES:
            return None
        return mmap.mmap(fd, found.st_size)
    except OSError:
        return None
    finally:
        os.close(fd)


async def connect(path: str, hello_type: type[M], response_type: type[Message], *,
                  timeout_s: float, use_ring: bool = True) -> tuple[LaneCall, M]:
    """Open the lane at `path`, read the tower's hello and map the ring it names (unless
    `use_ring` is false). Raises OSError (nothing there, no permission), asyncio.TimeoutError or
    LaneError."""
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
    ring = map_ring(path, getattr(hello, "step_ring", "")) if use_ring else None
    return LaneCall(reader, writer, response_type, ring=ring), hello
