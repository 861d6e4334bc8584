# The Python layer of the base made without a registry (hack/images/base.sh): Debian's Python 3.11 on
# a `debootstrap --variant=minbase` root imported with `docker import`, shaped like the official
# python:3.11-slim the images build on by default: `python` and `pip` first on PATH (a venv, so pip
# installs freely where Debian's own Python is "externally managed"), CA certificates, UTF-8.
# No headers or compilers: the images' build stages install what they compile with.
ARG ROOTFS_IMAGE
FROM ${ROOTFS_IMAGE}

ARG DEBIAN_FRONTEND=noninteractive
ENV LANG=C.UTF-8 \
    PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && python3 -m venv /opt/python \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
    && python --version && pip --version
CMD ["python3"]
