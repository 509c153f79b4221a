# One image for every dramaturg process; compose picks the entry point per service.
#   docker build -t dramaturg:latest .                         # CUDA base (stages on GPUs)
#   docker build -t dramaturg:cpu --build-arg BASE=python:3.11-slim --build-arg TORCH=cpu .
# The CUDA base brings its own torch; the CPU build installs the CPU wheel.
ARG BASE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
FROM ${BASE}

ARG TORCH=image
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    DRAMA_HOST=0.0.0.0

WORKDIR /app
# libsndfile ships inside the soundfile wheel; nothing else is needed from the OS.
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY drama ./drama
COPY services ./services
COPY gateway ./gateway
COPY bench ./bench
RUN if [ "$TORCH" = "cpu" ]; then \
        pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0; \
    fi \
 && pip install .

# Weights are mounted read-only at /models (never downloaded at start).
ENV DRAMA_CHECKPOINT=/models
EXPOSE 8000 50051 50052 50053
# compose overrides the command per service; the image alone runs the gateway.
CMD ["python", "-m", "gateway", "--host", "0.0.0.0", "--port", "8000"]
