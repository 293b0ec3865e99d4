# cdlm-serve for GPU hosts:
#   docker build -t cdlm-serve .
#   docker run --gpus all -p 8000:8000 -v cdlm-cache:/data cdlm-serve
# The model cache lives in the /data volume, so the default model is fetched and converted once.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-pip curl ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && useradd --create-home --uid 1000 cdlm \
    && mkdir -p /data && chown cdlm:cdlm /data

# The CUDA build of the pinned torch first, so `pip install .` keeps it.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128

WORKDIR /opt/cdlm-serve
COPY pyproject.toml README.md ./
COPY cdlm_serve ./cdlm_serve
RUN pip install .

ENV CDLM_SERVE_HOME=/data \
    CDLM_SERVE_HOST=0.0.0.0 \
    CDLM_SERVE_PORT=8000
VOLUME /data
USER cdlm
EXPOSE 8000
# The first start downloads and converts the default model: give it time before checking.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/health || exit 1
ENTRYPOINT ["cdlm-serve", "serve"]
