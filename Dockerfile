# GPU image for clusters: NGC PyTorch brings CUDA, torch, Transformer Engine and NVIDIA apex.
# megatron-core >= 0.17 needs Python 3.12, which recent NGC images ship.
ARG BASE=nvcr.io/nvidia/pytorch:25.09-py3
FROM ${BASE}

WORKDIR /workspace/megaloop
COPY setup.py README.md ./
COPY megaloop ./megaloop
COPY tools ./tools
COPY slurm ./slurm
COPY examples ./examples
# Keep the container's torch / Transformer Engine / apex: install only what is missing.
RUN pip install --no-cache-dir -e ".[mpi,hf,eval]" \
 && python -c "import megaloop, megatron.core, transformer_engine"
ENV PYTHONUNBUFFERED=1
