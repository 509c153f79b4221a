"""python -m gateway --checkpoint DIR [--port 8000] [--host H] [--backbone ADDR] [--codec ADDR]

Flags fall back to DRAMA_CHECKPOINT, DRAMA_PORT, DRAMA_HOST, DRAMA_BACKBONE_ADDR, DRAMA_CODEC_ADDR.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import uvicorn

from gateway.app import create_app
from gateway.settings import Settings


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="checkpoint dir (reads config.json, tokenizer.json)")
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (default 8000)")
    parser.add_argument("--backbone", help="backbone address (default localhost:50051)")
    parser.add_argument("--codec", help="codec address (default localhost:50053)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings.from_env(checkpoint=args.checkpoint, host=args.host, port=args.port,
                                 backbone_addr=args.backbone, codec_addr=args.codec)
    if settings.checkpoint is None:
        parser.error("--checkpoint (or DRAMA_CHECKPOINT) is required")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                timeout_graceful_shutdown=60)


if __name__ == "__main__":
    main()
