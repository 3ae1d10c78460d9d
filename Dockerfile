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
# MPI for tools/preprocess_data.py: the `mpi` extra is mpi4py with MPICH's wheel, which brings an
# MPI where the image has none (CPU). NGC's image has its own, HPC-X (Open MPI, its mpirun first on
# PATH): there the wheel's libmpi and mpiexec would shadow it, and ranks that HPC-X's mpirun starts
# would each be a world of one under MPICH's library. mpi4py is built from source against the
# image's MPI instead (its mpicc), and checked to link Open MPI: without starting MPI, which the
# standard allows MPI_Get_library_version before, and which as root in a build may be refused.
RUN if [ "${DEVICE}" = gpu ]; then \
      pip install --no-cache-dir -e ".[hf,eval]" "megatron-core==${MEGATRON_CORE}" \
      && mpicc="$(command -v mpicc)" \
      && MPICC="${mpicc}" pip install --no-cache-dir --no-binary=mpi4py "mpi4py==4.1.2" \
      && python -c "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; \
                    v = MPI.Get_library_version(); assert 'Open MPI' in v, v" \
      && python -c "import transformer_engine"; \
    else \
      pip install --no-cache-dir -e ".[mpi,hf,eval]" "megatron-core==${MEGATRON_CORE}"; \
    fi \
 && python -c "import megaloop.models.model, megatron.core as m; assert m.__version__ == '${MEGATRON_CORE}', m.__version__"
ENV PYTHONUNBUFFERED=1
