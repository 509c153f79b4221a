"""Generate the Python gRPC stubs from protos/ into drama/ (run after editing a .proto).

    python protos/generate.py            # writes drama/<stage>/v1/*_pb2*.py
    python protos/generate.py --check    # exit 1 if the committed stubs are stale

The generated modules are committed so a fresh clone imports them without a build step; the test
suite runs --check, so a .proto edit without regenerating fails CI. Nobody edits them by hand.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    files = proto_files()
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}"] + [str(f.relative_to(PROTO_DIR)) for f in files]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for pkg in {f.relative_to(PROTO_DIR).parent for f in files}:
        for part in range(1, len(pkg.parts) + 1):
            init = out_dir / Path(*pkg.parts[:part]) / "__init__.py"
            init.touch()
        written.extend(sorted((out_dir / pkg).glob("*")))
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if not args.check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for path in generate(Path(tmp)):
            if path.suffix not in (".py", ".pyi"):
                continue
            committed = ROOT / path.relative_to(tmp)
            if not committed.exists() or not filecmp.cmp(path, committed, shallow=False):
                stale.append(str(committed.relative_to(ROOT)))
        if stale:
            print("stale generated stubs (run python protos/generate.py):", *stale, sep="\n  ")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
