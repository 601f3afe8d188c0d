# syntax=docker/dockerfile:1
# The BOTS selection service: a small, non-root image whose entrypoint serves.
#
#   docker build -t bots-server:0.2.0 .
#   docker run --rm -v bots-data:/data bots-server:0.2.0 migrate      # create / upgrade the schema
#   docker run -d -p 50051:50051 -p 9464:9464 -v bots-data:/data bots-server:0.2.0
#
# Schema migrations are a separate command on purpose: several replicas must
# not each upgrade the schema while serving (Kubernetes runs `migrate` in an
# init container; see deploy/k8s). With PostgreSQL, pass BOTS_DB to both.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- build: install the two packages and their wheels into a venv ------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/bots
WORKDIR /src
# The third-party packages first, from the lock file: exact versions, and
# pip refuses any file whose sha256 is not in it, so two builds install the
# same bytes (regenerate it with `make image-lock`). Wheels only: the slim
# base has no compiler. A layer of its own, cached until the lock changes.
COPY deploy/image/requirements.txt /tmp/requirements.txt
RUN /opt/bots/bin/pip install --require-hashes --only-binary=:all: --no-deps -r /tmp/requirements.txt
# Only what the packages need (.dockerignore allows nothing else in).
COPY pyproject.toml README.md ./
COPY clients/python/ clients/python/
COPY server/ server/
# The two packages, non-editable, with nothing fetched (their dependencies and
# the build backend are already installed from the lock); pip check fails
# the build if the lock does not satisfy them. Then drop pip and setuptools,
# which the service never uses at run time, and precompile, since the root
# filesystem is read-only in Kubernetes.
RUN /opt/bots/bin/pip install --no-deps --no-build-isolation ./clients/python . \
    && /opt/bots/bin/pip check \
    && /opt/bots/bin/pip uninstall --yes pip setuptools \
    && /opt/bots/bin/python -m compileall -q /opt/bots/lib

# -- runtime: the venv on a clean base, as an unprivileged user ---------------
FROM ${PYTHON_IMAGE}
ARG VERSION=0.2.0
LABEL org.opencontainers.image.title="bots-server" \
      org.opencontainers.image.description="BOTS selection service: Bayesian online task selection for LLM RL finetuning, over gRPC" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"
RUN groupadd --system --gid 10001 bots \
    && useradd --system --uid 10001 --gid bots --home-dir /data --no-create-home --shell /usr/sbin/nologin bots \
    && install --directory --owner=bots --group=bots --mode=0750 /data
COPY --from=build /opt/bots /opt/bots
# Listen on all interfaces inside the container; JSON logs for collectors;
# the default database is a SQLite file on the /data volume.
ENV PATH=/opt/bots/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    BOTS_LISTEN=0.0.0.0:50051 \
    BOTS_METRICS_LISTEN=0.0.0.0:9464 \
    BOTS_DB=sqlite:////data/bots.db \
    BOTS_LOG_FORMAT=json \
    BOTS_MIGRATE=false
WORKDIR /data
USER 10001:10001
EXPOSE 50051 9464
# For plain Docker and Compose; Kubernetes uses its native gRPC probes.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; port = os.environ['BOTS_LISTEN'].rpartition(':')[2]; stub = g.HealthStub(grpc.insecure_channel(f'127.0.0.1:{port}')); sys.exit(stub.Check(h.HealthCheckRequest(service='bots.v1.TaskSelector'), timeout=4).status != h.HealthCheckResponse.SERVING)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["bots-server"]
CMD ["serve"]
