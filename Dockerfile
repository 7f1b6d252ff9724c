# Conveyor: one image for the API, the GPU worker and the migration step (`conveyor api|worker|migrate`).
# GPU build by default (CUDA wheels of torch bundle the CUDA runtime and Triton); for a CPU image:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_SPEC=torch

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CONVEYOR_DATA_DIR=/data \
    HF_HOME=/data/hf

# Triton compiles a small launcher for each kernel at run time: it needs a C compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 conveyor \
    && mkdir -p /data \
    && chown conveyor:conveyor /data

WORKDIR /app
# torch first, from its own index, so the layer is cached across code changes.
# Pin with e.g. --build-arg TORCH_SPEC=torch==2.13.0 to match the version the tests ran with.
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"
COPY pyproject.toml README.md alembic.ini ./
COPY api ./api
COPY cli ./cli
COPY core ./core
COPY worker ./worker
COPY engine ./engine
COPY kernels ./kernels
COPY migrations ./migrations
# Editable: alembic finds migrations/ next to core/ (core/store/migrate.py resolves it from the source tree).
RUN pip install -e .

USER conveyor
VOLUME ["/data"]
EXPOSE 8000
ENTRYPOINT ["conveyor"]
CMD ["serve"]
