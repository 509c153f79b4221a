"""Shared fixtures: the tiny random-weight checkpoint, made once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Two CI cores: keep torch from oversubscribing them when servers and tests share the process.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The MODEL.md §10 tiny checkpoint (seed 0), written once for the whole session."""
    from services.common.make_checkpoint import make_checkpoint

    out = tmp_path_factory.mktemp("tiny") / "ckpt"
    make_checkpoint(out, preset="tiny", seed=0, progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_config(tiny_checkpoint):
    from services.common.config import load_config

    return load_config(tiny_checkpoint)


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """One intra-op thread for a module's direct model calls, as the stages' model workers use:
    the CPU paths are many tiny ops, and OpenMP fork/joins dominate them on a busy 2-core box.
    Modules opt in with `pytestmark = pytest.mark.usefixtures("one_intra_op_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# A test still running after STALL_DUMP_S prints every thread's stack and every asyncio task's,
# once, to stderr. pytest-timeout (600 s, pyproject.toml) then fails it with the threads only; a
# stalled async test's threads all sit idle in epoll, and what each coroutine waits on is what
# the task stacks show (a CI run hung once in the voice-prefix test with the prefill lane).
STALL_DUMP_S = float(os.environ.get("DRAMA_TEST_STALL_DUMP_S", "240"))


def _dump_stalled(nodeid: str) -> None:
    import asyncio
    import faulthandler
    import gc
    import sys
    import warnings

    print(f"\n==== {nodeid} still running after {STALL_DUMP_S:.0f} s: threads, then asyncio tasks ====",
          file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    with warnings.catch_warnings():             # isinstance on every object trips deprecated attributes
        warnings.simplefilter("ignore")
        loops = [obj for obj in gc.get_objects()
                 if isinstance(obj, asyncio.AbstractEventLoop) and not obj.is_closed()]
    for loop in loops:
        for _ in range(3):          # the task set may change under us: read it again
            try:
                tasks = list(asyncio.all_tasks(loop))
                break
            except RuntimeError:
                tasks = []
        for task in tasks:
            print(f"-- {task!r}", file=sys.stderr)
            try:
                task.print_stack(file=sys.stderr)
            except Exception as exc:   # a diagnostic: never let it raise into the test thread
                print(f"   (no stack: {exc!r})", file=sys.stderr)
    sys.stderr.flush()


@pytest.fixture(autouse=True)
def _dump_stacks_if_stalled(request):
    import threading

    timer = threading.Timer(STALL_DUMP_S, _dump_stalled, args=(request.node.nodeid,))
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()
