# The operator: `tangram operator` (controllers, scheduler, gateway on TANGRAM_LISTEN_PORT, 8080).
#
#   docker build -f sandbox-images/operator.Dockerfile -t arl-tangram-operator:0.1.0 .   (from the repo root)
#
# Build arguments: BASE_IMAGE and EXTRA_CA_CERTS, as for sandbox-images/Dockerfile. The operator
# compiles nothing (the zygote's C loop is the sandbox's; setup.py makes it optional), so its build
# stage needs no compiler, and the image holds the base and one venv.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
ARG EXTRA_CA_CERTS=""
RUN { printenv EXTRA_CA_CERTS || true; } >/tmp/build-extra.crt \
    && cat /etc/ssl/certs/ca-certificates.crt /tmp/build-extra.crt >/tmp/build-ca.pem
ENV PIP_CERT=/tmp/build-ca.pem
WORKDIR /src
# The project's dependencies (pyproject.toml's list) in a layer of their own, so that a change to the
# code reinstalls only the code.
COPY pyproject.toml setup.py README.md ./
RUN python -m venv /opt/tangram
RUN /opt/tangram/bin/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' >/tmp/requirements.txt \
    && /opt/tangram/bin/pip install -r /tmp/requirements.txt
COPY operator ./operator
COPY hack/images/healthcheck.py /opt/tangram/bin/tangram-healthcheck
RUN /opt/tangram/bin/pip install --no-deps . \
    && chmod 755 /opt/tangram/bin/tangram-healthcheck

FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/tangram/bin:${PATH}
COPY --from=build /opt/tangram /opt/tangram
# The uid manifests/deployment.yaml runs it as: kopf names its peer after the user's name, and an
# unnamed uid stops the operator at start-up (getpwuid: uid not found).
RUN useradd --system --uid 65532 --user-group --no-create-home tangram
USER 65532
EXPOSE 8080
# /healthz on the port TANGRAM_LISTEN_PORT names (hack/images/healthcheck.py).
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 CMD ["tangram-healthcheck"]
ENTRYPOINT ["tangram", "operator"]
