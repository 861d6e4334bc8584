"""The image recipes: what the sandbox image promises, and a clear failure where no Docker runs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_sandbox_image_is_non_root_with_base_arg_entrypoint_and_healthcheck() -> None:
    steps = _instructions(ROOT / "sandbox-images" / "Dockerfile")
    assert steps[0] == ("ARG", "BASE_IMAGE=python:3.11-slim")
    assert ("FROM", "${BASE_IMAGE}") in steps
    users = [rest for word, rest in steps if word == "USER"]
    assert users and users[-1] not in ("0", "root")
    assert any(word == "HEALTHCHECK" and "/v1/health" in rest for word, rest in steps)
    assert ("ENTRYPOINT", '["tangram", "sandbox-agent"]') in steps
    install = " ".join(rest for word, rest in steps if word == "RUN")
    assert "pytest-xdist" in install


def test_operator_image_runs_the_operator() -> None:
    steps = _instructions(ROOT / "sandbox-images" / "operator.Dockerfile")
    assert ("ENTRYPOINT", '["tangram", "operator"]') in steps
    assert [rest for word, rest in steps if word == "USER"][-1] != "0"


def test_no_registry_host_is_named() -> None:
    for path in [*ROOT.joinpath("sandbox-images").rglob("*"), ROOT / "hack" / "images.sh"]:
        if not path.is_file():
            continue
        text = path.read_text()
        assert not re.search(r"\b[a-z0-9-]+\.(io|com|org|dev)/", text), path


def test_images_script_fails_clearly_without_a_docker_engine() -> None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "info"], capture_output=True).returncode == 0:
        pytest.skip("a Docker engine runs here: `make images` would really build")
    done = subprocess.run(["bash", str(ROOT / "hack" / "images.sh")], capture_output=True, text=True)
    assert done.returncode == 1
    assert "images:" in done.stderr
    assert "Docker" in done.stderr or "docker" in done.stderr
