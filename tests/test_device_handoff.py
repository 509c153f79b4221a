"""services/common/device_handoff.py: a step's rows from the backbone to the tower on the GPU.

The two kernels (publish: rows into a slot, then the flag; receive: wait for the flag, copy the
slot out) run on a CUDA GPU or in Triton's CPU interpreter:
    TRITON_INTERPRET=1 python -m pytest -q tests/test_device_handoff.py
The Mailbox / Inbox pair (cudaMalloc, CUDA IPC between two processes) needs a CUDA GPU; the
switch (`enabled`) is checked everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch

from services.common import device_handoff as dh

INTERPRET = dh.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = dh.HAS_TRITON and torch.cuda.is_available()
kernel = pytest.mark.skipif(not (CUDA or INTERPRET),
                            reason="needs a CUDA GPU with Triton (or TRITON_INTERPRET=1 with Triton)")
DEVICE = "cuda" if CUDA else "cpu"


def test_enabled_only_on_cuda_and_by_the_switch(monkeypatch):
    monkeypatch.setenv("DRAMA_DEVICE_HANDOFF", "1")
    assert not dh.enabled("cpu")                          # never off CUDA, whatever the switch
    if CUDA:
        assert dh.enabled("cuda")
        monkeypatch.setenv("DRAMA_DEVICE_HANDOFF", "0")
        assert not dh.enabled("cuda")
        monkeypatch.delenv("DRAMA_DEVICE_HANDOFF")
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/nonexistent-mps")
        assert not dh.enabled("cuda")                     # no MPS daemon: no spinning waits


def test_an_ipc_handle_keeps_every_byte():
    """A CUDA IPC handle is 64 opaque bytes, zeros included, both ways through ctypes (a c_char
    array would have cut it at its first zero byte: the H200 run that found it, session 25)."""
    raw = bytes([0, 7, 0, 0, 255]) * 12 + bytes(4)
    handle = dh._IpcHandle.from_buffer_copy(raw)
    assert bytes(handle) == raw and len(bytes(handle)) == dh.HANDLE_BYTES


def test_buffer_layout():
    # bf16 rows of 2048: 1024 words each, 64 header words
    assert dh.buffer_bytes(128, 2048, torch.bfloat16, 4) == 4 * (64 + 4 * 128 * 1024)
    with pytest.raises(dh.HandoffError, match="whole int32 words"):
        dh.buffer_bytes(1, 3, torch.bfloat16, 4)
    # frames after the rows, from a 128-byte line on: 64 header words, then int64 columns
    # (rows of 12 bf16: 6 words; every slot on a 128-byte line: 2 x 6 -> 32 words, 2 x 22 -> 64)
    assert dh.buffer_bytes(2, 12, torch.bfloat16, 4, code_columns=11) == 4 * (64 + 4 * 32 + 64 + 4 * 64)


# frames as the tower publishes them: N = 10 codes (semantic < 4096, residual < 1024), then stop
N, SEMANTIC, RESIDUAL, OFFSET = 10, 4096, 1024, 151_000


def _frames_buffer(rows: int, slots: int) -> torch.Tensor:
    return torch.zeros(dh.buffer_bytes(rows, 2048, torch.bfloat16, slots, N + 1) // 4, dtype=torch.int32,
                       device=DEVICE)[dh._rows_region_words(rows, 2048, torch.bfloat16, slots):]


def _frame(gen, stop: int = 0) -> list[int]:
    return ([int(torch.randint(SEMANTIC, (1,), generator=gen))]
            + torch.randint(RESIDUAL, (N - 1,), generator=gen).tolist() + [stop])


@kernel
@pytest.mark.parametrize("n_rows", [1, 3, 8])
def test_published_frames_fill_the_next_steps_inputs(n_rows):
    """Steps 1..6 through 4 slots: each fill gives every row the id token_offset + c_0 and the
    codes published under its seq; a stopped row and rows with a code out of range (either
    side of either codebook) become padding rows (id 0, codes -1); the ticket is back to zero."""
    rows, slots = 8, 4
    words = _frames_buffer(rows, slots)
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    for seq in range(1, 7):
        frames = [_frame(gen) for _ in range(n_rows)]
        if n_rows > 1:
            frames[-1][N] = 1                                         # stopped
            frames[0][0] = SEMANTIC if seq % 2 else -1                # semantic code out of range
        if n_rows > 2:
            frames[1][N - 1] = RESIDUAL if seq % 3 else -5            # a residual code out of range
        dh.publish_rows(words, rows, slots, seq, torch.tensor(frames, dtype=torch.int64, device=DEVICE))
        ids = torch.full((n_rows,), 77, dtype=torch.int64, device=DEVICE)
        codes = torch.full((n_rows, N), 77, dtype=torch.int64, device=DEVICE)
        dh.fill_frames(words, rows, slots, seq, ids, codes, OFFSET, SEMANTIC, RESIDUAL, status, 10**9, dh.abort_word())
        for r, frame in enumerate(frames):
            bad = frame[N] != 0 or not 0 <= frame[0] < SEMANTIC or any(not 0 <= c < RESIDUAL for c in frame[1:N])
            assert bad == (n_rows > 1 and r in (0, 1, n_rows - 1)), (seq, r)
            want_id, want_codes = (0, [-1] * N) if bad else (OFFSET + frame[0], frame[:N])
            assert int(ids[r]) == want_id and codes[r].tolist() == want_codes, (seq, r)
        assert int(words[dh.TICKET_WORD]) == 0 and int(status[0]) == 0


@kernel
def test_the_warm_up_runs_every_kernel(monkeypatch):
    """warm_up: publish, receive and fill through a buffer of its own (each stage calls it
    before SERVING on CUDA); its receive gets the rows it published."""
    if not CUDA:                                      # the interpreter: no stream to wait for
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    dh.warm_up(DEVICE, 2048, torch.bfloat16, N + 1)


@kernel
def test_released_waiters_go_on_at_once():
    """A set abort word (Mailbox.abort, the tower gone): a fill for frames never published goes on
    without waiting for its timeout, and reports no timeout."""
    words = _frames_buffer(2, 4)
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    abort = dh.abort_word()
    abort[0] = 1
    ids = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    codes = torch.zeros(1, N, dtype=torch.int64, device=DEVICE)
    dh.fill_frames(words, 2, 4, 7, ids, codes, OFFSET, SEMANTIC, RESIDUAL, status, 10**12, abort)   # ~17 min
    assert int(status[0]) == 0


@kernel
def test_a_fill_for_frames_never_published_gives_up():
    words = _frames_buffer(2, 4)
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    ids = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    codes = torch.zeros(1, N, dtype=torch.int64, device=DEVICE)
    dh.fill_frames(words, 2, 4, 1, ids, codes, OFFSET, SEMANTIC, RESIDUAL, status, 1_000_000, dh.abort_word())  # 1 ms
    assert int(status[0]) == 1


@kernel
@pytest.mark.parametrize("n_rows", [1, 3, dh.MAX_WAITERS + 3])
def test_published_rows_come_out_of_their_slot(n_rows):
    """Steps 1..6 through a buffer of 4 slots (two rounds): each receive gives exactly the rows
    published under its seq (more rows than the receive has programs too), the flag holds the
    last seq, the ticket is back to zero."""
    rows, slots, hidden = 16, 4, 2048
    words = torch.zeros(dh.buffer_bytes(rows, hidden, torch.bfloat16, slots) // 4, dtype=torch.int32, device=DEVICE)
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    for seq in range(1, 7):
        sent = torch.randn(n_rows, hidden, generator=gen).to(torch.bfloat16).to(DEVICE)
        dh.publish_rows(words, rows, slots, seq, sent)
        out = torch.full((n_rows, hidden), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        dh.receive_rows(words, rows, slots, seq, out, status, 10**9)
        assert torch.equal(out.cpu(), sent.cpu()), seq
        assert int(words[dh.FLAG_WORD:].view(torch.int64)[0]) == seq
        assert int(words[dh.TICKET_WORD]) == 0
        assert int(status[0]) == 0


@kernel
def test_a_wait_for_a_step_never_published_gives_up():
    rows, slots, hidden = 2, 4, 2048
    words = torch.zeros(dh.buffer_bytes(rows, hidden, torch.bfloat16, slots) // 4, dtype=torch.int32, device=DEVICE)
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = torch.zeros(1, hidden, dtype=torch.bfloat16, device=DEVICE)
    dh.receive_rows(words, rows, slots, 1, out, status, 1_000_000)     # 1 ms
    assert int(status[0]) == 1


def _receiving_process(handle: bytes, rows: int, slots: int, seqs: list[int], n_rows: int, queue) -> None:
    inbox = dh.Inbox(handle, rows, slots, 2048, torch.bfloat16, "cuda")
    try:
        for seq in seqs:       # as bytes: a tensor through the queue needs this process alive to be read
            queue.put(inbox.receive(seq, n_rows).cpu().view(torch.int16).numpy().tobytes())
        torch.cuda.synchronize()
        queue.put(inbox.timed_out())
    finally:
        inbox.close()


@pytest.mark.skipif(not CUDA, reason="CUDA IPC needs a CUDA GPU")
def test_mailbox_to_an_inbox_in_another_process():
    """The Mailbox's rows reach an Inbox that another process opened from its handle."""
    import torch.multiprocessing as mp

    box = dh.Mailbox(4, 2048, torch.bfloat16, "cuda", slots=4)
    try:
        sent = [torch.randn(2, 2048, device="cuda").to(torch.bfloat16) for _ in range(3)]
        seqs = []
        for rows in sent:
            assert box.can_publish(2)
            seqs.append(box.publish(rows))
            box.answered(seqs[-1])
        assert not box.can_publish(5)                    # more rows than a slot holds
        torch.cuda.synchronize()
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_receiving_process, args=(box.handle, 4, 4, seqs[1:], 2, queue))
        proc.start()
        got = [queue.get(timeout=120) for _ in seqs[1:]]
        timed_out = queue.get(timeout=120)
        proc.join(60)
        assert not timed_out
        for rows, out in zip(sent[1:], got):
            assert out == rows.cpu().view(torch.int16).numpy().tobytes()
    finally:
        box.close()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_unanswered_steps_hold_their_slots():
    box = dh.Mailbox(1, 2048, torch.bfloat16, "cuda", slots=3)
    try:
        row = torch.zeros(1, 2048, device="cuda", dtype=torch.bfloat16)
        first = box.publish(row)
        box.publish(row)
        assert not box.can_publish(1)                    # two unanswered of three slots
        with pytest.raises(ValueError, match="unanswered"):
            box.publish(row)
        box.answered(first)
        assert box.can_publish(1)
    finally:
        box.close()


def _frames_process(handle: bytes, rows: int, slots: int, published: dict, queue) -> None:
    inbox = dh.Inbox(handle, rows, slots, 2048, torch.bfloat16, "cuda", code_columns=N + 1)
    try:
        for seq, frames in published.items():
            inbox.publish_frames(seq, torch.tensor(frames, dtype=torch.int64, device="cuda"))
        torch.cuda.synchronize()
        queue.put("published")
    finally:
        inbox.close()


@pytest.mark.skipif(not CUDA, reason="CUDA IPC needs a CUDA GPU")
def test_frames_from_an_inbox_in_another_process_fill_the_mailbox_steps():
    """The way back: frames an Inbox publishes in another process reach the Mailbox's fill."""
    import torch.multiprocessing as mp

    box = dh.Mailbox(4, 2048, torch.bfloat16, "cuda", slots=4, code_columns=N + 1)
    box.frames_ready = True
    try:
        gen = torch.Generator().manual_seed(3)
        published = {}
        for _ in range(3):
            seq = box.publish(torch.zeros(3, 2048, device="cuda", dtype=torch.bfloat16))
            box.answered(seq)
            published[seq] = [_frame(gen) for _ in range(3)]
        published[3][2][N] = 1                                        # stopped
        torch.cuda.synchronize()
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_frames_process, args=(box.handle, 4, 4, published, queue))
        proc.start()
        assert queue.get(timeout=120) == "published"
        proc.join(60)
        for seq, frames in published.items():
            ids = torch.zeros(3, dtype=torch.int64, device="cuda")
            codes = torch.zeros(3, N, dtype=torch.int64, device="cuda")
            box.fill(seq, ids, codes, OFFSET, SEMANTIC, RESIDUAL)
            torch.cuda.synchronize()
            for r, frame in enumerate(frames):
                want = (0, [-1] * N) if frame[N] else (OFFSET + frame[0], frame[:N])
                assert (int(ids[r]), codes[r].tolist()) == want, (seq, r)
        assert not box.fill_timed_out()
        with pytest.raises(ValueError, match="published up to"):
            box.fill(9, ids, codes, OFFSET, SEMANTIC, RESIDUAL)
    finally:
        box.close()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (Triton's specialisation hook)")
def test_after_the_warm_up_serving_compiles_nothing():
    """What serving launches after warm_up (steps of 1 and 3 rows into every slot, frames, and a
    fill into a decode graph's staged inputs at bucket 1, 24 bytes off 16-byte alignment) meets
    kernels the warm-up compiled: kernel_watch counts no specialisation."""
    from services.common import kernel_watch

    dh.warm_up("cuda", 2048, torch.bfloat16, N + 1)
    assert kernel_watch.watch_after_serving()
    before = kernel_watch.late_specialisations
    rows, slots = dh.MAX_ROWS, dh.SLOTS
    words = torch.zeros(dh.buffer_bytes(rows, 2048, torch.bfloat16, slots, N + 1) // 4, dtype=torch.int32,
                        device="cuda")
    split = dh._rows_region_words(rows, 2048, torch.bfloat16, slots)
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    abort = dh.abort_word()
    inputs = torch.zeros((3 + N) * 1, dtype=torch.int64, device="cuda")       # bucket 1's staged inputs
    for seq in range(1, 2 * slots + 1):
        n = 1 if seq % 2 else 3
        dh.publish_rows(words[:split], rows, slots, seq, torch.zeros(n, 2048, dtype=torch.bfloat16, device="cuda"))
        dh.receive_rows(words[:split], rows, slots, seq, torch.empty(n, 2048, dtype=torch.bfloat16, device="cuda"),
                        status, 10**9)
        dh.publish_rows(words[split:], rows, slots, seq, torch.zeros(n, N + 1, dtype=torch.int64, device="cuda"))
        ids, codes = (inputs[2:3], inputs[3:].view(1, N)) if n == 1 else (
            torch.empty(n, dtype=torch.int64, device="cuda"), torch.empty(n, N, dtype=torch.int64, device="cuda"))
        dh.fill_frames(words[split:], rows, slots, seq, ids, codes, OFFSET, SEMANTIC, RESIDUAL, status, 10**9, abort)
    torch.cuda.synchronize()
    assert int(status[0]) == 0
    assert kernel_watch.late_specialisations == before


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_an_abort_releases_a_fill_spinning_on_the_gpu():
    """Mailbox.abort (the tower gone): a fill spinning on the current stream for frames that will
    never come goes on at once, with no timeout reported. (On the H200 an abort through the
    GPU waited out the timeout behind the spinning fill: a fill_ kernel from another stream in
    session 26 run 9, a copy from pinned memory from another stream in session 27 run 1. It is a
    store of the CPU into host memory the fill reads now.)"""
    import time

    box = dh.Mailbox(2, 2048, torch.bfloat16, "cuda", slots=4, code_columns=N + 1)
    box.frames_ready = True
    try:
        seq = box.publish(torch.zeros(1, 2048, device="cuda", dtype=torch.bfloat16))
        box.timeout_ns = 100 * 10**9                              # 100 s: the abort, not the timer
        ids = torch.zeros(1, dtype=torch.int64, device="cuda")
        codes = torch.zeros(1, N, dtype=torch.int64, device="cuda")
        started = time.monotonic()
        box.fill(seq, ids, codes, OFFSET, SEMANTIC, RESIDUAL)
        box.abort()
        torch.cuda.synchronize()
        assert time.monotonic() - started < 10 and not box.fill_timed_out() and not box.frames_ready
    finally:
        box.close()
