"""A decode step's hidden rows from the backbone to the tower on the GPU itself (issue #7).

Over the lane (local_lane.py) a frame still goes through both hosts: the backbone's GPU finishes,
its host wakes, copies the rows out, writes them to the socket; the tower's host wakes, copies
them in and launches. On the H200 that is ~0.3 ms of a ~5 ms single-stream frame. When both
stages run on one GPU under MPS (their kernels side by side), the backbone can instead leave the
rows in a small buffer of its own GPU memory that the tower has mapped (CUDA IPC), and send the
StepRequest as soon as the step is queued, with no rows in it, only a sequence number:

    backbone:  step (graph) -> publish: copy the rows into slot seq % slots, then store seq into
               the flag with a release at system scope -> StepRequest{handoff_seq: seq}
    tower:     on the request: receive (spin until the flag reaches seq, with an acquire; copy the
               rows out) -> its step, queued behind the receive on its own stream

The tower's host queues its step while the backbone's GPU is still computing, so the tower's GPU
starts the moment the rows land. bench/device_handoff.py, H200 under MPS (session 25): a round trip
of one 4 KB row through two processes' GPU work 4.4 µs, against 176 µs with the hosts in the loop
(a pipe and the copies to and from the host), and a spinning waiter did not slow the other
process's GEMMs (883 / 873 µs).

Rules that keep it safe:
- Only under MPS. Without it the GPU time-slices between the two processes' contexts, and a tower
  kernel spinning through its slice would hold the backbone's step off the GPU. `enabled()`: on
  for CUDA when an MPS control daemon's pipe is there, DRAMA_DEVICE_HANDOFF=0/1 overrides.
- Only on one GPU: the tower names its device's UUID in the lane's hello; the backbone sets the
  buffer up (a StepRequest with the IPC handle and no rows) only if the UUID is its own, and uses
  it only if the tower answers `handoff_ready`. Anything that fails leaves the rows in the
  request, as before.
- A waiter never hangs: past `RECEIVE_TIMEOUT_S` it gives up and the tower fails that step's
  entries (UNAVAILABLE).
- A slot is written again only `slots` publishes later, and only steps whose response waits for
  the tower's GPU (every entry draws) use it, and no more than `slots - 1` of them unanswered:
  the rows have been copied out before their slot comes round.
- Only steps of up to MAX_ROWS rows, with at most MAX_WAITERS programs spinning: the single-stream
  case it was measured for; many streams' large steps keep the lane.

The buffer is allocated with cudaMalloc (not torch's caching allocator): an IPC handle maps a whole
allocation, so the rows must start at its base.
"""

from __future__ import annotations

import collections
import ctypes
import os

import torch

from services.common.grpcutil import env_switch

try:  # CUDA builds of torch ship Triton; the CPU CI has none (then nothing here is enabled)
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

SLOTS = 4                          # rows of this many published steps live at once
RECEIVE_TIMEOUT_S = 2.0            # a waiter gives up after this (a decode step takes ~3-25 ms)
HEADER_WORDS = 64                  # int32 words before the slots: the flag (int64) and the ticket,
FLAG_WORD, TICKET_WORD = 0, 32     # each on a 128-byte line of its own
ROW_WORDS_PER_PROGRAM = 1024       # a program copies 4 KB (one bf16 row of 2048) at a time
# Programs of the receive kernel, each spinning while the backbone computes: a decode step of many
# rows must not hold many SMs' issue slots for the whole backbone step (a 128-row step: ~20 ms).
# One spinner beside 80 decode GEMMs cost them nothing measurable (bench/device_handoff.py).
MAX_WAITERS = 8
# Steps of at most this many rows take the hand-off (the Mailbox's slot size): the single-stream
# latency it was built and measured for (session 25). Larger decode steps (many streams) keep the
# lane, as measured at 128 streams in session 23, until a run there says the hand-off helps them.
MAX_ROWS = 8
HANDLE_BYTES = 64                  # sizeof(cudaIpcMemHandle_t)
MAX_BUFFER_BYTES = 64 * 1024 * 1024


def enabled(device: torch.device | str) -> bool:
    """Use the device hand-off on `device`? CUDA (with Triton) under MPS, unless
    DRAMA_DEVICE_HANDOFF says otherwise (0: never; 1: also without a visible MPS daemon)."""
    device = torch.device(device)
    if device.type != "cuda" or not HAS_TRITON or not torch.cuda.is_available():
        return False
    switch = env_switch("DRAMA_DEVICE_HANDOFF")
    if switch is not None:
        return switch
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe, "control"))


def device_uuid(device: torch.device | str) -> str:
    """The GPU's UUID, as the two stages compare it ("" when torch does not say)."""
    return str(getattr(torch.cuda.get_device_properties(torch.device(device)), "uuid", "") or "")


class HandoffError(Exception):
    """The device hand-off could not be set up (the caller keeps rows in the requests)."""


# --------------------------------------------------------------------------------------------
# the CUDA runtime, through ctypes (torch exposes no IPC handles of its own allocations)
# --------------------------------------------------------------------------------------------

class _IpcHandle(ctypes.Structure):
    # bytes, not c_char: a c_char array reads back as a string cut at its first zero byte
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


_CUDART = None


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (so the same context), else the first one found."""
    global _CUDART
    if _CUDART is None:
        torch.cuda.init()
        names = []
        try:
            with open("/proc/self/maps") as maps:
                names = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
        except OSError:
            pass
        for name in names + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            _CUDART = lib
            break
        else:
            raise HandoffError("no CUDA runtime library (libcudart) to load")
    return _CUDART


def _check(code: int, what: str) -> None:
    if code != 0:
        raise HandoffError(f"{what}: CUDA error {code} ({_cudart().cudaGetErrorString(code).decode()})")


class _Raw:
    """A device pointer as torch.as_tensor takes it (__cuda_array_interface__), bytes [n]."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _words(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(_Raw(ptr, nbytes), device=device).view(torch.int32)


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    # seq is never specialised: a value of 1 or a multiple of 16 would otherwise compile a kernel of its own
    @triton.jit(do_not_specialize=["seq"])
    def _publish_kernel(src_ptr, dst_ptr, n_words, ticket_ptr, flag_ptr, seq, BLOCK: tl.constexpr):
        """Copy n_words int32 words src -> dst; the last program to finish its part stores seq
        into the flag with a release at system scope, so a process that acquires seq there sees
        every word. The ticket (zero between launches) counts the programs; ordering as
        moe_decode._last_program_reduces: each program's stores, a barrier, an acq_rel ticket."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n_words
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=ok), mask=ok)
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) - 1:
            tl.store(ticket_ptr, 0)
            tl.atomic_xchg(flag_ptr, seq.to(tl.int64), sem="release", scope="sys")

    @triton.jit(do_not_specialize=["seq"])
    def _receive_kernel(flag_ptr, seq, src_ptr, dst_ptr, n_words, status_ptr, timeout_ns,
                        BLOCK: tl.constexpr, TIMER: tl.constexpr):
        """Spin until the flag reaches seq (acquire, system scope), then copy n_words src -> dst
        (from L2: `.cg`, never a line this SM's L1 kept from the slot's last use), BLOCK words at
        a time, program p taking blocks p, p + programs, ... Past timeout_ns (TIMER; else after
        one look, for the interpreter): status = 1, and copy anyway."""
        want = seq.to(tl.int64)
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        if TIMER:
            start = _now()
            now = start
            while (seen < want) & (now - start < timeout_ns):
                seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
                now = _now()
        if seen < want:
            tl.store(status_ptr, 1)
        for block in range(tl.program_id(0), tl.cdiv(n_words, BLOCK), tl.num_programs(0)):
            offs = block * BLOCK + tl.arange(0, BLOCK)
            ok = offs < n_words
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=ok, cache_modifier=".cg"), mask=ok)


def _slot(words: torch.Tensor, rows: int, slots: int, seq: int, step_rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the words from slot seq % slots on, the words of step_rows [n, H]) in a buffer of int32
    `words`: HEADER_WORDS, then slots x rows rows."""
    row_words = _row_words(step_rows.shape[1], step_rows.dtype)
    return words[HEADER_WORDS + (seq % slots) * rows * row_words:], step_rows.shape[0] * row_words


def publish_rows(words: torch.Tensor, rows: int, slots: int, seq: int, hidden: torch.Tensor) -> None:
    """Queue hidden [n, H] into slot seq % slots of a buffer of int32 `words` (HEADER_WORDS, then
    slots x rows rows), then seq into its flag (the Mailbox's launch)."""
    slot, n_words = _slot(words, rows, slots, seq, hidden)
    src = hidden.contiguous().view(torch.int32).reshape(-1)
    _publish_kernel[(triton.cdiv(n_words, ROW_WORDS_PER_PROGRAM),)](
        src, slot, n_words, words[TICKET_WORD:], words[FLAG_WORD:].view(torch.int64), seq,
        BLOCK=ROW_WORDS_PER_PROGRAM, num_warps=4)


def receive_rows(words: torch.Tensor, rows: int, slots: int, seq: int, out: torch.Tensor, status: torch.Tensor,
                 timeout_ns: int) -> None:
    """Queue the wait for seq in a buffer's flag and the copy of slot seq % slots into out [n, H]
    (status [1] int32 := 1 if the wait gave up; the Inbox's launch)."""
    slot, n_words = _slot(words, rows, slots, seq, out)
    _receive_kernel[(min(triton.cdiv(n_words, ROW_WORDS_PER_PROGRAM), MAX_WAITERS),)](
        words[FLAG_WORD:].view(torch.int64), seq, slot, out.view(torch.int32).reshape(-1), n_words,
        status, timeout_ns, BLOCK=ROW_WORDS_PER_PROGRAM, TIMER=not INTERPRET, num_warps=4)


def _row_words(hidden_size: int, dtype: torch.dtype) -> int:
    nbytes = hidden_size * dtype.itemsize
    if nbytes % 4:
        raise HandoffError(f"a hidden row of {nbytes} bytes is not whole int32 words")
    return nbytes // 4


def buffer_bytes(rows: int, hidden_size: int, dtype: torch.dtype, slots: int) -> int:
    return 4 * (HEADER_WORDS + slots * rows * _row_words(hidden_size, dtype))


# --------------------------------------------------------------------------------------------
# the two ends
# --------------------------------------------------------------------------------------------

class _SharedRows:
    """What both ends know of the buffer: its geometry, its int32 words once mapped, and how each
    lets it go (`_release`)."""

    def __init__(self, rows: int, slots: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str):
        if not (1 <= rows and 2 <= slots <= 64):
            raise HandoffError(f"a buffer of {rows} rows x {slots} slots")
        self.rows, self.slots, self.hidden_size, self.dtype = rows, slots, hidden_size, dtype
        self.device = torch.device(device)
        self.nbytes = buffer_bytes(rows, hidden_size, dtype, slots)
        if self.nbytes > MAX_BUFFER_BYTES:
            raise HandoffError(f"a buffer of {self.nbytes} bytes is over {MAX_BUFFER_BYTES}")
        self._ptr = 0
        self.words: torch.Tensor | None = None

    def _map(self, ptr: int) -> None:
        self._ptr = ptr
        self.words = _words(ptr, self.nbytes, self.device)

    def _release(self, ptr: ctypes.c_void_p) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Let the buffer go once this device's queued work is done (idempotent)."""
        if self._ptr:
            torch.cuda.synchronize(self.device)
            self.words = None
            self._release(ctypes.c_void_p(self._ptr))
            self._ptr = 0


class Mailbox(_SharedRows):
    """The backbone's end: a buffer of `slots` x `rows` hidden rows in its GPU memory, which the
    tower maps. `publish` queues a step's rows there on the current stream and returns its
    sequence number; `answered` tells it a step's response came back."""

    def __init__(self, rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str,
                 slots: int = SLOTS):
        super().__init__(rows, slots, hidden_size, dtype, device)
        lib = _cudart()
        with torch.cuda.device(self.device):
            ptr = ctypes.c_void_p()
            _check(lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(self.nbytes)), "cudaMalloc")
            handle = _IpcHandle()
            try:
                _check(lib.cudaIpcGetMemHandle(ctypes.byref(handle), ptr), "cudaIpcGetMemHandle")
            except HandoffError:
                lib.cudaFree(ptr)
                raise
        self.handle = bytes(handle)
        self._map(ptr.value)
        self.words.zero_()
        torch.cuda.synchronize(self.device)
        self.seq = 0
        self._unanswered: collections.deque[int] = collections.deque()

    def _release(self, ptr: ctypes.c_void_p) -> None:
        _cudart().cudaFree(ptr)

    def can_publish(self, n_rows: int) -> bool:
        """Room for a step of n_rows now: it fits a slot, and its slot's last rows are answered."""
        return 0 < n_rows <= self.rows and len(self._unanswered) < self.slots - 1

    def publish(self, hidden: torch.Tensor) -> int:
        """Queue hidden [n, H] (on this device, the current stream) into the next slot; its seq."""
        n = hidden.shape[0]
        if hidden.shape != (n, self.hidden_size) or hidden.dtype != self.dtype or not self.can_publish(n):
            raise ValueError(f"cannot publish rows {tuple(hidden.shape)} {hidden.dtype} (buffer: up to {self.rows} "
                             f"x {self.hidden_size} {self.dtype}, {len(self._unanswered)} unanswered)")
        self.seq += 1
        publish_rows(self.words, self.rows, self.slots, self.seq, hidden)
        self._unanswered.append(self.seq)
        return self.seq

    def answered(self, seq: int) -> None:
        """The response to the step published as `seq` came back (responses come in order)."""
        while self._unanswered and self._unanswered[0] <= seq:
            self._unanswered.popleft()


class Inbox(_SharedRows):
    """The tower's end: the backbone's buffer mapped from its IPC handle; `receive` queues the
    wait and the copy of a published step's rows on the current stream."""

    def __init__(self, handle: bytes, rows: int, slots: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        if len(handle) != HANDLE_BYTES:
            raise HandoffError(f"an IPC handle is {HANDLE_BYTES} bytes, got {len(handle)}")
        super().__init__(rows, slots, hidden_size, dtype, device)
        lib = _cudart()
        with torch.cuda.device(self.device):
            ptr = ctypes.c_void_p()
            _check(lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), _IpcHandle.from_buffer_copy(handle), ctypes.c_uint(1)),
                   "cudaIpcOpenMemHandle")
        self._map(ptr.value)
        self.received = torch.empty(rows, hidden_size, dtype=dtype, device=self.device)
        self._status = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._status_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.timeout_ns = int(RECEIVE_TIMEOUT_S * 1e9)

    def _release(self, ptr: ctypes.c_void_p) -> None:
        _cudart().cudaIpcCloseMemHandle(ptr)

    def receive(self, seq: int, n_rows: int) -> torch.Tensor:
        """Queue the wait for step `seq` and the copy of its n_rows rows; the rows [n, H] (valid
        on the current stream after what is queued). Check `timed_out` after the stream has run."""
        if not (0 < n_rows <= self.rows) or seq < 1:
            raise ValueError(f"step {seq} of {n_rows} rows: the buffer holds 1..{self.rows} rows a step")
        out = self.received[:n_rows]
        receive_rows(self.words, self.rows, self.slots, seq, out, self._status, self.timeout_ns)
        self._status_host.copy_(self._status, non_blocking=True)
        return out

    def timed_out(self) -> bool:
        """Did a wait queued so far give up? Read once the stream has run it (the step's codes
        came back); clears the record."""
        if int(self._status_host[0]):
            self._status.zero_()
            self._status_host.zero_()
            return True
        return False
