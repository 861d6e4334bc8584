"""The image recipes: what the sandbox image promises, and a clear failure where no Docker runs."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path
from types import ModuleType

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
    # The health check is a script that asks the agent on the address its --listen names (a fixed
    # port in the Dockerfile was a defect: an agent started on another port was reported unhealthy).
    assert any(word == "HEALTHCHECK" and "tangram-healthcheck" in rest for word, rest in steps)
    assert any(word == "COPY" and rest.startswith("hack/images/healthcheck.py ") for word, rest in steps)
    assert ("ENTRYPOINT", '["tangram", "sandbox-agent"]') in steps
    install = " ".join(rest for word, rest in steps if word == "RUN")
    assert "pytest-xdist" in install


def _healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "tangram_healthcheck", ROOT / "hack" / "images" / "healthcheck.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--listen", "0.0.0.0:9123", "--workdir-root", "/w"], ("0.0.0.0", 9123)),
        (["--listen=127.0.0.1:7001"], ("127.0.0.1", 7001)),
        (["--listen", "[::1]:8088"], ("[::1]", 8088)),
        (["--workdir-root", "/w"], ("", 8080)),
    ],
)
def test_the_health_check_asks_the_agent_where_it_listens(args: list[str], expected: tuple[str, int]) -> None:
    check = _healthcheck()
    assert check.address("sandbox-agent", args) == expected
    assert check.SERVERS["sandbox-agent"][0] == "/v1/health"


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


def _path_without_docker(tmp: Path, fake_cli: bool) -> str:
    """A PATH holding every program of this one but docker and dockerd (a fake docker CLI that
    reaches no engine where ``fake_cli``): the machine's own engine, running or startable, is then
    out of the script's reach, so the test means the same on every machine."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        d = Path(entry)
        if not d.is_dir():
            continue
        for prog in d.iterdir():
            link = bin_dir / prog.name
            if prog.name in ("docker", "dockerd") or link.exists() or not os.access(prog, os.X_OK):
                continue
            link.symlink_to(prog)
    if fake_cli:
        fake = bin_dir / "docker"
        fake.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
        fake.chmod(0o755)
    return str(bin_dir)


@pytest.mark.parametrize("fake_cli", [False, True], ids=["no-docker-cli", "cli-without-engine"])
def test_images_script_fails_clearly_without_a_docker_engine(tmp_path: Path, fake_cli: bool) -> None:
    env = {
        **os.environ,
        "PATH": _path_without_docker(tmp_path, fake_cli),
        "DOCKER_BUILDKIT": "0",  # the legacy builder takes the first docker CLI (the fake one)
        "DOCKER_ENGINE_TIMEOUT": "2",  # where this machine's own dockerd was started and recorded
        "DOCKER_ENGINE_LOG": str(tmp_path / "dockerd.log"),
    }
    env.pop("DOCKER", None)
    done = subprocess.run(
        ["bash", str(ROOT / "hack" / "images.sh")], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 1, done.stderr
    assert "images: no Docker engine: the images cannot be built here" in done.stderr, done.stderr
    # The engine script says which part is missing.
    reasons = ("no dockerd", "did not answer") if fake_cli else ("engine: no docker CLI",)
    assert any(r in done.stderr for r in reasons), done.stderr
