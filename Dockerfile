# syntax=docker/dockerfile:1
#
# prefix-router gateway image.
#
#   docker build -t prefix-router .
#   docker build -t prefix-router --build-arg TOKENIZER_DIR=deploy/tokenizers/my-model .
#
# TOKENIZER_DIR is a directory *inside the build context* holding the served model's tokenizer
# files (tokenizer.json, tokenizer_config.json with its chat template, ...). It is copied to
# /models/tokenizer, which the default config points at. The default is the Qwen3 tokenizer the
# package ships. Tokenizers are never downloaded at run time (HF_HUB_OFFLINE=1); to use another
# one without rebuilding, mount it over /models/tokenizer (read-only).
#
# Configuration: /etc/prefix-router/router.yaml (mount your own over it) and PREFIX_ROUTER_*
# environment variables (they win over the file; flags win over both). The default config
# listens on 0.0.0.0:8080 and names no replica: set PREFIX_ROUTER_REPLICAS or mount a config.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------- builder
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1

# Every dependency ships manylinux wheels for amd64 and arm64, so no compiler is installed.
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.md ./
COPY router ./router
# loadtest/ brings the simulated vLLM replicas (deploy/compose/compose.sim.yaml), which need
# nothing beyond the gateway's own dependencies; the demo's and load tests' plotting stack is
# the [loadtest] extra, which the image leaves out.
COPY loadtest ./loadtest
# A regular (non-editable) install: the venv is self-contained and /src is left behind.
# With fastokens (the [fast-tokenizer] extra, pinned): exact, self-checked at start-up, and
# ~50x faster BPE for new text.
# With the [ext-proc] extra's packages (pinned): the same image serves as the endpoint picker
# of an inference gateway (`serve --ext-proc-port 9002`, docs/endpoint-picker.md).
# Byte-compile everything now: the runtime root filesystem may be read-only.
RUN pip install --no-cache-dir . fastokens==0.3.5 \
        grpcio==1.85.4 grpcio-health-checking==1.85.1 xds-protos==1.85.0 \
    && python -m compileall -q /opt/venv/lib

# ---------------------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE} AS runtime

# A path, not a secret (DL3064 fires on the word "TOKEN" in the name).
# hadolint ignore=DL3064
ARG TOKENIZER_DIR=router/assets/tokenizers/qwen3

LABEL org.opencontainers.image.title="prefix-router" \
      org.opencontainers.image.description="OpenAI-compatible gateway that routes requests to the vLLM replica holding their prompt prefix" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    HF_HOME=/tmp/hf-home

RUN groupadd --system --gid 10001 router \
    && useradd --system --uid 10001 --gid router --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin router

COPY --from=builder /opt/venv /opt/venv
COPY ${TOKENIZER_DIR} /models/tokenizer
COPY deploy/docker/router.yaml /etc/prefix-router/router.yaml
COPY deploy/docker/healthcheck.py /opt/prefix-router/healthcheck.py

# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
WORKDIR /tmp

# In endpoint picker mode the ext_proc port (--ext-proc-port, 9002 in deploy/kubernetes/) too.
EXPOSE 8080
STOPSIGNAL SIGTERM

# GET /health with Python's urllib (no curl in the image), on the port the gateway uses:
# --port on its command line, else PREFIX_ROUTER_PORT, else `port` in the config, else 8000.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "/opt/prefix-router/healthcheck.py"]

ENTRYPOINT ["prefix-router"]
CMD ["serve", "--config", "/etc/prefix-router/router.yaml"]
