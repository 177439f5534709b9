# syntax=docker/dockerfile:1
# One image for every remat process of docker-compose.yml: `remat-service migrate`, the API
# (`remat-service`), the workers (`remat-worker --queues ...`) and Flower (`celery ... flower`).
# Built from uv.lock: the exact locked versions, without the dev group, with the `cluster` extra (Flower)
# and the `hf` extra (transformers: workers build allow-listed hf: models from their configurations).
#
#   docker build -t remat:latest .        # or: docker compose build
#
# CUDA: the locked torch is the default PyPI wheel, which on Linux x86_64 is built with CUDA and depends on
# the NVIDIA runtime wheels (cuda-toolkit, nvidia-cudnn-*, nvidia-nccl-*... see uv.lock): the same image runs
# the CPU and the GPU workers, and needs no CUDA base image. The GPU host needs only the NVIDIA driver (new
# enough for that CUDA major version; torch's release notes say which) and the NVIDIA Container Toolkit.
# The price is size: the CUDA libraries make the image several GB.

ARG PYTHON_VERSION=3.12
ARG UV_VERSION=0.13.9

FROM ghcr.io/astral-sh/uv:${UV_VERSION} AS uv

FROM python:${PYTHON_VERSION}-slim AS build
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/opt/venv
WORKDIR /src
# Dependencies first (their own layer, rebuilt only when the lock changes), then the project itself.
COPY pyproject.toml uv.lock ./
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --locked --no-dev --extra cluster --extra hf --no-install-project
COPY . .
# --no-editable: the project is installed into /opt/venv, so the runtime stage needs no source tree.
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --locked --no-dev --extra cluster --extra hf --no-editable

FROM python:${PYTHON_VERSION}-slim
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin remat
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
USER remat
WORKDIR /home/remat
EXPOSE 8000 5555
# Every service of docker-compose.yml sets its own command; this default is the API.
CMD ["remat-service", "--host", "0.0.0.0", "--port", "8000"]
