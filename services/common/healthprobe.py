"""Container health probe: `python -m services.common.healthprobe --addr localhost:50051`.

One grpc.health.v1 Check with a 2 s deadline; exit 0 only on SERVING (API.md §4: no external
grpc_health_probe binary is available to our images).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.common.grpcutil import check_health


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", required=True, help="host:port of the stage")
    parser.add_argument("--service", default="", help="service name to check ('' = server)")
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args(argv)
    status = asyncio.run(check_health(args.addr, timeout=args.timeout, service=args.service))
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
