"""The local stack behind `dramaturg up` and `dramaturg say`.

`up` starts the three stage servers and the gateway, each its own OS process on a loopback port
(`python -m services.codec|tower|backbone`, then `python -m gateway`), waits until the gateway's
`GET /ready` answers 200, prints the URL, and stops everything on Ctrl-C, on SIGTERM, or as soon as
one process dies (SIGTERM, then SIGKILL after a grace period). Each process writes its output to
`<log dir>/<name>.log`; when a start fails, the tail of the log of the process that died is shown.

`say` synthesizes one text through a running gateway (`POST /v1/audio/speech`), or, when nothing
answers at `--url`, brings a stack up on free ports for the one request and shuts it down.

Without `--checkpoint` both use the tiny random checkpoint (MODEL.md §10), generated on first use
into `$DRAMA_CACHE_DIR` (default `~/.cache/dramaturg/tiny-seed0`): written to a temporary sibling
directory, then renamed, so an interrupted or concurrent first run never leaves half a checkpoint.

The CLI wires this in with `add_up_parser(subparsers)` and `add_say_parser(subparsers)`; each
parser's `func` default is the function to call with the parsed args (it returns the exit code).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

LOOPBACK = "127.0.0.1"
DEFAULT_URL = "http://127.0.0.1:8000"
READY_TIMEOUT_S = 300.0   # tiny checkpoint on 2 CPU cores loads in well under a minute
STOP_GRACE_S = 10.0
CHILD_GRACE_S = "5"       # DRAMA_GRACE_S for the children: drain briefly, inside our own grace

FORMAT_BY_SUFFIX = {".wav": "wav", ".mp3": "mp3", ".flac": "flac", ".opus": "opus", ".ogg": "opus",
                    ".aac": "aac", ".pcm": "pcm", ".raw": "pcm"}


class StackError(RuntimeError):
    """The stack could not be started; the message carries the failing process's log tail."""


# ---------------------------------------------------------------------------------------------
# checkpoint cache
# ---------------------------------------------------------------------------------------------

def default_checkpoint_dir() -> Path:
    cache = os.environ.get("DRAMA_CACHE_DIR")
    return Path(cache) if cache else Path.home() / ".cache" / "dramaturg" / "tiny-seed0"


def _make_tiny(out_dir: Path) -> None:
    from services.common.make_checkpoint import make_checkpoint

    make_checkpoint(out_dir, preset="tiny", seed=0, progress=False)


def ensure_checkpoint(path: Path | None = None, make: Callable[[Path], None] = _make_tiny) -> Path:
    """The cached tiny checkpoint at `path` (default `default_checkpoint_dir()`), made on first use.

    `make(dir)` writes a checkpoint into an empty temporary directory next to `path`, which is
    then renamed into place; if another process got there first, its copy wins and ours is removed.
    A directory with a config.json counts as made; an empty one is filled; any other existing
    directory is refused (StackError) rather than mistaken for a checkpoint.
    """
    path = Path(path) if path is not None else default_checkpoint_dir()
    if (path / "config.json").is_file():
        return path
    if path.is_dir() and any(path.iterdir()):
        raise StackError(f"{path} exists but holds no checkpoint (no config.json); point "
                         f"DRAMA_CACHE_DIR elsewhere or remove it")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    print(f"generating the tiny checkpoint into {path} (first use) ...", file=sys.stderr)
    try:
        make(temporary)
        try:
            os.rename(temporary, path)  # also replaces an empty directory (e.g. a fresh mktemp -d)
        except OSError:
            if not (path / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)
    return path


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------

def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct ports that were free on `host` a moment ago (all held open while picking)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _die_with_parent() -> None:
    """In the child before exec (Linux): get SIGTERM if the launcher dies without cleaning up."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


@dataclass
class ManagedProcess:
    """One child process with its output in `log_path`."""
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen | None = None

    def start(self, env: dict[str, str] | None = None) -> "ManagedProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # A new session keeps a terminal's Ctrl-C away from the children: the launcher stops
            # them in order instead of all of them dying mid-request at once.
            self.popen = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        return self

    @property
    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def send_signal(self, signum: int) -> None:
        """Signal the child's process group (its own session), so helpers it spawned go too."""
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return "".join(deque(fh, maxlen=lines))
        except FileNotFoundError:
            return ""

    def describe_exit(self) -> str:
        code = self.returncode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        tail = self.log_tail().rstrip() or "(no output)"
        return f"{self.name} {how}; last lines of {self.log_path}:\n{tail}"


def stop_processes(processes: list[ManagedProcess], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every live process (last started first), SIGKILL what is left after `grace_s`."""
    live = [p for p in reversed(processes) if p.alive()]
    for process in live:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in live:
        try:
            process.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            process.popen.wait()


def wait_ready(url: str, processes: list[ManagedProcess], timeout_s: float = READY_TIMEOUT_S,
               poll_s: float = 0.25) -> None:
    """Poll `GET {url}/ready` until it answers 200. Raises StackError as soon as a process dies
    (with its log tail) or when `timeout_s` passes (with the last answer and every log tail)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    with httpx.Client(timeout=2.0) as client:
        while True:
            for process in processes:
                if not process.alive():
                    raise StackError(process.describe_exit())
            try:
                response = client.get(f"{url}/ready")
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}: {response.text[:500]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                tails = "\n\n".join(f"--- {p.name} ({p.log_path}) ---\n{p.log_tail(15).rstrip()}"
                                    for p in processes)
                raise StackError(f"not ready after {timeout_s:.0f} s ({url}/ready: {last})\n\n{tails}")
            time.sleep(poll_s)


def watch(processes: list[ManagedProcess], poll_s: float = 0.5) -> ManagedProcess:
    """Block until one process exits; returns it."""
    while True:
        for process in processes:
            if not process.alive():
                return process
        time.sleep(poll_s)


# ---------------------------------------------------------------------------------------------
# the stack
# ---------------------------------------------------------------------------------------------

@dataclass
class Stack:
    """The four processes of a local deployment, all on loopback (`port` 0: pick a free one)."""
    checkpoint: Path
    port: int
    device: str = "cpu"
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dramaturg-logs-")))
    processes: list[ManagedProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def commands(self, codec_port: int, tower_port: int, backbone_port: int) -> dict[str, list[str]]:
        common = ["--checkpoint", str(self.checkpoint), "--host", LOOPBACK]
        stage = common + ["--device", self.device]
        python = [sys.executable, "-m"]
        return {
            "codec": python + ["services.codec", *stage, "--port", str(codec_port)],
            "tower": python + ["services.tower", *stage, "--port", str(tower_port)],
            "backbone": python + ["services.backbone", *stage, "--port", str(backbone_port),
                                  "--tower", f"{LOOPBACK}:{tower_port}"],
            "gateway": python + ["gateway", *common, "--port", str(self.port),
                                 "--backbone", f"{LOOPBACK}:{backbone_port}",
                                 "--codec", f"{LOOPBACK}:{codec_port}"],
        }

    def start(self, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start all four (the stages listen before they load, so they start together) and wait
        for readiness; on failure everything started is stopped and StackError raised."""
        env = dict(os.environ)
        env.setdefault("DRAMA_GRACE_S", CHILD_GRACE_S)
        env.setdefault("PYTHONUNBUFFERED", "1")  # log tails must be current when a child dies
        ports = free_ports(4)
        if self.port == 0:
            self.port = ports[3]
        try:
            for name, argv in self.commands(*ports[:3]).items():
                process = ManagedProcess(name, argv, self.log_dir / f"{name}.log")
                self.processes.append(process.start(env))
            wait_ready(self.url, self.processes, ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        stop_processes(self.processes, grace_s)

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


class _Terminated(Exception):
    """SIGTERM to the launcher: stop the stack like Ctrl-C does."""


def _raise_terminated(signum, frame):
    raise _Terminated()


def run_up(args: argparse.Namespace) -> int:
    """Start the stack, print its URL, and keep it up until Ctrl-C or until a process dies."""
    checkpoint = Path(args.checkpoint) if args.checkpoint else ensure_checkpoint()
    stack = Stack(checkpoint, args.port, args.device,
                  log_dir=Path(args.log_dir) if args.log_dir else Path(
                      tempfile.mkdtemp(prefix="dramaturg-logs-")))
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    started = time.monotonic()
    try:
        print(f"starting the stack from {checkpoint} (logs in {stack.log_dir}) ...", file=sys.stderr)
        stack.start(args.ready_timeout)
        print(f"ready in {time.monotonic() - started:.1f} s: {stack.url}  (Ctrl-C stops it)", flush=True)
        died = watch(stack.processes)
        print(f"stopping: {died.describe_exit()}", file=sys.stderr)
        return 1
    except StackError as exc:
        print(f"dramaturg up failed: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Terminated):
        print("stopping ...", file=sys.stderr)
        return 0
    finally:
        stack.stop()
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------------------------
# say
# ---------------------------------------------------------------------------------------------

def format_for(output: Path, explicit: str | None) -> str:
    if explicit:
        return explicit
    try:
        return FORMAT_BY_SUFFIX[output.suffix.lower()]
    except KeyError:
        raise ValueError(f"cannot tell the audio format from {output.name!r}; pass --format "
                         f"({', '.join(sorted(set(FORMAT_BY_SUFFIX.values())))})") from None


def gateway_answers(url: str, timeout_s: float = 1.0) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class SpeechResult:
    path: Path
    audio_format: str
    sample_rate: int | None
    duration_s: float | None
    seed: str | None


def synthesize(url: str, text: str, output: Path, audio_format: str, voice: str | None = None,
               seed: int | None = None, max_new_tokens: int | None = None,
               timeout_s: float = 900.0) -> SpeechResult:
    """POST /v1/audio/speech and write the body to `output`. Raises RuntimeError with the API
    error message on a non-200 answer."""
    import httpx

    body: dict = {"model": "drama-3", "input": text, "response_format": audio_format, "stream": False}
    if voice is not None:
        body["voice"] = voice
    if seed is not None:
        body["seed"] = seed
    if max_new_tokens is not None:
        body["max_new_tokens"] = max_new_tokens
    response = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=timeout_s)
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:500]
        raise RuntimeError(f"HTTP {response.status_code}: {message}")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(response.content)
    rate = response.headers.get("x-sample-rate")
    sample_rate = int(rate) if rate and rate.isdigit() else None
    return SpeechResult(output, audio_format, sample_rate,
                        audio_duration(output, audio_format, sample_rate),
                        response.headers.get("x-seed"))


def audio_duration(path: Path, audio_format: str, sample_rate: int | None) -> float | None:
    """Seconds of audio in the file, or None when it cannot be read here (e.g. AAC)."""
    if audio_format == "pcm":
        return path.stat().st_size / 2 / sample_rate if sample_rate else None
    try:
        import soundfile

        return float(soundfile.info(str(path)).duration)
    except Exception:  # libsndfile cannot read every container (AAC): the duration is optional
        return None


def run_say(args: argparse.Namespace) -> int:
    output = Path(args.output)
    try:
        audio_format = format_for(output, args.format)
    except ValueError as exc:
        print(f"dramaturg say: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    stack = None
    try:
        url = args.url.rstrip("/")
        if not gateway_answers(url):
            checkpoint = Path(args.checkpoint) if args.checkpoint else ensure_checkpoint()
            print(f"no gateway at {url}; starting a local stack from {checkpoint} ...", file=sys.stderr)
            stack = Stack(checkpoint, 0, args.device)
            stack.start(args.ready_timeout)
            url = stack.url
        result = synthesize(url, args.text, output, audio_format, voice=args.voice, seed=args.seed,
                            max_new_tokens=args.max_new_tokens)
    except (StackError, RuntimeError) as exc:
        print(f"dramaturg say failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if stack is not None:
            stack.stop()
    duration = f"{result.duration_s:.2f} s of audio" if result.duration_s is not None else "audio"
    print(f"{result.path}: {duration} in {time.monotonic() - started:.1f} s wall time"
          + (f" (seed {result.seed})" if result.seed else ""))
    return 0


# ---------------------------------------------------------------------------------------------
# argument parsers
# ---------------------------------------------------------------------------------------------

def _stack_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default=None,
                        help="checkpoint directory (default: the tiny checkpoint, made on first use "
                             "into $DRAMA_CACHE_DIR or ~/.cache/dramaturg/tiny-seed0)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S, metavar="S",
                        help="seconds to wait for the stack to become ready")


def add_up_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("up", help="run the whole stack locally (three stages + gateway)",
                                   description=run_up.__doc__)
    _stack_arguments(parser)
    parser.add_argument("--port", type=int, default=8000, help="gateway HTTP port (0: any free port)")
    parser.add_argument("--log-dir", default=None, help="where the processes' logs go (default: a temp dir)")
    parser.set_defaults(func=run_up)
    return parser


def add_say_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("say", help="synthesize a text to an audio file",
                                   description="Synthesize TEXT through the gateway at --url, or "
                                               "through a temporary local stack when none answers.")
    parser.add_argument("text", metavar="TEXT")
    parser.add_argument("-o", "--output", required=True, help="output file; its suffix picks the format")
    parser.add_argument("--voice", default=None)
    parser.add_argument("--format", default=None, choices=sorted(set(FORMAT_BY_SUFFIX.values())))
    parser.add_argument("--url", default=DEFAULT_URL, help=f"gateway URL (default {DEFAULT_URL})")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                        help="at most N frames per text chunk")
    _stack_arguments(parser)
    parser.set_defaults(func=run_say)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m services.launcher up|say ...` (the same commands as `dramaturg up|say`)."""
    parser = argparse.ArgumentParser(prog="python -m services.launcher")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_up_parser(subparsers)
    add_say_parser(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
