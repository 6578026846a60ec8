# unbroken's image: the operator and the node agent (deploy/ gives each its command).
#
# Not built or tested on the machine where this file was written (no Docker there). Build it with
#
#   docker build -t ghcr.io/unbroken-dev/unbroken:0.1.0 .
#
# torch comes from PyTorch's index named by TORCH_INDEX_URL, a CUDA 12.x build by default (the
# agent's GPU checks need CUDA; NVML comes from the driver the NVIDIA container runtime mounts).
# For a smaller, CPU-only image (the operator alone, or a cluster without GPUs):
#
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t unbroken:cpu .
#
# Pin torch with --build-arg TORCH_VERSION=2.13.0 (empty: the newest the index has that unbroken
# supports). No USER and no ENTRYPOINT: the manifests run the operator as user 65532 and give
# both containers their command.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/unbroken/bin:$PATH
RUN python -m venv /opt/unbroken
# torch first, from its own index, so that `pip install .` finds torch>=2.6 satisfied and keeps it
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch${TORCH_VERSION:+==${TORCH_VERSION}}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install . \
    && python -c "import torch, unbroken; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="unbroken" \
      org.opencontainers.image.description="Keeps distributed PyTorch training alive through failures" \
      org.opencontainers.image.source="https://github.com/unbroken-dev/unbroken" \
      org.opencontainers.image.version="0.1.0"
COPY --from=build /opt/unbroken /opt/unbroken
ENV PATH=/opt/unbroken/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN unbroken --help >/dev/null
