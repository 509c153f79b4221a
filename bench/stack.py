"""Start a stack for the serving benchmarks and keep it up until SIGTERM / Ctrl-C.

    python -m bench.stack --random-weights full --device cuda --max-sessions 128 --url-file /tmp/url
    python -m bench.stack --preset tiny --device cpu --url-file /tmp/url         (tiny checkpoint)

With --random-weights the three stages build the preset's geometry with random values on the
device (no checkpoint files; bench/e2e.py's `start_stack`), and the gateway reads a config-only
directory. Otherwise the stages load the checkpoint (--checkpoint, default the tiny one).
The pools are sized for the sweep: DRAMA_MAX_ROWS = --max-sessions sessions of
DRAMA_MAX_CONTEXT_TOKENS = --max-context rows in the backbone and the tower. Once every stage is
SERVING and the gateway is ready, the gateway URL is written to --url-file (and printed), so a
shell script can start this in the background, wait for the file, and run bench.load /
bench.voice_prefix / bench.batch_invariance against it.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import io
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path


@contextlib.contextmanager
def background(stack_args: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 300.0):
    """`python -m bench.stack STACK_ARGS` in the background; yields the gateway URL once the stack
    is ready and stops it afterwards (for the benches and tests that need a stack of their own)."""
    scratch = tempfile.TemporaryDirectory(prefix="bench-stack-")
    url_file = Path(scratch.name) / "url"
    process = subprocess.Popen([sys.executable, "-m", "bench.stack", *stack_args, "--url-file", str(url_file)],
                               env=env)
    try:
        deadline = time.monotonic() + timeout_s
        while not url_file.exists():
            if process.poll() is not None:
                raise RuntimeError(f"bench.stack exited ({process.returncode}) before the stack was ready")
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench.stack: not ready in {timeout_s:.0f} s")
            time.sleep(0.2)
        yield url_file.read_text().strip()
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:      # a stack that does not drain is killed, not left behind
            process.kill()
            process.wait()
        scratch.cleanup()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stack", description=__doc__.splitlines()[0])
    parser.add_argument("--random-weights", choices=["full", "tiny"], default=None,
                        help="random weights of this preset made on the device (no checkpoint)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="checkpoint dir (default: tiny)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-sessions", type=int, default=8)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--url-file", type=Path, default=None)
    parser.add_argument("--info-file", type=Path, default=None,
                        help="also write {url, pids, ready_s, log_dir} as JSON once ready (bench.e2e --stack-info)")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)

    from bench.e2e import start_stack, wait_stack_ready
    from services.common.make_checkpoint import make_checkpoint
    from services.launcher import ensure_checkpoint

    os.environ["DRAMA_MAX_ROWS"] = str(args.max_sessions)
    os.environ["DRAMA_MAX_CONTEXT_TOKENS"] = str(args.max_context)
    tmp = Path(tempfile.mkdtemp(prefix="bench-stack-"))
    log_dir = args.log_dir or tmp / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.random_weights:
        config_dir = tmp / "config"
        with contextlib.redirect_stdout(io.StringIO()):
            make_checkpoint(config_dir, preset=args.random_weights, dry_run=True)
        stage_args = ["--random-weights", args.random_weights]
    else:
        config_dir = args.checkpoint or ensure_checkpoint()
        stage_args = ["--checkpoint", str(config_dir)]
    stack = start_stack(stage_args, args.device, config_dir, log_dir)
    stopping = False

    def stop(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        wait_stack_ready(stack, args.ready_timeout)
        print(f"ready ({', '.join(f'{k} {v:.1f} s' for k, v in stack.ready_s.items())}): {stack.url} "
              f"(logs in {log_dir})", flush=True)
        if args.info_file:       # written before the URL file, which is what scripts wait for
            info = {"url": stack.url, "pids": {name: p.popen.pid for name, p in stack.processes.items()},
                    "ready_s": stack.ready_s, "log_dir": str(log_dir),
                    "max_sessions": args.max_sessions, "max_context": args.max_context}
            args.info_file.write_text(json.dumps(info, indent=2) + "\n")
        if args.url_file:
            args.url_file.write_text(stack.url + "\n")
        while not stopping:
            dead = [p for p in stack.processes.values() if not p.alive()]
            if dead:
                print(f"bench.stack: {dead[0].describe_exit()}\n{dead[0].log_tail(30)}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
