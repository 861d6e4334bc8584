# The operator: `tangram operator` (controllers, scheduler, gateway).
#
#   docker build -f sandbox-images/operator.Dockerfile -t arl-tangram-operator:0.1.0 .   (from the repo root)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/arl-tangram
COPY pyproject.toml setup.py README.md ./
COPY operator ./operator
RUN pip install . \
    && useradd --system --uid 10001 --user-group --no-create-home tangram

USER 10001
ENTRYPOINT ["tangram", "operator"]
