"""The image recipes: what the sandbox image promises, and a clear failure where no Docker runs."""

from __future__ import annotations

import importlib.util
import re
import shutil
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


def test_images_script_fails_clearly_without_a_docker_engine() -> None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "info"], capture_output=True).returncode == 0:
        pytest.skip("a Docker engine runs here: `make images` would really build")
    done = subprocess.run(["bash", str(ROOT / "hack" / "images.sh")], capture_output=True, text=True)
    assert done.returncode == 1
    assert "images:" in done.stderr
    assert "Docker" in done.stderr or "docker" in done.stderr
