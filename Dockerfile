# megaloop image.
#   docker build -t megaloop .                                # GPU: NGC PyTorch (CUDA, torch,
#                                                             # Transformer Engine, NVIDIA apex)
#   docker build --build-arg DEVICE=cpu -t megaloop:cpu .     # CPU: Python 3.11, torch 2.13 CPU
# megatron-core is pinned to the release megaloop is tested with: megaloop overrides some of its
# internals, so a newer release must be tested before the pin moves (tools/gpu_check.sh on a GPU).
ARG DEVICE=gpu
ARG NGC_IMAGE=nvcr.io/nvidia/pytorch:25.09-py3
ARG MEGATRON_CORE=0.16.1

# The container's torch / Transformer Engine / apex are kept: only what is missing is installed.
FROM ${NGC_IMAGE} AS gpu

FROM python:3.11-slim AS cpu
# An unpinned torch from PyPI is a multi-GB CUDA build.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# hadolint ignore=DL3006
FROM ${DEVICE}
ARG DEVICE
ARG MEGATRON_CORE
WORKDIR /workspace/megaloop
COPY setup.py README.md ./
COPY megaloop ./megaloop
COPY tools ./tools
COPY slurm ./slurm
COPY examples ./examples
RUN pip install --no-cache-dir -e ".[mpi,hf,eval]" "megatron-core==${MEGATRON_CORE}" \
 && python -c "import megaloop.models.model, megatron.core as m; assert m.__version__ == '${MEGATRON_CORE}', m.__version__" \
 && if [ "${DEVICE}" = gpu ]; then python -c "import transformer_engine"; fi
ENV PYTHONUNBUFFERED=1
