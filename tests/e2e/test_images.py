"""The images of sandbox-images/, built with Docker from the repository root and run.

What `make images` (hack/images.sh) promises, checked against a real Docker engine (started by
hack/images/engine.sh where none runs): every Dockerfile builds with BuildKit and with the legacy
builder, on the base hack/images.sh chooses (the official Python image, or the one made with
debootstrap where no registry is reachable); the sandbox image serves /run_code with actions
isolated from the agent and the outside; the health check follows --listen; the images run as a
non-root user; the build fails, naming the compiler's error, when the C fork loop does not build;
extra CA certificates reach the builds and no image.

The builds reuse Docker's layer cache: after `make images` (as in .ci/run) they take seconds.
Where no Docker engine can run, the tests skip; TANGRAM_E2E_IMAGES=required (set by .ci/run) makes
that a failure.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from testbed import REPO

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
DOCKERFILES = {
    "sandbox": "sandbox-images/Dockerfile",
    "operator": "sandbox-images/operator.Dockerfile",
    "reward": "sandbox-images/reward/Dockerfile",
}
ENTRYPOINTS = {
    "sandbox": ["tangram", "sandbox-agent"],
    "operator": ["tangram", "operator"],
    "reward": ["tangram", "reward-runtime"],
}
LANGUAGES = {"c", "cpp", "go", "java", "nodejs", "perl", "rust", "typescript"}
# The capabilities the sandbox agent needs for its full isolation (sandbox-images/README.md).
FULL_ISOLATION_CAPS = (
    "SYS_ADMIN", "SYS_CHROOT", "SETUID", "SETGID", "CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "NET_ADMIN",
)  # fmt: skip
BUILD_TIMEOUT_S = 1800  # a build without a warm layer cache (no `make images` before) takes minutes
TOKEN = "s3cret-token"  # the agent's (TANGRAM_AGENT_TOKEN): what an action must not read
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S)


def _images_sh(*args: str, env: dict[str, str] | None = None) -> str:
    return _images_sh_run(*args, env=env).stdout


def _images_sh_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["bash", str(REPO / "hack" / "images.sh"), *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"hack/images.sh {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}"
        )
    return done


@pytest.fixture(scope="module")
def docker() -> str:
    """The docker CLI that builds with BuildKit here, with an engine that answers."""
    try:
        return _images_sh("docker").strip()
    except AssertionError as exc:
        if os.environ.get("TANGRAM_E2E_IMAGES") == "required":
            pytest.fail(f"no Docker engine for the image tests: {exc}", pytrace=False)
        pytest.skip(f"no Docker engine here: {exc}")


@pytest.fixture(scope="module")
def base(docker: str) -> str:
    return _images_sh("base").strip()


@pytest.fixture(scope="module")
def extra_ca(docker: str) -> str:
    """The PEM text hack/images.sh hands the builds (empty where the host adds no CA)."""
    return _images_sh("ca")


def _run(
    cmd: list[str], env: dict[str, str] | None = None, timeout: float = BUILD_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout, check=False
    )


def _build(
    docker: str,
    dockerfile: str,
    base: str,
    extra_ca: str,
    *,
    buildkit: bool = True,
    context: Path = REPO,
    extra: tuple[str, ...] = (),
    quiet: bool = True,
) -> subprocess.CompletedProcess[str]:
    """`docker build` from ``context`` (the repository root), as a user would type it; quiet, its
    stdout is the image id; else BuildKit's plain progress (every step's output) is on stderr. The
    legacy builder always prints its steps: they name the images it makes besides the last."""
    # The legacy builder works with any docker CLI; BuildKit with the one hack/images.sh picks.
    cli = docker if buildkit else (shutil.which("docker") or docker)
    with tempfile.TemporaryDirectory() as tmp:
        iidfile = Path(tmp) / "iid"
        cmd = [cli, "build", "-f", dockerfile, "--build-arg", f"BASE_IMAGE={base}", "--iidfile", str(iidfile)]
        # The legacy builder removes a failed step's container too, which would keep its image.
        cmd += [*extra, *((["-q"] if quiet else ["--progress=plain"]) if buildkit else ["--force-rm"])]
        if extra_ca:
            cmd += ["--build-arg", f"EXTRA_CA_CERTS={extra_ca}"]
        done = _run([*cmd, str(context)], env={"DOCKER_BUILDKIT": "1" if buildkit else "0"})
        made = _legacy_steps_made(done.stdout) if not buildkit else []
        _BUILT.extend(made)
        if iidfile.exists():
            iid = iidfile.read_text().strip()
            # A legacy build whose last step came from the cache made no image: an earlier one did.
            if buildkit or iid.removeprefix("sha256:")[:12] in {m[:12] for m in made}:
                _BUILT.append(iid)
    return done


def _legacy_steps_made(out: str) -> list[str]:
    """The images a legacy build's steps made, from its output. It keeps each step's image, and a
    stage's last one is no parent of the image: removing the image would leave those (gigabytes)
    behind. Not a FROM step's (the base) nor a cached step's (an earlier build's, perhaps yours)."""
    made = []
    for step in re.split(r"^Step \d+/\d+ : ", out, flags=re.M)[1:]:
        if step.upper().startswith("FROM ") or re.search(r"^ ---> Using cache$", step, re.M):
            continue
        ids = re.findall(r"^ ---> ([0-9a-f]{12,})$", step, re.M)
        made += ids[-1:]
    return made


# The images this module's builds made. They are untagged, so nothing else ever removes them: left
# behind, each CI run on a machine kept about 9 GB of them until its disk filled.
_BUILT: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _remove_the_images_built_here() -> Iterator[None]:
    yield
    docker = shutil.which("docker")
    if docker is None or not _BUILT:
        return
    # The latest first: an image goes before the steps it was built on.
    for image_id in reversed(dict.fromkeys(_BUILT)):
        # Only an image nothing names (`make images` may have tagged the very same id).
        tags = _run([docker, "image", "inspect", "-f", "{{len .RepoTags}}", image_id], timeout=60)
        if tags.returncode == 0 and tags.stdout.strip() == "0":
            _run([docker, "image", "rm", image_id], timeout=120)
    _BUILT.clear()


def _inspect(docker: str, ref: str) -> dict[str, Any]:
    done = _run([docker, "image", "inspect", ref])
    assert done.returncode == 0, done.stderr
    info: dict[str, Any] = json.loads(done.stdout)[0]
    return info


@pytest.fixture(scope="module")
def built(docker: str, base: str, extra_ca: str) -> dict[str, str]:
    """Each Dockerfile built with `DOCKER_BUILDKIT=1 docker build` from the repository root:
    name -> image id."""
    ids = {}
    for name, dockerfile in DOCKERFILES.items():
        done = _build(docker, dockerfile, base, extra_ca)
        assert done.returncode == 0, (
            f"DOCKER_BUILDKIT=1 docker build -f {dockerfile} . failed:\n{done.stderr[-4000:]}"
        )
        ids[name] = done.stdout.strip().splitlines()[-1]
    return ids


def test_every_dockerfile_builds_with_buildkit_from_the_repository_root(
    docker: str, built: dict[str, str]
) -> None:
    deployment = yaml.safe_load((REPO / "manifests" / "deployment.yaml").read_text())
    manifest_uid = str(deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"])
    for name, image_id in built.items():
        config = _inspect(docker, image_id)["Config"]
        # Non-root by default, as the uid the operator's manifest runs it as (kopf needs it named).
        assert config["User"] == manifest_uid, name
        assert config["Entrypoint"] == ENTRYPOINTS[name]
        assert config["Healthcheck"]["Test"] == ["CMD", "tangram-healthcheck"]


def test_every_dockerfile_builds_with_the_legacy_builder(docker: str, base: str, extra_ca: str) -> None:
    for name, dockerfile in DOCKERFILES.items():
        done = _build(docker, dockerfile, base, extra_ca, buildkit=False)
        assert done.returncode == 0, (
            f"DOCKER_BUILDKIT=0 docker build -f {dockerfile} . failed:\n{done.stderr[-4000:]}"
        )
        built = re.findall(r"^Successfully built ([0-9a-f]+)$", done.stdout, re.M)
        assert built, done.stdout[-2000:]
        assert _inspect(docker, built[-1])["Config"]["Entrypoint"] == ENTRYPOINTS[name]


def test_the_dockerfiles_share_one_default_base() -> None:
    """hack/images.sh reads the official base from the sandbox's Dockerfile: the others must agree."""
    defaults = {
        name: re.findall(r"^ARG BASE_IMAGE=(\S+)$", (REPO / path).read_text(), re.M)
        for name, path in DOCKERFILES.items()
    }
    assert len({tuple(d) for d in defaults.values()}) == 1 and len(defaults["sandbox"]) == 1, defaults


def _in_image(docker: str, image: str, script: str) -> str:
    done = _run([docker, "run", "--rm", "--entrypoint", "sh", image, "-c", script], timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_images_are_lean_and_keep_no_build_tools_or_extra_certificates(
    docker: str, built: dict[str, str], extra_ca: str, base: str, tmp_path: Path
) -> None:
    # The build stages' tools stay there: npm (which fetched esbuild) in no image, no compiler in the
    # operator's or the reward runtime's (the sandbox keeps gcc and g++: they are its C and C++).
    for name, image_id in built.items():
        found = _in_image(
            docker,
            image_id,
            "for t in npm gcc g++ esbuild; do command -v $t >/dev/null && echo $t; done; true",
        )
        expected = {"sandbox": {"gcc", "g++", "esbuild"}}.get(name, set())
        assert set(found.split()) == expected, (name, found)
    ca = extra_ca
    if not ca:
        # No extra CA on this host: make one, so that the check below still has something to find.
        key, crt = tmp_path / "ca.key", tmp_path / "ca.crt"
        done = _run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(crt), "-subj", "/CN=tangram-test-proxy-ca", "-days", "1"],
            timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        ca = crt.read_text()
        done = _build(docker, DOCKERFILES["operator"], base, ca)
        assert done.returncode == 0, done.stderr[-4000:]
        built = {"operator": done.stdout.strip().splitlines()[-1]}
    bodies = [
        b.replace("\n", "") for b in re.findall(r"-----BEGIN CERTIFICATE-----\n(.*?)\n-----END", ca, re.S)
    ]
    assert bodies
    for name, image_id in built.items():
        history = _run([docker, "history", "--no-trunc", "--format", "{{.CreatedBy}}", image_id]).stdout
        assert "BEGIN CERTIFICATE" not in history, name
        trusted = _in_image(
            docker, image_id, "cat /etc/ssl/certs/ca-certificates.crt; ls /usr/local/share/ca-certificates"
        )
        flat = trusted.replace("\n", "")
        assert not any(b[:200] in flat for b in bodies), f"{name} holds the build's extra CA"


# ---- the sandbox image running ---------------------------------------------------------------------


@contextlib.contextmanager
def _container(docker: str, args: list[str]) -> Iterator[str]:
    done = _run([docker, "run", "-d", *args], timeout=120)
    assert done.returncode == 0, done.stderr
    cid = done.stdout.strip()
    try:
        yield cid
    finally:
        logs = _run([docker, "logs", cid], timeout=60)
        _run([docker, "rm", "-f", cid], timeout=60)
        print(logs.stdout[-3000:], logs.stderr[-3000:])


def _ip(docker: str, cid: str) -> str:
    info = json.loads(_run([docker, "inspect", cid]).stdout)[0]
    ip: str = info["NetworkSettings"]["IPAddress"]
    assert ip, "the container has an address on the engine's bridge"
    return ip


def _wait_health(docker: str, cid: str, status: str, timeout: float = 120) -> dict[str, Any]:
    """The container's state once Docker's own health check (the image's HEALTHCHECK) says ``status``."""
    deadline = time.monotonic() + timeout
    while True:
        state: dict[str, Any] = json.loads(_run([docker, "inspect", cid]).stdout)[0]["State"]
        if (state.get("Health") or {}).get("Status") == status:
            return state
        assert state["Running"], f"the container stopped: {state}"
        assert time.monotonic() < deadline, f"health never became {status!r}: {state.get('Health')}"
        time.sleep(0.5)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with NO_PROXY.open(req, timeout=120) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def _get(url: str) -> dict[str, Any]:
    with NO_PROXY.open(url, timeout=30) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def _gateway(docker: str, cid: str) -> str:
    """The engine's bridge address, as the container sees it: the host, from outside."""
    info = json.loads(_run([docker, "inspect", cid]).stdout)[0]
    gw: str = info["NetworkSettings"]["Gateway"]
    return gw


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP server on every address of this host: what an action must not reach."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen(16)
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = srv.accept()
                conn.sendall(b"host\n")
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        srv.close()


def _reach(host: str, port: int) -> str:
    return (
        "import socket\n"
        "try:\n"
        f"    print(socket.create_connection(({host!r}, {port}), timeout=3).recv(16).decode().strip())\n"
        "except OSError as e:\n"
        "    print('unreachable', type(e).__name__)\n"
    )


def test_the_sandbox_image_serves_run_code_with_actions_isolated(
    docker: str, built: dict[str, str], listener: int
) -> None:
    port = 9123  # not the default 8080: the health check must follow --listen
    caps = [arg for cap in FULL_ISOLATION_CAPS for arg in ("--cap-add", cap)]
    args = ["--user", "0", "--cap-drop", "ALL", *caps, "-e", f"TANGRAM_AGENT_TOKEN={TOKEN}", built["sandbox"],
            "--listen", f"0.0.0.0:{port}", "--workdir-root", "/var/lib/tangram/work"]  # fmt: skip
    with _container(docker, args) as cid:
        _wait_health(docker, cid, "healthy")
        url = f"http://{_ip(docker, cid)}:{port}"
        gateway = _gateway(docker, cid)
        # The agent itself (the container's network) reaches the host: the control for the action below.
        control = _run([docker, "exec", cid, "python", "-c", _reach(gateway, listener)], timeout=60)
        assert control.stdout.strip() == "host", control

        # The agent wants its token; /v1/health lists what it found, /run_code speaks SandboxFusion.
        with pytest.raises(urllib.error.HTTPError) as refused:
            _post(f"{url}/run_code", {"code": "print(1)", "language": "python"})
        assert refused.value.code == 401
        health = _get_with_token(f"{url}/v1/health")
        iso = health["isolation"]
        assert (
            iso["per_action_uid"] and iso["pid_namespace"] and iso["private_tmp"] and iso["netns_per_action"]
        ), iso
        assert iso["fork_loop"] == "c" and iso["notes"] == [], iso
        assert iso["own_ipc"], iso
        assert set(health["languages"]["found"]) >= LANGUAGES, health["languages"]["missing"]

        probe = (
            "import os, pathlib\n"
            "import numpy, pandas, scipy, sklearn, sympy, networkx, matplotlib, PIL\n"
            "import regex, sortedcontainers, more_itertools, dateutil, pytz, tqdm\n"
            "print('uid', os.getuid())\n"
            # Its own environment is scrubbed, and no other process's (the agent's) is readable.
            "seen = [str(os.environ)]\n"
            "for p in pathlib.Path('/proc').glob('[0-9]*/environ'):\n"
            "    try:\n"
            "        seen.append(p.read_bytes().decode(errors='replace'))\n"
            "    except OSError:\n"
            "        pass\n"
            f"print('token', any({TOKEN!r} in s for s in seen))\n"
            "print('pid', os.getpid())\n"
            "pathlib.Path('/tmp/left-behind').write_text('x')\n"
            "print('sum', int(numpy.arange(101).sum()), sympy.factorint(360))\n"
        ) + _reach(gateway, listener)
        out = _run_code(url, {"code": probe, "language": "python"})
        lines = out["run_result"]["stdout"].splitlines()
        assert out["status"] == "Success", out
        uid = int(lines[0].split()[1])
        assert uid != 0 and uid != 65532, lines  # a uid of its own, neither root nor the agent's user
        assert lines[1] == "token False", "the agent's token is out of the action's reach"
        # A PID namespace of its own: the program is its second process (after the agent's init).
        assert lines[2] == "pid 2", lines
        assert lines[3] == "sum 5050 {2: 3, 3: 2, 5: 1}"
        assert lines[4].startswith("unreachable"), "no network for actions"
        again = _run_code(url, {"code": "import os; print(os.listdir('/tmp'))", "language": "python"})
        assert again["run_result"]["stdout"].strip() == "[]", "each action gets its own /tmp"
        # The container's /dev/mqueue (the runtime mounts it, mode 1777) is the agent's IPC
        # namespace's: a queue made there by path would be every action's. It is covered.
        mqueue = (
            "import os\ntry:\n    os.close(os.open('/dev/mqueue/q', os.O_CREAT | os.O_RDWR, 0o666))\n"
            "    print('made')\nexcept OSError as e:\n    print(type(e).__name__)\n"
        )
        made = _run_code(url, {"code": mqueue, "language": "python"})
        assert made["run_result"]["stdout"].strip() != "made", made

        # A compiled language of the image, through SandboxFusion's compile step.
        cpp = _run_code(
            url, {"code": '#include <cstdio>\nint main(){std::printf("%d\\n", 6*7);}', "language": "cpp"}
        )
        assert cpp["compile_result"]["return_code"] == 0 and cpp["run_result"]["stdout"] == "42\n", cpp
        ts = _run_code(url, {"code": "const n: number = 41; console.log(n + 1)", "language": "typescript"})
        assert ts["run_result"]["stdout"] == "42\n", ts
        # SandboxFusion's notebooks: a kernel of the image's Python, its plots inline.
        plot = "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()"
        notebook = _run_code(url, {"cells": ["n = 41", "n + 1", plot]}, "/run_jupyter")
        assert notebook["status"] == "Success", notebook
        assert notebook["cells"][1]["display"][0]["text/plain"] == "42", notebook
        assert "image/png" in notebook["cells"][2]["display"][0], notebook
        # pytest-mock's `mocker`, as SandboxFusion's image has it.
        mocked = _run_code(url, {"code": MOCKER_TEST, "language": "pytest"})
        assert mocked["status"] == "Success", mocked
        # SandboxFusion's versions and libraries: numpy 1.26's scalars, pytest 7 (an async test with
        # no plugin is skipped, not failed), bc, Boost's headers, R's recommended packages.
        scalar = "import numpy as np\nprint(repr(np.float64(2.0)))"
        numpy = _run_code(url, {"code": scalar, "language": "python"})
        assert numpy["run_result"]["stdout"] == "2.0\n", numpy
        skipped = _run_code(url, {"code": "async def test_x():\n    assert 1 == 2\n", "language": "pytest"})
        assert skipped["status"] == "Success", skipped
        bc = _run_code(url, {"code": 'echo "scale=2; 10/3" | bc', "language": "bash"})
        assert bc["run_result"]["stdout"] == "3.33\n", bc
        boost = _run_code(url, {"code": BOOST_PROGRAM, "language": "cpp"})
        assert boost["run_result"]["stdout"] == "1" + "0" * 30 + "\n", boost
        mass = _run_code(url, {"code": "library(MASS)\ncat('ok\\n')", "language": "R"})
        assert mass["run_result"]["stdout"] == "ok\n", mass


TOKEN_HEADERS = {"Authorization": f"Bearer {TOKEN}"}
MOCKER_TEST = "def test_mocked(mocker):\n    assert mocker.Mock(return_value=3)() == 3\n"
BOOST_PROGRAM = (
    "#include <boost/multiprecision/cpp_int.hpp>\n#include <iostream>\n"
    "int main() { boost::multiprecision::cpp_int x = 1; for (int i = 0; i < 30; i++) x *= 10;\n"
    "  std::cout << x << std::endl; }\n"
)


def _get_with_token(url: str) -> dict[str, Any]:
    req = urllib.request.Request(url, headers=TOKEN_HEADERS)
    with NO_PROXY.open(req, timeout=30) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def _run_code(url: str, body: dict[str, Any], path: str = "/run_code") -> dict[str, Any]:
    req = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **TOKEN_HEADERS},
    )
    with NO_PROXY.open(req, timeout=120) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def test_the_sandbox_image_runs_unprivileged_by_default(docker: str, built: dict[str, str]) -> None:
    """No --user, no capabilities: the image's own user, the fallbacks, and still a working /run_code."""
    with _container(docker, [built["sandbox"]]) as cid:
        _wait_health(docker, cid, "healthy")
        url = f"http://{_ip(docker, cid)}:8080"
        health = _get(f"{url}/v1/health")
        assert health["isolation"]["per_action_uid"] is False
        out = _post(f"{url}/run_code", {"code": "import os; print(os.getuid())", "language": "python"})
        assert out["run_result"]["stdout"].strip() == "65532", out


def test_the_health_check_fails_where_the_agent_does_not_answer(docker: str, built: dict[str, str]) -> None:
    """The agent listens on loopback only: Docker's health check (from inside) still reaches it, and
    turns unhealthy once the agent stops answering (its process stopped with SIGSTOP)."""
    with _container(docker, [built["sandbox"], "--listen", "127.0.0.1:7001"]) as cid:
        _wait_health(docker, cid, "healthy")
        assert _run([docker, "kill", "--signal", "STOP", cid], timeout=60).returncode == 0
        _wait_health(docker, cid, "unhealthy", timeout=180)


def test_the_build_fails_loudly_when_the_fork_loop_does_not_build(
    docker: str, base: str, extra_ca: str, tmp_path: Path
) -> None:
    """The package installs without its C fork loop on purpose (setup.py: optional); the image must
    not: a broken build is an error that shows the compiler's message, unless FORK_LOOP=python."""
    context = tmp_path / "context"
    context.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", ".dockerignore"):
        shutil.copy(REPO / name, context / name)
    shutil.copytree(
        REPO / "operator", context / "operator", ignore=shutil.ignore_patterns("__pycache__", "*.so")
    )
    (context / "hack" / "images").mkdir(parents=True)
    shutil.copy(REPO / "hack" / "images" / "healthcheck.py", context / "hack" / "images" / "healthcheck.py")
    zygote = context / "operator" / "arl_tangram" / "sandbox" / "_zygote.c"
    zygote.write_text("#include <no_such_header_for_this_test.h>\n" + zygote.read_text())
    dockerfile = str(REPO / DOCKERFILES["sandbox"])
    failed = _build(
        docker, dockerfile, base, extra_ca, context=context, extra=("--target", "build"), quiet=False
    )
    assert failed.returncode != 0
    assert "the zygote's C fork loop (operator/arl_tangram/sandbox/_zygote.c) did not build" in failed.stderr
    assert "no_such_header_for_this_test.h: No such file or directory" in failed.stderr
    accepted = _build(
        docker,
        dockerfile,
        base,
        extra_ca,
        context=context,
        extra=("--target", "build", "--build-arg", "FORK_LOOP=python"),
    )
    assert accepted.returncode == 0, accepted.stderr[-3000:]


# ---- the health check's reading of a command line (no Docker needed) --------------------------------


def _healthcheck_module() -> Any:
    spec = importlib.util.spec_from_file_location("healthcheck", REPO / "hack" / "images" / "healthcheck.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("command", "args", "env", "expected"),
    [
        ("sandbox-agent", ["--listen", "0.0.0.0:9123", "--cores", "0-1"], {}, ("0.0.0.0", 9123)),
        ("sandbox-agent", ["--listen=10.88.1.7:8080"], {}, ("10.88.1.7", 8080)),
        ("sandbox-agent", ["--cores", "0"], {}, ("", 8080)),
        ("reward-runtime", ["--config", "x.yaml", "--listen", "0.0.0.0:8000"], {}, ("0.0.0.0", 8000)),
        ("reward-runtime", [], {}, ("", 8000)),
        ("operator", [], {"TANGRAM_LISTEN_PORT": "9444"}, ("", 9444)),
        ("operator", [], {}, ("", 8080)),
    ],
)
def test_the_health_check_asks_the_address_the_server_listens_on(
    command: str,
    args: list[str],
    env: dict[str, str],
    expected: tuple[str, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = _healthcheck_module()
    monkeypatch.delenv("TANGRAM_LISTEN_PORT", raising=False)
    monkeypatch.delenv("TANGRAM_LISTEN_HOST", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert module.address(command, args) == expected


def test_the_made_base_is_cached_between_runs(docker: str, base: str) -> None:
    """A second `hack/images.sh base` finds what the first made (or the official image) at once."""
    if not base.startswith("arl-tangram-base/"):
        pytest.skip(f"the official base {base} is in use here: nothing is made")
    again = _images_sh_run("base")
    assert again.stdout.strip() == base
    # Nothing made again: no debootstrap, no import, no Python layer built.
    made = re.search(r"^images: (debootstrap --variant|imported |made )", again.stderr, re.M)
    assert made is None, again.stderr
    cache = Path(
        os.environ.get("IMAGES_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "arl-tangram" / "images"
    )
    assert list(cache.glob("debian-*-minbase-*.tar")), f"the root filesystem's tarball is kept in {cache}"
