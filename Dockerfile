# syntax=docker/dockerfile:1
# Two images from one file:
#   --target server   the service and the one-shot migrate job (no torch: the service
#                     validates configs against plain-data config spaces)
#   --target worker   a GPU worker: torch with CUDA from PyPI (it bundles the CUDA runtime;
#                     the host's NVIDIA driver comes in through the container toolkit)
ARG PYTHON=3.12

FROM python:${PYTHON}-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tunecache ./tunecache
COPY kernels ./kernels
COPY migrations ./migrations

FROM base AS server
RUN pip install ".[server]" && useradd --create-home --uid 10001 tunecache
USER tunecache
WORKDIR /home/tunecache
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --retries=5 \
  CMD python -c "import httpx; httpx.get('http://127.0.0.1:8000/healthz', timeout=2).raise_for_status()"
CMD ["tunecache", "serve", "--host", "0.0.0.0", "--port", "8000"]

FROM base AS worker
# Triton compiles a small C launcher per kernel signature at run time
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ARG TORCH=torch
RUN pip install "${TORCH}" && pip install ".[server]" && useradd --create-home --uid 10001 tunecache
USER tunecache
WORKDIR /home/tunecache
# the worker's local store and Triton's compile cache live under ~/.cache and ~/.triton
CMD ["tunecache", "worker", "--gpu", "0"]
