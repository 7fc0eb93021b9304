# shapetuner serving image: `tuner serve` on an artifact written by `tuner optimize`.
#
# GPU image (the default): CUDA 13 + cuDNN 9 runtime, which onnxruntime-gpu 1.31 is built
# against; TensorRT comes from its pip wheels through the `trt` extra (its -libs wheel is
# fetched from NVIDIA's package index at install time, so the build needs that network).
#   docker build -t shapetuner:gpu .
#   docker run --gpus all -p 8001:8001 -v "$PWD/out:/mnt/models:ro" shapetuner:gpu
# CPU image: a plain Ubuntu base and no GPU extras (onnxruntime-gpu still carries the CPU EP).
#   docker build -t shapetuner:cpu --build-arg BASE_IMAGE=ubuntu:24.04 --build-arg EXTRAS= .
#
# The artifact is mounted (or downloaded by KServe's storage initializer) at /mnt/models.
# On Amazon SageMaker (the image pushed to ECR, the artifact as the model's data) the same
# image answers /ping and /invocations on port 8080; SM_TUNER_<OPTION> variables set options.
# Engines built by `tuner optimize --backend trt` are inside it and are loaded, not rebuilt,
# as long as the serving GPU and TensorRT match the ones that built them.

ARG BASE_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS build
ARG EXTRAS=trt
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Ubuntu's archive replaces package versions in place: pinning them breaks rebuilds.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tuner ./tuner
COPY serving ./serving
COPY models ./models
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# EXTRAS is a comma-separated list of extras ("trt", "trt,probe"); empty for the CPU image.
RUN python3 -m venv /opt/shapetuner \
    && /opt/shapetuner/bin/pip install ".${EXTRAS:+[${EXTRAS}]}"

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 tuner \
    && useradd --system --uid 10001 --gid tuner --create-home --home-dir /home/tuner tuner
COPY --from=build /opt/shapetuner /opt/shapetuner
ENV PATH=/opt/shapetuner/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SHAPETUNER_RESULTS_CACHE=/tmp/shapetuner-cache
COPY deploy/docker-entrypoint.sh /usr/local/bin/shapetuner-entrypoint
USER 10001:10001
WORKDIR /home/tuner
# 8000: HTTP (KServe v2 REST, generate, OpenAI /v1); 8001: gRPC (KServe v2); 8002: /metrics;
# 8080: HTTP when started as SageMaker starts a container (`docker run IMAGE serve`)
EXPOSE 8000 8001 8002 8080
# `tuner serve` with the arguments below (or KServe's), or on SageMaker's terms when the
# first argument is `serve` (deploy/docker-entrypoint.sh)
ENTRYPOINT ["shapetuner-entrypoint"]
CMD ["/mnt/models", "--host", "0.0.0.0", "--port", "8001", "--http-port", "8000"]
