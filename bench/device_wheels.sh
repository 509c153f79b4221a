#!/usr/bin/env bash
# The wheels the lent H200 lacks (Python 3.12, x86-64; its image has torch, triton, transformers,
# numpy, grpcio's dependencies ... : /work/.library/device/KINDS.md), downloaded into .whl/ for the
# `device` tool's carry. bench/h200_run.sh installs them there with `pip install --target`.
#   bash bench/device_wheels.sh        (~20 MB; PyPI must be reachable from here)
# Versions follow a dev venv of this repo where it has the package. PyAV (~35 MB) stays out:
# the benchmarks ask for WAV/PCM, and the gateway imports av only for compressed formats.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
wheels=(
  flash-linear-attention==0.6.0 fla-core==0.6.0
  grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-instrumentation==0.66b2
  opentelemetry-instrumentation-grpc==0.66b2 opentelemetry-instrumentation-asgi==0.66b2
  opentelemetry-instrumentation-fastapi==0.66b2 opentelemetry-util-http==0.66b2
  googleapis-common-protos==1.76.0 asgiref==3.13.0
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 uvicorn==0.54.0
  soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 soxr==1.1.0
  py-spy==0.4.3 pytest-asyncio==1.5.0 nvidia-ml-py==13.615.71
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_24_x86_64 -d .whl "${wheels[@]}"
du -sh .whl
