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
starts the moment the rows land.

The way back goes the same way when the buffer has room for frames (`code_columns`, set up with
the tower's agreement): the tower publishes each hand-off step's frames (codes and the stop flag,
int64) into the frames' slot seq % slots, and the backbone may queue its next decode step behind a
wait for them (`Mailbox.fill`: the frames straight into that step's input ids, on the GPU) before
its host has read the response (services/backbone/scheduler.py's chained steps):

    tower:     its step -> publish the frames [n, N + 1] under seq -> the response
    backbone:  fill (spin until the frames' flag reaches seq; each row's id and codes into the
               next step's staged inputs; a stopped or out-of-range row becomes a padding row)
               -> the next step's graph -> publish its rows under seq + 1 -> ...

With both ways on the GPU, a single-stream frame is the backbone's step and the tower's back to
back, no host between them: 4.51-4.87 -> 4.00-4.05 ms on the H200 (session 26, the same codes).

bench/device_handoff.py, H200 under MPS (session 25): a round trip of one 4 KB row through two
processes' GPU work 4.4 µs, against 176 µs with the hosts in the loop (a pipe and the copies to
and from the host), and a spinning waiter did not slow the other process's GEMMs (883 / 873 µs).

Rules that keep it safe:
- Only under MPS. Without it the GPU time-slices between the two processes' contexts, and a tower
  kernel spinning through its slice would hold the backbone's step off the GPU. `enabled()`: on
  for CUDA when an MPS control daemon's pipe is there, DRAMA_DEVICE_HANDOFF=0/1 overrides.
- Only on one GPU: the tower names its device's UUID in the lane's hello; the backbone sets the
  buffer up (a StepRequest with the IPC handle and no rows) only if the UUID is its own, and uses
  it only if the tower answers `handoff_ready`. Anything that fails leaves the rows in the
  request, as before.
- A waiter never hangs: past `RECEIVE_TIMEOUT_S` it gives up and the tower fails that step's
  entries (UNAVAILABLE); a backbone step whose frames never came fails its entries the same way.
  The tower publishes a hand-off step's frames whatever happened to the step (rows of -1 when it
  failed), so a backbone step queued behind them waits no longer than the tower does.
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
import logging
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
log = logging.getLogger(__name__)

SLOTS = 4                          # rows of this many published steps live at once
RECEIVE_TIMEOUT_S = 2.0            # a waiter gives up after this (a decode step takes ~3-25 ms)
RECEIVE_TIMEOUT_NS = int(RECEIVE_TIMEOUT_S * 1e9)
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
MAX_CODE_COLUMNS = 64              # frames of at most this many int64 columns (codebooks + stop)
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
    ABORT_LOOK_NS = tl.constexpr(20_000)     # a fill reads its abort word this often (_wait_for)

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def _wait_for(flag_ptr, seq, status_ptr, timeout_ns, abort_ptr, TIMER: tl.constexpr, ABORTABLE: tl.constexpr):
        """Spin until the flag reaches seq, with an acquire at system scope (what the flag's
        release published is then seen); past timeout_ns (TIMER; else after one look, for the
        interpreter) give up with status = 1. ABORTABLE: every ABORT_LOOK_NS also read the abort
        word (host memory, set by the host's CPU: Mailbox.abort) and go on once it is set, with no
        status. No CUDA call could release the wait: on the H200 a copy from a stream of its own
        queued behind the spinning fill and waited out its timeout (session 27 run 1). Only the
        fill reads it, and rarely: the receive reading it every 64 turns took a stack of 8
        streams from RTF 0.19 to 0.43 (session 27 run 3)."""
        want = seq.to(tl.int64)
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        aborted = 0
        if TIMER:
            start = _now()
            now = start
            looked = start
            while (seen < want) & (now - start < timeout_ns) & (aborted == 0):
                seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
                now = _now()
                if ABORTABLE:
                    if now - looked > ABORT_LOOK_NS:
                        aborted = tl.load(abort_ptr, volatile=True)
                        looked = now
        elif ABORTABLE:
            aborted = tl.load(abort_ptr, volatile=True)
        if (seen < want) & (aborted == 0):
            tl.store(status_ptr, 1)

    # No integer argument is specialised: a value of 1 or a multiple of 16 would otherwise compile a
    # kernel of its own (a step of one row, of eight, each seq...), after SERVING, while a request
    # waits (session 26: the frames' publish and fill did, before these lists). Pointers keep their
    # alignment: every slot starts on a 128-byte line (_slot), so serving meets warm_up's kernels.
    @triton.jit(do_not_specialize=["n_words", "seq"])
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

    @triton.jit(do_not_specialize=["seq", "n_words", "timeout_ns"])
    def _receive_kernel(flag_ptr, seq, src_ptr, dst_ptr, n_words, status_ptr, timeout_ns,
                        BLOCK: tl.constexpr, TIMER: tl.constexpr):
        """Spin until the flag reaches seq (acquire, system scope), then copy n_words src -> dst
        (from L2: `.cg`, never a line this SM's L1 kept from the slot's last use), BLOCK words at
        a time, program p taking blocks p, p + programs, ... Past timeout_ns (TIMER; else after
        one look, for the interpreter): status = 1, and copy anyway."""
        _wait_for(flag_ptr, seq, status_ptr, timeout_ns, status_ptr, TIMER, False)
        for block in range(tl.program_id(0), tl.cdiv(n_words, BLOCK), tl.num_programs(0)):
            offs = block * BLOCK + tl.arange(0, BLOCK)
            ok = offs < n_words
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=ok, cache_modifier=".cg"), mask=ok)

    # ids and codes are views into a decode graph's staged inputs, 16-byte aligned or not by its
    # batch bucket (codes start 24 bytes in at bucket 1): one kernel for both
    @triton.jit(do_not_specialize=["seq", "n_rows", "token_offset", "semantic_codes", "residual_codes",
                                    "timeout_ns"], do_not_specialize_on_alignment=["ids_ptr", "codes_ptr"])
    def _fill_kernel(flag_ptr, seq, frames_ptr, n_rows, ids_ptr, codes_ptr, token_offset, semantic_codes,
                     residual_codes, status_ptr, timeout_ns, abort_ptr, N: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_N: tl.constexpr, TIMER: tl.constexpr):
        """Spin until the flag reaches seq (acquire, system scope; past timeout_ns: status = 1,
        and go on), then turn the published frames int64 [n_rows, N + 1] (N codes, then the stop
        flag) into a decode step's inputs: ids[r] = token_offset + c_0, codes[r, :] = c. A row
        that stopped, or has a code out of its codebook's range (c_0 < semantic_codes, c_k <
        residual_codes), becomes a padding row instead (id 0, codes all -1: a text row of token
        0), so whatever arrives the step reads only its own tables. One program."""
        _wait_for(flag_ptr, seq, status_ptr, timeout_ns, abort_ptr, TIMER, True)
        r = tl.arange(0, BLOCK_R)
        c = tl.arange(0, BLOCK_N)
        cell = (r[:, None] < n_rows) & (c[None, :] < N)
        frame = tl.load(frames_ptr + r[:, None] * (N + 1) + c[None, :], mask=cell, other=0, cache_modifier=".cg")
        stop = tl.load(frames_ptr + r * (N + 1) + N, mask=r < n_rows, other=1, cache_modifier=".cg")
        limit = tl.where(c == 0, semantic_codes, residual_codes).to(tl.int64)
        wrong = cell & ((frame < 0) | (frame >= limit[None, :]))
        bad = (tl.max(wrong.to(tl.int32), axis=1) > 0) | (stop != 0)
        first = tl.sum(tl.where(c[None, :] == 0, frame, 0), axis=1)
        tl.store(ids_ptr + r, tl.where(bad, 0, first + token_offset), mask=r < n_rows)
        tl.store(codes_ptr + r[:, None] * N + c[None, :], tl.where(bad[:, None], -1, frame), mask=cell)


def _slot_words(rows: int, row_words: int) -> int:
    """A slot's stride in a region: its rows, rounded up to 128 bytes (every slot starts on a line
    of its own, so a kernel sees the same pointer alignment whatever the slot or the row size)."""
    return -(-rows * row_words // 32) * 32


def _slot(words: torch.Tensor, rows: int, slots: int, seq: int, row_words: int) -> torch.Tensor:
    """The words from slot seq % slots on, in a region of int32 `words`: HEADER_WORDS, then
    slots x rows rows of row_words each (each slot `_slot_words` long)."""
    return words[HEADER_WORDS + (seq % slots) * _slot_words(rows, row_words):]


def publish_rows(words: torch.Tensor, rows: int, slots: int, seq: int, hidden: torch.Tensor) -> None:
    """Queue hidden [n, H] into slot seq % slots of a region of int32 `words` (HEADER_WORDS, then
    slots x rows rows), then seq into its flag (the Mailbox's launch; the Inbox's for frames,
    int64 [n, N + 1])."""
    row_words = _row_words(hidden.shape[1], hidden.dtype)
    slot, n_words = _slot(words, rows, slots, seq, row_words), hidden.shape[0] * row_words
    src = hidden.contiguous().view(torch.int32).reshape(-1)
    _publish_kernel[(triton.cdiv(n_words, ROW_WORDS_PER_PROGRAM),)](
        src, slot, n_words, words[TICKET_WORD:], words[FLAG_WORD:].view(torch.int64), seq,
        BLOCK=ROW_WORDS_PER_PROGRAM, num_warps=4)


def receive_rows(words: torch.Tensor, rows: int, slots: int, seq: int, out: torch.Tensor, status: torch.Tensor,
                 timeout_ns: int) -> None:
    """Queue the wait for seq in a buffer's flag and the copy of slot seq % slots into out [n, H]
    (status [1] int32 := 1 if the wait gave up; the Inbox's launch)."""
    row_words = _row_words(out.shape[1], out.dtype)
    slot, n_words = _slot(words, rows, slots, seq, row_words), out.shape[0] * row_words
    _receive_kernel[(min(triton.cdiv(n_words, ROW_WORDS_PER_PROGRAM), MAX_WAITERS),)](
        words[FLAG_WORD:].view(torch.int64), seq, slot, out.view(torch.int32).reshape(-1), n_words,
        status, timeout_ns, BLOCK=ROW_WORDS_PER_PROGRAM, TIMER=not INTERPRET, num_warps=4)


def fill_frames(words: torch.Tensor, rows: int, slots: int, seq: int, ids: torch.Tensor, codes: torch.Tensor,
                token_offset: int, semantic_codes: int, residual_codes: int, status: torch.Tensor,
                timeout_ns: int, abort: torch.Tensor) -> None:
    """Queue the wait for the frames published under seq in a region of int32 `words` (HEADER_WORDS,
    then slots x rows frames of N + 1 int64) and their rows' inputs into ids int64 [n] and codes
    int64 [n, N] (contiguous rows; status [1] int32 := 1 if the wait gave up; abort [1] int32,
    abort_word's: once set the wait goes on, see _wait_for; Mailbox.fill's launch)."""
    n, width = codes.shape
    if ids.shape != (n,) or ids.dtype != torch.int64 or codes.dtype != torch.int64 or codes.stride() != (width, 1):
        raise ValueError(f"inputs ids {tuple(ids.shape)} {ids.dtype} / codes {tuple(codes.shape)} {codes.dtype}")
    slot = _slot(words, rows, slots, seq, 2 * (width + 1))
    _fill_kernel[(1,)](
        words[FLAG_WORD:].view(torch.int64), seq, slot.view(torch.int64), n, ids, codes, token_offset,
        semantic_codes, residual_codes, status, timeout_ns, abort, N=width,
        BLOCK_R=triton.next_power_of_2(max(n, MAX_ROWS)), BLOCK_N=triton.next_power_of_2(width), TIMER=not INTERPRET,
        num_warps=1)


def _row_words(hidden_size: int, dtype: torch.dtype) -> int:
    nbytes = hidden_size * dtype.itemsize
    if nbytes % 4:
        raise HandoffError(f"a hidden row of {nbytes} bytes is not whole int32 words")
    return nbytes // 4


def _rows_region_words(rows: int, hidden_size: int, dtype: torch.dtype, slots: int) -> int:
    """The hidden rows' region, in int32 words: its header and slots (so the frames' region after
    it starts on a 128-byte line too)."""
    return HEADER_WORDS + slots * _slot_words(rows, _row_words(hidden_size, dtype))


def buffer_bytes(rows: int, hidden_size: int, dtype: torch.dtype, slots: int, code_columns: int = 0) -> int:
    """The whole buffer: the hidden rows' region, then (code_columns > 0) the frames' region:
    HEADER_WORDS, then slots x rows frames of code_columns int64."""
    frames = HEADER_WORDS + slots * _slot_words(rows, 2 * code_columns) if code_columns else 0
    return 4 * (_rows_region_words(rows, hidden_size, dtype, slots) + frames)


def frame_columns(num_codebooks: int) -> int:
    """The int64 columns of a frame in the frames' region: its codes, then its stop flag."""
    return num_codebooks + 1


def abort_word() -> torch.Tensor:
    """An int32 [1] a fill reads (fill_frames): host memory, pinned where CUDA is, which the GPU
    reads where it lies (mapped pinned memory) and the CPU sets with a plain store."""
    return torch.zeros(1, dtype=torch.int32, pin_memory=torch.cuda.is_available())


def warm_up(device: torch.device | str, hidden_size: int, dtype: torch.dtype, code_columns: int) -> None:
    """Compile every kernel here before SERVING (each stage's warm-up, when `enabled`): publish,
    receive and fill, through a buffer of this process laid out as a Mailbox's, a step of one row
    and of MAX_ROWS. Their first launch in serving would otherwise compile them while a request
    waits (services/common/kernel_watch.py logged it, session 26)."""
    device = torch.device(device)
    rows, width = MAX_ROWS, code_columns - 1
    words = torch.zeros(buffer_bytes(rows, hidden_size, dtype, SLOTS, code_columns) // 4, dtype=torch.int32,
                        device=device)
    split = _rows_region_words(rows, hidden_size, dtype, SLOTS)
    status = torch.zeros(1, dtype=torch.int32, device=device)
    abort = abort_word()
    for seq, n in enumerate((1, rows), start=1):
        publish_rows(words[:split], rows, SLOTS, seq, torch.zeros(n, hidden_size, dtype=dtype, device=device))
        receive_rows(words[:split], rows, SLOTS, seq, torch.empty(n, hidden_size, dtype=dtype, device=device), status,
                     RECEIVE_TIMEOUT_NS)
        if width > 0:
            frames = torch.zeros(n, code_columns, dtype=torch.int64, device=device)
            publish_rows(words[split:], rows, SLOTS, seq, frames)
            fill_frames(words[split:], rows, SLOTS, seq, torch.empty(n, dtype=torch.int64, device=device),
                        torch.empty(n, width, dtype=torch.int64, device=device), 0, 1, 1, status,
                        RECEIVE_TIMEOUT_NS, abort)
    torch.cuda.synchronize(device)
    if int(status[0]):
        raise HandoffError("the device hand-off's warm-up waited in vain for its own rows")


def warm_up_handoff(device: torch.device | str, hidden_size: int, dtype: torch.dtype, code_columns: int) -> None:
    """`warm_up` for a stage's start: a failure is logged, not raised (the stages then set no
    hand-off up, or the first one compiles what it needs)."""
    try:
        warm_up(device, hidden_size, dtype, code_columns)
    except Exception:
        log.exception("the device hand-off's warm-up failed")


# --------------------------------------------------------------------------------------------
# the two ends
# --------------------------------------------------------------------------------------------

class _SharedRows:
    """What both ends know of the buffer: its geometry, its int32 words once mapped, and how each
    lets it go (`_release`)."""

    def __init__(self, rows: int, slots: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str,
                 code_columns: int = 0):
        if not (1 <= rows and 2 <= slots <= 64):
            raise HandoffError(f"a buffer of {rows} rows x {slots} slots")
        if not 0 <= code_columns <= MAX_CODE_COLUMNS:
            raise HandoffError(f"frames of {code_columns} columns (at most {MAX_CODE_COLUMNS})")
        self.rows, self.slots, self.hidden_size, self.dtype = rows, slots, hidden_size, dtype
        self.code_columns = code_columns
        self.device = torch.device(device)
        self.nbytes = buffer_bytes(rows, hidden_size, dtype, slots, code_columns)
        if self.nbytes > MAX_BUFFER_BYTES:
            raise HandoffError(f"a buffer of {self.nbytes} bytes is over {MAX_BUFFER_BYTES}")
        self._ptr = 0
        self.words: torch.Tensor | None = None          # the hidden rows' region
        self.frame_words: torch.Tensor | None = None    # the frames' region (code_columns > 0)
        self.frames_ready = False                        # both ends agreed to pass frames there
        # the record of this end's waits (receive, fill): 1 once one gave up; its host copy is
        # queued behind each wait and read after the step (_gave_up)
        self._status = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._status_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.timeout_ns = RECEIVE_TIMEOUT_NS

    def _recorded(self) -> None:
        """Queue the wait record's copy to the host behind a wait just queued."""
        self._status_host.copy_(self._status, non_blocking=True)

    def _gave_up(self) -> bool:
        """Did a wait queued so far give up? Read once the stream has run it; clears the record."""
        if int(self._status_host[0]):
            self._status.zero_()
            self._status_host.zero_()
            return True
        return False

    def _map(self, ptr: int) -> None:
        self._ptr = ptr
        everything = _words(ptr, self.nbytes, self.device)
        split = _rows_region_words(self.rows, self.hidden_size, self.dtype, self.slots)
        self.words = everything[:split]
        self.frame_words = everything[split:] if self.code_columns else None

    def _release(self, ptr: ctypes.c_void_p) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Let the buffer go once this device's queued work is done (idempotent)."""
        if self._ptr:
            torch.cuda.synchronize(self.device)
            self.words = self.frame_words = None
            self._release(ctypes.c_void_p(self._ptr))
            self._ptr = 0


class Mailbox(_SharedRows):
    """The backbone's end: a buffer of `slots` x `rows` hidden rows in its GPU memory, which the
    tower maps. `publish` queues a step's rows there on the current stream and returns its
    sequence number; `answered` tells it a step's response came back. With `code_columns`, room
    for the frames of each step too, which the tower publishes there once it has agreed to
    (`frames_ready`, set by whoever set the hand-off up); `fill` then queues a decode step's
    inputs from them."""

    def __init__(self, rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str,
                 slots: int = SLOTS, code_columns: int = 0):
        super().__init__(rows, slots, hidden_size, dtype, device, code_columns)
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
        if self.frame_words is not None:
            self.frame_words.zero_()
        torch.cuda.synchronize(self.device)
        self.seq = 0
        self._unanswered: collections.deque[int] = collections.deque()
        self._abort = abort_word()                       # read by the fills, set by abort()

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

    def fill(self, seq: int, ids: torch.Tensor, codes: torch.Tensor, token_offset: int, semantic_codes: int,
             residual_codes: int) -> None:
        """Queue, on the current stream, the wait for the frames of step `seq` and their rows'
        inputs into ids int64 [n] / codes int64 [n, N] (a decode step's staged inputs, n at most
        the rows that step published): id token_offset + c_0 and the codes, or a padding row for
        a frame that stopped or is out of range (_fill_kernel). Check `fill_timed_out` after the
        stream has run it."""
        if not self.frames_ready or codes.shape[1] + 1 != self.code_columns:
            raise ValueError(f"no frames of {codes.shape[1]} codes in this buffer (frames_ready {self.frames_ready}, "
                             f"{self.code_columns} columns)")
        if not (0 < codes.shape[0] <= self.rows) or not (0 < seq <= self.seq):
            raise ValueError(f"frames of step {seq} for {codes.shape[0]} rows (published up to {self.seq}, "
                             f"{self.rows} rows a step)")
        fill_frames(self.frame_words, self.rows, self.slots, seq, ids, codes, token_offset, semantic_codes,
                    residual_codes, self._status, self.timeout_ns, self._abort)
        self._recorded()

    def abort(self) -> None:
        """Let every fill of this process go on at once, whatever it waits for: the tower is gone
        and will publish nothing more (TowerClient, when the stream breaks). A store of the host's
        CPU into the abort word the waits read (_wait_for), no CUDA call; the buffer takes no
        frames again (`frames_ready` off, and its waits no longer wait: the client sets up a new one)."""
        self.frames_ready = False
        self._abort[0] = 1

    def fill_timed_out(self) -> bool:
        """Did a fill queued so far give up waiting (the tower never published those frames)?
        Read once the stream has run it; clears the record."""
        return self._gave_up()


class Inbox(_SharedRows):
    """The tower's end: the backbone's buffer mapped from its IPC handle; `receive` queues the
    wait and the copy of a published step's rows on the current stream, `publish_frames` (with
    code_columns) the step's frames on the way back."""

    def __init__(self, handle: bytes, rows: int, slots: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str, code_columns: int = 0):
        if len(handle) != HANDLE_BYTES:
            raise HandoffError(f"an IPC handle is {HANDLE_BYTES} bytes, got {len(handle)}")
        super().__init__(rows, slots, hidden_size, dtype, device, code_columns)
        lib = _cudart()
        with torch.cuda.device(self.device):
            ptr = ctypes.c_void_p()
            _check(lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), _IpcHandle.from_buffer_copy(handle), ctypes.c_uint(1)),
                   "cudaIpcOpenMemHandle")
        self._map(ptr.value)
        self.received = torch.empty(rows, hidden_size, dtype=dtype, device=self.device)

    def _release(self, ptr: ctypes.c_void_p) -> None:
        _cudart().cudaIpcCloseMemHandle(ptr)

    def receive(self, seq: int, n_rows: int) -> torch.Tensor:
        """Queue the wait for step `seq` and the copy of its n_rows rows; the rows [n, H] (valid
        on the current stream after what is queued). Check `timed_out` after the stream has run."""
        if not (0 < n_rows <= self.rows) or seq < 1:
            raise ValueError(f"step {seq} of {n_rows} rows: the buffer holds 1..{self.rows} rows a step")
        out = self.received[:n_rows]
        receive_rows(self.words, self.rows, self.slots, seq, out, self._status, self.timeout_ns)
        self._recorded()
        return out

    def publish_frames(self, seq: int, frames: torch.Tensor) -> None:
        """Queue step `seq`'s frames int64 [n, N + 1] (codes, then the stop flag; on this device,
        at most `rows`) into their slot, then seq into the frames' flag, on the current stream."""
        if self.frame_words is None or frames.dtype != torch.int64 or frames.dim() != 2 \
                or frames.shape[1] != self.code_columns or not 0 < frames.shape[0] <= self.rows:
            raise ValueError(f"cannot publish frames {tuple(frames.shape)} {frames.dtype} (buffer: up to "
                             f"{self.rows} x {self.code_columns} int64)")
        publish_rows(self.frame_words, self.rows, self.slots, seq, frames)

    def timed_out(self) -> bool:
        """Did a wait queued so far give up? Read once the stream has run it (the step's codes
        came back); clears the record."""
        return self._gave_up()
