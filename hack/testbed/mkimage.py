"""Writes an OCI image archive holding one static binary as its entrypoint, for `ctr images import`.

The real node (real-node.sh) has no registry to pull from and no Docker engine to build with: its
pause image and its test image are made here from the Go programs in images/.
Usage: mkimage.py BINARY PATH-IN-IMAGE IMAGE-NAME OUT.tar
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
from typing import Any


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def _blob(tar: tarfile.TarFile, data: bytes, media_type: str) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    _add(tar, f"blobs/sha256/{digest}", data)
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def build(binary: str, path_in_image: str, name: str, out: str) -> None:
    """One layer with the binary, a config whose entrypoint is it, a manifest, an index naming it."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w") as layer_tar, open(binary, "rb") as f:
        _add(layer_tar, path_in_image.lstrip("/"), f.read(), mode=0o755)
    layer = layer_buf.getvalue()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": [path_in_image]},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }
    with tarfile.open(out, "w") as tar:
        layers = [_blob(tar, layer, "application/vnd.oci.image.layer.v1.tar")]
        cfg = _blob(tar, json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json")
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json"}
        manifest.update(config=cfg, layers=layers)
        entry = _blob(tar, json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
        entry["annotations"] = {
            "io.containerd.image.name": name,
            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
        }
        _add(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        _add(tar, "index.json", json.dumps({"schemaVersion": 2, "manifests": [entry]}).encode())


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    build(*sys.argv[1:])
